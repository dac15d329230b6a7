"""Running a corpus through a model (docs/pipeline.md): the pipeline. The jobs built on it (detect-heads, head
means, maps, comparisons, and the jobs behind `attnkit extract` and `attnkit distances`) are in attnkit/jobs/.

    plan          segments → length-sorted batches inside bounded windows (the same plan for every engine)
    forward       one measuring forward: features of every layer, observers attached
    local         this machine's engine: tokenisation workers, one thread per device replica
    tuning        the plan's workers and threads, measured and measured again as the run goes
    openmp        how torch's threads wait
    devices       which devices, and one model replica per device
    extract       `extract()` and the loop it shares with the extract job (`run_extraction`)
    distances     the Jensen-Shannon distance collector
    progress      the progress bars of long work
    ray/          the Ray Data engine (its shard files: attnkit/run/shards.py)

Ray is optional: `attnkit.engine.ray` is imported only when it is used. The names below are imported on first
use too (they pull in torch), so the command line can read `attnkit.engine.plan`'s constants cheaply.
"""
import importlib

_LAZY = {"DistanceCollector": "distances", "collect_distances": "distances", "js_distances": "distances",
         "ExtractionState": "extract", "ExtractSettings": "extract", "extract": "extract",
         "run_extraction": "extract", "default_batch_size": "forward", "forward_features": "forward",
         "measuring": "forward", "DEFAULT_WINDOW": "plan", "PlannedBatch": "plan", "plan_batches": "plan"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_LAZY)
