"""Extraction on a Ray cluster (`--engine ray`): the plan's windows become shards measured by Ray Data.

    driver: segments ─► windows of `window` segments (shard k = window k) ─► plan_window ─► planned batches
    Ray Data, one execution per group of shards:
        from_items(rows: shard, batch index, segments)          one block per planned batch
        ─► map_batches(tokenise)                               CPU tasks, a batch encoder (texts or images)
                                                                 built once per worker
        ─► map_batches(ModelActor, ActorPoolStrategy(size=n))   the instrumented model, num_gpus=1 per actor
                                                                 when the cluster has GPUs, CPU actors otherwise
        ─► per-batch sums (features: sum, m2, n_samples, n_tokens, n_truncated; distances: JS sums, rows)
    driver: sums of a shard added in batch order ─► RUN/<shards dir>/shard-000042.npz (atomic) ─► shards merged
            in shard order into one FeatureAccumulator (or one distance matrix)

Why the driver streams the plan instead of Ray Data's readers: a shard must hold exactly the batches that
`attnkit.engine.plan.plan_window` makes for window k of attnkit's own segment stream, because the fused op's
per-sample numbers depend on the batch's padded length (BLAS blocking): only identical batches give the
in-process numbers to 1e-12. Ray Data's text/JSON/CSV/Parquet readers parse differently from attnkit's readers
(paragraph units, GLUE quoting, SQuAD, empty rows, BOMs) and do not keep one global order cheaply, so the
segments are read once on the driver by attnkit's readers (streamed, one window at a time) and handed to Ray
Data in bounded groups of shards with `ray.data.from_items`. Driver memory is bounded by one group.

On a cluster with GPUs the two map stages stay apart (tokenisation tasks on CPUs feed the GPU actors). On a
CPU-only cluster their resources are equal and Ray Data fuses them, so each CPU actor tokenises its own batches
(a small share next to a CPU forward); a few CPUs are still left out of the actor pool so that the stages can
never starve each other if they are not fused.

The price of groups: each group is one Ray Data execution, so the model actors are started (and the model
loaded) once per group, and the last batches of a group leave some actors idle for a moment. Groups are
therefore large (`shards_per_group`, by default 8 shards per actor).

Resume: a finished shard's sums are written atomically with a fingerprint of the settings; a rerun with the same
settings skips them (their windows are read but neither sorted nor sent), a shard written under other settings
is refused. Fault tolerance: Ray Data (2.60) starts the actors of a pool with `max_restarts=-1` and
`max_task_retries=-1` (ActorPoolMapOperator._apply_default_remote_args), so a model actor that dies is restarted
and its batch retried; tokenisation tasks are retried by Ray core (`max_retries=3` for dead workers). Passing
these through `map_batches(**ray_remote_args)` is deprecated in Ray 2.60, so the defaults are relied on, and a
test kills an actor to hold them to it. The driver still de-duplicates results by (shard, batch index) and
refuses to finish a shard with a batch missing.

Threads: a model actor runs torch with exactly the CPUs it holds (`cpus_per_actor`, default 1), so it equals the
in-process loop run with that many threads (attnkit/engine/ray/workers.py says why).

Sums: a shard's batch sums are added in batch order, shards in shard order, so the totals equal the in-process
loop's batch-by-batch sums to float64 rounding (~1e-16 relative), the means likewise. The spread is kept as sums
of squared deviations merged pairwise (attnkit.run.head_features.merge_moments), not as sums of squares, so the
std too agrees to rounding, even where it is tiny next to the mean.

The driver is driver.py, what runs on the cluster workers.py, the Ray session and the actors' resources
session.py, the shard files attnkit/run/shards.py. Ray is an optional extra: nothing here imports it at module level.
"""
import importlib

from ...run.shards import remove_shards, shard_dir
from .session import check_ray_address, ray_session

# the driver and the workers import torch: imported on first use, so that checking a Ray address costs nothing
_LAZY = {"run_ray_distances": "driver", "run_ray_extraction": "driver", "PID_DIR_ENV": "workers"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["PID_DIR_ENV", "check_ray_address", "ray_session", "remove_shards", "run_ray_distances",
           "run_ray_extraction", "shard_dir"]
