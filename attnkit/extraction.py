"""Corpus → batches → instrumented forward passes → feature sums → `HeadFeatures`.

`extract()` is the Python entry point (SPEC.md "Stable interfaces"). `run_extraction()` is the loop
it shares with the CLI, which adds checkpoints so an interrupted run resumes where it stopped.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Sequence

import torch

from .errors import AttnkitError
from .features import check_num_windows, feature_names
from .head_features import FeatureAccumulator, HeadFeatures
from .models import attention_modules, instrument, load_model, max_positions, runtime_of
from .ops import backend_label, resolve_backend
from .tokens import Encoder, Segment


def default_batch_size(device: torch.device) -> int:
    return 64 if device.type == "cuda" else 16


@contextlib.contextmanager
def measuring(model, *, backend: str = "auto", num_windows: int = 16):
    """Inside the block, forwards of `model` record per-layer features into its runtime."""
    rt = runtime_of(model)
    saved = (rt.backend, rt.num_windows, rt.want_features)
    rt.backend, rt.num_windows, rt.want_features = backend, num_windows, True
    try:
        yield rt
    finally:
        rt.backend, rt.num_windows, rt.want_features = saved
        rt.batch = None
        rt.features = {}


@contextlib.contextmanager
def _observing(rt, observers: Sequence[Callable]):
    """Attach `observers` to the runtime for the block and always detach them again."""
    observers = list(observers or ())
    rt.observers.extend(observers)
    try:
        yield
    finally:
        for obs in observers:
            rt.observers.remove(obs)


def forward_features(model, batch, rt) -> torch.Tensor:
    """One forward of `batch` (already on the model's device); returns B × layers × heads × F on CPU."""
    rt.features = {}
    try:
        with rt.batch_of(batch), torch.inference_mode():
            model(**batch.inputs)
        n_layers = len(attention_modules(model))
        missing = [i for i in range(n_layers) if i not in rt.features]
        if missing:
            raise AttnkitError(f"layers {missing} produced no features: their attention bypassed attnkit")
        return torch.stack([rt.features[i] for i in range(n_layers)], dim=1).cpu()
    finally:
        rt.features = {}


def _chars(segment: Segment) -> int:
    return len(segment) if isinstance(segment, str) else sum(len(x) for x in segment)


def by_length(segments: Sequence[Segment]) -> list:
    """Longest first (stable): batches of similar length waste little on padding. Per-sample features
    do not depend on the batch a sample is in, and the order is a pure function of the corpus, so a
    resumed run sees exactly the batches an uninterrupted one would."""
    return sorted(segments, key=_chars, reverse=True)


def check_max_length(model, max_length: int) -> None:
    limit = max_positions(model)
    if limit is not None and max_length > limit:
        raise AttnkitError(
            f"max length {max_length} exceeds the model's {limit} positions ({model.config.model_type})"
        )


def run_extraction(
    model,
    tokenizer,
    segments: Sequence[Segment],
    *,
    max_length: int = 128,
    batch_size: int | None = None,
    num_windows: int = 16,
    split_sentences: bool = False,
    backend: str = "auto",
    accumulator: FeatureAccumulator | None = None,
    start: int = 0,
    on_batch: Callable[[FeatureAccumulator, int, int], None] | None = None,
    progress: bool = False,
    observers: Sequence[Callable] = (),
) -> tuple[FeatureAccumulator, int]:
    """Measure `segments[start:]` in order. `on_batch(acc, next_index, n_truncated)` runs after every
    batch (checkpointing hooks in here). `observers` are added to the runtime's observers for the run
    (each gets (layer, query, key, lengths, scaling) per layer and forward, e.g. the JS distance
    collector of attnkit.analysis). Returns the accumulator and the number of truncated segments."""
    check_num_windows(num_windows)
    check_max_length(model, max_length)
    device = next(model.parameters()).device
    batch_size = batch_size or default_batch_size(device)
    if batch_size < 1:
        raise AttnkitError(f"batch size must be positive, got {batch_size}")
    resolve_backend(backend, device)  # fail early on an unavailable backend
    mods = attention_modules(model)
    n_heads = model.config.num_attention_heads
    names = feature_names(num_windows)
    acc = accumulator or FeatureAccumulator(len(mods), n_heads, names)
    if acc.names != names or acc.sum.shape[:2] != (len(mods), n_heads):
        raise AttnkitError("the accumulated features belong to another model or feature set")
    encoder = Encoder(tokenizer, max_length=max_length, split_sentences=split_sentences)
    segments = by_length(segments)
    n_truncated = 0
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(segments), initial=start, unit="seg", desc="extract", dynamic_ncols=True)
    t0, tokens0 = time.perf_counter(), acc.n_tokens
    with measuring(model, backend=backend, num_windows=num_windows) as rt, _observing(rt, observers):
        for i in range(start, len(segments), batch_size):
            chunk = segments[i:i + batch_size]
            batch = encoder(chunk).to(device)
            feats = forward_features(model, batch, rt)
            acc.update(feats.numpy(), batch.n_tokens)
            n_truncated += batch.n_truncated
            if on_batch is not None:
                on_batch(acc, i + len(chunk), n_truncated)
            if bar is not None:
                dt = max(time.perf_counter() - t0, 1e-9)
                bar.set_postfix(tok_s=f"{(acc.n_tokens - tokens0) / dt:,.0f}", truncated=n_truncated, refresh=False)
                bar.update(len(chunk))
    if bar is not None:
        bar.close()
    return acc, n_truncated


def _as_model(model, tokenizer, device, dtype):
    """Accept None (embedded default), a path, a (model, tokenizer) pair, or a model + tokenizer."""
    if model is None or isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
        return load_model(model, device=device, dtype=dtype)
    if isinstance(model, tuple) and len(model) == 2:
        model, tokenizer = model
    if tokenizer is None:
        raise AttnkitError("pass the model's tokenizer: extract(texts, (model, tokenizer)) or tokenizer=...")
    if device is not None:
        model.to(device)
    if dtype is not None:
        from .models import resolve_dtype

        model.to(resolve_dtype(dtype))
    instrument(model.eval())
    return model, tokenizer


def extract(
    texts: Sequence[Segment],
    model=None,
    *,
    max_length: int = 128,
    batch_size: int | None = None,
    device=None,
    dtype=None,
    num_windows: int = 16,
    backend: str = "auto",
    split_sentences: bool = False,
    tokenizer=None,
    progress: bool = False,
    observers: Sequence[Callable] = (),
) -> HeadFeatures:
    """Per-head features of `texts` (a list of str or of (str, str) pairs) under `model`.

    `model`: None for the embedded MiniLM, a local path, or a (model, tokenizer) pair.
    `backend`: "reference" (pure PyTorch), "fused" (the compiled op), "auto" (fused when loaded).
    `observers`: callables (layer, query, key, lengths, scaling) attached for the run (see `Runtime`).
    """
    if isinstance(texts, (str, bytes)):
        raise AttnkitError("texts must be a list of strings or (str, str) pairs, not a single string")
    texts = list(texts)
    if not texts:
        raise AttnkitError("no texts to measure")
    for j, t in enumerate(texts):
        if not (isinstance(t, str) or (isinstance(t, (tuple, list)) and len(t) == 2 and all(isinstance(x, str) for x in t))):
            raise AttnkitError(f"texts[{j}] is neither a string nor a pair of strings: {t!r:.80}")
    model, tokenizer = _as_model(model, tokenizer, device, dtype)
    acc, n_truncated = run_extraction(
        model, tokenizer, texts, max_length=max_length, batch_size=batch_size, num_windows=num_windows,
        split_sentences=split_sentences, backend=backend, progress=progress, observers=observers,
    )
    dev = next(model.parameters()).device
    meta = {
        "model": getattr(model.config, "_name_or_path", "") or type(model).__name__,
        "model_type": model.config.model_type,
        "max_length": max_length,
        "num_windows": num_windows,
        "split_sentences": split_sentences,
        "n_truncated": n_truncated,
        "backend": backend_label(backend, dev),
        "device": str(dev),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
    }
    return acc.result(meta)
