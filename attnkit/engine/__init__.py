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

Ray is optional: `attnkit.engine.ray` is imported only when it is used.
"""
from .compare import ModelComparison, PairedCollector, compare_models, similarity_sums
from .distances import DistanceCollector, collect_distances, js_distances
from .extract import ExtractionState, ExtractSettings, extract, run_extraction
from .forward import default_batch_size, forward_features, measuring
from .head_means import head_means
from .plan import DEFAULT_WINDOW, PlannedBatch, plan_batches

__all__ = ["DEFAULT_WINDOW", "DistanceCollector", "ExtractSettings", "ExtractionState", "ModelComparison",
           "PairedCollector", "PlannedBatch", "collect_distances", "compare_models", "default_batch_size", "extract",
           "forward_features", "head_means", "js_distances", "measuring", "plan_batches", "run_extraction",
           "similarity_sums"]
