"""Tasks on tiny local fixtures (random tiny BERTs saved to disk) and the `ablate` command end to end."""
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertModel,
    BertTokenizerFast,
)

import attnkit
from attnkit import AttnkitError
from attnkit.ablation import get_task, metrics
from attnkit.ablation.data import detect_glue, subset
from attnkit.ablation.tasks import GlueTask
from attnkit.cli.ablate import ablate

from .conftest import write_clusters_json

WORDS = ("a man woman child is are playing riding eating guitar horse dog cat the on in with big small red blue "
         "what who where does paris france tower city river old new").split()


@pytest.fixture(scope="module")
def tokenizer():
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ",", "?", "!"] + WORDS
    tok = BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True)
    assert tok.vocab_size == len(vocab) and tok.unk_token_id not in tok("a man is playing .")["input_ids"]
    return tok


def _cfg(tok, **kw):
    return BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, max_position_embeddings=128, attn_implementation="eager", **kw)


def _save(model, tok, path):
    torch.manual_seed(0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _sent(rng, n):
    return " ".join(rng.choice(WORDS, size=n)) + "."


@pytest.fixture(scope="module")
def stsb_file(tmp_path_factory):
    rng = np.random.default_rng(0)
    d = tmp_path_factory.mktemp("stsb")
    lines = ["index\tgenre\tsentence1\tsentence2\tscore"]
    for i in range(12):
        lines.append(f"{i}\tx\t{_sent(rng, 3 + i % 4)}\t{_sent(rng, 4)} {_sent(rng, 2)}\t{(i * 7) % 11 / 2:.2f}")
    (d / "dev.tsv").write_text("\n".join(lines) + "\n")
    return str(d / "dev.tsv")


def test_glue_detection():
    assert detect_glue(["index", "question", "sentence", "label"], [], "x") == "qnli"
    assert detect_glue(["index", "sentence1", "sentence2", "label"], [["0", "a", "b", "entailment"]], "x") == "rte"
    assert detect_glue(["index", "sentence1", "sentence2", "label"], [["0", "a", "b", "1"]], "x") == "wnli"
    assert detect_glue(["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"], [], "x") == "mrpc"
    assert detect_glue(["sentence", "label"], [], "x") == "sst-2"
    assert detect_glue(["gj04", "1", "", "The sailors rode the breeze."], [], "x") == "cola"
    with pytest.raises(AttnkitError, match="cannot tell"):
        detect_glue(["foo", "bar"], [], "x")


def test_stsb_matches_manual_embedding(tokenizer, stsb_file):
    torch.manual_seed(0)
    model = attnkit.instrument(BertModel(_cfg(tokenizer)).eval())
    task = get_task("stsb", stsb_file)
    res = task.evaluate(model, tokenizer, limit=10, batch_size=3)
    assert res["n"] == 10
    chosen = subset(len(task), 10)
    assert chosen[0] == 0 and chosen[-1] == len(task) - 1 and len(chosen) == 10  # spread over the file
    cos = []
    for a, b, _ in [task.examples[i] for i in chosen]:
        with torch.no_grad():
            e = [model(**tokenizer(s, return_tensors="pt")).last_hidden_state[0].mean(0) for s in (a, b)]
        cos.append(float(torch.nn.functional.cosine_similarity(e[0], e[1], dim=0)))
    gold = [task.examples[i][2] for i in chosen]
    assert res["spearman"] == pytest.approx(metrics.spearman(cos, gold), abs=1e-6)
    assert res["pearson"] == pytest.approx(metrics.pearson(cos, gold), abs=1e-4)
    losses = list(task.losses(model, tokenizer, limit=4))
    assert len(losses) == 4 and all(l.ndim == 0 and torch.isfinite(l) for l in losses)


def test_glue_mrpc_metrics(tokenizer, tmp_path):
    rng = np.random.default_rng(1)
    lines = ["Quality\t#1 ID\t#2 ID\t#1 String\t#2 String"]
    for i in range(9):
        lines.append(f"{i % 2}\t{i}\t{i + 100}\t{_sent(rng, 4)}\t{_sent(rng, 5)}")
    (tmp_path / "dev.tsv").write_text("\n".join(lines) + "\n")
    torch.manual_seed(0)
    model = attnkit.instrument(BertForSequenceClassification(_cfg(tokenizer, num_labels=2)).eval())
    task = get_task("glue", tmp_path / "dev.tsv")
    assert isinstance(task, GlueTask) and task.subtask == "mrpc" and task.main_metric == "acc_and_f1"
    res = task.evaluate(model, tokenizer, batch_size=4)
    pred = []
    for (a, b), _ in task.examples:
        with torch.no_grad():
            pred.append(int(model(**tokenizer(a, b, return_tensors="pt")).logits.argmax(-1)))
    gold = [int(l) for _, l in task.examples]
    assert res["accuracy"] == pytest.approx(metrics.accuracy(pred, gold))
    assert res["f1"] == pytest.approx(metrics.f1(pred, gold))
    assert res["acc_and_f1"] == pytest.approx((res["accuracy"] + res["f1"]) / 2)
    with pytest.raises(AttnkitError, match="lacks columns"):
        get_task("glue", tmp_path / "dev.tsv", glue_task="mnli")
    three = attnkit.instrument(BertForSequenceClassification(_cfg(tokenizer, num_labels=3)).eval())
    with pytest.raises(AttnkitError, match="labels but the model has 3"):
        task.evaluate(three, tokenizer)
    (tmp_path / "bad.tsv").write_text("index\tsentence1\tsentence2\tlabel\n0\ta\tb\tmaybe\n")
    with pytest.raises(AttnkitError, match="not one of"):
        get_task("glue", tmp_path / "bad.tsv")


def test_squad_v2(tokenizer, tmp_path):
    ctx = "the old tower is in paris . the river is big , the city is old ."
    data = {"version": "v2.0", "data": [{"title": "t", "paragraphs": [{"context": ctx, "qas": [
        {"id": "q1", "question": "where is the tower ?", "is_impossible": False,
         "answers": [{"text": "paris", "answer_start": ctx.index("paris")}]},
        {"id": "q2", "question": "who is playing guitar ?", "is_impossible": True, "answers": []},
        {"id": "q3", "question": "what is big ?", "is_impossible": False,
         "answers": [{"text": "the river", "answer_start": ctx.index("the river")}]},
    ]}]}]}
    (tmp_path / "dev.json").write_text(json.dumps(data))
    torch.manual_seed(0)
    model = attnkit.instrument(BertForQuestionAnswering(_cfg(tokenizer)).eval())
    task = get_task("squad", tmp_path / "dev.json", max_length=24, stride=8)  # several windows per question
    assert task.v2 and len(task) == 3
    res = task.evaluate(model, tokenizer, batch_size=2)
    assert 0 <= res["exact"] <= res["f1"] <= 100 and res["total"] == 3
    assert res["HasAns_total"] == 2 and res["NoAns_total"] == 1
    # the loss targets the answer's tokens (in the windows that hold it) and position 0 otherwise
    feats, _ = task._features(tokenizer, [0, 1, 2])
    found = {}
    for f in feats:
        s_tok, e_tok = task.answer_positions(f)
        if s_tok:
            found.setdefault(f["example"], tokenizer.decode(f["input_ids"][s_tok:e_tok + 1]))
    assert found == {0: "paris", 2: "the river"}
    assert len(feats) > 3
    losses = list(task.losses(model, tokenizer))
    assert len(losses) == 3 and all(torch.isfinite(l) for l in losses)


def test_mlm_masks_do_not_depend_on_batching(tokenizer, tmp_path):
    rng = np.random.default_rng(2)
    (tmp_path / "c.txt").write_text("\n".join(_sent(rng, 6 + i % 5) for i in range(10)) + "\n\n")
    torch.manual_seed(0)
    model = attnkit.instrument(BertForMaskedLM(_cfg(tokenizer)).eval())
    task = get_task("mlm", tmp_path / "c.txt")
    assert len(task) == 10
    a = task.evaluate(model, tokenizer, batch_size=3)
    b = task.evaluate(model, tokenizer, batch_size=10)
    assert a["masked"] == b["masked"] >= 10 and a["accuracy"] == pytest.approx(b["accuracy"])
    c = task.evaluate(model, tokenizer, limit=4, batch_size=4)
    assert c["n"] == 4 and c["masked"] < a["masked"]
    # a text gets the same masked positions whatever the limit and batch size

    def masked_positions(limit, bs):
        out = {}
        for orig, _, labels in task._masked(tokenizer, limit, bs):
            for b, j in enumerate(orig):
                out[j] = torch.nonzero(labels[b] != -100).flatten().tolist()
        return out

    full, part = masked_positions(None, 3), masked_positions(4, 4)
    assert sorted(part) == subset(len(task), 4)
    assert all(part[j] == full[j] and part[j] for j in part)


def test_ablate_command_end_to_end(tokenizer, stsb_file, tmp_path):
    torch.manual_seed(0)
    path = _save(BertModel(_cfg(tokenizer)), tokenizer, tmp_path / "model")
    write_clusters_json(tmp_path / "run", [[["diagonal", "vertical"][h % 2] for h in range(4)] for _ in range(2)])
    runner = CliRunner()
    for exp, extra in (("heads", []), ("layers", []), ("types", ["--clusters", str(tmp_path / "run")]),
                       ("importance", ["--step", "0.25"])):
        out = tmp_path / f"out-{exp}"
        res = runner.invoke(ablate, [path, "--task", "stsb", "--data", stsb_file, "--experiment", exp,
                                     "--limit", "8", "-o", str(out), "--quiet", *extra])
        assert res.exit_code == 0, res.output
        lines = [l for l in res.output.splitlines() if l.startswith("| ")]
        assert lines[1].startswith("| baseline |")  # header, then the baseline row first
        for ext in ("csv", "json", "md", "png"):
            assert (out / f"{exp}.{ext}").stat().st_size > 0
        rows = json.loads((out / f"{exp}.json").read_text())["rows"]
        assert rows[0]["setting"] == "baseline" and rows[0]["n"] == 8
        n_rows = {"heads": 1 + 8, "layers": 1 + 2, "importance": 5,
                  "types": 1 + 2 * (2 + 1) + 2 * 2 + 2 * 2}[exp]
        assert len(rows) == n_rows, [r["setting"] for r in rows]
    res = runner.invoke(ablate, ["default", "--task", "glue", "--data", stsb_file, "--experiment", "heads"])
    assert res.exit_code != 0 and "without a glue head" in res.output
    res = runner.invoke(ablate, [path, "--task", "stsb", "--data", stsb_file, "--experiment", "types"])
    assert res.exit_code != 0 and "--clusters" in res.output
    res = runner.invoke(ablate, [str(tmp_path / "nope"), "--task", "stsb", "--data", stsb_file,
                                 "--experiment", "layers", "-o", str(tmp_path / "x")])
    assert res.exit_code != 0 and "not found" in res.output


def test_region_interventions_see_the_sentences(tokenizer):
    """Task forwards hand sentence ids to the op: no_inter changes a pair, not a single sentence."""
    from attnkit.ablation.tasks import forward
    from attnkit.tokens import Encoder

    torch.manual_seed(0)
    model = attnkit.instrument(BertModel(_cfg(tokenizer)).eval())
    enc = Encoder(tokenizer, split_sentences=True)
    pair = enc([("a man is playing", "the dog is eating")])
    single = enc(["a man is playing guitar"])
    everything = lambda **kw: attnkit.Intervention.from_layers(model, [0, 1], **kw)
    with torch.no_grad():
        base_pair, base_single = forward(model, pair)[0], forward(model, single)[0]
        with attnkit.intervene(model, everything(mode="keep", region="no_inter")):
            assert not torch.allclose(forward(model, pair)[0], base_pair, atol=1e-4)
            assert torch.equal(forward(model, single)[0], base_single)
        with attnkit.intervene(model, everything(mode="keep", region="no_intra")):
            no_intra = forward(model, single)[0]
        with attnkit.intervene(model, everything(mode="zero")):
            zero = forward(model, single)[0]
    torch.testing.assert_close(no_intra, zero)


def test_types_settings_follow_guan_tables():
    from attnkit.ablation.experiments import types_settings
    from attnkit.features import NO_INTRA, UNIFORM, ZERO
    from attnkit.interventions import HeadTypes

    grid = np.array([["diagonal", "vertical", "dense"], ["dense", "diagonal", "vertical"]], dtype=object)
    settings = types_settings((2, 3), HeadTypes(grid))
    names = [s.name for s in settings]
    assert names[0] == "baseline" and settings[0].intervention.is_identity
    # Table 2: 3 single types + 3 pairs, for prune and for substitute; Table 3: 2 regions × 3 types × 2
    assert len(settings) == 1 + 2 * (3 + 3) + 2 * 3 + 2 * 3
    by = dict(zip(names, settings))
    assert by["prune diagonal"].intervention.mode.tolist() == [[ZERO, 0, 0], [0, ZERO, 0]]
    assert by["substitute dense & vertical"].intervention.mode.tolist() == [[0, UNIFORM, UNIFORM], [UNIFORM, 0, UNIFORM]]
    only = by["only diagonal keeps intra"]
    assert only.intervention.region.tolist() == [[0, NO_INTRA, NO_INTRA], [NO_INTRA, 0, NO_INTRA]]
    assert not only.intervention.mode.any()
    assert only.info["diagonal"] == "keep" and only.info["vertical"] == "-intra"
    assert by["remove intra of vertical"].intervention.changed_heads() == [(0, 1), (1, 2)]
