"""Running a corpus through a model (docs/pipeline.md).

    plan          segments → length-sorted batches inside bounded windows (the same plan for every engine)
    forward       one measuring forward: features of every layer, observers attached
    local         this machine's engine: tokenisation workers, one thread per device replica
    devices       which devices, and one model replica per device
    head_means    the mean output of every head over a corpus (mean ablation)
    extract       `extract()` and the loop it shares with the extract job (`run_extraction`)
    distances     the Jensen-Shannon distance collector
    compare       two models compared head by head, batch by batch
    ray/          the Ray Data engine (its shard files: attnkit/run/shards.py)
    extract_job, distances_job
                  the jobs behind `attnkit extract` and `attnkit distances`: they report through a callback and
                  never import click

Ray is optional: `attnkit.engine.ray` is imported only when it is used. The names below are imported on first
use too (they pull in torch), so the command line can read `attnkit.engine.plan`'s constants cheaply.
"""
import importlib

_LAZY = {"ModelComparison": "compare", "PairedCollector": "compare", "compare_models": "compare",
         "similarity_sums": "compare", "DistanceCollector": "distances", "collect_distances": "distances",
         "js_distances": "distances", "ExtractionState": "extract", "ExtractSettings": "extract", "extract": "extract",
         "run_extraction": "extract", "default_batch_size": "forward", "forward_features": "forward",
         "measuring": "forward", "DEFAULT_WINDOW": "plan", "PlannedBatch": "plan", "plan_batches": "plan",
         "AttentionMaps": "maps", "attention_maps": "maps", "head_means": "head_means"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_LAZY)
