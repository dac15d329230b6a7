"""Pruning grouped-query decoders (attnkit/arch/pruning.py, docs/pruning.md): query heads leave q_proj and o_proj,
a KV head leaves k_proj and v_proj with the last query head that reads it, and the heads left map to their KV heads
(even groups through `num_key_value_groups`, uneven ones through the op's `kv_head`). Checked against the full model
with the same heads zeroed, under eager, sdpa and attnkit attention; saved and loaded; sizes; the command."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM

import attnkit
from attnkit.ablation.sizes import count_parameters, forward_flops, reference_inputs
from attnkit.arch import load_pruned_model, prune_heads, pruned_head_grid
from attnkit.arch.pruning import KV_HEAD_ATTR, GroupedKV
from attnkit.cli.main import main
from attnkit.errors import AttnkitError

from .synthetic import tiny_decoder
from .test_pruning import pruned_under, valid, zeroed_and_pruned

# 3 layers × 4 query heads, 2 KV heads (query heads 0, 1 read KV head 0; 2, 3 read KV head 1). Layer 0 keeps 1, 2, 3
# (uneven groups: KV head 0 serves one query head, KV head 1 two), layer 1 keeps 2, 3 (KV head 0 goes), layer 2 none.
HEADS = [(0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2), (2, 3)]
VOCAB = 60


def batch():
    ids = torch.randint(3, VOCAB, (3, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 2:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def with_padding(tok):
    """A copy of the decoder tokenizer that pads with EOS (the fixture has no padding token)."""
    tok = copy.deepcopy(tok)
    tok.pad_token = tok.eos_token
    return tok


def zeroed(model, heads, inputs, what="hidden"):
    """The unpruned `model` with `heads` zeroed by an attnkit Intervention: last hidden states, or logits."""
    full = attnkit.instrument(copy.deepcopy(model))
    with torch.no_grad(), attnkit.intervene(full, attnkit.Intervention.from_heads(full, heads, mode="zero")):
        out = full(**inputs, output_hidden_states=True)
    return out.hidden_states[-1] if what == "hidden" else out.logits


CASES = [(k, i) for k in ("llama", "qwen2", "mistral", "gemma2", "gpt_oss") for i in ("eager", "sdpa", "attnkit")
         if not (i == "sdpa" and k in ("gemma2", "gpt_oss"))]  # transformers has no sdpa for these two


@pytest.mark.parametrize("kind,impl", CASES)
def test_pruned_decoder_equals_the_zeroed_full_model(kind, impl):
    model = tiny_decoder(kind, n_layers=3, vocab=VOCAB)
    inputs = batch()
    expect = zeroed(model, HEADS, inputs)
    pruned = pruned_under(model, HEADS, impl)
    with torch.no_grad():
        got = pruned(**inputs, output_hidden_states=True).hidden_states[-1]
        plain = model(**inputs, output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(valid(got, inputs), valid(expect, inputs), atol=1e-5, rtol=1e-5)
    assert valid(plain - got, inputs).abs().max() > 1e-2  # pruning changed the model
    attn = [layer.self_attn for layer in pruned.model.layers]
    D = 8
    assert [a.q_proj.out_features for a in attn] == [3 * D, 2 * D, 0]
    assert [a.k_proj.out_features for a in attn] == [2 * D, D, 0] == [a.v_proj.out_features for a in attn]
    assert [a.o_proj.in_features for a in attn] == [3 * D, 2 * D, 0]
    assert getattr(attn[0], KV_HEAD_ATTR).tolist() == [0, 1, 1]  # uneven: the op's kv_head
    assert isinstance(attn[0].k_proj, GroupedKV) and attn[0].num_key_value_groups == 1
    assert not hasattr(attn[1], KV_HEAD_ATTR) and attn[1].num_key_value_groups == 2  # even: 2 heads, 1 KV head
    assert pruned.config.attnkit_heads == [[1, 2, 3], [2, 3], []]
    if kind == "gpt_oss":
        torch.testing.assert_close(attn[0].sinks.data, model.model.layers[0].self_attn.sinks.data[1:])
    assert count_parameters(pruned) < count_parameters(model)


def test_pruning_twice_and_the_grid_of_kv_heads():
    """A second pruning counts from the unpruned numbering: layer 0 then keeps 1 and 2, one per KV head (even
    groups again: no kv_head, eager's num_key_value_groups 1)."""
    model = tiny_decoder("llama", n_layers=3, vocab=VOCAB)
    inputs = batch()
    twice = prune_heads(prune_heads(copy.deepcopy(model), HEADS), [(0, 3)])
    expect = zeroed(model, HEADS + [(0, 3)], inputs)
    attn0 = twice.model.layers[0].self_attn
    assert not hasattr(attn0, KV_HEAD_ATTR) and attn0.num_key_value_groups == 1
    assert type(attn0.k_proj) is torch.nn.Linear and attn0.k_proj.out_features == 16
    for impl in ("eager", "attnkit"):
        m = attnkit.instrument(copy.deepcopy(twice)) if impl == "attnkit" else twice
        with torch.no_grad():
            got = m(**inputs, output_hidden_states=True).hidden_states[-1]
        torch.testing.assert_close(valid(got, inputs), valid(expect, inputs), atol=1e-5, rtol=1e-5)
    assert pruned_head_grid(twice).sum(1).tolist() == [2, 2, 0]
    with pytest.raises(AttnkitError, match="head L0H0 was already pruned"):
        prune_heads(twice, [(0, 0)])


def test_features_and_maps_of_a_pruned_decoder_are_those_of_the_zeroed_model(decoder_tokenizer):
    model = tiny_decoder("llama", n_layers=3, vocab=len(decoder_tokenizer))
    tok = with_padding(decoder_tokenizer)
    texts = ["the cat sat on the mat.", "a dog ran."]
    full = attnkit.instrument(copy.deepcopy(model), tok)
    pruned = attnkit.instrument(prune_heads(copy.deepcopy(model), HEADS), tok)
    with attnkit.intervene(full, attnkit.Intervention.from_heads(full, HEADS, mode="zero")):
        expect = attnkit.extract(texts, (full, tok), max_length=16)
    got = attnkit.extract(texts, (pruned, tok), max_length=16)
    removed = ~pruned_head_grid(pruned)  # no attention, so no features: NaN (docs/pruning.md)
    np.testing.assert_allclose(got.mean[~removed], expect.mean[~removed], atol=1e-5)
    assert np.isnan(got.mean[removed]).all() and removed.sum() == len(HEADS) and (got.mean[0, 1:, 0] > 0).all()
    enc = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        maps = pruned(**enc, output_attentions=True).attentions
        eager = model(**enc, output_attentions=True).attentions
    assert float(maps[0][:, 0].abs().sum()) == 0.0  # a removed head's map
    # a kept head of the uneven layer keeps its own map (rows of padding aside)
    m = enc["attention_mask"].bool()
    keep = m[:, None, :, None] & m[:, None, None, :]
    torch.testing.assert_close(maps[0][:, 1:] * keep, eager[0][:, 1:] * keep, atol=1e-5, rtol=1e-5)


def test_save_and_load_with_attnkit_and_plain_transformers(tmp_path, decoder_tokenizer):
    tok = with_padding(decoder_tokenizer)
    model = tiny_decoder("qwen2", n_layers=3, vocab=len(tok))
    inputs = dict(tok(["the cat sat on the mat.", "a dog."], padding=True, return_tensors="pt"))
    expect = zeroed(model, HEADS, inputs, "logits")
    prune_heads(copy.deepcopy(model), HEADS).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    saved = json.loads((tmp_path / "m" / "config.json").read_text())
    assert saved["attnkit_heads"] == [[1, 2, 3], [2, 3], []]
    assert (saved["num_attention_heads"], saved["num_key_value_heads"]) == (4, 2)
    plain = load_pruned_model(tmp_path / "m", AutoModelForCausalLM)
    assert plain.config._attn_implementation != "attnkit"
    loaded, _ = attnkit.load_model(tmp_path / "m", device="cpu", task="causal-lm")
    for m in (plain, loaded):
        with torch.no_grad():
            got = m(**inputs).logits
        torch.testing.assert_close(valid(got, inputs), valid(expect, inputs), atol=1e-5, rtol=1e-5)
    bare, _ = attnkit.load_model(tmp_path / "m", device="cpu")  # the base model, from the causal LM's checkpoint
    with torch.no_grad():
        hidden = bare(**inputs).last_hidden_state
        torch.testing.assert_close(valid(hidden, inputs), valid(loaded.model(**inputs).last_hidden_state, inputs))
    # transformers alone builds every layer with 4 query and 2 KV heads and refuses the smaller matrices
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "m")


def test_sizes_count_the_query_and_kv_heads_removed():
    model = tiny_decoder("llama", n_layers=3, vocab=VOCAB)
    inputs = reference_inputs(model, 2, 16)
    T, L, D, hidden = 2 * 16, 16, 8, 32
    pruned = prune_heads(copy.deepcopy(model), HEADS)
    flops = [forward_flops(m, inputs) for m in (model, pruned)]
    q_heads, kv_heads = len(HEADS), 0 + 1 + 2
    # a query head: its q and o projections 2 · 2·T·hidden·D and the two attention products 2 · 2·B·L²·D; a KV head:
    # its k and v projections 2 · 2·T·hidden·D
    assert flops[0] - flops[1] == q_heads * (4 * T * hidden * D + 4 * 2 * L * L * D) + kv_heads * 4 * T * hidden * D
    assert count_parameters(model) - count_parameters(pruned) == (q_heads + kv_heads) * 2 * hidden * D


def test_importance_experiment_on_a_decoder_measures_sizes(decoder_tokenizer):
    from attnkit.ablation import run_experiment

    tok = with_padding(decoder_tokenizer)
    model = attnkit.instrument(tiny_decoder("llama", n_layers=3, vocab=len(tok)), tok)
    enc = tok(["the cat sat on the mat.", "a big red house."], padding=True, return_tensors="pt")

    def evaluate(iv):
        with torch.no_grad(), attnkit.intervene(model, iv):
            return {"loss": float(model(**enc, labels=enc["input_ids"]).loss)}

    def losses():
        for i in range(2):
            yield model(**{k: v[i:i + 1] for k, v in enc.items()}, labels=enc["input_ids"][i:i + 1]).loss

    table = run_experiment("importance", model, evaluate, "loss", losses=losses, progress=False, n_boot=10,
                           mode="zero", step=0.25, max_share=0.5)
    inputs = reference_inputs(model)
    gone: list = []
    for r in table.rows:
        gone += attnkit.interventions.parse_heads(r["newly_pruned"], (3, 4)) if r["newly_pruned"] else []
        pruned = prune_heads(copy.deepcopy(model), gone)
        assert r["params"] == count_parameters(pruned), r
        assert r["flops_per_token"] == forward_flops(pruned, inputs) / inputs["input_ids"].numel(), r
    assert table.rows[2]["params"] < table.rows[0]["params"]


def test_prune_command_on_a_decoder_and_fused_layouts_refused(tmp_path, decoder_tokenizer):
    src = tmp_path / "llama"
    tiny_decoder("llama", n_layers=3, vocab=len(decoder_tokenizer)).save_pretrained(src)
    decoder_tokenizer.save_pretrained(src)
    res = CliRunner().invoke(main, ["prune", str(src), "--heads", "L0H0,L1H0,L1H1", "-o", str(tmp_path / "p"), "-q"],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    model, _ = attnkit.load_model(tmp_path / "p", device="cpu", task="causal-lm")
    assert isinstance(model, torch.nn.Module) and model.config.attnkit_heads == [[1, 2, 3], [2, 3], [0, 1, 2, 3]]
    assert type(model).__name__ == "LlamaForCausalLM"  # the LM head kept
    with pytest.raises(AttnkitError, match="pruning heads of a 'gpt2' model is not supported.*not fused ones"):
        prune_heads(tiny_decoder("gpt2"), [(0, 1)])


@pytest.mark.slow
def test_pruned_smollm2_equals_it_zeroed(smollm2):
    """SmolLM2-135M (9 query heads on 3 KV heads): layer 0 loses one query head (uneven groups), layer 5 a whole KV
    group, layer 29 two heads of different groups. Hidden states equal the zeroed model's; KV rows go only with
    the whole group."""
    model, tok = smollm2
    heads = [(0, 4), (5, 0), (5, 1), (5, 2), (29, 1), (29, 7)]
    enc = tok(["The bridge was long, and the river below was wide.", "Short."], padding=True, return_tensors="pt")
    expect, got, pruned = zeroed_and_pruned(model, heads, enc)
    scale = expect.abs().max().item()
    assert valid(got - expect, enc).abs().max().item() <= 1e-5 * scale
    attn = {l: pruned.layers[l].self_attn for l in (0, 5, 29)}  # the fixture is the base model
    assert [attn[l].k_proj.out_features // 64 for l in (0, 5, 29)] == [3, 2, 3]
    assert getattr(attn[0], KV_HEAD_ATTR).tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
    assert count_parameters(model) - count_parameters(pruned) == (6 + 1) * 2 * 576 * 64
