"""How a batch's tokens lie in the padded tensors transformers passes: per-sample lengths from the 2-D padding mask,
left padding moved to the front and back (`rolled`, `unshift`), the token classes of a forward without an attnkit
batch. A left-padded batch is taken by moving each sample's tokens to the front, calling the op, and moving the
results back; rows of left padding get zeros."""
from __future__ import annotations

import weakref

import torch

from ..errors import AttnkitError
from ..features import CLS

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


_last_layout: tuple = (lambda: None, None)


def padding_of(mask: torch.Tensor | None, B: int, L: int, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(lengths, offsets) of a batch whose samples are right- or left-padded: each sample's tokens are one run of
    ones in the 2-D mask, starting at `offsets[b]` (int64 B; None when every sample starts at 0, i.e. the batch is
    right-padded). A mask whose ones are not one run (1 0 1) is refused. While compiling or capturing a CUDA graph
    only right padding is taken (lengths_from_mask: a device-side assertion), as finding offsets needs the host."""
    global _last_layout
    if mask is None or torch.compiler.is_compiling() or (mask.is_cuda and torch.cuda.is_current_stream_capturing()):
        return lengths_from_mask(mask, B, L, device), None
    if _last_layout[0]() is mask:
        return _last_layout[1]
    if mask.dim() != 2 or mask.shape != (B, L):
        return lengths_from_mask(mask, B, L, device), None  # its message names the shape
    m = mask.bool()
    lengths = m.sum(-1)
    offsets = torch.where(lengths > 0, m.int().argmax(-1), 0)
    pos = torch.arange(L, device=m.device)[None, :]
    one_run = (m == ((pos >= offsets[:, None]) & (pos < (offsets + lengths)[:, None]))).all()
    ok_run, ok_non_empty, shifted = torch.stack([one_run, (lengths > 0).all(), (offsets > 0).any()]).tolist()
    if not ok_run:
        raise AttnkitError("attnkit attention needs each sample's tokens in one run: right- or left-padded batches "
                           "(the attention mask has a 0 between two 1s)")
    if not ok_non_empty:
        raise AttnkitError("a sample in the batch has no unmasked token")
    result = (lengths, offsets if shifted else None)
    _last_layout = (weakref.ref(mask), result)
    return result


def rolled(t: torch.Tensor, offsets: torch.Tensor, dim: int, back: bool = False) -> torch.Tensor:
    """Each sample b of `t` (samples on axis 0) rolled along `dim` so that position offsets[b] comes first
    (`back`: the inverse, the first position goes back to offsets[b]). Left padding becomes right padding: the
    sample's tokens move to the front, its padding behind them."""
    L = t.shape[dim]
    sign = -1 if back else 1
    idx = (torch.arange(L, device=t.device)[None, :] + sign * offsets.to(t.device)[:, None]) % L  # B × L
    shape = [1] * t.dim()
    shape[0], shape[dim] = t.shape[0], L
    return torch.gather(t, dim, idx.view(shape).expand(t.shape))


def unshift(t: torch.Tensor, offsets: torch.Tensor, dims, row_dim: int, first_row: int = 0) -> torch.Tensor:
    """A result computed on left padding moved to the front (`rolled`) put back in the batch's own positions
    along `dims`; the rows of padding (`row_dim`, whose positions `first_row` + i lie below offsets[b]) are 0. A
    KV-cache step's rows were not moved (they are the batch's last positions, `first_row` = keys − queries)."""
    for d in dims:
        t = rolled(t, offsets, d, back=True)
    L = t.shape[row_dim]
    pad = first_row + torch.arange(L, device=t.device)[None, :] < offsets.to(t.device)[:, None]
    shape = [1] * t.dim()
    shape[0], shape[row_dim] = t.shape[0], L
    return t.masked_fill(pad.view(shape), 0)


def first_token_classes(B: int, L: int, device) -> torch.Tensor:
    """B×L token classes for a forward without attnkit's own batch (attnkit.track): the first token of each sample
    is CLS (after left padding is moved to the front, position 0 holds it), every other token OTHER, so the feature
    `cls` is each row's weight on the first token (a decoder's BOS or attention sink)."""
    classes = torch.zeros(B, L, dtype=torch.int32, device=device)
    classes[:, 0] = CLS
    return classes
