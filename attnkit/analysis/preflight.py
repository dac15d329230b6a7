"""What `attnkit cluster` and `attnkit report` can refuse without scikit-learn, matplotlib or a model: the run's
files, the features asked for, and earlier results that only `overwrite` replaces. The jobs (jobs.py) check the
same under the run's lock; the command line calls these first, so a refusal comes at once. This module imports
nothing heavy (tests/test_cli_startup.py holds it to that)."""
from __future__ import annotations

from pathlib import Path

from ..features import resolve_subset
from ..run.files import CLUSTERS_FILE, REPORT_FILE
from ..run.head_features import HeadFeatures
from ..run.locking import lock_owner
from ..run.overwrite import claim_outputs


def preflight_cluster(run, features: str | None, overwrite: bool) -> None:
    """`attnkit cluster`'s refusals before scikit-learn loads (skipped while another command holds the run: its
    lock names the holder)."""
    run = Path(run)
    if lock_owner(run) is None:
        feats = HeadFeatures.load(run)
        resolve_subset(feats.names, features)
        claim_outputs([run / CLUSTERS_FILE], overwrite, stale=[run / REPORT_FILE])


def preflight_report(run, overwrite: bool) -> None:
    """`attnkit report`'s refusals before matplotlib, scikit-learn or a model load."""
    run = Path(run)
    if lock_owner(run) is None:
        HeadFeatures.load(run)
        claim_outputs([run / REPORT_FILE], overwrite)


__all__ = ["preflight_cluster", "preflight_report"]
