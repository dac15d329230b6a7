"""Corpus → batches → instrumented forward passes → feature sums → `HeadFeatures`.

`extract()` is the Python entry point (a stable interface: see README.md). `run_extraction()` is the loop
it shares with the `attnkit extract` job (attnkit/jobs/extract_job.py), which adds checkpoints so an
interrupted run resumes where it stopped. What decides the numbers is one `ExtractSettings`; the plan of
batches is attnkit/engine/plan.py, the engine that runs them attnkit/engine/local.py (docs/pipeline.md).
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from ..arch.pruning import pruned_head_grid, removed_heads
from ..attention.kinds import seq2seq_layer_kinds
from ..corpus.pairs import check_segments_for_model
from ..corpus.sources import is_blank
from ..errors import AttnkitError, arg, check_int
from ..features import (
    DEFAULT_MAX_LENGTH,
    DEFAULT_NUM_WINDOWS,
    DEFAULT_WEIGHTING,
    check_num_windows,
    check_weighting,
)
from ..models import (
    attention_modules,
    check_max_length,
    given_by_path,
    model_feature_names,
    observing,
    resolve_model,
)
from ..ops import BACKENDS, backend_label, resolve_backend
from ..run.head_features import FeatureAccumulator, HeadFeatures
from ..run.identity import IDENTITY_FIELD, model_identity
from ..tokens import Segment, batch_encoder
from .devices import parse_devices, replicate
from .forward import default_batch_size, device_forward, measuring
from .local import BatchResult, check_workers, run_pipeline
from .plan import DEFAULT_WINDOW, check_plan_settings, plan_batches
from .progress import segment_bar


@dataclass(frozen=True)
class ExtractSettings:
    """What decides the numbers of an extraction: the samples (`max_length`, `split_sentences`), the plan of
    batches (`batch_size`, `window`: docs/pipeline.md) and the features (`num_windows`, `backend`, `weighting`:
    "attention" or "norm", docs/features.md).
    `batch_size` None: `default_batch_size` of the device."""

    max_length: int = DEFAULT_MAX_LENGTH
    batch_size: int | None = None
    window: int = DEFAULT_WINDOW
    num_windows: int = DEFAULT_NUM_WINDOWS
    split_sentences: bool = False
    backend: str = "auto"
    weighting: str = DEFAULT_WEIGHTING

    def check(self) -> ExtractSettings:
        """Refuse settings no model could run, naming the argument (the model's own limits are checked by
        `check_max_length`)."""
        check_int(self.max_length, "max_length", minimum=2)
        check_plan_settings(1 if self.batch_size is None else self.batch_size, self.window)
        check_num_windows(self.num_windows)
        check_weighting(self.weighting)
        if self.backend not in BACKENDS:
            raise AttnkitError(f"unknown {arg('backend')} {self.backend!r}: use 'auto', 'fused' or 'reference'")
        return self

    def for_device(self, device) -> ExtractSettings:
        """These settings with the batch size resolved for `device`."""
        if self.batch_size is not None:
            return self
        return ExtractSettings(**{**asdict(self), "batch_size": default_batch_size(device)})


@dataclass
class ExtractionState:
    """Where an extraction stands: the sums so far, the number of planned segments measured (the next one to
    measure), and how many of them were truncated. A resumed extraction starts from a saved one."""

    accumulator: FeatureAccumulator
    next_index: int = 0
    n_truncated: int = 0
    runners: list = field(default_factory=list, repr=False)  # the local engine's replicas, for rates

    def add(self, res: BatchResult) -> None:
        self.accumulator.update(res.features, res.n_tokens)
        self.n_truncated += res.n_truncated
        self.next_index = res.planned.end


class _ProgressBar:
    """The bar of an extraction (`label`: what the command does): segments with a total where it can be known
    (attnkit/engine/progress.py), tokens/s (per replica when there are several), truncations."""

    def __init__(self, label: str, segments, total: int | None, initial: int, tokens0: int):
        self.bar = segment_bar(label, segments, total=total, initial=initial)
        self.t0, self.tokens0 = time.perf_counter(), tokens0

    def update(self, state: ExtractionState, res: BatchResult) -> None:
        dt = max(time.perf_counter() - self.t0, 1e-9)
        text = f"tok/s={(state.accumulator.n_tokens - self.tokens0) / dt:,.0f}"
        if len(state.runners) > 1:  # each replica's share: "cuda:0 6,100 | cuda:1 6,245"
            text += " (" + " | ".join(f"{r.label} {r.tokens / dt:,.0f}" for r in state.runners) + ")"
        self.bar.set_postfix_str(text + f", truncated={state.n_truncated}", refresh=False)
        self.bar.update(len(res.planned.segments))

    def close(self) -> None:
        self.bar.close()

    def finish(self) -> None:
        self.bar.finish()


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
    settings: ExtractSettings | None = None,
    *,
    replicas: Sequence = (),
    workers: int | str = 0,
    threads: int | str | None = None,
    prefetch: int | None = None,
    observers: Sequence[Callable] = (),
    on_choice: Callable | None = None,
    resume: ExtractionState | None = None,
    on_batch: Callable[[ExtractionState, BatchResult], None] | None = None,
    progress: bool = False,
    total: int | None = None,
    label: str = "extract",
) -> ExtractionState:
    """Measure `segments` (any iterable: it is streamed) under `settings`; returns the final state.

    The plan (attnkit/engine/plan.py) sorts by length within windows of `settings.window` segments.
    `replicas` are more instrumented copies of `model` on other devices; `workers` tokenisation processes run
    ahead of the model (at most `prefetch` tasks in flight) with `threads` torch threads (None: torch's count);
    either may be "auto": chosen from the rates of the first batches (attnkit/engine/tuning.py), the choice
    handed to `on_choice` before the run. `resume` continues a saved state: its sums, after
    its first `next_index` segments of the plan. `on_batch(state, result)` runs after every batch, in plan
    order (checkpoints hook in here; `result` holds the batch's per-sample features, input positions and
    token counts before truncation). `observers` are attached to the runtime for the run (each gets (layer,
    query, key, lengths, scaling) per layer and forward, e.g. attnkit.engine.distances.DistanceCollector;
    one device only). `settings` None: the defaults. `progress`: a bar named `label` on stderr, with a total
    (`total`, the input's length, or counted in the background) and so an ETA.
    """
    settings = (settings or ExtractSettings()).check()
    check_workers(workers)
    check_max_length(model, settings.max_length)
    models = [model, *replicas]
    check_replicas(models)
    if observers and len(models) > 1:
        raise AttnkitError("observers (e.g. distance collectors) run on one device only")
    settings = settings.for_device(next(model.parameters()).device)
    for m in models:
        resolve_backend(settings.backend, next(m.parameters()).device)  # fail early on an unavailable backend
    names = model_feature_names(model, settings.num_windows)
    shape = (len(attention_modules(model)), model.config.num_attention_heads)
    state = resume or ExtractionState(FeatureAccumulator(*shape, names))
    if state.accumulator.names != names or state.accumulator.sum.shape[:2] != shape:
        raise AttnkitError("the accumulated features belong to another model or feature set")
    # a vision model's batches from its image processor, an encoder–decoder's from (source, target) pairs
    encoder = batch_encoder(model, tokenizer, max_length=settings.max_length, split_sentences=settings.split_sentences)
    planned = plan_batches(segments, settings.batch_size, settings.window, skip_segments=state.next_index,
                           grouped=True)
    bar = _ProgressBar(label, segments, total, state.next_index, state.accumulator.n_tokens) if progress else None

    def deliver(res: BatchResult) -> None:
        state.add(res)
        if on_batch is not None:
            on_batch(state, res)
        if bar is not None:
            bar.update(state, res)

    def running(runners) -> None:
        state.runners = runners

    with contextlib.ExitStack() as stack:
        for m in models:
            stack.enter_context(measuring(m, backend=settings.backend, num_windows=settings.num_windows,
                                          weighting=settings.weighting))
        stack.enter_context(observing(model, observers))
        if bar is not None:
            stack.callback(bar.close)
        run_pipeline(models, encoder, planned, device_forward, workers=workers, threads=threads, prefetch=prefetch,
                     on_result=deliver, on_progress=running, on_choice=on_choice)
        if bar is not None:
            bar.finish()  # every segment read: the total is known whatever the background count is doing
    return state


def kinds_meta(config) -> dict:
    """{"layer_kinds": [[kind, index in its kind], ...]} for a run of an encoder–decoder (docs/files.md), else {}:
    a model of one stack's meta.json stays as it was."""
    kinds = seq2seq_layer_kinds(config)
    return {} if kinds is None else {"layer_kinds": [[k, i] for k, i in kinds]}


def given_config(model):
    """The config of a model as `resolve_model` takes it, without loading one: a model (or (model, tokenizer)
    pair)'s own, else its config.json (None where there is none to read yet)."""
    from ..embedded import model_config

    if isinstance(model, tuple) and model:
        model = model[0]
    if given_by_path(model):
        return model_config(model)
    return getattr(model, "config", None)


def check_texts(texts) -> list:
    if isinstance(texts, (str, bytes)):
        raise AttnkitError(f"{arg('texts')} must be a list of strings or (str, str) pairs, not a single string")
    texts = list(texts)
    if not texts:
        raise AttnkitError("no texts to measure")
    for j, t in enumerate(texts):
        if not (isinstance(t, str) or (isinstance(t, (tuple, list)) and len(t) == 2
                                       and all(isinstance(x, str) for x in t))):
            raise AttnkitError(f"{arg('texts')}[{j}] is neither a string nor a pair of strings: {t!r:.80}")
        if is_blank(t):  # `attnkit extract` skips blank segments; a list given here has no blank to skip
            raise AttnkitError(f"{arg('texts')}[{j}] is empty (blank): there is nothing of it to measure; leave it "
                               "out")
    return texts


def extract(
    texts: Sequence[Segment] | None = None,
    model=None,
    *,
    images=None,
    max_length: int = DEFAULT_MAX_LENGTH,
    batch_size: int | None = None,
    device=None,
    dtype=None,
    num_windows: int = DEFAULT_NUM_WINDOWS,
    backend: str = "auto",
    split_sentences: bool = False,
    tokenizer=None,
    progress: bool = False,
    observers: Sequence[Callable] = (),
    workers: int | str = 0,
    threads: int | str | None = None,
    devices=None,
    window: int = DEFAULT_WINDOW,
    per_sample: bool = False,
    label: str = "extract",
    weighting: str = DEFAULT_WEIGHTING,
    max_logit: bool = False,
) -> HeadFeatures:
    """Per-head features of `texts` (a list of str or of (str, str) pairs, or an attnkit.corpus.Corpus, which
    is streamed) under `model`; or, for a vision transformer, of `images` instead: "embedded" (scikit-image's sample
    images), image files, folders, "DATASET_DIR:COLUMN", a list of them, or a Corpus of
    attnkit.corpus.images.open_images, decoded and processed by the model's image processor (docs/features.md §10).

    `model`: None for the embedded MiniLM, a local path, or a (model, tokenizer) pair.
    `backend`: "reference" (pure PyTorch), "fused" (the compiled op), "auto" (fused when loaded).
    `observers`: callables (layer, query, key, lengths, scaling) attached for the run (see `Runtime`).
    `workers`: tokenisation processes running ahead of the model (0: tokenise on this thread); `threads`: torch
    threads for the run (None: torch's count); either "auto": chosen from the first batches' rates
    (attnkit/engine/tuning.py, docs/pipeline.md §4).
    `devices`: "all", "cuda:0,cuda:1", "cpu,cpu" or a list: one model replica per entry (default: `device`).
    `window`: segments sorted by length together (attnkit/engine/plan.py); the numbers do not depend on it
    beyond float64 rounding, only padding does.
    `per_sample`: also keep every sample's features (`HeadFeatures.per_sample`, n_samples × layers × heads ×
    features float32 in the order of `texts`; `.save(dir)` writes them as per_sample.npy, docs/patterns.md).
    `weighting`: "attention" (the features describe the attention weights) or "norm" (the weights scaled per key
    by the norm of the transformed key vector, Kobayashi et al. 2020: docs/features.md).
    `max_logit`: also each head's max logit over the corpus (`HeadFeatures.max_logit`, layers × heads; docs/features.md,
    "Max logit"), measured by the fused CPU kernel in the attention call itself, elsewhere by one more blocked q·kᵀ
    pass per layer (`.save(dir)` writes it into features.npz).
    """
    from ..corpus import Corpus
    from ..corpus.images import open_images
    from ..run.model_dir import check_model_takes

    if (texts is None) == (images is None):
        raise AttnkitError(f"give {arg('texts')} or {arg('images')}" + ("" if texts is None else ", not both"))
    if given_by_path(model):
        check_model_takes(model, images is not None)  # from config.json, before the model loads
    if images is not None:
        texts = images if isinstance(images, Corpus) else open_images(images)
    elif not isinstance(texts, Corpus):  # a Corpus streams (and checks) its own segments
        texts = check_texts(texts)
        # pairs for an encoder–decoder, single texts for a decoder: refused before a model given by its path loads
        check_segments_for_model(texts, given_config(model))
    settings = ExtractSettings(max_length=max_length, batch_size=batch_size, window=window, num_windows=num_windows,
                               split_sentences=split_sentences, backend=backend, weighting=weighting).check()
    devs = None
    if devices is not None:
        devs = parse_devices(",".join(map(str, devices)) if isinstance(devices, (list, tuple)) else devices)
        device = device if device is not None else devs[0]
    model, tokenizer = resolve_model(model, tokenizer, device, dtype, max_length=settings.max_length,
                                     function="attnkit.extract")
    replicas = replicate(model, devs)[1:] if devs is not None else []
    rows: dict[int, object] = {}

    def keep_rows(_state, res: BatchResult) -> None:
        rows.update(zip(res.planned.positions, res.features.astype(np.float32, copy=False)))

    collector = None
    if max_logit:
        if replicas:
            raise AttnkitError(f"{arg('max_logit')} runs on one device only")
        collector = MaxLogitCollector(len(attention_modules(model)), model.config.num_attention_heads)
        observers = [*observers, collector]
    state = run_extraction(model, tokenizer, texts, settings, replicas=replicas, workers=workers, threads=threads,
                           observers=observers, progress=progress, on_batch=keep_rows if per_sample else None,
                           label=label)
    dev = next(model.parameters()).device
    meta = {
        "model": getattr(model.config, "_name_or_path", "") or type(model).__name__,
        "model_type": model.config.model_type,
        IDENTITY_FIELD: model_identity(model, getattr(model.config, "_name_or_path", "") or type(model).__name__),
        "max_length": max_length,
        "num_windows": num_windows,
        "split_sentences": split_sentences,
        "weighting": weighting,
        "n_truncated": state.n_truncated,
        "backend": backend_label(backend, dev),
        "device": str(dev),
        "devices": [str(dev)] + [str(next(r.parameters()).device) for r in replicas],
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
    }
    if removed_heads(model):  # a pruned model: its removed heads' features are NaN (docs/pruning.md)
        meta["removed_heads"] = removed_heads(model)
    meta.update(kinds_meta(model.config))
    features = state.accumulator.result(meta)
    if per_sample:
        features.per_sample = np.stack([rows[i] for i in range(len(rows))])
    if collector is not None:
        features.max_logit = collector.head_max(model)
    return features


class MaxLogitCollector:
    """An observer (encoders and decoders) that keeps each head's max logit over every forward. It takes the max
    logit from the attention call itself (`takes_max_logit`: attnkit.hf_attention asks attnkit.ops.attention for it,
    which the fused CPU kernel measures while it runs and other backends by attnkit.kernels.statistics.max_logits,
    blocks of query rows; no L×L map either way), not q and k. `start`: the maximum of an earlier
    part of the run (a checkpoint's, layers × heads, NaN where none was seen), which the result includes: a maximum
    accumulates exactly across parts, and a part measured twice (a resume re-measures what its checkpoint may
    already hold) leaves it unchanged."""

    decoder_arguments = True
    takes_max_logit = True  # `add_max_logit` after the op, instead of a call with q and k before it

    def __init__(self, n_layers: int, n_heads: int, start: np.ndarray | None = None):
        self.max = [None] * n_layers
        self.n_heads = n_heads
        if start is not None and np.shape(start) != (n_layers, n_heads):
            raise AttnkitError(f"a saved max_logit of shape {np.shape(start)} belongs to another model "
                               f"({n_layers} layers × {n_heads} heads here)")
        self.start = None if start is None else np.asarray(start, dtype=np.float64)

    def add_max_logit(self, layer: int, max_logit: torch.Tensor) -> None:
        """One forward's B×H max logits of `layer` (NaN for a removed head)."""
        m = max_logit.amax(0)
        self.max[layer] = m if self.max[layer] is None else torch.maximum(self.max[layer], m)

    def __call__(self, *_args, **_kwargs):  # an observer is callable (attnkit.models.observing); never called
        raise AttnkitError("MaxLogitCollector takes the max logit from the attention call (add_max_logit)")

    def result(self) -> np.ndarray:
        now = np.stack([np.full(self.n_heads, np.nan) if m is None else m.double().cpu().numpy() for m in self.max])
        return now if self.start is None else np.fmax(self.start, now)  # fmax: NaN (nothing seen) gives way

    def head_max(self, model) -> np.ndarray:
        """`result()` with NaN for the heads a pruning removed from `model` (`HeadFeatures.max_logit`)."""
        return np.where(pruned_head_grid(model), self.result(), np.nan)


__all__ = ["ExtractSettings", "ExtractionState", "MaxLogitCollector", "check_replicas", "check_texts", "extract",
           "run_extraction"]
