"""Generation with a KV cache on attnkit models (docs/decoders.md, "Generation"): each step has fewer queries than
keys (attnkit/reference.py, "Fewer queries than keys"). Greedy tokens equal eager's on tiny random decoders
(tests/synthetic.py), without padding and left-padded as generate pads; the maps of generated tokens equal eager's;
interventions apply at every step (equal to eager with the same change made by hand, and to attnkit without the
cache); regions and attnkit's own batches are refused by name. The embedded SmolLM2 in a slow test."""
from __future__ import annotations

import copy

import pytest
import torch

import attnkit
from attnkit.errors import AttnkitError

from .synthetic import tiny_decoder

VOCAB = 120
KINDS = ("llama", "qwen2", "gpt2", "mistral", "gemma2", "gpt_oss")  # qwen2, mistral, gemma2, gpt-oss: windows of 5
KW = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)


def prompts(padded: bool):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, VOCAB, (3, 8), generator=g)
    mask = torch.ones_like(ids)
    if padded:  # left padding, as generate pads decoders
        mask[1, :3] = 0
        mask[2, :6] = 0
    return {"input_ids": ids * mask, "attention_mask": mask}


@pytest.fixture(scope="module", params=KINDS)
def pair(request):
    eager = tiny_decoder(request.param)
    return eager, attnkit.instrument(copy.deepcopy(eager))


@pytest.mark.parametrize("padded", [False, True])
def test_greedy_tokens_with_the_cache_equal_eagers(pair, padded):
    eager, ours = pair
    enc = prompts(padded)
    want = eager.generate(**enc, **KW)
    got = ours.generate(**enc, **KW)  # the default: a KV cache
    assert torch.equal(got, want)
    assert torch.equal(ours.generate(**enc, use_cache=False, **KW), want)


def test_maps_of_generated_tokens_equal_eagers(pair):
    eager, ours = pair
    enc = prompts(True)
    kw = dict(KW, max_new_tokens=4, output_attentions=True, return_dict_in_generate=True)
    want, got = eager.generate(**enc, **kw), ours.generate(**enc, **kw)
    assert torch.equal(got.sequences, want.sequences)
    mask = torch.cat([enc["attention_mask"], torch.ones(3, 4, dtype=torch.long)], 1)
    for step, (a, b) in enumerate(zip(got.attentions, want.attentions)):
        for x, y in zip(a, b):
            Lk = x.shape[-1]
            assert x.shape == y.shape and x.shape[2] == (8 if step == 0 else 1)
            keys = mask[:, -Lk:] if Lk < 8 + step else mask[:, :Lk]  # a window's cache keeps the last keys
            rows = keys[:, -x.shape[2]:].bool()
            sel = rows[:, None, :, None] & keys.bool()[:, None, None, :]
            torch.testing.assert_close(x[sel.expand_as(x)], y[sel.expand_as(y)], atol=2e-5, rtol=1e-5)
            assert float(x[~rows[:, None, :, None].expand_as(x)].abs().sum()) == 0.0  # padding rows: 0


def test_interventions_apply_at_every_step():
    eager = tiny_decoder("llama")
    ours = attnkit.instrument(copy.deepcopy(eager))
    enc = prompts(True)
    kw = dict(KW, max_new_tokens=12)
    plain = eager.generate(**enc, **kw)
    # a zeroed head: eager with that head's columns of the output projection zeroed
    cut = copy.deepcopy(eager)
    with torch.no_grad():
        cut.model.layers[1].self_attn.o_proj.weight[:, 2 * 8:3 * 8] = 0
        cut.model.layers[0].self_attn.o_proj.weight[:, 0:8] = 0
    want = cut.generate(**enc, **kw)
    assert not torch.equal(want, plain)
    with attnkit.intervene(ours, attnkit.Intervention.from_heads(ours, "L1H2,L0H0", mode="zero")):
        assert torch.equal(ours.generate(**enc, **kw), want)
    # composed blocks (uniform, mean, gates) with the cache equal attnkit without it
    mean = torch.randn(8, generator=torch.Generator().manual_seed(3))
    outer = attnkit.Intervention.from_heads(ours, "L0H1", mode="uniform").with_gates(torch.full((2, 4), 0.7),
                                                                                     requires_grad=False)
    inner = attnkit.Intervention.for_model(ours).set(1, 3, mode="mean", value=mean)
    with attnkit.intervene(ours, outer), attnkit.intervene(ours, inner):
        cached = ours.generate(**enc, **kw)
        recomputed = ours.generate(**enc, use_cache=False, **kw)
    assert torch.equal(cached, recomputed)
    assert not torch.equal(cached, plain)


def test_refusals_by_name():
    ours = attnkit.instrument(tiny_decoder("llama"))
    enc = prompts(False)
    iv = attnkit.Intervention.from_heads(ours, "L0H0", mode="keep", region="no_inter")
    with attnkit.intervene(ours, iv), pytest.raises(AttnkitError, match="region interventions need the sentence of "
                                                                        "every key, which a step of generation"):
        ours.generate(**enc, **KW)
    # a region intervention without the cache still works
    with attnkit.intervene(ours, iv):
        ours.generate(**enc, use_cache=False, **dict(KW, max_new_tokens=2))
    from attnkit.hf_attention import attnkit_attention

    mod = ours.model.layers[0].self_attn
    q, kv = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 2, 8)
    with pytest.raises(AttnkitError, match="got 3 queries and 2 keys: attnkit measures cross-attention in the encoder–decoders"):
        attnkit_attention(mod, q, kv, kv, None, scaling=0.3)
    q, kv = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 4, 8)
    with pytest.raises(AttnkitError, match="each sample's tokens to end at the last key"):
        attnkit_attention(mod, q, kv, kv, torch.tensor([[0, 1, 1, 0]]), scaling=0.3)


def test_head_caches_hold_the_last_steps_outputs():
    ours = attnkit.instrument(tiny_decoder("llama"))
    enc = prompts(True)
    with attnkit.cache_heads(ours) as cache:
        ours.generate(**enc, **dict(KW, max_new_tokens=3))
    assert cache[0].shape == (3, 1, 4, 8)


@pytest.mark.slow
def test_smollm2_generates_eagers_tokens_with_the_cache(smollm2_cache):
    from transformers import AutoModelForCausalLM

    from attnkit.embedded import embedded_path

    lm, tok = attnkit.load_model("smollm2", task="causal-lm", device="cpu")
    eager = AutoModelForCausalLM.from_pretrained(str(embedded_path("smollm2")), attn_implementation="eager").eval()
    tok.padding_side = "left"
    enc = tok(["The capital of France is Paris. The capital of Germany is", "Water boils at"], return_tensors="pt",
              padding=True)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    want = eager.generate(**enc, **kw)
    assert torch.equal(lm.generate(**enc, **kw), want)
    assert "Berlin" in tok.decode(want[0, enc["input_ids"].shape[1]:])
