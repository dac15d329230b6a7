"""attnkit::word_attention (Clark et al.'s word-level attention) against its reference twin, and the
reference against Clark's definition written out with loops.

CPU op tests skip when the extension lacks the op; the CUDA tests skip without a GPU and a CUDA build."""
from __future__ import annotations

import pytest
import torch

from attnkit.errors import AttnkitError
from attnkit.words import op_available, reference_word_attention, word_attention

HAS_CPU_OP = op_available("cpu")
HAS_CUDA_OP = torch.cuda.is_available() and op_available("cuda")
needs_cpu_op = pytest.mark.skipif(not HAS_CPU_OP, reason="attnkit._C has no word_attention kernel (rebuild it)")
needs_cuda_op = pytest.mark.skipif(not HAS_CUDA_OP, reason="needs a GPU and attnkit._C built with CUDA")


def _inputs(B=3, H=4, L=13, D=8, dtype=torch.float32, lengths=(13, 7, 1), seed=0, device="cpu"):
    """Random q, k and word ids: [special] words of 1-3 pieces ... [special], -1 on padding."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, H, L, D, generator=g) * 1.5).to(dtype)
    k = (torch.randn(B, H, L, D, generator=g) * 1.5).to(dtype)
    lengths = torch.tensor(lengths, dtype=torch.int64)
    wid = torch.full((B, L), -1, dtype=torch.int32)
    W = 0
    for b in range(B):
        n = int(lengths[b])
        w, t = 0, 1
        while t < n - 1:
            pieces = int(torch.randint(1, 4, (1,), generator=g))
            for _ in range(pieces):
                if t < n - 1:
                    wid[b, t] = w
                    t += 1
            w += 1
        W = max(W, w)
    return q.to(device), k.to(device), lengths.to(device), wid.to(device), W


def _loops(q, k, lengths, wid, W, scaling):
    """Clark's definition, directly: attention from word i to word j = mean over pieces p of i of the sum
    over pieces t of j of A[p, t]."""
    B, H, L, _ = q.shape
    words = torch.zeros(B, H, W, W, dtype=torch.float64)
    for b in range(B):
        n = int(lengths[b])
        A = torch.softmax(q[b, :, :n].double() @ k[b, :, :n].double().transpose(-1, -2) * scaling, -1)
        for i in range(W):
            pi = [p for p in range(n) if wid[b, p] == i]
            for j in range(W):
                tj = [t for t in range(n) if wid[b, t] == j]
                if pi and tj:
                    words[b, :, i, j] = A[:, pi][:, :, tj].sum(-1).mean(-1)
    return words


def test_reference_matches_clarks_definition():
    q, k, lengths, wid, W = _inputs()
    ref = reference_word_attention(q, k, lengths, wid, W, 0.35)
    torch.testing.assert_close(ref.words.double(), _loops(q, k, lengths, wid, W, 0.35), atol=1e-6, rtol=1e-5)
    # rows of words with pieces: sum of attention to all words + to special tokens = 1, so <= 1
    assert float(ref.words.sum(-1).max()) <= 1 + 1e-6


def test_reference_row_argmax_excludes_own_word_and_special_tokens():
    # one sample, 1 head: tokens [CLS] a a b [SEP]; word 0 = tokens 1,2; word 1 = token 3
    L = 5
    q = torch.zeros(1, 1, L, 2)
    k = torch.zeros(1, 1, L, 2)
    q[..., 0] = 1.0
    k[0, 0, :, 0] = torch.tensor([9.0, 5.0, 5.0, 1.0, 9.0])  # [CLS]/[SEP] get most, then word 0's pieces
    wid = torch.tensor([[-1, 0, 0, 1, -1]], dtype=torch.int32)
    ref = reference_word_attention(q, k, torch.tensor([L]), wid, 2, 1.0)
    A = torch.softmax(k[0, 0, :, 0], 0)
    assert ref.row_word[0, 0].tolist() == [0, 1, 1, 0, 0]  # own word excluded, specials never chosen
    torch.testing.assert_close(ref.row_weight[0, 0, 1], A[3])
    torch.testing.assert_close(ref.row_weight[0, 0, 0], A[1] + A[2])
    torch.testing.assert_close(ref.words[0, 0, 0, 1], A[3])  # mean over the two identical rows of word 0


def test_reference_ties_take_lowest_word_and_padding_rows_have_none():
    L = 6
    q = torch.zeros(1, 1, L, 2)
    k = torch.zeros(1, 1, L, 2)  # uniform attention: every word of one piece ties
    wid = torch.tensor([[-1, 0, 1, 2, -1, 2]], dtype=torch.int32)
    ref = reference_word_attention(q, k, torch.tensor([5]), wid, 3, 1.0)
    assert ref.row_word[0, 0].tolist() == [0, 1, 0, 0, 0, -1]
    assert float(ref.row_weight[0, 0, 5]) == 0.0


@needs_cpu_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_op_matches_reference(dtype):
    q, k, lengths, wid, W = _inputs(dtype=dtype, lengths=(13, 8, 1))
    got = word_attention(q, k, lengths, wid, W, scaling=0.4, backend="fused")
    ref = reference_word_attention(q, k, lengths, wid, W, 0.4)
    assert got.words.dtype == torch.float32 and got.row_weight.dtype == torch.float32
    assert got.row_word.dtype == torch.int64
    torch.testing.assert_close(got.words, ref.words, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(got.row_weight, ref.row_weight, atol=2e-6, rtol=1e-5)
    assert torch.equal(got.row_word, ref.row_word)
    assert int((got.row_word[2] >= 0).sum()) == 0  # n = 1: only a special token, no candidate word


@needs_cpu_op
def test_cpu_op_long_rows_span_several_tiles():
    q, k, lengths, wid, W = _inputs(B=2, H=2, L=150, D=16, lengths=(150, 97), seed=3)
    got = word_attention(q, k, lengths, wid, W, backend="fused")
    ref = reference_word_attention(q, k, lengths, wid, W, 16 ** -0.5)
    torch.testing.assert_close(got.words, ref.words, atol=2e-6, rtol=1e-5)
    assert torch.equal(got.row_word, ref.row_word)


@needs_cpu_op
def test_fake_kernel_gives_shapes():
    q, k, lengths, wid, W = _inputs()
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fq, fk, fl, fw = (mode.from_tensor(t) for t in (q, k, lengths, wid))
        words, row_word, row_weight = torch.ops.attnkit.word_attention(fq, fk, fl, fw, W, 0.5)
    assert tuple(words.shape) == (3, 4, W, W) and words.dtype == torch.float32
    assert tuple(row_word.shape) == (3, 4, 13) and row_word.dtype == torch.int64


@needs_cpu_op
def test_cpu_op_refuses_word_ids_out_of_range():
    q, k, lengths, wid, W = _inputs()
    with pytest.raises(RuntimeError, match="word_id must lie in"):
        torch.ops.attnkit.word_attention(q, k, lengths, wid, W - 1, 0.5)


def test_wrapper_refuses_bad_inputs():
    q, k, lengths, wid, W = _inputs()
    with pytest.raises(AttnkitError, match=r"word ids must lie in \[-1, 2\)"):
        word_attention(q, k, lengths, wid, 2)
    with pytest.raises(AttnkitError, match="word_id must be B×L"):
        word_attention(q, k, lengths, wid[:, :5], W)
    with pytest.raises(AttnkitError, match="lengths must be"):
        word_attention(q, k, torch.tensor([13, 0, 1]), wid, W)
    with pytest.raises(AttnkitError, match="unknown backend"):
        word_attention(q, k, lengths, wid, W, backend="magic")


def test_reference_backend_runs_without_the_extension():
    q, k, lengths, wid, W = _inputs()
    got = word_attention(q, k, lengths, wid, W, backend="reference")
    torch.testing.assert_close(got.words.double(), _loops(q, k, lengths, wid, W, 8 ** -0.5), atol=1e-6, rtol=1e-5)


@needs_cuda_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_op_matches_reference(dtype):
    q, k, lengths, wid, W = _inputs(B=3, H=4, L=77, D=32, dtype=dtype, lengths=(77, 40, 1), device="cuda")
    got = word_attention(q, k, lengths, wid, W, backend="fused")
    ref = reference_word_attention(q, k, lengths, wid, W, 32 ** -0.5)
    torch.testing.assert_close(got.words, ref.words, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got.row_weight, ref.row_weight, atol=1e-5, rtol=1e-4)
    # arg-max may differ only where two words' weights are within rounding of each other
    differ = got.row_word != ref.row_word
    if differ.any():
        gap = (ref.row_weight - got.row_weight).abs()[differ]
        assert float(gap.max()) < 1e-5


@needs_cuda_op
def test_cuda_op_matches_cpu_op():
    q, k, lengths, wid, W = _inputs(B=2, H=3, L=300, D=64, lengths=(300, 123), seed=5)
    cpu = word_attention(q, k, lengths, wid, W, backend="fused")
    gpu = word_attention(q.cuda(), k.cuda(), lengths.cuda(), wid.cuda(), W, backend="fused")
    torch.testing.assert_close(gpu.words.cpu(), cpu.words, atol=1e-5, rtol=1e-4)
