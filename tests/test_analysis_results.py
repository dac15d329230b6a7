"""attnkit/analysis/results.py: comparing the head types of two clustered runs, and how reliable the comparison is."""
from attnkit.analysis.clustering import cluster, stability_over_seeds
from attnkit.analysis.results import clusters_dict, compare

from .synthetic import layered_truth, make_features


def _clusters(features, n_seeds=10):
    c = cluster(features, k=4, n_stability=4)
    return clusters_dict(c, features, seeds=stability_over_seeds(features, n_seeds=n_seeds, first=c, k=4,
                                                                  n_stability=4))


def test_compare_marks_changes_unreliable_when_a_run_is_unstable():
    truth = layered_truth(4, 12)
    a = _clusters(make_features(truth, noise=0.005))
    b = _clusters(make_features(truth, noise=0.005, seed=3))
    mush = _clusters(make_features(truth, noise=0.02, structureless=True))
    ok = compare(a, b)
    assert ok["reliable"] and ok["stability"]["a"] == a["stability"]["over_seeds"]["mean"]
    bad = compare(a, mush)
    assert not bad["reliable"] and bad["stability"]["b"] < 0.8
    assert bad["changed"] and all(c["reliable"] is False for c in bad["changed"])
