"""`attnkit distances RUN` as a job: the Jensen-Shannon divergences between all heads of a run's model, over the
run's corpus (read again, checked to be the same bytes), on this machine or on a Ray cluster, saved to
RUN/distances.npz (docs/analysis.md; the file: docs/files.md, "distances.npz"); an encoder–decoder's, over its
(source, target) pairs, within each kind, to RUN/distances_KIND.npz (docs/seq2seq.md §9).

The job reports stage messages through `echo(text, err=False)` and returns what the command line prints.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..corpus import Corpus
from ..engine.distances import check_smoothing, collect_distances
from ..engine.extract import ExtractSettings
from ..engine.local import default_workers
from ..errors import AttnkitError, print_message
from ..features import DEFAULT_MAX_LENGTH, DEFAULT_NUM_WINDOWS, weighting_of
from ..models import attention_modules, load_model
from ..run.distances import HeadDistances
from ..run.files import REPORT_FILE
from ..run.identity import IDENTITY_FIELD, model_identity, model_mismatch, recorded_identity
from ..run.locking import output_directory
from ..run.opened import Run, open_run
from ..run.outputs import os_errors
from ..run.overwrite import claim_outputs
from .job_options import DistancesOptions, check_distances_options, distances_inputs, distances_outputs


def _check_shape(run, meta: dict, n_layers: int, n_heads: int) -> None:
    want = (meta.get("n_layers", n_layers), meta.get("n_heads", n_heads))
    if (n_layers, n_heads) != want:
        raise AttnkitError(f"the model has {n_layers} × {n_heads} heads but {run} was measured "
                           f"with {want[0]} × {want[1]}")


def _run_model_name(meta: dict):
    """The model's name as the run recorded it (its `model_identity`), so that both identities name it alike."""
    ident = meta.get(IDENTITY_FIELD)
    return ident.get("name") if isinstance(ident, dict) else meta.get("model") or None


def _check_model(run, meta: dict, identity: dict) -> dict:
    """`identity` (of the model just loaded), after checking that it is the model the run measured (the one
    comparison, attnkit/run/identity.py): a model directory replaced since `extract` is refused."""
    why = model_mismatch(recorded_identity(meta, meta.get("n_layers"), meta.get("n_heads")),
                         {**identity, "partial": False})
    if why:
        raise AttnkitError(f"the model loaded for {run} is not the one it measured: {why}")
    return identity


def run_distances_job(opts: DistancesOptions, echo: Callable[..., None] = print_message,
                      read: tuple[Run, Corpus] | None = None) -> tuple[HeadDistances | dict, int, Path]:
    """Measure and save the distances of `opts.run`; returns (the distances, the segments measured, the path
    written); for an encoder–decoder's run ({kind: the distances}, the segments, the first path written). Earlier
    distances are replaced only with `opts.overwrite` (the report drawn from them goes with
    them; what was removed is said through `echo`). `read`: (the run, its corpus) as the command read them before
    (`preflight_distances`), used as they are; None reads them here, once."""
    check_distances_options(opts)  # also checked by the command line before torch loads
    check_smoothing(opts.smooth)

    def say(text: str) -> None:
        if not opts.quiet:
            echo(text, err=True)

    run = Path(opts.run)
    command = "attnkit distances" + (" --engine ray" if opts.engine == "ray" else "")
    with output_directory(run, command, inputs=[("the corpus", opts.corpus, True)]), \
            os_errors(f"write into {run}"):
        if read is None:
            opened = open_run(run)
            texts = distances_inputs(opts, opened.features.meta)
        else:
            opened, texts = read
        run_feats = opened.features
        meta = run_feats.meta
        claim = claim_outputs(distances_outputs(run, run_feats), opts.overwrite, stale=[run / REPORT_FILE])
        if weighting_of(meta) == "norm":
            say(f"attnkit distances: {run} holds norm-weighted features; the distances compare attention weights")
        max_length = int(meta.get("max_length", DEFAULT_MAX_LENGTH))
        num_windows = int(meta.get("num_windows", DEFAULT_NUM_WINDOWS))
        if opts.engine == "ray":
            dist, n_samples = _on_ray(run, meta, texts, opts, max_length, num_windows, say)
        else:
            say(f"attnkit distances: loading the model of {run}")
            model = load_model(meta.get("model") or None, device=opts.device, max_length=max_length)
            _check_shape(run, meta, len(attention_modules(model[0])), int(model[0].config.num_attention_heads))
            identity = _check_model(run, meta, model_identity(model[0], _run_model_name(meta)))
            say(f"attnkit distances: {texts.summary()}; "
                f"{len(attention_modules(model[0])) * model[0].config.num_attention_heads} heads")
            workers = default_workers(next(model[0].parameters()).device.type)
            feats, dist = collect_distances(texts, model, workers=workers, rows_per_sample=opts.rows_per_sample,
                                            seed=opts.seed, smoothing=opts.smooth, max_length=max_length,
                                            batch_size=opts.batch_size, num_windows=num_windows,
                                            progress=not opts.quiet)
            n_samples = feats.n_samples
        if opts.engine == "ray":  # the actors loaded the run's model (meta.json `model`), checked by its shape
            identity = meta.get(IDENTITY_FIELD)
        # which model and corpus the sums come from: the report shows them only beside the heads of that run
        # (the run's own inputs were read again and checked to be its bytes, `corpus_of_run`: the run's corpus, even
        # with another --limit; a corpus given with --corpus is named by its own fingerprint, its limit included)
        corpus = (meta.get("settings") or {}).get("corpus_sha256") if opts.corpus is None else None
        provenance = {IDENTITY_FIELD: identity, "corpus_sha256": corpus or texts.fingerprint()}
        path = _save(run, dist, run_feats, provenance)
        if opts.engine == "ray":
            from ..run.shards import remove_shards

            remove_shards(run, "distances")
        claim.remove_stale()
    if claim.removed_message():
        echo(claim.removed_message(), err=True)
    return dist, n_samples, path


def _save(run: Path, dist: HeadDistances | dict, run_feats, provenance: dict) -> Path:
    """Save `dist` (an encoder–decoder's: {kind: HeadDistances}, each into its own file) with `provenance` and the
    heads removed by pruning, which have no attention: their distances are left out (docs/pruning.md). Returns the
    (first) path written."""
    removed = np.argwhere(run_feats.removed)
    if not isinstance(dist, dict):
        dist.meta.update(provenance)
        if len(removed):
            dist.meta["removed_heads"] = [[int(l), int(h)] for l, h in removed]
        return dist.save(run)
    kinds = run_feats.layer_kinds  # a removed head's layer numbered within its kind, as the kind's matrix is
    paths = []
    for kind, d in dist.items():
        d.meta.update(provenance)
        gone = [[kinds[l][1], int(h)] for l, h in removed if kinds[l][0] == kind]
        if gone:
            d.meta["removed_heads"] = gone
        paths.append(d.save(run))
    return paths[0]


def _on_ray(run, meta, texts, opts: DistancesOptions, max_length: int, num_windows: int, say):
    """The same sums, measured by model actors on a Ray cluster; resumable by shards (RUN/distance-shards)."""
    from ..engine.ray import run_ray_distances

    settings = {"corpus_sha256": texts.fingerprint(), "model": meta.get("model"), "max_length": max_length,
                "batch_size": opts.batch_size, "rows_per_sample": opts.rows_per_sample, "seed": opts.seed}
    say(f"attnkit distances (ray): {texts.summary()}")
    dist, info = run_ray_distances(
        texts, ExtractSettings(max_length=max_length, batch_size=opts.batch_size, num_windows=num_windows),
        run_dir=run, run_settings=settings, rows_per_sample=opts.rows_per_sample, seed=opts.seed,
        model_path=meta.get("model") or None, address=opts.ray_address, progress=not opts.quiet)
    _check_shape(run, meta, dist.n_layers, dist.n_heads)
    return dist, info["n_samples"]


__all__ = ["DistancesOptions", "run_distances_job"]
