"""Texts longer than a model's positions, through every command and API that runs a model (issue 34, item 3; issue
35: `--max-length` beyond the positions is refused before the model loads, config.json being enough): a GPT-2
(learned positions) and a Llama (rotary) with 16 positions, and a BERT with 16. A length past the positions is
refused by name, before the model loads: the refusals below come from directories whose weights are garbage, so
loading them would fail with another message. A length within the positions truncates the texts to it, and
`ablate --task lm` scores exactly the loss of the truncated texts. Then detect-heads' sizes (checked before anything
is drawn; the sequences drawn in blocks, the same as drawn at once), its input checks, and the messages of item 7."""
from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import attnkit
from attnkit.cli.main import main
from attnkit.errors import AttnkitError

from .synthetic import WORDS, tiny_bert, tiny_decoder

POSITIONS = 16
TEXTS = [" ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(30)) for i in range(6)]  # 30 words: > 16 tokens


def decoder_tokenizer():
    """A word-level tokenizer of a decoder over WORDS: BOS <s> added in front, EOS </s>, no cls, sep or padding."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", ",", "."] + WORDS
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def short_decoder(kind: str, tok):
    """A tiny decoder of `kind` with POSITIONS positions (GPT-2: learned; Llama: rotary)."""
    model = tiny_decoder(kind, vocab=len(tok))
    cfg = model.config
    if kind == "gpt2":  # learned position embeddings: cut to POSITIONS rows
        cfg.n_positions = POSITIONS
        wpe = model.transformer.wpe
        model.transformer.wpe = torch.nn.Embedding.from_pretrained(wpe.weight[:POSITIONS].detach().clone(),
                                                                   freeze=False)
    else:
        cfg.max_position_embeddings = POSITIONS
    return model


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """{name: directory} of the three models, and of each a copy whose weights are garbage ("NAME-broken")."""
    root = tmp_path_factory.mktemp("positions")
    tok = decoder_tokenizer()
    out = {}
    for kind in ("gpt2", "llama"):
        path = root / kind
        short_decoder(kind, tok).save_pretrained(path)
        tok.save_pretrained(path)
        out[kind] = path
    from transformers import BertModel

    bert, btok = tiny_bert()
    bert.config.max_position_embeddings = POSITIONS
    torch.manual_seed(0)
    bert = BertModel(bert.config).eval()
    bert.save_pretrained(root / "bert")
    btok.save_pretrained(root / "bert")
    out["bert"] = root / "bert"
    for name in list(out):
        broken = root / f"{name}-broken"
        shutil.copytree(out[name], broken)
        (broken / "model.safetensors").write_bytes(b"not a model")
        out[f"{name}-broken"] = broken
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(TEXTS) + "\n")
    out["corpus"] = corpus
    conllu = root / "toy.conllu"
    conllu.write_text("".join(f"# text = {t}\n" + "".join(f"{i + 1}\t{w}\t{w}\tX\tX\t_\t{i}\tdep\t_\t_\n"
                                                             for i, w in enumerate(t.split()[:20])) + "\n"
                              for t in TEXTS))
    out["conllu"] = conllu
    return out


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def refused(res, text: str):
    """The command ended with a one-line attnkit error containing `text`, no traceback."""
    assert res.exit_code not in (0, None), res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert "Traceback" not in res.output
    lines = [line for line in res.output.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1 and text in lines[0], res.output


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_every_command_refuses_a_length_past_the_positions_before_the_model_loads(dirs, kind, tmp_path):
    model, corpus = dirs[f"{kind}-broken"], dirs["corpus"]
    past = f"exceeds the model's {POSITIONS} positions"
    default = f"--max-length 128 exceeds the model's {POSITIONS} positions"
    commands = [
        (["extract", corpus, "--model", model, "--max-length", 17, "-o", tmp_path / "x"], "--max-length 17 " + past),
        (["extract", corpus, "--model", model, "-o", tmp_path / "x"], default),
        (["compare-models", model, model, corpus, "--max-length", 40, "-o", tmp_path / "c"], "--max-length 40 " + past),
    ]
    if kind == "bert":
        commands += [
            (["ablate", model, "--task", "mlm", "--data", corpus, "--experiment", "heads", "--max-length", 17, "-o",
              tmp_path / "a"], "--max-length 17 " + past),
            (["probe", dirs["conllu"], "--model", model, "--max-length", 64, "-o", tmp_path / "p"],
             "--max-length 64 " + past),
        ]
    else:
        commands += [
            (["ablate", model, "--task", "lm", "--data", corpus, "--experiment", "heads", "--max-length", 17, "-o",
              tmp_path / "a"], "--max-length 17 " + past),
            (["detect-heads", model, "--length", 9, "-o", tmp_path / "d"],
             f"the repeated sequences (2 × 9 tokens) take 18 tokens, more than the model's {POSITIONS} positions"),
            (["detect-heads", model, "--length", 2_000_000_000, "-o", tmp_path / "d"], "take 4000000000 tokens"),
        ]
    for args, text in commands:
        refused(run(*args), text)


def test_the_python_apis_refuse_a_length_past_the_positions(dirs):
    broken = str(dirs["llama-broken"])  # by path: refused before it loads
    past = re.escape(f"max_length 17 exceeds the model's {POSITIONS} positions (llama): give at most {POSITIONS}")
    with pytest.raises(AttnkitError, match=past):
        attnkit.extract(TEXTS, broken, max_length=17)
    with pytest.raises(AttnkitError, match=past):
        attnkit.attention_maps(TEXTS[0], broken, max_length=17)
    with pytest.raises(AttnkitError, match=past):
        attnkit.head_means(TEXTS, broken, max_length=17)
    with pytest.raises(AttnkitError, match=past):
        attnkit.load_model(broken, max_length=17)
    from attnkit.jobs.compare import compare_models

    with pytest.raises(AttnkitError, match=past):
        compare_models(TEXTS, str(dirs["llama"]), broken, max_length=17)
    with pytest.raises(AttnkitError, match="take 18 tokens, more than the model's 16 positions"):
        attnkit.detect_heads(broken, length=9)
    # a loaded model: the same check
    pair = attnkit.load_model(str(dirs["gpt2"]), task="causal-lm")
    with pytest.raises(AttnkitError, match="max_length 17 exceeds the model's 16 positions"):
        attnkit.extract(TEXTS, pair, max_length=17)
    with pytest.raises(AttnkitError, match="max_length 17 exceeds the model's 16 positions"):
        attnkit.attention_maps(TEXTS[0], pair, max_length=17)
    from attnkit.ablation.experiments import TaskEvaluator
    from attnkit.ablation.tasks import get_task

    task = get_task("lm", dirs["corpus"], max_length=17)  # a length asked for: refused
    with pytest.raises(AttnkitError, match="max_length 17 exceeds the model's 16 positions"):
        task.evaluate(*pair)
    with pytest.raises(AttnkitError, match="max_length 17 exceeds the model's 16 positions"):
        TaskEvaluator(task, *pair)
    task = get_task("lm", dirs["corpus"])  # the task's default, 128: cut to the model's positions
    TaskEvaluator(task, *pair)
    assert task.max_length == POSITIONS


def lm_loss(model, tok, texts, max_length: int) -> float:
    """The next-token loss of `texts` cut to `max_length` tokens, with plain transformers (eager attention)."""
    total, n = 0.0, 0
    for t in texts:
        ids = tok(t, truncation=True, max_length=max_length, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model(input_ids=ids, labels=ids)
        total += float(out.loss) * (ids.shape[1] - 1)
        n += ids.shape[1] - 1
    return total / n


@pytest.mark.parametrize("given", [True, False])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_ablate_lm_within_the_positions_scores_the_truncated_texts(dirs, kind, given, tmp_path):
    """issue 34: GPT-2 with 64 positions ended in IndexError, a rotary Llama was scored past its context. Given
    --max-length 16, or by default (128, cut to the model's 16 positions, and said so), the loss is that of the
    texts cut to 16 tokens."""
    length = ["--max-length", POSITIONS] if given else []
    res = run("ablate", dirs[kind], "--task", "lm", "--data", dirs["corpus"], "--experiment", "layers", *length,
              "--resamples", 0, "-o", tmp_path / "a")
    assert res.exit_code == 0, res.output
    cut = "attnkit ablate: inputs cut to the model's 16 positions (the task's default --max-length is 128)"
    assert (cut in res.stderr) == (not given), res.stderr
    table = json.loads((tmp_path / "a" / "layers.json").read_text())
    base = next(r for r in table["rows"] if r["setting"] == "baseline")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(dirs[kind], attn_implementation="eager").eval()
    want = lm_loss(model, AutoTokenizer.from_pretrained(dirs[kind]), TEXTS, POSITIONS)
    assert base["loss"] == pytest.approx(want, rel=1e-5)
    meta = json.loads((tmp_path / "a" / "layers.meta.json").read_text())
    assert meta["max_length"] == POSITIONS and meta.get("max_length_cut_from") == (None if given else 128)


def test_other_commands_within_the_positions_truncate(dirs, tmp_path):
    for kind in ("gpt2", "llama", "bert"):
        res = run("extract", dirs["corpus"], "--model", dirs[kind], "--max-length", POSITIONS, "-q", "-o",
                  tmp_path / f"x-{kind}")
        assert res.exit_code == 0, res.output
        meta = json.loads((tmp_path / f"x-{kind}" / "meta.json").read_text())
        assert meta["n_tokens"] == POSITIONS * len(TEXTS)  # every text cut to the positions
    res = run("compare-models", dirs["llama"], dirs["llama"], dirs["corpus"], "--max-length", POSITIONS, "-q", "-o",
              tmp_path / "c")
    assert res.exit_code == 0, res.output
    res = run("detect-heads", dirs["llama"], "--length", 7, "--sequences", 3, "-q", "-o", tmp_path / "d")
    assert res.exit_code == 0, res.output  # a BOS and 2 × 7 tokens: 15


# --- detect-heads: sizes, progress, inputs --------------------------------------------------------------------
def test_sequences_are_drawn_in_blocks_equal_to_one_draw():
    from attnkit.jobs.detect import BATCH, repeated_chunks

    tok = decoder_tokenizer()
    blocks = list(repeated_chunks(tok, 5, 2 * BATCH + 3, seed=4))
    assert [len(b) for b, _ in blocks] == [BATCH, BATCH, 3] and {o for _, o in blocks} == {1}
    ids = torch.cat([b for b, _ in blocks])
    # one draw of every sequence at once, written out here
    special = set(tok.all_special_ids)
    vocab = np.array([i for i in range(len(tok)) if i not in special])
    r = vocab[np.random.default_rng(4).integers(0, len(vocab), size=(2 * BATCH + 3, 5))]
    assert torch.equal(ids[:, 1:], torch.from_numpy(np.concatenate([r, r], 1)))
    assert (ids[:, 0] == 1).all()


def test_detect_heads_memory_does_not_grow_with_the_sequences(dirs, monkeypatch):
    """`--sequences 2000000000 --length 8` tried 119 GiB at once: now one block is drawn at a time. The forward is
    stopped after the third block (a model that raises): by then three blocks were drawn, not all."""
    import attnkit.jobs.detect as detect

    model, tok = attnkit.load_model(str(dirs["llama"]), task="causal-lm")
    seen = []
    real = detect.repeated_chunks

    def counting(*a, **k):
        for block in real(*a, **k):
            seen.append(block[0].shape)
            yield block

    monkeypatch.setattr(detect, "repeated_chunks", counting)
    forward = model.forward

    def stop_after_three(*a, **k):
        if len(seen) > 3:
            raise KeyboardInterrupt
        return forward(*a, **k)

    monkeypatch.setattr(model, "forward", stop_after_three)
    with pytest.raises(KeyboardInterrupt):
        attnkit.detect_heads((model, tok), length=7, n_sequences=2_000_000_000)
    assert len(seen) == 4 and all(s == (detect.BATCH, 15) for s in seen)


def test_detect_heads_shows_progress(dirs, capsys):
    pair = attnkit.load_model(str(dirs["llama"]), task="causal-lm")
    attnkit.detect_heads(pair, length=7, n_sequences=20, progress=True)
    err = capsys.readouterr().err
    assert "detect-heads" in err and "20/20" in err
    attnkit.detect_heads(pair, length=7, n_sequences=20)
    assert capsys.readouterr().err == ""


def test_detect_heads_input_checks(dirs):
    pair = attnkit.load_model(str(dirs["llama"]), task="causal-lm")
    n = pair[0].get_input_embeddings().num_embeddings
    good = torch.tensor([[5, 6, 7, 5, 6, 7]])
    assert len(attnkit.detect_heads(pair, input_ids=good)) == 8
    for ids, text in ((torch.tensor([[5, n, 7, 5, n, 7]]), f"holds {n} .*outside the model's vocabulary of {n}"),
                      (torch.tensor([[5, -1, 7, 5, -1, 7]]), "holds -1 .*outside the model's vocabulary"),
                      (torch.tensor([[5.0, 6.7, 7.0, 5.0, 6.7, 7.0]]), "must be integer token ids, got float32"),
                      ([[5.5, 6.0, 5.5, 6.0]], "must be integer token ids"),
                      ([["a", "b"]], "input_ids must be B × 2R integer token ids"),
                      (torch.tensor([[5, 5]]), "sequences of 1 token\\(s\\) hold no induction target")):
        with pytest.raises(AttnkitError, match=text):
            attnkit.detect_heads(pair, input_ids=ids)
    # a one-token sequence is fine where no induction score is asked for
    assert len(attnkit.detect_heads(pair, input_ids=torch.tensor([[5, 5]]), kinds=["previous", "duplicate"])) == 8
    with pytest.raises(AttnkitError, match="length must be an integer of at least 2, got 1"):
        attnkit.detect_heads(pair, length=1)
    with pytest.raises(AttnkitError, match="not one string: it would be read as one text per character"):
        attnkit.detect_heads(pair, kinds=["retrieval"], corpus="the cat sat on the mat. the dog ran.")
    with pytest.raises(AttnkitError, match="corpus must hold texts"):
        attnkit.detect_heads(pair, kinds=["retrieval"], corpus=[1, 2])
    with pytest.raises(AttnkitError, match="corpus gives the haystacks of retrieval, which kinds does not ask for"):
        attnkit.detect_heads(pair, corpus=["the cat sat. the dog ran."])


def test_detect_heads_command_checks(dirs, tmp_path):
    corpus = dirs["corpus"]
    refused(run("detect-heads", dirs["llama"], "--corpus", corpus, "-o", tmp_path / "d"),
            "--corpus gives the haystacks of retrieval, which --kinds does not ask for")
    assert not (tmp_path / "d").exists()
    refused(run("detect-heads", dirs["llama"], "--length", 1, "-o", tmp_path / "d"), "1 is not in the range 2<=x")
    # 2 × 8 tokens fit the 16 positions, but not with the BOS the tokenizer adds: refused before anything is drawn
    refused(run("detect-heads", dirs["llama"], "--sequences", 2_000_000_000, "--length", 8, "-o", tmp_path / "d"),
            "the repeated sequences (2 × 8 tokens and a BOS) take 17 tokens, more than the model's 16 positions")
    # `default` is the embedded MiniLM, as for every command: an encoder, refused as one
    refused(run("detect-heads", "default", "-o", tmp_path / "d", "--length", 4, "--sequences", 1),
            "attention is not causal")


# --- messages ------------------------------------------------------------------------------------------------
def test_a_task_the_model_cannot_do_is_an_attnkit_message(dirs, tmp_path):
    refused(run("ablate", dirs["llama"], "--task", "mlm", "--data", dirs["corpus"], "--experiment", "heads", "-o",
                tmp_path / "a"), "--task mlm scores a masked language model (an encoder)")
    with pytest.raises(AttnkitError, match="holds a 'llama' model, for which transformers has no masked-lm model"):
        attnkit.load_model(str(dirs["llama"]), task="masked-lm")
    with pytest.raises(AttnkitError, match="holds a 'bert' model whose attention is not causal: causal-lm"):
        attnkit.load_model(str(dirs["bert"]), task="causal-lm", max_length=POSITIONS)


def test_an_output_that_is_not_a_directory_is_a_usage_error(dirs, tmp_path):
    (tmp_path / "f").write_text("x")
    for out in ("/dev/null", tmp_path / "f"):
        res = run("extract", dirs["corpus"], "--model", dirs["bert"], "--max-length", POSITIONS, "-o", out)
        assert res.exit_code == 2 and "exists and is not a directory" in res.output, res.output


def test_probe_cuts_its_default_length_to_the_positions_and_says_so(dirs, tmp_path):
    res = run("probe", dirs["conllu"], "--model", dirs["bert"], "--min-count", 1, "-o", tmp_path / "p")
    assert res.exit_code == 0, res.output
    assert "attnkit probe: sentences cut to the model's 16 positions (the default --max-length is 128)" in res.stderr
    assert json.loads((tmp_path / "p" / "probe.json").read_text())["settings"]["max_length"] == POSITIONS
