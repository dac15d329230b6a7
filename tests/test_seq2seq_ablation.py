"""`attnkit ablate --task seq2seq` on a tiny random BART (and T5, for the loss) saved with a word-level tokenizer into tmp_path: the task's
loss against the model's own teacher-forced loss (`labels`), computed pair by pair without attnkit; the heads
experiment end to end, a cross-attention head's Δloss against a direct forward under that head zeroed; and the
refusals of a task that does not fit the model."""
from __future__ import annotations

import csv

import pytest
import torch
from click.testing import CliRunner

import attnkit
from attnkit.ablation.tasks import get_task
from attnkit.cli.ablate import ablate
from attnkit.errors import AttnkitError

from .synthetic import tiny_bert, tiny_seq2seq
from .test_seq2seq_extract import PAIRS, save_seq2seq, word_tokenizer, write_jsonl, write_tsv


@pytest.fixture(scope="module")
def bart_dir(tmp_path_factory):
    return save_seq2seq("bart", tmp_path_factory.mktemp("bart"))


def direct_loss(model, tok, pairs, heads=None) -> float:
    """Σ nll / Σ target tokens over `pairs`, each pair alone through the model's own loss (`labels`), with the
    attnkit heads `heads` ("L4H1") zeroed where given."""
    total, count = 0.0, 0
    for source, target in pairs:
        enc = tok(source, return_tensors="pt")
        labels = tok(text_target=target, return_tensors="pt")["input_ids"]
        iv = attnkit.Intervention.from_heads(model, heads) if heads else attnkit.Intervention.for_model(model)
        with torch.no_grad(), attnkit.intervene(model, iv):
            loss = model(**enc, labels=labels).loss
        total += float(loss) * labels.shape[1]
        count += labels.shape[1]
    return total / count


@pytest.mark.parametrize("kind", ["bart", "t5"])
def test_loss_is_the_models_own_teacher_forced_loss(kind, bart_dir, tmp_path):
    path = bart_dir
    if kind == "t5":
        tok, vocab = word_tokenizer("t5")
        path = tmp_path / "t5"
        tiny_seq2seq("t5", vocab=vocab).save_pretrained(path)
        tok.save_pretrained(path)
    model, tok = attnkit.load_model(str(path), device="cpu", task="seq2seq-lm")
    task = get_task("seq2seq", write_tsv(tmp_path / "pairs.tsv", PAIRS))
    got = task.evaluate(model, tok, batch_size=4)  # batches padded on both sides, sorted by source length
    assert got["n"] == len(PAIRS)
    assert got["tokens"] == sum(len(tok(text_target=t)["input_ids"]) for _, t in PAIRS)
    assert got["loss"] == pytest.approx(direct_loss(model, tok, PAIRS), rel=1e-5)
    # JSONL pairs read as `attnkit extract` reads them; the gradient losses are the same pairs' losses
    task = get_task("seq2seq", write_jsonl(tmp_path / "pairs.jsonl", PAIRS))
    assert task.evaluate(model, tok, batch_size=2)["loss"] == pytest.approx(got["loss"], rel=1e-5)
    losses = [float(x.detach()) for x in task.losses(model, tok)]
    assert losses == pytest.approx([direct_loss(model, tok, [p]) for p in PAIRS], rel=1e-5)


def ablate_table(model_dir, tmp_path, experiment: str, resamples: int) -> list[dict]:
    """`attnkit ablate MODEL --task seq2seq` over a TSV of PAIRS: the rows of `experiment`'s table."""
    data = write_tsv(tmp_path / "pairs.tsv", PAIRS)
    out = tmp_path / "out"
    res = CliRunner().invoke(ablate, [str(model_dir), "--task", "seq2seq", "--data", str(data), "--experiment",
                                      experiment, "--out", str(out), "--resamples", str(resamples), "--quiet"])
    assert res.exit_code == 0, res.output
    with open(out / f"{experiment}.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_heads_experiment_zeroes_a_cross_head_as_a_direct_forward(bart_dir, tmp_path):
    rows = ablate_table(bart_dir, tmp_path, "heads", 200)
    assert len(rows) == 1 + 6 * 4  # baseline, then 2 encoder + 2 decoder + 2 cross layers × 4 heads
    assert [(r["kind"], r["kind_layer"]) for r in rows[1::4]] == [
        ("encoder", "0"), ("encoder", "1"), ("decoder", "0"), ("decoder", "1"), ("cross", "0"), ("cross", "1")]
    model, tok = attnkit.load_model(str(bart_dir), device="cpu", task="seq2seq-lm")
    base = direct_loss(model, tok, PAIRS)
    assert float(rows[0]["loss"]) == pytest.approx(base, rel=1e-5)
    for r in rows:
        if r["setting"] in ("L4H1 zero", "L1H2 zero", "L3H0 zero"):  # cross, encoder, decoder
            heads = r["setting"].split()[0]
            delta = direct_loss(model, tok, PAIRS, heads) - base
            assert float(r["delta_loss"]) == pytest.approx(delta, rel=1e-4, abs=1e-6)
            assert delta != 0
            assert float(r["delta_loss_lo"]) <= float(r["delta_loss"]) <= float(r["delta_loss_hi"])


@pytest.mark.slow
def test_importance_ranks_and_prunes_every_kind(bart_dir, tmp_path):
    """The curve over all heads, then one curve per kind pruning that kind's heads alone (Michel et al.'s Enc-Enc,
    Dec-Dec and Enc-Dec curves), each step's loss that of a direct forward with the curve's heads so far zeroed."""
    rows = ablate_table(bart_dir, tmp_path, "importance", 100)
    curves = {}
    for r in rows:
        curves.setdefault(r["kind"], []).append(r)
    assert list(curves) == ["all", "encoder", "decoder", "cross"]
    every = curves["all"]
    pruned = [h for r in every[1:] for h in r["newly_pruned"].split(",")]
    assert sorted(pruned) == sorted(f"L{layer}H{head}" for layer in range(6) for head in range(4))
    assert int(every[-1]["pruned"]) == 24
    model, tok = attnkit.load_model(str(bart_dir), device="cpu", task="seq2seq-lm")
    base = float(rows[0]["loss"])
    for kind, layers in (("encoder", (0, 1)), ("decoder", (2, 3)), ("cross", (4, 5))):
        curve = curves[kind]
        assert float(curve[0]["loss"]) == pytest.approx(base, rel=1e-6) and int(curve[0]["pruned"]) == 0
        so_far = []
        for r in curve[1:]:
            so_far += r["newly_pruned"].split(",")
            assert int(r["pruned"]) == len(so_far) and float(r["share"]) == pytest.approx(len(so_far) / 8)
            assert {int(h[1:].split("H")[0]) for h in so_far} <= set(layers)  # the other kinds stay intact
        assert len(set(so_far)) == 8
        mid = curve[len(curve) // 2]
        heads = ",".join(h for r in curve[1:curve.index(mid) + 1] for h in r["newly_pruned"].split(","))
        assert float(mid["delta_loss"]) == pytest.approx(direct_loss(model, tok, PAIRS, heads) - base, rel=1e-4,
                                                         abs=1e-6)


def test_a_task_that_does_not_fit_the_model_is_refused(bart_dir, tmp_path):
    model, tok = tiny_bert()
    bert = tmp_path / "bert"
    model.save_pretrained(bert)
    tok.save_pretrained(bert)
    pairs = write_tsv(tmp_path / "pairs.tsv", PAIRS)
    texts = tmp_path / "texts.txt"
    texts.write_text("the cat sat .\na dog ran .\n")
    for model_path, task, data, said in ((bert, "seq2seq", pairs, "not an encoder–decoder"),
                                         (bart_dir, "lm", texts, "encoder–decoder, which --task lm cannot"),
                                         (bart_dir, "mlm", texts, "--task seq2seq")):
        res = CliRunner().invoke(ablate, [str(model_path), "--task", task, "--data", str(data), "--experiment",
                                          "heads", "--out", str(tmp_path / f"out-{task}")])
        assert res.exit_code != 0 and said in res.output, res.output
        assert not (tmp_path / f"out-{task}").exists()
    res = CliRunner().invoke(ablate, [str(bart_dir), "--task", "seq2seq", "--data", str(pairs), "--experiment",
                                      "heads", "--mode", "mean", "--out", str(tmp_path / "out-mean")])
    assert res.exit_code != 0 and "--mode mean is not built for --task seq2seq" in res.output, res.output
    assert not (tmp_path / "out-mean").exists()
    from attnkit.ablation.job import AblateOptions, run_ablation

    with pytest.raises(AttnkitError, match="not an encoder–decoder"):  # the job alone refuses it before the model loads
        run_ablation(AblateOptions(model=str(bert), task_name="seq2seq", data=str(pairs),
                                   experiment="layers", out=str(tmp_path / "job")))


def test_importance_figure_draws_one_curve_per_kind():
    from attnkit.ablation.experiments import ResultTable
    from attnkit.ablation.figures import importance_axes

    rows = [{"setting": "baseline" if k == 0 and kind == "all" else f"prune {k} {kind} heads", "kind": kind,
             "pruned": k, "share": k / 2, "loss": 1.0 + 0.1 * k * (i + 1), "delta_loss": 0.1 * k * (i + 1)}
            for i, kind in enumerate(["all", "encoder", "cross"]) for k in range(3)]
    fig, (_, right) = importance_axes(ResultTable("importance", "loss", rows, {"importance": [[1.0, 0.5]] * 3}))
    curves = [line for line in right.get_lines() if line.get_label() in ("all heads", "encoder heads", "cross heads")]
    assert [line.get_label() for line in curves] == ["all heads", "encoder heads", "cross heads"]
    for line, k in zip(curves, (1, 2, 3)):
        assert line.get_ydata().tolist() == pytest.approx([0.0, 0.1 * k, 0.2 * k])
    assert [line.get_xdata().tolist() for line in curves] == [[0.0, 50.0, 100.0]] * 3
    for r in rows:  # with --decode: a panel each for BLEU and chrF, the same curves
        r.update(bleu=50.0 - r["pruned"], delta_bleu=-float(r["pruned"]), chrf=60.0, delta_chrf=0.0)
    fig, axes = importance_axes(ResultTable("importance", "loss", rows, {"importance": [[1.0, 0.5]] * 3}))
    assert len(axes) == 4 and "Δ bleu" in axes[2].get_ylabel() and "Δ chrf" in axes[3].get_ylabel()
    bleu = [line for line in axes[2].get_lines() if line.get_label() == "cross heads"]
    assert bleu[0].get_ydata().tolist() == [0.0, -1.0, -2.0]
