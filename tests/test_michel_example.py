"""examples/michel_seq2seq.py (docs/seq2seq.md, "Michel et al. on a laptop"): its toy grammar's translation, and
a run of a few steps whose outputs have the structure the docs describe."""
from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "michel_seq2seq.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("michel_seq2seq", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("source, target", [
    ("cat sees dog", "neko ga inu wo mi -ru"),
    ("cat -s sees dog", "neko -tachi ga inu wo mi -ra"),
    ("big red cat chases old dog -s", "neko aka ooki ga inu -tachi furu wo oi -ru"),
    ("small bird -s likes quick happy frog", "tori -tachi chisa ga kaeru ureshi haya wo suki -ra"),
])
def test_the_grammar_reorders_and_inflects(example, source, target):
    """SVO → SOV with case markers, adjectives after the noun in reverse order, the plural marker on the noun, the
    verb's suffix agreeing with the subject's number (never the object's)."""
    assert " ".join(example.translate(source.split())) == target


def test_held_out_sentences_never_reach_training(example):
    held, batches = example.held_out_and_training(3, 64)
    assert len({tuple(s) for s in held}) == 64
    drawn = next(batches(512))
    source = {tuple(row.tolist()) for row in drawn.input_ids}
    assert not source & {tuple(row.tolist()) for row in example.Pairs(held).input_ids}
    # every drawn pair's labels are its source's translation, </s> ended, -100 after it
    words = [example.WORDS[i] for i in drawn.input_ids[0].tolist() if i not in (example.PAD, example.EOS)]
    labels = drawn.labels[0].tolist()
    n = labels.index(example.EOS)
    assert [example.WORDS[i] for i in labels[:n]] == example.translate(words)
    assert set(labels[n + 1:]) <= {-100}


@pytest.mark.slow
def test_a_short_run_writes_every_kind_s_importance_ablations_and_figure(example, tmp_path):
    out = tmp_path / "run"
    summary = example.main(["--steps", "4", "--every", "2", "--layers", "1", "--d-model", "16", "--held-out", "8",
                            "--importance-pairs", "8", "--group", "4", "--out", str(out)])
    assert sorted(p.name for p in out.iterdir()) == ["ablation.csv", "heads.csv", "michel_seq2seq.png",
                                                     "summary.json"]
    assert json.loads((out / "summary.json").read_text()) == summary
    heads = list(csv.DictReader(open(out / "heads.csv")))
    # checkpoints at steps 2 and 4, 3 layers (encoder, decoder, cross) × 4 heads each
    assert [(r["step"], r["layer"], r["head"], r["kind"]) for r in heads] == [
        (str(s), str(layer), str(h), kind) for s in (2, 4) for layer, kind in enumerate(("encoder", "decoder", "cross"))
        for h in range(4)]
    for step in ("2", "4"):  # Michel's normalisation: each layer's importance has ℓ2 norm 1
        imp = np.array([float(r["importance"]) for r in heads if r["step"] == step]).reshape(3, 4)
        np.testing.assert_allclose(np.linalg.norm(imp, axis=1), 1.0, rtol=1e-6)
    rows = list(csv.DictReader(open(out / "ablation.csv")))
    alone = [r for r in rows if r["experiment"] == "masked_alone"]
    assert len(alone) == 12
    for kind, layer in (("encoder", 0), ("decoder", 1), ("cross", 2)):
        curve = [r for r in rows if r["experiment"] == "prune_" + kind]
        assert [int(r["pruned"]) for r in curve] == [0, 1, 2, 3, 4]
        assert curve[0]["heads"] == ""  # one more head of that kind's layer at each step, never another kind's
        assert sorted(curve[-1]["heads"].split()) == [f"L{layer}H{h}" for h in range(4)]
        assert all(curve[i]["heads"].split() == curve[i + 1]["heads"].split()[:i] for i in range(4))
        # nothing pruned: the trained model's own held-out loss
        assert float(curve[0]["loss"]) == pytest.approx(summary["final"]["loss"], abs=1e-3)
    assert set(summary["kinds"]) == {"Enc-Enc", "Dec-Dec", "Enc-Dec"}
    assert summary["importance_spearman_with_final"]["4"] == 1.0
    assert summary["command"].endswith(f"--out {out}")
