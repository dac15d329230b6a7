"""The op's arguments as one object (attnkit.reference.AttentionParams) and what the op's wrapper makes of them on
every call (attnkit.ops): the fast constructor builds what the dataclass builds, and the conversion for the
compiled kernels converts what needs it, keeps what does not, and changes no number."""
import dataclasses

import pytest
import torch

from attnkit import ops
from attnkit.reference import AttentionParams

B, H, L, D = 2, 4, 7, 8


def _given():
    g = torch.Generator().manual_seed(0)
    return {"mode": torch.tensor([0, 1, 0, 2]), "region": torch.zeros(H, dtype=torch.int64),
            "gates": torch.rand(H, generator=g, dtype=torch.float64), "scaling": 0.3, "num_windows": 5,
            "want_features": True, "key_scale": torch.rand(B, H, L, generator=g), "causal": 1,
            "sliding_window": 4, "softcap": 30, "sink": torch.randn(H, generator=g),
            "grid": torch.zeros(B, L, 2, dtype=torch.int64), "alignment": True}


@pytest.mark.parametrize("keys", [(), ("want_features",), ("mode", "gates", "causal"), tuple(_given())])
def test_of_builds_what_the_dataclass_builds(keys):
    given = _given()
    tc, sid = torch.zeros(B, L, dtype=torch.int64), torch.ones(B, L, dtype=torch.int32)
    kw = {name: given[name] for name in keys}
    fast, slow = AttentionParams.of(tc, sid, **kw), AttentionParams(tc, sid, **kw)
    assert type(fast) is AttentionParams
    for f in dataclasses.fields(AttentionParams):
        assert getattr(fast, f.name) is getattr(slow, f.name), f.name
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.causal = True


def test_of_refuses_an_unknown_name_as_the_dataclass_does():
    with pytest.raises(TypeError, match="causl"):
        AttentionParams.of(None, None, causl=True)
    with pytest.raises(TypeError, match="causl"):
        ops.attention(*(torch.zeros(1, 1, 2, 4) for _ in range(3)), torch.tensor([2]), causl=True)


def test_the_kernels_arguments_are_converted_only_where_needed():
    given = _given()
    tc32 = torch.zeros(B, L, dtype=torch.int32)
    gates = given["gates"].clone().requires_grad_()
    p = AttentionParams.of(tc32, torch.zeros(B, L, dtype=torch.int64), **{**given, "gates": gates})
    q = torch.zeros(B, H, L, D)
    k = ops._for_kernels(p, q)
    assert k.token_class is tc32  # already int32 on q's device: the same tensor
    assert k.sentence_id.dtype == torch.int32 and torch.equal(k.sentence_id, p.sentence_id.int())
    assert k.mode.dtype == k.region.dtype == torch.int32 and torch.equal(k.mode, p.mode.int())
    assert k.gates is gates and k.gates.dtype == torch.float64  # a gate that needs a gradient keeps its dtype
    assert k.key_scale is p.key_scale and k.sink is p.sink  # fp32 already
    assert k.grid.dtype == torch.int32 and k.alignment is True
    assert (k.causal, k.softcap, k.scaling) == (True, 30.0, 0.3) and type(k.softcap) is float
    assert p.mode.dtype == torch.int64  # the caller's object is left as it was
    # without features the grid and alignment change nothing: the kernels are not given them
    k = ops._for_kernels(dataclasses.replace(p, want_features=False), q)
    assert k.grid is None and k.alignment is False
    k = ops._for_kernels(AttentionParams.of(None, None), q)
    assert k.scaling == D ** -0.5 and all(t is None for t in k.tensors())
    # a gate without a gradient is converted to fp32 as the schema takes it
    assert ops._for_kernels(AttentionParams.of(None, None, gates=given["gates"]), q).gates.dtype == torch.float32


@pytest.mark.skipif(not ops.has_kernel("cpu"), reason="the compiled CPU kernel is not built")
def test_classes_of_any_integer_dtype_give_the_same_numbers():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))
    n = torch.tensor([L, 4])
    tc = torch.randint(0, 4, (B, L), generator=g)
    outs = [ops.attention(q, k, v, n, tc.to(dtype), want_features=True, backend="fused",
                          mode=torch.tensor([0, 1, 0, 2], dtype=dtype)) for dtype in (torch.int64, torch.int32)]
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    ref = ops.attention(q, k, v, n, tc, want_features=True, backend="reference", mode=torch.tensor([0, 1, 0, 2]))
    torch.testing.assert_close(outs[0][1], ref[1], rtol=1e-4, atol=1e-5)
