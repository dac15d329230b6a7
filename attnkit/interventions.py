"""Interventions on attention heads (SPEC.md "Interventions"): per (layer, head) a mode and a region,
optional renormalisation, and differentiable per-head gates.

    iv = Intervention.identity(n_layers, n_heads)
    iv.set(2, 5, mode="zero")
    with attnkit.intervene(model, iv):
        model(**inputs)

transformers 5 removed `head_mask`; this replaces it, through the same fused op that extracts features.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from .errors import AttnkitError
from .features import ALL, KEEP, MODES, REGIONS


class Intervention:
    """Per-(layer, head) modes and regions (codes of `attnkit.features`), renormalize, and gates."""

    def __init__(self, mode: np.ndarray, region: np.ndarray | None = None, renormalize: bool = False,
                 gates: torch.Tensor | None = None):
        self.mode = np.asarray(mode, dtype=np.int32)
        if self.mode.ndim != 2:
            raise AttnkitError(f"intervention mode must be n_layers × n_heads, got shape {self.mode.shape}")
        self.region = (np.zeros_like(self.mode) if region is None else np.asarray(region, dtype=np.int32))
        if self.region.shape != self.mode.shape:
            raise AttnkitError(f"region shape {self.region.shape} differs from mode shape {self.mode.shape}")
        if self.mode.min(initial=0) < 0 or self.mode.max(initial=0) >= len(MODES):
            raise AttnkitError("intervention mode codes must be 0 (keep), 1 (zero) or 2 (uniform)")
        if self.region.min(initial=0) < 0 or self.region.max(initial=0) >= len(REGIONS):
            raise AttnkitError("intervention region codes must be 0 (all), 1 (no_intra) or 2 (no_inter)")
        if gates is not None and tuple(gates.shape) != self.mode.shape:
            raise AttnkitError(f"gates shape {tuple(gates.shape)} differs from {self.mode.shape}")
        self.renormalize = bool(renormalize)
        self.gates = gates
        self._cache: dict = {}

    @classmethod
    def identity(cls, n_layers: int, n_heads: int) -> "Intervention":
        return cls(np.full((n_layers, n_heads), KEEP, dtype=np.int32))

    @classmethod
    def for_model(cls, model) -> "Intervention":
        cfg = model.config
        n_layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layers")
        n_heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_heads")
        return cls.identity(n_layers, n_heads)

    @property
    def shape(self) -> tuple[int, int]:
        return self.mode.shape

    def set(self, layer: int, head: int | None = None, *, mode: str = "keep", region: str = "all") -> "Intervention":
        """Set one head (or the whole layer when head is None); returns self for chaining."""
        if mode not in MODES:
            raise AttnkitError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
        if region not in REGIONS:
            raise AttnkitError(f"unknown region {region!r}; use one of {', '.join(REGIONS)}")
        L, H = self.shape
        if not 0 <= layer < L or (head is not None and not 0 <= head < H):
            raise AttnkitError(f"head L{layer}H{head} is outside this model's {L} layers × {H} heads")
        sel = slice(None) if head is None else head
        self.mode[layer, sel] = MODES.index(mode)
        self.region[layer, sel] = REGIONS.index(region)
        self._cache.clear()
        return self

    @property
    def is_identity(self) -> bool:
        return (not self.mode.any() and not self.region.any() and self.gates is None)

    def for_layer(self, layer: int, device) -> tuple:
        """(mode, region, gates) tensors for one layer's heads; None where nothing changes."""
        key = (layer, str(device))
        if key not in self._cache:
            m, r = self.mode[layer], self.region[layer]
            mode = torch.as_tensor(m, device=device) if m.any() else None
            region = torch.as_tensor(r, device=device) if (r != ALL).any() else None
            self._cache[key] = (mode, region)
        mode, region = self._cache[key]
        gates = None if self.gates is None else self.gates[layer]
        return mode, region, gates


@contextlib.contextmanager
def intervene(model, intervention: Intervention):
    """Apply `intervention` to an instrumented model inside the block; always restores the model."""
    from .models import attention_modules, runtime_of

    rt = runtime_of(model)
    n_layers = len(attention_modules(model))
    if intervention.shape[0] != n_layers:
        raise AttnkitError(f"intervention covers {intervention.shape[0]} layers but the model has {n_layers}")
    previous = rt.intervention
    rt.intervention = intervention
    try:
        yield model
    finally:
        rt.intervention = previous
