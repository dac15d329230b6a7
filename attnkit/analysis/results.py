"""RUN/clusters.json: head types of a run, written by `attnkit cluster` and read by report/compare.

Layout (version 1):
    {"version": 1,
     "settings": {"k", "method", "features", "standardize", "seed", "n_stability", "subsample"},
     "run": {"n_layers", "n_heads", "n_samples", "n_tokens", "model", "corpus"},
     "heads": [{"layer", "head", "label", "type", "agreement"}, ...]      # (layer, head) order
     "clusters": [{"label", "type", "n_heads", "share", "centroid": {feature: value},
                   "profile": {"special", "near_r", "far_r", ...}}, ...],
     "stability": {"k", "stability", "silhouette", "n_stability", "sweep": [{"k", "stability",
                   "silhouette", "type_names", "shares", ["stability_mean", "stability_min",
                   "stability_max", "n_seeds"]}, ...] or null,
                   "over_seeds": {"n_seeds", "seeds", "values", "mean", "min", "max"} or absent}}
`agreement` is the share of stability fits that gave the head its final label; `over_seeds` repeats the
whole stability measure with other seeds (`attnkit.analysis.clustering.stability_over_seeds`).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..errors import AttnkitError
from ..run.head_features import write_json
from ..run.outputs import ensure_writable_dir
from ..run.schemas import CLUSTERS_REPORT_SCHEMA, CLUSTERS_SCHEMA, load_json
from .naming import profile_groups

CLUSTERS_FILE = "clusters.json"
VERSION = 1


def _num(x):
    x = float(x)
    return None if math.isnan(x) else x


def clusters_dict(clusterer, features=None, sweep_rows=None, seeds=None) -> dict:
    """The clusters.json content of a fitted HeadClusterer (fitted on HeadFeatures)."""
    if getattr(clusterer, "grid_shape_", None) is None:
        raise AttnkitError("clusters.json needs a clusterer fitted on HeadFeatures (layers × heads)")
    L, H = clusterer.grid_shape_
    names = clusterer.type_names_
    heads = []
    for m, lab in enumerate(clusterer.labels_):
        heads.append({"layer": m // H, "head": m % H, "label": int(lab), "type": names[int(lab)],
                      "agreement": _num(clusterer.head_stability_[m])})
    clusters = []
    for c, name in enumerate(names):
        g = profile_groups(clusterer.profiles_[c], clusterer.profile_names_)
        clusters.append({
            "label": c, "type": name, "n_heads": int(np.sum(clusterer.labels_ == c)),
            "share": float(clusterer.shares_[c]),
            "centroid": {f: float(v) for f, v in zip(clusterer.feature_names_in_, clusterer.centroids_[c])},
            "profile": None if g is None else {key: round(float(v), 6) for key, v in g.items()},
        })
    run = {"n_layers": int(L), "n_heads": int(H)}
    if features is not None:
        run.update(n_samples=int(features.n_samples), n_tokens=int(features.n_tokens),
                   model=features.meta.get("model"), corpus=features.meta.get("corpus"))
    return {
        "version": VERSION,
        "settings": {"k": int(clusterer.k), "method": clusterer.method,
                     "features": list(clusterer.feature_names_in_), "standardize": bool(clusterer.standardize),
                     "seed": int(clusterer.seed), "n_stability": int(clusterer.n_stability),
                     "subsample": float(clusterer.subsample)},
        "run": run,
        "heads": heads,
        "clusters": clusters,
        "stability": {"k": int(clusterer.k), "stability": _num(clusterer.stability_),
                      "silhouette": _num(clusterer.silhouette_), "n_stability": int(clusterer.n_stability),
                      "sweep": [{key: (_num(v) if isinstance(v, float) else v) for key, v in r.items()}
                                for r in sweep_rows] if sweep_rows is not None else None,
                      **({"over_seeds": seeds} if seeds is not None else {})},
    }


def save_clusters(run_dir, clusterer, features=None, sweep_rows=None, seeds=None) -> Path:
    path = ensure_writable_dir(run_dir, "run directory") / CLUSTERS_FILE
    write_json(path, clusters_dict(clusterer, features, sweep_rows, seeds))
    return path


def clusters_path(run_dir) -> Path:
    """RUN/clusters.json for a run directory; a path to a file is returned as it is."""
    path = Path(run_dir)
    return path / CLUSTERS_FILE if path.is_dir() or not path.suffix else path


def load_clusters(run_dir, shape: tuple[int, int] | None = None, *, complete: bool = False,
                  feature_names=None) -> dict:
    """The content of a run's clusters.json (`run_dir` may also be the file itself), validated.

    The file must follow `attnkit.schemas.CLUSTERS_SCHEMA` (with `complete`: CLUSTERS_REPORT_SCHEMA,
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
    seen = set()
    for i, h in enumerate(data["heads"]):
        where = f"{path}: field heads[{i}]"
        if h["layer"] >= L:
            raise AttnkitError(f"{where}.layer: layer {h['layer']} is out of range (the run has {L} layers)")
        if h["head"] >= H:
            raise AttnkitError(f"{where}.head: head {h['head']} is out of range (the run has {H} heads per layer)")
        if (h["layer"], h["head"]) in seen:
            raise AttnkitError(f"{where}: L{h['layer']}H{h['head']} appears twice")
        seen.add((h["layer"], h["head"]))
        if h["label"] not in labels:
            raise AttnkitError(f"{where}.label: label {h['label']} is none of the clusters' labels "
                               f"({', '.join(map(str, sorted(labels)))})")
        if h["type"] != labels[h["label"]]:
            raise AttnkitError(f"{where}.type: {h['type']!r} differs from the type of cluster {h['label']} "
                               f"({labels[h['label']]!r})")
    if len(seen) != L * H:
        raise AttnkitError(f"{path}: field heads: {len(seen)} heads listed, but the run has {L} × {H} = {L * H}")
    feats = data["settings"].get("features")
    if feats is not None:
        for i, c in enumerate(data["clusters"]):
            missing = [f for f in feats if "centroid" in c and f not in c["centroid"]]
            if missing:
                raise AttnkitError(f"{path}: field clusters[{i}].centroid: no value for {', '.join(missing)}")


def type_grid(data: dict) -> np.ndarray:
    """n_layers × n_heads array of type names from clusters.json content."""
    L, H = data["run"]["n_layers"], data["run"]["n_heads"]
    grid = np.empty((L, H), dtype=object)
    for h in data["heads"]:
        grid[h["layer"], h["head"]] = h["type"]
    return grid


def label_grid(data: dict) -> np.ndarray:
    L, H = data["run"]["n_layers"], data["run"]["n_heads"]
    grid = np.zeros((L, H), dtype=np.int64)
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


def compare(a: dict, b: dict) -> dict:
    """Compare two clusters.json contents of the same architecture by type name.

    Returns {"n_heads", "n_changed", "changed": [{"layer", "head", "a", "b"}], "transitions":
    {"a -> b": count}, "per_layer": {"a": type_distribution(a), "b": type_distribution(b)}}.
    Types are compared by name, so two runs must name their clusters with the same rules (they do:
    names come from the centroids, not from label ids). "reliable" is false when either run's clustering
    stability (`run_stability`) is below STABILITY_WARN (or unknown): its type changes may be an artefact of
    the clustering; "stability" gives both values and every changed head carries the same flag.
    """
    from .clustering import STABILITY_WARN

    ga, gb = type_grid(a), type_grid(b)
    if ga.shape != gb.shape:
        raise AttnkitError(f"cannot compare runs of different shapes: {ga.shape} vs {gb.shape} (layers × heads)")
    changed, transitions = [], {}
    for l in range(ga.shape[0]):
        for h in range(ga.shape[1]):
            if ga[l, h] != gb[l, h]:
                changed.append({"layer": l, "head": h, "a": ga[l, h], "b": gb[l, h]})
                key = f"{ga[l, h]} -> {gb[l, h]}"
                transitions[key] = transitions.get(key, 0) + 1
    stab = {"a": run_stability(a), "b": run_stability(b)}
    reliable = all(v is not None and v >= STABILITY_WARN for v in stab.values())
    for c in changed:
        c["reliable"] = reliable
    return {"n_heads": int(ga.size), "n_changed": len(changed), "changed": changed,
            "reliable": reliable, "stability": stab, "stability_threshold": STABILITY_WARN,
            "transitions": dict(sorted(transitions.items(), key=lambda kv: -kv[1])),
            "per_layer": {"a": type_distribution(a), "b": type_distribution(b)}}


__all__ = ["CLUSTERS_FILE", "clusters_dict", "save_clusters", "load_clusters", "check_clusters", "clusters_path", "type_grid", "label_grid",
           "type_distribution", "compare", "run_stability"]
