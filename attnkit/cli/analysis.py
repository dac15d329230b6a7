"""Click commands of the analysis: `cluster`, `distances`, `report`, `compare`.

They are plain `@click.command()`s; attnkit/cli.py adds them to the `attnkit` group with
`main.add_command(...)`. `python -m attnkit.analysis ...` runs them without the main CLI.
"""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import click

from ..corpus import FORMATS
from ..errors import AttnkitError, cli_errors

RUN = click.Path(exists=True, file_okay=False, path_type=Path)
SEED = click.IntRange(0, 2**32 - 1)  # what scikit-learn accepts as random_state

quiet_option = click.option("-q", "--quiet", is_flag=True,
                            help="No progress bars or stage messages on stderr (results are still printed).")
k_option = click.option("-k", "--k", "k", default=4, show_default=True, type=click.IntRange(min=2),
                        help="Number of head types (clusters).")


def _say(quiet: bool, message: str) -> None:
    """A stage message on stderr (so stdout keeps only results)."""
    if not quiet:
        click.echo(message, err=True)


def _run_shape(run: Path) -> tuple[int, int] | None:
    """(n_layers, n_heads) of the run in `run`, or None when it holds no features.npz."""
    from ..run.head_features import FEATURES_FILE, HeadFeatures

    if not (run / FEATURES_FILE).is_file():
        return None
    f = HeadFeatures.load(run)
    return f.n_layers, f.n_heads


def _corpus_from_run(run: Path, corpus, fmt, squad_pairs, columns, limit):
    """The corpus of a run: --corpus, else the inputs recorded in meta.json (read as the run read them).
    Returns (a streamed attnkit.corpus.Corpus, the run's meta)."""
    from ..corpus import open_corpus
    from ..run.head_features import HeadFeatures

    text_unit = "auto"
    meta = HeadFeatures.load(run).meta
    corpus_given = corpus
    if corpus is None:
        reading = (meta.get("settings") or {}).get("reading")
        if isinstance(reading, dict) and reading.get("paths"):
            paths = reading["paths"]
            fmt, text_unit = reading.get("format") or "auto", reading.get("text_unit") or "auto"
            columns, squad_pairs = columns or reading.get("columns"), bool(reading.get("squad_pairs"))
        else:  # runs written before several inputs were possible
            paths = [meta.get("corpus")]
            fmt = meta.get("format", fmt) or fmt
            squad_pairs = bool(meta.get("squad_pairs", squad_pairs))
            columns = columns or meta.get("columns")
            text_unit = meta.get("text_unit", "auto")
        missing = [p for p in paths if not p or p == "-" or not Path(p).exists()]
        if missing:
            raise AttnkitError(f"{run}/meta.json names no readable corpus ({missing[0]!r}): pass --corpus PATH")
        corpus = paths
        limit = limit or meta.get("n_segments")
    if isinstance(columns, str):
        columns = tuple(c.strip() for c in columns.split(",") if c.strip())
    texts = open_corpus(corpus, fmt, text_unit=text_unit, squad_pairs=squad_pairs, columns=columns, limit=limit)
    if corpus_given is None:
        _check_same_inputs(run, meta, texts)
    return texts, meta


def _check_same_inputs(run: Path, meta: dict, texts) -> None:
    """The run's inputs, read again, must be the bytes it measured (meta.json keeps their SHA-256): numbers
    from an edited corpus would be saved into the run as if they belonged to it."""
    recorded = meta.get("inputs")
    if not isinstance(recorded, list) or len(recorded) != len(texts.sources):
        return  # runs written before inputs were recorded: nothing to compare with
    for source, rec in zip(texts.sources, recorded):
        want = rec.get("sha256") if isinstance(rec, dict) else None
        if want and source.sha256() != want:
            raise AttnkitError(f"{source.name} changed since {run} was measured (its SHA-256 differs from "
                               f"meta.json's): extract again, or pass the corpus with --corpus")


_corpus_options = [
    click.option("--corpus", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
                 help="Corpus file [default: the one recorded in RUN/meta.json]."),
    click.option("--format", "fmt", type=click.Choice(list(FORMATS)), default="auto",
                 show_default=True, help="Corpus format (auto: by extension)."),
    click.option("--squad-pairs", is_flag=True, help="SQuAD JSON: (question, context) pairs instead of contexts."),
    click.option("--columns", default=None, metavar="COL[,COL2]", help="TSV/CSV text column(s)."),
    click.option("--limit", type=click.IntRange(min=1), default=None,
                 help="Use only the first N segments (as `attnkit extract --limit`)."),
]


def _with(options):
    def deco(fn):
        for opt in reversed(options):
            fn = opt(fn)
        return fn
    return deco


@click.command("cluster")
@click.argument("run", type=RUN)
@k_option
@click.option("--method", type=click.Choice(["kmeans", "gmm"]), default="kmeans", show_default=True,
              help="scikit-learn KMeans or GaussianMixture.")
@click.option("--features", default=None, metavar="NAMES",
              help="Comma-separated features to cluster on, or 'all' [default: the distance buckets cls, sep, "
                   "comma, period, self, win_0..win_N-1 (Guan et al.'s 21-dim distance feature)].")
@click.option("--standardize/--no-standardize", default=False, show_default=True,
              help="Scale every feature to unit variance first.")
@click.option("--seed", default=0, show_default=True, type=SEED, help="Random seed (fits and stability subsets).")
@click.option("--stability", "n_stability", default=10, show_default=True, type=click.IntRange(min=0),
              help="Fits on random halves of the heads for the stability measure (0: skip).")
@click.option("--sweep/--no-sweep", default=False, show_default=True,
              help="Also report stability and silhouette for k = 2..8.")
@click.option("--seeds", "n_seeds", default=10, show_default=True, type=click.IntRange(min=1),
              help="Repeat the stability measure with this many seeds (seed, seed+1, ...) for its mean and range "
                   "(1: only --seed).")
@quiet_option
@cli_errors
def cluster_cmd(run, k, method, features, standardize, seed, n_stability, sweep, n_seeds, quiet):
    """Group the heads of RUN into types; writes RUN/clusters.json.

    Types are named from their centroids (dense, diagonal, dense+vertical, vertical; see
    attnkit.analysis.naming). Stability follows Guan et al. 2020: the share of heads that get the same
    label in all fits on random 50% subsets of the heads, labels matched by the Hungarian method.
    """
    from ..run.head_features import HeadFeatures
    from ..run.locking import run_lock
    from ..run.outputs import os_errors
    from ..analysis.clustering import STABILITY_WARN, cluster, stability_over_seeds, sweep as do_sweep
    from ..analysis.results import save_clusters

    with run_lock(run, "attnkit cluster"), os_errors(f"write into {run}"):
        feats = HeadFeatures.load(run)
        _say(quiet, f"attnkit cluster: {feats.n_layers} × {feats.n_heads} heads of {run}, {method}, k = {k}, "
                    f"{n_stability} stability fits")
        c = cluster(feats, k=k, method=method, features_subset=features, standardize=standardize, seed=seed,
                    n_stability=n_stability)
        over = None
        if n_stability and n_seeds > 1:
            over = stability_over_seeds(feats, n_seeds=n_seeds, seed=seed, first=c, k=k, method=method,
                                        features_subset=features, standardize=standardize, n_stability=n_stability)
        rows = do_sweep(feats, method=method, features_subset=features, standardize=standardize, seed=seed,
                        n_stability=n_stability, progress=not quiet, n_seeds=n_seeds) if sweep else None
        path = save_clusters(run, c, feats, rows, over)
    click.echo(f"{feats.n_layers} layers × {feats.n_heads} heads, {len(c.feature_names_in_)} features, "
               f"{method}, k = {k}: stability {c.stability_:.3f}, silhouette {c.silhouette_:.3f}")
    if over is not None:
        click.echo(f"stability over {over['n_seeds']} seeds: mean {over['mean']:.3f}, range "
                   f"{over['min']:.3f}–{over['max']:.3f}")
    judged = over["mean"] if over is not None else c.stability_
    if judged == judged and judged < STABILITY_WARN:
        click.echo(f"warning: stability {judged:.3f} is below {STABILITY_WARN}: these head types are not "
                   "reliable (try another k, or more features)", err=True)
    for j, name in enumerate(c.type_names_):
        click.echo(f"  {j}: {name:<16} {int((c.labels_ == j).sum()):>4} heads ({c.shares_[j]:.1%})")
    click.echo("type ids per layer (rows: layers, columns: heads):")
    for l in range(feats.n_layers):
        click.echo(f"  L{l:<3} " + " ".join(str(int(x)) for x in c.labels_grid_[l]))
    if rows:
        click.echo("k  stability  silhouette" + ("  stability over seeds (mean, min–max)" if n_seeds > 1 else ""))
        for r in rows:
            extra = (f"  {r['stability_mean']:.3f} ({r['stability_min']:.3f}–{r['stability_max']:.3f})"
                     if "stability_mean" in r else "")
            click.echo(f"{r['k']:<2} {r['stability']:>9.3f} {r['silhouette']:>11.3f}{extra}")
    click.echo(f"wrote {path}")


@click.command("distances")
@click.argument("run", type=RUN)
@_with(_corpus_options)
@click.option("--rows-per-sample", type=click.IntRange(min=1), default=None,
              help="Sample this many query tokens per sample (for big corpora) [default: all].")
@click.option("--batch-size", type=click.IntRange(min=1), default=None, help="Samples per batch.")
@click.option("--device", default=None, help="cpu, cuda or cuda:N.")
@click.option("--seed", default=0, show_default=True, type=SEED, help="Seed of the row sampling.")
@click.option("--smooth", "smooth", is_flag=False, flag_value=0.001, default=0.0, type=click.FloatRange(0, 1, max_open=True),
              metavar="[EPS]", help="Smooth every row to (1 − EPS)·A + EPS/n before the divergence, as Clark et al.'s "
                                    "code (--smooth alone: EPS = 0.001) [default: no smoothing; local engine only].")
@click.option("--engine", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="local: this machine; ray: the Ray Data pipeline of `extract --engine ray` (shards in "
                   "RUN/distance-shards, a rerun skips finished ones).")
@click.option("--ray-address", default=None, metavar="ADDR", help="Ray cluster to join [default: a local one].")
@quiet_option
@cli_errors
def distances_cmd(run, corpus, fmt, squad_pairs, columns, limit, rows_per_sample, batch_size, device, seed, smooth,
                  engine, ray_address, quiet):
    """Jensen-Shannon divergences between all pairs of heads of RUN's model over a corpus (Clark et al.
    2019; natural logs, between 0 and ln 2 per token; not the metric sqrt(JS)); writes RUN/distances.npz
    (sums, per-token means, rows counted, smoothing).

    Runs the model over the corpus (by default the one in RUN/meta.json, with the run's model and
    max length); the attention maps are recomputed per layer inside the forward (Runtime observers)
    and reduced to a heads × heads matrix per batch, never stored. Uses the compiled js_distances op
    when it is built for the device and no smoothing is asked for, a chunked PyTorch computation otherwise.
    """
    from ..run.locking import run_lock
    from ..models import load_model
    from ..run.outputs import os_errors
    from ..engine.distances import collect_distances

    if ray_address and engine != "ray":
        raise AttnkitError("--ray-address needs --engine ray")
    if smooth and engine == "ray":
        raise AttnkitError("--smooth runs on the local engine only (the Ray pipeline sums unsmoothed divergences)")
    if engine == "ray":
        _distances_on_ray(run, corpus, fmt, squad_pairs, columns, limit, rows_per_sample, batch_size, seed,
                          ray_address, quiet)
        return
    with run_lock(run, "attnkit distances"), os_errors(f"write into {run}"):
        texts, meta = _corpus_from_run(run, corpus, fmt, squad_pairs, columns, limit)
        _say(quiet, f"attnkit distances: loading the model of {run}")
        model = load_model(meta.get("model") or None, device=device)
        shape = (len(model[0]._attnkit_modules), int(model[0].config.num_attention_heads))
        want = (meta.get("n_layers", shape[0]), meta.get("n_heads", shape[1]))
        if shape != want:
            raise AttnkitError(f"the model has {shape[0]} × {shape[1]} heads but {run} was measured "
                               f"with {want[0]} × {want[1]}")
        _say(quiet, f"attnkit distances: {texts.summary()}; {shape[0] * shape[1]} heads")
        from ..engine.local import default_workers

        workers = default_workers(next(model[0].parameters()).device.type)
        feats, dist = collect_distances(texts, model, workers=workers, rows_per_sample=rows_per_sample, seed=seed,
                                        smoothing=smooth,
                                        max_length=int(meta.get("max_length", 128)), batch_size=batch_size,
                                        num_windows=int(meta.get("num_windows", 16)), progress=not quiet)
        path = dist.save(run)
    _print_distances(dist, feats.n_samples, path, smooth)


def _print_distances(dist, n_samples: int, path, smooth: float = 0.0) -> None:
    import numpy as np

    pt = dist.per_token
    off = pt[~np.eye(pt.shape[0], dtype=bool)]
    smoothed = f" (rows smoothed with ε = {smooth:g})" if smooth else ""
    click.echo(f"{n_samples} segments, {dist.n_rows} query tokens{smoothed}: mean JS divergence per token "
               f"between heads "
               f"{off.mean():.4f} (min {off.min():.4f}, max {off.max():.4f}); wrote {path}")


def _distances_on_ray(run, corpus, fmt, squad_pairs, columns, limit, rows_per_sample, batch_size, seed, address,
                      quiet) -> None:
    """`attnkit distances --engine ray`: the same sums, measured by model actors on a Ray cluster."""
    from ..engine.ray.driver import remove_shards, run_ray_distances
    from ..run.locking import run_lock
    from ..run.outputs import os_errors

    with run_lock(run, "attnkit distances --engine ray"), os_errors(f"write into {run}"):
        texts, meta = _corpus_from_run(run, corpus, fmt, squad_pairs, columns, limit)
        settings = {"corpus_sha256": texts.fingerprint(), "model": meta.get("model"),
                    "max_length": int(meta.get("max_length", 128)), "batch_size": batch_size,
                    "rows_per_sample": rows_per_sample, "seed": seed}
        _say(quiet, f"attnkit distances (ray): {texts.summary()}")
        dist, info = run_ray_distances(
            texts, model_path=meta.get("model") or None, max_length=settings["max_length"], batch_size=batch_size,
            num_windows=int(meta.get("num_windows", 16)), rows_per_sample=rows_per_sample, seed=seed, run_dir=run,
            settings=settings, address=address, progress=not quiet)
        want = (meta.get("n_layers", dist.n_layers), meta.get("n_heads", dist.n_heads))
        if (dist.n_layers, dist.n_heads) != want:
            raise AttnkitError(f"the model has {dist.n_layers} × {dist.n_heads} heads but {run} was measured "
                               f"with {want[0]} × {want[1]}")
        path = dist.save(run)
        remove_shards(run, "distances")
    _print_distances(dist, info["n_samples"], path)


@click.command("report")
@click.argument("run", type=RUN)
@click.option("--examples", default=0, show_default=True, type=click.IntRange(min=0),
              help="Example attention maps per type, drawn from the corpus (needs the model and corpus).")
@_with(_corpus_options)
@k_option
@click.option("--method", type=click.Choice(["kmeans", "gmm"]), default="kmeans", show_default=True,
              help="Clustering method, when RUN/clusters.json does not exist yet.")
@click.option("--seed", default=0, show_default=True, type=SEED, help="Seed of clustering and t-SNE/MDS.")
@click.option("--device", default=None, help="Device for the example maps.")
@click.option("--svg/--no-svg", default=True, show_default=True, help="Also save every figure as SVG.")
@quiet_option
@cli_errors
def report_cmd(run, examples, corpus, fmt, squad_pairs, columns, limit, k, method, seed, device, svg, quiet):
    """Write RUN/report.html: one self-contained page (figures embedded, opens offline) with the
    settings, head types and stability, t-SNE and MDS maps, per-layer heatmaps, box plots and tables.
    Figures are also saved as PNG and SVG in RUN/figures/. Uses RUN/clusters.json (or clusters now,
    with -k/--method/--seed) and RUN/distances.npz when present."""
    import numpy as np

    from ..run.head_features import HeadFeatures
    from ..run.locking import run_lock
    from ..run.outputs import ensure_writable_dir, os_errors
    from ..engine.distances import DISTANCES_FILE, HeadDistances
    from ..analysis.report import FIGURES_DIR, build_report
    from ..analysis.results import CLUSTERS_FILE, load_clusters

    with run_lock(run, "attnkit report"), os_errors(f"write the report into {run}"):
        feats = HeadFeatures.load(run)
        shape = (feats.n_layers, feats.n_heads)
        # check what the report reads before drawing anything
        bad = np.argwhere(~np.isfinite(feats.mean).all(axis=2))
        if len(bad):
            heads = ", ".join(f"L{l}H{h}" for l, h in bad[:5]) + (" ..." if len(bad) > 5 else "")
            raise AttnkitError(f"{run}/features.npz holds NaN or infinite means for {len(bad)} head(s) ({heads}): "
                               f"the report cannot place them on maps")
        if (run / CLUSTERS_FILE).is_file():
            load_clusters(run, shape, complete=True, feature_names=feats.names)
        if (run / DISTANCES_FILE).is_file():
            HeadDistances.load(run, shape)
        ensure_writable_dir(run / FIGURES_DIR, "figures directory")
        texts = model = None
        if examples:
            from ..models import load_model

            texts, meta = _corpus_from_run(run, corpus, fmt, squad_pairs, columns, limit)
            texts = list(itertools.islice(texts, 500))  # example maps come from the first segments
            _say(quiet, f"attnkit report: loading the model of {run} for the example maps")
            model = load_model(meta.get("model") or None, device=device)
        _say(quiet, f"attnkit report: {shape[0]} × {shape[1]} heads of {run}")
        path = build_report(run, k=k, method=method, seed=seed, examples=examples, texts=texts, model=model,
                            svg=svg, progress=not quiet)
    click.echo(f"wrote {path}")


@click.command("compare")
@click.argument("run_a", type=RUN)
@click.argument("run_b", type=RUN)
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the comparison as JSON.")
@quiet_option
@cli_errors
def compare_cmd(run_a, run_b, json_out, quiet):
    """Compare the head types of two clustered runs (e.g. pretrained vs fine-tuned, or two corpora):
    which heads changed type, and the type distribution per layer of each."""
    import contextlib

    from ..run.head_features import FEATURES_FILE, atomic_write
    from ..run.locking import run_lock
    from ..run.outputs import ensure_writable_dir
    from ..analysis.results import compare, load_clusters

    if json_out is not None:
        ensure_writable_dir(json_out.parent, "output directory")
    res = compare(load_clusters(run_a, _run_shape(run_a)), load_clusters(run_b, _run_shape(run_b)))
    click.echo(f"{res['n_changed']} of {res['n_heads']} heads changed type")
    if not res["reliable"]:
        st = res["stability"]
        click.echo("warning: type changes are unreliable: clustering stability "
                   + ", ".join(f"{run} {'unknown' if st[s] is None else format(st[s], '.3f')}"
                               for s, run in (("a", run_a), ("b", run_b)))
                   + f" (below {res['stability_threshold']} in at least one run)", err=True)
    for key, n in res["transitions"].items():
        click.echo(f"  {key}: {n}")
    for side, run in (("a", run_a), ("b", run_b)):
        dist = res["per_layer"][side]
        click.echo(f"types per layer in {run} (counts for layers 0..):")
        for t, counts in dist.items():
            click.echo(f"  {t:<16} " + " ".join(f"{c:>3}" for c in counts))
    if res["changed"]:
        mark = "" if res["reliable"] else " (unreliable)"
        click.echo(f"changed heads{mark}: " + ", ".join(f"L{c['layer']}H{c['head']} {c['a']}→{c['b']}"
                                                          for c in res["changed"]))
    if json_out:
        into_run = (json_out.parent / FEATURES_FILE).is_file()  # writing into a run directory: lock it
        with run_lock(json_out.parent, "attnkit compare") if into_run else contextlib.nullcontext():
            atomic_write(json_out, lambda f: f.write((json.dumps(res, indent=2) + "\n").encode()))
        click.echo(f"wrote {json_out}")


COMMANDS = (cluster_cmd, distances_cmd, report_cmd, compare_cmd)


@click.group()
def analysis():
    """attnkit analysis commands (also available as `attnkit cluster|distances|report|compare`)."""


for _cmd in COMMANDS:
    analysis.add_command(_cmd)

__all__ = ["cluster_cmd", "distances_cmd", "report_cmd", "compare_cmd", "COMMANDS", "analysis"]
