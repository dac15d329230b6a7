"""attnkit/analysis/summaries.py: Clark et al.'s per-layer summaries, the heads above the papers' thresholds, and
the departures from the paper's findings."""
import math

import numpy as np
import pytest

from attnkit.analysis.summaries import layer_summaries, paper_differences, threshold_heads
from attnkit.run import HeadFeatures


def _features(**per_feature):
    from attnkit.features import feature_names

    names = feature_names(16)
    L, H = 6, 4
    mean = np.zeros((L, H, len(names)))
    mean[..., names.index("entropy")] = 2.0
    mean[..., names.index("cls_entropy")] = 2.5
    for k, v in per_feature.items():
        mean[..., names.index(k)] = v
    return HeadFeatures(mean, np.zeros_like(mean), names, n_samples=10, n_tokens=200, meta={})


def test_thresholds_and_baseline():
    f = _features()
    names = f.names
    f.mean[0, 1, names.index("prev")] = 0.7
    f.mean[1, 2, names.index("next")] = 0.55
    f.mean[3, 0, names.index("sep")] = 0.65
    f.mean[0, 3, names.index("entropy")] = 2.9  # 0.8 · ln 20 = 2.40
    s = layer_summaries(f)
    assert s["n_mean_tokens"] == 20 and s["uniform_entropy"] == pytest.approx(math.log(20))
    th = threshold_heads(f)
    assert th["previous token"] == [{"layer": 0, "head": 1, "value": pytest.approx(0.7)}]
    assert [(r["layer"], r["head"]) for r in th["next token"]] == [(1, 2)]
    assert [(r["layer"], r["head"]) for r in th["[SEP]"]] == [(3, 0)]
    assert [(r["layer"], r["head"]) for r in th["broad"]] == [(0, 3)]
    assert th["[CLS]"] == []


def test_paper_differences():
    cls_sink = _features(cls=0.5, sep=0.1)
    notes = paper_differences(cls_sink)
    assert any("sink is [CLS], not [SEP]" in n for n in notes)
    assert any("No head puts more than 50%" in n for n in notes)
    like_paper = _features(cls=0.05, sep=0.5)
    like_paper.mean[0, 0, like_paper.names.index("prev")] = 0.8
    like_paper.mean[..., like_paper.names.index("entropy")] = np.linspace(2.8, 1.0, 6)[:, None]
    assert paper_differences(like_paper) == []
