"""Task metrics, as the benchmarks define them. All scores are reported ×100 (percent points).

* Correlations (STS-B): Pearson and Spearman from `scipy.stats`.
* GLUE: accuracy; F1 of the positive class (MRPC, QQP); Matthews correlation (CoLA), via `sklearn.metrics`.
* SQuAD: exact match and token F1 after the official normalisation (lower case, strip punctuation,
  drop the articles a/an/the, collapse white space), max over the gold answers; SQuAD 2.0 scores an
  unanswerable question 1 when the prediction is empty and 0 otherwise.
* Uncertainty: a paired percentile bootstrap of metric changes (`bootstrap_delta`): resample the examples
  with replacement (10,000 resamples by default), evaluate the baseline and the setting on the same resample,
  take the 2.5 and 97.5 percentiles of the differences. Each metric has a vectorised form (weighted_*) that
  scores many resamples at once from their counts; `excludes_zero` tells an interval from 0 only beyond the
  Monte-Carlo noise of its ends.
"""
from __future__ import annotations

import collections
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import AttnkitError
from .names import N_BOOT


def _check_pair(a, b, what: str) -> tuple[np.ndarray, np.ndarray]:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise AttnkitError(f"{what}: predictions and gold must be 1-D of equal length, got {a.shape} and {b.shape}")
    if a.size < 2:
        raise AttnkitError(f"{what} needs at least two examples, got {a.size}")
    return a, b


def spearman(pred, gold) -> float:
    """Spearman rank correlation ×100 (ties get average ranks); nan when an input is constant."""
    from scipy.stats import spearmanr

    a, b = _check_pair(pred, gold, "Spearman correlation")
    if np.ptp(a) == 0 or np.ptp(b) == 0:
        return float("nan")
    return float(spearmanr(a, b).statistic) * 100.0


def pearson(pred, gold) -> float:
    """Pearson correlation ×100; nan when an input is constant."""
    from scipy.stats import pearsonr

    a, b = _check_pair(pred, gold, "Pearson correlation")
    if np.ptp(a) == 0 or np.ptp(b) == 0:
        return float("nan")
    return float(pearsonr(a, b).statistic) * 100.0


def accuracy(pred, gold) -> float:
    pred, gold = np.asarray(pred), np.asarray(gold)
    if pred.shape != gold.shape or pred.size == 0:
        raise AttnkitError(f"accuracy: predictions {pred.shape} and gold {gold.shape} differ or are empty")
    return float((pred == gold).mean()) * 100.0


def f1(pred, gold) -> float:
    """F1 of the positive class (label 1) ×100, as GLUE scores MRPC and QQP."""
    from sklearn.metrics import f1_score

    return float(f1_score(np.asarray(gold), np.asarray(pred), pos_label=1, average="binary", zero_division=0)) * 100.0


def matthews(pred, gold) -> float:
    """Matthews correlation coefficient ×100 (CoLA)."""
    from sklearn.metrics import matthews_corrcoef

    return float(matthews_corrcoef(np.asarray(gold), np.asarray(pred))) * 100.0


# --- SQuAD (official evaluation script semantics) -------------------------------------------------------
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """Lower text and remove punctuation, articles and extra white space (SQuAD's evaluate-v2.0.py)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _tokens(s: str) -> list[str]:
    return normalize_answer(s).split() if s else []


def squad_exact(prediction: str, gold: str) -> int:
    return int(normalize_answer(gold) == normalize_answer(prediction))


def squad_f1(prediction: str, gold: str) -> float:
    """Token-overlap F1 after normalisation; when either side is empty: 1 if both are, else 0."""
    gold_toks, pred_toks = _tokens(gold), _tokens(prediction)
    if not gold_toks or not pred_toks:
        return float(gold_toks == pred_toks)
    common = collections.Counter(gold_toks) & collections.Counter(pred_toks)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_toks), same / len(gold_toks)
    return 2 * precision * recall / (precision + recall)


def _squad_questions(predictions: dict[str, str], golds: dict[str, Sequence[str]]):
    if not golds:
        raise AttnkitError("no questions to score")
    em, f1s, has = {}, {}, {}
    for qid, answers in golds.items():
        if qid not in predictions:
            raise AttnkitError(f"no prediction for question {qid!r}")
        answers = [a for a in answers if normalize_answer(a)] or [""]
        pred = predictions[qid]
        em[qid] = max(squad_exact(pred, a) for a in answers)
        f1s[qid] = max(squad_f1(pred, a) for a in answers)
        has[qid] = answers != [""]
    return em, f1s, has


def squad_per_question(predictions: dict[str, str], golds: dict[str, Sequence[str]]):
    """(question ids, exact match 0/1 array, F1 array in [0, 1]) per question, in the order of `golds`."""
    em, f1s, _ = _squad_questions(predictions, golds)
    qids = list(golds)
    return qids, np.array([em[q] for q in qids], dtype=np.float64), np.array([f1s[q] for q in qids])


def squad_scores(predictions: dict[str, str], golds: dict[str, Sequence[str]]) -> dict[str, float]:
    """EM and F1 ×100 over questions (max over gold answers). An empty gold list means "no answer"
    (SQuAD 2.0), whose only correct prediction is the empty string. Adds HasAns_/NoAns_ splits
    when both kinds of questions are present."""
    em, f1s, has = _squad_questions(predictions, golds)
    out = {"exact": 100.0 * np.mean(list(em.values())), "f1": 100.0 * np.mean(list(f1s.values()))}
    kinds = set(has.values())
    if len(kinds) == 2:
        for flag, name in ((True, "HasAns"), (False, "NoAns")):
            ids = [q for q in golds if has[q] == flag]
            out[f"{name}_exact"] = 100.0 * np.mean([em[q] for q in ids])
            out[f"{name}_f1"] = 100.0 * np.mean([f1s[q] for q in ids])
            out[f"{name}_total"] = len(ids)
    out["total"] = len(golds)
    return {k: float(v) for k, v in out.items()}


# --- paired bootstrap of metric changes -----------------------------------------------------------------
# A resample of n examples drawn with replacement is a row of counts (how often each example was drawn). Every
# metric below takes the examples' arrays and a k × n matrix of such counts and returns the metric of each of the
# k resamples at once (a row of ones is the data itself), so 10,000 resamples cost a few array operations instead
# of 10,000 calls of scipy.


def _rows(weights) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    return w[None, :] if w.ndim == 1 else w


def weighted_mean(x, weights) -> np.ndarray:
    """Σ w·x / Σ w for each row of weights (k values)."""
    w = _rows(weights)
    return (w @ np.asarray(x, dtype=np.float64)) / w.sum(1)


def weighted_pearson(x, y, weights) -> np.ndarray:
    """Pearson correlation ×100 of each weighted sample (x, y: n values, or k × n); nan where one side is
    constant."""
    w = _rows(weights)
    total = w.sum(1, keepdims=True)
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    xc = x - (w * x).sum(1, keepdims=True) / total
    yc = y - (w * y).sum(1, keepdims=True) / total
    sxy, sxx, syy = (w * xc * yc).sum(1), (w * xc * xc).sum(1), (w * yc * yc).sum(1)
    # a side constant up to rounding has no correlation (nan), as spearman() and pearson() say
    flat = (sxx <= (1e-12 * np.abs(x).max()) ** 2 * total[:, 0]) | (syy <= (1e-12 * np.abs(y).max()) ** 2 * total[:, 0])
    with np.errstate(invalid="ignore", divide="ignore"):
        r = sxy / np.sqrt(sxx * syy)
    return np.where(flat, np.nan, np.clip(r, -1.0, 1.0) * 100.0)


def weighted_ranks(x, weights) -> np.ndarray:
    """k × n: each example's rank (1-based, ties averaged) within the resample of each row of counts; the
    copies of an example drawn c times, and all examples tied with it, share the average of their positions."""
    w = _rows(weights)
    x = np.asarray(x, dtype=np.float64)
    order = np.argsort(x, kind="stable")
    xs = x[order]
    first = np.r_[True, xs[1:] != xs[:-1]]  # the first position of each group of tied values
    group = np.cumsum(first) - 1
    starts = np.flatnonzero(first)
    ends = np.r_[starts[1:], x.size]
    cum = np.concatenate([np.zeros((w.shape[0], 1)), np.cumsum(w[:, order], axis=1)], axis=1)
    before, total = cum[:, starts], cum[:, ends] - cum[:, starts]
    ranks = np.empty_like(w)
    ranks[:, order] = (before + (total + 1.0) / 2.0)[:, group]
    return ranks


def weighted_spearman(x, y, weights) -> np.ndarray:
    """Spearman correlation ×100 of each resample (ties get average ranks, as scipy's spearmanr)."""
    return weighted_pearson(weighted_ranks(x, weights), weighted_ranks(y, weights), weights)


def weighted_counts(pred, gold, weights, positive=1) -> tuple[np.ndarray, ...]:
    """(tp, fp, fn, tn) of the positive class in each resample."""
    w = _rows(weights)
    p, g = np.asarray(pred) == positive, np.asarray(gold) == positive
    return tuple(w @ (a & b).astype(np.float64) for a, b in ((p, g), (p, ~g), (~p, g), (~p, ~g)))


def weighted_accuracy(pred, gold, weights) -> np.ndarray:
    return 100.0 * weighted_mean(np.asarray(pred) == np.asarray(gold), weights)


def weighted_f1(pred, gold, weights, positive=1) -> np.ndarray:
    """F1 ×100 of the positive class (0 where nothing is predicted or gold positive, as sklearn's
    zero_division=0)."""
    tp, fp, fn, _ = weighted_counts(pred, gold, weights, positive)
    den = 2 * tp + fp + fn
    return np.where(den > 0, 200.0 * tp / np.where(den > 0, den, 1.0), 0.0)


def weighted_matthews(pred, gold, weights) -> np.ndarray:
    """Matthews correlation ×100 of binary labels (0 where a margin is empty, as sklearn)."""
    labels = np.unique(np.concatenate([np.asarray(pred).ravel(), np.asarray(gold).ravel()]))
    if labels.size > 2:
        raise AttnkitError(f"the resampled Matthews correlation takes two labels, got {labels.size}")
    positive = labels[-1] if labels.size else 1
    tp, fp, fn, tn = weighted_counts(pred, gold, weights, positive)
    den = np.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return np.where(den > 0, 100.0 * (tp * tn - fp * fn) / np.where(den > 0, den, 1.0), 0.0)


@dataclass
class ExampleScores:
    """One evaluation's per-example outputs: `arrays` (name → array whose first axis is the n examples, in the same
    order for every setting of an experiment) and `metric(arrays, weights) → k values`, the main metric (×100)
    of the k resamples given as a k × n matrix of counts (the weighted_* functions above); `index` says which
    examples of the data the rows are (their positions in the task's examples). Tasks leave one in
    `task.last_examples`; `attnkit ablate` writes the arrays per setting (docs/files.md). `others`: further metrics
    of the same arrays (name → metric, as `metric`), whose changes get intervals of their own on the same resamples
    (a seq2seq task's decoded `bleu` and `chrf` beside its `loss`)."""

    arrays: dict
    metric: Callable[[dict, np.ndarray], np.ndarray]
    index: np.ndarray | None = None
    others: dict = field(default_factory=dict)

    def of(self, name: str) -> ExampleScores:
        """The same examples scored by the further metric `name`."""
        return ExampleScores(self.arrays, self.others[name], self.index)

    @property
    def n(self) -> int:
        return len(next(iter(self.arrays.values())))

    def value(self) -> float:
        """The metric on the examples themselves."""
        return float(self.resampled(np.ones((1, self.n)))[0])

    def resampled(self, counts: np.ndarray) -> np.ndarray:
        return np.asarray(self.metric(self.arrays, counts), dtype=np.float64).reshape(len(counts))


BOOT_CHUNK = 500  # resamples drawn and evaluated at once (memory: BOOT_CHUNK × n floats per array)
MC_Z = 2.576  # a percentile is told from 0 only outside its 99% Monte-Carlo band (percentile_bands)


def resample_counts(n: int, n_boot: int = N_BOOT, seed: int = 0, chunk: int = BOOT_CHUNK):
    """The n_boot resamples of n examples drawn with replacement, as chunks of ≤ `chunk` rows of counts (how often
    each example was drawn). The same seed draws the same resamples for every setting of an experiment, so each
    change is measured on paired resamples of the same examples."""
    if n < 2:
        raise AttnkitError(f"a bootstrap needs at least two examples, got {n}")
    if n_boot < 10:
        raise AttnkitError(f"a bootstrap needs at least 10 resamples, got {n_boot}")
    rng = np.random.default_rng(seed)
    for start in range(0, n_boot, chunk):
        k = min(chunk, n_boot - start)
        draws = rng.integers(0, n, size=(k, n))
        yield np.bincount((draws + n * np.arange(k)[:, None]).ravel(), minlength=k * n).reshape(k, n).astype(
            np.float64)


def bootstrap_values(scores: ExampleScores, n_boot: int = N_BOOT, seed: int = 0) -> np.ndarray:
    """The metric on every resample; nan where it is undefined (e.g. a constant resample)."""
    return np.concatenate([scores.resampled(c) for c in resample_counts(scores.n, n_boot, seed)])


def percentile_interval(values: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """The (1 − level)/2 and (1 + level)/2 percentiles of the finite `values`; (nan, nan) when fewer than
    half the resamples gave a finite value."""
    if not 0.0 < level < 1.0:
        raise AttnkitError(f"the confidence level must lie in (0, 1), got {level}")
    values = np.asarray(values, dtype=np.float64)
    finite = values[np.isfinite(values)]
    if finite.size < max(1, values.size // 2):
        return float("nan"), float("nan")
    lo, hi = np.percentile(finite, [50.0 * (1.0 - level), 50.0 * (1.0 + level)])
    return float(lo), float(hi)


def percentile_bands(values: np.ndarray, level: float = 0.95, z: float = MC_Z) -> tuple[tuple, tuple]:
    """The Monte-Carlo band of each end of `percentile_interval`: a percentile q estimated from m resamples is
    the order statistic near rank m·q, and with other resamples it would have come out anywhere between the
    order statistics at ranks m·q ± z·√(m·q·(1 − q)) (the binomial count of resamples below the true
    percentile). ((lo_min, lo_max), (hi_min, hi_max)); nan when the interval is."""
    values = np.asarray(values, dtype=np.float64)
    finite = np.sort(values[np.isfinite(values)])
    m = finite.size
    if m < max(1, values.size // 2):
        return (float("nan"),) * 2, (float("nan"),) * 2
    out = []
    for q in ((1.0 - level) / 2.0, (1.0 + level) / 2.0):
        spread = z * np.sqrt(m * q * (1.0 - q))
        a = int(np.clip(np.floor(m * q - spread), 0, m - 1))
        b = int(np.clip(np.ceil(m * q + spread), 0, m - 1))
        out.append((float(finite[a]), float(finite[b])))
    return out[0], out[1]


def excludes_zero(values: np.ndarray, level: float = 0.95, z: float = MC_Z) -> bool:
    """Whether the interval of `values` excludes 0 by more than its Monte-Carlo noise: the whole band of its lower
    end lies above 0, or the whole band of its upper end below 0. An end within that noise of 0 could have
    landed on the other side with other resamples, so it is not read as excluding 0."""
    (lo_min, _), (_, hi_max) = percentile_bands(values, level, z)
    return bool(lo_min > 0.0 or hi_max < 0.0)


def bootstrap_delta(base: ExampleScores, other: ExampleScores, *, n_boot: int = N_BOOT, seed: int = 0,
                    level: float = 0.95) -> tuple[float, float]:
    """Paired percentile-bootstrap interval of metric(other) − metric(base): both evaluated on the same
    resamples of the examples."""
    if base.n != other.n:
        raise AttnkitError(f"paired resampling needs the same examples: {base.n} vs {other.n}")
    return percentile_interval(bootstrap_values(other, n_boot, seed) - bootstrap_values(base, n_boot, seed), level)
