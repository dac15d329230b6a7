"""Jensen-Shannon distances between every pair of heads (Clark et al. 2019, Sec. 6; docs/analysis.md), collected
while the model runs (the file they are saved in: attnkit/run/distances.py).

    D[i, j] = Σ_samples Σ_{valid query rows s} JS(A_i[s, :], A_j[s, :])

with JS(p, q) = ½ KL(p‖m) + ½ KL(q‖m), m = (p + q)/2, natural logs — the *divergence* (between 0 and
ln 2 per row), not its square root: `scipy.spatial.distance.jensenshannon` returns sqrt(JS), so
JS = jensenshannon(p, q) ** 2. Heads are numbered across layers, head m = layer·n_heads + head.
`D / n_rows` is the mean per token.

The computation is chunked over pairs of head blocks so it never holds more than about
`max_elems` floats: per row, JS = ½(Σ p log p + Σ q log q) − Σ m log m, where Σ p log p is computed
once per head and Σ m log m for each pair in the block. `DistanceCollector` gathers the attention
weights of all layers of one forward through the Runtime's `observers` hook (recomputed from q and k
with `attnkit.reference.attention_weights`) and adds the batch's distances when the last layer has
been seen. It uses the compiled op `torch.ops.attnkit.js_distances` when the extension has a kernel
for the device (and every valid row is kept), the chunked PyTorch computation otherwise.

Smoothing (Clark et al.'s code): with `smoothing` ε > 0 every row is replaced by (1 − ε)·A + ε/n over the
sample's n valid keys before the divergence (Clark: ε = 0.001), which keeps rows that put all their mass on
different keys from saturating at ln 2 alone. Smoothed distances use the chunked PyTorch path (the op computes
the unsmoothed divergence only). Whatever the smoothing, the values are Jensen-Shannon *divergences* (natural
logs), not the metric sqrt(JS).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..attention.kinds import CROSS
from ..corpus.images import is_image_corpus
from ..errors import AttnkitError, arg, check_int
from ..models import attention_modules, layer_kinds, resolve_model
from ..ops import has_kernel
from ..ops import js_distances as js_distances_op
from ..reference import attention_weights, visible_keys
from ..run.distances import HeadDistances
from .extract import extract

JS_OP = "attnkit::js_distances"
CLARK_SMOOTHING = 0.001  # ε in 0.999·A + 0.001/n (Clark et al.'s code)


def smooth_attention(attn: torch.Tensor, lengths: torch.Tensor, smoothing: float,
                     visible: torch.Tensor | None = None) -> torch.Tensor:
    """(1 − ε)·A + ε/n on the n valid keys of each sample (padded keys stay 0); a new fp32 tensor. With
    `visible` (B×1×Lq×L bool, attnkit.reference.visible_keys: a decoder's causal and windowed rows, a cross row's
    source keys), ε is spread over the keys each row sees instead."""
    check_smoothing(smoothing)
    B, M, L = _check_attn(attn, lengths, square=visible is None)  # cross-attention's rows: with `visible`
    lengths = lengths.to(attn.device).long()
    if visible is not None:
        seen = visible.to(attn.device).float()
        return attn.float() * (1.0 - float(smoothing)) + float(smoothing) * seen / seen.sum(-1, keepdim=True).clamp(
            min=1)
    valid = (torch.arange(L, device=attn.device)[None, :] < lengths[:, None]).float()  # B×L
    add = (float(smoothing) / lengths.float())[:, None] * valid  # B×L
    return attn.float() * (1.0 - float(smoothing)) + add[:, None, None, :]


def check_smoothing(smoothing: float) -> float:
    if not 0.0 <= float(smoothing) < 1.0:
        raise AttnkitError(f"{arg('smoothing')} must lie in [0, 1), got {smoothing}")
    return float(smoothing)


def _check_attn(attn: torch.Tensor, lengths: torch.Tensor, square: bool = True) -> tuple[int, int, int]:
    """(B, M, L) of B×M×L×L weights (`square` False: B×M×Lq×Lk, cross-attention's rows over the other sequence's
    keys; L is then Lq and `lengths` the query rows')."""
    if attn.dim() != 4 or (square and attn.shape[2] != attn.shape[3]):
        raise AttnkitError(f"attention must be B×M×L×L, got shape {tuple(attn.shape)}")
    B, M, L, _ = attn.shape
    if lengths.shape != (B,):
        raise AttnkitError(f"lengths must have shape ({B},), got {tuple(lengths.shape)}")
    if B and (int(lengths.min()) < 1 or int(lengths.max()) > L):
        raise AttnkitError(f"lengths must lie in [1, {L}]")
    return B, M, L


def valid_rows(attn: torch.Tensor, lengths: torch.Tensor, rows_per_sample: int | None = None,
               generator: torch.Generator | None = None, *, cross: bool = False) -> torch.Tensor:
    """R × M × Lk fp32: the valid query rows of every sample (optionally a random sample of at most
    `rows_per_sample` rows per sample), heads second."""
    B, M, L = _check_attn(attn, lengths, square=not cross)
    lengths = lengths.to(attn.device).long()
    keep = torch.arange(L, device=attn.device)[None, :] < lengths[:, None]  # B×L
    if rows_per_sample is not None:
        check_int(rows_per_sample, "rows_per_sample")
        noise = torch.rand(B, L, generator=generator).to(attn.device)
        noise = noise.masked_fill(~keep, 2.0)
        rank = noise.argsort(dim=1).argsort(dim=1)
        keep = keep & (rank < rows_per_sample)
    b, s = keep.nonzero(as_tuple=True)
    return attn[b, :, s, :].float()  # R×M×L


def js_from_rows(rows: torch.Tensor, max_elems: int = 1 << 24) -> torch.Tensor:
    """M×M fp64 Σ_rows JS(rows[:, i], rows[:, j]) for R × M × L rows of distributions."""
    if rows.dim() != 3:
        raise AttnkitError(f"rows must be R×M×L, got shape {tuple(rows.shape)}")
    R, M, L = rows.shape
    out = torch.zeros(M, M, dtype=torch.float64, device=rows.device)
    if R == 0 or M == 0:
        return out.cpu()
    rows = rows.float()
    neg_ent = torch.special.xlogy(rows, rows).sum(-1)  # R×M: Σ p log p per row and head
    rsum = rows.sum(-1)  # R×M: 1 for softmax rows, less for rows an intervention emptied
    # block size c: R·c·c·L floats per block
    c = max(1, min(M, int(math.sqrt(max(1, max_elems // max(1, R * L))))))
    r_chunk = R if R * c * c * L <= max_elems else max(1, max_elems // (c * c * L))
    for a0 in range(0, M, c):
        a1 = min(M, a0 + c)
        for b0 in range(a0, M, c):
            b1 = min(M, b0 + c)
            acc = torch.zeros(a1 - a0, b1 - b0, dtype=torch.float64, device=rows.device)
            for r0 in range(0, R, r_chunk):
                r1 = min(R, r0 + r_chunk)
                # Σ m log m with m = (p + q)/2 = ½ Σ s log s − ½ ln2 (Σp + Σq), s = p + q; in place,
                # with log(max(s, tiny)) so that s = 0 gives 0 (cheaper than xlogy on (p+q)/2)
                S = rows[r0:r1, a0:a1, None, :] + rows[r0:r1, None, b0:b1, :]
                slogs = S.clamp_min(1e-30).log_().mul_(S).sum(-1)  # r×a×b
                del S
                mlogm = 0.5 * slogs - (0.5 * math.log(2.0)) * (rsum[r0:r1, a0:a1, None] + rsum[r0:r1, None, b0:b1])
                js = 0.5 * (neg_ent[r0:r1, a0:a1, None] + neg_ent[r0:r1, None, b0:b1]) - mlogm
                acc += js.clamp_(min=0.0).sum(0, dtype=torch.float64)
            out[a0:a1, b0:b1] = acc
            out[b0:b1, a0:a1] = acc.T
    out.fill_diagonal_(0.0)
    return out.cpu()


def js_distances(attn: torch.Tensor, lengths: torch.Tensor, *, rows_per_sample: int | None = None,
                 generator: torch.Generator | None = None, use_op: bool | None = None,
                 max_elems: int = 1 << 24, smoothing: float = 0.0, cross: bool = False) -> tuple[torch.Tensor, int]:
    """(M×M fp64 JS divergence sums, number of rows used) for B×M×L×L weights (padded keys 0) of one batch
    (`cross`: B×M×Lq×Lk weights of cross-attention, `lengths` the query rows'; the PyTorch computation, unsmoothed).

    `use_op`: None picks `torch.ops.attnkit.js_distances` when it has a kernel for the device, no row
    sampling and no smoothing is asked for; False forces the chunked PyTorch computation. `smoothing`: ε of
    Clark et al.'s (1 − ε)·A + ε/n (0: none).
    """
    B, M, L = _check_attn(attn, lengths, square=not cross)
    lengths = lengths.to(attn.device).long()
    if cross and (use_op or smoothing):
        raise AttnkitError("cross-attention's weights (B×M×Lq×Lk) take the PyTorch computation, unsmoothed (the "
                           "collector smooths them over the source's keys before)")
    if use_op is None:
        use_op = not cross and rows_per_sample is None and not smoothing and has_kernel(attn.device.type, JS_OP)
    if smoothing:
        attn = smooth_attention(attn, lengths, smoothing)
    if use_op:
        if rows_per_sample is not None:
            raise AttnkitError(f"the js_distances op uses every valid row; row sampling needs {arg('use_op', False)}")
        if smoothing:
            raise AttnkitError(f"the js_distances op computes unsmoothed divergences; smoothing needs "
                               f"{arg('use_op', False)}")
        return js_distances_op(attn, lengths).double().cpu(), int(lengths.sum())
    rows = valid_rows(attn, lengths, rows_per_sample, generator, cross=cross)
    return js_from_rows(rows, max_elems=max_elems), int(rows.shape[0])


def check_decoder_arguments(decoder: dict, what: str) -> None:
    """Refuse, by name, a decoder argument an observer does not know (it might change the weights)."""
    unknown = sorted(set(decoder) - {"causal", "kv_head", "sliding_window", "softcap", "sink", "symmetric_window",
                                     "key_lengths", "bias"})
    if unknown:
        raise AttnkitError(f"{what}: unknown attention argument {unknown[0]!r}")


class DistanceCollector:
    """Runtime observer that sums JS distances between all heads over every forward it sees.

    A decoder's layers pass the op's decoder arguments (causal, kv_head, sliding_window, softcap: see
    attnkit.attention.call.observed): the weights are then those the decoder really uses (each row over the keys it
    sees, each query head against its KV head's keys, a learned sink (gpt-oss) taking its share of each row as in
    the maps eager attention returns: the row's key weights then sum to 1 − its sink mass), and smoothing spreads
    ε over the keys each row sees.

    An encoder–decoder (`kinds`: the kind of each of attnkit's layers, attnkit.models.layer_kinds) is compared
    within each kind only: encoder heads over the source's rows, decoder and cross-attention heads over the target's
    rows (a cross head's rows are over the source's keys, a decoder head's over the target's: distributions over
    different keys, whose divergence is undefined; an encoder head's rows are other tokens). `by_kind()` gives one
    HeadDistances per kind, its layers numbered within the kind; cross-attention calls arrive with the source's
    `key_lengths`, T5's layers with their position `bias`.

    Pass it to `attnkit.extract(..., observers=[collector])` (or append it to a Runtime's
    `observers`). Per layer it recomputes the softmax weights from q and k (no interventions); when
    all `n_layers` layers of a forward have arrived, it computes the distances of that batch over all
    n_layers·n_heads heads and adds them. `rows_per_sample` samples that many query rows per sample
    (for big corpora); None keeps every valid row.
    """

    def __init__(self, n_layers: int, *, rows_per_sample: int | None = None, seed: int = 0,
                 use_op: bool | None = None, max_elems: int = 1 << 24, smoothing: float = 0.0,
                 kinds: list[str] | None = None):
        self.n_layers = check_int(n_layers, "n_layers")
        if kinds is not None and len(kinds) != self.n_layers:
            raise AttnkitError(f"{arg('kinds')} names {len(kinds)} layers' kinds, not {self.n_layers}")
        self.kinds = None if kinds is None else list(kinds)
        self.two_sequences = kinds is not None  # takes cross-attention and T5's bias (attention/consumers/observers)
        self._by_kind: dict[str, list] = {}  # kind -> [sum, rows]
        self.rows_per_sample = None if rows_per_sample is None else check_int(rows_per_sample, "rows_per_sample")
        self.smoothing = check_smoothing(smoothing)
        self.use_op = use_op
        self.max_elems = max_elems
        self.generator = torch.Generator().manual_seed(seed)
        self.sum: np.ndarray | None = None
        self.n_rows = 0
        self.n_batches = 0
        self.n_heads: int | None = None
        self._pending: dict[int, torch.Tensor] = {}
        self._lengths: dict[int, torch.Tensor] = {}  # per layer: its query rows' lengths
        self._smoothed = False  # this batch's decoder weights were smoothed per layer already

    decoder_arguments = True  # takes a decoder's attention arguments (attnkit.hf_attention: observers)

    def __call__(self, layer, query, key, lengths, scaling, **decoder) -> None:
        if layer in self._pending:
            raise AttnkitError(f"layer {layer} was seen twice before all {self.n_layers} layers arrived")
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        check_decoder_arguments(decoder, "Jensen-Shannon distances")
        with torch.no_grad():
            w = attention_weights(query.detach(), key.detach(), lengths.long(), float(scaling), **decoder)
            # ε over the keys each row sees, layer by layer: layers may differ in their window, and an
            # encoder–decoder's in their keys (cross-attention's: the source's)
            if self.smoothing and (decoder or self.kinds is not None):
                keys = decoder.get("key_lengths", lengths)
                visible = visible_keys(keys.long().to(w.device), w.shape[-1], decoder.get("causal", False),
                                       decoder.get("sliding_window"), w.shape[-2],
                                       symmetric_window=decoder.get("symmetric_window", False))
                w = smooth_attention(w, lengths, self.smoothing, visible)
                self._smoothed = True
        self._pending[int(layer)] = w
        self._lengths[int(layer)] = lengths
        if len(self._pending) == self.n_layers:
            self._flush()

    def _flush(self) -> None:
        layers = sorted(self._pending)
        if layers != list(range(self.n_layers)):
            raise AttnkitError(f"expected layers 0..{self.n_layers - 1}, got {layers}")
        self.n_heads = self._pending[0].shape[1]
        pending, lengths, self._pending, self._lengths = self._pending, self._lengths, {}, {}
        smoothed, self._smoothed = self._smoothed, False
        groups = {None: layers} if self.kinds is None else {k: [i for i in layers if self.kinds[i] == k]
                                                            for k in dict.fromkeys(self.kinds)}
        for kind, group in groups.items():
            attn = torch.cat([pending[i] for i in group], dim=1)  # B×(layers·heads)×Lq×Lk
            cross = kind == CROSS
            d, n = js_distances(attn, lengths[group[0]], rows_per_sample=self.rows_per_sample,
                                generator=self.generator, use_op=False if smoothed or cross else self.use_op,
                                max_elems=self.max_elems, smoothing=0.0 if smoothed else self.smoothing, cross=cross)
            d = d.numpy()
            if kind is None:
                self.sum = d if self.sum is None else self.sum + d
                self.n_rows += n
            else:
                acc = self._by_kind.setdefault(kind, [0.0, 0])
                acc[0], acc[1] = acc[0] + d, acc[1] + n
        self.n_batches += 1

    def _check_complete(self) -> None:
        if self._pending:
            raise AttnkitError(f"a forward stopped after layers {sorted(self._pending)} of {self.n_layers}")
        if self.n_batches == 0:
            raise AttnkitError("no forward was observed: no distances to report")

    def by_kind(self) -> dict[str, HeadDistances]:
        """An encoder–decoder's distances: per kind ("encoder", "decoder", "cross"), a HeadDistances between the
        heads of that kind's layers (numbered within the kind), its rows those of the sequence its queries read."""
        if self.kinds is None:
            raise AttnkitError("distances by kind are an encoder–decoder's: this collector was given no kinds")
        self._check_complete()
        meta = {"rows_per_sample": self.rows_per_sample, "n_batches": self.n_batches, "smoothing": self.smoothing}
        return {kind: HeadDistances(total, rows, self.kinds.count(kind), int(self.n_heads), {**meta, "kind": kind})
                for kind, (total, rows) in self._by_kind.items()}

    def result(self) -> HeadDistances:
        if self.kinds is not None:
            raise AttnkitError("an encoder–decoder's heads are compared within each kind (a cross head's rows are "
                               "over other keys than a decoder head's, an encoder head's are other tokens): use "
                               "by_kind()")
        self._check_complete()
        return HeadDistances(self.sum, self.n_rows, self.n_layers, int(self.n_heads),
                             {"rows_per_sample": self.rows_per_sample, "n_batches": self.n_batches,
                              "smoothing": self.smoothing})


def collect_distances(texts, model=None, *, rows_per_sample: int | None = None, seed: int = 0,
                      use_op: bool | None = None, smoothing: float = 0.0, **extract_kwargs):
    """Extract features and JS divergences in one pass over `texts` (or an image Corpus, `open_images`): returns
    (HeadFeatures, HeadDistances); for an encoder–decoder's pairs (HeadFeatures, {kind: HeadDistances}), its heads
    compared within each kind (DistanceCollector.by_kind).
    `smoothing`: ε of Clark et al.'s (1 − ε)·A + ε/n before the divergence (CLARK_SMOOTHING = 0.001)."""
    model, tokenizer = resolve_model(model, extract_kwargs.pop("tokenizer", None), extract_kwargs.pop("device", None),
                                     extract_kwargs.pop("dtype", None))
    kinds = [kind for kind, _ in layer_kinds(model)] if getattr(model.config, "is_encoder_decoder", False) else None
    collector = DistanceCollector(len(attention_modules(model)), rows_per_sample=rows_per_sample, seed=seed,
                                  use_op=use_op, smoothing=smoothing, kinds=kinds)
    extract_kwargs.setdefault("label", "distances")
    if is_image_corpus(texts):  # an image run's images (attnkit.corpus.images.images_of_run)
        extract_kwargs["images"], texts = texts, None
    feats = extract(texts, (model, tokenizer), observers=[collector], **extract_kwargs)
    return feats, collector.result() if kinds is None else collector.by_kind()


__all__ = ["CLARK_SMOOTHING", "DistanceCollector", "check_decoder_arguments", "check_smoothing", "collect_distances",
           "js_distances", "js_from_rows", "smooth_attention", "valid_rows"]
