"""Interventions on attention heads (docs/interventions.md): per (layer, head) a mode and a region,
optional renormalisation, differentiable per-head gates, and values that replace a head's output (modes patch
and mean).

    iv = Intervention.identity(n_layers, n_heads)
    iv.set(2, 5, mode="zero")
    with attnkit.intervene(model, iv):
        model(**inputs)

Builders: `Intervention.from_heads(model_or_shape, "L2H5,L3H0", mode="zero")`, `.from_layers(...)`,
`.from_types(shape, load_clusters(run), ["diagonal"], ...)`; `with_gates()` adds differentiable gates.

transformers 5 removed `head_mask`; this replaces it, through the same fused op that extracts features.

Modes keep, zero and uniform change the head's weights inside the op. Modes patch and mean leave the weights
alone (the op computes them, and features describe them) and replace the head's output after the op, before
the output projection: `set(l, h, mode="patch", value=T)` with T of L × D or B × L × D (or a `HeadCache`, read
at forward time), `set(l, h, mode="mean", value=v)` with v of D. `StackedInterventions` runs several
interventions in one forward, one per block of samples (the ablation sweeps batch settings this way).

Nested `intervene` blocks compose: the inner block adds its settings to those in force (`merged`; a head both
set differently is refused by name), and leaving it restores the enclosing block's intervention. `only` puts one
intervention alone in force (attnkit's ablation runners evaluate their settings so). Blocks are the model's state,
for every thread, and may be left in any order ("Open blocks" below).

Regions (no_intra / no_inter) need each token's sentence: in a plain forward they are the segments of
a text pair (token_type_ids or separator tokens), or ids given with `sentences(model, ids)` /
`intervene(..., sentences=ids)`; attnkit/hf_attention.py has the exact rule and when it refuses.

Head types come from a run's clusters.json, written by `attnkit cluster` (format: docs/files.md; reader:
attnkit/run/clusters.py), through `load_clusters`.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .attention.runtime import LayerPart
from .errors import AttnkitError, arg, check_int
from .features import ALL, KEEP, MODES, REGIONS, is_index, read_heads
from .models import attention_modules, runtime_of
from .run.clusters import CLUSTERS_FILE, REMOVED, type_grid
from .run.clusters import load_clusters as read_clusters
from .run.head_means import HeadMeans

# Modes that replace a head's output after the op (their codes follow the op's; the op sees them as keep).
HEAD_MODES = MODES + ("patch", "mean")
PATCH, MEAN = len(MODES), len(MODES) + 1


def _shape_of(model_or_shape) -> tuple[int, int]:
    """(n_layers, n_heads) from a model, an Intervention, or a (n_layers, n_heads) pair."""
    if isinstance(model_or_shape, Intervention):
        return model_or_shape.shape
    if isinstance(model_or_shape, (tuple, list)) and len(model_or_shape) == 2:
        L, H = (int(x) for x in model_or_shape)
        if L < 1 or H < 1:
            raise AttnkitError(f"an intervention needs at least one layer and one head, got {L} × {H}")
        return L, H
    cfg = getattr(model_or_shape, "config", None)
    if cfg is None:
        raise AttnkitError(f"cannot tell the number of layers and heads of {type(model_or_shape).__name__}")
    n_layers = _attnkit_layers(model_or_shape) or getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layers",
                                                                                                    None)
    n_heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_heads", None)
    if not n_layers or not n_heads:
        raise AttnkitError(f"model config {type(cfg).__name__} names no layer/head counts")
    return int(n_layers), int(n_heads)


def _attnkit_layers(model) -> int | None:
    """The layers attnkit numbers in an instrumented model (an encoder–decoder's encoder, decoder and cross-attention
    layers: docs/seq2seq.md), or None before attnkit.models.instrument."""
    mods = getattr(model, "_attnkit_modules", None)
    return len(mods) if mods else None


def parse_heads(spec, shape: tuple[int, int] | None = None) -> list[tuple[int, int]]:
    """Heads from "L2H5,L3H0" (0-based; "L4" = every head of layer 4) or an iterable of (layer, head)
    (`attnkit.features.read_heads` reads them).

    With `shape` = (n_layers, n_heads), whole layers are expanded and every head is range-checked.
    Duplicates are dropped; order of first appearance is kept.
    """
    out: list[tuple[int, int]] = []
    for layer, head in read_heads(spec):
        if head is None:
            if shape is None:
                raise AttnkitError(f"L{layer} names a whole layer: give the model's shape to expand it")
            heads = [(layer, h) for h in range(shape[1])]
        else:
            heads = [(layer, head)]
        for lh in heads:
            if shape is not None and not (0 <= lh[0] < shape[0] and 0 <= lh[1] < shape[1]):
                raise AttnkitError(f"head L{lh[0]}H{lh[1]} is outside this model's {shape[0]} layers × "
                                   f"{shape[1]} heads")
            if lh not in out:
                out.append(lh)
    return out


def format_heads(heads: Iterable[tuple[int, int]]) -> str:
    return ",".join(f"L{layer}H{head}" for layer, head in heads)


def _compact_heads(selected: np.ndarray) -> str:
    """Heads of a layers × heads boolean grid, short: "L3" for a whole layer, "L1H0-H3" for a run."""
    out = []
    for layer, row in enumerate(selected):
        if row.all():
            out.append(f"L{layer}")
            continue
        runs: list[list[int]] = []  # [first, last] of consecutive heads
        for h in np.flatnonzero(row).tolist():
            if runs and h == runs[-1][1] + 1:
                runs[-1][1] = h
            else:
                runs.append([h, h])
        out += [f"L{layer}H{a}" + (f"-H{b}" if b > a else "") for a, b in runs]
    return ",".join(out)


@dataclass
class HeadTypes:
    """Head types from a clustering run: `grid[layer, head]` is a type name; `types` in first-seen order."""

    grid: np.ndarray  # object array n_layers × n_heads of str ("" where a head has no type)
    source: str = ""

    @property
    def shape(self) -> tuple[int, int]:
        return self.grid.shape

    @property
    def types(self) -> list[str]:
        order = {"dense": 0, "diagonal": 1, "dense+vertical": 2, "dense&vertical": 2, "vertical": 3}
        names = sorted({t for t in self.grid.ravel() if t}, key=lambda t: (order.get(t, 9), t))
        return names

    def heads(self, type_name: str) -> list[tuple[int, int]]:
        if type_name not in self.types:
            raise AttnkitError(f"no heads of type {type_name!r} in {self.source or 'the clusters'}; "
                               f"types there: {', '.join(self.types)}")
        return [(int(l), int(h)) for l, h in zip(*np.nonzero(self.grid == type_name))]

    def counts(self) -> dict[str, int]:
        return {t: len(self.heads(t)) for t in self.types}


def load_clusters(run_or_file, shape: tuple[int, int] | None = None) -> HeadTypes:
    """Head types from a run's clusters.json (written by `attnkit cluster`), checked against `shape`."""
    return head_types_of(read_clusters(run_or_file), run_or_file, shape)


def head_types_of(data: dict, run_or_file, shape: tuple[int, int] | None = None) -> HeadTypes:
    """Head types from clusters.json content already read from `run_or_file` (attnkit.run.clusters.load_clusters;
    a command reads the file once), checked against `shape`."""
    path = Path(run_or_file)
    grid = type_grid(data)
    grid[grid == REMOVED] = ""  # a head a pruning removed has no type: no type's ablation names it
    if shape is not None and grid.shape != tuple(shape):
        raise AttnkitError(f"{path} covers {grid.shape[0]} layers × {grid.shape[1]} heads, "
                           f"but the model has {shape[0]} × {shape[1]}")
    if any(t is None for t in grid.flat):
        raise AttnkitError(f"{path}: some heads have no type")
    return HeadTypes(grid, source=str(path if path.suffix else path / CLUSTERS_FILE))


class Intervention:
    """Per-(layer, head) modes and regions (codes of `attnkit.features`, then PATCH and MEAN), renormalize, gates,
    and the values of patched and mean-ablated heads (`values`: (layer, head) → `HeadValue`)."""

    def __init__(self, mode: np.ndarray, region: np.ndarray | None = None, renormalize: bool = False,
                 gates: torch.Tensor | None = None, values: dict | None = None):
        self.mode = np.asarray(mode, dtype=np.int32)
        if self.mode.ndim != 2:
            raise AttnkitError(f"intervention mode must be n_layers × n_heads, got shape {self.mode.shape}")
        self.region = (np.zeros_like(self.mode) if region is None else np.asarray(region, dtype=np.int32))
        if self.region.shape != self.mode.shape:
            raise AttnkitError(f"region shape {self.region.shape} differs from mode shape {self.mode.shape}")
        if self.mode.min(initial=0) < 0 or self.mode.max(initial=0) >= len(HEAD_MODES):
            raise AttnkitError("intervention mode codes must be 0 (keep), 1 (zero), 2 (uniform), 3 (patch) or 4 (mean)")
        if self.region.min(initial=0) < 0 or self.region.max(initial=0) >= len(REGIONS):
            raise AttnkitError("intervention region codes must be 0 (all), 1 (no_intra) or 2 (no_inter)")
        if gates is not None and tuple(gates.shape) != self.mode.shape:
            raise AttnkitError(f"gates shape {tuple(gates.shape)} differs from {self.mode.shape}")
        self.values = dict(values or {})
        valued = {(int(l), int(h)) for l, h in zip(*np.nonzero(self.mode >= PATCH))}
        if valued != set(self.values):
            odd = sorted(valued ^ set(self.values))[0]
            raise AttnkitError(f"head L{odd[0]}H{odd[1]}: modes patch and mean need a value, and only they take one")
        self.renormalize = bool(renormalize)
        self.gates = gates
        self._cache: dict = {}

    @classmethod
    def identity(cls, n_layers: int, n_heads: int) -> Intervention:
        check_int(n_layers, "n_layers")
        check_int(n_heads, "n_heads")
        return cls(np.full((n_layers, n_heads), KEEP, dtype=np.int32))

    @classmethod
    def for_model(cls, model) -> Intervention:
        cfg = model.config
        n_layers = _attnkit_layers(model) or getattr(cfg, "num_hidden_layers", None) or cfg.n_layers
        n_heads = getattr(cfg, "num_attention_heads", None) or cfg.n_heads
        return cls.identity(n_layers, n_heads)

    @classmethod
    def from_heads(cls, model_or_shape, heads, *, mode: str = "zero", region: str = "all",
                   renormalize: bool = False, means=None) -> Intervention:
        """Apply `mode`/`region` to the listed heads ("L2H5,L3H0", "L4", or (layer, head) pairs). Mode mean takes
        each head's value from `means` (an `attnkit.head_means` result, or an n_layers × n_heads × D array)."""
        shape = _shape_of(model_or_shape)
        iv = cls.identity(*shape)
        iv.renormalize = bool(renormalize)
        return iv.set_heads(parse_heads(heads, shape), mode=mode, region=region, means=means)

    @classmethod
    def from_layers(cls, model_or_shape, layers: Iterable[int] | int, *, mode: str = "uniform",
                    region: str = "all", renormalize: bool = False, means=None) -> Intervention:
        """Apply `mode`/`region` to every head of the given layers (mode mean: values from `means`)."""
        shape = _shape_of(model_or_shape)
        layers = [layers] if isinstance(layers, (int, np.integer)) else list(layers)
        return cls.from_heads(shape, [(int(l), None) for l in layers], mode=mode, region=region,
                              renormalize=renormalize, means=means)

    @classmethod
    def from_types(cls, model_or_shape, head_types: HeadTypes, types: Sequence[str] | str, *,
                   mode: str = "zero", region: str = "all", renormalize: bool = False, means=None) -> Intervention:
        """Apply `mode`/`region` to every head whose cluster type is in `types` (mode mean: values from `means`)."""
        shape = _shape_of(model_or_shape)
        if head_types.shape != shape:
            raise AttnkitError(f"clusters cover {head_types.shape[0]} layers × {head_types.shape[1]} heads "
                               f"but the model has {shape[0]} × {shape[1]}")
        types = [types] if isinstance(types, str) else list(types)
        heads = list(itertools.chain.from_iterable(head_types.heads(t) for t in types))
        iv = cls.identity(*shape)
        iv.renormalize = bool(renormalize)
        return iv.set_heads(heads, mode=mode, region=region, means=means)

    def copy(self) -> Intervention:
        gates = None if self.gates is None else self.gates.detach().clone()
        return Intervention(self.mode.copy(), self.region.copy(), self.renormalize, gates, self.values)

    def with_gates(self, gates: torch.Tensor | None = None, requires_grad: bool = True) -> Intervention:
        """A copy with per-head gates (ones by default) that autograd tracks: Michel et al.'s ξ."""
        iv = self.copy()
        if gates is None:
            gates = torch.ones(self.shape, dtype=torch.float32)
        gates = gates.detach().to(torch.float32).clone().requires_grad_(requires_grad)
        if tuple(gates.shape) != self.shape:
            raise AttnkitError(f"gates shape {tuple(gates.shape)} differs from {self.shape}")
        iv.gates = gates
        return iv

    def set_heads(self, heads: Iterable[tuple[int, int]], *, mode: str = "keep", region: str = "all",
                  means=None) -> Intervention:
        """`set` each of `heads`; mode mean takes each head's value from `means` (`attnkit.head_means`' result or
        an n_layers × n_heads × D array)."""
        if mode == "mean":
            if means is None:
                raise AttnkitError(f"mode mean needs {arg('means')}: the heads' mean outputs (attnkit.head_means)")
            table = np.asarray(means.mean if isinstance(means, HeadMeans) else means)
            if table.ndim != 3 or table.shape[:2] != self.shape:
                raise AttnkitError(f"{arg('means')} must be n_layers × n_heads × head size = {self.shape[0]} × "
                                   f"{self.shape[1]} × D, got shape {table.shape}")
        for layer, head in heads:
            value = table[layer, head] if mode == "mean" else None
            self.set(layer, head, mode=mode, region=region, value=value)
        return self

    def _changed(self) -> np.ndarray:
        """L × H: True where a head's mode or region differs from keep/all."""
        return (self.mode != KEEP) | (self.region != ALL)

    def changed_heads(self) -> list[tuple[int, int]]:
        """Heads whose mode or region differs from keep/all."""
        return [(int(l), int(h)) for l, h in zip(*np.nonzero(self._changed()))]

    def describe(self) -> str:
        parts = []
        for code, name in enumerate(HEAD_MODES[1:], start=1):
            heads = [(int(l), int(h)) for l, h in zip(*np.nonzero(self.mode == code))]
            if heads:
                parts.append(f"{name}: {format_heads(heads)}")
        for code, name in enumerate(REGIONS[1:], start=1):
            heads = [(int(l), int(h)) for l, h in zip(*np.nonzero(self.region == code))]
            if heads:
                parts.append(f"{name}: {format_heads(heads)}")
        return "; ".join(parts) or "keep all"

    @property
    def shape(self) -> tuple[int, int]:
        return self.mode.shape

    def __repr__(self) -> str:
        parts = [f"{name} {_compact_heads(self.mode == code)}"
                 for code, name in enumerate(HEAD_MODES) if code != KEEP and (self.mode == code).any()]
        parts += [f"region {name} {_compact_heads(self.region == code)}"
                  for code, name in enumerate(REGIONS) if code != ALL and (self.region == code).any()]
        text = "; ".join(parts) or "keep all"
        if self.gates is not None:
            text += "; gates"
        L, H = self.shape
        return f"Intervention({L}×{H}: {text}, renormalize={self.renormalize})"

    def set(self, layer: int, head: int | None = None, *, mode: str = "keep", region: str = "all",
            value=None) -> Intervention:
        """Set one head (or the whole layer when head is None); returns self for chaining.

        Modes patch and mean take a `value` (docs/interventions.md): patch a tensor of L × D or B × L × D
        (tokens × head size; with head None, L × H × D or B × L × H × D, e.g. a layer of `cache_heads`) or a
        `HeadCache` whose output of this layer is read at forward time; mean a vector of D (head None: H × D)."""
        if mode not in HEAD_MODES:
            raise AttnkitError(f"unknown mode {mode!r}; use one of {', '.join(HEAD_MODES)}")
        if region not in REGIONS:
            raise AttnkitError(f"unknown region {region!r}; use one of {', '.join(REGIONS)}")
        L, H = self.shape
        if not is_index(layer) or not (head is None or is_index(head)):
            raise AttnkitError(f"layer and head must be integers >= 0 (head None: the whole layer), got layer "
                               f"{layer!r}, head {head!r}")
        if not 0 <= layer < L or (head is not None and not 0 <= head < H):
            raise AttnkitError(f"head L{layer}H{head} is outside this model's {L} layers × {H} heads")
        heads = range(H) if head is None else [head]
        if mode in ("patch", "mean"):
            values = head_values(mode, value, layer, head, H)
        elif value is not None:
            raise AttnkitError(f"{arg('value')} is for modes patch and mean, not {mode!r}")
        else:
            values = [None] * len(heads)
        sel = slice(None) if head is None else head
        self.mode[layer, sel] = HEAD_MODES.index(mode)
        self.region[layer, sel] = REGIONS.index(region)
        for h, v in zip(heads, values):
            self.values.pop((layer, h), None)
            if v is not None:
                self.values[(layer, h)] = v
        self._cache.clear()
        return self

    def first_changed_layer(self) -> int:
        """The first layer whose heads this intervention changes (0 with gates; the number of layers when it
        changes none): the layers before it compute what they compute without it."""
        if self.gates is not None:
            return 0
        changed = np.flatnonzero(self._changed().any(1))
        return int(changed[0]) if changed.size else self.shape[0]

    @property
    def is_identity(self) -> bool:
        return (not self.mode.any() and not self.region.any() and self.gates is None)

    def for_layer(self, layer: int, device) -> tuple:
        """(mode, region, gates) tensors of the op for one layer's heads; None where nothing changes (patched and
        mean-ablated heads are keep for the op: it computes their weights, and their outputs are replaced after)."""
        key = (layer, str(device))
        if key not in self._cache:
            m, r = np.where(self.mode[layer] >= PATCH, KEEP, self.mode[layer]), self.region[layer]
            mode = torch.as_tensor(m, device=device) if m.any() else None
            region = torch.as_tensor(r, device=device) if (r != ALL).any() else None
            self._cache[key] = (mode, region)
        mode, region = self._cache[key]
        gates = None if self.gates is None else self.gates[layer]
        return mode, region, gates

    def outputs_for_layer(self, layer: int, B: int, L: int, D: int, device, dtype) -> dict:
        """head → the tensor that replaces its output in a forward of B samples × L tokens with head size D
        (broadcastable to B × L × D), for the patched and mean-ablated heads of `layer`."""
        out = {}
        for (l, h), v in self.values.items():
            if l == layer:
                out[h] = v.resolve(layer, h, B, L, D, device, dtype)
        return out

    def layer_plan(self, layer: int, B: int, L: int, D: int, device, dtype) -> list:
        """What the attention of `layer` does to a forward of B samples (`attnkit.attention.runtime.LayerPart`s)."""
        mode, region, gates = self.for_layer(layer, device)
        return [LayerPart(0, B, mode, region, gates, self.renormalize,
                          self.outputs_for_layer(layer, B, L, D, device, dtype))]


@dataclass(frozen=True)
class HeadValue:
    """What replaces one head's output: `tensor` (patch: L × D or B × L × D; mean: D) or `cache`, a `HeadCache`
    whose output of the head is read at forward time."""

    mode: str
    tensor: torch.Tensor | None = None
    cache: object | None = None

    def resolve(self, layer: int, head: int, B: int, L: int, D: int, device, dtype) -> torch.Tensor:
        """The value for a forward of B × L tokens with head size D, checked, as a (1 or B) × L × D or 1 × 1 × D
        tensor on `device` in `dtype`."""
        name = f"L{layer}H{head}"
        t = self.tensor if self.cache is None else self.cache.head_output(layer, head)
        if t.shape[-1] != D:
            raise AttnkitError(f"the {self.mode} value of {name} has {t.shape[-1]} numbers per token but the head "
                               f"outputs {D} (the model's head size)")
        if self.mode == "mean":
            return t.to(device, dtype).view(1, 1, D)
        if t.shape[-2] != L:
            raise AttnkitError(f"the patch value of {name} covers {t.shape[-2]} tokens but the forward has {L}: "
                               "patch between inputs of equal token length")
        if t.dim() == 3 and t.shape[0] != B:
            raise AttnkitError(f"the patch value of {name} holds {t.shape[0]} samples but the forward has {B}")
        return t.to(device, dtype).reshape(-1, L, D)


def head_values(mode: str, value, layer: int, head: int | None, n_heads: int) -> list[HeadValue]:
    """The `HeadValue` of each head that `Intervention.set(layer, head, mode=mode, value=value)` sets, checked."""
    name = f"L{layer}" + ("" if head is None else f"H{head}")
    if value is None:
        raise AttnkitError(f"mode {mode!r} needs a {arg('value')} for {name}")
    heads = range(n_heads) if head is None else [head]
    if hasattr(value, "head_output"):  # a HeadCache: read at forward time
        if mode != "patch":
            raise AttnkitError(f"mode mean takes a vector of the head's size as {arg('value')}, not a cache")
        if not value.covers(layer):
            raise AttnkitError(f"the cache given as {arg('value')} for {name} does not keep layer {layer}")
        return [HeadValue(mode, cache=value) for _ in heads]
    try:
        t = value.detach() if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    except (TypeError, ValueError, RuntimeError) as exc:
        raise AttnkitError(f"the {mode} value of {name} is not an array of numbers ({exc})") from None
    if not t.dtype.is_floating_point:
        raise AttnkitError(f"the {mode} value of {name} must hold floats, got {t.dtype}")
    if t.numel() and not bool(torch.isfinite(t).all()):
        what = "NaN" if bool(torch.isnan(t).any()) else "an infinite number"
        raise AttnkitError(f"the {mode} value of {name} holds {what}")
    extra = 0 if head is not None else 1  # a whole layer has a heads axis before the head size
    shapes = {"patch": "L × D or B × L × D", "mean": "D"}[mode]
    ndims = {"patch": (2 + extra, 3 + extra), "mean": (1 + extra,)}[mode]
    if t.dim() not in ndims or (extra and t.shape[-2] != n_heads) or t.numel() == 0:
        want = shapes if not extra else shapes.replace("D", f"H × D (H = {n_heads})")
        raise AttnkitError(f"the {mode} value of {name} must have shape {want}"
                           f"{' (tokens × head size)' if mode == 'patch' else ' (the head size)'}, "
                           f"got {tuple(t.shape)}")
    return [HeadValue(mode, t if not extra else t.select(-2, h)) for h in heads]


class StackedInterventions:
    """Several interventions in one forward: intervention i covers samples i·group … (i + 1)·group − 1 (a batch
    repeated once per intervention). Each block of samples gets its own call of the op where the interventions
    differ in a layer, one call where they agree (how `attnkit ablate` evaluates several settings at once)."""

    def __init__(self, interventions: Sequence[Intervention], group: int):
        self.interventions = list(interventions)
        if not self.interventions or any(not isinstance(iv, Intervention) for iv in self.interventions):
            raise AttnkitError("stacked interventions need one or more attnkit.Intervention")
        shapes = {iv.shape for iv in self.interventions}
        if len(shapes) > 1:
            raise AttnkitError(f"stacked interventions differ in shape: {sorted(shapes)}")
        if int(group) < 1:
            raise AttnkitError(f"each stacked intervention needs at least one sample, got {group}")
        self.group = int(group)

    @property
    def shape(self) -> tuple[int, int]:
        return self.interventions[0].shape

    def layer_plan(self, layer: int, B: int, L: int, D: int, device, dtype) -> list:
        n = len(self.interventions)
        if B != n * self.group:
            raise AttnkitError(f"{n} stacked interventions of {self.group} samples each need a batch of "
                               f"{n * self.group}, but the forward has {B}")
        parts: list = []
        for i, iv in enumerate(self.interventions):
            (p,) = iv.layer_plan(layer, self.group, L, D, device, dtype)
            start = i * self.group
            if parts and _same_op_call(parts[-1], p):
                parts[-1] = LayerPart(parts[-1].start, start + self.group, p.mode, p.region, p.gates, p.renormalize)
            else:
                parts.append(LayerPart(start, start + self.group, p.mode, p.region, p.gates, p.renormalize,
                                       p.outputs))
        return parts


def _same_op_call(a: LayerPart, b: LayerPart) -> bool:
    """Whether two blocks of samples can share one call of the op (same codes, no gates, no replaced outputs)."""
    def same(x, y):
        return (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))

    return (not a.outputs and not b.outputs and a.gates is None and b.gates is None
            and a.renormalize == b.renormalize and same(a.mode, b.mode) and same(a.region, b.region))


def _as_sentence_ids(sentence_ids) -> torch.Tensor:
    """User-given sentence ids as a B×L int32 CPU tensor, or a one-line AttnkitError."""
    try:
        ids = torch.as_tensor(np.asarray(sentence_ids) if not isinstance(sentence_ids, torch.Tensor) else sentence_ids)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise AttnkitError(f"sentence ids must be a batch × length array of integers ({exc})") from None
    if ids.dim() != 2:
        raise AttnkitError(f"sentence ids must be batch × length (one id per token), got shape {tuple(ids.shape)}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex:
        raise AttnkitError(f"sentence ids must be integers, got {ids.dtype}")
    info = torch.iinfo(torch.int32)
    if ids.numel() and (int(ids.min()) < info.min or int(ids.max()) > info.max):
        raise AttnkitError("sentence ids must fit in 32 bits")
    return ids.detach().to("cpu", torch.int32)


def _same_value(a: HeadValue, b: HeadValue) -> bool:
    """Whether two patch or mean values are the same: the same cache, or equal tensors."""
    if a.mode != b.mode or a.cache is not b.cache:
        return False
    if a.cache is not None:
        return True
    return a.tensor is b.tensor or (a.tensor.shape == b.tensor.shape and bool(torch.equal(a.tensor, b.tensor)))


def _conflict(what: str, layer: int, head: int, outer: str, inner: str) -> AttnkitError:
    return AttnkitError(f"nested interventions both set the {what} of head L{layer}H{head}: {outer} in the enclosing "
                        f"block, {inner} in the inner one; attnkit composes nested blocks but refuses to choose "
                        "between two settings of one head (docs/interventions.md, \"Nested blocks\")")


def merged(outer: Intervention, inner: Intervention) -> Intervention:
    """The intervention in force inside `intervene(model, inner)` nested in `intervene(model, outer)`
    (docs/interventions.md, "Nested blocks"): per head, the mode (and value) and the region each block sets,
    where a block sets what differs from keep / all; a head whose mode (or region) both set differently is
    refused by name. Gates multiply; renormalize is that of the block with region settings (refused when both
    have region settings and differ on it)."""
    if outer.shape != inner.shape:
        raise AttnkitError(f"nested interventions differ in shape: {outer.shape} outside, {inner.shape} inside")
    for l, h in zip(*np.nonzero((outer.mode != KEEP) & (inner.mode != KEEP))):
        l, h = int(l), int(h)
        a, b = int(outer.mode[l, h]), int(inner.mode[l, h])
        if a != b or (a >= PATCH and not _same_value(outer.values[(l, h)], inner.values[(l, h)])):
            raise _conflict("mode", l, h, HEAD_MODES[a], HEAD_MODES[b] + (" with another value" if a == b else ""))
    for l, h in zip(*np.nonzero((outer.region != ALL) & (inner.region != ALL))):
        l, h = int(l), int(h)
        if outer.region[l, h] != inner.region[l, h]:
            raise _conflict("region", l, h, REGIONS[outer.region[l, h]], REGIONS[inner.region[l, h]])
    outer_regions, inner_regions = bool((outer.region != ALL).any()), bool((inner.region != ALL).any())
    if outer_regions and inner_regions and outer.renormalize != inner.renormalize:
        raise AttnkitError(f"nested interventions both have region settings but differ in renormalize "
                           f"({outer.renormalize} in the enclosing block, {inner.renormalize} in the inner one): "
                           "give both blocks the same renormalize")
    renormalize = (inner.renormalize if inner_regions else outer.renormalize if outer_regions
                   else outer.renormalize or inner.renormalize)
    gates = outer.gates if inner.gates is None else inner.gates if outer.gates is None else outer.gates * inner.gates
    mode = np.where(inner.mode != KEEP, inner.mode, outer.mode)
    region = np.where(inner.region != ALL, inner.region, outer.region)
    return Intervention(mode, region, renormalize, gates, {**outer.values, **inner.values})


def composed(outer, inner):
    """`inner` (an Intervention or StackedInterventions) added to `outer` (the one in force, or None): see `merged`.
    A stack takes the plain intervention into each of its settings; two stacks are refused."""
    if outer is None:
        return inner
    if isinstance(outer, StackedInterventions) and isinstance(inner, StackedInterventions):
        raise AttnkitError("stacked interventions cannot be nested in stacked interventions: which setting of one "
                           "stack goes with which of the other is undefined")
    if isinstance(inner, StackedInterventions):
        return StackedInterventions([merged(outer, iv) for iv in inner.interventions], inner.group)
    if isinstance(outer, StackedInterventions):
        return StackedInterventions([merged(iv, inner) for iv in outer.interventions], outer.group)
    return merged(outer, inner)


def _checked(model, intervention):
    """`intervention` after checking it fits `model` (None passes)."""
    if intervention is None:
        return None
    if not isinstance(intervention, (Intervention, StackedInterventions)):
        raise AttnkitError(f"intervene() needs an attnkit.Intervention, got {type(intervention).__name__}")
    n_layers = len(attention_modules(model))
    if intervention.shape[0] != n_layers:
        raise AttnkitError(f"intervention covers {intervention.shape[0]} layers but the model has {n_layers}")
    n_heads = _shape_of(model)[1] if getattr(model, "config", None) is not None else intervention.shape[1]
    if intervention.shape[1] != n_heads:
        raise AttnkitError(f"intervention covers {intervention.shape[1]} heads per layer but the model has {n_heads}")
    return intervention


# --- Open blocks: what is in force on a model ------------------------------------------------------------------
#
# `intervene`, `only` and `sentences` blocks are state of the model, as `model.eval()` is: every forward of the model
# sees them, whichever thread runs it (docs/interventions.md, "Blocks, threads and interruptions"). What is in force
# follows from the blocks still open, in the order they were entered, so blocks may be left in any order (by hand,
# through an ExitStack, or by two threads whose blocks overlap): leaving the innermost block puts back exactly what
# was in force when it was entered; leaving another one recomposes the blocks entered after it without it.

_OPEN_BLOCKS = "_attnkit_open_blocks"  # attribute of a Runtime while blocks are open on its model: an _OpenBlocks
_lock = threading.Lock()  # entering and leaving blocks, from any thread


@dataclass(eq=False)
class _Block:
    """One open block: its intervention (`sets`: it has one; `alone`: `only`, in force whatever the blocks before it
    set), its sentence ids, and the intervention in force while it is the innermost open block."""

    intervention: object | None
    sets: bool
    alone: bool
    sentences: torch.Tensor | None
    in_force: object | None = None


@dataclass
class _OpenBlocks:
    """The open blocks of a model in the order they were entered, and what was in force before the first."""

    intervention: object | None
    sentences: torch.Tensor | None
    blocks: list[_Block]


def _attach(rt, intervention, sentence_ids) -> None:
    """Put `intervention` and `sentence_ids` in force (None: none) for the forwards that begin from now on (each
    reads them into its context when it begins: attnkit/attention/context.py)."""
    rt.give(intervention=intervention, sentences=sentence_ids)


def _on_top(below, block: _Block):
    """The intervention in force inside `block` when `below` is in force outside it."""
    if not block.sets:
        return below
    return block.intervention if block.alone else composed(below, block.intervention)


def _enter(model, intervention, sentence_ids, *, sets: bool, alone: bool = False):
    """Open a block on `model` (checked first: a refusal changes nothing) and put it in force; returns the runtime and
    the block, for `_leave`."""
    rt = runtime_of(model)
    with _lock:
        state = getattr(rt, _OPEN_BLOCKS, None) or _OpenBlocks(rt.intervention, rt.sentences, [])
        ids = rt.sentences
        if sentence_ids is not None and ids is not None and not (
                ids.shape == sentence_ids.shape and torch.equal(ids, sentence_ids)):
            raise AttnkitError("sentence ids are already given by an enclosing block (attnkit.sentences or "
                               f"intervene's {arg('sentences')}), and these differ: a batch has one set of sentences, "
                               "so a nested block may repeat them but not replace them")
        block = _Block(intervention, sets, alone, sentence_ids)
        block.in_force = _on_top(state.blocks[-1].in_force if state.blocks else state.intervention, block)
        state.blocks.append(block)
        setattr(rt, _OPEN_BLOCKS, state)
        _attach(rt, block.in_force, ids if sentence_ids is None else sentence_ids)
    return rt, block


def _leave(rt, block: _Block) -> None:
    """Close `block`, in whatever order blocks are left, and put in force what the blocks still open make."""
    with _lock:
        state = getattr(rt, _OPEN_BLOCKS, None)
        where = [i for i, b in enumerate(state.blocks) if b is block] if state is not None else []
        if not where:  # already closed: a refused recomposition (below) closed it
            return
        i = where[0]
        del state.blocks[i]
        below = state.blocks[i - 1].in_force if i else state.intervention
        refused = None
        for j, b in enumerate(state.blocks[i:], start=i):  # blocks entered after it, recomposed without it
            try:
                below = b.in_force = _on_top(below, b)
            except AttnkitError as exc:  # an Intervention changed in place since: restore, and say so
                refused = exc
                del state.blocks[j:]
                break
        ids = next((b.sentences for b in reversed(state.blocks) if b.sentences is not None), state.sentences)
        if not state.blocks:
            delattr(rt, _OPEN_BLOCKS)
        _attach(rt, below, ids)
    if refused is not None:
        raise AttnkitError(f"an intervene block was left before a block entered inside it, and the blocks still open "
                           f"no longer compose ({refused}); they are closed, and the model has what was in force "
                           "before them") from None


def open_blocks(model) -> int:
    """How many `intervene`, `only` and `sentences` blocks are open on `model` (0: attnkit holds none)."""
    state = getattr(runtime_of(model), _OPEN_BLOCKS, None)
    return 0 if state is None else len(state.blocks)


@contextlib.contextmanager
def _block(model, intervention, sentence_ids, *, sets: bool, alone: bool = False):
    rt, block = _enter(model, intervention, sentence_ids, sets=sets, alone=alone)
    try:
        with rt.closing_forwards():  # a forward Ctrl-C left open is exited
            yield model
    finally:  # KeyboardInterrupt included
        _leave(rt, block)


def sentences(model, sentence_ids):
    """Inside the block, plain forwards of `model` use these sentence ids (batch × length integers,
    one per token of the padded batch; equal ids = same sentence) for region interventions, instead
    of the segments found from token_type_ids or separator tokens. attnkit's own runners (extract,
    ablate) still use their own. A batch of another shape is refused, and so are other ids than those
    an enclosing block gave."""
    return _block(model, None, _as_sentence_ids(sentence_ids), sets=False)


def patch_regions(model, regions, *, batch: int = 1, size: tuple | None = None) -> torch.Tensor:
    """Regions of the patches of an instrumented vision transformer's `batch` images, as the sentence ids that
    `sentences` and `intervene(..., sentences=...)` take: so no_intra / no_inter keep a head from attending within /
    across regions of the image. `regions`: "quadrants", or a map of region ids (H × W or batch × H × W non-negative
    integers: a label map of the image in pixels, or one id per patch), read at each patch's centre; [CLS], the
    distillation token and the registers form a region of their own (−1). `size`: the images' (height, width) in
    pixels as the model gets them (default: its config's). attnkit.attention.positions.region_ids says how."""
    from .attention.positions import ImageTokens, region_ids

    layout = runtime_of(model).image
    if layout is None:
        raise AttnkitError("patch regions are for a vision transformer: this model takes text (its sentences are "
                           "its regions)")
    check_int(batch, "batch")
    return region_ids(ImageTokens(layout, tuple(size) if size is not None else layout.image), regions, batch)


def intervene(model, intervention: Intervention, sentences=None):
    """Apply `intervention` to an instrumented model inside the block; always restores the model.

    Nested in another `intervene` block, it adds its settings to those in force (`merged`; a head both set
    differently is refused by name), and leaving it restores exactly the enclosing block's intervention. Blocks may
    be left in any order (docs/interventions.md, "Blocks, threads and interruptions").

    Region interventions (no_intra / no_inter) take each forward's sentences from its token_type_ids
    or separator tokens (attnkit/hf_attention.py says how), or from `sentences` (batch × length ids)."""
    if intervention is None:
        raise AttnkitError("intervene() needs an attnkit.Intervention, got NoneType")
    ids = None if sentences is None else _as_sentence_ids(sentences)
    return _block(model, _checked(model, intervention), ids, sets=True)


def only(model, intervention):
    """Inside the block, exactly `intervention` (None: none) is in force, whatever an enclosing block set:
    attnkit's ablation runners evaluate their settings, and their unchanged baseline, this way."""
    return _block(model, _checked(model, intervention), None, sets=True, alone=True)
