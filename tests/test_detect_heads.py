"""attnkit.detect_heads and `attnkit detect-heads` (docs/analysis.md, "Detecting heads of decoders"): scores
from the row_stats op against scores recomputed from eager attention maps of the same input_ids, on tiny random
Llama and Qwen2 models (grouped-query attention)."""
import copy
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from transformers import AutoConfig, AutoModelForCausalLM

import attnkit
from attnkit import AttnkitError
from attnkit.cli.main import main
from attnkit.jobs.detect import repeat_targets, repeated_tokens, retrieval_inputs

from .test_ablation_tasks import tokenizer  # noqa: F401


def tiny_decoder(kind: str, vocab: int, seed: int = 0):
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(kind, vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                               attn_implementation="eager")
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # sharper attention than the init's near-uniform rows, so that heads differ
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)
    return model


def eager_scores(model, ids: torch.Tensor, offset: int, R: int) -> dict:
    """previous, duplicate, induction per (layer, head) from the eager maps, as TransformerLens would."""
    with torch.no_grad():
        maps = model(input_ids=ids, output_attentions=True).attentions  # per layer B×H×L×L
    out = {}
    s = torch.arange(offset + R, offset + 2 * R)
    for kind, back in (("previous", 1), ("duplicate", R), ("induction", R - 1)):
        out[kind] = np.array([[float(a[:, h, s, s - back].mean()) for h in range(a.shape[1])] for a in maps])
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_scores_equal_those_of_eager_maps(kind, tokenizer):  # noqa: F811
    eager = tiny_decoder(kind, tokenizer.vocab_size)
    model = attnkit.instrument(copy.deepcopy(eager))
    rng = np.random.default_rng(3)
    r = torch.from_numpy(rng.integers(5, tokenizer.vocab_size, size=(5, 12)))
    ids = torch.cat([r, r], 1)
    df = attnkit.detect_heads((model, tokenizer), input_ids=ids)
    assert list(df.columns) == ["layer", "head", "previous", "duplicate", "induction"] and len(df) == 8
    want = eager_scores(eager, ids, 0, 12)
    for k in want:
        got = df[k].to_numpy().reshape(2, 4)
        assert np.abs(got - want[k]).max() <= 1e-4, k
        assert got.std() > 1e-3  # the heads differ: a wrong target would show


def test_random_sequences_are_repeated_after_the_bos(roberta_tokenizer):
    ids, offset = repeated_tokens(roberta_tokenizer, 7, 4, seed=1)
    assert offset == 1 and ids.shape == (4, 15) and (ids[:, 0] == roberta_tokenizer.bos_token_id).all()
    assert torch.equal(ids[:, 1:8], ids[:, 8:])
    assert not set(ids[:, 1:].flatten().tolist()) & set(roberta_tokenizer.all_special_ids)
    again, _ = repeated_tokens(roberta_tokenizer, 7, 4, seed=1)
    assert torch.equal(ids, again)
    t = repeat_targets("induction", 4, 1, 7)
    assert t[0, :8].eq(-1).all() and t[0, 8].item() == 2 and t[0, 14].item() == 8
    # the function's own inputs: the same scores as eager maps of them
    eager = tiny_decoder("llama", len(roberta_tokenizer), seed=2)
    model = attnkit.instrument(copy.deepcopy(eager))
    df = attnkit.detect_heads((model, roberta_tokenizer), length=7, n_sequences=4, seed=1)
    want = eager_scores(eager, ids, 1, 7)
    assert np.abs(df["induction"].to_numpy().reshape(2, 4) - want["induction"]).max() <= 1e-4


def test_retrieval_scores_count_argmax_on_the_needle(tokenizer):  # noqa: F811
    eager = tiny_decoder("llama", tokenizer.vocab_size)
    model = attnkit.instrument(copy.deepcopy(eager))
    corpus = ["a man is playing the guitar. the dog is eating on the river. a cat is riding a horse. "
              "the old city is big. who does the child see in paris?"] * 3
    ids, expected = retrieval_inputs(tokenizer, corpus, 3, seed=0, haystack=40)
    assert all(int((e >= 0).sum()) == 6 for e in expected)
    for i, e in zip(ids, expected):  # the expected key holds the token the row predicts next
        rows = torch.nonzero(e >= 0).flatten()
        assert torch.equal(i[e[rows]], i[rows + 1])
    df = attnkit.detect_heads((model, tokenizer), kinds=["retrieval"], n_sequences=3, corpus=corpus, haystack=40)
    hits = np.zeros((2, 4))
    for i, e in zip(ids, expected):
        with torch.no_grad():
            maps = eager(input_ids=i[None], output_attentions=True).attentions
        rows = torch.nonzero(e >= 0).flatten()
        for layer, a in enumerate(maps):
            hits[layer] += (a[0, :, rows].argmax(-1) == e[rows]).sum(-1).numpy()
    assert np.allclose(df["retrieval"].to_numpy().reshape(2, 4), hits / 18)


def test_refusals(tokenizer, minilm):  # noqa: F811
    model = attnkit.instrument(tiny_decoder("llama", tokenizer.vocab_size))
    with pytest.raises(AttnkitError, match="unknown head kind"):
        attnkit.detect_heads((model, tokenizer), kinds=["sinks"])
    with pytest.raises(AttnkitError, match="input_ids"):
        attnkit.detect_heads((model, tokenizer), input_ids=torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(AttnkitError, match="causal"):
        attnkit.detect_heads(minilm)


def test_command_writes_heads_csv_and_meta(tokenizer, tmp_path):  # noqa: F811
    path = tmp_path / "model"
    tiny_decoder("qwen2", tokenizer.vocab_size).save_pretrained(path)
    tokenizer.save_pretrained(path)
    out = tmp_path / "run"
    res = CliRunner().invoke(main, ["detect-heads", str(path), "-o", str(out), "--length", "8", "--sequences", "3"])
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("previous: L")
    assert "detect-heads: 100%" in res.stderr and "3/3" in res.stderr  # progress of the sequences scored
    rows = (out / "detected_heads.csv").read_text().splitlines()
    assert rows[0] == "layer,head,previous,duplicate,induction" and len(rows) == 9
    meta = json.loads((out / "detected_heads.json").read_text())
    assert meta["length"] == 8 and meta["n_sequences"] == 3 and meta["bos"] is None
    again = CliRunner().invoke(main, ["detect-heads", str(path), "-o", str(out)])
    assert again.exit_code != 0 and "overwrite" in again.output


def test_detected_heads_do_not_collide_with_an_ablation_of_heads(tokenizer, tmp_path):  # noqa: F811
    # detect-heads wrote heads.csv and heads.meta.json, the names of `ablate --experiment heads -o RUN`'s table:
    # into a run holding that ablation it was refused, or with --overwrite replaced the ablation's files
    path = tmp_path / "model"
    tiny_decoder("llama", tokenizer.vocab_size).save_pretrained(path)
    tokenizer.save_pretrained(path)
    out = tmp_path / "run"
    out.mkdir()
    ablation = {"heads.csv": "setting,layer,head\n", "heads.meta.json": '{"experiment": "heads"}',
                "heads.json": '{"experiment": "heads", "main_metric": "loss", "rows": [{"setting": "baseline"}]}'}
    for name, text in ablation.items():
        (out / name).write_text(text)
    res = CliRunner().invoke(main, ["detect-heads", str(path), "-o", str(out), "--length", "4", "--sequences", "2"])
    assert res.exit_code == 0, res.output
    assert {n: (out / n).read_text() for n in ablation} == ablation
    assert (out / "detected_heads.csv").read_text().startswith("layer,head,previous,duplicate,induction\n")


@pytest.mark.parametrize("where", ["is the model", "lies inside the model"])
def test_an_output_that_is_an_input_is_refused_before_torch_loads(where, tmp_path):
    from .test_cli_startup import _start

    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (model / name).write_text("{}")
    corpus = tmp_path / "c.txt"
    corpus.write_text("a text\n")
    out = model if where == "is the model" else model / "scores"
    res, proc = _start("detect-heads", str(model), "--kinds", "retrieval", "--corpus", str(corpus), "-o", str(out))
    assert res["code"] != 0 and res["heavy"] == [], (res, proc.stderr)
    assert f"{where}" in proc.stderr and not (model / "scores").exists()


def test_inputs_longer_than_the_model_s_positions_are_refused(tokenizer):  # noqa: F811
    # a model with learned positions failed deep inside; one with rotary positions was measured past its context
    model = attnkit.instrument(tiny_decoder("llama", tokenizer.vocab_size))  # 256 positions
    with pytest.raises(AttnkitError, match=r"the repeated sequences \(2 × 200 tokens\) take 400 tokens, more than "
                                           r"the model's 256 positions \(llama\): lower length"):
        attnkit.detect_heads((model, tokenizer), length=200, n_sequences=1)
    with pytest.raises(AttnkitError, match="take 258 tokens, more than the model's 256 positions"):
        attnkit.detect_heads((model, tokenizer), input_ids=torch.zeros(1, 258, dtype=torch.long))
    with pytest.raises(AttnkitError, match="needle-in-a-haystack inputs take .* the retrieval recipe needs a model"):
        attnkit.detect_heads((model, tokenizer), kinds=["retrieval"], n_sequences=1, haystack=300)
    assert len(attnkit.detect_heads((model, tokenizer), length=128, n_sequences=1)) == 8  # 256 tokens fit


def test_the_observer_refuses_a_bidirectional_window_it_would_measure_as_one_sided():
    """row_stats computes causal and one-sided windows; a layer with symmetric_window (ModernBERT's local layers) is
    refused by name, not measured as a different attention than the model's."""
    from attnkit.jobs.detect import _Observer

    obs = _Observer(1, 2, ["previous"])
    obs.targets = {"previous": torch.zeros(1, 4, dtype=torch.int64)}
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(AttnkitError, match="bidirectional sliding window"):
        obs(0, q, q, torch.tensor([4]), 8 ** -0.5, causal=False, sliding_window=2, symmetric_window=True)
    obs(0, q, q, torch.tensor([4]), 8 ** -0.5, causal=True, sliding_window=2)  # a one-sided window is measured
    s = (q @ q.transpose(-1, -2)) * 8 ** -0.5
    pos = torch.arange(4)
    s = s.masked_fill((pos[None] > pos[:, None]) | (pos[:, None] - pos[None] >= 2), float("-inf"))
    want = torch.softmax(s, -1)[..., 0].sum(-1)[0]  # each head's mass on key 0, summed over the rows
    np.testing.assert_allclose(obs.scores["previous"].sums[0], want.numpy(), rtol=1e-5)
    assert (obs.scores["previous"].rows[0] == 4.0).all()
