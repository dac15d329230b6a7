"""`attnkit cluster` and `attnkit report` as jobs on a run directory: hold its lock, read and check what they
need, write RUN/clusters.json or RUN/report.html (docs/analysis.md; the files: docs/files.md).

They report stage messages through `echo(text, err=False)` and return what the command line prints; they
never import click.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import AttnkitError, check_int, print_message
from ..run.files import CLUSTERS_FILE, FIGURES_DIR, REPORT_FILE
from ..run.head_features import HeadFeatures
from ..run.locking import output_directory
from ..run.model_dir import is_decoder_meta
from ..run.opened import Run
from ..run.outputs import ensure_writable_dir, os_errors
from ..run.overwrite import claim_outputs
from .attached import find_attached
from .clustering import HeadClusterer, fit_types
from .head_panel import unverifiable_corpus
from .naming import cluster_features
from .preflight import load_run
from .report import (
    DEFAULT_EXAMPLES,
    build_report,
    examples_problem,
    report_figures,
)
from .results import save_clusters

EXAMPLE_POOL = 500  # the example inputs are the shortest of the corpus's first EXAMPLE_POOL segments


@dataclass
class Clustering:
    """What `cluster_run` found and wrote: the fitted clusterer, the stability over seeds (None: one seed),
    the k sweep (None: not asked for), the run's features and the path of clusters.json."""

    clusterer: HeadClusterer
    over_seeds: dict | None
    sweep: list | None
    features: HeadFeatures
    path: Path


def cluster_run(run, *, k: int | None = None, method: str = "kmeans", features: str | None = None,
                standardize: bool = False, seed: int = 0, n_stability: int = 10, do_sweep: bool = False,
                n_seeds: int = 10, quiet: bool = False, overwrite: bool = False,
                echo: Callable[..., None] = print_message, feats: HeadFeatures | None = None) -> Clustering:
    """Group the heads of `run` into types and write RUN/clusters.json (the arguments as `attnkit.cluster`'s;
    `n_seeds` > 1 repeats the stability measure with that many seeds, `do_sweep` adds k = 2..8; the sweep is
    also made when the types at `k` are not stable, to say which k is; `k` None chooses the most stable k,
    `fit_types`). An earlier clusters.json is replaced
    only with `overwrite` (the report drawn from it goes with it). `feats`: the run's features as the command read
    them before (preflight); None reads them here, once."""
    run = Path(run)
    for value, name in ((k, "k"), (seed, "seed"), (n_stability, "n_stability"), (n_seeds, "n_seeds")):
        if value is not None:
            check_int(value, name)  # before the lock and the first fit
    with output_directory(run, "attnkit cluster"), os_errors(f"write into {run}"):
        feats = feats or HeadFeatures.load(run)
        cluster_features(feats.names, features, decoder=is_decoder_meta(feats.meta))  # a bad feature name: at once
        claim = claim_outputs([run / CLUSTERS_FILE], overwrite, stale=[run / REPORT_FILE])
        if not quiet:
            echo(f"attnkit cluster: {feats.n_layers} × {feats.n_heads} heads of {run}, {method}, "
                 f"{'k chosen by stability' if k is None else f'k = {k}'}, "
                 f"{n_stability} stability fits", err=True)
        c, over, rows = fit_types(feats, k=k, n_seeds=n_stability and n_seeds, do_sweep=do_sweep or None,
                                  progress=not quiet, method=method, features_subset=features,
                                  standardize=standardize, seed=seed, n_stability=n_stability)
        path = save_clusters(run, c, feats, rows, over)
        claim.remove_stale()
    if claim.removed_message():
        echo(claim.removed_message(), err=True)
    return Clustering(c, over, rows, feats, path)


def report_run(run, *, examples: int | None = None, include=(), corpus=None, fmt: str = "auto",
               squad_pairs: bool = False, columns=None, limit: int | None = None, k: int | None = None,
               method: str = "kmeans", seed: int = 0, device=None, svg: bool = True, quiet: bool = False,
               overwrite: bool = False, echo: Callable[..., None] = print_message, opened: Run | None = None) -> Path:
    """Write RUN/report.html (`build_report`) after checking, before drawing anything, every file it reads;
    `examples` embeds the maps of that many short inputs of the run's corpus (or `corpus`), made with the run's
    model (None: DEFAULT_EXAMPLES when the run records its model and corpus and both can be read, else none, with
    a note; 0: none); `include` names directories of probe or ablation results to show. An earlier report (and
    its figures) is replaced only with `overwrite`. `opened`: the run as the command read it before (preflight), used
    as it is; None reads it here, once."""
    run = Path(run)
    wanted = examples is not None
    examples = DEFAULT_EXAMPLES if examples is None else examples
    check_int(examples, "examples")
    check_int(seed, "seed")

    def say(text: str) -> None:
        if not quiet:
            echo(text, err=True)

    inputs = [("the corpus", corpus, True)]  # only read; the run is where the report goes
    with output_directory(run, "attnkit report", inputs=inputs), os_errors(f"write the report into {run}"):
        opened = opened or load_run(run)  # what the command read before the lock, or the run read now, once
        feats = opened.features
        claim = claim_outputs([run / REPORT_FILE] + report_figures(run), overwrite)
        shape = opened.shape
        # a damaged distances, patterns, probe, ablation or detection file is named now
        attached = find_attached(run, shape, include, feats)
        damaged = examples_problem(run, feats)
        if damaged:  # a warning, shown even with quiet
            echo(f"attnkit report: {damaged}", err=True)
        ensure_writable_dir(run / FIGURES_DIR, "figures directory")
        texts = model = None
        if examples:
            texts, model = _example_sources(run, feats, wanted, say, corpus=corpus, fmt=fmt, squad_pairs=squad_pairs,
                                            columns=columns, limit=limit, device=device)
        say(f"attnkit report: {shape[0]} × {shape[1]} heads of {run}")
        path = build_report(run, k=k, method=method, seed=seed, examples=examples if model else 0, texts=texts,
                            model=model, svg=svg, progress=not quiet, include=include, opened=opened,
                            attached=attached)
    if claim.removed_message():
        echo(claim.removed_message(), err=True)
    return path


def _example_sources(run: Path, feats: HeadFeatures, wanted: bool, say, *, corpus, fmt, squad_pairs, columns, limit,
                     device) -> tuple:
    """(the first EXAMPLE_POOL texts of the run's corpus, (model, tokenizer)) for the example inputs. When they were
    not asked for (`wanted` False: the default), a run that records no model, no corpus with the SHA-256 of its
    inputs (`unverifiable_corpus`), or whose model or corpus cannot be read, gets none, with a note; when asked
    for, that is an error."""
    from ..corpus import corpus_of_run
    from ..corpus.images import images_of_run, is_image_run
    from ..models import load_model

    name = feats.meta.get("model") or None
    try:
        if not wanted and name is None:
            raise AttnkitError("the run records no model")
        if feats.kinds is not None:
            raise AttnkitError("the run is an encoder–decoder's, whose example maps over (source, target) pairs "
                               "are not drawn yet")
        if is_image_run(feats.meta) and corpus is None:  # one of its images, for the [CLS] maps
            images = list(itertools.islice(images_of_run(run, feats.meta, limit=1), 1))
            say(f"attnkit report: loading the model of {run} for the [CLS] maps of {images[0].name}")
            return images, load_model(name, device=device)
        if not wanted and corpus is None and unverifiable_corpus(feats.meta):
            raise AttnkitError(unverifiable_corpus(feats.meta))
        texts = list(itertools.islice(corpus_of_run(run, feats.meta, corpus, fmt, squad_pairs=squad_pairs,
                                                    columns=columns, limit=limit), EXAMPLE_POOL))
        if not texts:
            raise AttnkitError("the run's corpus holds no text")
        say(f"attnkit report: loading the model of {run} for the example inputs")
        return texts, load_model(name, device=device)
    except AttnkitError as exc:
        if wanted:
            raise
        what = "[CLS] maps" if is_image_run(feats.meta) else "example inputs"
        say(f"attnkit report: no {what} ({exc}); give --examples 0 to skip them quietly")
        return None, None


__all__ = ["Clustering", "cluster_run", "report_run"]
