"""Intervention builders, `intervene` restoring the model, identity = plain model, gradients to gates."""
import json

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertModel

import attnkit
from attnkit import AttnkitError, Intervention
from attnkit.features import KEEP, NO_INTER, NO_INTRA, UNIFORM, ZERO
from attnkit.interventions import load_clusters, parse_heads
from attnkit.models import runtime_of
from attnkit.reference import reference_attention

from .conftest import write_clusters_json


def test_parse_heads():
    assert parse_heads("L2H5, l3h0,L2H5") == [(2, 5), (3, 0)]
    assert parse_heads("L1", shape=(3, 2)) == [(1, 0), (1, 1)]
    assert parse_heads([(0, 1), [2, 0]]) == [(0, 1), (2, 0)]
    for bad in ("2.5", "L2H", "H5", "L2H5x"):
        with pytest.raises(AttnkitError, match="L<layer>H<head>"):
            parse_heads(bad)
    with pytest.raises(AttnkitError, match="outside"):
        parse_heads("L3H0", shape=(3, 2))
    with pytest.raises(AttnkitError, match="whole layer"):
        parse_heads("L1")


def test_builders():
    iv = Intervention.from_heads((3, 4), "L0H1,L2H3", mode="uniform", region="no_inter")
    expected = np.zeros((3, 4), int)
    expected[0, 1] = expected[2, 3] = UNIFORM
    assert (iv.mode == expected).all()
    assert (iv.region == np.where(expected > 0, NO_INTER, 0)).all()
    assert iv.changed_heads() == [(0, 1), (2, 3)]
    lay = Intervention.from_layers((3, 4), [1, 2])
    assert (lay.mode[0] == KEEP).all() and (lay.mode[1:] == UNIFORM).all()
    assert Intervention.from_layers((3, 4), 0, mode="zero").mode[0].tolist() == [ZERO] * 4
    assert "zero: L0H0" in Intervention.from_layers((3, 4), 0, mode="zero").describe()
    assert Intervention.identity(2, 2).describe() == "keep all"
    c = iv.copy()
    c.set(1, 1, mode="zero")
    assert iv.mode[1, 1] == KEEP  # copies are independent
    g = iv.with_gates()
    assert g.gates.requires_grad and tuple(g.gates.shape) == (3, 4) and iv.gates is None
    with pytest.raises(AttnkitError, match="unknown mode"):
        Intervention.from_heads((3, 4), "L0H0", mode="drop")


def test_load_clusters(tmp_path):
    grid = [["diagonal", "vertical", "diagonal"], ["vertical", "diagonal", "vertical"]]
    run = write_clusters_json(tmp_path / "run", grid)
    ht = load_clusters(run, shape=(2, 3))
    assert ht.types == ["diagonal", "vertical"]
    assert ht.heads("vertical") == [(0, 1), (1, 0), (1, 2)]
    assert load_clusters(run / "clusters.json").counts() == {"diagonal": 3, "vertical": 3}
    iv = Intervention.from_types((2, 3), ht, ["vertical"], mode="zero")
    assert iv.changed_heads() == [(0, 1), (1, 0), (1, 2)]
    assert Intervention.from_types((2, 3), ht, "diagonal", region="no_intra").region[0, 0] == NO_INTRA
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "clusters.json").write_text(json.dumps({"heads": []}))
    with pytest.raises(AttnkitError, match="clusters.json: missing .version., .settings., .run."):
        load_clusters(tmp_path / "other")
    with pytest.raises(AttnkitError, match="but the model has 1 × 3"):
        load_clusters(run, shape=(1, 3))
    with pytest.raises(AttnkitError, match="missing: run `attnkit cluster"):
        load_clusters(tmp_path / "missing")
    with pytest.raises(AttnkitError, match="covers|clusters cover"):
        Intervention.from_types((3, 3), ht, "vertical")
    with pytest.raises(AttnkitError, match="no heads of type"):
        ht.heads("dense")


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                     max_position_embeddings=32, attn_implementation="eager")
    plain = BertModel(cfg).eval()
    inst = BertModel(cfg).eval()
    inst.load_state_dict(plain.state_dict())
    attnkit.instrument(inst)
    ids = torch.randint(5, 50, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    mask[2, 4:] = 0
    return plain, inst, {"input_ids": ids, "attention_mask": mask}


def test_keep_everything_equals_plain_model(tiny):
    plain, inst, inputs = tiny
    with torch.no_grad():
        ref = plain(**inputs).last_hidden_state
        bare = inst(**inputs).last_hidden_state
        with attnkit.intervene(inst, Intervention.for_model(inst)):
            kept = inst(**inputs).last_hidden_state
        with attnkit.intervene(inst, Intervention.for_model(inst).with_gates(requires_grad=False)):
            gated = inst(**inputs).last_hidden_state
    assert torch.equal(kept, bare)  # identity intervention = no intervention, bit for bit
    assert torch.equal(gated, bare)  # gates of 1 change nothing
    valid = inputs["attention_mask"].bool()
    torch.testing.assert_close(kept[valid], ref[valid], atol=2e-5, rtol=1e-4)  # vs transformers' eager


def test_intervene_restores_even_on_error(tiny):
    _, inst, inputs = tiny
    rt = runtime_of(inst)
    with torch.no_grad():
        before = inst(**inputs).last_hidden_state
    with pytest.raises(RuntimeError, match="boom"):
        with attnkit.intervene(inst, Intervention.from_layers(inst, [0, 1], mode="zero")):
            with torch.no_grad():
                changed = inst(**inputs).last_hidden_state
            assert not torch.allclose(changed, before)
            raise RuntimeError("boom")
    assert rt.intervention is None
    with torch.no_grad():
        assert torch.equal(inst(**inputs).last_hidden_state, before)
    with pytest.raises(AttnkitError, match="layers"):
        with attnkit.intervene(inst, Intervention.identity(3, 4)):
            pass
    with pytest.raises(AttnkitError, match="heads per layer"):
        with attnkit.intervene(inst, Intervention.identity(2, 5)):
            pass


def test_zero_mode_equals_zero_gate(tiny):
    _, inst, inputs = tiny
    gates = torch.ones(2, 4)
    gates[1, 2] = 0
    with torch.no_grad():
        with attnkit.intervene(inst, Intervention.from_heads(inst, "L1H2", mode="zero")):
            a = inst(**inputs).last_hidden_state
        with attnkit.intervene(inst, Intervention.for_model(inst).with_gates(gates, requires_grad=False)):
            b = inst(**inputs).last_hidden_state
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_gate_gradients_in_the_reference():
    torch.manual_seed(1)
    B, H, L, D = 2, 3, 5, 4
    q, k, v = (torch.randn(B, H, L, D, requires_grad=True) for _ in range(3))
    lengths = torch.tensor([5, 3])
    gates = torch.tensor([1.0, 0.5, 2.0], requires_grad=True)
    out, _ = reference_attention(q, k, v, lengths, gates=gates)
    w = torch.randn_like(out)
    (out * w).sum().backward()
    # d/dg_h of Σ w·(g_h·o_h) = Σ w·o_h, o_h the ungated head output
    o, _ = reference_attention(q.detach(), k.detach(), v.detach(), lengths)
    expected = (o * w).sum(dim=(0, 1, 3))
    torch.testing.assert_close(gates.grad, expected)
    assert q.grad is not None and k.grad.abs().sum() > 0 and v.grad.abs().sum() > 0


def test_gate_gradients_through_the_model(tiny):
    _, inst, inputs = tiny
    iv = Intervention.from_heads(inst, "L0H3", mode="zero").with_gates()
    w = torch.randn(3, 9, 32, generator=torch.Generator().manual_seed(3))
    with attnkit.intervene(inst, iv):
        loss = (inst(**inputs).last_hidden_state * w).sum()
    (grad,) = torch.autograd.grad(loss, iv.gates)
    assert grad[0, 3] == 0  # a zeroed head's gate does not matter
    assert (grad.abs().flatten()[[i for i in range(8) if i != 3]] > 0).all()
    # finite difference on one gate
    eps = 1e-2
    g = iv.gates.detach().clone()

    def f(delta):
        gg = g.clone()
        gg[1, 1] += delta
        with torch.no_grad(), attnkit.intervene(inst, iv.with_gates(gg, requires_grad=False)):
            return (inst(**inputs).last_hidden_state.double() * w).sum()

    fd = (f(eps) - f(-eps)) / (2 * eps)
    assert float(grad[1, 1]) == pytest.approx(float(fd), rel=2e-2, abs=1e-4)


def test_heads_layers_and_shapes_must_be_whole_numbers():
    from attnkit.interventions import Intervention, parse_heads

    for spec in ([("a", "b")], [(1.7, 2.2)], [(True, 1)], [(-1, 0)]):
        with pytest.raises(AttnkitError, match=r"^a head must be a \(layer, head\) pair of integers >= 0"):
            parse_heads(spec)
    assert parse_heads([(np.int64(1), None)], (2, 3)) == [(1, 0), (1, 1), (1, 2)]
    with pytest.raises(AttnkitError, match=r"^n_layers must be a positive integer, got 0$"):
        Intervention.identity(0, 12)
    with pytest.raises(AttnkitError, match=r"^n_heads must be a positive integer, got 2.5$"):
        Intervention.identity(2, 2.5)
    iv = Intervention.identity(2, 3)
    for layer, head in ((1.5, 0), (1, 0.5), ("1", 0)):
        with pytest.raises(AttnkitError, match=r"^layer and head must be integers >= 0"):
            iv.set(layer, head, mode="zero")
    assert iv.is_identity
