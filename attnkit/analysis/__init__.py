"""Analysis of per-head features: head types by clustering (with stability), 2-D maps (MDS, t-SNE), pattern
types, Clark et al.'s summaries, figures and a self-contained HTML report (docs/analysis.md, docs/patterns.md).

    feats = attnkit.HeadFeatures.load("run")
    c = attnkit.cluster(feats, k=4)          # HeadClusterer: labels_, type_names_, stability_, ...

The analysis reads run files (attnkit.run); it runs no corpus through a model. The Jensen-Shannon distances it
maps are collected by the engine (attnkit/engine/distances.py) and saved in RUN/distances.npz
(attnkit/run/distances.py); both are re-exported here.
"""
import importlib

# every name is imported when first asked for: scikit-learn, torch (the distances) and matplotlib (figures, the
# report) load only then, and the command line reads the constants of a module here without them
_LAZY = {"DistanceCollector": "..engine.distances", "collect_distances": "..engine.distances",
         "js_distances": "..engine.distances", "HeadDistances": "..run.distances", "HeadClusterer": "clustering",
         "cluster": "clustering", "match_labels": "clustering", "stability_over_seeds": "clustering",
         "sweep": "clustering", "name_clusters": "naming", "build_report": "report", "mds": "embedding",
         "tsne": "embedding", "compare": "results", "load_clusters": "results", "save_clusters": "results",
         "classify": "patterns", "class_counts": "patterns", "run_patterns": "patterns", "examples_of": "patterns",
         "layer_summaries": "summaries", "threshold_heads": "summaries", "paper_differences": "summaries"}


def __getattr__(name):
    if name in _LAZY:
        where = _LAZY[name]
        module = importlib.import_module(where, __name__) if where.startswith(".") else \
            importlib.import_module(f"{__name__}.{where}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_LAZY)
