"""Analysis of per-head features: head types by clustering (with stability), Jensen-Shannon distances
between heads, 2-D maps (MDS, t-SNE), figures and a self-contained HTML report.

    feats = attnkit.HeadFeatures.load("run")
    c = attnkit.cluster(feats, k=4)          # HeadClusterer: labels_, type_names_, stability_, ...
"""
from .clustering import HeadClusterer, cluster, match_labels, stability_over_seeds, sweep
from ..engine.distances import DistanceCollector, HeadDistances, collect_distances, js_distances
from .naming import name_clusters


def __getattr__(name):
    # figures/report pull in matplotlib: import them only when asked for
    if name == "build_report":
        from .report import build_report

        return build_report
    if name in ("mds", "tsne"):
        from . import embedding

        return getattr(embedding, name)
    if name in ("compare", "load_clusters", "save_clusters"):
        from . import results

        return getattr(results, name)
    if name in ("classify", "class_counts", "run_patterns"):
        from . import patterns

        return getattr(patterns, name)
    if name in ("layer_summaries", "threshold_heads", "paper_differences"):
        from . import summaries

        return getattr(summaries, name)
    raise AttributeError(f"module 'attnkit.analysis' has no attribute {name!r}")

__all__ = ["HeadClusterer", "cluster", "sweep", "match_labels", "name_clusters", "DistanceCollector",
           "HeadDistances", "collect_distances", "js_distances", "build_report", "mds", "tsne", "compare",
           "load_clusters", "save_clusters", "stability_over_seeds", "classify", "class_counts", "run_patterns",
           "layer_summaries", "threshold_heads", "paper_differences"]
