"""Word-level attention (Clark et al. 2019, Sec. 4.2): the `attnkit::word_attention` op, its reference twin
and the wrapper that picks between them.

Definitions (docs/probes.md, "Word-level attention"). For sample b with n valid tokens, head h,
token-level weights A[s, t] = softmax over t < n of scaling · q_s · k_t (every valid token, special tokens
included, takes part in the softmax), and `word_id[b, t]` the word of token t (-1: special token or a token
of no candidate word):
  * attention from token s TO word w:     to[s, w] = Σ_{t < n, word_id[t] = w} A[s, t]
  * attention FROM word i TO word j:      words[b, h, i, j] = mean over the pieces p < n of i of to[p, j]
    (exactly Clark's "sum over the pieces of the attended word, mean over the pieces of the attending
    word"); a word with no valid piece has a row of zeros and is no candidate.
  * per query row s: row_word[b, h, s] = the word w ≠ word_id[s] (with at least one valid piece) of the
    largest to[s, w], lowest w on ties, -1 when there is none (padding rows s ≥ n included);
    row_weight[b, h, s] = to[s, row_word] (0 when none).
The word-to-word matrix is B×H×W×W with W the number of words (W ≤ L): what the probes' word-level arg-max
needs (mean over pieces comes before the arg-max); no L×L map is written. Inputs q, k are fp32, fp16 or
bf16 (computed in fp32); every output is fp32 (row_word int64).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .errors import AttnkitError, arg
from .ops import BACKENDS, extension_loaded, has_kernel

OP = "attnkit::word_attention"


class WordAttention(NamedTuple):
    words: torch.Tensor       # fp32 B×H×W×W, attention from word i (rows) to word j (columns)
    row_word: torch.Tensor    # int64 B×H×L, most-attended other word of each token row (-1: none)
    row_weight: torch.Tensor  # fp32 B×H×L, its weight


def op_available(device_type: str) -> bool:
    """True when the compiled extension has a word_attention kernel for this device type."""
    try:
        return has_kernel(device_type, OP)
    except RuntimeError:  # an older extension: the operator is not even defined
        return False


def reference_word_attention(q, k, lengths, word_id, num_words: int, scaling: float) -> WordAttention:
    """The executable specification of the op (materialises B×H×L×L weights: small inputs only)."""
    B, H, L, _ = q.shape
    W = int(num_words)
    dev = q.device
    lengths = lengths.to(device=dev, dtype=torch.int64)
    valid = torch.arange(L, device=dev)[None, :] < lengths[:, None]  # B×L
    wid = torch.where(valid, word_id.to(device=dev, dtype=torch.int64), torch.full_like(word_id, -1, dtype=torch.int64))
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    A = torch.softmax(scores, dim=-1)  # B×H×L×L
    onehot = torch.zeros(B, L, W + 1, device=dev)
    onehot.scatter_(2, (wid + 1).clamp(min=0)[..., None], 1.0)
    onehot = onehot[..., 1:]  # B×L×W, 0 rows for word -1
    to = torch.matmul(A, onehot[:, None])  # B×H×L×W
    count = onehot.sum(1)  # B×W
    words = torch.matmul(onehot.transpose(1, 2)[:, None], to) / count.clamp(min=1)[:, None, :, None]
    cand = (count > 0)[:, None, None, :] & (torch.arange(W, device=dev)[None, None, None, :] != wid[:, None, :, None])
    masked = torch.where(cand, to, torch.full_like(to, -1.0))
    if W > 0:
        best_v, best = masked.max(-1)  # first maximum: the lowest index on ties
        none = (best_v < 0) | ~valid[:, None, :]
        row_word = torch.where(none, torch.full_like(best, -1), best)
        row_weight = torch.where(none, torch.zeros_like(best_v), best_v)
    else:
        row_word = torch.full((B, H, L), -1, dtype=torch.int64, device=dev)
        row_weight = torch.zeros(B, H, L, device=dev)
    return WordAttention(words, row_word, row_weight)


def _check(q, k, lengths, word_id, num_words) -> None:
    if q.dim() != 4 or k.shape != q.shape:
        raise AttnkitError(f"word_attention: q and k must be B×H×L×D of one shape, got {tuple(q.shape)} and "
                           f"{tuple(k.shape)}")
    B, _, L, _ = q.shape
    if tuple(word_id.shape) != (B, L):
        raise AttnkitError(f"word_attention: word_id must be B×L = {B}×{L}, got {tuple(word_id.shape)}")
    if tuple(lengths.shape) != (B,) or bool(((lengths < 1) | (lengths > L)).any()):
        raise AttnkitError(f"word_attention: lengths must be {B} values in [1, {L}], got {lengths.tolist()}")
    if num_words < 0:
        raise AttnkitError(f"word_attention: num_words must be >= 0, got {num_words}")
    valid = torch.arange(L, device=word_id.device)[None, :] < lengths.to(word_id.device)[:, None]
    used = word_id[valid]
    if used.numel() and (int(used.min()) < -1 or int(used.max()) >= num_words):
        raise AttnkitError(f"word_attention: word ids must lie in [-1, {num_words}), got "
                           f"[{int(used.min())}, {int(used.max())}]")


def word_attention(q, k, lengths, word_id, num_words: int, *, scaling: float | None = None,
                   backend: str = "auto") -> WordAttention:
    """Word-level attention of every head (see the module docstring); `backend` as in `attnkit.ops`."""
    if scaling is None:
        scaling = q.shape[-1] ** -0.5
    dev = q.device
    lengths = lengths.to(device=dev, dtype=torch.int64)
    word_id = word_id.to(device=dev, dtype=torch.int32)
    _check(q, k, lengths, word_id, int(num_words))
    if backend not in BACKENDS:
        raise AttnkitError(f"unknown {arg('backend')} {backend!r}: use 'auto', 'fused' or 'reference'")
    use_op = backend != "reference" and op_available(dev.type)
    if backend == "fused" and not use_op:
        raise AttnkitError(f"backend 'fused' requested but the extension has no {dev.type} word_attention kernel "
                           "(rebuild it: pip install --no-build-isolation -e .)")
    if not use_op:
        return reference_word_attention(q, k, lengths, word_id, int(num_words), float(scaling))
    return WordAttention(*torch.ops.attnkit.word_attention(q, k, lengths, word_id.contiguous(), int(num_words),
                                                           float(scaling)))


def _register_fake() -> None:
    if not extension_loaded() or not hasattr(torch.ops.attnkit, "word_attention"):
        return

    @torch.library.register_fake(OP)
    def _word_attention_fake(q, k, lengths, word_id, num_words, scaling):
        B, H, L, _ = q.shape
        return (q.new_empty((B, H, num_words, num_words), dtype=torch.float32),
                q.new_empty((B, H, L), dtype=torch.int64),
                q.new_empty((B, H, L), dtype=torch.float32))


_register_fake()
