"""Extraction's features: each layer's B×H×F features of a forward of attnkit's own batch (attnkit.engine.forward:
`measuring` attaches `Features`, `forward_features` adds `EarlyStop`), into a dict or one `LayerFeatures` buffer.

A pruned layer's removed heads have no attention, hence no features: NaN (docs/pruning.md). With norm weighting
(docs/features.md, "Norm-weighted features") each layer's features describe its weights scaled per key by
‖f_h(x_t)‖, which needs the layer's output projection (`Features.out_proj`: layer → nn.Linear)."""
from __future__ import annotations

import torch

from ...arch.pruning import to_unpruned
from ...errors import AttnkitError
from ..call import AttentionCall
from .base import BaseConsumer, Result, Wants


class FeaturesComplete(Exception):
    """Raised by the attention function when every layer's features are in and the forward only measures
    (`EarlyStop`): the rest of the forward would compute what nobody reads."""


class LayerFeatures:
    """layer → the B×H×F features of the forward under way, written into one B × layers × H × F buffer.

    Why one buffer, made before the forward: a small tensor kept per layer until the forward ends is carved by
    glibc out of the hole a large freed activation left, so the next activation of that size no longer fits there
    and the heap grows instead (at long inputs the peak memory then exceeds sdpa's forward: docs/decoders.md §7).
    `shape` (B, H, F) and `device`: the buffer is made here, before the forward's activations exist; None: at
    the first layer's features (also when they do not have that shape)."""

    def __init__(self, n_layers: int, shape: tuple | None = None, device=None):
        self.n_layers = n_layers
        self._buffer = None if shape is None else torch.empty((shape[0], n_layers, *shape[1:]), device=device)
        self._written = [False] * n_layers  # a list made here: a set would grow (reallocate) mid-forward

    def __setitem__(self, layer: int, feats: torch.Tensor) -> None:
        if not 0 <= layer < self.n_layers:
            raise AttnkitError(f"features of layer {layer}, but the model has {self.n_layers} attention layers")
        fits = self._buffer is not None and self._buffer[:, layer].shape == feats.shape
        if not fits and not any(self._written):
            self._buffer = feats.new_empty((feats.shape[0], self.n_layers, *feats.shape[1:]))
        elif not fits:
            raise AttnkitError(f"layer {layer} produced features of shape {tuple(feats.shape)}, the layers before "
                               f"{tuple(self._buffer[:, layer].shape)}: attnkit needs the same heads in every layer")
        self._buffer[:, layer] = feats
        self._written[layer] = True

    def __contains__(self, layer: int) -> bool:
        return 0 <= layer < self.n_layers and self._written[layer]

    def complete(self) -> bool:
        """Whether every layer's features are in."""
        return all(self._written)

    def __getitem__(self, layer: int) -> torch.Tensor:
        if layer not in self:
            raise KeyError(layer)
        return self._buffer[:, layer]

    def stacked(self) -> torch.Tensor:
        """B × layers × H × F (every layer written: the caller checks with `in`)."""
        return self._buffer


class Features(BaseConsumer):
    """Records the features of each layer into `store` (layer → B×H×F) in forwards of attnkit's own batches;
    `weighting` "attention", or "norm" with `out_proj` (layer → the output projection)."""

    role = "features"

    def __init__(self, weighting: str = "attention", out_proj: dict | None = None):
        self.weighting = weighting
        self.out_proj = out_proj or {}
        self.store: dict | LayerFeatures = {}

    def wants(self, call: AttentionCall) -> Wants | None:
        if call.info is None:  # a plain forward: no token classes to measure with
            return None
        if self.weighting != "norm" or call.H == 0:
            return Wants(features=True)
        if call.layer not in self.out_proj:
            raise AttnkitError("norm weighting needs each layer's output projection: measure inside "
                               "attnkit.engine.forward.measuring(model, weighting='norm')")
        return Wants(features=True, out_proj=self.out_proj[call.layer])

    def after(self, call: AttentionCall, result: Result) -> None:
        feats = result.feats
        self.store[call.layer] = feats if call.kept is None else to_unpruned(feats, call.kept, float("nan"))


class EarlyStop(BaseConsumer):
    """Ends a forward that only measures once every layer's features are in `features.store` (a LayerFeatures),
    by raising FeaturesComplete (caught by attnkit.engine.forward.forward_features): the rest of the forward would
    compute what nobody reads. Attached after the other consumers, so they all get the last layer's results; a
    forward that asks for maps runs to the end."""

    role = "early_stop"

    def __init__(self, features: Features):
        self.features = features

    def after(self, call: AttentionCall, result: Result) -> None:
        store = self.features.store
        if not call.want_maps and isinstance(store, LayerFeatures) and store.complete():
            raise FeaturesComplete
