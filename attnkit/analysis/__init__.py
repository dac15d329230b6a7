"""Analysis of per-head features: head types by clustering (with stability), Jensen-Shannon distances
between heads, 2-D maps (MDS, t-SNE), figures and a self-contained HTML report.

    feats = attnkit.HeadFeatures.load("run")
    c = attnkit.cluster(feats, k=4)          # HeadClusterer: labels_, type_names_, stability_, ...
"""
from .clustering import HeadClusterer, cluster, match_labels, sweep
from .distances import DistanceCollector, HeadDistances, collect_distances, js_distances
from .naming import name_clusters

__all__ = ["HeadClusterer", "cluster", "sweep", "match_labels", "name_clusters", "DistanceCollector",
           "HeadDistances", "collect_distances", "js_distances"]
