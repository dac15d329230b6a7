"""`attnkit ablate --experiment best_head` (Michel et al. Table 4): in each layer every head but one masked, for
each choice of the head kept. Each row's loss against a direct forward under `attnkit.intervene` of the masked heads
(transformers' own loss): a tiny masked-LM encoder through the task's sweep, and a tiny BART end to end through the
command line; the best head per layer and the Markdown that shows only those."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import attnkit
from attnkit.ablation import get_task
from attnkit.ablation.experiments import ResultTable, TaskEvaluator, mark_best_heads, run_experiment
from attnkit.cli.ablate import ablate
from attnkit.interventions import Intervention, intervene

from .test_ablation_tasks import tokenizer  # noqa: F401
from .test_lm_tasks import _mlm, corpus  # noqa: F401
from .test_seq2seq_ablation import PAIRS, bart_dir, direct_loss  # noqa: F401
from .test_seq2seq_extract import write_tsv


def others(layer: int, kept: int, n_heads: int = 4) -> list[tuple[int, int]]:
    return [(layer, h) for h in range(n_heads) if h != kept]


def test_every_kept_head_equals_a_direct_forward_on_an_encoder(tokenizer, corpus):  # noqa: F811
    model = attnkit.instrument(_mlm(tokenizer))
    task = get_task("mlm", corpus)
    table = run_experiment("best_head", model, TaskEvaluator(task, model, tokenizer, batch_size=4), "loss",
                           progress=False, n_boot=100)
    assert [(r["layer"], r["head"]) for r in table.rows] == [(None, None)] + [(l, h) for l in range(2)
                                                                              for h in range(4)]
    for row in table.rows[1:]:
        nll = count = 0.0
        iv = Intervention.from_heads((2, 4), others(row["layer"], row["head"]), mode="zero")
        with torch.no_grad(), intervene(model, iv):  # transformers' own loss over the task's masked batches
            for _, batch, labels in task._masked(tokenizer, None, 4):
                k = int((labels != -100).sum())
                nll, count = nll + float(model(**batch.inputs, labels=labels).loss) * k, count + k
        assert row["loss"] == pytest.approx(nll / count, abs=1e-5)
        assert row["delta_loss_lo"] <= row["delta_loss"] <= row["delta_loss_hi"]
    for layer in range(2):
        rows = [r for r in table.rows[1:] if r["layer"] == layer]
        assert [r["best"] for r in rows] == [r["loss"] == min(x["loss"] for x in rows) for r in rows]
    assert table.rows[0]["best"] is None and len(set(r["loss"] for r in table.rows[1:])) > 4
    shown = table.to_markdown().splitlines()[2:]
    assert len(shown) == 3 and shown[0].startswith("| baseline")


def test_best_is_the_highest_score_and_never_nan():
    rows = [{"setting": "baseline", "layer": None, "head": None, "accuracy": 80.0}]
    rows += [{"setting": f"L0 only H{h}", "layer": 0, "head": h, "accuracy": a}
             for h, a in enumerate([70.0, float("nan"), 75.0])]
    table = mark_best_heads(ResultTable("best_head", "accuracy", rows))
    assert [r["best"] for r in table.rows] == [None, False, False, True] and table.shown == [0, 3]


@pytest.mark.slow
def test_ablate_best_head_on_an_encoder_decoder(bart_dir, tmp_path):  # noqa: F811
    data = write_tsv(tmp_path / "pairs.tsv", PAIRS)
    out = tmp_path / "out"
    res = CliRunner().invoke(ablate, [str(bart_dir), "--task", "seq2seq", "--data", str(data), "--experiment",
                                      "best_head", "--out", str(out), "--resamples", "100", "--quiet"])
    assert res.exit_code == 0, res.output
    with open(out / "best_head.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1 + 6 * 4
    assert [(r["kind"], r["kind_layer"]) for r in rows[1::4]] == [
        ("encoder", "0"), ("encoder", "1"), ("decoder", "0"), ("decoder", "1"), ("cross", "0"), ("cross", "1")]
    model, tok = attnkit.load_model(str(bart_dir), device="cpu", task="seq2seq-lm")
    base = direct_loss(model, tok, PAIRS)
    for r in rows[1::3]:  # every kind
        layer, head = int(r["layer"]), int(r["head"])
        heads = ",".join(f"L{l}H{h}" for l, h in others(layer, head))
        assert float(r["delta_loss"]) == pytest.approx(direct_loss(model, tok, PAIRS, heads) - base, rel=1e-4,
                                                       abs=1e-6)
    best = [r for r in rows[1:] if r["best"] == "True"]
    assert len(best) == 6 and all(float(b["loss"]) == min(float(r["loss"]) for r in rows[1:]
                                                          if r["layer"] == b["layer"]) for b in best)
    assert res.output.count(" only H") == 6  # the printed table: each layer's best kept head
    assert json.loads((out / "best_head.json").read_text())["experiment"] == "best_head"
    assert (out / "best_head.png").is_file() and np.isfinite(float(rows[1]["loss"]))
