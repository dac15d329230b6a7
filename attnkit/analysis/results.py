"""Writing RUN/clusters.json from a fitted HeadClusterer, and comparing the head types of two runs.

The file's layout and its reader are attnkit/run/clusters.py (docs/files.md, "clusters.json"); the readers
are re-exported here, where `attnkit cluster` and `attnkit compare` found them before.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import AttnkitError
from ..features import weighting_of
from ..run.clusters import (
    CLUSTERS_FILE,
    REMOVED,
    VERSION,
    check_clusters,
    clusters_path,
    label_grid,
    load_clusters,
    run_stability,
    type_distribution,
    type_grid,
)
from ..run.outputs import ensure_writable_dir, json_float, write_json
from .clustering import STABILITY_WARN, stability_assessment
from .naming import class_shares, profile_groups


def clusters_dict(clusterer, features=None, sweep_rows=None, seeds=None) -> dict:
    """The clusters.json content of a fitted HeadClusterer (fitted on HeadFeatures)."""
    if getattr(clusterer, "grid_shape_", None) is None:
        raise AttnkitError("clusters.json needs a clusterer fitted on HeadFeatures (layers × heads)")
    L, H = clusterer.grid_shape_
    names = clusterer.type_names_
    heads = []
    kept = clusterer.kept_ if clusterer.kept_ is not None else np.ones(L * H, dtype=bool)
    kinds = getattr(features, "layer_kinds", None)
    for i, (m, lab) in enumerate(zip(np.flatnonzero(kept), clusterer.labels_)):
        heads.append({"layer": int(m // H), "head": int(m % H), "label": int(lab), "type": names[int(lab)],
                      "agreement": json_float(clusterer.head_stability_[i])})
        if kinds is not None:  # an encoder–decoder's run: the head's kind and layer within its kind
            heads[-1].update(kind=kinds[m // H][0], kind_layer=kinds[m // H][1])
    removed = [[int(m // H), int(m % H)] for m in np.flatnonzero(~kept)]
    clusters = []
    for c, name in enumerate(names):
        g = profile_groups(clusterer.profiles_[c], clusterer.profile_names_)
        if g is not None:  # and the classes its name is made of
            g.update(class_shares(g, getattr(clusterer, "decoder_", False)))
        clusters.append({
            "label": c, "type": name, "n_heads": int(np.sum(clusterer.labels_ == c)),
            "share": float(clusterer.shares_[c]),
            "centroid": {f: float(v) for f, v in zip(clusterer.feature_names_in_, clusterer.centroids_[c])},
            "profile": None if g is None else {key: round(float(v), 6) for key, v in g.items()},
        })
    run = {"n_layers": int(L), "n_heads": int(H)}
    if features is not None:
        run.update(n_samples=int(features.n_samples), n_tokens=int(features.n_tokens),
                   model=features.meta.get("model"), corpus=features.meta.get("corpus"),
                   weighting=weighting_of(features.meta))
    return {
        "version": VERSION,
        "settings": {"k": int(clusterer.k), "method": clusterer.method,
                     "features": list(clusterer.feature_names_in_), "standardize": bool(clusterer.standardize),
                     "seed": int(clusterer.seed), "n_stability": int(clusterer.n_stability),
                     "subsample": float(clusterer.subsample)},
        "run": run,
        **({"removed_heads": removed} if removed else {}),
        "heads": heads,
        "clusters": clusters,
        "stability": {"k": int(clusterer.k), "stability": json_float(clusterer.stability_),
                      "silhouette": json_float(clusterer.silhouette_), "n_stability": int(clusterer.n_stability),
                      "sweep": [{key: (json_float(v) if isinstance(v, float) else v) for key, v in r.items()}
                                for r in sweep_rows] if sweep_rows is not None else None,
                      **({"over_seeds": seeds} if seeds is not None else {}),
                      "assessment": stability_assessment(clusterer, seeds, sweep_rows,
                                                         None if features is None else int(features.n_samples))},
    }


def save_clusters(run_dir, clusterer, features=None, sweep_rows=None, seeds=None) -> Path:
    path = ensure_writable_dir(run_dir, "run directory") / CLUSTERS_FILE
    write_json(path, clusters_dict(clusterer, features, sweep_rows, seeds))
    return path


def compare(a: dict, b: dict) -> dict:
    """Compare two clusters.json contents of the same architecture by type name.

    Returns {"n_heads" (compared), "n_removed" (left out: removed by pruning in either run), "n_changed",
    "changed": [{"layer", "head", "a", "b"}], "transitions":
    {"a -> b": count}, "per_layer": {"a": type_distribution(a), "b": type_distribution(b)}}.
    Types are compared by name, so two runs must name their clusters with the same rules (they do:
    names come from the centroids, not from label ids). "reliable" is false when either run's clustering
    stability (`run_stability`) is below STABILITY_WARN (or unknown): its type changes may be an artefact of
    the clustering; "stability" gives both values and every changed head carries the same flag.
    """
    ga, gb = type_grid(a), type_grid(b)
    if ga.shape != gb.shape:
        raise AttnkitError(f"cannot compare runs of different shapes: {ga.shape} vs {gb.shape} (layers × heads)")
    removed = (ga == REMOVED) | (gb == REMOVED)  # a head a pruning removed in either run has no type to compare
    changed, transitions = [], {}
    for l in range(ga.shape[0]):
        for h in range(ga.shape[1]):
            if not removed[l, h] and ga[l, h] != gb[l, h]:
                changed.append({"layer": l, "head": h, "a": ga[l, h], "b": gb[l, h]})
                key = f"{ga[l, h]} -> {gb[l, h]}"
                transitions[key] = transitions.get(key, 0) + 1
    stab = {"a": run_stability(a), "b": run_stability(b)}
    reliable = all(v is not None and v >= STABILITY_WARN for v in stab.values())
    for c in changed:
        c["reliable"] = reliable
    return {"n_heads": int((~removed).sum()), "n_removed": int(removed.sum()), "n_changed": len(changed),
            "changed": changed,
            "reliable": reliable, "stability": stab, "stability_threshold": STABILITY_WARN,
            "transitions": dict(sorted(transitions.items(), key=lambda kv: -kv[1])),
            "per_layer": {"a": type_distribution(a), "b": type_distribution(b)}}


__all__ = ["CLUSTERS_FILE", "clusters_dict", "save_clusters", "load_clusters", "check_clusters", "clusters_path",
           "type_grid", "label_grid", "type_distribution", "compare", "run_stability"]
