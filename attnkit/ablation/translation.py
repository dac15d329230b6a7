"""An encoder–decoder's greedy translations scored by corpus BLEU and chrF (sacrebleu), with the bootstrap exact and
fast: each pair keeps sacrebleu's sufficient statistics of its hypothesis against its target (BLEU: hypothesis and
reference lengths, matched and total n-grams of orders 1–4; chrF: hypothesis, reference and matched character
n-grams of orders 1–6), and the corpus score of a resample is computed from the count-weighted sums of those
statistics, for 10,000 resamples in a few array operations (as metrics.py's weighted_* do) — the same formulas as
sacrebleu's `BLEU.compute_bleu` (default: 13a tokens, exponential smoothing) and `CHRF._compute_f_score`
(chrF2), so a row of ones gives `sacrebleu.corpus_bleu` / `corpus_chrf` of the pairs.

This module imports neither torch nor sacrebleu at load (the command line checks `require_sacrebleu` before torch).
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import AttnkitError, arg

BLEU_ORDER = 4  # sacrebleu's BLEU.MAX_NGRAM_ORDER
CHRF_ORDER = 6  # sacrebleu's CHRF.CHAR_ORDER (word order 0: chrF, not chrF++)
CHRF_BETA = 2
BLEU_COLUMNS = ("bleu_hyp_len", "bleu_ref_len", *(f"bleu_match_{n}" for n in range(1, BLEU_ORDER + 1)),
                *(f"bleu_total_{n}" for n in range(1, BLEU_ORDER + 1)))
CHRF_COLUMNS = tuple(f"chrf_{what}_{n}" for n in range(1, CHRF_ORDER + 1) for what in ("hyp", "ref", "match"))
LOG_OF_ZERO = -9999999999  # sacrebleu.utils.my_log(0)


def require_sacrebleu() -> None:
    """Refuse decoding by name when sacrebleu, which scores it, is not installed."""
    try:
        import sacrebleu  # noqa: F401
    except ImportError:
        raise AttnkitError(f"{arg('decode')} scores translations with sacrebleu, which is not installed: "
                           "pip install attnkit[seq2seq]") from None


def pair_statistics(hypotheses: list[str], references: list[str]) -> dict[str, np.ndarray]:
    """Each pair's BLEU and chrF statistics (sacrebleu's, one reference per pair), one 1-D integer array per
    column of BLEU_COLUMNS and CHRF_COLUMNS."""
    require_sacrebleu()
    from sacrebleu.metrics import BLEU, CHRF

    if len(hypotheses) != len(references):
        raise AttnkitError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    out = {}
    for metric, columns in ((BLEU(), BLEU_COLUMNS), (CHRF(), CHRF_COLUMNS)):
        stats = np.asarray(metric._extract_corpus_statistics(list(hypotheses), [list(references)]),
                           dtype=np.int64).reshape(len(hypotheses), len(columns))
        out.update({c: stats[:, i] for i, c in enumerate(columns)})
    return out


def _sums(arrays: dict, columns, weights) -> np.ndarray:
    """k × columns: the count-weighted sums of the columns over the pairs, one row per resample (exact: whole
    counts times whole statistics)."""
    w = np.asarray(weights, dtype=np.float64)
    w = w[None, :] if w.ndim == 1 else w
    return w @ np.stack([np.asarray(arrays[c], dtype=np.float64) for c in columns], axis=1)


def weighted_bleu(arrays: dict, weights) -> np.ndarray:
    """Corpus BLEU (0–100) of each resample (rows of counts over the pairs), as sacrebleu's `compute_bleu` with
    exponential smoothing computes it from the summed statistics, operation for operation."""
    s = _sums(arrays, BLEU_COLUMNS, weights)
    sys_len, ref_len = s[:, 0], s[:, 1]
    correct, total = s[:, 2:2 + BLEU_ORDER], s[:, 2 + BLEU_ORDER:]
    with np.errstate(divide="ignore", invalid="ignore"):
        bp = np.where(sys_len < ref_len, np.where(sys_len > 0, np.exp(1 - ref_len / sys_len), 0.0), 1.0)
        smooth = np.ones(len(s))
        alive = np.ones(len(s), dtype=bool)  # no lower order without n-grams (sacrebleu stops there)
        log_sum = np.zeros(len(s))
        for n in range(BLEU_ORDER):
            alive &= total[:, n] > 0
            missed = alive & (correct[:, n] == 0)
            smooth = np.where(missed, smooth * 2, smooth)
            precision = np.where(missed, 100. / (smooth * total[:, n]), 100. * correct[:, n] / total[:, n])
            precision = np.where(alive, precision, 0.0)
            log_sum = log_sum + np.where(precision > 0, np.log(np.where(precision > 0, precision, 1.0)), LOG_OF_ZERO)
    score = bp * np.exp(log_sum / BLEU_ORDER)
    return np.where(correct.any(axis=1), score, 0.0)


def weighted_chrf(arrays: dict, weights) -> np.ndarray:
    """Corpus chrF (β = 2, character n-grams 1–6; 0–100) of each resample, as sacrebleu's `_compute_f_score`
    computes it from the summed statistics: precision and recall averaged over the orders that both sides have."""
    s = _sums(arrays, CHRF_COLUMNS, weights)
    factor = CHRF_BETA ** 2
    avg_prec, avg_rec, orders = np.zeros(len(s)), np.zeros(len(s)), np.zeros(len(s))
    with np.errstate(divide="ignore", invalid="ignore"):
        for i in range(CHRF_ORDER):
            n_hyp, n_ref, n_match = s[:, 3 * i], s[:, 3 * i + 1], s[:, 3 * i + 2]
            both = (n_hyp > 0) & (n_ref > 0)
            avg_prec = np.where(both, avg_prec + n_match / n_hyp, avg_prec)
            avg_rec = np.where(both, avg_rec + n_match / n_ref, avg_rec)
            orders = orders + both
        avg_prec = np.where(orders > 0, avg_prec / orders, 0.0)
        avg_rec = np.where(orders > 0, avg_rec / orders, 0.0)
        score = (1 + factor) * avg_prec * avg_rec
        score = score / ((factor * avg_prec) + avg_rec)
    return np.where(avg_prec + avg_rec != 0, 100 * score, 0.0)


TRANSLATION_METRICS = {"bleu": weighted_bleu, "chrf": weighted_chrf}


def default_max_new_tokens(target_tokens: list[int], max_length: int) -> int:
    """Tokens a greedy decoding may generate when not told: half again the longest target's tokens, and 5 more (a
    hypothesis longer than any target only loses precision), within the task's max_length."""
    longest = max(target_tokens, default=1)
    return max(1, min(math.ceil(1.5 * longest) + 5, max_length))


__all__ = ["BLEU_COLUMNS", "CHRF_COLUMNS", "TRANSLATION_METRICS", "default_max_new_tokens",
           "pair_statistics", "require_sacrebleu", "weighted_bleu", "weighted_chrf"]
