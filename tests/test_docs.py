"""docs/ stays true to the code: the worked example computes as written, and the documented file
formats name every field the code writes."""
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from attnkit.features import CLS, OTHER, PERIOD, SEP, feature_names
from attnkit.reference import bucket_index, row_features

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_index_links_resolve():
    index = (DOCS / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)", index)
    assert {"features.md", "interventions.md", "files.md", "analysis.md"} <= set(links)
    for page in DOCS.glob("*.md"):
        for link in re.findall(r"\]\(([^)#:]+\.md)", page.read_text()):
            assert (DOCS / link).is_file(), f"{page.name} links to missing {link}"


def test_worked_example_of_features_md():
    """Section 4 of docs/features.md: N = 4, [CLS] the cat . [SEP], row 2 given, other rows uniform."""
    classes = torch.tensor([[CLS, OTHER, OTHER, PERIOD, SEP]], dtype=torch.int32)
    lengths = torch.tensor([5])
    names = ["cls", "sep", "comma", "period", "self", "win_0", "win_1", "win_2", "win_3"]
    table = [["cls", "win_0", "win_1", "period", "sep"],
             ["cls", "self", "win_0", "period", "sep"],
             ["cls", "win_0", "self", "period", "sep"],
             ["cls", "win_1", "win_0", "period", "sep"],
             ["cls", "win_2", "win_1", "period", "sep"]]
    idx = bucket_index(classes, lengths, 4)[0]
    assert [[names[i] for i in row] for row in idx.tolist()] == table

    w = torch.full((1, 1, 5, 5), 0.2)
    w[0, 0, 2] = torch.tensor([0.10, 0.30, 0.40, 0.15, 0.05])
    # row 2 alone: zero the other rows (they then add 0 to every feature) and undo the mean over 5 rows
    only_row2 = torch.zeros(1, 1, 5, 1)
    only_row2[0, 0, 2] = 1.0
    got = dict(zip(feature_names(4), (row_features(w * only_row2, lengths, classes, None, 4)[0, 0] * 5).tolist()))
    row2 = {"cls": 0.10, "sep": 0.05, "comma": 0.0, "period": 0.15, "self": 0.40, "win_0": 0.30, "win_1": 0.0,
            "win_2": 0.0, "win_3": 0.0, "prev": 0.30, "next": 0.15, "entropy": 1.392, "max": 0.40, "intra": 1.0,
            "inter": 0.0}
    for k, v in row2.items():
        assert got[k] == pytest.approx(v, abs=5e-4), k

    sample = dict(zip(feature_names(4), row_features(w, lengths, classes, None, 4)[0, 0].tolist()))
    assert sample["self"] == pytest.approx(0.12)
    assert sample["win_0"] == pytest.approx(0.18)
    assert sample["entropy"] == pytest.approx((4 * np.log(5) + 1.392) / 5, abs=1e-3)
    assert sample["cls_entropy"] == pytest.approx(np.log(5))
    assert sum(sample[n] for n in names) == pytest.approx(1.0)


def test_every_feature_is_defined_in_features_md():
    text = (DOCS / "features.md").read_text()
    for name in feature_names(16, sink=True):
        if not name.startswith("win_"):
            assert f"`{name}`" in text, name
    assert "win_0" in text and "5 + N" in text


def test_clusters_json_fields_are_documented():
    from attnkit.analysis import cluster
    from attnkit.analysis.results import clusters_dict

    from .synthetic import layered_truth, make_features

    feats = make_features(layered_truth(L=3, H=6, seed=1))
    data = clusters_dict(cluster(feats, k=3, n_stability=2), feats)
    text = (DOCS / "files.md").read_text()
    keys = set(data) | set(data["settings"]) | set(data["run"]) | set(data["heads"][0]) | set(data["clusters"][0])
    keys |= set(data["stability"]) | set(data["clusters"][0]["profile"])
    for key in sorted(keys):
        assert f'"{key}"' in text or f"`{key}`" in text, key
