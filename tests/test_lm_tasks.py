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


@pytest.fixture(scope="module")
def dtok(tokenizer):  # noqa: F811
    """The tiny tokenizer as a decoder's: no token_type_ids."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.model_input_names = ["input_ids", "attention_mask"]
    return tok


def _decoder(tok, seed=0):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model("llama", vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=128, attn_implementation="eager")
    return AutoModelForCausalLM.from_config(cfg).eval()


def test_lm_loss_is_the_next_token_cross_entropy(dtok, corpus):  # noqa: F811
    model = _decoder(dtok)
    task = get_task("lm", corpus)
    assert task.main_metric == "loss" and task.model_task == "causal-lm"
    nll = count = 0.0
    with torch.no_grad():  # transformers' own loss, text by text, eager attention
        for text in task.examples:
            ids = dtok(text, return_tensors="pt")["input_ids"]
            out = model(input_ids=ids, labels=ids)
            nll, count = nll + float(out.loss) * (ids.shape[1] - 1), count + ids.shape[1] - 1
    attnkit.instrument(model)
    res = task.evaluate(model, dtok, batch_size=4)  # padded batches
    assert res["tokens"] == count and res["loss"] == pytest.approx(nll / count, abs=1e-5)
    assert res["perplexity"] == pytest.approx(math.exp(res["loss"]))
    assert task.last_examples.value() == pytest.approx(res["loss"], abs=1e-9)
    grads = list(task.losses(model, dtok, batch_size=2))
    assert len(grads) == 5 and float(sum(g.detach() for g in grads)) > 0


@pytest.mark.parametrize("experiment", ["layers", "heads"])
def test_lm_ablations_equal_a_plain_loop_over_intervene(dtok, corpus, experiment):  # noqa: F811
    model = attnkit.instrument(_decoder(dtok, seed=1))
    task = get_task("lm", corpus)
    table = run_experiment(experiment, model, TaskEvaluator(task, model, dtok, batch_size=4), "loss",
                           mode="zero", progress=False, n_boot=100)
    rows = table.rows[1:]
    assert len(rows) == (3 if experiment == "layers" else 12)
    for row in rows[:4]:
        iv = (Intervention.from_layers((3, 4), [row["layer"]], mode="zero") if experiment == "layers" else
              Intervention.from_heads((3, 4), [(row["layer"], row["head"])], mode="zero"))
        with intervene(model, iv):
            plain = task.evaluate(model, dtok, batch_size=4)["loss"]
        assert abs(row["loss"] - plain) <= 1e-6
        assert row["delta_loss_lo"] <= row["delta_loss"] <= row["delta_loss_hi"]
    assert max(abs(r["delta_loss"]) for r in rows) > 1e-4


def test_lm_importance_and_patching_run(dtok, corpus, tmp_path):  # noqa: F811
    from attnkit.ablation.patching import PatchingTask

    model = attnkit.instrument(_decoder(dtok, seed=2))
    task = get_task("lm", corpus)
    table = run_experiment("importance", model, TaskEvaluator(task, model, dtok, batch_size=4), "loss",
                           losses=lambda: task.losses(model, dtok, batch_size=1), step=0.25, progress=False,
                           n_boot=50)
    assert table.rows[0]["setting"] == "baseline" and len(table.rows) == 5
    assert np.isfinite(table.extra["importance"]).all() and table.extra["importance"].max() > 0
    (tmp_path / "p.tsv").write_text("clean\tcorrupted\ttarget\tfoil\n"
                                    "a man is playing\ta dog is playing\tguitar\thorse\n"
                                    "the cat is eating\tthe man is eating\thorse\tguitar\n")
    patch = PatchingTask(str(tmp_path / "p.tsv"), "lm")
    table = run_experiment("patching", model, TaskEvaluator(patch, model, dtok), "restored", patching=patch,
                           progress=False, n_boot=0)
    assert len(table.rows) == 1 + 12 and table.rows[0]["restored"] == pytest.approx(0.0, abs=1e-9)
