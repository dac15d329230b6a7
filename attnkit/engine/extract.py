"""Corpus → batches → instrumented forward passes → feature sums → `HeadFeatures`.

`extract()` is the Python entry point (a stable interface: see README.md). `run_extraction()` is the loop
it shares with the CLI, which adds checkpoints so an interrupted run resumes where it stopped.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterable, Sequence

import torch

from .plan import DEFAULT_WINDOW, check_plan_settings, plan_batches
from ..errors import AttnkitError
from ..features import check_num_windows, feature_names
from ..run.head_features import FeatureAccumulator, HeadFeatures
from ..models import attention_modules, instrument, load_model, max_positions, runtime_of
from ..ops import backend_label, resolve_backend
from .local import run_pipeline
from ..tokens import Encoder, Segment


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


def forward_features(model, batch, rt=None, *, to_cpu: bool = True) -> torch.Tensor:
    """One forward of `batch` (already on the model's device); returns B × layers × heads × F (on the CPU
    unless `to_cpu` is false)."""
    rt = rt or runtime_of(model)
    rt.features = {}
    try:
        with rt.batch_of(batch), torch.inference_mode():
            model(**batch.inputs)
        n_layers = len(attention_modules(model))
        missing = [i for i in range(n_layers) if i not in rt.features]
        if missing:
            raise AttnkitError(f"layers {missing} produced no features: their attention bypassed attnkit")
        feats = torch.stack([rt.features[i] for i in range(n_layers)], dim=1)
        return feats.cpu() if to_cpu else feats
    finally:
        rt.features = {}


def _device_forward(model, batch) -> torch.Tensor:
    return forward_features(model, batch, to_cpu=False)


def check_max_length(model, max_length: int) -> None:
    limit = max_positions(model)
    if limit is not None and max_length > limit:
        raise AttnkitError(
            f"max length {max_length} exceeds the model's {limit} positions ({model.config.model_type})"
        )


def check_replicas(models: Sequence) -> None:
    """Replicas must be the same model (same config and weights shape) on their own devices."""
    first = models[0]
    for m in models[1:]:
        if type(m) is not type(first) or m.config.to_dict() != first.config.to_dict():
            raise AttnkitError("all model replicas must be the same model")
        attention_modules(m)


def run_extraction(
    model,
    tokenizer,
    segments: Iterable[Segment],
    *,
    max_length: int = 128,
    batch_size: int | None = None,
    num_windows: int = 16,
    split_sentences: bool = False,
    backend: str = "auto",
    accumulator: FeatureAccumulator | None = None,
    start: int = 0,
    on_batch: Callable[..., None] | None = None,
    progress: bool = False,
    observers: Sequence[Callable] = (),
    window: int = DEFAULT_WINDOW,
    workers: int = 0,
    replicas: Sequence = (),
    prefetch: int | None = None,
    total: int | None = None,
    on_result: Callable | None = None,
) -> tuple[FeatureAccumulator, int]:
    """Measure `segments` (any iterable: it is streamed) after the first `start` segments of the plan.

    The plan (attnkit.batching) sorts by length within windows of `window` segments. `workers` tokenisation
    processes run ahead of the model; `replicas` are more instrumented copies of `model` on other devices.
    `on_batch(acc, next_index, n_truncated, full_lengths)` runs after every batch, in plan order
    (checkpointing hooks in here; `full_lengths` are the batch's token counts before truncation). `observers` are added to the runtime for the run (each gets (layer, query, key, lengths, scaling)
    per layer and forward, e.g. the JS distance collector of attnkit.analysis; one replica only).
    Returns the accumulator and the number of truncated segments.
    """
    check_num_windows(num_windows)
    if isinstance(max_length, bool) or not isinstance(max_length, int):
        raise AttnkitError(f"max_length must be an integer, got {max_length!r}")
    check_max_length(model, max_length)
    bad = [o for o in observers if not callable(o)]
    if bad:
        raise AttnkitError(f"observers must be callables (layer, query, key, lengths, scaling), got {bad[0]!r}")
    models = [model, *replicas]
    check_replicas(models)
    device = next(model.parameters()).device
    batch_size = default_batch_size(device) if batch_size is None else batch_size
    check_plan_settings(batch_size, window)
    if observers and len(models) > 1:
        raise AttnkitError("observers (e.g. distance collectors) run on one device only")
    for m in models:
        resolve_backend(backend, next(m.parameters()).device)  # fail early on an unavailable backend
    mods = attention_modules(model)
    n_heads = model.config.num_attention_heads
    names = feature_names(num_windows)
    acc = accumulator or FeatureAccumulator(len(mods), n_heads, names)
    if acc.names != names or acc.sum.shape[:2] != (len(mods), n_heads):
        raise AttnkitError("the accumulated features belong to another model or feature set")
    encoder = Encoder(tokenizer, max_length=max_length, split_sentences=split_sentences)
    if total is None and hasattr(segments, "__len__"):
        total = len(segments)
    planned = plan_batches(segments, batch_size, window, skip_segments=start)
    state = {"truncated": 0}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, initial=start, unit="seg", desc="extract", dynamic_ncols=True)
    t0, tokens0 = time.perf_counter(), acc.n_tokens

    def deliver(res) -> None:
        if on_result is not None:
            on_result(res)
        acc.update(res.features, res.n_tokens)
        state["truncated"] += res.n_truncated
        if on_batch is not None:
            on_batch(acc, res.planned.end, state["truncated"], res.full_lengths)
        if bar is not None:
            dt = max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix_str(_rates(acc.n_tokens - tokens0, dt, state.get("runners")) +
                                f", truncated={state['truncated']}", refresh=False)
            bar.update(len(res.planned.segments))

    def on_progress(runners) -> None:
        state["runners"] = runners

    with contextlib.ExitStack() as stack:
        for m in models:
            stack.enter_context(measuring(m, backend=backend, num_windows=num_windows))
        stack.enter_context(_observing(runtime_of(model), observers))
        try:
            run_pipeline(models, encoder, planned, _device_forward, workers=workers, prefetch=prefetch,
                         on_result=deliver, on_progress=on_progress)
        finally:
            if bar is not None:
                bar.close()
    return acc, state["truncated"]


def _rates(tokens: int, seconds: float, runners) -> str:
    """"tok/s=12,345" and, with several replicas, each replica's share: "cuda:0 6,100 | cuda:1 6,245"."""
    text = f"tok/s={tokens / seconds:,.0f}"
    if runners and len(runners) > 1:
        text += " (" + " | ".join(f"{r.label} {r.tokens / seconds:,.0f}" for r in runners) + ")"
    return text


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
        from ..models import resolve_dtype

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
    workers: int = 0,
    devices=None,
    window: int = DEFAULT_WINDOW,
) -> HeadFeatures:
    """Per-head features of `texts` (a list of str or of (str, str) pairs, or an attnkit.corpus.Corpus, which
    is streamed) under `model`.

    `model`: None for the embedded MiniLM, a local path, or a (model, tokenizer) pair.
    `backend`: "reference" (pure PyTorch), "fused" (the compiled op), "auto" (fused when loaded).
    `observers`: callables (layer, query, key, lengths, scaling) attached for the run (see `Runtime`).
    `workers`: tokenisation processes running ahead of the model (0: tokenise on this thread).
    `devices`: "all", "cuda:0,cuda:1", "cpu,cpu" or a list: one model replica per entry (default: `device`).
    `window`: segments sorted by length together (see attnkit.batching); the numbers do not depend on it
    beyond float64 rounding, only padding does.
    """
    from ..corpus import Corpus

    if isinstance(texts, (str, bytes)):
        raise AttnkitError("texts must be a list of strings or (str, str) pairs, not a single string")
    if not isinstance(texts, Corpus):  # a Corpus streams (and checks) its own segments
        texts = list(texts)
        if not texts:
            raise AttnkitError("no texts to measure")
        for j, t in enumerate(texts):
            if not (isinstance(t, str) or (isinstance(t, (tuple, list)) and len(t) == 2 and all(isinstance(x, str) for x in t))):
                raise AttnkitError(f"texts[{j}] is neither a string nor a pair of strings: {t!r:.80}")
    if devices is not None:
        from .devices import parse_devices

        devs = parse_devices(",".join(map(str, devices)) if isinstance(devices, (list, tuple)) else devices)
        device = device if device is not None else devs[0]
    model, tokenizer = _as_model(model, tokenizer, device, dtype)
    replicas = []
    if devices is not None:
        from .devices import replicate

        replicas = replicate(model, devs)[1:]
    acc, n_truncated = run_extraction(
        model, tokenizer, texts, max_length=max_length, batch_size=batch_size, num_windows=num_windows,
        split_sentences=split_sentences, backend=backend, progress=progress, observers=observers,
        workers=workers, replicas=replicas, window=window,
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
        "devices": [str(dev)] + [str(next(r.parameters()).device) for r in replicas],
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
    }
    return acc.result(meta)
