"""Per-head outputs of a forward (`attnkit.cache_heads`): what each head of a layer hands to the output projection,
B × L × H × D, as the attention function returns it (after every intervention, patch and mean included).

    with attnkit.cache_heads(model) as cache:
        model(**enc)
    cache[3]                                  # layer 3: B × L × H × D
    iv.set(3, 5, mode="patch", value=cache)   # patch L3H5 from this cache in a later forward

Each forward inside the block replaces what the cache holds of the layers it runs; the cache keeps its tensors
after the block. They are detached unless `keep_grad=True`.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

from ..attention.consumers import HeadCaching
from ..errors import AttnkitError, arg
from ..models import attention_modules, runtime_of


class HeadCache:
    """Per-head outputs of the layers `layers` (all when None), filled by forwards inside `cache_heads`."""

    def __init__(self, n_layers: int, layers: Iterable[int] | None = None, keep_grad: bool = False):
        self.n_layers = n_layers
        self.layers = tuple(range(n_layers)) if layers is None else tuple(sorted(set(layers)))
        self.keep_grad = bool(keep_grad)
        self._outputs: dict[int, torch.Tensor] = {}

    def covers(self, layer: int) -> bool:
        return layer in self.layers

    def record(self, layer: int, out: torch.Tensor) -> None:
        """Keep `out` (B × L × H × D) as the outputs of `layer` (the attention function calls this)."""
        if layer in self.layers:
            self._outputs[layer] = out if self.keep_grad else out.detach()

    def __getitem__(self, layer: int) -> torch.Tensor:
        if not isinstance(layer, int) or not self.covers(layer):
            kept = ", ".join(map(str, self.layers))
            raise AttnkitError(f"layer {layer!r} is not cached: this cache keeps layers {kept}")
        if layer not in self._outputs:
            raise AttnkitError(f"the cache holds no outputs of layer {layer} yet: run a forward inside "
                               "attnkit.cache_heads first")
        return self._outputs[layer]

    def head_output(self, layer: int, head: int) -> torch.Tensor:
        """B × L × D: the outputs of one head."""
        return self[layer][:, :, head, :]

    def __contains__(self, layer) -> bool:
        return layer in self._outputs

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._outputs))

    def __len__(self) -> int:
        return len(self._outputs)

    def keys(self) -> list[int]:
        return sorted(self._outputs)

    def items(self) -> list[tuple[int, torch.Tensor]]:
        return [(k, self._outputs[k]) for k in self.keys()]

    def clear(self) -> None:
        self._outputs.clear()

    def __repr__(self) -> str:
        held = ", ".join(f"{k}: {tuple(v.shape)}" for k, v in self.items()) or "nothing yet"
        return f"HeadCache(layers {list(self.layers)}; {held})"


@contextlib.contextmanager
def cache_heads(model, layers: Iterable[int] | int | None = None, *, keep_grad: bool = False,
                cache: HeadCache | None = None):
    """Inside the block, forwards of the instrumented `model` fill the yielded `HeadCache` with each layer's
    per-head outputs (B × L × H × D, before the output projection); `layers` limits it to some layers. The
    outputs are detached, unless `keep_grad` (then gradients flow through them). `cache`: fill this HeadCache
    (its own layers and keep_grad) instead of a new one, e.g. one that patch interventions already read."""
    n_layers = len(attention_modules(model))
    if cache is not None:
        if not isinstance(cache, HeadCache) or cache.n_layers != n_layers:
            raise AttnkitError(f"{arg('cache')} must be a HeadCache of this model's {n_layers} layers")
        layers = cache.layers
    if layers is not None:
        layers = [layers] if isinstance(layers, int) else list(layers)
        bad = [x for x in layers if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < n_layers]
        if bad:
            raise AttnkitError(f"{arg('layers')} must be layer numbers 0 … {n_layers - 1}, got {bad[0]!r}")
    cache = cache if cache is not None else HeadCache(n_layers, layers, keep_grad)
    rt = runtime_of(model)
    handle = _attach(rt, cache)
    try:
        with rt.closing_forwards():  # a forward Ctrl-C left open is exited
            yield cache
    finally:  # KeyboardInterrupt included; blocks may be left in any order
        _detach(rt, handle)


def _attach(rt, cache: HeadCache):
    """Make every forward of the runtime's model record into `cache` (from any thread: a cache is the model's state,
    as interventions are; docs/interventions.md, "Blocks, threads and interruptions"); returns what `_detach` takes."""
    return rt.attach(HeadCaching(cache))  # attnkit/attention/consumers/head_cache.py


def _detach(rt, handle) -> None:
    """Undo one `_attach` (the same cache may be in force in two blocks, each attached once)."""
    rt.detach(handle)


__all__ = ["HeadCache", "cache_heads"]
