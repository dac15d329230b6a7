"""Task metrics, as the benchmarks define them. All scores are reported ×100 (percent points).

* Correlations (STS-B): Pearson and Spearman from `scipy.stats`.
* GLUE: accuracy; F1 of the positive class (MRPC, QQP); Matthews correlation (CoLA), via `sklearn.metrics`.
* SQuAD: exact match and token F1 after the official normalisation (lower case, strip punctuation,
  drop the articles a/an/the, collapse white space), max over the gold answers; SQuAD 2.0 scores an
  unanswerable question 1 when the prediction is empty and 0 otherwise.
* Uncertainty: a paired percentile bootstrap of metric changes (`bootstrap_delta`): resample the examples
  with replacement, evaluate the baseline and the setting on the same resample, take the 2.5 and 97.5
  percentiles of the differences.
"""
from __future__ import annotations

import collections
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import AttnkitError


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
@dataclass
class ExampleScores:
    """One evaluation's per-example outputs, for resampling: `arrays` (name → array whose first axis is the n
    examples, in the same order for every setting of an experiment) and `metric(arrays) → float`, the main
    metric (×100) of any subset or resample of the rows. Tasks leave one in `task.last_examples`."""

    arrays: dict
    metric: Callable[[dict], float]

    @property
    def n(self) -> int:
        return len(next(iter(self.arrays.values())))

    def at(self, idx: np.ndarray) -> float:
        return float(self.metric({k: np.asarray(v)[idx] for k, v in self.arrays.items()}))


def resample_indices(n: int, n_boot: int = 1000, seed: int = 0) -> np.ndarray:
    """n_boot × n indices drawn with replacement; the same seed gives the same draws to every setting of an
    experiment, so each change is measured on paired resamples of the same examples."""
    if n < 2:
        raise AttnkitError(f"a bootstrap needs at least two examples, got {n}")
    if n_boot < 10:
        raise AttnkitError(f"a bootstrap needs at least 10 resamples, got {n_boot}")
    return np.random.default_rng(seed).integers(0, n, size=(n_boot, n))


def bootstrap_values(scores: ExampleScores, draws: np.ndarray) -> np.ndarray:
    """The metric on every resample (rows of `draws`); nan where it is undefined (e.g. a constant resample)."""
    if draws.shape[1] != scores.n:
        raise AttnkitError(f"resamples of {draws.shape[1]} examples cannot index {scores.n} examples: the settings "
                           "were evaluated on different examples")
    return np.array([scores.at(idx) for idx in draws], dtype=np.float64)


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


def bootstrap_delta(base: ExampleScores, other: ExampleScores, *, n_boot: int = 1000, seed: int = 0,
                    level: float = 0.95) -> tuple[float, float]:
    """Paired percentile-bootstrap interval of metric(other) − metric(base): both evaluated on the same
    resamples of the examples."""
    if base.n != other.n:
        raise AttnkitError(f"paired resampling needs the same examples: {base.n} vs {other.n}")
    draws = resample_indices(base.n, n_boot, seed)
    return percentile_interval(bootstrap_values(other, draws) - bootstrap_values(base, draws), level)
