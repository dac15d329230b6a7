"""What runs on the Ray cluster: the tokenisation stage (one batch encoder per worker process, of texts or of a
vision transformer's images, built on first use) and the model actor (the instrumented model; per planned batch,
its feature or distance sums).

Threads: on CPU, the per-sample numbers of a forward can depend on torch's intra-op thread count (a batch of
one MiniLM sample differs by ~1e-7 between 1 and 2 threads, BLAS blocking thin matmuls differently), so a model
actor runs torch with exactly the CPUs it holds and equals the in-process loop run with that many threads.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import time
from pathlib import Path

import numpy as np

from ...errors import AttnkitError

# Each model actor writes its pid to a file in this directory when it starts (for tests and operators that
# want to find the processes, e.g. to check fault tolerance by killing one).
PID_DIR_ENV = "ATTNKIT_RAY_PID_DIR"
# While PID_DIR/hold holds a number N, an actor that has measured N batches stands still before the next one,
# after writing PID_DIR/<pid>.held, until the file is removed: a test can kill it mid-run at a known point,
# however fast the run would otherwise finish.
HOLD_FILE = "hold"

# The environment of attnkit's tasks and actors, given to Ray with them (driver.py: runtime_env): a pooled worker
# process that runs other tasks later does not keep it, as it would keep an os.environ write (docs/process.md).
# The Rust tokenizer's own threads stay off beside the actors' torch threads.
WORKER_ENV = {"TOKENIZERS_PARALLELISM": "false"}


def worker_env(local: bool) -> dict[str, str]:
    """The environment of attnkit's tasks and actors: WORKER_ENV, and on a local cluster the OpenMP wait regime
    this process runs under (attnkit.process.openmp_in_effect), told explicitly: the workers share this machine and
    its load, and the regime no longer reaches subprocesses through os.environ (docs/process.md). A remote
    cluster's nodes are other machines: their workers keep their own environment."""
    env = dict(WORKER_ENV)
    if local:
        from ...process import openmp_in_effect

        env.update(openmp_in_effect()[0])
    return env

_encoders: dict = {}  # (model path, max_length, split_sentences) -> the batch encoder of this worker process


def worker_encoder(model_path: str | None, max_length: int, split_sentences: bool):
    """The batch encoder of this worker process (built on first use, then reused by every batch): the model's
    `attnkit.tokens.Encoder`, or a vision transformer's `ImageEncoder` (attnkit.tokens.config_encoder)."""
    key = (model_path, max_length, split_sentences)
    if key not in _encoders:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoConfig

        from ...attention.positions import image_layout
        from ...models import load_preprocessor, model_dir
        from ...tokens import config_encoder

        path = model_dir(model_path)
        try:
            config = AutoConfig.from_pretrained(path)
        except Exception as exc:
            raise AttnkitError(f"could not read the config of {path!r} on a Ray worker: {exc}") from None
        layout = image_layout(config)
        try:
            preprocessor = load_preprocessor(path, vision=layout is not None)
        except Exception as exc:
            what = "image processor" if layout is not None else "tokenizer"
            raise AttnkitError(f"could not load the {what} of {path!r} on a Ray worker: {exc}") from None
        _encoders[key] = config_encoder(config, preprocessor, layout, max_length=max_length,
                                        split_sentences=split_sentences)
    return _encoders[key]


def tokenise(rows: dict, *, model_path, max_length, split_sentences) -> dict:
    """Ray Data stage: planned batches (their segments pickled: texts, pairs or `ImageItem`s) → pickled
    `EncodedArrays`."""
    from ...tokens import ImageEncoder

    enc = worker_encoder(model_path, max_length, split_sentences)
    try:
        encoded = [pickle.dumps(enc.encode_arrays(pickle.loads(s)), protocol=5) for s in rows["segments"]]
    except AttnkitError as exc:
        if not isinstance(enc, ImageEncoder):  # text: read on the driver, nothing depends on this node
            raise
        raise AttnkitError(f"{exc} (read on a Ray worker: with images the files must be at the same absolute paths "
                           "on every node)") from None
    return {"shard": rows["shard"], "batch": rows["batch"], "n_segments": rows["n_segments"],
            "encoded": np.array(encoded, dtype=object)}


class ModelActor:
    """Ray Data stage held by each actor of the pool: the instrumented model; per batch, its sums."""

    def __init__(self, *, kind, model_path, dtype, max_length, backend, num_windows, rows_per_sample, seed,
                 threads, pid_dir=None, weighting="attention", batch_size=None):
        import torch

        torch.set_num_threads(threads)  # the CPUs the actor holds (see the module docstring)

        from ...models import attention_modules, check_max_length, load_model
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
        self.kind, self.backend, self.num_windows, self.weighting = kind, backend, num_windows, weighting
        self.rows_per_sample, self.seed = rows_per_sample, seed
        self.batch_size = batch_size  # samples per forward: a planned unit runs several (attnkit/engine/plan.py)
        self.n_layers = len(attention_modules(self.model))
        self.n_heads = self.model.config.num_attention_heads
        self.pid_dir, self.n_calls = (Path(pid_dir) if pid_dir else None), 0
        if pid_dir:
            Path(pid_dir).mkdir(parents=True, exist_ok=True)
            (Path(pid_dir) / f"{os.getpid()}.pid").write_text(str(os.getpid()))

    def _hold(self) -> None:
        """Stand still while PID_DIR/hold asks it (HOLD_FILE)."""
        hold = self.pid_dir / HOLD_FILE
        try:
            after = int(hold.read_text())
        except (OSError, ValueError):
            return
        if self.n_calls >= after:
            (self.pid_dir / f"{os.getpid()}.held").write_text(str(self.n_calls))
            while hold.exists():
                time.sleep(0.05)

    def __call__(self, rows: dict) -> dict:
        if self.pid_dir is not None:
            self._hold()
        self.n_calls += 1
        out: dict = {"shard": rows["shard"], "batch": rows["batch"], "n_segments": rows["n_segments"]}
        per_row = [self._measure(pickle.loads(e), int(b)) for e, b in zip(rows["encoded"], rows["batch"])]
        for key in per_row[0]:
            out[key] = np.stack([r[key] for r in per_row])
        return out

    def _collector(self, batch_index: int):
        """A distance collector whose row sample depends on nothing but (seed, batch index)."""
        import torch

        from ..distances import DistanceCollector

        collector = DistanceCollector(self.n_layers, rows_per_sample=self.rows_per_sample)
        if self.rows_per_sample is not None:
            seed = int(np.random.SeedSequence([self.seed, batch_index]).generate_state(1)[0])
            collector.generator = torch.Generator().manual_seed(seed)
        return collector

    def _measure(self, arrays, batch_index: int) -> dict:
        from ...models import observing
        from ...run.head_features import batch_moments
        from ..forward import forward_features, measuring, unit_features

        collector = self._collector(batch_index) if self.kind == "distances" else None
        with measuring(self.model, backend=self.backend, num_windows=self.num_windows,
                       weighting=self.weighting if self.kind == "features" else "attention") as rt, \
                observing(rt, [collector] if collector is not None else []):
            feats = unit_features(lambda m, b: forward_features(m, b, rt), self.model, arrays, self.batch_size,
                                  lambda b: b.to(self.device)).numpy()
        common = {"n_samples": np.int64(feats.shape[0]), "n_tokens": np.int64(arrays.n_tokens),
                  "n_truncated": np.int64(arrays.n_truncated)}
        if collector is not None:
            res = collector.result()
            return {"js": res.total, "n_rows": np.int64(res.n_rows), "n_layers": np.int64(self.n_layers),
                    "n_heads": np.int64(self.n_heads), **common}
        _, total, m2 = batch_moments(feats)  # what FeatureAccumulator.update computes of a batch
        return {"sum": total, "m2": m2, **common}


__all__ = ["HOLD_FILE", "PID_DIR_ENV", "ModelActor", "tokenise", "worker_encoder"]
