"""compare-models: the chunked similarity sums against full attention maps, and a model against a copy whose
layer 2 is perturbed (layers 0-1 identical, layer 2 changed most)."""
import copy
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from attnkit.compare import compare_models, similarity_sums  # the path docs/compare.md names
from attnkit.errors import AttnkitError

from .synthetic import WORDS, tiny_bert


def full_maps(q, k, lengths, scaling):
    B, H, L, _ = q.shape
    s = torch.einsum("bhsd,bhtd->bhst", q.double(), k.double()) * scaling
    mask = torch.arange(L)[None, :] < lengths[:, None]
    return torch.softmax(s.masked_fill(~mask[:, None, None, :], float("-inf")), -1)


@pytest.mark.parametrize("max_elems", [1 << 22, 40])  # one block / one row per block
def test_sums_match_full_maps(max_elems):
    g = torch.Generator().manual_seed(0)
    B, H, L = 3, 2, 7
    qa, ka = torch.randn(B, H, L, 4, generator=g), torch.randn(B, H, L, 4, generator=g)
    qb, kb = torch.randn(B, H, L, 6, generator=g), torch.randn(B, H, L, 6, generator=g)  # other head size
    lengths = torch.tensor([7, 3, 1])
    got = similarity_sums(qa, ka, qb, kb, lengths, 0.5, 0.4, max_elems=max_elems)
    A, Bm = full_maps(qa, ka, lengths, 0.5), full_maps(qb, kb, lengths, 0.4)
    for b in range(B):
        n = int(lengths[b])
        a, bb = A[b, :, :n, :n], Bm[b, :, :n, :n]
        cos = (a * bb).sum(-1) / (a.norm(dim=-1) * bb.norm(dim=-1))
        np.testing.assert_allclose(got["row_cos"][b], cos.sum(-1), rtol=1e-5)
        np.testing.assert_allclose(got["ab"][b], (a * bb).sum((-1, -2)), rtol=1e-5)
        np.testing.assert_allclose(got["aa"][b], (a * a).sum((-1, -2)), rtol=1e-5)
        np.testing.assert_allclose(got["bb"][b], (bb * bb).sum((-1, -2)), rtol=1e-5)
    assert got["row_cos"][2].tolist() == pytest.approx([1.0, 1.0])  # one token: both rows are (1)
    same = similarity_sums(qa, ka, qa, ka, lengths, 0.5, 0.5, max_elems=max_elems)
    np.testing.assert_allclose(same["row_cos"].sum(0), [lengths.sum()] * H, rtol=1e-6)


def test_shape_mismatch_is_an_error():
    q = torch.zeros(2, 2, 5, 4)
    with pytest.raises(AttnkitError, match="disagree"):
        similarity_sums(q, q, torch.zeros(2, 3, 5, 4), torch.zeros(2, 3, 5, 4), torch.tensor([5, 5]), 1.0, 1.0)


TEXTS = [" ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(4 + i % 6)) for i in range(12)]


def test_perturbed_layer_two(tmp_path):
    model, tok = tiny_bert(n_layers=4, n_heads=2)
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # every weight of layer 2
        for p in other.encoder.layer[2].parameters():
            p.add_(torch.randn(p.shape, generator=g) * p.std() * 2)
    res = compare_models(TEXTS, (model, tok), (other, tok), max_length=16, batch_size=5, backend="reference")
    assert res.n_samples == len(TEXTS)
    cos = res.row_cosine
    np.testing.assert_allclose(cos[:2], 1.0, atol=1e-6)  # layers before the change are identical
    np.testing.assert_allclose(res.shift[:2], 0.0, atol=1e-6)
    assert np.all(cos[2] < 0.9) and np.all(cos[3] < 1 - 1e-5)  # layer 2 and the layer after it change
    drop = 1 - cos.mean(1)
    assert drop[2] > drop[3] and drop[2] > 10 * max(drop[0], drop[1], 1e-7)
    assert np.all(res.map_cosine[2] < 1 - 1e-3) and np.abs(res.shift[2]).max() > 1e-3
    same = compare_models(TEXTS[:4], (model, tok), (copy.deepcopy(model), tok), max_length=16, backend="reference")
    np.testing.assert_allclose(same.row_cosine, 1.0, atol=1e-5)

    path = res.save(tmp_path / "cmp", svg=False)
    data = json.loads(path.read_text())
    assert data["n_layers"] == 4 and data["most_changed"][0]["layer"] == 2
    assert np.asarray(data["row_cosine"]).shape == (4, 2)
    assert (tmp_path / "cmp" / "figures" / "compare_models.png").is_file()
    with np.load(tmp_path / "cmp" / "compare_models.npz") as z:
        np.testing.assert_allclose(z["shift"], res.shift)


def test_the_heatmap_scale_is_fitted_to_the_values():
    """A perturbed layer at 0.92–0.99 must not look like identical layers: the colours span the values."""
    import matplotlib.pyplot as plt

    from attnkit.jobs.compare import cosine_heatmaps

    cos = np.array([[1.0, 1.0, 1.0], [0.92, 0.97, 0.99], [0.995, 0.996, 0.999]])
    fig = cosine_heatmaps(map_cosine=cos, row_cosine=np.clip(cos + 0.001, 0, 1))
    ax = fig.axes[0]
    lo, hi = ax.images[0].get_clim()
    assert (lo, hi) == (0.92, 1.0)
    rgba = ax.images[0].to_rgba(cos)
    assert np.abs(rgba[0, 0, :3] - rgba[1, 0, :3]).max() > 0.5  # 1.00 and 0.92 look far apart
    labels = [t.get_text() for t in ax.texts]
    assert "0.995" in labels and "0.996" in labels  # neighbouring values read differently
    assert "0.920–1.000" in fig._suptitle.get_text()
    plt.close(fig)


def test_command_and_bad_pairs(tmp_path):
    from attnkit.cli.main import main

    model, tok = tiny_bert(n_layers=2, n_heads=2)
    for name, m in (("a", model), ("b", copy.deepcopy(model))):
        m.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(TEXTS[:6]) + "\n")
    res = CliRunner().invoke(main, ["compare-models", str(tmp_path / "a"), str(tmp_path / "b"), str(corpus),
                                    "-o", str(tmp_path / "out"), "--max-length", "16", "-q", "--no-svg"])
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "out" / "compare_models.json").read_text())
    assert data["n_samples"] == 6 and np.allclose(data["row_cosine"], 1.0, atol=1e-5)
    out = tmp_path / "out"
    assert res.output.strip().splitlines()[-1] == (f"wrote {out}/compare_models.json, {out}/compare_models.npz, "
                                                   f"{out}/figures/compare_models.png")
    args = ["compare-models", str(tmp_path / "a"), str(tmp_path / "b"), str(corpus), "-o", str(out), "--max-length",
            "16", "-q", "--no-svg"]
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 1 and "compare_models.json, compare_models.npz, figures/compare_models.png} already " \
                                     "exist: give --overwrite" in again.output
    again = CliRunner().invoke(main, args + ["--overwrite"])
    assert again.exit_code == 0 and f"--overwrite removed {out}/{{compare_models.json, compare_models.npz, " in again.output
    with pytest.raises(AttnkitError, match="same object"):
        compare_models(TEXTS, (model, tok), (model, tok))
    small, _ = tiny_bert(n_layers=1, n_heads=2)
    with pytest.raises(AttnkitError, match="differ in shape"):
        compare_models(TEXTS, (model, tok), (small, tok))


def test_figure_plots_what_its_titles_say():
    from attnkit.jobs.compare import cosine_heatmaps
    from attnkit.plotting import plt

    rng = np.random.default_rng(0)
    map_cos, row_cos = rng.uniform(0.2, 1.0, (3, 4)), rng.uniform(0.2, 1.0, (3, 4))
    fig = cosine_heatmaps(map_cosine=map_cos, row_cosine=row_cos, meta={"model_a": "x/pre", "model_b": "x/tuned"})
    try:
        panels = [ax for ax in fig.axes if ax.images]  # the two heatmaps (colour bars hold no image)
        assert len(panels) == 2
        (left, right) = panels
        assert "flattened-map cosine" in left.get_title() and "Fig. 5" in left.get_title()
        assert "row cosine" in right.get_title() and "map" not in right.get_title()
        np.testing.assert_array_equal(left.images[0].get_array(), map_cos)
        np.testing.assert_array_equal(right.images[0].get_array(), row_cos)
        both = np.concatenate([map_cos.ravel(), row_cos.ravel()])
        assert left.images[0].get_clim() == right.images[0].get_clim() == (both.min(), both.max())  # one scale
        # every cell carries its own value
        assert sorted(t.get_text() for t in left.texts) == sorted(f"{v:.2f}" for v in map_cos.ravel())
        assert "x/tuned vs x/pre" in fig._suptitle.get_text()
    finally:
        plt.close(fig)


def test_help_cites_kovaleva_section_4_3():
    from attnkit.cli.main import main

    res = CliRunner().invoke(main, ["compare-models", "--help"])
    assert res.exit_code == 0
    text = " ".join(res.output.split())
    assert "Kovaleva et al. 2019, Sec. 4.3, Fig. 5" in text and "Sec. 5" not in text


def test_an_empty_corpus_is_named_before_the_models_load(tmp_path):
    from attnkit.corpus import open_corpus

    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    # the models do not exist: the corpus error comes first, so neither was loaded
    with pytest.raises(AttnkitError, match="has no text"):
        compare_models(open_corpus([empty]), tmp_path / "no-model-a", tmp_path / "no-model-b")
