"""Encoder–decoders through attnkit attention (docs/seq2seq.md), on tiny random-weight BART, Marian, T5 and Whisper
built here (tests/synthetic.py: tiny_seq2seq): the three kinds of layers numbered (encoder, decoder, cross), hidden
states and maps on request against the same model with eager attention, with padded sources and targets (right and
left); features of attnkit's own (source, target) batches against features counted from eager's maps (encoder and
decoder self-attention: features_from_maps; cross-attention: cross_features_from_maps); interventions (zero, uniform,
gates) against eager with the heads' output columns changed; head caches; the refusals."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import attnkit
from attnkit.errors import AttnkitError
from attnkit.features import CLS, OTHER, SEP
from attnkit.models import attention_modules, layer_kinds, runtime_of
from attnkit.tokens import Batch

from .synthetic import (
    SEQ2SEQ_KINDS,
    CallCounter,
    alignment_from_maps,
    cross_features_from_maps,
    features_from_maps,
    tiny_seq2seq,
)

VOCAB, H, D = 120, 4, 8
SOURCE = [7, 5, 2]
TARGET = [5, 3, 1]
FRAMES = 8  # Whisper's encoder positions (16 mel frames)
NW = 4


def padded(lengths, side: str, seed: int, eos: int = 2):
    """Random ids (an EOS inside the first sample) for `lengths`, padded on `side` with 0, and their mask."""
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), L), generator=g)
    ids[0, min(3, lengths[0] - 1)] = eos
    mask = (torch.arange(L)[None] < torch.tensor(lengths)[:, None]).long()
    if side == "left":
        mask = mask.flip(1)
        for b, n in enumerate(lengths):
            ids[b] = ids[b].roll(L - n)
    return ids * mask, mask


def inputs(kind: str, side: str) -> dict:
    """A batch of three (source, target) pairs padded on `side` (Whisper: a source of mel frames, no padding)."""
    tgt, tmask = padded(TARGET, side, 2)
    out = {"decoder_input_ids": tgt, "decoder_attention_mask": tmask}
    if kind == "whisper":
        g = torch.Generator().manual_seed(1)
        out["input_features"] = torch.randn(len(TARGET), 8, 2 * FRAMES, generator=g)
    else:
        out["input_ids"], out["attention_mask"] = padded(SOURCE, side, 1)
    return out


def source_lengths(kind: str) -> list[int]:
    return [FRAMES] * len(TARGET) if kind == "whisper" else SOURCE


@pytest.fixture(scope="module", params=SEQ2SEQ_KINDS)
def pair(request):
    """(kind, eager model, the same weights with attnkit attention)"""
    eager = tiny_seq2seq(request.param)
    return request.param, eager, attnkit.instrument(copy.deepcopy(eager))


def test_layers_are_numbered_by_kind(pair):
    kind, _, ours = pair
    assert layer_kinds(ours) == [("encoder", 0), ("encoder", 1), ("decoder", 0), ("decoder", 1), ("cross", 0),
                                 ("cross", 1)]
    mods = attention_modules(ours)
    assert [m.attnkit_layer for m in mods] == list(range(6))
    assert [getattr(m, "is_causal", False) for m in mods] == [False, False, True, True, False, False]
    # transformers' own numbering (the decoder's caches read it) is left alone
    assert [m.layer_idx for m in mods] == [0, 1, 0, 1, 0, 1]
    assert attnkit.Intervention.for_model(ours).shape == (6, H)


def own_positions(mask):
    return mask.bool()


@pytest.mark.parametrize("side", ["right", "left"])
def test_hidden_states_and_maps_equal_eager(pair, side):
    kind, eager, ours = pair
    x = inputs(kind, side)
    with torch.no_grad(), runtime_of(ours).attached(CallCounter()) as counter:
        e = eager(**x, output_attentions=True, output_hidden_states=True)
        o = ours(**x, output_attentions=True, output_hidden_states=True)
    assert counter.calls == 6  # every layer of every kind went through attnkit
    tv = x["decoder_attention_mask"].bool()
    sv = x["attention_mask"].bool() if "attention_mask" in x else torch.ones(len(TARGET), FRAMES, dtype=torch.bool)
    for a, b in zip(e.encoder_hidden_states, o.encoder_hidden_states):
        if a.shape[1] == sv.shape[1]:
            torch.testing.assert_close(b[sv], a[sv], atol=2e-5, rtol=1e-5)
    for a, b in zip(e.decoder_hidden_states, o.decoder_hidden_states):
        torch.testing.assert_close(b[tv], a[tv], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(o.logits[tv], e.logits[tv], atol=2e-5, rtol=1e-5)
    for name, rows, keys in (("encoder_attentions", sv, sv), ("decoder_attentions", tv, tv),
                             ("cross_attentions", tv, sv)):
        for a, b in zip(getattr(e, name), getattr(o, name)):
            assert b.shape == a.shape
            both = (rows[:, None, :, None] & keys[:, None, None, :]).expand_as(a)
            torch.testing.assert_close(b[both], a[both], atol=1e-6, rtol=1e-5)
            assert float(b[~keys[:, None, None, :].expand_as(b)].abs().sum()) == 0.0  # no weight on padding
            if side == "left":  # rows of left padding: 0 (eager gives them a meaningless spread)
                assert float(b[~rows[:, None, :, None].expand_as(b)].abs().sum()) == 0.0
    for b in o.decoder_attentions:
        assert float(torch.triu(b, diagonal=1).abs().sum()) == 0.0  # causal


def classes_of(ids, lengths, eos: int):
    """Token classes of a right-padded batch: CLS on each sample's first position, SEP on EOS tokens."""
    cls = torch.full(ids.shape, OTHER, dtype=torch.int32)
    cls[ids == eos] = SEP
    cls[:, 0] = CLS
    cls[torch.arange(ids.shape[1])[None] >= torch.tensor(lengths)[:, None]] = OTHER
    return cls


def seq2seq_batch(kind: str) -> Batch:
    """attnkit's batch of a (source, target) pair batch, right-padded: the source's lengths and token classes, the
    target's in `target`."""
    x = inputs(kind, "right")
    eos = 1 if kind == "t5" else 2
    tgt = x["decoder_input_ids"]
    target = Batch({}, torch.tensor(TARGET), classes_of(tgt, TARGET, eos), torch.zeros(tgt.shape, dtype=torch.int32),
                   0)
    n = source_lengths(kind)
    if kind == "whisper":
        src_cls = torch.full((len(n), FRAMES), OTHER, dtype=torch.int32)
        src_cls[:, 0] = CLS
    else:
        src_cls = classes_of(x["input_ids"], n, eos)
    return Batch(x, torch.tensor(n), src_cls, torch.zeros(src_cls.shape, dtype=torch.int32), 0, target)


def test_features_equal_those_of_eager_maps(pair):
    kind, eager, ours = pair
    from attnkit.engine.forward import forward_features, measuring

    batch = seq2seq_batch(kind)
    with measuring(ours, backend="auto", num_windows=NW):
        feats = forward_features(ours, batch).numpy()
    assert feats.shape == (3, 6, H, 5 + NW + 7 + 2)  # the alignment features last, every kind
    with torch.no_grad():
        e = eager(**batch.inputs, output_attentions=True)
    src, tgt = source_lengths(kind), TARGET
    sc, tc = batch.token_class.numpy(), batch.target.token_class.numpy()
    zeros_s, zeros_t = np.zeros_like(sc), np.zeros_like(tc)
    enc = features_from_maps([a.numpy() for a in e.encoder_attentions], src, sc, zeros_s, NW)
    dec = features_from_maps([a.numpy() for a in e.decoder_attentions], tgt, tc, zeros_t, NW)
    cross = np.stack([cross_features_from_maps(a.numpy(), tgt, src, tc, sc, NW) for a in e.cross_attentions], 1)
    align = np.stack([alignment_from_maps(a.numpy(), src) for a in e.encoder_attentions]
                     + [alignment_from_maps(a.numpy(), tgt) for a in e.decoder_attentions]
                     + [alignment_from_maps(a.numpy(), tgt, src) for a in e.cross_attentions], 1)
    want = np.concatenate([np.concatenate([enc, dec, cross], 1), align], -1)
    np.testing.assert_allclose(feats, want, atol=1e-5)
    np.testing.assert_allclose(feats[..., :5 + NW].sum(-1), 1.0, atol=1e-5)


def output_projection(module):
    return module.o if hasattr(module, "o") else module.out_proj


def eager_with_heads_scaled(eager, ours, heads: dict):
    """A copy of `eager` whose heads {(attnkit layer, head): factor} have their output columns scaled: what a zeroed
    head (0) or a gate does."""
    cut = copy.deepcopy(eager)
    names = {id(m): name for name, m in ours.named_modules()}
    theirs = dict(cut.named_modules())
    mods = attention_modules(ours)
    with torch.no_grad():
        for (layer, h), factor in heads.items():
            proj = output_projection(theirs[names[id(mods[layer])]])
            proj.weight[:, h * D:(h + 1) * D] *= factor
    return cut


def test_interventions_and_head_caches(pair):
    kind, eager, ours = pair
    x = inputs(kind, "right")
    tv = x["decoder_attention_mask"].bool()
    # a zeroed head of each kind: eager with its output columns zeroed
    iv = attnkit.Intervention.from_heads(ours, "L0H1,L3H2,L4H0", mode="zero")
    want = eager_with_heads_scaled(eager, ours, {(0, 1): 0.0, (3, 2): 0.0, (4, 0): 0.0})
    with attnkit.intervene(ours, iv), torch.no_grad():
        got = ours(**x).logits
        ref = want(**x).logits
    torch.testing.assert_close(got[tv], ref[tv], atol=2e-5, rtol=1e-5)
    # gates on cross-attention heads: eager with those columns scaled
    gates = torch.ones(6, H)
    gates[5, 1], gates[4, 3] = 0.5, 2.0
    iv = attnkit.Intervention.for_model(ours).with_gates(gates, requires_grad=False)
    want = eager_with_heads_scaled(eager, ours, {(5, 1): 0.5, (4, 3): 2.0})
    with attnkit.intervene(ours, iv), torch.no_grad():
        got = ours(**x).logits
        ref = want(**x).logits
    torch.testing.assert_close(got[tv], ref[tv], atol=2e-5, rtol=1e-5)
    # a uniform cross-attention head: every target row spreads over its source's tokens
    iv = attnkit.Intervention.from_heads(ours, "L5H2", mode="uniform")
    with attnkit.intervene(ours, iv), torch.no_grad():
        maps = ours(**x, output_attentions=True).cross_attentions[1]
    for b, n in enumerate(source_lengths(kind)):
        want_row = torch.zeros(maps.shape[-1])
        want_row[:n] = 1.0 / n
        torch.testing.assert_close(maps[b, 2], want_row.expand_as(maps[b, 2]))
    # cached head outputs: patching a cross head with its own output changes nothing
    with attnkit.cache_heads(ours) as cache, torch.no_grad():
        plain = ours(**x).logits
    assert cache[4].shape == (3, max(TARGET), H, D) and cache[0].shape[1] == max(source_lengths(kind))
    iv = attnkit.Intervention.for_model(ours).set(4, 1, mode="patch", value=cache[4][:, :, 1])
    with attnkit.intervene(ours, iv), torch.no_grad():
        patched = ours(**x).logits
    torch.testing.assert_close(patched, plain)


def test_regions_on_cross_attention_and_observers_are_refused_by_name(pair):
    kind, _, ours = pair
    x = inputs(kind, "right")
    iv = attnkit.Intervention.from_heads(ours, "L4H0", mode="keep", region="no_inter")
    with attnkit.intervene(ours, iv), pytest.raises(AttnkitError, match="not defined on cross-attention"):
        ours(**x)
    with attnkit.models.observing(ours, [lambda *a: None]), pytest.raises(AttnkitError, match="does not support"):
        ours(**x)


def test_generation_with_a_cache_equals_eager(pair):
    kind, eager, ours = pair
    x = {k: v[:1] for k, v in inputs(kind, "right").items() if not k.startswith("decoder")}
    kw = dict(max_new_tokens=4, do_sample=False, use_cache=True)
    with torch.no_grad():
        want = eager.generate(**x, **kw)
        got = ours.generate(**x, **kw)
    torch.testing.assert_close(got, want)


def test_an_encoder_decoder_not_instrumented_is_refused_by_name():
    model = tiny_seq2seq("bart")
    model.set_attn_implementation("attnkit")
    x = inputs("bart", "right")
    with pytest.raises(AttnkitError, match="not instrumented: call attnkit.instrument"):
        model(**x)


def test_gate_gradients_of_every_kind_equal_eagers(pair):
    """Michel et al.'s importance on an encoder–decoder: the gradient of a loss with respect to each head's gate, on
    all three kinds, equals eager's with the same gates multiplied into the heads' outputs (hooks on the output
    projections)."""
    kind, eager, ours = pair
    x = inputs(kind, "right")
    tv = x["decoder_attention_mask"].bool()
    g = torch.Generator().manual_seed(4)
    start = torch.rand(6, H, generator=g) + 0.5
    iv = attnkit.Intervention.for_model(ours).with_gates(start)
    with attnkit.intervene(ours, iv):
        ours(**x).logits[tv].logsumexp(-1).sum().backward()
    gates = start.clone().requires_grad_(True)
    names = {id(m): name for name, m in ours.named_modules()}
    theirs = dict(eager.named_modules())
    hooks = []
    for layer, mod in enumerate(attention_modules(ours)):
        def gate(module, args, layer=layer):
            h = args[0].unflatten(-1, (H, D)) * gates[layer].view(H, 1)
            return (h.flatten(-2),)

        hooks.append(output_projection(theirs[names[id(mod)]]).register_forward_pre_hook(gate))
    try:
        eager(**x).logits[tv].logsumexp(-1).sum().backward()
    finally:
        for h in hooks:
            h.remove()
        eager.zero_grad()
        ours.zero_grad()
    torch.testing.assert_close(iv.gates.grad, gates.grad, atol=1e-4, rtol=1e-4)
    assert float(iv.gates.grad[4:].abs().sum()) > 0  # cross-attention heads matter


def test_iterative_pruning_of_one_kind_prunes_only_that_kind_by_importance():
    """Michel et al.'s per-kind pruning curves (examples/michel_seq2seq.py): `among` restricts iterative pruning to
    the cross-attention heads of an encoder–decoder; each step zeroes the cross head of least importance under the
    heads pruned so far (checked against head_importance itself), the shares are of the 8 cross heads, and the
    encoder and decoder heads are never touched."""
    from attnkit.ablation import head_importance, iterative_pruning
    from attnkit.features import KEEP

    ours = attnkit.instrument(tiny_seq2seq("marian"))
    x = inputs("marian", "right")
    losses = lambda: (ours(**{k: v[i:i + 1] for k, v in x.items()}).logits.logsumexp(-1).mean() for i in range(3))
    among = np.array([k == "cross" for k, _ in layer_kinds(ours)])[:, None].repeat(H, 1)
    seen = []

    def evaluate(iv):
        seen.append(iv.copy())
        return {"zeroed": int((iv.mode != KEEP).sum())}

    res = iterative_pruning(ours, evaluate, losses, step=0.25, among=among)
    assert [s["pruned"] for s in res["steps"]] == [0, 2, 4, 6, 8]
    assert [s["share"] for s in res["steps"]] == [0, 0.25, 0.5, 0.75, 1.0]
    assert [s["metrics"]["zeroed"] for s in res["steps"]] == [0, 2, 4, 6, 8]
    assert sorted(res["steps"][-1]["heads"]) == [(l, h) for l in (4, 5) for h in range(H)]
    assert all((iv.mode[~among] == KEEP).all() for iv in seen)
    before = attnkit.Intervention.for_model(ours)
    for s in res["steps"][1:]:  # each step's two heads: the least important cross heads under the mask before it
        imp = head_importance(ours, losses, before)["importance"]
        expect = sorted(np.argsort(np.where(among & (before.mode == KEEP), imp, np.inf), axis=None, kind="stable")[:2])
        new = [lh for lh in s["heads"] if before.mode[lh] == KEEP]
        assert sorted(int(np.ravel_multi_index(lh, among.shape)) for lh in new) == [int(i) for i in expect]
        before.set_heads(new, mode="zero")
    with pytest.raises(AttnkitError, match="boolean array"):
        iterative_pruning(ours, evaluate, losses, among=among[:2])
    with pytest.raises(AttnkitError, match="boolean array"):
        iterative_pruning(ours, evaluate, losses, among=among.astype(int))
    with pytest.raises(AttnkitError, match="no head to prune"):
        iterative_pruning(ours, evaluate, losses, among=np.zeros_like(among))


def tokens_first(maps, row_mask, key_mask):
    """Eager's maps (B × H × rows × keys) with each sample's tokens moved to the front along rows and keys (left
    padding), as features_from_maps reads them."""
    out = maps.clone()
    for b in range(maps.shape[0]):
        r, k = int((~row_mask[b]).sum()), int((~key_mask[b]).sum())
        out[b] = maps[b].roll((-r, -k), (1, 2)) if row_mask[b, 0] == 0 or key_mask[b, 0] == 0 else maps[b]
    return out


@pytest.mark.parametrize("side", ["right", "left"])
def test_tracking_a_plain_forward_counts_every_kind(pair, side):
    """attnkit.track on an encoder–decoder: a plain forward (each sample's first token CLS; the target's rows from its
    decoder_attention_mask) gives every layer of every kind the features counted from eager's maps, with sources and
    targets padded on either side."""
    kind, eager, ours = pair
    x = inputs(kind, side)
    tracked = ("entropy", "cls", "self", "max", "win_0", "next", "align_offset", "align_near")
    with attnkit.track(ours, features=tracked) as tracker, torch.no_grad():
        ours(**x)
        got = {k: v.numpy() for k, v in tracker.read().items()}
    with torch.no_grad():
        e = eager(**x, output_attentions=True)
    tm = x["decoder_attention_mask"].bool()
    sm = x["attention_mask"].bool() if "attention_mask" in x else torch.ones(len(TARGET), FRAMES, dtype=torch.bool)
    e.encoder_attentions = [tokens_first(a, sm, sm) for a in e.encoder_attentions]
    e.decoder_attentions = [tokens_first(a, tm, tm) for a in e.decoder_attentions]
    e.cross_attentions = [tokens_first(a, tm, sm) for a in e.cross_attentions]
    src, tgt = source_lengths(kind), TARGET
    nw = 16
    first = np.zeros((3, max(max(src), max(tgt))), dtype=np.int32)
    first[:, 0] = CLS
    sc, tc = first[:, :max(src)], first[:, :max(tgt)]
    want = np.concatenate([
        features_from_maps([a.numpy() for a in e.encoder_attentions], src, sc, np.zeros_like(sc), nw),
        features_from_maps([a.numpy() for a in e.decoder_attentions], tgt, tc, np.zeros_like(tc), nw),
        np.stack([cross_features_from_maps(a.numpy(), tgt, src, tc, sc, nw) for a in e.cross_attentions], 1)], 1)
    align = np.stack([alignment_from_maps(a.numpy(), src) for a in e.encoder_attentions]
                     + [alignment_from_maps(a.numpy(), tgt) for a in e.decoder_attentions]
                     + [alignment_from_maps(a.numpy(), tgt, src) for a in e.cross_attentions], 1)
    want = np.concatenate([want, align], -1)
    names = attnkit.feature_names(nw, alignment=True)
    for name, values in got.items():
        np.testing.assert_allclose(values, want[..., names.index(name)].mean(0), atol=1e-5, err_msg=name)
