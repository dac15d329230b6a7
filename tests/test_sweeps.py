"""Sweeps (attnkit/ablation/sweep.py): evaluating many settings with the unchanged layers run once per batch and
several settings per forward gives the numbers of the plain loop (one full evaluation per setting), on every task;
the patching experiment against an eager patching loop on hooks of the plain model; the heads' corpus means against
hooks, resumed after an interruption, with workers."""
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from transformers import BertForMaskedLM, BertForQuestionAnswering, BertForSequenceClassification, BertModel

import attnkit
from attnkit import AttnkitError, Intervention
from attnkit.ablation import TaskEvaluator, get_task
from attnkit.ablation.experiments import heads_settings, run_experiment, types_settings
from attnkit.ablation.patching import PatchingTask
from attnkit.cli.ablate import ablate
from attnkit.interventions import HeadTypes

from .test_ablation_tasks import _cfg, _save, _sent, stsb_file, tokenizer  # noqa: F401  (fixtures)


def settings(model, means):
    """Heads zeroed, made uniform, mean-ablated; regions with renormalisation; the baseline; settings of several
    layers (they start at their first changed layer)."""
    shape = Intervention.for_model(model).shape
    grid = np.array([["dense", "vertical"][(l + h) % 2] for l in range(shape[0]) for h in range(shape[1])],
                    dtype=object).reshape(shape)
    out = [s.intervention for s in heads_settings(shape, "zero")]
    out += [s.intervention for s in heads_settings(shape, "mean", means)[1:4]]
    out += [s.intervention for s in types_settings(shape, HeadTypes(grid), renormalize=True)]
    out.append(Intervention.for_model(model).set(1, 2, mode="uniform", region="no_intra"))
    return out


def compare(task, model, tok, ivs, **kw):
    plain = TaskEvaluator(task, model, tok, sweep=False, **kw).evaluate_many(ivs)
    for stack in (None, 1, 3):
        swept = TaskEvaluator(task, model, tok, stack=stack, **kw).evaluate_many(ivs)
        for (ma, ea), (mb, eb) in zip(plain, swept):
            assert ma.keys() == mb.keys()
            for k in ma:
                assert mb[k] == pytest.approx(ma[k], rel=1e-6, abs=1e-6, nan_ok=True), (k, ma, mb)
            for name, a in ea.arrays.items():
                b = eb.arrays[name]
                if a.dtype.kind in "fc":
                    np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
                else:
                    assert list(a) == list(b)
            np.testing.assert_array_equal(ea.index, eb.index)
    return plain


def means_of(model):
    L, H = Intervention.for_model(model).shape
    return np.random.default_rng(0).normal(size=(L, H, model.config.hidden_size // H))


def test_sweep_equals_the_plain_loop_stsb(tokenizer, stsb_file):  # noqa: F811
    torch.manual_seed(0)
    model = attnkit.instrument(BertModel(_cfg(tokenizer)).eval(), tokenizer)
    task = get_task("stsb", stsb_file)
    results = compare(task, model, tokenizer, settings(model, means_of(model)), batch_size=5)
    assert len({tuple(np.round(e.arrays["pred"], 6)) for _, e in results}) > 20  # the settings change the outputs


def test_sweep_equals_the_plain_loop_glue_mlm_squad(tokenizer, tmp_path):  # noqa: F811
    rng = np.random.default_rng(1)
    lines = ["Quality\t#1 ID\t#2 ID\t#1 String\t#2 String"]
    lines += [f"{i % 2}\t{i}\t{i + 100}\t{_sent(rng, 3 + i % 4)}\t{_sent(rng, 5)}" for i in range(11)]
    (tmp_path / "dev.tsv").write_text("\n".join(lines) + "\n")
    (tmp_path / "c.txt").write_text("\n".join(_sent(rng, 6 + i % 5) for i in range(9)) + "\n")
    ctx = "the old tower is in paris . the river is big , the city is old ."
    qas = [{"id": f"q{i}", "question": q, "answers": [{"text": a, "answer_start": ctx.index(a)}]}
           for i, (q, a) in enumerate([("where is the tower ?", "paris"), ("what is big ?", "the river"),
                                       ("what is old ?", "the city")])]
    (tmp_path / "dev.json").write_text(json.dumps({"data": [{"paragraphs": [{"context": ctx, "qas": qas}]}]}))
    torch.manual_seed(0)
    for cls, name, path, kw in ((BertForSequenceClassification, "glue", "dev.tsv", {"num_labels": 2}),
                                (BertForMaskedLM, "mlm", "c.txt", {}),
                                (BertForQuestionAnswering, "squad", "dev.json", {})):
        model = attnkit.instrument(cls(_cfg(tokenizer, **kw)).eval(), tokenizer)
        task = get_task(name, tmp_path / path, **({"max_length": 20, "stride": 6} if name == "squad" else {}))
        compare(task, model, tokenizer, settings(model, means_of(model))[::3], batch_size=4)


def test_sweep_runs_the_unchanged_layers_once_per_batch(tokenizer, stsb_file):  # noqa: F811
    """Counted by the op's calls per layer: the plain loop runs every layer for every setting; the sweep runs a
    layer for the plain forward and for the settings that change it or a layer before it."""
    torch.manual_seed(0)
    model = attnkit.instrument(BertModel(_cfg(tokenizer)).eval(), tokenizer)
    task = get_task("stsb", stsb_file)
    calls = {}

    def count(layer, *args):
        calls[layer] = calls.get(layer, 0) + 1

    ivs = [s.intervention for s in heads_settings((2, 4), "zero")]
    steps = len(task.plan(model, tokenizer, None, 4).steps)
    with attnkit.models.observing(model, [count]):
        TaskEvaluator(task, model, tokenizer, batch_size=4, stack=1).evaluate_many(ivs)
    # layer 0: the plain forward + 4 settings of layer 0; layer 1: the plain forward + all 8 settings
    assert calls == {0: steps * (1 + 4), 1: steps * (1 + 8)}
    calls.clear()
    with attnkit.models.observing(model, [count]):
        TaskEvaluator(task, model, tokenizer, batch_size=4).evaluate_many(ivs)  # stacked: one forward per layer
    assert calls == {0: steps * 2, 1: steps * 3}


def test_the_sweep_bar_counts_batches_of_named_settings(tokenizer, stsb_file, capsys):  # noqa: F811
    torch.manual_seed(0)
    model = attnkit.instrument(BertModel(_cfg(tokenizer)).eval(), tokenizer)
    task = get_task("stsb", stsb_file)
    ivs = [s.intervention for s in heads_settings((2, 4), "zero")]
    steps = len(task.plan(model, tokenizer, None, 4).steps)
    TaskEvaluator(task, model, tokenizer, batch_size=4).evaluate_many(ivs, progress=True, desc="heads")
    last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert last.startswith(f"heads: 9 settings × {steps} batches: 100%") and f"{9 * steps}/{9 * steps}" in last
    assert ("batch/s" in last or "s/batch" in last) and "setting·batch" not in last  # tqdm: slow rates as s/step


def test_sweep_refuses_gates(tokenizer, stsb_file):  # noqa: F811
    model = attnkit.instrument(BertModel(_cfg(tokenizer)).eval(), tokenizer)
    task = get_task("stsb", stsb_file)
    with pytest.raises(AttnkitError, match="without gates"):
        TaskEvaluator(task, model, tokenizer).evaluate_many([Intervention.for_model(model).with_gates()])


# --- patching -----------------------------------------------------------------------------------------------
CLEAN = ["a man is riding the horse .", "the dog is eating in the city .", "a small cat is playing .",
         "the old man is riding .", "a woman is eating the big red cat ."]
CORRUPT = ["a woman is riding the horse .", "the cat is eating in the city .", "a big dog is playing .",
           "the old woman is riding .", "a man is eating the big blue cat ."]
REFERENCE = ["a man rides a horse .", "a dog eats .", "a cat plays .", "an old man rides .", "a woman eats ."]


def patch_file(path, kind):
    rows = ["clean\tcorrupted\t" + ("reference" if kind == "stsb" else "target\tfoil")]
    for i, (a, b) in enumerate(zip(CLEAN, CORRUPT)):
        if kind == "mlm":
            a, b = a.replace(" is ", " [MASK] ", 1), b.replace(" is ", " [MASK] ", 1)
        rows.append(f"{a}\t{b}\t" + (REFERENCE[i] if kind == "stsb" else "man\twoman" if kind == "mlm" else "1\t0"))
    path.write_text("\n".join(rows) + "\n")
    return str(path)


def eager_patching(model, tok, kind, heads):
    """The restored share of each head by hooks on each layer's output projection: cache the clean heads' outputs,
    run the corrupted inputs with one head's slice replaced, score, and take (patched − corrupted)/(clean −
    corrupted) of the means."""
    H = model.config.num_attention_heads
    D = model.config.hidden_size // H
    bert = model.base_model
    projs = [layer.attention.output.dense for layer in bert.encoder.layer]
    clean = tok(CLEAN if kind != "mlm" else [c.replace(" is ", " [MASK] ", 1) for c in CLEAN], padding=True,
                return_tensors="pt")
    corrupt = tok(CORRUPT if kind != "mlm" else [c.replace(" is ", " [MASK] ", 1) for c in CORRUPT], padding=True,
                  return_tensors="pt")

    def run(enc, replace=None, keep=None):
        def hook(mod, args, i):
            x = args[0].view(*args[0].shape[:2], H, D).clone()
            if keep is not None:
                keep[i] = x.clone()
            if replace is not None and replace[0] == i:
                x[:, :, replace[1]] = replace[2]
            return (x.flatten(2),)
        hs = [p.register_forward_pre_hook(lambda m, a, i=i: hook(m, a, i)) for i, p in enumerate(projs)]
        try:
            with torch.no_grad():
                out = model(**enc)
        finally:
            for h in hs:
                h.remove()
        return metric(out, enc)

    def metric(out, enc):
        if kind == "stsb":
            ref = tok(REFERENCE, padding=True, return_tensors="pt")
            with torch.no_grad():
                r = model(**ref).last_hidden_state
            pool = lambda h, m: (h * m[..., None]).sum(1) / m.sum(1, keepdim=True)  # noqa: E731
            return torch.nn.functional.cosine_similarity(pool(out.last_hidden_state, enc["attention_mask"]),
                                                         pool(r, ref["attention_mask"]), dim=-1).numpy()
        if kind == "mlm":
            pos = (enc["input_ids"] == tok.mask_token_id).nonzero()[:, 1]
            logits = out.logits[torch.arange(len(pos)), pos]
            return (logits[:, tok.convert_tokens_to_ids("man")] - logits[:, tok.convert_tokens_to_ids("woman")]).numpy()
        return (out.logits[:, 1] - out.logits[:, 0]).numpy()

    kept = {}
    c = run(clean, keep=kept).mean()
    k = run(corrupt).mean()
    return {(l, h): 100 * (run(corrupt, (l, h, kept[l][:, :, h])).mean() - k) / (c - k) for l, h in heads}


@pytest.mark.parametrize("kind, cls, kw", [("stsb", BertModel, {}), ("mlm", BertForMaskedLM, {}),
                                           ("glue", BertForSequenceClassification, {"num_labels": 2})])
def test_patching_restores_what_an_eager_patching_loop_restores(tokenizer, tmp_path, kind, cls, kw):  # noqa: F811
    torch.manual_seed(0)  # weights larger than BERT's init: clean and corrupted outputs differ well above rounding
    model = attnkit.instrument(cls(_cfg(tokenizer, initializer_range=0.2, **kw)).eval(), tokenizer)
    task = PatchingTask(patch_file(tmp_path / "p.tsv", kind), kind)
    for sweep in (True, False):
        table = run_experiment("patching", model, TaskEvaluator(task, model, tokenizer, batch_size=2, sweep=sweep),
                               task.main_metric, progress=False, n_boot=200, patching=task)
        rows = table.rows
        assert rows[0]["setting"] == "corrupted" and rows[0]["restored"] == 0.0 and len(rows) == 1 + 8
        want = eager_patching(model, tokenizer, kind, [(r["layer"], r["head"]) for r in rows[1:]])
        got = {(r["layer"], r["head"]): r["restored"] for r in rows[1:]}
        for lh, w in want.items():
            assert got[lh] == pytest.approx(w, rel=1e-3, abs=1e-3), (lh, got[lh], w)
        assert all("delta_restored_lo" in r for r in rows)


def test_patching_refuses_unequal_lengths_and_missing_columns(tokenizer, tmp_path):  # noqa: F811
    model = attnkit.instrument(BertModel(_cfg(tokenizer)).eval(), tokenizer)
    (tmp_path / "bad.tsv").write_text("clean\tcorrupted\treference\na man .\ta big man .\ta man .\n"
                                      "a dog .\ta cat .\ta dog .\n")
    task = PatchingTask(str(tmp_path / "bad.tsv"), "stsb")
    with pytest.raises(AttnkitError, match=r"bad.tsv:2: the clean input has 5 tokens and the corrupted one 6: "
                                           "patching needs inputs of equal token length"):
        task.evaluate(model, tokenizer)
    (tmp_path / "cols.tsv").write_text("clean\tcorrupted\na\tb\nc\td\n")
    with pytest.raises(AttnkitError, match="needs columns clean, corrupted, target, foil; missing target, foil"):
        PatchingTask(str(tmp_path / "cols.tsv"), "mlm")
    with pytest.raises(AttnkitError, match="does not apply to task stsb"):
        PatchingTask(str(tmp_path / "bad.tsv"), "stsb", "logit_diff")
    (tmp_path / "same.tsv").write_text("clean\tcorrupted\treference\na man .\ta man .\ta dog .\n"
                                       "a cat .\ta cat .\ta dog .\n")
    with pytest.raises(AttnkitError, match="no gap for patching to restore"):
        PatchingTask(str(tmp_path / "same.tsv"), "stsb").evaluate(model, tokenizer)


# --- corpus means -------------------------------------------------------------------------------------------
TEXTS = [_sent(np.random.default_rng(i), 3 + i % 6) for i in range(23)] + [("a man is riding .", "the dog .")]


def eager_means(model, tok, texts):
    """Each head's output averaged over every valid token, read by hooks on the output projections."""
    H = model.config.num_attention_heads
    projs = [layer.attention.output.dense for layer in model.encoder.layer]
    sums, n = 0.0, 0
    for t in texts:
        enc = tok(*([t] if isinstance(t, str) else t), return_tensors="pt")
        seen = []
        hs = [p.register_forward_pre_hook(lambda m, a, seen=seen: seen.append(a[0][0].view(a[0].shape[1], H, -1)
                                                                              .double())) for p in projs]
        with torch.no_grad():
            model(**enc)
        for h in hs:
            h.remove()
        sums = sums + torch.stack([s.sum(0) for s in seen])
        n += enc["input_ids"].shape[1]
    return (sums / n).numpy(), n


def test_head_means_equal_hooks_and_resume_after_an_interruption(tokenizer, tmp_path):  # noqa: F811
    torch.manual_seed(0)
    model = attnkit.instrument(BertModel(_cfg(tokenizer)).eval(), tokenizer)
    want, n = eager_means(model, tokenizer, TEXTS)
    full = attnkit.head_means(TEXTS, (model, tokenizer), batch_size=4, window=8)
    assert full.n_tokens == n and full.mean.shape == (2, 4, 8)
    np.testing.assert_allclose(full.mean, want, rtol=1e-5, atol=1e-6)
    ckpt = tmp_path / "means.npz"

    def stop_after_three(state, res):
        if res.planned.index == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        attnkit.head_means(TEXTS, (model, tokenizer), batch_size=4, window=8, checkpoint=ckpt, on_batch=stop_after_three)
    partial = attnkit.run.head_means.HeadMeans.load(ckpt)
    assert not partial.complete and partial.next_index == 12 and 0 < partial.n_tokens < n
    seen = []
    resumed = attnkit.head_means(TEXTS, (model, tokenizer), batch_size=4, window=8, checkpoint=ckpt,
                                 on_batch=lambda s, r: seen.append(r.planned.index))
    assert seen == [3, 4, 5]  # only what was left
    np.testing.assert_array_equal(resumed.sums, full.sums)
    again = attnkit.head_means(TEXTS, (model, tokenizer), batch_size=4, window=8, checkpoint=ckpt,
                               on_batch=lambda s, r: seen.append("work"))
    assert seen == [3, 4, 5] and again.complete  # a finished checkpoint is read back
    with pytest.raises(AttnkitError, match="made with other settings \\(batch_size differ\\)"):
        attnkit.head_means(TEXTS, (model, tokenizer), batch_size=5, window=8, checkpoint=ckpt)
    first = next(model.parameters())
    kept = first.detach().clone()
    with torch.no_grad():  # other weights under the same name: not continued
        first.add_(0.01)
    with pytest.raises(AttnkitError, match="made with other settings \\(weights_sha256 differ\\)"):
        attnkit.head_means(TEXTS, (model, tokenizer), batch_size=4, window=8, checkpoint=ckpt)
    with torch.no_grad():
        first.copy_(kept)
    workers = attnkit.head_means(TEXTS, (model, tokenizer), batch_size=4, window=8, workers=2)
    np.testing.assert_array_equal(workers.sums, full.sums)


def test_ablate_patching_and_mean_from_the_command_line(tokenizer, stsb_file, tmp_path):  # noqa: F811
    torch.manual_seed(0)
    path = _save(BertModel(_cfg(tokenizer)), tokenizer, tmp_path / "model")
    runner = CliRunner()
    out = tmp_path / "patch"
    res = runner.invoke(ablate, [path, "--task", "stsb", "--data", patch_file(tmp_path / "p.tsv", "stsb"),
                                 "--experiment", "patching", "-o", str(out), "-q", "--resamples", "300"])
    assert res.exit_code == 0, res.output
    table = json.loads((out / "patching.json").read_text())
    assert table["main_metric"] == "restored" and table["bootstrap"]["resamples"] == 300
    assert len(table["rows"]) == 1 + 8 and (out / "patching.png").stat().st_size > 0
    examples = (out / "patching.examples.csv").read_text().splitlines()
    assert examples[0] == "setting,example,patched,clean,corrupted" and len(examples) == 1 + 9 * 5
    assert json.loads((out / "patching.meta.json").read_text())["metric"] == "cosine"
    out = tmp_path / "mean"
    res = runner.invoke(ablate, [path, "--task", "stsb", "--data", stsb_file, "--experiment", "heads", "--mode",
                                 "mean", "--limit", "8", "-o", str(out), "-q", "--resamples", "0"])
    assert res.exit_code == 0, res.output
    means = attnkit.run.head_means.HeadMeans.load(out / "head_means.npz")
    model, tok = attnkit.load_model(path)
    task = get_task("stsb", stsb_file).head(8)
    want, _ = eager_means(model, tok, task.segments())
    np.testing.assert_allclose(means.mean, want, rtol=1e-5, atol=1e-6)
    rows = json.loads((out / "heads.json").read_text())["rows"]
    assert rows[1]["setting"] == "L0H0 mean" and "delta_spearman_lo" not in rows[1]
    # the model changes under the same path: --overwrite measures the means again
    torch.manual_seed(1)
    _save(BertModel(_cfg(tokenizer)), tokenizer, tmp_path / "model")
    res = runner.invoke(ablate, [path, "--task", "stsb", "--data", stsb_file, "--experiment", "heads", "--mode",
                                 "mean", "--limit", "8", "-o", str(out), "-q", "--resamples", "0", "--overwrite"])
    assert res.exit_code == 0 and "head_means.npz" in res.output, res.output
    model, tok = attnkit.load_model(path)
    want, _ = eager_means(model, tok, task.segments())
    np.testing.assert_allclose(attnkit.run.head_means.HeadMeans.load(out / "head_means.npz").mean, want, rtol=1e-5,
                               atol=1e-6)
    for bad, message in ((["--experiment", "importance", "--mode", "mean"], "--mode mean applies to the experiments"),
                         (["--experiment", "heads", "--metric", "cosine"], "--metric is for --experiment patching"),
                         (["--experiment", "patching", "--mode", "zero"], "--mode does not apply"),
                         (["--experiment", "heads", "--resamples", "5"], "--resamples must be 0")):
        res = runner.invoke(ablate, [path, "--task", "stsb", "--data", stsb_file, "-o", str(tmp_path / "x"), *bad])
        assert res.exit_code == 1 and message in res.output, res.output
