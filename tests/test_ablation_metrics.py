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


def test_resampled_metrics_equal_the_metrics_of_the_resamples():
    """Each weighted_* metric of a row of counts equals the plain metric of that resample written out (np.repeat),
    computed by scipy and scikit-learn."""
    from scipy.stats import pearsonr, spearmanr
    from sklearn.metrics import f1_score, matthews_corrcoef

    rng = np.random.default_rng(3)
    x, y = np.round(rng.random(40), 1), rng.random(40)  # rounding makes ties
    p, g = rng.integers(0, 2, 40), rng.integers(0, 2, 40)
    counts = np.concatenate(list(metrics.resample_counts(40, 30, seed=5, chunk=7)))
    assert counts.shape == (30, 40) and (counts.sum(1) == 40).all()
    got = {"spearman": metrics.weighted_spearman(x, y, counts), "pearson": metrics.weighted_pearson(x, y, counts),
           "accuracy": metrics.weighted_accuracy(p, g, counts), "f1": metrics.weighted_f1(p, g, counts),
           "mcc": metrics.weighted_matthews(p, g, counts), "mean": metrics.weighted_mean(x, counts)}
    for i, c in enumerate(counts.astype(int)):
        idx = np.repeat(np.arange(40), c)
        want = {"spearman": 100 * spearmanr(x[idx], y[idx]).statistic, "pearson": 100 * pearsonr(x[idx], y[idx]).statistic,
                "accuracy": 100 * (p[idx] == g[idx]).mean(), "f1": 100 * f1_score(g[idx], p[idx], zero_division=0),
                "mcc": 100 * matthews_corrcoef(g[idx], p[idx]), "mean": x[idx].mean()}
        for k, v in want.items():
            assert got[k][i] == pytest.approx(v, abs=1e-9), k
    assert math.isnan(metrics.weighted_pearson(np.ones(4), np.arange(4.0), np.ones((1, 4)))[0])


def test_ten_thousand_resamples_by_default_and_the_same_draws_for_every_setting():
    assert metrics.N_BOOT == 10_000
    a = np.concatenate(list(metrics.resample_counts(50, seed=1)))
    b = np.concatenate(list(metrics.resample_counts(50, seed=1, chunk=333)))
    assert a.shape == (10_000, 50) and np.array_equal(a, b)  # chunking does not change the draws


def test_an_end_within_monte_carlo_noise_of_zero_does_not_exclude_zero():
    """The 2.5th percentile of 10,000 resamples lies a little above 0, but other resamples would put it below: its
    99% Monte-Carlo band (order statistics at ranks m·q ± 2.576·√(m·q·(1 − q))) reaches below 0."""
    rng = np.random.default_rng(0)
    m, q = 10_000, 0.025
    values = np.sort(rng.normal(1.0, 0.5, m))
    values -= values[int(m * q)] - 1e-4  # the lower percentile lands just above 0
    lo, hi = percentile_interval(values)
    assert 0 < lo < 1e-3 and hi > 0
    (lo_min, lo_max), _ = metrics.percentile_bands(values)
    spread = 2.576 * math.sqrt(m * q * (1 - q))
    assert lo_min == values[math.floor(m * q - spread)] < 0 < lo_max == values[math.ceil(m * q + spread)]
    assert not metrics.excludes_zero(values)
    assert metrics.excludes_zero(values + 0.1)  # clear of 0 by more than the noise
    assert metrics.excludes_zero(-(values + 0.1))
    assert not metrics.excludes_zero(np.full(100, np.nan))
