"""Interventions on attention heads (docs/interventions.md): per (layer, head) a mode and a region,
optional renormalisation, and differentiable per-head gates.

    iv = Intervention.identity(n_layers, n_heads)
    iv.set(2, 5, mode="zero")
    with attnkit.intervene(model, iv):
        model(**inputs)

Builders: `Intervention.from_heads(model_or_shape, "L2H5,L3H0", mode="zero")`, `.from_layers(...)`,
`.from_types(shape, load_clusters(run), ["diagonal"], ...)`; `with_gates()` adds differentiable gates.

transformers 5 removed `head_mask`; this replaces it, through the same fused op that extracts features.

Regions (no_intra / no_inter) need each token's sentence: in a plain forward they are the segments of
a text pair (token_type_ids or separator tokens), or ids given with `sentences(model, ids)` /
`intervene(..., sentences=ids)`; attnkit/hf_attention.py has the exact rule and when it refuses.

Head types come from a run's clusters.json, written by `attnkit cluster` (format: docs/files.md; reader:
attnkit/run/clusters.py), through `load_clusters`.
"""
from __future__ import annotations

import contextlib
import itertools
import numbers
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .errors import AttnkitError, check_int
from .features import ALL, KEEP, MODES, REGIONS
from .models import attention_modules, runtime_of
from .run.clusters import CLUSTERS_FILE, type_grid
from .run.clusters import load_clusters as read_clusters

_HEAD_RE = re.compile(r"^L(\d+)(?:H(\d+))?$", re.IGNORECASE)


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
    n_layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layers", None)
    n_heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_heads", None)
    if not n_layers or not n_heads:
        raise AttnkitError(f"model config {type(cfg).__name__} names no layer/head counts")
    return int(n_layers), int(n_heads)


def parse_heads(spec, shape: tuple[int, int] | None = None) -> list[tuple[int, int]]:
    """Heads from "L2H5,L3H0" (0-based; "L4" = every head of layer 4) or an iterable of (layer, head).

    With `shape` = (n_layers, n_heads), whole layers are expanded and every head is range-checked.
    Duplicates are dropped; order of first appearance is kept.
    """
    items: list = []
    if isinstance(spec, str):
        for part in spec.replace(" ", "").split(","):
            if not part:
                continue
            m = _HEAD_RE.match(part)
            if not m:
                raise AttnkitError(f"cannot read head {part!r}: write heads as L<layer>H<head>, e.g. L2H5, or L<layer>")
            items.append((int(m.group(1)), None if m.group(2) is None else int(m.group(2))))
    else:
        for item in spec:
            try:
                layer, head = item
            except (TypeError, ValueError):
                raise AttnkitError(f"a head must be a (layer, head) pair, got {item!r}") from None
            if not _is_index(layer) or not (head is None or _is_index(head)):
                raise AttnkitError(f"a head must be a (layer, head) pair of integers >= 0 (head None: the whole "
                                   f"layer), got {item!r}")
            items.append((int(layer), None if head is None else int(head)))
    out: list[tuple[int, int]] = []
    for layer, head in items:
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


def _is_index(x) -> bool:
    """An integer >= 0 (a numpy integer too; not a bool, a float or a string): a layer or head number."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 0


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
    path = Path(run_or_file)
    data = read_clusters(path)
    grid = type_grid(data)
    if shape is not None and grid.shape != tuple(shape):
        raise AttnkitError(f"{path} covers {grid.shape[0]} layers × {grid.shape[1]} heads, "
                           f"but the model has {shape[0]} × {shape[1]}")
    if any(t is None for t in grid.flat):
        raise AttnkitError(f"{path}: some heads have no type")
    return HeadTypes(grid, source=str(path if path.suffix else path / CLUSTERS_FILE))


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
    def identity(cls, n_layers: int, n_heads: int) -> Intervention:
        check_int(n_layers, "n_layers")
        check_int(n_heads, "n_heads")
        return cls(np.full((n_layers, n_heads), KEEP, dtype=np.int32))

    @classmethod
    def for_model(cls, model) -> Intervention:
        cfg = model.config
        n_layers = getattr(cfg, "num_hidden_layers", None) or cfg.n_layers
        n_heads = getattr(cfg, "num_attention_heads", None) or cfg.n_heads
        return cls.identity(n_layers, n_heads)

    @classmethod
    def from_heads(cls, model_or_shape, heads, *, mode: str = "zero", region: str = "all",
                   renormalize: bool = False) -> Intervention:
        """Apply `mode`/`region` to the listed heads ("L2H5,L3H0", "L4", or (layer, head) pairs)."""
        shape = _shape_of(model_or_shape)
        iv = cls.identity(*shape)
        iv.renormalize = bool(renormalize)
        return iv.set_heads(parse_heads(heads, shape), mode=mode, region=region)

    @classmethod
    def from_layers(cls, model_or_shape, layers: Iterable[int] | int, *, mode: str = "uniform",
                    region: str = "all", renormalize: bool = False) -> Intervention:
        """Apply `mode`/`region` to every head of the given layers."""
        shape = _shape_of(model_or_shape)
        layers = [layers] if isinstance(layers, (int, np.integer)) else list(layers)
        return cls.from_heads(shape, [(int(l), None) for l in layers], mode=mode, region=region,
                              renormalize=renormalize)

    @classmethod
    def from_types(cls, model_or_shape, head_types: HeadTypes, types: Sequence[str] | str, *,
                   mode: str = "zero", region: str = "all", renormalize: bool = False) -> Intervention:
        """Apply `mode`/`region` to every head whose cluster type is in `types`."""
        shape = _shape_of(model_or_shape)
        if head_types.shape != shape:
            raise AttnkitError(f"clusters cover {head_types.shape[0]} layers × {head_types.shape[1]} heads "
                               f"but the model has {shape[0]} × {shape[1]}")
        types = [types] if isinstance(types, str) else list(types)
        heads = list(itertools.chain.from_iterable(head_types.heads(t) for t in types))
        iv = cls.identity(*shape)
        iv.renormalize = bool(renormalize)
        return iv.set_heads(heads, mode=mode, region=region)

    def copy(self) -> Intervention:
        gates = None if self.gates is None else self.gates.detach().clone()
        return Intervention(self.mode.copy(), self.region.copy(), self.renormalize, gates)

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

    def set_heads(self, heads: Iterable[tuple[int, int]], *, mode: str = "keep", region: str = "all") -> Intervention:
        for layer, head in heads:
            self.set(layer, head, mode=mode, region=region)
        return self

    def changed_heads(self) -> list[tuple[int, int]]:
        """Heads whose mode or region differs from keep/all."""
        return [(int(l), int(h)) for l, h in zip(*np.nonzero((self.mode != KEEP) | (self.region != ALL)))]

    def describe(self) -> str:
        parts = []
        for code, name in enumerate(MODES[1:], start=1):
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
                 for code, name in enumerate(MODES) if code != KEEP and (self.mode == code).any()]
        parts += [f"region {name} {_compact_heads(self.region == code)}"
                  for code, name in enumerate(REGIONS) if code != ALL and (self.region == code).any()]
        text = "; ".join(parts) or "keep all"
        if self.gates is not None:
            text += "; gates"
        L, H = self.shape
        return f"Intervention({L}×{H}: {text}, renormalize={self.renormalize})"

    def set(self, layer: int, head: int | None = None, *, mode: str = "keep", region: str = "all") -> Intervention:
        """Set one head (or the whole layer when head is None); returns self for chaining."""
        if mode not in MODES:
            raise AttnkitError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
        if region not in REGIONS:
            raise AttnkitError(f"unknown region {region!r}; use one of {', '.join(REGIONS)}")
        L, H = self.shape
        if not _is_index(layer) or not (head is None or _is_index(head)):
            raise AttnkitError(f"layer and head must be integers >= 0 (head None: the whole layer), got layer "
                               f"{layer!r}, head {head!r}")
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


@contextlib.contextmanager
def _given_sentences(model, sentence_ids):
    rt = runtime_of(model)
    ids = _as_sentence_ids(sentence_ids)
    previous = rt.sentences
    rt.sentences = ids
    try:
        yield model
    finally:
        rt.sentences = previous


def sentences(model, sentence_ids):
    """Inside the block, plain forwards of `model` use these sentence ids (batch × length integers,
    one per token of the padded batch; equal ids = same sentence) for region interventions, instead
    of the segments found from token_type_ids or separator tokens. attnkit's own runners (extract,
    ablate) still use their own. A batch of another shape is refused."""
    return _given_sentences(model, sentence_ids)


@contextlib.contextmanager
def intervene(model, intervention: Intervention, sentences=None):
    """Apply `intervention` to an instrumented model inside the block; always restores the model.

    Region interventions (no_intra / no_inter) take each forward's sentences from its token_type_ids
    or separator tokens (attnkit/hf_attention.py says how), or from `sentences` (batch × length ids)."""
    if not isinstance(intervention, Intervention):
        raise AttnkitError(f"intervene() needs an attnkit.Intervention, got {type(intervention).__name__}")
    rt = runtime_of(model)
    n_layers = len(attention_modules(model))
    if intervention.shape[0] != n_layers:
        raise AttnkitError(f"intervention covers {intervention.shape[0]} layers but the model has {n_layers}")
    n_heads = _shape_of(model)[1] if getattr(model, "config", None) is not None else intervention.shape[1]
    if intervention.shape[1] != n_heads:
        raise AttnkitError(f"intervention covers {intervention.shape[1]} heads per layer but the model has {n_heads}")
    with contextlib.ExitStack() as stack:
        if sentences is not None:
            stack.enter_context(_given_sentences(model, sentences))
        previous = rt.intervention
        rt.intervention = intervention
        try:
            yield model
        finally:
            rt.intervention = previous
