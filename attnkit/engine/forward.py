"""One forward of an instrumented model that measures: the runtime switched to recording features, and the
per-layer features stacked into B × layers × heads × F (`observing`, from attnkit.models, attaches observers).

Every engine measures through `forward_features` inside `measuring` (the local loop, its device threads, the
Ray model actors, the comparison of two models), so a batch gives the same numbers whichever engine ran it.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable

import numpy as np
import torch

from ..arch.architectures import attention_layers
from ..attention.consumers import EarlyStop, Features, FeaturesComplete, LayerFeatures
from ..attention.kinds import layer_of
from ..errors import AttnkitError
from ..features import DEFAULT_NUM_WINDOWS, check_weighting, num_features
from ..models import attention_modules, runtime_of
from ..tokens import Batch, EncodedArrays, image_forward_arguments

DEFAULT_BATCH_SIZE = {"cpu": 16, "cuda": 64}


def default_batch_size(device) -> int:
    """Samples per batch when none is given: 64 on a GPU, 16 on the CPU."""
    return DEFAULT_BATCH_SIZE["cuda" if torch.device(device).type == "cuda" else "cpu"]


def output_projections(model) -> dict:
    """layer → the output projection (nn.Linear) of each attention module of an instrumented `model`, found by the
    layout of its architecture (attnkit/arch/architectures.py); an AttnkitError for an architecture attnkit does
    not know, or an encoder–decoder (not built: docs/seq2seq.md)."""
    if getattr(model.config, "is_encoder_decoder", False):
        raise AttnkitError(f"norm weighting of an encoder–decoder ({model.config.model_type}) is not built: measure it "
                           "with attention weighting (docs/seq2seq.md)")
    layers = {id(a.module): a for a in attention_layers(model, "norm weighting")}
    out = {}
    for mod in attention_modules(model):
        if id(mod) not in layers:
            raise AttnkitError(f"norm weighting: the attention module {type(mod).__name__} of layer {layer_of(mod)} "
                               f"is not where the {model.config.model_type} layout expects it")
        out[layer_of(mod)] = layers[id(mod)].output
    return out


@contextlib.contextmanager
def measuring(model, *, backend: str = "auto", num_windows: int = DEFAULT_NUM_WINDOWS, weighting: str = "attention"):
    """Inside the block, forwards of `model` record per-layer features into its runtime, weighted as `weighting`
    says ("norm": by the norms of the transformed keys, which needs an architecture attnkit knows)."""
    rt = runtime_of(model)
    out_proj = output_projections(model) if check_weighting(weighting) == "norm" else {}
    saved = (rt.backend, rt.num_windows)
    rt.backend, rt.num_windows = backend, num_windows
    try:
        with rt.attached(Features(weighting, out_proj)):  # attnkit/attention/consumers/features.py
            yield rt
    finally:
        rt.backend, rt.num_windows = saved


@functools.cache
def _takes_use_cache(cls) -> bool:
    return "use_cache" in inspect.signature(cls.forward).parameters


def no_cache(model) -> dict:
    """Keyword arguments that keep a forward of `model` from building a KV cache: a decoder otherwise keeps
    2 tensors per layer (hundreds of MB for a long input) that extraction never reads
    (shared/design/cpu-kernel-review.md §6). Empty for a model whose forward takes no `use_cache`."""
    return {"use_cache": False} if _takes_use_cache(type(model)) else {}


def forward_features(model, batch, rt=None, *, to_cpu: bool = True) -> torch.Tensor:
    """One forward of `batch` (already on the model's device), without a KV cache; returns B × layers × heads ×
    F (on the CPU unless `to_cpu` is false).

    The forward stops once the last attention layer has measured (attnkit.attention.consumers.EarlyStop): that layer's
    output projection and MLP and the model's final norm would compute an output nobody reads (MiniLM's six
    layers: an eighth of the forward's matrix products). Hooks on those modules therefore do not run here."""
    rt = rt or runtime_of(model)
    n_layers = len(attention_modules(model))
    features = next((c for c in reversed(rt.consumers) if isinstance(c, Features)), None)
    if features is None:
        raise AttnkitError("forward_features measures inside attnkit.engine.forward.measuring(model)")
    shape = (len(batch.lengths), model.config.num_attention_heads,
             num_features(rt.num_windows, rt.sink, alignment=rt.alignment))
    features.store = LayerFeatures(n_layers, shape, batch.lengths.device)
    try:
        with rt.attached(EarlyStop(features)), rt.batch_of(batch), torch.inference_mode():
            try:
                model(**batch.inputs, **no_cache(model), **image_forward_arguments(model, batch.inputs))
            except FeaturesComplete:
                pass
        missing = [i for i in range(n_layers) if i not in features.store]
        if missing:
            raise AttnkitError(f"layers {missing} produced no features: their attention bypassed attnkit")
        feats = features.store.stacked()
        return feats.cpu() if to_cpu else feats
    finally:
        features.store = {}


def device_forward(model, batch) -> torch.Tensor:
    """`forward_features` left on the device (what the replicas of the local engine run)."""
    return forward_features(model, batch, to_cpu=False)


def length_batches(lengths: np.ndarray, batch_size: int | None) -> list[np.ndarray] | None:
    """The forwards of a planned unit (attnkit/engine/plan.py, "grouped"): its samples sorted by token count,
    longest first (ties in plan order), `batch_size` at a time; None when the unit is a single forward, which then
    runs its samples as planned."""
    if batch_size is None or len(lengths) <= batch_size:
        return None
    order = np.argsort(-np.asarray(lengths), kind="stable")
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def unit_features(forward: Callable, model, arrays: EncodedArrays, batch_size: int | None,
                  to_device: Callable[[Batch], Batch]) -> torch.Tensor:
    """`forward(model, batch)` (per-sample rows, on the device) over a planned unit, run as `length_batches`
    cuts it; the rows come back in the unit's order. `to_device` moves a batch to the model's device."""
    parts = length_batches(arrays.lengths, batch_size)
    if parts is None:
        return forward(model, to_device(Batch.from_arrays(arrays)))
    order = np.concatenate(parts)
    ordered = arrays.rows(order)  # sorted once; each forward then takes a span of it
    rows = torch.cat([forward(model, to_device(Batch.from_arrays(ordered.span(i, i + batch_size))))
                      for i in range(0, len(order), batch_size)])
    return rows.index_select(0, torch.from_numpy(np.argsort(order, kind="stable")).to(rows.device))


__all__ = ["DEFAULT_BATCH_SIZE", "default_batch_size", "device_forward", "forward_features", "length_batches",
           "measuring", "no_cache", "output_projections", "unit_features"]
