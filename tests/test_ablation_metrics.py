"""Metric implementations against values worked out by hand."""
import math

import numpy as np
import pytest

from attnkit import AttnkitError
from attnkit.ablation import metrics
from attnkit.ablation.metrics import ExampleScores, bootstrap_delta, percentile_interval

from .synthetic import mean_scores


def test_spearman_by_hand():
    # ranks of pred: 1 2 3 4 5; ranks of gold: 2 1 4 3 5 → d² = 1+1+1+1+0 = 4 → 1 - 6·4/(5·24) = 0.8
    assert metrics.spearman([0.1, 0.2, 0.3, 0.4, 0.5], [2.0, 1.0, 4.0, 3.0, 5.0]) == pytest.approx(80.0)
    assert metrics.spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-100.0)
    # ties take average ranks: pred ranks 1.5 1.5 3, gold ranks 1 2 3 → Pearson of the ranks
    r = np.corrcoef([1.5, 1.5, 3], [1, 2, 3])[0, 1]
    assert metrics.spearman([0, 0, 1], [1, 2, 3]) == pytest.approx(100 * r)
    assert math.isnan(metrics.spearman([1, 1, 1], [1, 2, 3]))
    with pytest.raises(AttnkitError):
        metrics.spearman([1, 2], [1, 2, 3])


def test_pearson_by_hand():
    # x = 1 2 3, y = 1 3 2: cov = (−1·−1 + 0 + 1·0)/… → r = 1/(√2·√2) = 0.5
    assert metrics.pearson([1, 2, 3], [1, 3, 2]) == pytest.approx(50.0)


def test_classification_metrics_by_hand():
    pred = [1, 1, 0, 0, 1, 0]
    gold = [1, 0, 0, 1, 1, 0]
    # tp = 2, fp = 1, fn = 1, tn = 2
    assert metrics.accuracy(pred, gold) == pytest.approx(100 * 4 / 6)
    assert metrics.f1(pred, gold) == pytest.approx(100 * 2 * 2 / (2 * 2 + 1 + 1))  # 2tp/(2tp+fp+fn)
    mcc = (2 * 2 - 1 * 1) / math.sqrt((2 + 1) * (2 + 1) * (2 + 1) * (2 + 1))
    assert metrics.matthews(pred, gold) == pytest.approx(100 * mcc)
    assert metrics.f1([0, 0], [1, 1]) == 0.0


def test_squad_normalisation():
    assert metrics.normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert metrics.normalize_answer("an apple, a pear") == "apple pear"
    assert metrics.normalize_answer("Theatre") == "theatre"  # articles only as whole words
    assert metrics.normalize_answer("U.S.A.") == "usa"


def test_squad_em_f1_by_hand():
    assert metrics.squad_exact("the Eiffel tower.", "Eiffel Tower") == 1
    assert metrics.squad_exact("Eiffel", "Eiffel Tower") == 0
    # pred tokens [eiffel], gold [eiffel, tower]: p = 1, r = 1/2 → F1 = 2/3
    assert metrics.squad_f1("Eiffel", "the Eiffel Tower") == pytest.approx(2 / 3)
    # repeated tokens count once per occurrence: pred [x b b], gold [b c]: common 1 → p=1/3 r=1/2 → 0.4
    assert metrics.squad_f1("x b b", "b c") == pytest.approx(0.4)
    assert metrics.squad_f1("", "") == 1.0
    assert metrics.squad_f1("", "paris") == 0.0


def test_squad_scores_v2_no_answer():
    preds = {"q1": "Paris", "q2": "", "q3": "London", "q4": "in 1999"}
    golds = {"q1": ["paris", "Paris, France"], "q2": [], "q3": [], "q4": ["1999"]}
    s = metrics.squad_scores(preds, golds)
    # EM: q1 1, q2 1 (no answer, empty prediction), q3 0, q4 0 → 50; F1: q4 = 2·(1/2·1)/(1/2+1) = 2/3
    assert s["exact"] == pytest.approx(50.0)
    assert s["f1"] == pytest.approx(100 * (1 + 1 + 0 + 2 / 3) / 4)
    assert s["HasAns_exact"] == pytest.approx(50.0) and s["NoAns_exact"] == pytest.approx(50.0)
    assert s["total"] == 4
    with pytest.raises(AttnkitError):
        metrics.squad_scores({}, {"q": ["a"]})


def test_paired_bootstrap_of_a_constant_shift_is_exact():
    rng = np.random.default_rng(0)
    base = rng.random(200)
    lo, hi = bootstrap_delta(mean_scores(base), mean_scores(base + 0.05), n_boot=200)
    assert lo == pytest.approx(5.0) and hi == pytest.approx(5.0)  # paired: the noise cancels


def test_bootstrap_interval_covers_the_true_change_and_shrinks_with_n():
    rng = np.random.default_rng(1)
    widths = []
    for n in (50, 800):
        base = rng.integers(0, 2, n)
        flip = rng.random(n) < 0.1
        other = np.where(flip, 1 - base, base)
        true = 100.0 * (other.mean() - base.mean())
        lo, hi = bootstrap_delta(mean_scores(base), mean_scores(other), n_boot=500, seed=2)
        assert lo <= true <= hi
        widths.append(hi - lo)
    assert widths[1] < widths[0] / 2


def test_undefined_resamples_give_nan():
    const = ExampleScores({"p": np.ones(5), "g": np.arange(5.0)},
                          lambda a, w: metrics.weighted_spearman(a["p"], a["g"], w))
    assert all(math.isnan(x) for x in bootstrap_delta(const, const, n_boot=50))
    assert percentile_interval(np.array([1.0, 2.0, 3.0]), 0.5) == (1.5, 2.5)
