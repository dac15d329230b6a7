"""attnkit as a transformers 5 attention implementation (`attn_implementation="attnkit"`).

transformers calls `attnkit_attention(module, q, k, v, mask, scaling=..., dropout=...)` from every
self-attention layer. With nothing active it is plain attention (equal to eager). What extraction and
interventions need per forward — the batch's token classes and sentence ids, the intervention, where
to put features — lives in a `Runtime` that `attnkit.models.instrument` attaches to each attention
module; context managers in `extraction` and `interventions` fill it and always clear it again.

The mask function registered beside it hands over the 2-D padding mask (or None when a batch has no
padding) instead of an L×L bias: the op takes per-sample lengths, never an L×L tensor.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from . import ops
from .errors import AttnkitError

NAME = "attnkit"


@dataclass
class BatchInfo:
    """What the op needs to know about the batch beyond q, k, v (on the model's device)."""

    lengths: torch.Tensor  # int64 B
    token_class: torch.Tensor | None = None  # int32 B×L
    sentence_id: torch.Tensor | None = None  # int32 B×L


@dataclass
class Runtime:
    """Per-model state read by the attention function during a forward pass."""

    backend: str = "auto"
    num_windows: int = 16
    want_features: bool = False
    batch: BatchInfo | None = None
    intervention: object | None = None  # attnkit.interventions.Intervention
    features: dict = field(default_factory=dict)  # layer -> B×H×F tensor, filled during forward
    # Callables (layer, query, key, lengths, scaling) for statistics that need q and k themselves,
    # e.g. the Jensen-Shannon distances between heads.
    observers: list[Callable] = field(default_factory=list)
    calls: int = 0

    @property
    def active(self) -> bool:
        return self.want_features or self.intervention is not None or bool(self.observers)

    @contextlib.contextmanager
    def batch_of(self, batch):
        """Within the block, forwards use `batch`'s lengths, token classes and sentence ids
        (an `attnkit.tokens.Batch` on the model's device)."""
        self.batch = BatchInfo(batch.lengths, batch.token_class, batch.sentence_id)
        try:
            yield self
        finally:
            self.batch = None


_probe: list | None = None  # set by models.instrument to learn which modules call us
_last_mask: tuple = (lambda: None, None)


def lengths_from_mask(mask: torch.Tensor | None, B: int, L: int, device) -> torch.Tensor:
    """Per-sample lengths (int64, on the mask's device) from a 2-D padding mask; insists on right
    padding (1…1 0…0) and at least one token per sample.

    The same mask object reaches every layer of a forward, so the lengths are computed and checked once
    per forward. Checking needs the mask's values: in an eager forward (CPU, or CUDA outside graph
    capture: one host sync per new mask) a bad mask raises AttnkitError. Under torch.compile, or while
    a CUDA graph is being captured, nothing is read on the host (the lengths stay on the device): the
    check becomes a device-side assertion (torch._assert_async), so a bad mask then fails the run
    with an assertion instead of an AttnkitError. Run a batch eagerly before capturing a graph.
    """
    global _last_mask
    if mask is None:
        return torch.full((B,), L, dtype=torch.int64, device=device)
    if mask.dim() != 2 or mask.shape != (B, L):
        raise AttnkitError(
            f"attnkit attention needs a 2-D padding mask of shape (batch, length) = ({B}, {L}); "
            f"got shape {tuple(mask.shape)} (pass the tokenizer's attention_mask, not a prepared 4-D mask)"
        )
    compiling = torch.compiler.is_compiling()
    if not compiling and _last_mask[0]() is mask:
        return _last_mask[1]
    m = mask.bool()
    lengths = m.sum(-1)
    right_padded = (m == (torch.arange(L, device=m.device)[None, :] < lengths[:, None])).all()
    non_empty = (lengths > 0).all()
    if compiling or (m.is_cuda and torch.cuda.is_current_stream_capturing()):
        torch._assert_async(right_padded & non_empty,
                            "attnkit attention needs right-padded batches with at least one token per sample")
        return lengths
    ok_padding, ok_non_empty = torch.stack([right_padded, non_empty]).tolist()  # one host read
    if not ok_padding:
        raise AttnkitError("attnkit attention needs right-padded batches (padding_side='right')")
    if not ok_non_empty:
        raise AttnkitError("a sample in the batch has no unmasked token")
    _last_mask = (weakref.ref(mask), lengths)
    return lengths


def attnkit_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    if _probe is not None:
        _probe.append(module)
    B, H, L, D = query.shape
    if key.shape[2] != L:
        raise AttnkitError(
            "attnkit attention supports self-attention over one sequence (no cross-attention or KV cache)"
        )
    rt: Runtime | None = getattr(module, "_attnkit_runtime", None)
    if dropout and module.training:
        if rt is not None and rt.active:
            raise AttnkitError("attnkit cannot measure or intervene while attention dropout is on: call model.eval()")
        # training: plain attention with dropout, exactly what sdpa computes
        bias = None if attention_mask is None else attention_mask[:, None, None, :].bool()
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=bias, dropout_p=dropout, scale=scaling
        )
        return out.transpose(1, 2).contiguous(), None

    if rt is not None and rt.batch is not None:
        info = rt.batch
        lengths = info.lengths
        if lengths.shape[0] != B:
            raise AttnkitError(f"runtime batch has {lengths.shape[0]} samples but the model got {B}")
    else:
        info = None
        lengths = lengths_from_mask(attention_mask, B, L, query.device)

    mode = region = gates = None
    renormalize = False
    want = False
    backend = "auto"
    num_windows = 16
    if rt is not None:
        rt.calls += 1
        backend, num_windows = rt.backend, rt.num_windows
        want = rt.want_features and info is not None
        if rt.intervention is not None:
            mode, region, gates = rt.intervention.for_layer(module.layer_idx, query.device)
            renormalize = rt.intervention.renormalize
        for obs in rt.observers:
            obs(module.layer_idx, query, key, lengths, scaling)

    out, feats = ops.attention(
        query, key, value, lengths,
        info.token_class if info is not None else None,
        info.sentence_id if info is not None else None,
        scaling=scaling, num_windows=num_windows, mode=mode, region=region,
        renormalize=renormalize, gates=gates, want_features=want, backend=backend,
    )
    if want:
        rt.features[module.layer_idx] = feats
    return out, None


def padding_mask(batch_size, q_length, kv_length, *args, attention_mask=None, **kwargs):
    """transformers' mask function for attnkit: the 2-D padding mask (None when the batch has no
    padding). While compiling or capturing a CUDA graph, the mask is handed over even without padding:
    deciding "no padding" needs its values on the host (a graph break, or a sync that a capture
    forbids), and lengths_from_mask handles a full mask just as well."""
    if attention_mask is not None and (
        torch.compiler.is_compiling() or (attention_mask.is_cuda and torch.cuda.is_current_stream_capturing())
    ):
        return attention_mask[:, -kv_length:]
    return flash_attention_mask(batch_size, q_length, kv_length, *args, attention_mask=attention_mask, **kwargs)


def register() -> None:
    """Make "attnkit" a valid `attn_implementation` (idempotent; done on `import attnkit`)."""
    AttentionInterface.register(NAME, attnkit_attention)
    AttentionMaskInterface.register(NAME, padding_mask)


register()
