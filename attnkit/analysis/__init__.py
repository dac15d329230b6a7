"""Analysis of per-head features: head types by clustering (with stability), 2-D maps (MDS, t-SNE), pattern
types, Clark et al.'s summaries, figures and a self-contained HTML report (docs/analysis.md, docs/patterns.md).

    feats = attnkit.HeadFeatures.load("run")
    c = attnkit.cluster(feats, k=4)          # HeadClusterer: labels_, type_names_, stability_, ...

The analysis reads run files (attnkit.run); it runs no corpus through a model. The Jensen-Shannon distances it
maps are collected by the engine (attnkit/engine/distances.py) and saved in RUN/distances.npz
(attnkit/run/distances.py); both are re-exported here.
"""
import importlib

from ..engine.distances import DistanceCollector, collect_distances, js_distances
from ..run.distances import HeadDistances
from .clustering import HeadClusterer, cluster, match_labels, stability_over_seeds, sweep
from .naming import name_clusters

# figures, the report, maps and patterns pull in matplotlib: their names are imported when first asked for
_LAZY = {"build_report": "report", "mds": "embedding", "tsne": "embedding", "compare": "results",
         "load_clusters": "results", "save_clusters": "results", "classify": "patterns", "class_counts": "patterns",
         "run_patterns": "patterns", "layer_summaries": "summaries", "threshold_heads": "summaries",
         "paper_differences": "summaries"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["HeadClusterer", "cluster", "sweep", "match_labels", "name_clusters", "DistanceCollector",
           "HeadDistances", "collect_distances", "js_distances", "build_report", "mds", "tsne", "compare",
           "load_clusters", "save_clusters", "stability_over_seeds", "classify", "class_counts", "run_patterns",
           "layer_summaries", "threshold_heads", "paper_differences"]
