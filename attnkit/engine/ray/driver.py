"""Extraction on a Ray cluster (`--engine ray`): the plan's windows become shards measured by Ray Data.

    driver: segments ─► windows of `window` segments (shard k = window k) ─► plan_window ─► planned batches
    Ray Data, one execution per group of shards:
        from_items(rows: shard, batch index, segments)          one block per planned batch
        ─► map_batches(_tokenise)                              CPU tasks, attnkit Encoder built once per worker
        ─► map_batches(_ModelActor, ActorPoolStrategy(size=n))  the instrumented model, num_gpus=1 per actor
                                                                 when the cluster has GPUs, CPU actors otherwise
        ─► per-batch sums (features: sum, m2, n_samples, n_tokens, n_truncated; distances: JS sums, rows)
    driver: sums of a shard added in batch order ─► RUN/<shards dir>/shard-000042.npz (atomic) ─► shards merged
            in shard order into one FeatureAccumulator (or one distance matrix)

Why the driver streams the plan instead of Ray Data's readers: a shard must hold exactly the batches that
`attnkit.batching.plan_window` makes for window k of attnkit's own segment stream, because the fused op's
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

Threads: on CPU, the per-sample numbers of a forward can depend on torch's intra-op thread count (seen here: a
batch of one MiniLM sample differs by ~1e-7 between 1 and 2 threads, BLAS blocking thin matmuls differently), so
a model actor runs torch with exactly the CPUs it holds (`cpus_per_actor`, default 1) and equals the in-process
loop run with that many threads.

Sums: a shard's batch sums are added in batch order, shards in shard order, so the totals equal the in-process
loop's batch-by-batch sums to float64 rounding (~1e-16 relative), the means likewise. The spread is kept as sums
of squared deviations merged pairwise (head_features.merge_moments), not as sums of squares, so the std too
agrees to rounding, even where it is tiny next to the mean.

Ray is an optional extra: nothing here imports it at module level.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pickle
import re
import time
from pathlib import Path
from typing import Iterable

import numpy as np

from ..plan import DEFAULT_WINDOW, check_plan_settings, plan_window, windows
from ...errors import AttnkitError
from ...features import check_num_windows, feature_names
from ...run.head_features import FeatureAccumulator, atomic_write, batch_moments, merge_moments
from ...tokens import Segment

FEATURE_SHARDS_DIR = "shards"
DISTANCE_SHARDS_DIR = "distance-shards"
# Each model actor writes its pid to a file in this directory when it starts (for tests and operators that
# want to find the processes, e.g. to check fault tolerance by killing one).
PID_DIR_ENV = "ATTNKIT_RAY_PID_DIR"
INSTALL_HINT = "pip install 'attnkit[distributed]'"

# What a batch contributes, per kind of run: summed in batch order within a shard, then over shards.
_SUM_KEYS = {
    "features": ("sum", "m2", "n_samples", "n_tokens", "n_truncated"),
    "distances": ("js", "n_rows", "n_samples", "n_tokens", "n_truncated"),
}
_SHARD_DIRS = {"features": FEATURE_SHARDS_DIR, "distances": DISTANCE_SHARDS_DIR}


def import_ray():
    """`ray` with Ray Data, or an AttnkitError saying how to install it."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise AttnkitError(f"the ray engine needs Ray Data, which is not installed: {INSTALL_HINT}") from None
    return ray


def settings_fingerprint(settings: dict) -> str:
    """sha256 of the settings as canonical JSON: what a shard file must match to be reused."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()


# --- shard files --------------------------------------------------------------------------------------------
class ShardStore:
    """RUN/<dir>/shard-000042.npz: one finished shard's sums, with the settings they were measured under."""

    def __init__(self, directory: Path, settings: dict, kind: str):
        self.directory = Path(directory)
        self.settings = settings
        self.fingerprint = settings_fingerprint(settings)
        self.kind = kind

    def path(self, shard: int) -> Path:
        return self.directory / f"shard-{shard:06d}.npz"

    def finished(self) -> set[int]:
        """Shards with a file, after checking that every file was written under these settings."""
        out = set()
        if not self.directory.is_dir():
            return out
        for p in sorted(self.directory.glob("shard-*.npz")):
            try:
                shard = int(p.stem.split("-", 1)[1])
            except ValueError:
                continue
            self._read(p, check_only=True)
            out.add(shard)
        return out

    def _read(self, path: Path, check_only: bool = False) -> dict:
        try:
            with np.load(path, allow_pickle=False) as z:
                fingerprint = str(z["fingerprint"])
                saved = json.loads(str(z["settings"]))
                data = None if check_only else {k: z[k] for k in z.files}
        except Exception as exc:
            raise AttnkitError(f"shard file {path} is unreadable or corrupt ({type(exc).__name__}: {exc}); "
                               "delete it to measure that shard again") from None
        if fingerprint != self.fingerprint:
            keys = sorted(set(_flatten(saved)) | set(_flatten(self.settings)))
            diffs = [f"{k}: {_flatten(saved).get(k)!r} then, {_flatten(self.settings).get(k)!r} now"
                     for k in keys if _flatten(saved).get(k) != _flatten(self.settings).get(k)]
            raise AttnkitError(f"shard file {path} was written under other settings ("
                               + ("; ".join(diffs) or "fingerprint differs")
                               + "): use another run directory, or delete " + str(self.directory))
        return data

    def load(self, shard: int, n_segments: int) -> dict:
        path = self.path(shard)
        data = self._read(path)
        if int(data["n_segments"]) != n_segments:
            raise AttnkitError(f"shard file {path} holds {int(data['n_segments'])} segments but window {shard} of "
                               f"the corpus has {n_segments}: the corpus changed; delete {self.directory}")
        return {k: data[k] for k in _SUM_KEYS[self.kind]} | {k: data[k] for k in ("n_layers", "n_heads") if k in data}

    def save(self, shard: int, sums: dict, n_segments: int, n_batches: int) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        state = {k: np.asarray(v) for k, v in sums.items()}
        state.update(n_segments=np.int64(n_segments), n_batches=np.int64(n_batches), kind=np.array(self.kind),
                     fingerprint=np.array(self.fingerprint),
                     settings=np.array(json.dumps(self.settings, sort_keys=True, default=str)))
        atomic_write(self.path(shard), lambda f: np.savez(f, **state))


def add_sums(total: dict | None, part: dict) -> dict:
    """`total` plus one more batch's or shard's sums. Feature moments merge as counts, sums and sums of squared
    deviations (head_features.merge_moments); other summable keys add; the rest (shape) are taken as they are."""
    part = {k: np.array(v) for k, v in part.items()}
    if total is None:
        return part
    out = {k: (total[k] + part[k]) if k in _ADDED else part[k] for k in part}
    if "m2" in part:
        n, out["sum"], out["m2"] = merge_moments(int(total["n_samples"]), total["sum"], total["m2"],
                                                 int(part["n_samples"]), part["sum"], part["m2"])
        out["n_samples"] = np.int64(n)
    return out


_ADDED = {"sum", "n_samples", "n_tokens", "n_truncated", "js", "n_rows"}


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def shard_dir(run_dir, kind: str = "features") -> Path:
    """Where a run keeps its finished shards (features: RUN/shards, distances: RUN/distance-shards)."""
    return Path(run_dir) / _SHARD_DIRS[kind]


def remove_shards(run_dir, kind: str = "features") -> None:
    """Delete a run's shard files (after the run was saved, or before starting over with --overwrite)."""
    d = shard_dir(run_dir, kind)
    if d.is_dir():
        for p in d.glob("shard-*.npz"):
            p.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            d.rmdir()


# --- what runs on the cluster -------------------------------------------------------------------------------
_encoders: dict = {}


def _encoder(model_path: str | None, max_length: int, split_sentences: bool):
    """The attnkit Encoder of this worker process (built on first use, then reused by every batch)."""
    key = (model_path, max_length, split_sentences)
    if key not in _encoders:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        from transformers import AutoTokenizer

        from ...models import default_model_path
        from ...tokens import Encoder

        path = model_path or default_model_path()
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except Exception as exc:
            raise AttnkitError(f"could not load the tokenizer of {path!r} on a Ray worker: {exc}") from None
        _encoders[key] = Encoder(tokenizer, max_length=max_length, split_sentences=split_sentences)
    return _encoders[key]


def _tokenise(rows: dict, *, model_path, max_length, split_sentences) -> dict:
    """Ray Data stage: planned batches (segments as JSON) → pickled `EncodedArrays`."""
    enc = _encoder(model_path, max_length, split_sentences)
    encoded = [pickle.dumps(enc.encode_arrays(json.loads(str(s))), protocol=5) for s in rows["segments"]]
    return {"shard": rows["shard"], "batch": rows["batch"], "n_segments": rows["n_segments"],
            "encoded": np.array(encoded, dtype=object)}


class _ModelActor:
    """Ray Data stage held by each actor of the pool: the instrumented model; per batch, its sums."""

    def __init__(self, *, kind, model_path, dtype, max_length, backend, num_windows, rows_per_sample, seed,
                 threads, pid_dir=None):
        import torch

        torch.set_num_threads(threads)  # the CPUs the actor holds (see the module docstring)

        import attnkit  # noqa: F401  (registers the attention implementation)
        from ..extract import check_max_length
        from ...models import attention_modules, load_model
        from ...ops import resolve_backend

        with contextlib.suppress(Exception):
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
            hf_logging.set_verbosity_error()
        device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "cpu"
        self.model, _ = load_model(model_path, device=device, dtype=dtype)
        check_max_length(self.model, max_length)
        resolve_backend(backend, device)
        self.device = next(self.model.parameters()).device
        self.kind, self.backend, self.num_windows = kind, backend, num_windows
        self.rows_per_sample, self.seed = rows_per_sample, seed
        self.n_layers = len(attention_modules(self.model))
        self.n_heads = self.model.config.num_attention_heads
        if pid_dir:
            Path(pid_dir).mkdir(parents=True, exist_ok=True)
            (Path(pid_dir) / f"{os.getpid()}.pid").write_text(str(os.getpid()))

    def __call__(self, rows: dict) -> dict:
        out: dict = {"shard": rows["shard"], "batch": rows["batch"], "n_segments": rows["n_segments"]}
        per_row = [self._measure(pickle.loads(e), int(b)) for e, b in zip(rows["encoded"], rows["batch"])]
        for key in per_row[0]:
            out[key] = np.stack([r[key] for r in per_row])
        return out

    def _measure(self, arrays, batch_index: int) -> dict:
        import torch

        from ..extract import _observing, forward_features, measuring
        from ...models import runtime_of
        from ...tokens import Batch

        batch = Batch.from_arrays(arrays).to(self.device)
        observers = []
        if self.kind == "distances":
            from ..distances import DistanceCollector

            collector = DistanceCollector(self.n_layers, rows_per_sample=self.rows_per_sample)
            if self.rows_per_sample is not None:  # a sample of rows that depends on nothing but (seed, batch)
                seed = int(np.random.SeedSequence([self.seed, batch_index]).generate_state(1)[0])
                collector.generator = torch.Generator().manual_seed(seed)
            observers.append(collector)
        with measuring(self.model, backend=self.backend, num_windows=self.num_windows) as rt, \
                _observing(runtime_of(self.model), observers):
            feats = forward_features(self.model, batch, rt).numpy()
        common = {"n_samples": np.int64(feats.shape[0]), "n_tokens": np.int64(arrays.n_tokens),
                  "n_truncated": np.int64(arrays.n_truncated)}
        if self.kind == "distances":
            res = collector.result()
            return {"js": res.total, "n_rows": np.int64(res.n_rows), "n_layers": np.int64(self.n_layers),
                    "n_heads": np.int64(self.n_heads), **common}
        _, total, m2 = batch_moments(feats)  # what FeatureAccumulator.update computes of a batch
        return {"sum": total, "m2": m2, **common}


# --- the driver ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def ray_session(address: str | None):
    """Yield a label of the cluster in use. An already initialised Ray is used as it is (and left running);
    otherwise `address=None` starts a local cluster and anything else connects to one ("auto",
    "host:6379", "ray://host:10001"); both are shut down at the end."""
    ray = import_ray()
    if ray.is_initialized():
        yield address or "connected"
        return
    kwargs = {"logging_level": logging.ERROR}
    try:
        if address is None:
            ray.init(include_dashboard=False, **kwargs)
        else:
            ray.init(address=address, **kwargs)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        where = f"the Ray cluster at {address!r}" if address else "a local Ray cluster"
        raise AttnkitError(f"could not start or reach {where}: {first}") from None
    try:
        yield address or "local"
    finally:
        ray.shutdown()


@contextlib.contextmanager
def _quiet_ray_data_logs():
    """Ray Data announces every execution and that its progress bars are off (the driver shows its own)."""
    logger = logging.getLogger("ray.data")
    saved = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(saved)


def _actor_plan(ray, num_actors: int | None, cpus_per_actor: int) -> tuple[int, dict]:
    """How many model actors, and the resources of each: one GPU (and `cpus_per_actor` CPUs) each when the
    cluster has GPUs, else `cpus_per_actor` CPUs each, leaving CPUs for the tokenisation tasks."""
    res = ray.cluster_resources()
    gpus, cpus = int(res.get("GPU", 0)), int(res.get("CPU", 0))
    for name, value in (("number of Ray actors", num_actors), ("CPUs per actor", cpus_per_actor)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise AttnkitError(f"the {name} must be a positive integer, got {value!r}")
    if gpus:
        return (num_actors or gpus), {"num_gpus": 1, "num_cpus": cpus_per_actor}
    spare = cpus - cpus_per_actor
    if spare < 1:
        raise AttnkitError(f"the Ray cluster has {cpus} CPU(s) and no GPU: a model actor of {cpus_per_actor} "
                           "CPU(s) would leave none for tokenisation")
    n = num_actors or max(1, (cpus - max(1, cpus // 8)) // cpus_per_actor)
    if n * cpus_per_actor > cpus - 1:
        raise AttnkitError(f"{n} CPU model actors of {cpus_per_actor} CPU(s) would take every CPU of the cluster "
                           f"({cpus}), leaving none for tokenisation: use at most {spare // cpus_per_actor}")
    return n, {"num_cpus": cpus_per_actor}


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _one_line(exc: BaseException) -> str:
    """The message of an exception raised through Ray: the AttnkitError inside it when there is one (Ray
    carries a remote error as a traceback in its message), else the first line."""
    chain, cur = [], exc
    while cur is not None and all(cur is not c for c in chain):
        chain.append(cur)
        cur = getattr(cur, "cause", None) or cur.__cause__ or cur.__context__
    for e in chain:
        if isinstance(e, AttnkitError):
            return str(e)
    for e in chain:
        found = re.findall(r"AttnkitError: (.+)", _ANSI.sub("", str(e)))
        if found:
            return found[-1].strip()
    for e in chain:  # the remote exception's own last line, e.g. "ValueError: ..." under a traceback
        found = [m for m in re.findall(r"^\s*([\w.]+(?:Error|Exception)): (.+)$", _ANSI.sub("", str(e)), re.M)
                 if not m[0].startswith(("ray.", "Ray", "UserCodeException", "SystemException"))]
        if found:
            return f"{found[-1][0].rsplit('.', 1)[-1]}: {found[-1][1].strip()}"
    lines = [l.strip() for l in _ANSI.sub("", str(exc)).splitlines() if l.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _check_model_here(model_path: str | None, max_length: int, local: bool) -> None:
    """Fail before starting the cluster when the model is missing or too short for `max_length` (read from its
    config alone). On a remote cluster the path may exist only on the workers: checked there."""
    from ...models import default_model_path, max_positions

    try:
        path = model_path or default_model_path()
    except AttnkitError:
        if local:
            raise
        return
    if not os.path.isdir(path):
        if local:
            raise AttnkitError(f"model {path!r} not found: give a local directory holding a transformers model")
        return
    from types import SimpleNamespace

    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:
        raise AttnkitError(f"could not read the model config in {path!r}: {exc}") from None
    limit = max_positions(SimpleNamespace(config=config))
    if limit is not None and max_length > limit:
        raise AttnkitError(f"max length {max_length} exceeds the model's {limit} positions ({config.model_type})")


class _Reduction:
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
        self.partial[shard][batch] = {k: row[k] for k in _SUM_KEYS[self.kind]}
        for k in ("n_layers", "n_heads"):
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


def _run(kind: str, segments: Iterable[Segment], *, model_path, dtype, max_length, batch_size, window, num_windows,
         split_sentences, backend, run_dir, settings, address, num_actors, cpus_per_actor, progress,
         shards_per_group, rows_per_sample=None, seed=0):
    check_plan_settings(1 if batch_size is None else batch_size, window)
    check_num_windows(num_windows)
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
        raise AttnkitError(f"max_length must be an integer of at least 2, got {max_length!r}")
    if shards_per_group is not None and (not isinstance(shards_per_group, int) or shards_per_group < 1):
        raise AttnkitError(f"shards_per_group must be a positive integer, got {shards_per_group!r}")

    def shard_store(batch_size: int) -> tuple[ShardStore, set[int]]:
        engine = {"kind": kind, "model": model_path, "dtype": dtype, "max_length": max_length,
                  "batch_size": batch_size, "window": window, "num_windows": num_windows,
                  "split_sentences": split_sentences, "backend": backend, "cpus_per_actor": cpus_per_actor}
        if kind == "distances":
            engine |= {"rows_per_sample": rows_per_sample, "seed": seed}
        store = ShardStore(shard_dir(run_dir, kind), {"settings": settings, "engine": engine}, kind)
        return store, store.finished()  # refuses shards of other settings before any work starts

    if batch_size is not None:
        store, finished = shard_store(batch_size)
    ray = import_ray()
    _check_model_here(model_path, max_length, local=address is None)
    pid_dir = os.environ.get(PID_DIR_ENV) or None

    with ray_session(address) as cluster, _quiet_ray_data_logs():
        n_actors, resources = _actor_plan(ray, num_actors, cpus_per_actor)
        if batch_size is None:  # the in-process defaults: 64 on GPUs, 16 on CPUs
            batch_size = 64 if "num_gpus" in resources else 16
            store, finished = shard_store(batch_size)
        group_size = shards_per_group or max(4, 8 * n_actors)
        ctx = ray.data.DataContext.get_current()
        saved_ctx = (ctx.enable_progress_bars, ctx.print_on_execution_start)
        ctx.enable_progress_bars, ctx.print_on_execution_start = False, False
        bar = None
        if progress:
            from tqdm.auto import tqdm

            total = len(segments) if hasattr(segments, "__len__") else None
            bar = tqdm(total=total, unit="seg", desc=f"{'extract' if kind == 'features' else 'distances'} (ray)",
                       dynamic_ncols=True)
        red = _Reduction(kind, store, bar)
        tokenise_args = {"model_path": model_path, "max_length": max_length, "split_sentences": split_sentences}
        actor_args = {"kind": kind, "model_path": model_path, "dtype": dtype, "max_length": max_length,
                      "backend": backend, "num_windows": num_windows, "rows_per_sample": rows_per_sample,
                      "seed": seed, "threads": cpus_per_actor, "pid_dir": pid_dir}

        def run_group(rows: list[dict]) -> None:
            ds = ray.data.from_items(rows, override_num_blocks=len(rows))  # one planned batch per block
            ds = ds.map_batches(_tokenise, fn_kwargs=tokenise_args, batch_size=1, batch_format="numpy", num_cpus=1)
            # the actors of a pool restart and their tasks are retried: Ray Data's defaults (see the docstring)
            ds = ds.map_batches(_ModelActor, fn_constructor_kwargs=actor_args, batch_size=1, batch_format="numpy",
                                compute=ray.data.ActorPoolStrategy(size=n_actors), **resources)
            try:
                for block in ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=0):
                    for i in range(len(block["shard"])):
                        red.add_row({k: v[i] for k, v in block.items()})
            except AttnkitError:
                raise
            except Exception as exc:
                raise AttnkitError(f"the Ray pipeline failed: {_one_line(exc)}") from None
            red.check_complete()

        merged = {"total": None, "next": 0}  # shards are merged in shard order as soon as they are all in

        def merge_ready() -> None:
            while merged["next"] in red.done:
                s = red.done.pop(merged["next"])
                merged["total"] = add_sums(merged["total"], s)
                merged["next"] += 1

        n_shards = n_skipped = n_segments = n_batches = 0
        rows: list[dict] = []
        pending = 0
        try:
            for k, chunk in enumerate(windows(segments, window)):
                n_shards += 1
                if k in finished:
                    red.done[k] = store.load(k, len(chunk))
                    n_skipped += 1
                    merge_ready()
                    if bar is not None:
                        bar.update(len(chunk))
                    if rows and len(red.done) >= group_size:  # finished shards wait for the group before them
                        run_group(rows)
                        merge_ready()
                        rows, pending = [], 0
                else:
                    planned = plan_window(chunk, batch_size, window_index=k, first_batch=n_batches, start=n_segments)
                    red.expect(k, [pb.index for pb in planned], len(chunk))
                    rows.extend({"shard": k, "batch": pb.index, "n_segments": len(pb.segments),
                                 "segments": json.dumps([s if isinstance(s, str) else list(s) for s in pb.segments],
                                                        ensure_ascii=False)} for pb in planned)
                    pending += 1
                    if pending >= group_size:
                        run_group(rows)
                        merge_ready()
                        rows, pending = [], 0
                n_segments += len(chunk)
                n_batches += -(-len(chunk) // batch_size)
            if rows:
                run_group(rows)
                merge_ready()
        finally:
            if bar is not None:
                bar.close()
            ctx.enable_progress_bars, ctx.print_on_execution_start = saved_ctx
        if n_shards == 0:
            raise AttnkitError("no segments to measure")
        if merged["next"] != n_shards:
            raise AttnkitError(f"shard {merged['next']} of {n_shards} was never measured; run again to finish it")
        total = merged["total"]
        info = {"engine": "ray", "shards": n_shards, "shards_skipped": n_skipped, "actors": n_actors,
                "cpus_per_actor": cpus_per_actor, "batch_size": batch_size,
                "ray_address": cluster, "window": window, "shards_per_group": group_size, "n_segments": n_segments, "n_batches": n_batches,
                "duplicates_dropped": red.duplicates}
    return total, info


def run_ray_extraction(segments: Iterable[Segment], *, model_path: str | None, dtype: str = "float32",
                       max_length: int = 128, batch_size: int | None = 16, window: int = DEFAULT_WINDOW,
                       num_windows: int = 16, split_sentences: bool = False, backend: str = "auto",
                       run_dir: Path, settings: dict, address: str | None = None, num_actors: int | None = None,
                       progress: bool = True, cpus_per_actor: int = 1, shards_per_group: int | None = None
                       ) -> tuple[FeatureAccumulator, int, dict]:
    """Per-head feature sums of `segments` measured on a Ray cluster, shard by shard (see the module docstring).

    Returns (the accumulator over the whole corpus, the number of truncated segments, an info dict for
    meta.json). `batch_size` None: 64 when the cluster has GPUs, else 16 (as in-process). `model_path` None is the embedded MiniLM (resolved on each worker); the model and attnkit must
    be installed on every node. Finished shards are kept in RUN/shards and skipped by a rerun with the same
    `settings` (and engine settings); they are left in place (see `remove_shards`).
    """
    total, info = _run("features", segments, model_path=model_path, dtype=dtype, max_length=max_length,
                       batch_size=batch_size, window=window, num_windows=num_windows, split_sentences=split_sentences,
                       backend=backend, run_dir=run_dir, settings=settings, address=address, num_actors=num_actors,
                       cpus_per_actor=cpus_per_actor, progress=progress, shards_per_group=shards_per_group)
    L, H, F = total["sum"].shape
    names = feature_names(num_windows)
    if F != len(names):
        raise AttnkitError(f"the actors returned {F} features per head, expected {len(names)}")
    acc = FeatureAccumulator(L, H, names)
    acc.add_moments(int(total["n_samples"]), np.asarray(total["sum"], np.float64),
                    np.asarray(total["m2"], np.float64), int(total["n_tokens"]))
    return acc, int(total["n_truncated"]), info


def run_ray_distances(segments: Iterable[Segment], *, model_path: str | None, dtype: str = "float32",
                      max_length: int = 128, batch_size: int | None = 16, window: int = DEFAULT_WINDOW,
                      num_windows: int = 16, split_sentences: bool = False, backend: str = "auto",
                      rows_per_sample: int | None = None, seed: int = 0, run_dir: Path, settings: dict,
                      address: str | None = None, num_actors: int | None = None, progress: bool = True,
                      cpus_per_actor: int = 1, shards_per_group: int | None = None):
    """Jensen-Shannon distances between all heads over `segments` on a Ray cluster (what `attnkit distances`
    saves): the same pipeline as `run_ray_extraction`, each batch contributing its JS sums. Returns
    (`HeadDistances`, info dict). Finished shards are kept in RUN/distance-shards.

    With `rows_per_sample`, each batch samples its rows with a generator seeded by (seed, batch index), so the
    sample is reproducible and independent of the order batches finish in, but it is not the sample of the
    in-process collector (whose one generator runs through the batches in order). Without it the numbers equal
    the in-process collector's.
    """
    from ..distances import HeadDistances

    if rows_per_sample is not None and (not isinstance(rows_per_sample, int) or rows_per_sample < 1):
        raise AttnkitError(f"rows_per_sample must be a positive integer, got {rows_per_sample!r}")
    total, info = _run("distances", segments, model_path=model_path, dtype=dtype, max_length=max_length,
                       batch_size=batch_size, window=window, num_windows=num_windows, split_sentences=split_sentences,
                       backend=backend, run_dir=run_dir, settings=settings, address=address, num_actors=num_actors,
                       cpus_per_actor=cpus_per_actor, progress=progress, shards_per_group=shards_per_group,
                       rows_per_sample=rows_per_sample,
                       seed=seed)
    info = info | {"n_truncated": int(total["n_truncated"]), "n_samples": int(total["n_samples"]),
                   "n_tokens": int(total["n_tokens"])}
    dist = HeadDistances(total["js"], int(total["n_rows"]), int(total["n_layers"]), int(total["n_heads"]),
                         {"rows_per_sample": rows_per_sample, "n_batches": info["n_batches"], "engine": "ray"})
    return dist, info


__all__ = ["run_ray_extraction", "run_ray_distances", "ray_session", "settings_fingerprint", "shard_dir",
           "remove_shards", "ShardStore", "FEATURE_SHARDS_DIR", "DISTANCE_SHARDS_DIR", "PID_DIR_ENV"]
