"""The reference (attnkit/reference.py) against answers worked out by hand from docs/features.md."""
import math

import pytest
import torch

from attnkit.features import ALL, CLS, COMMA, KEEP, NO_INTER, NO_INTRA, OTHER, SEP, UNIFORM, ZERO, feature_names
from attnkit.reference import bucket_index, intervene_weights, reference_attention, row_features

N = 4  # windows in most hand-built cases
NAMES = feature_names(N)
IDX = {n: i for i, n in enumerate(NAMES)}


def feats(w, lengths, classes, sent=None, nw=N):
    w = torch.tensor(w, dtype=torch.float32)[None, None]  # 1×1×L×L
    classes = torch.tensor([classes], dtype=torch.int32)
    sent = None if sent is None else torch.tensor([sent], dtype=torch.int32)
    return row_features(w, torch.tensor([lengths]), classes, sent, nw)[0, 0]


def test_buckets_of_a_hand_built_matrix():
    # tokens: [CLS] a , b [SEP]   (n = 5, N = 4 → window w = floor(d·4/5): d=1→0, d=2→1, d=3→2, d=4→3)
    classes = [CLS, OTHER, COMMA, OTHER, SEP]
    w = [
        [0.5, 0.1, 0.1, 0.2, 0.1],
        [0.2, 0.4, 0.1, 0.2, 0.1],
        [0.0, 0.0, 1.0, 0.0, 0.0],
        [0.1, 0.3, 0.0, 0.6, 0.0],
        [0.0, 0.0, 0.0, 0.0, 1.0],
    ]
    f = feats(w, 5, classes)
    # per-row buckets worked out by hand, then averaged over 5 rows
    cls = (0.5 + 0.2 + 0 + 0.1 + 0) / 5
    sep = (0.1 + 0.1 + 0 + 0 + 1.0) / 5
    comma = (0.1 + 0.1 + 1.0 + 0 + 0) / 5
    self_ = (0 + 0.4 + 0 + 0.6 + 0) / 5  # row 0 is CLS, row 2 comma, row 4 SEP: their self weight is in the class bucket
    # row 0 (s=0): t=1 d=1 → win_0 0.1; t=3 d=3 → win_2 0.2
    # row 1 (s=1): t=3 d=2 → win_1 0.2
    # row 3 (s=3): t=1 d=2 → win_1 0.3
    win0 = 0.1 / 5
    win1 = (0.2 + 0.3) / 5
    win2 = 0.2 / 5
    expect = {"cls": cls, "sep": sep, "comma": comma, "period": 0.0, "self": self_, "win_0": win0,
              "win_1": win1, "win_2": win2, "win_3": 0.0}
    for name, value in expect.items():
        assert f[IDX[name]].item() == pytest.approx(value, abs=1e-6), name
    assert f[: 5 + N].sum().item() == pytest.approx(1.0, abs=1e-6)
    # prev/next: A[s, s-1], A[s, s+1]
    assert f[IDX["prev"]].item() == pytest.approx((0 + 0.2 + 0.0 + 0.0 + 0.0) / 5)
    assert f[IDX["next"]].item() == pytest.approx((0.1 + 0.1 + 0.0 + 0.0 + 0) / 5)
    # max and entropy
    assert f[IDX["max"]].item() == pytest.approx((0.5 + 0.4 + 1 + 0.6 + 1) / 5)
    ent = lambda row: -sum(p * math.log(p) for p in row if p > 0)
    assert f[IDX["entropy"]].item() == pytest.approx(sum(ent(r) for r in w) / 5, abs=1e-6)
    assert f[IDX["cls_entropy"]].item() == pytest.approx(ent(w[0]), abs=1e-6)
    # one sentence: all intra
    assert f[IDX["intra"]].item() == pytest.approx(1.0)
    assert f[IDX["inter"]].item() == pytest.approx(0.0)


def test_padding_rows_and_keys_are_ignored():
    classes = [CLS, OTHER, SEP, OTHER]  # last position is padding (n = 3)
    w = [[0.2, 0.3, 0.5, 0.0], [0.1, 0.8, 0.1, 0.0], [0.3, 0.3, 0.4, 0.0], [0.25, 0.25, 0.25, 0.25]]
    f = feats(w, 3, classes)
    assert f[: 5 + N].sum().item() == pytest.approx(1.0, abs=1e-6)
    assert f[IDX["self"]].item() == pytest.approx(0.8 / 3)


def test_window_formula_when_n_is_not_divisible_by_N():
    n, nw = 7, 3  # w = floor(d·3/7): d=1,2→0; d=3,4→1; d=5,6→2
    idx = bucket_index(torch.zeros(1, n, dtype=torch.int32), torch.tensor([n]), nw)[0]
    for s in range(n):
        for t in range(n):
            d = abs(s - t)
            expect = 4 if d == 0 else 5 + (d * nw) // n
            assert idx[s, t].item() == expect
    assert {idx[0, t].item() - 5 for t in range(1, n)} == {0, 1, 2}


def test_intra_inter_and_prev_next_edges():
    # two sentences: [CLS] a [SEP] | b [SEP]
    classes = [CLS, OTHER, SEP, OTHER, SEP]
    sent = [0, 0, 0, 1, 1]
    w = torch.full((5, 5), 0.2).tolist()
    f = feats(w, 5, classes, sent)
    # rows 0..2 see 3 keys of their own sentence; rows 3, 4 see 2
    intra = (3 * 0.6 + 2 * 0.4) / 5
    assert f[IDX["intra"]].item() == pytest.approx(intra)
    assert f[IDX["inter"]].item() == pytest.approx(1 - intra)
    # first row has no previous token, last row no next token
    assert f[IDX["prev"]].item() == pytest.approx(4 * 0.2 / 5)
    assert f[IDX["next"]].item() == pytest.approx(4 * 0.2 / 5)


def test_single_token_sample():
    f = feats([[1.0]], 1, [CLS])
    assert f[IDX["cls"]].item() == 1.0
    assert f[IDX["entropy"]].item() == 0.0
    assert f[IDX["prev"]].item() == 0.0 and f[IDX["next"]].item() == 0.0


def _weights(B=2, H=3, L=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(B, H, L, L, generator=g)
    return w / w.sum(-1, keepdim=True)


def test_interventions_modes_and_regions():
    L = 4
    w = torch.full((1, 4, L, L), 0.25)
    lengths = torch.tensor([3])
    w[..., 3] = 0  # padded key
    w = w / w.sum(-1, keepdim=True)
    sent = torch.tensor([[0, 0, 1, 1]], dtype=torch.int32)
    mode = torch.tensor([KEEP, ZERO, UNIFORM, KEEP])
    region = torch.tensor([ALL, ALL, NO_INTRA, NO_INTER])
    out = intervene_weights(w, lengths, sent, mode, region, renormalize=False)
    assert torch.allclose(out[0, 0], w[0, 0])
    assert out[0, 1].abs().sum() == 0
    # uniform 1/3 on valid keys, then intra removed: row 0 (sentence 0) keeps key 2 only
    assert torch.allclose(out[0, 2, 0], torch.tensor([0, 0, 1 / 3, 0]))
    assert torch.allclose(out[0, 2, 2], torch.tensor([1 / 3, 1 / 3, 0, 0]))
    # keep, inter removed: row 0 keeps keys 0, 1 (1/3 each)
    assert torch.allclose(out[0, 3, 0], torch.tensor([1 / 3, 1 / 3, 0, 0]))
    ren = intervene_weights(w, lengths, sent, mode, region, renormalize=True)
    assert torch.allclose(ren[0, 3, 0], torch.tensor([0.5, 0.5, 0, 0]))
    assert torch.allclose(ren[0, 2, 0], torch.tensor([0, 0, 1.0, 0]))
    assert ren[0, 1].abs().sum() == 0  # a zeroed row stays zero under renormalisation


def test_reference_attention_with_zero_queries_is_uniform_and_gated():
    B, H, L, D = 2, 2, 5, 4
    q = torch.zeros(B, H, L, D)
    k = torch.randn(B, H, L, D)
    v = torch.randn(B, H, L, D)
    lengths = torch.tensor([5, 3])
    gates = torch.tensor([1.0, 0.5])
    out, f = reference_attention(q, k, v, lengths, scaling=0.5, gates=gates, want_features=True, num_windows=N)
    assert out.shape == (B, L, H, D) and f.shape == (B, H, len(NAMES))
    mean_v0 = v[1, :, :3].mean(1)  # sample 1 attends uniformly to its 3 valid keys
    assert torch.allclose(out[1, 0], mean_v0 * gates[:, None], atol=1e-6)
    # uniform rows: entropy log n, max 1/n
    assert torch.allclose(f[1, :, IDX["entropy"]], torch.full((H,), math.log(3)), atol=1e-6)
    assert torch.allclose(f[1, :, IDX["max"]], torch.full((H,), 1 / 3), atol=1e-6)
    assert torch.allclose(f[..., : 5 + N].sum(-1), torch.ones(B, H), atol=1e-6)


def test_buckets_sum_to_one_on_random_weights_with_classes():
    w = _weights()
    lengths = torch.tensor([6, 4])
    w = w.masked_fill(torch.arange(6)[None, None, None, :] >= lengths[:, None, None, None], 0)
    w = w / w.sum(-1, keepdim=True)
    classes = torch.randint(0, 5, (2, 6), generator=torch.Generator().manual_seed(1)).int()
    f = row_features(w, lengths, classes, None, 5)
    assert torch.allclose(f[..., :10].sum(-1), torch.ones(2, 3), atol=1e-6)


def test_gates_and_inputs_receive_gradients():
    B, H, L, D = 1, 2, 4, 3
    q, k, v = (torch.randn(B, H, L, D, requires_grad=True) for _ in range(3))
    gates = torch.ones(H, requires_grad=True)
    out, _ = reference_attention(q, k, v, torch.tensor([4]), gates=gates)
    out.sum().backward()
    assert gates.grad is not None and q.grad is not None and v.grad is not None
    # d(sum out)/d gate_h = sum of the ungated output of head h
    with torch.no_grad():
        ungated, _ = reference_attention(q, k, v, torch.tensor([4]))
    assert torch.allclose(gates.grad, ungated.sum(dim=(0, 1, 3)), atol=1e-5)


# --- argument checks and the numerics policy (issue 12) ----------------------------------------------

def _qkv(B=2, H=2, L=6, D=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, D, generator=g) for _ in range(3)]


@pytest.mark.parametrize("kw,match", [
    (dict(lengths=torch.tensor([0, 6])), r"lengths must lie in \[1, L\] = \[1, 6\], got lengths\[0\] = 0"),
    (dict(lengths=torch.tensor([6, 7])), r"got lengths\[1\] = 7"),
    (dict(lengths=torch.tensor([6.0, 6.0])), "lengths must be an integer tensor"),
    (dict(lengths=torch.tensor([6])), r"lengths must have shape \[2\]"),
    (dict(mode=torch.tensor([0, 3])), "mode codes must be 0 \\(keep\\), 1 \\(zero\\) or 2 \\(uniform\\), got 3 at head 1"),
    (dict(region=torch.tensor([-1, 0])), "region codes .* got -1 at head 0"),
    (dict(token_class=torch.full((2, 6), 5), want_features=True), r"token_class codes must be 0..4 .* got 5 at \[0, 0\]"),
    (dict(num_windows=0), "num_windows must be an integer >= 1"),
    (dict(scaling=float("inf")), "scaling must be a finite number"),
    (dict(scaling=float("nan")), "scaling must be a finite number"),
    (dict(sentence_id=torch.zeros(2, 5, dtype=torch.int32)), r"sentence_id must have shape \[2, 6\]"),
    (dict(gates=torch.ones(3)), r"gates must have shape \[2\]"),
])
def test_reference_refuses_bad_arguments_by_name(kw, match):
    from attnkit.errors import AttnkitError

    q, k, v = _qkv()
    args = dict(lengths=torch.tensor([6, 4]), token_class=None, sentence_id=None)
    args.update(kw)
    with pytest.raises(AttnkitError, match=match):
        reference_attention(q, k, v, args.pop("lengths"), args.pop("token_class"), args.pop("sentence_id"), **args)


def test_reference_refuses_empty_head_dim_and_accepts_classes_beyond_lengths():
    from attnkit.errors import AttnkitError

    q, k, v = _qkv(D=0)
    with pytest.raises(AttnkitError, match="head dim"):
        reference_attention(q, k, v, torch.tensor([6, 4]), scaling=1.0)
    q, k, v = _qkv()
    tc = torch.zeros(2, 6, dtype=torch.int32)
    tc[1, 4:] = 99  # padding: never read
    reference_attention(q, k, v, torch.tensor([6, 4]), tc, want_features=True)


def test_nan_policy_by_hand():
    """A NaN score makes its row NaN (output and the features of its sample/head); padded garbage and
    zeroed heads stay out of it; uniform heads do not look at scores."""
    B, H, L, D = 2, 3, 5, 4
    q, k, v = _qkv(B, H, L, D, seed=3)
    lengths = torch.tensor([5, 3])
    q[0, 0, 1, 0] = float("nan")  # sample 0, head 0, row 1
    q[0, 1, 1, 0] = float("nan")  # same row in head 1 (uniform) and head 2 (zero)
    q[0, 2, 1, 0] = float("nan")
    v[0, 2, 0, 0] = float("nan")  # zeroed head: output stays 0
    k[1, :, 3:] = float("nan")  # padded keys of sample 1
    v[1, :, 3:] = float("inf")
    q[1, :, 4] = float("nan")  # a padded query row of sample 1
    mode = torch.tensor([KEEP, UNIFORM, ZERO])
    region = torch.tensor([NO_INTRA, ALL, ALL])  # no_intra on one sentence drops every key: still NaN
    out, f = reference_attention(q, k, v, lengths, mode=mode, region=region, want_features=True, num_windows=N)
    assert out[0, 1, 0].isnan().all() and not out[0, [0, 2, 3, 4], 0].isnan().any()
    assert f[0, 0].isnan().all() and torch.isfinite(f[0, 1:]).all()
    assert torch.isfinite(out[0, :, 1]).all() and (out[0, :, 2] == 0).all()
    assert torch.isfinite(out[1, :3]).all() and torch.isfinite(f[1]).all()
    assert out[1, 4, 0].isnan().all()  # the padded row itself is NaN, as every backend computes it
    # a +inf score: undefined too (torch.softmax gives NaN); a −inf score among finite ones: weight 0
    q2, k2, v2 = _qkv(1, 1, 4, 1, seed=4)
    q2.fill_(1.0)
    k2[0, 0, 2, 0] = float("inf")
    out2, f2 = reference_attention(q2, k2, v2, torch.tensor([4]), scaling=1.0, want_features=True)
    assert out2.isnan().all() and f2.isnan().all()
    k2[0, 0, 2, 0] = float("-inf")
    out3, f3 = reference_attention(q2, k2, v2, torch.tensor([4]), scaling=1.0, want_features=True)
    w = torch.softmax(k2[0, 0, [0, 1, 3], 0], 0)
    torch.testing.assert_close(out3[0, 0, 0, 0], (w * v2[0, 0, [0, 1, 3], 0]).sum())
    assert torch.isfinite(f3).all()


def test_sentence_ids_compare_as_integers_in_the_reference():
    q, k, v = _qkv(1, 1, 4, 4, seed=5)
    a = torch.tensor([[0, 0, 1, 1]], dtype=torch.int32)
    b = a + 2**24  # 2^24 and 2^24 + 1 share one float32
    fa = reference_attention(q, k, v, torch.tensor([4]), sentence_id=a, want_features=True, num_windows=N)[1]
    fb = reference_attention(q, k, v, torch.tensor([4]), sentence_id=b, want_features=True, num_windows=N)[1]
    assert torch.equal(fa, fb) and fa[0, 0, IDX["inter"]] > 0
