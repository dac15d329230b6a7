"""The driver of the Ray engine: the plan's windows as shards, sent to Ray Data in groups, their per-batch sums
reduced into shard files and merged in shard order (the whole design: attnkit/engine/ray/__init__.py)."""
from __future__ import annotations

import os
import pickle
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ...corpus.images import ImageItem, absolute_item
from ...errors import AttnkitError, check_int
from ...features import PLAN, feature_names
from ...models import check_max_length, model_dir
from ...run.distances import HeadDistances
from ...run.head_features import FeatureAccumulator
from ...run.shards import SHAPE_KEYS, SUM_KEYS, ShardStore, add_sums, shard_dir
from ...tokens import Segment
from ..extract import ExtractSettings
from ..forward import DEFAULT_BATCH_SIZE
from ..plan import plan_window, windows
from .errors import ray_failure
from .session import import_ray, plan_actors, quiet_ray_data, ray_logs_aside, ray_session
from .workers import PID_DIR_ENV, ModelActor, tokenise, worker_env


def check_model_here(model_path: str | None, max_length: int, local: bool) -> None:
    """Fail before starting the cluster when the model is missing or too short for `max_length` (read from its
    config alone). On a remote cluster the path may exist only on the workers: checked there."""
    try:
        path = model_dir(model_path)
    except AttnkitError:
        if local:
            raise
        return
    if not os.path.isdir(path):
        if local:
            raise AttnkitError(f"model {path!r} not found: give a local directory holding a transformers model")
        return
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:
        raise AttnkitError(f"could not read the model config in {path!r}: {exc}") from None
    check_max_length(config, max_length)


def portable(segments) -> list:
    """A planned batch's segments as a Ray worker reads them: texts and pairs as they are, images with absolute
    paths (the worker decodes them, maybe in another working directory)."""
    return [absolute_item(s) if isinstance(s, ImageItem) else s for s in segments]


class Reduction:
    """Collects per-batch rows on the driver: de-duplicates them by (shard, batch), adds a shard's batches in
    batch order once they are all in, writes the shard file, and keeps the shard's sums for the final merge."""

    def __init__(self, kind: str, store: ShardStore, bar):
        self.kind, self.store, self.bar = kind, store, bar
        self.expected: dict[int, dict] = {}  # shard -> {"batches": [indices], "n_segments": n}
        self.partial: dict[int, dict] = {}  # shard -> {batch index: row}
        self.done: dict[int, dict] = {}  # shard -> sums
        self.shape: dict = {}
        self.tokens = 0
        self.duplicates = 0
        self.t0 = time.perf_counter()

    def expect(self, shard: int, batches: list[int], n_segments: int) -> None:
        self.expected[shard] = {"batches": batches, "n_segments": n_segments}
        self.partial[shard] = {}

    def add_row(self, row: dict) -> None:
        shard, batch = int(row["shard"]), int(row["batch"])
        exp = self.expected.get(shard)
        if exp is None or shard in self.done or batch in self.partial[shard]:
            self.duplicates += 1  # a retried task delivered twice, or a shard already finished: count it once
            return
        if batch not in exp["batches"]:
            raise AttnkitError(f"the Ray pipeline returned batch {batch}, which is not part of shard {shard}")
        self.partial[shard][batch] = {k: row[k] for k in SUM_KEYS[self.kind]}
        for k in SHAPE_KEYS:
            if k in row:
                self.shape[k] = int(row[k])
        self.tokens += int(row["n_tokens"])
        if self.bar is not None:
            dt = max(time.perf_counter() - self.t0, 1e-9)
            self.bar.set_postfix_str(f"tok/s={self.tokens / dt:,.0f}", refresh=False)
            self.bar.update(int(row["n_segments"]))
        if len(self.partial[shard]) == len(exp["batches"]):
            self._finish(shard)

    def _finish(self, shard: int) -> None:
        exp = self.expected.pop(shard)
        rows = self.partial.pop(shard)
        sums = None
        for b in exp["batches"]:  # batch order, as the in-process loop adds them
            sums = add_sums(sums, rows[b])
        sums |= {k: np.int64(v) for k, v in self.shape.items()}
        self.store.save(shard, sums, exp["n_segments"], len(exp["batches"]))
        self.done[shard] = sums

    def check_complete(self) -> None:
        if self.expected:
            shard, exp = next(iter(self.expected.items()))
            missing = sorted(set(exp["batches"]) - set(self.partial[shard]))
            raise AttnkitError(f"the Ray pipeline ended without batch {missing[0]} of shard {shard} "
                               f"({len(self.expected)} shard(s) incomplete); run again to measure what is missing")


class ShardedRun:
    """One run of the Ray pipeline over `segments`: `kind` "features" or "distances", measured under
    `settings`, its shard files in `run_dir` fingerprinted with `run_settings` (and the engine's own)."""

    def __init__(self, kind: str, segments: Iterable[Segment], settings: ExtractSettings, *, run_dir,
                 run_settings: dict, model_path, dtype, address, num_actors, cpus_per_actor, progress,
                 shards_per_group, rows_per_sample=None, seed=0):
        settings.check()
        if shards_per_group is not None:
            check_int(shards_per_group, "shards_per_group")
        if rows_per_sample is not None:
            check_int(rows_per_sample, "rows_per_sample")
        self.kind, self.segments, self.settings = kind, segments, settings
        self.run_dir, self.run_settings = run_dir, run_settings
        self.model_path, self.dtype, self.address = model_path, dtype, address
        self.num_actors, self.cpus_per_actor, self.progress = num_actors, cpus_per_actor, progress
        self.shards_per_group, self.rows_per_sample, self.seed = shards_per_group, rows_per_sample, seed
        self.total = None  # the sums of the shards merged so far, in shard order
        self.merged = 0  # shards merged into `total`
        self.n_shards = self.n_skipped = self.n_segments = self.n_batches = 0

    def store(self, batch_size: int) -> tuple[ShardStore, set[int]]:
        """The shard files of this run at this batch size, and the shards they hold (refusing files of other
        settings before any work starts)."""
        s = self.settings
        engine = {"kind": self.kind, "model": self.model_path, "dtype": self.dtype, "max_length": s.max_length,
                  "batch_size": batch_size, "window": s.window, "num_windows": s.num_windows,
                  "split_sentences": s.split_sentences, "backend": s.backend, "cpus_per_actor": self.cpus_per_actor,
                  "plan": PLAN}
        if self.kind == "distances":
            engine |= {"rows_per_sample": self.rows_per_sample, "seed": self.seed}
        store = ShardStore(shard_dir(self.run_dir, self.kind), {"settings": self.run_settings, "engine": engine},
                           self.kind)
        return store, store.finished()

    def run(self) -> tuple[dict, dict]:
        """(the merged sums, an info dict for meta.json)."""
        if self.settings.batch_size is not None:
            self.store(self.settings.batch_size)  # settings of other shard files are refused before Ray starts
        ray = import_ray()
        check_model_here(self.model_path, self.settings.max_length, local=self.address is None)
        with ray_logs_aside(), ray_session(self.address) as cluster, quiet_ray_data(ray):
            self.ray = ray
            self.n_actors, self.resources = plan_actors(ray, self.num_actors, self.cpus_per_actor)
            gpus = "num_gpus" in self.resources
            self.batch_size = self.settings.batch_size or DEFAULT_BATCH_SIZE["cuda" if gpus else "cpu"]
            self.shards, self.finished = self.store(self.batch_size)
            self.group_size = self.shards_per_group or max(4, 8 * self.n_actors)
            self.red = Reduction(self.kind, self.shards, self._bar())
            try:
                self._stream()
                if self.red.bar is not None:
                    self.red.bar.finish()
            finally:
                if self.red.bar is not None:
                    self.red.bar.close()
        if self.n_shards == 0:
            raise AttnkitError("no segments to measure")
        if self.merged != self.n_shards:
            raise AttnkitError(f"shard {self.merged} of {self.n_shards} was never measured; run again to finish it")
        info = {"engine": "ray", "shards": self.n_shards, "shards_skipped": self.n_skipped, "actors": self.n_actors,
                "cpus_per_actor": self.cpus_per_actor, "batch_size": self.batch_size, "ray_address": cluster,
                "window": self.settings.window, "shards_per_group": self.group_size, "n_segments": self.n_segments,
                "n_batches": self.n_batches, "duplicates_dropped": self.red.duplicates}
        return self.total, info

    def _bar(self):
        if not self.progress:
            return None
        from ..progress import segment_bar

        return segment_bar(f"{'extract' if self.kind == 'features' else 'distances'} (ray)", self.segments)

    def _merge_ready(self) -> None:
        """Merge, in shard order, the shards that are all in."""
        while self.merged in self.red.done:
            self.total = add_sums(self.total, self.red.done.pop(self.merged))
            self.merged += 1

    def _stream(self) -> None:
        """Read the corpus window by window: finished shards are loaded, the others planned and sent to the
        cluster in groups of `group_size` shards."""
        red = self.red
        rows: list[dict] = []
        pending = 0
        for k, chunk in enumerate(windows(self.segments, self.settings.window)):
            self.n_shards += 1
            planned = plan_window(chunk, self.batch_size, window_index=k, first_batch=self.n_batches,
                                  start=self.n_segments, grouped=True)
            if k in self.finished:
                red.done[k] = self.shards.load(k, len(chunk))
                self.n_skipped += 1
                self._merge_ready()
                if red.bar is not None:
                    red.bar.update(len(chunk))
                if rows and len(red.done) >= self.group_size:  # finished shards wait for the group before them
                    self._run_group(rows)
                    rows, pending = [], 0
            else:
                red.expect(k, [pb.index for pb in planned], len(chunk))
                rows.extend({"shard": k, "batch": pb.index, "n_segments": len(pb.segments),
                             "segments": pickle.dumps(portable(pb.segments), protocol=5)} for pb in planned)
                pending += 1
                if pending >= self.group_size:
                    self._run_group(rows)
                    rows, pending = [], 0
            self.n_segments += len(chunk)
            self.n_batches += len(planned)
        if rows:
            self._run_group(rows)

    def _run_group(self, rows: list[dict]) -> None:
        """One Ray Data execution over the planned batches of a group of shards."""
        s = self.settings
        tokenise_args = {"model_path": self.model_path, "max_length": s.max_length,
                         "split_sentences": s.split_sentences}
        actor_args = {"kind": self.kind, "model_path": self.model_path, "dtype": self.dtype,
                      "max_length": s.max_length, "backend": s.backend, "num_windows": s.num_windows,
                      "rows_per_sample": self.rows_per_sample, "seed": self.seed, "threads": self.cpus_per_actor,
                      "pid_dir": os.environ.get(PID_DIR_ENV) or None, "weighting": s.weighting,
                      "batch_size": self.batch_size}
        ray = self.ray
        ds = ray.data.from_items(rows, override_num_blocks=len(rows))  # one planned batch per block
        # for these tasks only (workers.py: worker_env); the cluster is this machine unless an address was given
        env = {"runtime_env": {"env_vars": worker_env(local=self.address is None)}}
        ds = ds.map_batches(tokenise, fn_kwargs=tokenise_args, batch_size=1, batch_format="numpy", num_cpus=1, **env)
        # the actors of a pool restart and their tasks are retried: Ray Data's defaults (see the package docstring)
        ds = ds.map_batches(ModelActor, fn_constructor_kwargs=actor_args, batch_size=1, batch_format="numpy",
                            compute=ray.data.ActorPoolStrategy(size=self.n_actors), **self.resources, **env)
        try:
            for block in ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=0):
                for i in range(len(block["shard"])):
                    self.red.add_row({k: v[i] for k, v in block.items()})
        except AttnkitError:
            raise
        except Exception as exc:
            raise AttnkitError("the Ray pipeline failed: " + ray_failure(exc).template) from None
        self.red.check_complete()
        self._merge_ready()


def run_ray_extraction(segments: Iterable[Segment], settings: ExtractSettings | None = None, *,
                       run_dir: Path, run_settings: dict, model_path: str | None = None, dtype: str = "float32",
                       address: str | None = None, num_actors: int | None = None, cpus_per_actor: int = 1,
                       shards_per_group: int | None = None, progress: bool = True
                       ) -> tuple[FeatureAccumulator, int, dict]:
    """Per-head feature sums of `segments` measured on a Ray cluster, shard by shard (the package docstring).

    Returns (the accumulator over the whole corpus, the number of truncated segments, an info dict for
    meta.json). `settings.batch_size` None: 64 when the cluster has GPUs, else 16 (as in-process). `model_path`
    None is the embedded MiniLM (resolved on each worker); the model and attnkit must be installed on every
    node. Finished shards are kept in RUN/shards and skipped by a rerun with the same `run_settings` (and engine
    settings); they are left in place (see `attnkit.run.shards.remove_shards`).
    """
    settings = settings or ExtractSettings()
    total, info = ShardedRun("features", segments, settings, run_dir=run_dir, run_settings=run_settings,
                             model_path=model_path, dtype=dtype, address=address, num_actors=num_actors,
                             cpus_per_actor=cpus_per_actor, progress=progress, shards_per_group=shards_per_group).run()
    L, H, F = total["sum"].shape
    # with a sink one more feature, with a patch grid (a vision transformer) six more, with alignment (an
    # encoder–decoder) two more: each count is one model's names
    names = next((n for n in (feature_names(settings.num_windows, sink=sink, grid=grid, alignment=alignment)
                              for sink in (False, True) for grid in (False, True) for alignment in (False, True))
                  if len(n) == F), feature_names(settings.num_windows))
    if F != len(names):
        raise AttnkitError(f"the actors returned {F} features per head, expected {len(names)}")
    acc = FeatureAccumulator(L, H, names)
    acc.add_moments(int(total["n_samples"]), np.asarray(total["sum"], np.float64),
                    np.asarray(total["m2"], np.float64), int(total["n_tokens"]))
    return acc, int(total["n_truncated"]), info


def run_ray_distances(segments: Iterable[Segment], settings: ExtractSettings | None = None, *,
                      run_dir: Path, run_settings: dict, rows_per_sample: int | None = None, seed: int = 0,
                      model_path: str | None = None, dtype: str = "float32", address: str | None = None,
                      num_actors: int | None = None, cpus_per_actor: int = 1, shards_per_group: int | None = None,
                      progress: bool = True) -> tuple[HeadDistances, dict]:
    """Jensen-Shannon distances between all heads over `segments` on a Ray cluster (what `attnkit distances`
    saves): the same pipeline as `run_ray_extraction`, each batch contributing its JS sums. Returns
    (`HeadDistances`, info dict). Finished shards are kept in RUN/distance-shards.

    With `rows_per_sample`, each batch samples its rows with a generator seeded by (seed, batch index), so the
    sample is reproducible and independent of the order batches finish in, but it is not the sample of the
    in-process collector (whose one generator runs through the batches in order). Without it the numbers equal
    the in-process collector's.
    """
    total, info = ShardedRun("distances", segments, settings or ExtractSettings(), run_dir=run_dir,
                             run_settings=run_settings, model_path=model_path, dtype=dtype, address=address,
                             num_actors=num_actors, cpus_per_actor=cpus_per_actor, progress=progress,
                             shards_per_group=shards_per_group, rows_per_sample=rows_per_sample, seed=seed).run()
    info = info | {"n_truncated": int(total["n_truncated"]), "n_samples": int(total["n_samples"]),
                   "n_tokens": int(total["n_tokens"])}
    dist = HeadDistances(total["js"], int(total["n_rows"]), int(total["n_layers"]), int(total["n_heads"]),
                         {"rows_per_sample": rows_per_sample, "n_batches": info["n_batches"], "engine": "ray"})
    return dist, info


__all__ = ["Reduction", "ShardedRun", "check_model_here", "run_ray_distances", "run_ray_extraction"]
