"""The names of the files attnkit writes, in one place (their formats: docs/files.md).

A run directory (`attnkit extract -o RUN`) holds FEATURES_FILE and META_FILE, later what the analysis adds;
`attnkit probe -o OUT` and `attnkit compare-models -o OUT` write directories of their own.
"""
from __future__ import annotations

from pathlib import Path

from .model_dir import KINDS

# written by `attnkit extract`
FEATURES_FILE = "features.npz"
META_FILE = "meta.json"
CHECKPOINT_FILE = "checkpoint.npz"
PER_SAMPLE_FILE = "per_sample.npy"
PER_SAMPLE_META = "per_sample.json"
PER_SAMPLE_ROWS = "per_sample_rows.csv"  # where each per-sample row came from
FEATURE_SHARDS_DIR = "shards"  # --engine ray, while unfinished
# written by the analysis commands
CLUSTERS_FILE = "clusters.json"
DISTANCES_FILE = "distances.npz"
# an encoder–decoder's run: one file per kind of layers, its heads compared within the kind (docs/seq2seq.md §9)
DISTANCES_KIND_FILES = {kind: f"distances_{kind}.npz" for kind in KINDS}
DISTANCE_SHARDS_DIR = "distance-shards"  # `attnkit distances --engine ray`, while unfinished
PATTERNS_FILE = "patterns.json"
PATTERN_LABELS = "pattern_labels.npy"  # the class of every (example, head)
REPORT_FILE = "report.html"
FIGURES_DIR = "figures"
# written by `attnkit detect-heads MODEL -o RUN` (into a run directory, or a directory of its own)
DETECTED_HEADS_FILE = "detected_heads.csv"
DETECTED_HEADS_META = "detected_heads.json"
# what detect-heads wrote before 0.x names: the same names as `attnkit ablate --experiment heads -o RUN`'s files,
# which is why they changed; the report still reads them (attnkit/analysis/attached.py)
LEGACY_DETECTED_HEADS = ("heads.csv", "heads.meta.json")
# one command at a time per directory (attnkit.run.locking)
LOCK_FILE = ".attnkit.lock"
OWNER_FILE = ".attnkit.lock.owner"
# `attnkit compare-models -o OUT`
COMPARE_JSON = "compare_models.json"
COMPARE_NPZ = "compare_models.npz"
# `attnkit probe -o OUT`
PROBE_JSON = "probe.json"
PROBE_CSV = "probe.csv"
PROBE_TABLE = "best_heads.txt"
PROBE_HEATMAP = "probe_heatmap"  # .png
# `attnkit ablate --mode mean -o OUT`: the heads' mean outputs (also the checkpoint while they are computed)
HEAD_MEANS_FILE = "head_means.npz"

# What later steps add to a run directory: a fresh run that replaces a finished one removes them, since they
# describe the old features.
DERIVED_OUTPUTS = (CLUSTERS_FILE, DISTANCES_FILE, *DISTANCES_KIND_FILES.values(), REPORT_FILE, FIGURES_DIR,
                   PATTERNS_FILE, PATTERN_LABELS, PER_SAMPLE_FILE, PER_SAMPLE_META, PER_SAMPLE_ROWS,
                   DETECTED_HEADS_FILE, DETECTED_HEADS_META)


def compare_models_outputs(directory, *, svg: bool = True) -> list[Path]:
    """The files `attnkit compare-models -o DIR` writes (ModelComparison.save)."""
    directory = Path(directory)
    figure = directory / FIGURES_DIR / "compare_models"
    return [directory / COMPARE_JSON, directory / COMPARE_NPZ, figure.with_suffix(".png")] + \
        ([figure.with_suffix(".svg")] if svg else [])


__all__ = ["CHECKPOINT_FILE", "CLUSTERS_FILE", "COMPARE_JSON", "COMPARE_NPZ", "DERIVED_OUTPUTS", "DISTANCES_FILE",
           "DISTANCES_KIND_FILES",
           "DISTANCE_SHARDS_DIR", "FEATURES_FILE", "FEATURE_SHARDS_DIR", "FIGURES_DIR", "LOCK_FILE", "META_FILE",
           "OWNER_FILE", "PATTERN_LABELS", "PATTERNS_FILE", "PER_SAMPLE_FILE", "PER_SAMPLE_META", "PER_SAMPLE_ROWS",
           "PROBE_CSV", "PROBE_HEATMAP", "PROBE_JSON", "PROBE_TABLE", "REPORT_FILE"]
__all__ += ["DETECTED_HEADS_FILE", "DETECTED_HEADS_META", "HEAD_MEANS_FILE", "LEGACY_DETECTED_HEADS",
            "compare_models_outputs"]
