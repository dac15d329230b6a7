"""Jensen-Shannon distances between heads (Clark et al.): chunked PyTorch vs scipy, the collector
observer inside extraction, sampling of query rows, and the run-dir file."""
import copy
import math

import numpy as np
import pytest
import torch
from scipy.spatial.distance import jensenshannon

import attnkit
from attnkit import AttnkitError
from attnkit.analysis import DistanceCollector, HeadDistances, collect_distances, js_distances
from attnkit.engine.distances import js_from_rows, smooth_attention
from attnkit.ops import has_kernel

from .synthetic import tiny_bert


def random_attn(B, M, L, lengths, seed=0, sharp=2.0):
    g = torch.Generator().manual_seed(seed)
    attn = torch.zeros(B, M, L, L)
    for b, n in enumerate(lengths):
        attn[b, :, :, :n] = torch.softmax(torch.randn(M, L, n, generator=g) * sharp, -1)
    return attn


def scipy_js_sum(attn, lengths):
    """Σ_b Σ_{s<n_b} JS divergence, from scipy (which returns sqrt(JS): square it)."""
    B, M = attn.shape[:2]
    out = np.zeros((M, M))
    for b in range(B):
        n = int(lengths[b])
        for s in range(n):
            for i in range(M):
                for j in range(M):
                    p = attn[b, i, s, :n].double().numpy()
                    q = attn[b, j, s, :n].double().numpy()
                    out[i, j] += jensenshannon(p, q) ** 2  # natural log base by default
    return out


@pytest.mark.parametrize("max_elems", [1 << 24, 50, 700])  # one block / many head blocks / row chunks
def test_js_matches_scipy(max_elems):
    lengths = torch.tensor([7, 4, 1, 6])
    attn = random_attn(4, 5, 7, lengths.tolist())
    d, n = js_distances(attn, lengths, use_op=False, max_elems=max_elems)
    assert n == int(lengths.sum())
    ref = scipy_js_sum(attn, lengths)
    assert d.dtype == torch.float64
    np.testing.assert_allclose(d.numpy(), ref, atol=2e-6, rtol=1e-5)
    assert np.allclose(d.numpy(), d.numpy().T) and np.all(np.diag(d.numpy()) == 0)
    assert d.max() <= np.log(2) * n + 1e-9


def test_js_of_known_distributions():
    # one row, two heads: p = (1, 0), q = (0, 1): JS = ln 2; p = q: 0; a worked value for (1,0) vs (½,½)
    attn = torch.tensor([[[[1.0, 0.0], [0.5, 0.5]], [[0.0, 1.0], [0.5, 0.5]], [[0.5, 0.5], [0.5, 0.5]]]])
    d, n = js_distances(attn, torch.tensor([2]), use_op=False)
    assert n == 2
    # head 0 vs 1: row 0 ln 2, row 1 0
    assert d[0, 1].item() == pytest.approx(np.log(2), abs=1e-6)
    # head 0 vs 2, row 0: p=(1,0), q=(½,½), m=(¾,¼): ½[ln(4/3)] + ½[½ln(2/3) + ½ln 2]
    expected = 0.5 * np.log(4 / 3) + 0.5 * (0.5 * np.log(0.5 / 0.75) + 0.5 * np.log(0.5 / 0.25))
    assert d[0, 2].item() == pytest.approx(expected, abs=1e-6)


def test_row_sampling():
    # every row of a sample is the same distribution: the full sum is n_b times the one-row sum
    B, M, L = 3, 4, 6
    lengths = torch.tensor([6, 3, 5])
    base = random_attn(B, M, L, lengths.tolist(), seed=3)[:, :, :1, :]
    attn = base.expand(B, M, L, L).clone()
    full, n_full = js_distances(attn, lengths, use_op=False)
    one, n_one = js_distances(attn, lengths, rows_per_sample=1, use_op=False, generator=torch.Generator().manual_seed(1))
    assert (n_full, n_one) == (14, 3)
    per_sample = torch.stack([js_distances(attn[b:b + 1], lengths[b:b + 1], use_op=False)[0] / int(lengths[b])
                              for b in range(B)])
    np.testing.assert_allclose(one.numpy(), per_sample.sum(0).numpy(), atol=1e-6)
    np.testing.assert_allclose(full.numpy(), (per_sample * lengths.view(B, 1, 1)).sum(0).numpy(), atol=1e-5)
    many, n_many = js_distances(attn, lengths, rows_per_sample=100, use_op=False)
    assert n_many == n_full and torch.allclose(many, full)
    with pytest.raises(AttnkitError):
        js_distances(attn, lengths, rows_per_sample=0, use_op=False)
    with pytest.raises(AttnkitError):
        js_distances(attn[:, :, :, :5], lengths, use_op=False)


@pytest.mark.skipif(not has_kernel("cpu", "attnkit::js_distances"), reason="js_distances op not built")
def test_op_matches_pytorch():
    lengths = torch.tensor([9, 5, 2])
    attn = random_attn(3, 6, 9, lengths.tolist(), seed=5)
    d_op, _ = js_distances(attn, lengths, use_op=True)
    d_pt, _ = js_distances(attn, lengths, use_op=False)
    np.testing.assert_allclose(d_op.numpy(), d_pt.numpy(), atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_bert()


TEXTS = ["the cat sat on the mat.", ("a big red house", "the dog ran, and then the cat ran!"), "the dog is here",
         "the mat is red, the house is big.", ("then", "a cat")]


def test_collector_during_extraction_matches_eager_attention(tiny):
    model, tok = tiny
    eager = copy.deepcopy(model)  # the eager model gives the attention maps to check against
    feats, dist = collect_distances(TEXTS, (model, tok), batch_size=2, backend="reference", use_op=False,
                                    max_length=32)
    assert feats.n_samples == len(TEXTS)
    assert (dist.n_layers, dist.n_heads) == (2, 2) and dist.meta["n_batches"] == 3
    enc = tok([t if isinstance(t, str) else list(t) for t in TEXTS], padding=True, return_tensors="pt")
    with torch.no_grad():
        att = eager(**enc, output_attentions=True).attentions  # layers × (B×H×L×L)
    attn = torch.cat(list(att), dim=1)
    lengths = enc["attention_mask"].sum(-1)
    for b, n in enumerate(lengths.tolist()):
        attn[b, :, :, n:] = 0.0
    ref = scipy_js_sum(attn, lengths)
    assert dist.n_rows == int(lengths.sum()) == feats.n_tokens
    np.testing.assert_allclose(dist.total, ref, atol=5e-5, rtol=1e-4)
    np.testing.assert_allclose(dist.per_token, ref / dist.n_rows, atol=1e-6)
    # the observer is removed after the run
    assert attnkit.models.runtime_of(model).observers == []


def test_collector_checks_layers_and_roundtrip(tmp_path):
    c = DistanceCollector(2)
    q = torch.randn(1, 2, 3, 4)
    c(0, q, q, torch.tensor([3]), None)
    with pytest.raises(AttnkitError, match="seen twice"):
        c(0, q, q, torch.tensor([3]), None)
    with pytest.raises(AttnkitError, match="stopped after"):
        c.result()
    c(1, q, q, torch.tensor([3]), None)
    d = c.result()
    assert d.n_rows == 3 and d.total.shape == (4, 4)
    d.save(tmp_path)
    back = HeadDistances.load(tmp_path)
    np.testing.assert_array_equal(back.total, d.total)
    assert (back.n_rows, back.n_layers, back.n_heads) == (3, 2, 2)
    assert back.labels()[:3] == ["L0H0", "L0H1", "L1H0"]
    with pytest.raises(AttnkitError, match="missing") as err:
        HeadDistances.load(tmp_path / "nope")
    # the hint names the command for this run (the run's own corpus is the default: no --corpus needed)
    assert f"attnkit distances {tmp_path / 'nope'})" in str(err.value) and "--corpus" not in str(err.value)
    with pytest.raises(AttnkitError, match="no forward"):
        DistanceCollector(2).result()


def test_js_from_rows_empty():
    assert js_from_rows(torch.zeros(0, 3, 4)).shape == (3, 3)


def test_smoothing_matches_clark_formula():
    attn = torch.zeros(1, 2, 3, 3)
    attn[0, 0, :, 0] = 1.0  # head 0: all on token 0; head 1: all on token 1 (rows of a 2-token sample)
    attn[0, 1, :, 1] = 1.0
    lengths = torch.tensor([2])
    sm = smooth_attention(attn, lengths, 0.001)
    assert torch.allclose(sm[0, 0, 0, :2], torch.tensor([0.999 + 0.0005, 0.0005])) and sm[0, 0, 0, 2] == 0
    raw, n = js_distances(attn, lengths, use_op=False)
    smooth, _ = js_distances(attn, lengths, smoothing=0.001)
    assert raw[0, 1] == pytest.approx(2 * math.log(2))
    p, q = np.array([0.9995, 0.0005]), np.array([0.0005, 0.9995])
    m = (p + q) / 2
    js = 0.5 * np.sum(p * np.log(p / m)) + 0.5 * np.sum(q * np.log(q / m))
    assert float(smooth[0, 1]) == pytest.approx(2 * js, rel=1e-5) and float(smooth[0, 1]) < float(raw[0, 1])
    with pytest.raises(AttnkitError, match="smoothing"):
        js_distances(attn, lengths, smoothing=0.001, use_op=True)
    with pytest.raises(AttnkitError, match="smoothing must lie"):
        smooth_attention(attn, lengths, 1.5)
