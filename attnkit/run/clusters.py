"""RUN/clusters.json, read back: head types of a run, validated (the layout: docs/files.md, "clusters.json").

`attnkit cluster` writes the file (attnkit/analysis/results.py); the report, `attnkit compare` and the
ablations read it through `load_clusters`. Layout (version 1):
    {"version": 1,
     "settings": {"k", "method", "features", "standardize", "seed", "n_stability", "subsample"},
     "run": {"n_layers", "n_heads", "n_samples", "n_tokens", "model", "corpus"},
     "removed_heads": [[layer, head], ...]                               # absent when none were removed
     "heads": [{"layer", "head", "label", "type", "agreement"}, ...]      # (layer, head) order
     "clusters": [{"label", "type", "n_heads", "share", "centroid": {feature: value},
                   "profile": {"special", "near_r", "far_r", ...}}, ...],
     "stability": {"k", "stability", "silhouette", "n_stability", "sweep": [{"k", "stability",
                   "silhouette", "type_names", "shares", ["stability_mean", "stability_min",
                   "stability_max", "n_seeds"]}, ...] or null,
                   "over_seeds": {"n_seeds", "seeds", "values", "mean", "min", "max"} or absent}}
A head a pruning removed has no features: it is in no cluster, listed in `removed_heads` instead of `heads`
(`type_grid` gives it the type "removed", `label_grid` the label -1). `agreement` is the share of stability
fits that gave the head its final label; `over_seeds` repeats the
whole stability measure with other seeds (`attnkit.analysis.clustering.stability_over_seeds`).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import AttnkitError
from .files import CLUSTERS_FILE
from .schemas import CLUSTERS_REPORT_SCHEMA, CLUSTERS_SCHEMA, load_json

VERSION = 1
REMOVED = "removed"  # the type of a head a pruning removed (docs/pruning.md)


def clusters_path(run_dir) -> Path:
    """RUN/clusters.json for a run directory; a path to a file is returned as it is."""
    path = Path(run_dir)
    return path / CLUSTERS_FILE if path.is_dir() or not path.suffix else path


def load_clusters(run_dir, shape: tuple[int, int] | None = None, *, complete: bool = False,
                  feature_names=None) -> dict:
    """The content of a run's clusters.json (`run_dir` may also be the file itself), validated.

    The file must follow `attnkit.run.schemas.CLUSTERS_SCHEMA` (with `complete`: CLUSTERS_REPORT_SCHEMA,
    every field the report reads) and be consistent: every (layer, head) of the run's
    n_layers × n_heads exactly once, labels and types that name one of the clusters. With `shape`
    (n_layers, n_heads), the run must have that shape; with `feature_names` (the run's), the clustered
    features must be among them. Problems end in an AttnkitError naming the file and the field.
    """
    path = clusters_path(run_dir)
    if not path.is_file():
        raise AttnkitError(f"{path} is missing: run `attnkit cluster {path.parent}` first")
    data = load_json(path, CLUSTERS_REPORT_SCHEMA if complete else CLUSTERS_SCHEMA)
    check_clusters(data, path, shape)
    unknown = [f for f in data["settings"].get("features") or [] if feature_names is not None
               and f not in feature_names]
    if unknown:
        raise AttnkitError(f"{path}: field settings.features: {', '.join(unknown)} not among the run's features: "
                           f"re-run `attnkit cluster`")
    return data


def check_clusters(data: dict, path, shape: tuple[int, int] | None = None) -> None:
    """The cross-field checks of clusters.json content that a schema cannot express."""
    L, H = data["run"]["n_layers"], data["run"]["n_heads"]
    if shape is not None and (L, H) != tuple(shape):
        raise AttnkitError(f"{path} covers {L} layers × {H} heads, but the run has {shape[0]} × {shape[1]}: "
                           f"re-run `attnkit cluster`")
    labels = {}
    for i, c in enumerate(data["clusters"]):
        if c["label"] in labels:
            raise AttnkitError(f"{path}: field clusters[{i}].label: label {c['label']} appears twice")
        if c["type"] in labels.values():
            raise AttnkitError(f"{path}: field clusters[{i}].type: type {c['type']!r} appears twice")
        labels[c["label"]] = c["type"]
    removed = {(l, h) for l, h in data.get("removed_heads") or []}
    for l, h in removed:
        if l >= L or h >= H:
            raise AttnkitError(f"{path}: field removed_heads: L{l}H{h} is outside the run's {L} layers × {H} heads")
    seen = set()
    for i, h in enumerate(data["heads"]):
        where = f"{path}: field heads[{i}]"
        if h["layer"] >= L:
            raise AttnkitError(f"{where}.layer: layer {h['layer']} is out of range (the run has {L} layers)")
        if h["head"] >= H:
            raise AttnkitError(f"{where}.head: head {h['head']} is out of range (the run has {H} heads per layer)")
        if (h["layer"], h["head"]) in seen or (h["layer"], h["head"]) in removed:
            raise AttnkitError(f"{where}: L{h['layer']}H{h['head']} appears twice")
        seen.add((h["layer"], h["head"]))
        if h["label"] not in labels:
            raise AttnkitError(f"{where}.label: label {h['label']} is none of the clusters' labels "
                               f"({', '.join(map(str, sorted(labels)))})")
        if h["type"] != labels[h["label"]]:
            raise AttnkitError(f"{where}.type: {h['type']!r} differs from the type of cluster {h['label']} "
                               f"({labels[h['label']]!r})")
    if len(seen) + len(removed) != L * H:
        listed = f"{len(seen)} heads listed" + (f" and {len(removed)} removed" if removed else "")
        raise AttnkitError(f"{path}: field heads: {listed}, but the run has {L} × {H} = {L * H}")
    feats = data["settings"].get("features")
    if feats is not None:
        for i, c in enumerate(data["clusters"]):
            missing = [f for f in feats if "centroid" in c and f not in c["centroid"]]
            if missing:
                raise AttnkitError(f"{path}: field clusters[{i}].centroid: no value for {', '.join(missing)}")


def type_grid(data: dict) -> np.ndarray:
    """n_layers × n_heads array of type names from clusters.json content ("removed" for a head a pruning
    removed)."""
    L, H = data["run"]["n_layers"], data["run"]["n_heads"]
    grid = np.empty((L, H), dtype=object)
    for l, h in data.get("removed_heads") or []:
        grid[l, h] = REMOVED
    for h in data["heads"]:
        grid[h["layer"], h["head"]] = h["type"]
    return grid


def label_grid(data: dict) -> np.ndarray:
    """n_layers × n_heads array of cluster labels (-1 for a head a pruning removed)."""
    L, H = data["run"]["n_layers"], data["run"]["n_heads"]
    grid = np.full((L, H), -1, dtype=np.int64)
    for h in data["heads"]:
        grid[h["layer"], h["head"]] = h["label"]
    return grid


def type_distribution(data: dict) -> dict:
    """{type: [count of heads of that type in layer 0, 1, ...]}"""
    grid = type_grid(data)
    names = [c["type"] for c in data["clusters"]]
    return {t: [int(np.sum(row == t)) for row in grid] for t in names}


def run_stability(data: dict) -> float | None:
    """The stability to judge a clustering by: the mean over seeds when recorded, else the single value."""
    st = data.get("stability") or {}
    over = st.get("over_seeds")
    if over and over.get("mean") is not None:
        return float(over["mean"])
    return None if st.get("stability") is None else float(st["stability"])


__all__ = ["CLUSTERS_FILE", "REMOVED", "VERSION", "check_clusters", "clusters_path", "label_grid", "load_clusters",
           "run_stability", "type_distribution", "type_grid"]
