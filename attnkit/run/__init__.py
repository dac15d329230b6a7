"""The run directory and every file attnkit reads back (formats: docs/files.md).

    files.py         the file names, in one place
    head_features    features.npz + meta.json (`HeadFeatures`) and the accumulator that makes them
    rundir           a run directory under way: checkpoints, resume, the finished run
    per_sample       per_sample.npy, written row by row in input order
    distances        distances.npz (`HeadDistances`)
    clusters         clusters.json, read back and validated
    opened           a run directory as one command read it, once (`Run`, `open_run`), handed down to its work
    shards           the Ray engine's shard files
    schemas          the schemas every file is checked against, the one .npz loader, the one JSON Schema formatter
    settings         saved settings against this run's settings
    identity         which model a file was made from, recorded by every command that runs one, compared by the report
    outputs          atomic writes, writable directories, one-line OS errors
    locking          one command at a time per run directory

Nothing here runs a model: this layer sits under the engines and the analyses, which all read runs through it.
"""
from . import files
from .distances import HeadDistances
from .files import *  # noqa: F403 (the file names)
from .head_features import FeatureAccumulator, HeadFeatures, features_table
from .locking import lock_owner, run_lock
from .outputs import atomic_write, ensure_writable_dir, os_errors, write_json
from .rundir import RunDir
from .schemas import load_json, load_npz, validate, validate_arrays

__all__ = [*files.__all__, "FeatureAccumulator", "HeadDistances", "HeadFeatures", "RunDir", "atomic_write",
           "ensure_writable_dir", "features_table", "load_json", "load_npz", "lock_owner", "os_errors", "run_lock",
           "validate", "validate_arrays", "write_json"]
