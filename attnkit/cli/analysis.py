"""`attnkit cluster`, `distances`, `report` and `compare`: the analysis of a run directory (docs/analysis.md).

Click only: each command parses its options, calls the library (attnkit/analysis/, and the distances job in
attnkit/jobs/distances_job.py) and prints what it found.
"""
from __future__ import annotations

from pathlib import Path

import click

from .options import SEED, OutputPath, cli_errors, echo_for, int_range, run_argument, shared

k_option = click.option("-k", "--k", "k", default=None, type=int_range("k"),
                        help="Number of head types (clusters) [default: the most stable k from 2 to 8].")


def corpus_options(fn):
    """--corpus (default: the run's) and how to read it, as `attnkit extract` does."""
    fn = shared("format", "squad-pairs", "columns", "limit")(fn)
    return click.option("--corpus", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
                        help="Corpus file [default: the one recorded in RUN/meta.json].")(fn)


def _opened(run: Path):
    """The run in `run` read once (attnkit.run.opened.Run), or None when it holds no features.npz."""
    from ..run.files import FEATURES_FILE
    from ..run.opened import open_run

    return open_run(run) if (run / FEATURES_FILE).is_file() else None


@click.command("cluster")
@run_argument()
@k_option
@click.option("--method", type=click.Choice(["kmeans", "gmm"]), default="kmeans", show_default=True,
              help="scikit-learn KMeans or GaussianMixture.")
@click.option("--features", default=None, metavar="NAMES",
              help="Comma-separated features to cluster on, 'distance' (the distance buckets cls, sep, comma, "
                   "period, self, win_0..win_N-1: Guan et al.'s 21-dim distance feature) or 'all' [default: "
                   "'classes', the class shares the type names are made of: vertical, diagonal, dense; a decoder's "
                   "six].")
@click.option("--standardize/--no-standardize", default=False, show_default=True,
              help="Scale every feature to unit variance first.")
@click.option("--seed", default=0, show_default=True, type=SEED, help="Random seed (fits and stability subsets).")
@click.option("--stability", "n_stability", default=10, show_default=True, type=int_range("n_stability"),
              help="Fits on random halves of the heads for the stability measure (0: skip).")
@click.option("--sweep/--no-sweep", default=False, show_default=True,
              help="Also report stability and silhouette for k = 2..8.")
@click.option("--seeds", "n_seeds", default=10, show_default=True, type=int_range("n_seeds"),
              help="Repeat the stability measure with this many seeds (seed, seed+1, ...) for its mean and range "
                   "(1: only --seed).")
@shared("overwrite", "quiet")
@cli_errors
def cluster_cmd(run, k, method, features, standardize, seed, n_stability, sweep, n_seeds, overwrite, quiet):
    """Group the heads of RUN into types; writes RUN/clusters.json.

    Types are named from their centroids by their largest class (vertical, diagonal, dense; on a decoder's
    run first-token, previous-token, local, broad, ...) and what tells them apart (vertical+dense; see
    attnkit.analysis.naming). Stability follows Guan et al. 2020: the share of heads that get the same
    label in all fits on random 50% subsets of the heads, labels matched by the Hungarian method.
    """
    from ..analysis.preflight import preflight_cluster
    from ..run.locking import check_not_in_use

    check_not_in_use(run)  # a directory another command holds is refused first, as the job's lock would
    feats = preflight_cluster(run, features, overwrite)  # refusals come before scikit-learn is imported
    from ..analysis.clustering import STABILITY_WARN, stability_assessment
    from ..analysis.jobs import cluster_run

    res = cluster_run(run, k=k, method=method, features=features, standardize=standardize, seed=seed,
                      n_stability=n_stability, do_sweep=sweep, n_seeds=n_seeds, quiet=quiet, overwrite=overwrite,
                      echo=echo_for(), feats=feats)
    c, over, rows, feats, path = res.clusterer, res.over_seeds, res.sweep, res.features, res.path
    chosen = k is None
    k = int(c.k)
    verdict = stability_assessment(c, over, rows, feats.n_samples)
    norm = " (norm-weighted)" if feats.meta.get("weighting") == "norm" else ""
    left_out = f" ({c.n_removed_} removed by pruning left out)" if c.n_removed_ else ""
    stab = (f"stability over {over['n_seeds']} seeds: mean {over['mean']:.3f}, range {over['min']:.3f}–"
            f"{over['max']:.3f}; seed {seed}: {c.stability_:.3f}" if over is not None
            else f"stability {c.stability_:.3f}")
    ks = [r["k"] for r in rows] if rows else []
    if verdict["stable"] is False and rows and not verdict["any_k_stable"]:
        click.echo(f"no k from {ks[0]} to {ks[-1]} gives stable head types: stability ({verdict['sweep_judged_by']}) "
                   f"is below {STABILITY_WARN} for every k; the most stable is k = {verdict['most_stable_k']} "
                   f"({verdict['most_stable_value']:.3f})")
    elif verdict["stable"] is False and rows:
        best = verdict["most_stable_k"]
        click.echo(f"the head types at k = {k} are not stable ({verdict['value']:.3f} < {STABILITY_WARN}); "
                   f"stable: k = {', '.join(map(str, verdict['stable_ks']))} (most stable: k = {best}, "
                   f"{verdict['most_stable_value']:.3f}): try -k {best}")
    elif verdict["stable"] is False:
        click.echo(f"the head types at k = {k} are not stable ({verdict['value']:.3f} < {STABILITY_WARN})")
    if rows:
        click.echo("stability by k" + (" (mean over seeds, min–max)" if n_seeds > 1 else "") + ":")
        click.echo("  k  stability  silhouette" + ("  seed-0 stability" if n_seeds > 1 else ""))
        for r in rows:
            main = (f"{r['stability_mean']:.3f} ({r['stability_min']:.3f}–{r['stability_max']:.3f})"
                    if "stability_mean" in r else f"{r['stability']:.3f}")
            extra = f"  {r['stability']:.3f}" if "stability_mean" in r else ""
            click.echo(f"  {r['k']:<2} {main:>9} {r['silhouette']:>11.3f}{extra}")
    if verdict.get("what_would_help"):
        click.echo("what would help:")
        for line in verdict["what_would_help"]:
            click.echo(f"  - {line}")
    click.echo(f"{feats.n_layers} layers × {feats.n_heads} heads{left_out}, {len(c.feature_names_in_)} features{norm}, "
               f"{method}, k = {k}{' (the most stable)' if chosen else ''}: {stab}, silhouette {c.silhouette_:.3f}")
    if verdict["stable"] is False:
        click.echo(f"warning: stability {verdict['value']:.3f} is below {STABILITY_WARN}: these head types are not "
                   "reliable", err=True)
    for j, name in enumerate(c.type_names_):
        click.echo(f"  {j}: {name:<16} {int((c.labels_ == j).sum()):>4} heads ({c.shares_[j]:.1%})")
    click.echo("type ids per layer (rows: layers, columns: heads" + ("; -: removed" if c.n_removed_ else "") + "):")
    for l in range(feats.n_layers):
        click.echo(f"  L{l:<3} " + " ".join("-" if x < 0 else str(int(x)) for x in c.labels_grid_[l]))
    click.echo(f"wrote {path}")


@click.command("distances")
@run_argument()
@corpus_options
@click.option("--rows-per-sample", type=int_range("rows_per_sample"), default=None,
              help="Sample this many query tokens per sample (for big corpora) [default: all].")
@shared("batch-size", "device")
@click.option("--seed", default=0, show_default=True, type=SEED, help="Seed of the row sampling.")
@click.option("--smooth", "smooth", is_flag=False, flag_value=0.001, default=0.0,
              type=click.FloatRange(0, 1, max_open=True),
              metavar="[EPS]", help="Smooth every row to (1 − EPS)·A + EPS/n before the divergence, as Clark et al.'s "
                                    "code (--smooth alone: EPS = 0.001) [default: no smoothing; local engine only].")
@shared("engine", "ray-address", "overwrite", "quiet")
@cli_errors
def distances_cmd(run, corpus, fmt, squad_pairs, columns, limit, rows_per_sample, batch_size, device, seed, smooth,
                  engine, ray_address, overwrite, quiet):
    """Jensen-Shannon divergences between all pairs of heads of RUN's model over a corpus (Clark et al.
    2019; natural logs, between 0 and ln 2 per token; not the metric sqrt(JS)); writes RUN/distances.npz
    (sums, per-token means, rows counted, smoothing). An encoder–decoder's heads are compared within each kind
    over the run's (source, target) pairs: one file per kind, RUN/distances_encoder.npz, distances_decoder.npz
    and distances_cross.npz (docs/seq2seq.md §9; local engine only).

    Runs the model over the corpus (by default the one in RUN/meta.json, with the run's model and
    max length); the attention maps are recomputed per layer inside the forward (Runtime observers)
    and reduced to a heads × heads matrix per batch, never stored. Uses the compiled js_distances op
    when it is built for the device and no smoothing is asked for, a chunked PyTorch computation otherwise.
    With --engine ray the same sums come from the Ray Data pipeline of `extract --engine ray` (shards in
    RUN/distance-shards, a rerun skips finished ones).
    """
    import numpy as np

    from ..jobs.job_options import DistancesOptions, preflight_distances
    from ..run.distances import distances_file
    from ..run.locking import check_not_in_use

    check_not_in_use(run)  # a directory another command holds is refused first, as the job's lock would
    opts = DistancesOptions(
        run=run, corpus=corpus, fmt=fmt, squad_pairs=squad_pairs, columns=columns, limit=limit,
        rows_per_sample=rows_per_sample, batch_size=batch_size, device=device, seed=seed, smooth=smooth,
        engine=engine, ray_address=ray_address, quiet=quiet, overwrite=overwrite)
    read = preflight_distances(opts)  # refusals that need no model come before torch is imported
    from ..jobs.distances_job import run_distances_job

    dist, n_samples, path = run_distances_job(opts, echo=echo_for(), read=read)
    smoothed = f" (rows smoothed with ε = {smooth:g})" if smooth else ""
    by_kind = dist if isinstance(dist, dict) else {None: dist}
    for kind, d in by_kind.items():
        pt = d.per_token
        kept = ~d.removed
        off = pt[np.ix_(kept, kept)][~np.eye(int(kept.sum()), dtype=bool)]
        gone = f"; left out {int((~kept).sum())} head(s) removed by pruning" if (~kept).any() else ""
        between = "heads" if kind is None else f"{kind} heads"
        click.echo(f"{n_samples} segments, {d.n_rows} query tokens{smoothed}: mean JS divergence per token "
                   f"between {between} {off.mean():.4f} (min {off.min():.4f}, max {off.max():.4f}){gone}; wrote "
                   f"{path if kind is None else path.parent / distances_file(kind)}")


@click.command("report")
@run_argument()
@click.option("--examples", default=None, type=int_range("examples"),
              help="Embed the attention maps of this many short inputs of the run's corpus (the shortest first): an "
                   "interactive view of where each head attends from each token, every head's maps in its panel, "
                   "and example maps of each type. Needs the run's model and corpus. Default 4 when the run records "
                   "both, the corpus with the SHA-256 of its inputs (none, with a note, otherwise); 0: none.")
@click.option("--include", multiple=True, type=click.Path(exists=True, path_type=Path), metavar="DIR",
              help="A directory of `attnkit probe`, `attnkit ablate` or `attnkit detect-heads` results to show beside "
                   "the run's heads, or a run of the same corpus under the other --weighting (the findings then say "
                   "how much first-token, [CLS] or [SEP] mass survives norm weighting). Repeatable; results written "
                   "into RUN itself are found without it.")
@corpus_options
@k_option
@click.option("--method", type=click.Choice(["kmeans", "gmm"]), default="kmeans", show_default=True,
              help="Clustering method, when RUN/clusters.json does not exist yet.")
@click.option("--seed", default=0, show_default=True, type=SEED, help="Seed of clustering and t-SNE/MDS.")
@shared("device", "svg", "overwrite", "quiet")
@cli_errors
def report_cmd(run, examples, include, corpus, fmt, squad_pairs, columns, limit, k, method, seed, device, svg,
               overwrite, quiet):
    """Write RUN/report.html: one self-contained page that opens offline. It starts with the findings (head
    types and their stability, the attention sink, departures from the papers, heads above their thresholds; for
    a decoder: sink heads, detected previous-token/induction heads, language-model loss ablations),
    then a head explorer (click a head: its features, type, nearest heads, top and bottom examples, maps, probe,
    pattern and ablation results), a head view of a few short inputs of the corpus (--examples), the figures,
    the results of patterns/probe/ablate, sortable tables, a glossary, and the settings; it links nothing
    outside itself and shows every value read from the run's files as text. Figures are also saved as PNG and
    SVG in RUN/figures/. Uses RUN/clusters.json (or clusters now, with -k/--method/--seed), RUN/distances.npz,
    RUN/per_sample.npy and RUN/patterns.json when present."""
    from ..analysis.preflight import preflight_report
    from ..run.locking import check_not_in_use

    check_not_in_use(run)  # a directory another command holds is refused first, as the job's lock would
    opened = preflight_report(run, overwrite)  # refusals come before matplotlib, scikit-learn or the model load
    from ..analysis.jobs import report_run
    from ..analysis.report import report_figures
    from ..run.clusters import clusters_path

    had_clusters = clusters_path(run).is_file()
    path = report_run(run, examples=examples, include=include, corpus=corpus, fmt=fmt, squad_pairs=squad_pairs,
                      columns=columns, limit=limit, k=k, method=method, seed=seed, device=device, svg=svg, quiet=quiet,
                      overwrite=overwrite, echo=echo_for(), opened=opened)
    figures = report_figures(run)
    if not had_clusters and clusters_path(run).is_file():  # the report clustered the run: say so, it is a new file
        click.echo(f"wrote {clusters_path(run)} (the run had no head types: clustered now with "
                   f"{'the most stable k' if k is None else f'k = {k}'}, method "
                   f"{method}, seed {seed}; `attnkit cluster` chooses others)")
    click.echo(f"wrote {path}" + (f" and {len(figures)} figure files in {figures[0].parent}" if figures else ""))


@click.command("compare")
@run_argument("run_a")
@run_argument("run_b")
@click.option("--json", "json_out", type=OutputPath(dir_okay=False, path_type=Path), default=None,
              help="Also write the comparison as JSON.")
@shared("overwrite", "quiet")
@cli_errors
def compare_cmd(run_a, run_b, json_out, overwrite, quiet):
    """Compare the head types of two clustered runs (e.g. pretrained vs fine-tuned, or two corpora):
    which heads changed type, and the type distribution per layer of each.

    When one run was extracted with --weighting attention and the other with --weighting norm (one corpus, two
    weightings), it first shows how much of each head's [CLS], [SEP] and punctuation mass survives norm weighting
    (Kobayashi et al. 2020); head types are then compared only when both runs are clustered."""
    from ..analysis.weighting import compare_run_weightings, weighting_lines
    from ..run.clusters import clusters_path, load_clusters
    from ..run.files import CLUSTERS_FILE, FEATURES_FILE, META_FILE
    from ..run.locking import output_file
    from ..run.outputs import write_json
    from ..run.overwrite import claim_outputs

    claim = None
    inputs = [(f"a file of {r}", r / name) for r in (run_a, run_b)
              for name in (FEATURES_FILE, META_FILE, CLUSTERS_FILE)]
    if json_out is not None:  # the write path, held until the command ends (locked when OUT is in a run directory)
        click.get_current_context().with_resource(output_file(json_out, "attnkit compare", inputs=inputs,
                                                              name="json_out"))
        claim = claim_outputs([json_out], overwrite)

    def write(doc: dict) -> None:
        write_json(json_out, doc)
        click.echo(f"wrote {json_out}")
        if claim.removed_message():
            echo_for()(claim.removed_message(), err=True)

    opened_a, opened_b = _opened(run_a), _opened(run_b)  # each run's files read once, used by all that follows
    weighting = compare_run_weightings(opened_a, opened_b) if opened_a and opened_b else None
    if weighting is not None:
        for line in weighting_lines(weighting):
            click.echo(line)
        if not all(clusters_path(r).is_file() for r in (run_a, run_b)):
            click.echo("head types not compared: cluster both runs first (attnkit cluster RUN)")
            if json_out:
                write({"weighting": weighting})
            return
    a, b = (load_clusters(r, o and o.shape) for r, o in ((run_a, opened_a), (run_b, opened_b)))
    from ..analysis.results import compare  # scikit-learn: only once both files have passed their checks

    res = compare(a, b)
    if weighting is not None:
        res["weighting"] = weighting
    click.echo(f"{res['n_changed']} of {res['n_heads']} heads changed type"
               + (f" ({res['n_removed']} head(s) removed by pruning in either run left out)" if res["n_removed"]
                  else ""))
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
        write(res)


__all__ = ["cluster_cmd", "compare_cmd", "distances_cmd", "report_cmd"]
