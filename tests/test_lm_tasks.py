"""Language-model losses as ablation tasks (docs/interventions.md, "Tasks"): the masked-LM loss of an encoder
(`--task mlm`) and the next-token loss of a decoder (`--task lm`), checked against plain computations."""
import math

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertForMaskedLM

import attnkit
from attnkit.ablation import get_task
from attnkit.ablation.experiments import TaskEvaluator, run_experiment
from attnkit.interventions import Intervention, intervene

from .test_ablation_tasks import WORDS, _sent, tokenizer  # noqa: F401


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = np.random.default_rng(5)
    path = tmp_path_factory.mktemp("lm") / "c.txt"
    path.write_text("\n".join(_sent(rng, 4 + i % 7) for i in range(9)) + "\n")
    return path


def _mlm(tok):
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64, attn_implementation="eager")
    return BertForMaskedLM(cfg).eval()


def test_mlm_loss_is_the_mean_cross_entropy_of_the_masked_tokens(tokenizer, corpus):  # noqa: F811
    model = _mlm(tokenizer)
    task = get_task("mlm", corpus)
    assert task.main_metric == "loss"
    # the plain computation: eager attention, transformers' own loss over the same masked batches
    nll, count = 0.0, 0
    with torch.no_grad():
        for _, batch, labels in task._masked(tokenizer, None, 4):
            out = model(**batch.inputs, labels=labels)
            k = int((labels != -100).sum())
            nll, count = nll + float(out.loss) * k, count + k
    attnkit.instrument(model)
    res = task.evaluate(model, tokenizer, batch_size=4)
    assert res["masked"] == count and res["loss"] == pytest.approx(nll / count, abs=1e-5)
    ex = task.last_examples
    assert ex.value() == pytest.approx(res["loss"], abs=1e-9) and ex.n == len(task)


def test_mlm_layers_table_shows_delta_loss_with_intervals(tokenizer, corpus):  # noqa: F811
    model = attnkit.instrument(_mlm(tokenizer))
    task = get_task("mlm", corpus)
    table = run_experiment("layers", model, TaskEvaluator(task, model, tokenizer, batch_size=4), task.main_metric,
                           mode="zero", progress=False, n_boot=200)
    base = table.rows[0]["loss"]
    for layer, row in enumerate(table.rows[1:]):
        with intervene(model, Intervention.from_layers((2, 4), [layer], mode="zero")):
            plain = task.evaluate(model, tokenizer, batch_size=4)["loss"]
        assert row["loss"] == pytest.approx(plain, abs=1e-6)
        assert row["delta_loss"] == pytest.approx(plain - base, abs=1e-6)
        assert row["delta_loss_lo"] <= row["delta_loss"] <= row["delta_loss_hi"]
    assert table.rows[0]["delta_loss_lo"] == table.rows[0]["delta_loss_hi"] == 0
    assert not math.isclose(table.rows[1]["delta_loss"], 0.0, abs_tol=1e-4)
