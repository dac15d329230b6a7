"""Comparing the attention of two models head by head (Kovaleva et al. 2019, Sec. 4.3 and Fig. 5; defined in
docs/compare.md).

For each layer ℓ and head h, over the same tokenised corpus, with A and B the two models' softmax weights:

    row cosine  = mean over valid query rows s of  cos(A[s, :], B[s, :])
    map cosine  = mean over samples of  Σ A·B / sqrt(Σ A² · Σ B²)   (the whole n × n map flattened, as
                  Kovaleva et al. compare "flattened arrays of attention weights")

Both come from per-(sample, head) sums that `similarity_sums` computes from each layer's q and k, one block
of query rows at a time (one row block × L per head, never an L × L map of the whole batch): Σ_s cos, Σ A·B,
Σ A², Σ B². Models A and B run one after the other on the same batch; `PairedCollector` keeps model A's q
and k per layer (the Runtime observer hook) until model B's forward reaches that layer. Each head's feature
shift is B's corpus-mean features minus A's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..arch.pruning import pruned_head_grid
from ..corpus import Corpus
from ..engine.distances import check_decoder_arguments
from ..engine.forward import default_batch_size, forward_features, measuring
from ..engine.plan import DEFAULT_WINDOW, plan_batches
from ..errors import AttnkitError
from ..features import DEFAULT_MAX_LENGTH, DEFAULT_NUM_WINDOWS, check_num_windows
from ..models import (
    attention_modules,
    check_max_length,
    check_model_max_length,
    given_by_path,
    model_feature_names,
    observing,
    resolve_model,
)
from ..run.files import COMPARE_JSON, COMPARE_NPZ, FIGURES_DIR, compare_models_outputs
from ..run.head_features import FeatureAccumulator
from ..run.outputs import atomic_write, ensure_writable_dir, json_float, write_json
from ..tokens import Batch, Encoder

SUM_NAMES = ("row_cos", "ab", "aa", "bb")


def grouped_scores(q_blk: torch.Tensor, k: torch.Tensor, kv_head: torch.Tensor | None = None) -> torch.Tensor:
    """B × H × r × L fp32 q·kᵀ of each query head against its KV head's keys (k: B × Hkv × L × D). Even groups
    (query head h reads KV head h // (H / Hkv)) broadcast over the group without copying K; only an explicit,
    uneven `kv_head` (a pruned layer) gathers K per query head."""
    B, H, r, D = q_blk.shape
    Hkv = k.shape[1]
    q_blk, k = q_blk.float(), k.float()
    if kv_head is not None:
        idx = kv_head.to(k.device, torch.long)
        if not torch.equal(idx, torch.arange(H, device=k.device) // max(1, H // Hkv)) or H % Hkv:
            return torch.matmul(q_blk, k.index_select(1, idx).transpose(-1, -2))
    if Hkv == H:
        return torch.matmul(q_blk, k.transpose(-1, -2))
    g = H // Hkv
    return torch.matmul(q_blk.reshape(B, Hkv, g, r, D), k[:, :, None].transpose(-1, -2)).view(B, H, r, -1)


def _weights_block(q_blk, k, lengths, scaling, s0: int = 0, *, kv_head=None, causal: bool = False,
                   sliding_window: int | None = None, softcap: float | None = None, sink=None,
                   symmetric_window: bool = False):
    """Softmax weights of query rows s0 … s0 + r − 1 (q_blk: B × H × r × D) over the keys each row sees: the valid
    keys, with `causal` those t ≤ s, with a window W those s − t < W (and t − s < W with `symmetric_window`);
    scores soft-capped first; a learned sink logit per head (`sink`, H) joins the denominator and takes its share
    (the keys' weights then sum to 1 − the sink's mass, as in eager's maps) (docs/features.md, "Causal
    attention"). A row that sees no key (a padded row outside a window) gives NaN without a sink: callers drop it."""
    scores = grouped_scores(q_blk, k, kv_head) * float(scaling)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    L = k.shape[2]
    visible = (torch.arange(L, device=k.device)[None, :] < lengths[:, None])[:, None, None, :]  # B×1×1×L
    if causal or sliding_window is not None:
        offset = (torch.arange(s0, s0 + q_blk.shape[2], device=k.device)[:, None]
                  - torch.arange(L, device=k.device)[None, :])  # r×L: s − t
        if causal:
            visible = visible & (offset >= 0)
        if sliding_window is not None:
            visible = visible & (offset < sliding_window)
            if symmetric_window:
                visible = visible & (offset > -sliding_window)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sink is None:
        return torch.softmax(scores, dim=-1)
    logit = sink.to(scores.device, torch.float32).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    return torch.softmax(torch.cat([scores, logit], dim=-1), dim=-1)[..., :L]


def similarity_sums(q_a, k_a, q_b, k_b, lengths, scaling_a: float, scaling_b: float, *,
                    max_elems: int = 1 << 22, decoder_a: dict | None = None,
                    decoder_b: dict | None = None) -> dict[str, torch.Tensor]:
    """Per (sample, head) sums over the valid query rows s < n_b of one layer of two models:
    "row_cos" Σ_s cos(A[s,:], B[s,:]), "ab" Σ_s Σ_t A·B, "aa" Σ A², "bb" Σ B² (each B × H, float64, CPU).

    q_*, k_*: B × H × L × D (D may differ between the models); lengths: B valid tokens per sample. Rows are
    processed in blocks so at most about `max_elems` weights per model exist at once (the pure-PyTorch
    reference of this computation). `decoder_a`, `decoder_b`: a decoder layer's arguments (causal, kv_head,
    sliding_window, softcap; k then has its Hkv KV heads), as attnkit.attention.call.observed gives them."""
    decoder_a, decoder_b = decoder_a or {}, decoder_b or {}
    for name, t in (("q_a", q_a), ("k_a", k_a), ("q_b", q_b), ("k_b", k_b)):
        if t.dim() != 4:
            raise AttnkitError(f"{name} must be B×H×L×D, got shape {tuple(t.shape)}")

    def kv_fits(q, k, dec):
        return (k.shape[0], k.shape[2]) == (q.shape[0], q.shape[2]) and (
            k.shape[1] == q.shape[1] or "kv_head" in dec or (k.shape[1] and q.shape[1] % k.shape[1] == 0))

    if q_a.shape[:3] != q_b.shape[:3] or not kv_fits(q_a, k_a, decoder_a) or not kv_fits(q_b, k_b, decoder_b):
        raise AttnkitError(f"the two models' q/k disagree in batch, heads or length: {tuple(q_a.shape)}, "
                           f"{tuple(k_a.shape)}, {tuple(q_b.shape)}, {tuple(k_b.shape)}")
    B, H, L, _ = q_a.shape
    lengths = torch.as_tensor(lengths, device=q_a.device).long()
    if lengths.shape != (B,) or (B and (int(lengths.min()) < 1 or int(lengths.max()) > L)):
        raise AttnkitError(f"lengths must be {B} values in [1, {L}]")
    q_b, k_b = q_b.to(q_a.device), k_b.to(q_a.device)
    out = {n: torch.zeros(B, H, dtype=torch.float64, device=q_a.device) for n in SUM_NAMES}
    rows = max(1, min(L, max_elems // max(1, B * H * L)))
    for s0 in range(0, L, rows):
        s1 = min(L, s0 + rows)
        a = _weights_block(q_a[:, :, s0:s1], k_a, lengths, scaling_a, s0, **decoder_a)  # B×H×r×L
        b = _weights_block(q_b[:, :, s0:s1], k_b, lengths, scaling_b, s0, **decoder_b)
        valid_row = (torch.arange(s0, s1, device=q_a.device)[None, :] < lengths[:, None])[:, None, :]  # B×1×r
        ab, aa, bb = (a * b).sum(-1), (a * a).sum(-1), (b * b).sum(-1)  # B×H×r
        cos = ab / torch.sqrt(aa * bb).clamp_min(1e-30)
        for name, v in (("row_cos", cos), ("ab", ab), ("aa", aa), ("bb", bb)):
            out[name] += torch.where(valid_row, v, torch.zeros_like(v)).sum(-1, dtype=torch.float64)
    return {n: v.cpu() for n, v in out.items()}


class PairedCollector:
    """Runtime observers for two models run one after the other on the same batch.

    Attach `observe_a` to model A's runtime and `observe_b` to model B's; per batch, call model A's forward,
    then model B's. A's q and k are kept per layer until B reaches the same layer (memory: one batch's q and
    k of every layer of model A). Sums accumulate per layer × head (float64)."""

    def __init__(self, n_layers: int, n_heads: int, *, max_elems: int = 1 << 22):
        self.n_layers, self.n_heads, self.max_elems = int(n_layers), int(n_heads), max_elems
        self.row_cos = np.zeros((n_layers, n_heads))
        self.map_cos = np.zeros((n_layers, n_heads))
        self.n_rows = 0
        self.n_samples = 0
        self._a: dict = {}
        self._done_b: set = set()

    def observe_a(self, layer, query, key, lengths, scaling, **decoder) -> None:
        check_decoder_arguments(decoder, "attention similarities")
        self._a[int(layer)] = (query.detach(), key.detach(), lengths.detach().long(),
                               query.shape[-1] ** -0.5 if scaling is None else float(scaling), decoder)

    observe_a.decoder_arguments = True  # takes a decoder's attention arguments (attnkit.hf_attention: observers)

    def observe_b(self, layer, query, key, lengths, scaling, **decoder) -> None:
        layer = int(layer)
        check_decoder_arguments(decoder, "attention similarities")
        if layer not in self._a:
            raise AttnkitError(f"model B reached layer {layer} before model A did on this batch")
        qa, ka, la, sa, dec_a = self._a.pop(layer)
        if bool(dec_a.get("causal")) != bool(decoder.get("causal")):
            raise AttnkitError("one model's attention is causal and the other's is not: compare two encoders or two "
                               "decoders")
        if not torch.equal(la.cpu(), lengths.long().cpu()):
            raise AttnkitError("the two models saw different token counts for the same batch")
        sb = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
        with torch.no_grad():
            s = similarity_sums(qa, ka, query.detach(), key.detach(), la, sa, sb, max_elems=self.max_elems,
                                decoder_a=dec_a, decoder_b=decoder)
        self.row_cos[layer] += s["row_cos"].sum(0).numpy()
        self.map_cos[layer] += (s["ab"] / torch.sqrt(s["aa"] * s["bb"]).clamp_min(1e-300)).sum(0).numpy()
        self._done_b.add(layer)
        if len(self._done_b) == self.n_layers:
            self.n_rows += int(la.sum())
            self.n_samples += int(la.shape[0])
            self._done_b = set()

    observe_b.decoder_arguments = True

    def check_complete(self) -> None:
        if self._a or self._done_b:
            raise AttnkitError(f"a batch stopped part way: layers {sorted(self._a)} of model A were never "
                               f"compared with model B")


@dataclass
class ModelComparison:
    """Per-head similarity of two models' attention over one corpus, and each head's feature shift."""

    row_cosine: np.ndarray  # layers × heads: mean over query rows of cos(A[s,:], B[s,:])
    map_cosine: np.ndarray  # layers × heads: mean over samples of the flattened-map cosine
    features_a: object  # HeadFeatures of model A
    features_b: object
    n_rows: int
    n_samples: int
    meta: dict = field(default_factory=dict)

    @property
    def shift(self) -> np.ndarray:
        """layers × heads × F: model B's mean features minus model A's."""
        return self.features_b.mean - self.features_a.mean

    @property
    def removed(self) -> np.ndarray:
        """layers × heads booleans: heads removed by pruning from A or B (`meta["removed_heads"]`); their cosines
        and feature shifts are NaN (null in compare_models.json)."""
        out = np.zeros(self.row_cosine.shape, dtype=bool)
        for l, h in self.meta.get("removed_heads") or []:
            out[l, h] = True
        return out

    def to_dict(self, top: int = 10) -> dict:
        names = list(self.features_a.names)
        L, H = self.row_cosine.shape
        kept = ~self.removed
        order = [i for i in np.argsort(np.where(kept, self.row_cosine, np.inf), axis=None)
                 if kept.flat[i]][:top]
        shift = self.shift

        def grid(a):
            return [[json_float(round(float(x), 6)) for x in row] for row in a]

        def layer_means(a):
            return [json_float(a[l][kept[l]].mean()) if kept[l].any() else None for l in range(L)]

        return {
            "version": 1, **self.meta, "n_samples": int(self.n_samples), "n_rows": int(self.n_rows),
            "n_layers": int(L), "n_heads": int(H),
            "row_cosine": grid(self.row_cosine),
            "map_cosine": grid(self.map_cosine),
            "per_layer": {"row_cosine": layer_means(self.row_cosine),
                          "map_cosine": layer_means(self.map_cosine)},
            "most_changed": [{"layer": int(i // H), "head": int(i % H),
                              "row_cosine": float(self.row_cosine.flat[i]),
                              "shift": {n: round(float(shift[i // H, i % H, j]), 6) for j, n in enumerate(names)
                                        if n in ("cls", "sep", "prev", "next", "self", "entropy", "intra")}}
                             for i in order],
            "feature_shift": {n: grid(shift[..., j]) for j, n in enumerate(names)},
        }

    @staticmethod
    def outputs(directory, *, svg: bool = True) -> list[Path]:
        """The files `save` writes into `directory`."""
        return compare_models_outputs(directory, svg=svg)

    def save(self, directory, *, svg: bool = True) -> Path:
        """Write COMPARE_JSON, COMPARE_NPZ and figures/compare_models.png (and .svg) into `directory`."""
        from ..plotting import save_figure

        directory = ensure_writable_dir(directory, "output directory")
        write_json(directory / COMPARE_JSON, self.to_dict())
        atomic_write(directory / COMPARE_NPZ, lambda f: np.savez(
            f, row_cosine=self.row_cosine, map_cosine=self.map_cosine, mean_a=self.features_a.mean,
            mean_b=self.features_b.mean, shift=self.shift, names=np.array(self.features_a.names),
            n_rows=np.int64(self.n_rows), n_samples=np.int64(self.n_samples)))
        save_figure(cosine_heatmaps(map_cosine=self.map_cosine, row_cosine=self.row_cosine, meta=self.meta),
                    directory / FIGURES_DIR, "compare_models", svg=svg)
        return directory / COMPARE_JSON


def _short(name) -> str:
    """The last two components of a model path (enough to tell models apart in a title)."""
    parts = Path(str(name)).parts
    return "/".join(parts[-2:]) if len(parts) > 1 else str(name)


MAP_COSINE_TITLE = "flattened-map cosine (Kovaleva et al. 2019, Fig. 5)\nmean over samples"
ROW_COSINE_TITLE = "row cosine\nmean over query rows"


def cosine_heatmaps(*, map_cosine: np.ndarray, row_cosine: np.ndarray, meta: dict | None = None):
    """Two layer × head heatmaps side by side, each titled with what it shows: left the flattened-map cosine
    (the measure of Kovaleva et al.'s Fig. 5), right the row cosine. One colour scale for both, fitted to their
    values (a layer at 0.92–0.99 would look like identical layers on a fixed 0–1 scale); the cells print as many
    decimals as tell their values apart, and the title states the scale."""
    from ..plotting import fitted_scale, head_grid, plt

    L, H = map_cosine.shape
    lo, hi, digits = fitted_scale(np.concatenate([np.ravel(map_cosine), np.ravel(row_cosine)]))
    width = max(4.0, (0.45 + 0.06 * (digits - 2)) * H + 2)
    fig, axes = plt.subplots(1, 2, figsize=(2 * width, max(2.8, 0.4 * L + 1.6)))
    for ax, grid, title in ((axes[0], map_cosine, MAP_COSINE_TITLE), (axes[1], row_cosine, ROW_COSINE_TITLE)):
        head_grid(ax, grid, labels=[[f"{v:.{digits}f}" for v in row] for row in grid], vmin=lo, vmax=hi,
                  fontsize=6, dark_below=lo + 0.45 * (hi - lo), colorbar={"fraction": 0.046, "pad": 0.04})
        ax.set_title(title, fontsize=9)
    meta = meta or {}
    fig.suptitle(f"attention of {_short(meta.get('model_b', 'B'))} vs {_short(meta.get('model_a', 'A'))}, "
                 f"per head (1 = identical; colour scale {lo:.{digits}f}–{hi:.{digits}f}, fitted to the values)",
                 fontsize=10)
    fig.tight_layout()
    return fig


def _check_pair(model_a, tok_a, model_b, tok_b):
    if model_a is model_b:
        raise AttnkitError("model A and model B are the same object: load or copy the second model")
    la, lb = len(attention_modules(model_a)), len(attention_modules(model_b))
    ha, hb = model_a.config.num_attention_heads, model_b.config.num_attention_heads
    if (la, ha) != (lb, hb):
        raise AttnkitError(f"the models differ in shape: {la} × {ha} heads vs {lb} × {hb}; heads can only be "
                           f"compared between models of the same architecture")
    if tok_a.get_vocab() != tok_b.get_vocab():
        raise AttnkitError("the two models' tokenizers have different vocabularies: they would not see the same "
                           "tokens")
    return la, ha


def compare_models(texts, model_a, model_b, *, tokenizer_a=None, tokenizer_b=None, max_length: int = DEFAULT_MAX_LENGTH,
                   batch_size: int | None = None, num_windows: int = DEFAULT_NUM_WINDOWS, split_sentences: bool = False,
                   backend: str = "auto", device=None, window: int = DEFAULT_WINDOW, max_elems: int = 1 << 22,
                   progress: bool = False) -> ModelComparison:
    """Compare `model_a` and `model_b` (None/path/(model, tokenizer) as in `attnkit.extract`) on `texts`
    (an iterable of str or (str, str)), tokenised once with model A's tokenizer."""
    check_num_windows(num_windows)
    if isinstance(texts, Corpus):
        texts.check_has_text()  # an empty corpus is named before two models load
    for m in (model_a, model_b):  # both models' positions from their config.json before either loads
        if given_by_path(m):
            check_model_max_length(m, max_length)
    model_a, tok_a = resolve_model(model_a, tokenizer_a, device)
    model_b, tok_b = resolve_model(model_b, tokenizer_b, device)
    L, H = _check_pair(model_a, tok_a, model_b, tok_b)
    for m in (model_a, model_b):
        check_max_length(m, max_length)
    dev_a, dev_b = next(model_a.parameters()).device, next(model_b.parameters()).device
    batch_size = batch_size or default_batch_size(dev_a)
    names = model_feature_names(model_a, num_windows)
    acc_a, acc_b = FeatureAccumulator(L, H, names), FeatureAccumulator(L, H, names)
    coll = PairedCollector(L, H, max_elems=max_elems)
    encoder = Encoder(tok_a, max_length=max_length, split_sentences=split_sentences)
    bar = None
    if progress:
        from ..engine.progress import segment_bar

        bar = segment_bar("compare-models", texts)
    try:
        with measuring(model_a, backend=backend, num_windows=num_windows) as rt_a, \
                measuring(model_b, backend=backend, num_windows=num_windows) as rt_b, \
                observing(rt_a, [coll.observe_a]), observing(rt_b, [coll.observe_b]):
            for pb in plan_batches(texts, batch_size, window):
                batch = Batch.from_arrays(encoder.encode_arrays(pb.segments))
                fa = forward_features(model_a, batch.to(dev_a), rt_a)
                fb = forward_features(model_b, batch.to(dev_b), rt_b)
                coll.check_complete()
                acc_a.update(fa.numpy(), batch.n_tokens)
                acc_b.update(fb.numpy(), batch.n_tokens)
                if bar is not None:
                    bar.update(len(pb.segments))
        if bar is not None:
            bar.finish()
    finally:
        if bar is not None:
            bar.close()  # an interrupted comparison leaves no bar half drawn
    if coll.n_samples == 0:
        raise AttnkitError("no texts to compare")
    meta = {"model_a": getattr(model_a.config, "_name_or_path", "") or "A",
            "model_b": getattr(model_b.config, "_name_or_path", "") or "B", "max_length": max_length,
            "num_windows": num_windows}
    fa_, fb_ = acc_a.result(meta), acc_b.result(meta)
    # a head removed by pruning from either model has no attention to compare (its q, k read as 0)
    removed = ~(pruned_head_grid(model_a) & pruned_head_grid(model_b))
    row_cos, map_cos = coll.row_cos / coll.n_rows, coll.map_cos / coll.n_samples
    if removed.any():
        meta["removed_heads"] = [[int(l), int(h)] for l, h in np.argwhere(removed)]
        row_cos, map_cos = np.where(removed, np.nan, row_cos), np.where(removed, np.nan, map_cos)
    return ModelComparison(row_cos, map_cos, fa_, fb_, coll.n_rows, coll.n_samples, meta)


__all__ = ["similarity_sums", "PairedCollector", "ModelComparison", "compare_models", "cosine_heatmaps",
           "COMPARE_JSON", "COMPARE_NPZ"]
