"""What `attnkit cluster` and `attnkit report` can refuse without scikit-learn, matplotlib or a model: the run's
files, the features asked for, heads with NaN means that meta.json does not record as removed, and earlier results
that only `overwrite` replaces. The jobs (jobs.py) check the same under the run's lock; the command line calls these
first, so a refusal comes at once. This module imports nothing heavy (tests/test_cli_startup.py holds it to that)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import AttnkitError
from ..features import weighting_of
from ..run.clusters import load_clusters
from ..run.files import CLUSTERS_FILE, META_FILE, REPORT_FILE
from ..run.head_features import HeadFeatures
from ..run.identity import model_mismatch, recorded_identity
from ..run.locking import lock_owner
from ..run.model_dir import is_decoder_meta
from ..run.opened import Run
from ..run.overwrite import claim_outputs
from .naming import class_names, cluster_features


def check_heads(features: HeadFeatures, run_dir) -> None:
    """Refuse a run whose means hold NaN or infinity for heads that meta.json does not record as removed (a damaged
    run; a removed head outside the run is refused where meta.json is read, by HeadFeatures.load)."""
    bad = ~np.isfinite(features.mean).all(axis=2) & ~features.removed
    if bad.any():
        heads = [f"L{l}H{h}" for l, h in np.argwhere(bad)]
        raise AttnkitError(f"{Path(run_dir) / 'features.npz'} holds NaN or infinite means for {len(heads)} head(s) "
                           f"({', '.join(heads[:5])}{' ...' if len(heads) > 5 else ''}) that meta.json does not "
                           "record as removed: the report cannot place them on maps")


def clustered_names(features: HeadFeatures) -> list[str]:
    """The names a clusters.json of this run may have clustered on: the run's features and the class shares of its
    kind (attnkit.analysis.naming.cluster_features)."""
    return list(features.names) + class_names(is_decoder_meta(features.meta))


def load_run(run_dir, *, clusters: bool = True) -> Run:
    """The run that a report (or a clustering) describes, read once: its features, refused (AttnkitError) when its
    meta.json is missing (the run's record: model, corpus, counts, removed heads; without it the page would describe
    a model it cannot name) or its means hold NaN for heads it does not record as removed (`check_heads`); with
    `clusters`, its clusters.json when there is one, checked against the run (`check_clusters_of_run`)."""
    run_dir = Path(run_dir)
    features = HeadFeatures.load(run_dir)
    if not (run_dir / META_FILE).is_file():
        raise AttnkitError(f"{run_dir / META_FILE} is missing: the report needs the run's record (model, corpus, "
                           "counts, removed heads); restore it, or extract the run again")
    check_heads(features, run_dir)
    data = None
    if clusters and (run_dir / CLUSTERS_FILE).is_file():
        data = load_clusters(run_dir, (features.n_layers, features.n_heads), complete=True,
                             feature_names=clustered_names(features))
        check_clusters_of_run(data, features, run_dir / CLUSTERS_FILE)
    return Run(run_dir, features, data)


def check_clusters_of_run(data: dict, features: HeadFeatures, path) -> None:
    """Refuse clusters.json (`data`, read from `path`) made from another run than that of `features`: its `run`
    records another model, another number of samples or another weighting (a shape that differs is refused where it
    is read, attnkit/run/clusters.py)."""
    run = data.get("run") or {}
    why = model_mismatch(recorded_identity(features.meta, features.n_layers, features.n_heads),
                         recorded_identity({"model": run.get("model")}, run.get("n_layers"), run.get("n_heads")))
    if not why and run.get("n_samples") and features.n_samples and run["n_samples"] != features.n_samples:
        why = f"it clustered a run of {run['n_samples']} samples, this run measured {features.n_samples}"
    if not why and run.get("weighting") and run["weighting"] != weighting_of(features.meta):
        why = (f"it clustered {run['weighting']}-weighted features, this run's are "
               f"{weighting_of(features.meta)}-weighted")
    if why:
        raise AttnkitError(f"{path} is another run's ({why}): cluster this run again with "
                           "`attnkit cluster RUN --overwrite`")


def preflight_cluster(run, features: str | None, overwrite: bool) -> HeadFeatures | None:
    """`attnkit cluster`'s refusals before scikit-learn loads, and the features read for them, which the job then
    uses (None while another command holds the run: its lock names the holder, and the job reads the run)."""
    run = Path(run)
    if lock_owner(run) is not None:
        return None
    feats = HeadFeatures.load(run)
    cluster_features(feats.names, features, decoder=is_decoder_meta(feats.meta))
    claim_outputs([run / CLUSTERS_FILE], overwrite, stale=[run / REPORT_FILE])
    return feats


def preflight_report(run, overwrite: bool) -> Run | None:
    """`attnkit report`'s refusals before matplotlib, scikit-learn or a model load, and the run read for them, which
    the job then uses (None while another command holds the run)."""
    run = Path(run)
    if lock_owner(run) is not None:
        return None
    opened = load_run(run)
    claim_outputs([run / REPORT_FILE], overwrite)
    return opened


__all__ = ["check_clusters_of_run", "check_heads", "clustered_names", "load_run", "preflight_cluster",
           "preflight_report"]
