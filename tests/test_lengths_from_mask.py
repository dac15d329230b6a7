"""hf_attention.lengths_from_mask: lengths stay on the mask's device; bad masks are refused eagerly and
asserted on the device (no host read) while compiling."""
import pytest
import torch

from attnkit.errors import AttnkitError
from attnkit.hf_attention import lengths_from_mask


def test_lengths_and_refusals():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    lengths = lengths_from_mask(mask, 2, 4, "cpu")
    assert lengths.tolist() == [3, 4] and lengths.dtype == torch.int64
    assert lengths_from_mask(mask, 2, 4, "cpu") is lengths  # one computation per mask object (per forward)
    assert lengths_from_mask(None, 2, 4, "cpu").tolist() == [4, 4]
    with pytest.raises(AttnkitError, match="right-padded"):
        lengths_from_mask(torch.tensor([[0, 1, 1, 1]]), 1, 4, "cpu")
    with pytest.raises(AttnkitError, match="no unmasked token"):
        lengths_from_mask(torch.tensor([[1, 1], [0, 0]]), 2, 2, "cpu")
    with pytest.raises(AttnkitError, match="2-D padding mask"):
        lengths_from_mask(torch.ones(1, 1, 4, 4), 1, 4, "cpu")


def test_compiled_check_is_a_device_assertion():
    def f(mask):
        return lengths_from_mask(mask, mask.shape[0], mask.shape[1], mask.device) * 1

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert compiled(torch.tensor([[1, 1, 0], [1, 0, 0]])).tolist() == [2, 1]
    with pytest.raises(RuntimeError, match="right-padded"):
        compiled(torch.tensor([[0, 1, 1], [1, 0, 0]]))


def test_padding_of_takes_left_padding_and_refuses_gaps():
    from attnkit.hf_attention import padding_of, rolled

    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]])
    lengths, offsets = padding_of(mask, 3, 4, "cpu")
    assert lengths.tolist() == [2, 3, 4] and offsets.tolist() == [2, 0, 0]
    x = torch.arange(12).view(3, 4)
    moved = rolled(x, offsets, 1)
    assert moved.tolist() == [[2, 3, 0, 1], [4, 5, 6, 7], [8, 9, 10, 11]]  # tokens first, padding behind
    assert torch.equal(rolled(moved, offsets, 1, back=True), x)
    assert padding_of(torch.tensor([[1, 1, 0]]), 1, 3, "cpu")[1] is None  # right padding: nothing to move
    with pytest.raises(AttnkitError, match="each sample's tokens in one run"):
        padding_of(torch.tensor([[1, 0, 1]]), 1, 3, "cpu")
    with pytest.raises(AttnkitError, match="no unmasked token"):
        padding_of(torch.tensor([[1, 1], [0, 0]]), 2, 2, "cpu")
