"""HeadFeatures as a user sees it: `to_pandas()` with layer and head columns (as `attnkit export` writes), a short
`repr`, and a notebook view of one feature as a layer × head grid."""
import re

import numpy as np
import pytest

from attnkit.errors import AttnkitError
from attnkit.run.head_features import HeadFeatures

FEATS = {"L": 3, "H": 4, "seed": 2}


def test_to_pandas_has_layer_and_head_columns(feats):
    df = feats.to_pandas()
    F = len(feats.names)
    assert list(df.columns) == ["layer", "head", *feats.names, *[f"{n}_std" for n in feats.names]]
    assert df["layer"].dtype.kind == "i" and df["head"].dtype.kind == "i"
    assert len(df) == feats.n_layers * feats.n_heads and F > 5
    for _, row in df.sample(5, random_state=0).iterrows():
        l, h = int(row["layer"]), int(row["head"])
        for j in (0, F - 1):
            assert row[feats.names[j]] == feats.mean[l, h, j]
            assert row[f"{feats.names[j]}_std"] == feats.std[l, h, j]


def test_repr_is_one_short_line(feats):
    feats.meta["model"] = "/models/minilm"
    text = repr(feats)
    assert "\n" not in text and len(text) < 200 and "[" not in text  # no array dump
    assert text == (f"HeadFeatures(3 layers × 4 heads × {len(feats.names)} features, {feats.n_samples} samples, "
                    f"{feats.n_tokens} tokens, model='/models/minilm')")


def _cells(html_text):
    return re.findall(r'<td style="background:rgb\((\d+),(\d+),(\d+)\);color:[^"]*">([-\d.]+)</td>', html_text)


def test_notebook_view_shows_the_chosen_feature_as_a_shaded_grid(feats):
    grid = feats.grid("sep")
    cells = _cells(grid._repr_html_())
    values = feats.feature("sep")
    assert [float(c[3]) for c in cells] == [float(f"{v:.3f}") for v in values.ravel()]
    red = np.array([int(c[0]) for c in cells])
    assert red[np.argmax(values.ravel())] == red.min() and red[np.argmin(values.ravel())] == 255
    assert grid._repr_html_().count("<tr>") == 1 + feats.n_layers
    text = repr(grid).splitlines()
    assert text[0] == "sep (mean), 3 layers × 4 heads" and text[2].split()[1] == f"{values[0, 0]:.3f}"
    page = feats._repr_html_()
    assert "HeadFeatures(3 layers" in page and len(_cells(page)) == 12 and "cls (mean)" in page
    assert [float(c[3]) for c in _cells(feats.grid("entropy", "std")._repr_html_())] == \
        [float(f"{v:.3f}") for v in feats.std[:, :, feats.names.index("entropy")].ravel()]
    with pytest.raises(AttnkitError, match="unknown feature 'nope'"):
        feats.grid("nope")
    with pytest.raises(AttnkitError, match="unknown stat 'var'"):
        feats.grid("cls", "var")


def test_a_constant_feature_does_not_divide_by_zero():
    f = HeadFeatures(np.full((1, 2, 1), 0.5), np.zeros((1, 2, 1)), ["cls"], 3, 30)
    assert [c[3] for c in _cells(f._repr_html_())] == ["0.500", "0.500"]
