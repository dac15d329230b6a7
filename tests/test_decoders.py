"""Decoder language models through attnkit attention (docs/decoders.md), on tiny random-weight configs built here
(tests/synthetic.py: Llama, Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3, GPT-2, GPT-NeoX, Phi-3, gpt-oss): hidden
states and maps on request against the same model with eager attention, with right and left padding; features
against features computed here from eager's maps (tests/synthetic.py: features_from_maps); norm weighting against
value vectors taken from the projections here; interventions, head caches, the refusals (unknown attention
arguments, pruning, text pairs); generation with and without a KV cache."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import attnkit
from attnkit.errors import AttnkitError
from attnkit.features import CLS, OTHER, SEP
from attnkit.models import attention_modules, runtime_of
from attnkit.tokens import Batch

from .synthetic import DECODER_KINDS, CallCounter, features_from_maps, tiny_decoder

VOCAB = 120
LENGTHS = [9, 6, 3]
EOS = 2


def inputs(side: str = "right"):
    """Random ids (an EOS inside the first sample) for LENGTHS, padded on `side` with 0."""
    g = torch.Generator().manual_seed(1)
    L = max(LENGTHS)
    ids = torch.randint(3, VOCAB, (len(LENGTHS), L), generator=g)
    ids[0, 5] = EOS
    mask = (torch.arange(L)[None] < torch.tensor(LENGTHS)[:, None]).long()
    if side == "left":
        ids, mask = ids.roll(0), mask.flip(1)
        for b, n in enumerate(LENGTHS):
            ids[b] = ids[b].roll(L - n)
    return ids * mask, mask


@pytest.fixture(scope="module", params=DECODER_KINDS)
def pair(request):
    """(eager model, the same weights with attnkit attention)"""
    eager = tiny_decoder(request.param)
    return eager, attnkit.instrument(copy.deepcopy(eager))


@pytest.mark.parametrize("side", ["right", "left"])
def test_hidden_states_and_maps_equal_eager(pair, side):
    eager, ours = pair
    ids, mask = inputs(side)
    with torch.no_grad(), runtime_of(ours).attached(CallCounter()) as counter:
        e = eager(input_ids=ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
        o = ours(input_ids=ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
    assert counter.calls == ours.config.num_hidden_layers  # every layer went through attnkit
    valid = mask.bool()
    for a, b in zip(e.hidden_states, o.hidden_states):
        torch.testing.assert_close(b[valid], a[valid], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(o.logits[valid], e.logits[valid], atol=2e-5, rtol=1e-5)
    both = (valid[:, None, :, None] & valid[:, None, None, :])
    assert len(o.attentions) == len(e.attentions) == ours.config.num_hidden_layers
    for a, b in zip(e.attentions, o.attentions):
        assert b.shape == a.shape
        torch.testing.assert_close(b[both.expand_as(a)], a[both.expand_as(a)], atol=1e-6, rtol=1e-5)
        keys = valid[:, None, None, :].expand_as(b)
        assert float(b[~keys].abs().sum()) == 0.0  # no weight on padding
        if side == "left":  # rows of left padding: 0 (eager gives them a meaningless spread)
            assert float(b[~valid[:, None, :, None].expand_as(b)].abs().sum()) == 0.0
        # causal: nothing above the diagonal
        assert float(torch.triu(b, diagonal=1).abs().sum()) == 0.0


def batch_of(ids, mask):
    """An attnkit Batch of a right-padded batch: CLS on each sample's first position, SEP on EOS tokens."""
    lengths = mask.sum(-1)
    cls = torch.full(ids.shape, OTHER, dtype=torch.int32)
    cls[ids == EOS] = SEP
    cls[:, 0] = CLS
    return Batch({"input_ids": ids, "attention_mask": mask}, lengths, cls, torch.zeros(ids.shape, dtype=torch.int32), 0)


def test_features_equal_those_of_eager_maps(pair):
    eager, ours = pair
    from attnkit.engine.forward import forward_features, measuring

    ids, mask = inputs("right")
    batch = batch_of(ids, mask)
    nw = 4
    with measuring(ours, backend="auto", num_windows=nw):
        feats = forward_features(ours, batch).numpy()
    with torch.no_grad():
        maps = [a.numpy() for a in eager(input_ids=ids, attention_mask=mask, output_attentions=True).attentions]
    sink = eager.config.model_type == "gpt_oss"
    want = features_from_maps(maps, LENGTHS, batch.token_class.numpy(), batch.sentence_id.numpy(), nw, sink=sink)
    assert feats.shape == want.shape
    np.testing.assert_allclose(feats, want, atol=2e-5)
    assert attnkit.models.model_feature_names(ours, nw) == attnkit.feature_names(nw, sink=sink)
    buckets = feats[..., :5 + nw].sum(-1) + (feats[..., -1] if sink else 0)
    np.testing.assert_allclose(buckets, 1.0, atol=1e-5)


def value_vectors(model, ids, mask):
    """Per layer, B × H × L × D value vectors of each query head (its KV head's), taken from the projections
    with hooks and split as each architecture lays them out, independently of attnkit.arch."""
    cfg = model.config
    kind, H = cfg.model_type, cfg.num_attention_heads
    Hkv = getattr(cfg, "num_key_value_heads", H) or H
    D = cfg.hidden_size // H if kind in ("gpt2", "gpt_neox") else cfg.head_dim
    got, hooks = [], []

    def keep(split):
        return lambda mod, args, out: got.append(split(out))

    for name, mod in model.named_modules():
        if kind == "gpt2" and name.endswith("attn.c_attn"):
            split = lambda out: out[..., 2 * H * D:].unflatten(-1, (H, D))
        elif kind == "gpt_neox" and name.endswith("query_key_value"):
            split = lambda out: out.unflatten(-1, (H, 3 * D))[..., 2 * D:]
        elif kind == "phi3" and name.endswith("qkv_proj"):
            split = lambda out: out[..., (H + Hkv) * D:].unflatten(-1, (Hkv, D))
        elif name.endswith("v_proj"):
            split = lambda out: out.unflatten(-1, (Hkv, D))
        else:
            continue
        hooks.append(mod.register_forward_hook(keep(split)))
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    for h in hooks:
        h.remove()
    per_query = [v.transpose(1, 2)[:, [h // (H // v.shape[2]) for h in range(H)]] for v in got]
    return per_query, [a for a in out.attentions]


def output_weights(model):
    """Per layer the output projection as hidden × (H·D) (GPT-2's Conv1D transposed)."""
    out = []
    for name, mod in model.named_modules():
        if name.endswith(("attn.c_proj", "self_attn.o_proj", "attention.dense")):
            out.append(mod.weight.t() if model.config.model_type == "gpt2" else mod.weight)
    return out


@pytest.mark.parametrize("kind", ["llama", "gpt2", "gpt_neox", "phi3"])
def test_norm_weighting_uses_each_query_heads_kv_values_and_output_slice(kind):
    eager = tiny_decoder(kind)
    ours = attnkit.instrument(copy.deepcopy(eager))
    from attnkit.engine.forward import forward_features, measuring

    ids, mask = inputs("right")
    batch = batch_of(ids, mask)
    with measuring(ours, num_windows=4, weighting="norm"):
        feats = forward_features(ours, batch).numpy()
    values, maps = value_vectors(eager, ids, mask)
    W = output_weights(eager)
    H = eager.config.num_attention_heads
    weighted = []
    for v, a, w in zip(values, maps, W):
        D = v.shape[-1]
        f = torch.stack([v[:, h] @ w[:, h * D:(h + 1) * D].T for h in range(H)], 1)  # B × H × L × hidden
        scaled = a * f.norm(dim=-1)[:, :, None, :]
        weighted.append((scaled / scaled.sum(-1, keepdim=True).clamp_min(1e-30)).detach().numpy())
    want = features_from_maps(weighted, LENGTHS, batch.token_class.numpy(), batch.sentence_id.numpy(), 4)
    np.testing.assert_allclose(feats, want, atol=2e-5)


def test_interventions_and_head_caches():
    eager = tiny_decoder("llama")
    ours = attnkit.instrument(copy.deepcopy(eager))
    ids, mask = inputs("left")
    iv = attnkit.Intervention.from_heads(ours, "L0H1", mode="uniform")
    with attnkit.intervene(ours, iv), torch.no_grad():
        maps = ours(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    # a uniform head of a causal layer: 1/(s+1) over the s+1 keys row s sees (left padding: from the first token)
    for b, n in enumerate(LENGTHS):
        o = ids.shape[1] - n
        want = torch.tril(torch.ones(n, n)) / torch.arange(1, n + 1)[:, None]
        torch.testing.assert_close(maps[0][b, 1, o:, o:], want)
    # a zeroed head equals eager with its columns of the output projection zeroed
    cut = copy.deepcopy(eager)
    with torch.no_grad():
        cut.model.layers[1].self_attn.o_proj.weight[:, 2 * 8:3 * 8] = 0
        want = cut(input_ids=ids, attention_mask=mask).logits
    with attnkit.intervene(ours, attnkit.Intervention.from_heads(ours, "L1H2", mode="zero")), torch.no_grad():
        got = ours(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=2e-5, rtol=1e-5)
    # cached head outputs are in the batch's own positions: patching a head with them changes nothing
    with attnkit.cache_heads(ours) as cache, torch.no_grad():
        ours(input_ids=ids, attention_mask=mask)
    out = cache[0]
    assert out.shape == (3, ids.shape[1], 4, 8)
    assert float(out[2, :ids.shape[1] - LENGTHS[2]].abs().sum()) == 0.0  # left padding rows: 0


def test_unknown_attention_arguments_are_refused_by_name():
    from attnkit.hf_attention import attnkit_attention

    model = attnkit.instrument(tiny_decoder("llama"))
    mod = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 3, 8)
    kv = torch.randn(1, 2, 3, 8)
    out, _ = attnkit_attention(mod, q, kv, kv, None, scaling=0.3, position_ids=torch.arange(3)[None], use_cache=True)
    assert out.shape == (1, 3, 4, 8)
    with pytest.raises(AttnkitError, match="LlamaAttention passes 'cu_seq_lens_q' to its attention function, which "
                                           "attnkit does not know"):
        attnkit_attention(mod, q, kv, kv, None, scaling=0.3, cu_seq_lens_q=torch.tensor([0, 3]))


def test_generation_with_and_without_a_cache():  # more in tests/test_generation.py
    eager = tiny_decoder("qwen2")
    ours = attnkit.instrument(copy.deepcopy(eager))
    ids = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    want = eager.generate(ids, **kw)
    assert torch.equal(ours.generate(ids, use_cache=False, **kw), want)
    assert torch.equal(ours.generate(ids, use_cache=True, **kw), want)


def test_pruning_a_fused_projection_is_refused_by_name():
    from attnkit.arch import prune_heads

    for kind in ("gpt2", "gpt_neox", "phi3"):  # the Llama family is pruned: tests/test_pruning_decoders.py
        with pytest.raises(AttnkitError, match=f"pruning heads of a '{kind}' model is not supported"):
            prune_heads(tiny_decoder(kind), [(0, 1)])


def test_region_interventions_find_sentences_in_left_padded_batches():
    """Sentence ids of a plain forward come from its input_ids (EOS closes a segment); with left padding they are
    found on the samples' own tokens, so a region intervention acts as on the right-padded batch."""
    model = attnkit.instrument(tiny_decoder("llama"))
    iv = attnkit.Intervention.from_heads(model, "L0H0,L1H3", mode="keep", region="no_inter")
    outs = {}
    for side in ("right", "left"):
        ids, mask = inputs(side)
        with attnkit.intervene(model, iv), torch.no_grad():
            outs[side] = model(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    with torch.no_grad():
        ids, mask = inputs("right")
        plain = model(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    torch.testing.assert_close(outs["left"], outs["right"], atol=2e-5, rtol=1e-5)
    assert (outs["right"] - plain).abs().max() > 1e-3  # sample 0's EOS splits it: the intervention acts


@pytest.mark.parametrize("side", ["right", "left"])
def test_training_with_attention_dropout_equals_eager(side):
    """Attention dropout in training: right-padded, the same dropout mask as eager's (one B×H×L×L dropout in the
    same order), so the same outputs and maps. Left-padded, the mask falls on the moved tokens, so only the
    structure is eager's: causal maps, nothing on padding."""
    eager = tiny_decoder("mistral")
    eager.config.attention_dropout = 0.3
    for m in eager.modules():
        if hasattr(m, "attention_dropout"):
            m.attention_dropout = 0.3
    ours = attnkit.instrument(copy.deepcopy(eager))
    ids, mask = inputs(side)
    valid = mask.bool()
    got = {}
    for name, model in (("eager", eager), ("ours", ours)):
        model.train()
        torch.manual_seed(5)
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
        got[name] = out
    both = (valid[:, None, :, None] & valid[:, None, None, :]).expand_as(got["eager"].attentions[0])
    if side == "left":
        for a in got["ours"].attentions:
            assert float(a[~both].abs().sum()) == 0.0 and float(torch.triu(a, diagonal=1).abs().sum()) == 0.0
            assert (a[both] == 0).any() and (a[both] > 0).any()  # dropped and kept weights
        return
    torch.testing.assert_close(got["ours"].logits[valid], got["eager"].logits[valid], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got["ours"].attentions[1][both], got["eager"].attentions[1][both])


def test_distances_use_the_decoders_attention_and_other_observers_are_refused():
    """The JS distance collector recomputes each layer's weights with the decoder's arguments (here gpt-oss:
    causal, grouped KV heads, windows, sinks): its distances equal those of eager's maps. An observer that cannot
    take them is refused by name rather than measuring attention the model does not compute."""
    from attnkit.engine.distances import DistanceCollector, js_distances

    eager = tiny_decoder("gpt_oss")
    ours = attnkit.instrument(copy.deepcopy(eager))
    ids, mask = inputs("right")
    collector = DistanceCollector(2, use_op=False)
    with attnkit.models.observing(ours, [collector]), torch.no_grad():
        ours(input_ids=ids, attention_mask=mask)
    with torch.no_grad():
        maps = eager(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    want, n = js_distances(torch.cat(maps, 1), mask.sum(-1), use_op=False)
    assert collector.result().n_rows == n == sum(LENGTHS)
    np.testing.assert_allclose(collector.sum, want.numpy(), rtol=1e-5, atol=1e-6)

    def plain(layer, query, key, lengths, scaling):
        pass

    with attnkit.models.observing(ours, [plain]), pytest.raises(
            AttnkitError, match=r"an observer of q and k \(test_distances_use_the_decoders_attention_and_other_"
                                r"observers_are_refused.<locals>.plain\) does not take a decoder's attention"):
        ours(input_ids=ids, attention_mask=mask)


def test_extraction_builds_no_kv_cache(pair):
    """A decoder's forward keeps a KV cache by default (2 tensors per layer); extraction never reads it, so its
    forward asks for none (use_cache=False): no attention layer is handed a cache to fill. (The forward ends at the
    last attention layer, so the model's output, which would show the cache, is never made.)"""
    _, ours = pair
    from transformers.cache_utils import Cache

    from attnkit.engine.forward import forward_features, measuring

    seen = []

    def record(mod, args, kwargs):  # the cache's keyword is named differently across transformers versions
        seen.append(next((v for v in (*args, *kwargs.values()) if isinstance(v, Cache)), None))

    hooks = [m.register_forward_pre_hook(record, with_kwargs=True) for m in attention_modules(ours)]
    try:
        ids, mask = inputs("right")
        with torch.no_grad():
            default = ours(input_ids=ids, attention_mask=mask).past_key_values
        n = len(seen)
        with measuring(ours, backend="auto"):
            forward_features(ours, batch_of(ids, mask))
    finally:
        for h in hooks:
            h.remove()
    assert default is not None and all(c is default for c in seen[:n])  # the model would build one, for each layer
    assert len(seen) == 2 * n and seen[n:] == [None] * n
