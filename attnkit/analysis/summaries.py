"""Clark et al. (2019) style summaries of a run for the report: per-layer attention to [CLS], [SEP] and
punctuation, entropy against the uniform baseline, heads above the papers' thresholds, and notes where the
run departs from the published findings.

Thresholds (named so the report can quote them):
- PREV_NEXT_MIN: Clark et al. Sec. 3 count heads that put more than half their attention on the previous or
  next token;
- SPECIAL_MIN: heads whose attention to one special class ([CLS], [SEP], punctuation) exceeds this are listed
  as special-token heads (Clark's Fig. 2 shows middle-layer heads above 0.6 on [SEP]);
- BROAD_FRACTION: broad heads have a mean entropy of at least this share of ln n, the entropy of uniform
  attention over n tokens. n is the run's mean tokens per sample (meta.json n_tokens / n_samples); since
  ln is concave this baseline is an upper bound of the mean of ln n_i over samples.
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import AttnkitError

PREV_NEXT_MIN = 0.5
SPECIAL_MIN = 0.6
BROAD_FRACTION = 0.8
SPECIAL_GROUPS = (("[CLS]", ("cls",)), ("[SEP]", ("sep",)), ("punctuation", ("comma", "period")))


def class_mass(features, names) -> np.ndarray:
    """L × H: each head's corpus-mean mass on the token classes `names` (their features summed)."""
    missing = [n for n in names if n not in features.names]
    if missing:
        raise AttnkitError(f"the run's features lack {', '.join(missing)}")
    return sum(features.mean[:, :, features.names.index(n)] for n in names)


def kept_mean(values: np.ndarray, axis=None):
    """Mean over the heads a model has: a head removed by pruning (NaN features, docs/pruning.md) is left out;
    NaN where no head is left (a layer whose heads were all removed)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "Mean of empty slice": a layer with no head left
        return np.nanmean(values, axis=axis)


def uniform_entropy(features) -> tuple[float, float]:
    """(n, ln n): mean tokens per sample of the run and the entropy of uniform attention over them."""
    if features.n_samples <= 0 or features.n_tokens <= 0:
        raise AttnkitError("the run records no samples or tokens (meta.json n_samples, n_tokens)")
    n = features.n_tokens / features.n_samples
    return n, math.log(n)


def layer_summaries(features) -> dict:
    """Per layer (mean over its heads, those removed by pruning left out: NaN for a layer with none): attention to
    [CLS], [SEP], punctuation, entropy, [CLS]-row entropy; also the per-head values (layers × heads lists, NaN for
    a removed head), the uniform baseline and `n_removed`, the heads left out."""
    n, ln_n = uniform_entropy(features)
    out = {"n_mean_tokens": n, "uniform_entropy": ln_n, "per_layer": {}, "per_head": {},
           "n_removed": int(np.isnan(features.mean).all(axis=2).sum())}
    for label, names in SPECIAL_GROUPS + (("entropy", ("entropy",)), ("[CLS] entropy", ("cls_entropy",))):
        v = class_mass(features, names)
        out["per_layer"][label] = [float(x) for x in kept_mean(v, 1)]
        out["per_head"][label] = v.tolist()
    return out


def _heads(values: np.ndarray, cut: float) -> list[dict]:
    L, H = values.shape
    idx = np.argwhere(values > cut)
    rows = [{"layer": int(l), "head": int(h), "value": float(values[l, h])} for l, h in idx]
    return sorted(rows, key=lambda r: -r["value"])


def threshold_heads(features) -> dict:
    """Heads above the papers' thresholds: {"previous token", "next token", "[CLS]", "[SEP]", "punctuation",
    "broad"} → [{"layer", "head", "value"}], largest first."""
    _, ln_n = uniform_entropy(features)
    out = {"previous token": _heads(class_mass(features, ("prev",)), PREV_NEXT_MIN),
           "next token": _heads(class_mass(features, ("next",)), PREV_NEXT_MIN)}
    for label, names in SPECIAL_GROUPS:
        out[label] = _heads(class_mass(features, names), SPECIAL_MIN)
    out["broad"] = _heads(class_mass(features, ("entropy",)), BROAD_FRACTION * ln_n)
    return out


def paper_differences(features) -> list[str]:
    """Short notes where the run departs from Clark et al.'s findings for BERT-base (empty: none found)."""
    L = features.n_layers
    notes = []
    cls, sep = class_mass(features, ("cls",)), class_mass(features, ("sep",))
    punct = class_mass(features, ("comma", "period"))
    mid = slice(L // 3, max(L // 3 + 1, (2 * L) // 3))
    m_cls, m_sep, m_punct = float(kept_mean(cls[mid])), float(kept_mean(sep[mid])), float(kept_mean(punct[mid]))
    where = f"layers {mid.start}–{mid.stop - 1}"
    if max(m_cls, m_sep) < 0.2:
        notes.append(f"No special-token sink: in the middle {where} heads put {m_cls:.2f} on [CLS] and {m_sep:.2f} on "
                     "[SEP] on average (Clark et al.: middle layers attend heavily to [SEP]).")
    elif m_cls > m_sep:
        notes.append(f"The sink is [CLS], not [SEP]: in the middle {where} heads put {m_cls:.2f} on [CLS] and "
                     f"{m_sep:.2f} on [SEP] on average (Clark et al.: middle layers attend to [SEP]).")
    if m_punct > max(m_cls, m_sep):
        notes.append(f"Punctuation draws more attention than [CLS]/[SEP] in the middle {where} ({m_punct:.2f}).")
    th = threshold_heads(features)
    pn = th["previous token"] + th["next token"]
    if not pn:
        notes.append(f"No head puts more than {PREV_NEXT_MIN:.0%} of its attention on the previous or next token "
                     "(Clark et al. find several such heads).")
    elif L >= 3 and np.mean([r["layer"] for r in pn]) >= (L - 1) / 2:
        notes.append("Previous/next-token heads sit mostly in the upper half of the model (Clark et al.: "
                     "especially in earlier layers).")
    ent = class_mass(features, ("entropy",))
    third = max(1, L // 3)
    low, high = float(kept_mean(ent[:third])), float(kept_mean(ent[-third:]))
    if L >= 3 and low < high:
        notes.append(f"Attention is not broadest in the lowest layers: mean entropy {low:.2f} nats in "
                     f"the first {third} layer(s) vs {high:.2f} in the last (Clark et al.: low layers "
                     "attend broadly).")
    _, ln_n = uniform_entropy(features)
    cls_rows = class_mass(features, ("cls_entropy",))
    with_heads = [l for l in range(L) if np.isfinite(cls_rows[l]).any()]  # pruning may have emptied the last
    if with_heads:
        last = with_heads[-1]
        cls_ent = float(kept_mean(cls_rows[last]))
        which = "the last layer" if last == L - 1 else f"layer {last}, the last with heads left,"
        if cls_ent < 0.5 * ln_n:
            notes.append(f"The [CLS] rows of {which} are focused (entropy {cls_ent:.2f} nats, uniform {ln_n:.2f}); "
                         "Clark et al. find them broad.")
    return notes


# what the summaries' labels mean on a decoder run (docs/features.md: `cls` is the first position, `sep` EOS); its
# "[CLS] rows" are row 0, which sees only itself (entropy 0), and are left out
DECODER_LABELS = {"[CLS]": "first token", "[SEP]": "EOS"}


def layer_summary_figure(summary: dict, decoder: bool = False):
    """Clark et al. Fig. 2 analogue: per layer, attention to [CLS], [SEP] and punctuation (lines: layer
    means, dots: heads), and entropy per layer with the uniform ln n baseline. `decoder`: labelled as a decoder
    run's classes (DECODER_LABELS), without the [CLS] rows."""
    from ..plotting import plt

    colors = {"[CLS]": "#d62728", "[SEP]": "#1f77b4", "punctuation": "#2ca02c"}
    shown = DECODER_LABELS if decoder else {}
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for label, c in colors.items():
        per_head = np.asarray(summary["per_head"][label])
        L, H = per_head.shape
        ax.scatter(np.repeat(np.arange(L), H) + np.tile(np.linspace(-0.2, 0.2, H), L), per_head.ravel(), s=8,
                   color=c, alpha=0.4)
        ax.plot(range(L), summary["per_layer"][label], "o-", color=c, label=shown.get(label, label))
    ax.set_xlabel("layer")
    ax.set_ylabel("avg. attention")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xticks(range(0, L, max(1, -(-L // 16))))  # at most 16 labels: 30 layers overlap
    ax.legend(fontsize=8)
    ax.set_title(("Attention to the first token, EOS and punctuation" if decoder else "Attention to special tokens")
                 + " (cf. Clark et al. Fig. 2)", fontsize=9)
    ent = np.asarray(summary["per_head"]["entropy"])
    ax2.scatter(np.repeat(np.arange(L), H) + np.tile(np.linspace(-0.2, 0.2, H), L), ent.ravel(), s=8,
                color="#555", alpha=0.5, label="heads")
    ax2.plot(range(L), summary["per_layer"]["entropy"], "o-", color="#000", label="layer mean")
    if not decoder:
        ax2.plot(range(L), summary["per_layer"]["[CLS] entropy"], "s--", color="#d62728", label="[CLS] rows")
    ax2.axhline(summary["uniform_entropy"], color="#888", ls=":",
                label=f"uniform, ln {summary['n_mean_tokens']:.1f} = {summary['uniform_entropy']:.2f}")
    ax2.set_xlabel("layer")
    ax2.set_ylabel("entropy (nats)")
    ax2.set_xticks(range(0, L, max(1, -(-L // 16))))
    ax2.set_ylim(0, 1.3 * max(summary["uniform_entropy"], float(np.nanmax(ent))))
    ax2.legend(fontsize=7, ncol=2, loc="upper center")
    ax2.set_title("Attention entropy (cf. Clark et al. Fig. 4)", fontsize=9)
    fig.tight_layout()
    return fig


__all__ = ["DECODER_LABELS", "kept_mean", "layer_summaries", "threshold_heads", "paper_differences",
           "layer_summary_figure", "uniform_entropy", "PREV_NEXT_MIN", "SPECIAL_MIN", "BROAD_FRACTION", "class_mass"]
