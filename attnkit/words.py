"""Word-level attention (Clark et al. 2019, Sec. 4.2): the `attnkit::word_attention` op, its reference twin
and the wrapper that picks between them; and its token-level generalisation, the per-row statistics of the
`attnkit::row_stats` op (`row_stats`, defined below and in docs/analysis.md, "Per-row statistics").

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
from .reference import attention_scores, resolve_kv_head

OP = "attnkit::word_attention"
ROW_OP = "attnkit::row_stats"
ROW_BLOCK = 128  # query rows per block where row_stats runs on the reference (memory B×H×ROW_BLOCK×L)


class WordAttention(NamedTuple):
    words: torch.Tensor       # fp32 B×H×W×W, attention from word i (rows) to word j (columns)
    row_word: torch.Tensor    # int64 B×H×L, most-attended other word of each token row (-1: none)
    row_weight: torch.Tensor  # fp32 B×H×L, its weight


class RowStats(NamedTuple):
    target_mass: torch.Tensor    # fp32 B×H×L, the weight of each row on its target key
    argmax_key: torch.Tensor     # int64 B×H×L, the key of the row's largest weight (-1: padding row)
    argmax_weight: torch.Tensor  # fp32 B×H×L, that weight


def op_available(device_type: str, op: str = OP) -> bool:
    """True when the compiled extension has a kernel of `op` (default: word_attention) for this device type."""
    try:
        return has_kernel(device_type, op)
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


# --- per-row statistics ---------------------------------------------------------------------------------------
def check_kv_head(H: int, Hkv: int, kv_head=None, device=None) -> torch.Tensor:
    """int64 (H,): the KV head of each query head (attnkit.reference.resolve_kv_head), after checking that
    `kv_head` names one in [0, Hkv) per query head, or, without it, that the KV heads divide the query heads."""
    if kv_head is not None:
        kv_head = torch.as_tensor(kv_head, device=device).reshape(-1)
        if kv_head.numel() != H or (H and (int(kv_head.min()) < 0 or int(kv_head.max()) >= Hkv)):
            raise AttnkitError(f"kv_head must give each of the {H} query heads a KV head in [0, {Hkv}), got "
                               f"{kv_head.tolist()}")
    elif Hkv == 0 or H % Hkv:
        raise AttnkitError(f"{H} query heads and {Hkv} KV heads: without kv_head the KV heads must divide the "
                           "query heads evenly")
    return resolve_kv_head(H, Hkv, kv_head, device)


def reference_row_stats(q, k, lengths, target, scaling: float, kv_head=None, causal: bool = False,
                        sliding_window: int | None = None, softcap: float | None = None, sink=None,
                        block: int | None = None) -> RowStats:
    """The executable specification of `attnkit::row_stats` (docs/analysis.md, "Per-row statistics"). The
    weights are computed `block` query rows at a time (None: all rows at once, B×H×L×L)."""
    B, H, L, _ = q.shape
    dev = q.device
    kvh = None if kv_head is None else torch.as_tensor(kv_head, device=dev)
    lengths = lengths.to(device=dev, dtype=torch.int64)
    target = target.to(device=dev, dtype=torch.int64)
    t = torch.arange(L, device=dev)
    mass = torch.zeros(B, H, L, device=dev)
    key = torch.full((B, H, L), -1, dtype=torch.int64, device=dev)
    weight = torch.zeros(B, H, L, device=dev)
    step = L if block is None else max(1, int(block))
    for s0 in range(0, L, step):
        s = t[s0:s0 + step]
        x = attention_scores(q[:, :, s0:s0 + step], k, scaling, kv_head=kvh, softcap=softcap)  # B×H×rows×L
        sees = (t[None, None, :] < lengths[:, None, None]) & (s[None, :, None] < lengths[:, None, None])  # B×rows×L
        if causal:
            sees = sees & (t[None, None, :] <= s[None, :, None])
        if sliding_window is not None:
            sees = sees & (s[None, :, None] - t[None, None, :] < sliding_window)
        x = x.masked_fill(~sees[:, None], float("-inf"))
        lse = torch.logsumexp(x, dim=-1)
        if sink is not None:
            lse = torch.logaddexp(lse, sink.float().to(dev)[None, :, None].expand_as(lse))
        valid = sees.any(-1)[:, None].expand(B, H, -1)  # a row that sees a key (every valid row does)
        A = torch.exp(x - torch.where(valid, lse, torch.zeros_like(lse))[..., None])
        want = target[:, None, s0:s0 + step, None].expand(B, H, -1, 1)
        got = torch.gather(A, 3, want.clamp(min=0))[..., 0]
        mass[:, :, s0:s0 + step] = torch.where(want[..., 0] >= 0, got, torch.zeros_like(got))
        best_w, best = A.max(-1)  # the first maximum: the lowest key on ties
        key[:, :, s0:s0 + step] = torch.where(valid, best, torch.full_like(best, -1))
        weight[:, :, s0:s0 + step] = torch.where(valid, best_w, torch.zeros_like(best_w))
    return RowStats(mass, key, weight)


def row_stats(q, k, lengths, target=None, *, scaling: float | None = None, kv_head=None, causal: bool = False,
              sliding_window: int | None = None, softcap: float | None = None, sink=None,
              backend: str = "auto") -> RowStats:
    """Per query row of every head: the weight on a given key (`target`, B×L int64, -1 for none; None: no target,
    every mass 0) and the arg-max key with its weight, for q B×H×L×D and k B×Hkv×L×D (docs/features.md,
    "Per-row statistics"). The compiled kernel where the device has one; elsewhere the reference, `ROW_BLOCK`
    rows at a time (never an L×L map)."""
    if q.dim() != 4 or k.dim() != 4 or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]:
        raise AttnkitError(f"row_stats: q must be B×H×L×D and k B×Hkv×L×D with the same B, L and D, got "
                           f"{tuple(q.shape)} and {tuple(k.shape)}")
    B, H, L, D = q.shape
    if scaling is None:
        scaling = D ** -0.5
    dev = q.device
    lengths = lengths.to(device=dev, dtype=torch.int64)
    if tuple(lengths.shape) != (B,) or bool(((lengths < 1) | (lengths > L)).any()):
        raise AttnkitError(f"row_stats: lengths must be {B} values in [1, {L}], got {lengths.tolist()}")
    target = (torch.full((B, L), -1, dtype=torch.int64, device=dev) if target is None
              else torch.as_tensor(target).to(device=dev, dtype=torch.int64))
    if tuple(target.shape) != (B, L) or (target.numel() and (int(target.min()) < -1 or int(target.max()) >= L)):
        raise AttnkitError(f"row_stats: target must be B×L = {B}×{L} key indices in [-1, {L})")
    if sliding_window is not None and sliding_window < 1:
        raise AttnkitError(f"row_stats: sliding_window must be at least 1, got {sliding_window}")
    if softcap is not None and not softcap > 0:
        raise AttnkitError(f"row_stats: softcap must be positive, got {softcap}")
    if sink is not None and tuple(sink.shape) != (H,):
        raise AttnkitError(f"row_stats: sink must hold one logit per query head ({H}), got {tuple(sink.shape)}")
    kvh = check_kv_head(H, k.shape[1], kv_head, dev)
    if backend not in BACKENDS:
        raise AttnkitError(f"unknown {arg('backend')} {backend!r}: use 'auto', 'fused' or 'reference'")
    use_op = backend != "reference" and op_available(dev.type, ROW_OP)
    if backend == "fused" and not use_op:
        raise AttnkitError(f"backend 'fused' requested but the extension has no {dev.type} row_stats kernel "
                           "(rebuild it: pip install --no-build-isolation -e .)")
    if not use_op:
        return reference_row_stats(q, k, lengths, target, float(scaling), kvh, causal, sliding_window, softcap,
                                   sink, block=ROW_BLOCK)
    return RowStats(*torch.ops.attnkit.row_stats(
        q, k, lengths, target.contiguous(), float(scaling), kvh.to(torch.int32), bool(causal),
        None if sliding_window is None else int(sliding_window), None if softcap is None else float(softcap),
        None if sink is None else sink.float()))


def _register_fake() -> None:
    if not extension_loaded() or not hasattr(torch.ops.attnkit, "word_attention"):
        return

    @torch.library.register_fake(OP)
    def _word_attention_fake(q, k, lengths, word_id, num_words, scaling):
        B, H, L, _ = q.shape
        return (q.new_empty((B, H, num_words, num_words), dtype=torch.float32),
                q.new_empty((B, H, L), dtype=torch.int64),
                q.new_empty((B, H, L), dtype=torch.float32))

    if hasattr(torch.ops.attnkit, "row_stats"):
        @torch.library.register_fake(ROW_OP)
        def _row_stats_fake(q, k, lengths, target, scaling, kv_head=None, causal=False, sliding_window=None,
                            softcap=None, sink=None):
            B, H, L, _ = q.shape
            return (q.new_empty((B, H, L), dtype=torch.float32), q.new_empty((B, H, L), dtype=torch.int64),
                    q.new_empty((B, H, L), dtype=torch.float32))


_register_fake()
