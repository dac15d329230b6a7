"""Physical head pruning (attnkit/arch/pruning.py, docs/pruning.md): exactness against the full model with the same
heads zeroed by an Intervention, layers with no head left, saving and loading (attnkit and plain transformers),
what attnkit measures of a pruned model, the real sizes, and `attnkit prune` with its one-line refusals."""
from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from transformers import (
    AutoModel,
    AutoModelForSequenceClassification,
    BertConfig,
    BertForSequenceClassification,
)

import attnkit
from attnkit.ablation.sizes import count_parameters, forward_flops, pruned_sizes, reference_inputs
from attnkit.arch import load_pruned_model, prune_heads, pruned_head_grid
from attnkit.cli.main import main
from attnkit.errors import AttnkitError

from .synthetic import WORDS, padded_inputs, tiny_bert, tiny_config, tiny_encoder

HEADS = [(0, 1), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3), (2, 2)]  # layer 1 loses every head


def tiny(kind):
    return tiny_encoder(kind, n_layers=3, vocab=40)


def inputs_of_three(pair=True):
    return padded_inputs(40, (11, 6, 1), pair)


def zeroed_reference(model, heads, inputs):
    """Hidden states of the unpruned `model` with `heads` zeroed by an attnkit Intervention."""
    full = attnkit.instrument(copy.deepcopy(model))
    with torch.no_grad(), attnkit.intervene(full, attnkit.Intervention.from_heads(full, heads, mode="zero")):
        return full(**inputs).last_hidden_state


def valid(x, inputs):
    return x * inputs["attention_mask"][..., None]


def pruned_under(model, heads, impl):
    """A copy of `model` with `heads` removed, under attention implementation `impl` (attnkit: instrumented)."""
    pruned = prune_heads(copy.deepcopy(model), heads)
    if impl == "attnkit":
        return attnkit.instrument(pruned)
    pruned.set_attn_implementation(impl)
    return pruned


@pytest.mark.parametrize("impl", ["eager", "sdpa", "attnkit"])
@pytest.mark.parametrize("kind", ["bert", "roberta", "electra", "distilbert"])
def test_pruned_hidden_states_equal_the_zeroed_full_model(kind, impl):
    model = tiny(kind)
    inputs = inputs_of_three(pair=kind != "distilbert")
    expect = zeroed_reference(model, HEADS, inputs)
    pruned = pruned_under(model, HEADS, impl)
    with torch.no_grad():
        got = pruned(**inputs).last_hidden_state
    torch.testing.assert_close(valid(got, inputs), valid(expect, inputs), atol=2e-6, rtol=1e-5)
    with torch.no_grad():
        plain = model(**inputs).last_hidden_state
    assert (valid(plain - got, inputs)).abs().max() > 1e-2  # pruning changed the model
    assert pruned_head_grid(pruned).sum(1).tolist() == [2, 0, 3]
    assert pruned.config.attnkit_head_counts == [2, 0, 3]
    assert count_parameters(pruned) < count_parameters(model)


def zeroed_and_pruned(model, heads, enc):
    """The last hidden states of `model` with `heads` zeroed, those of a pruned copy on the same inputs, and the copy."""
    with torch.no_grad(), attnkit.intervene(model, attnkit.Intervention.from_heads(model, heads, mode="zero")):
        expect = model(**enc).last_hidden_state
    pruned = prune_heads(copy.deepcopy(model), heads)
    with torch.no_grad():
        got = pruned(**enc).last_hidden_state
    return expect, got, pruned


def test_the_real_minilm_pruned_equals_it_zeroed(minilm):
    model, tok = minilm
    heads = [(l, h) for l in range(6) for h in range(12) if (3 * l + h) % 2 == 0] + [(4, h) for h in range(12)]
    heads = list(dict.fromkeys(heads))
    enc = tok(["The bridge was long, and the river below was wide.", "Short."],
              ["Where is the river?", "A pair."], padding=True, return_tensors="pt")
    expect, got, pruned = zeroed_and_pruned(model, heads, enc)
    scale = expect.abs().max().item()
    assert (valid(got - expect, enc)).abs().max().item() <= 1e-6 * scale * 10  # fp32 rounding over 6 layers
    assert pruned_head_grid(pruned).sum() == 72 - len(heads)


def test_pruning_twice_keeps_the_original_numbering():
    model = tiny("bert")
    inputs = inputs_of_three()
    once = prune_heads(prune_heads(copy.deepcopy(model), [(0, 1), (2, 0)]), [(0, 3), (2, 2)])
    expect = zeroed_reference(model, [(0, 1), (2, 0), (0, 3), (2, 2)], inputs)
    with torch.no_grad():
        torch.testing.assert_close(valid(once(**inputs).last_hidden_state, inputs), valid(expect, inputs), atol=2e-6,
                                   rtol=1e-5)
    assert once.config.attnkit_heads == [[0, 2], [0, 1, 2, 3], [1, 3]]
    with pytest.raises(AttnkitError, match="head L0H1 was already pruned from this model"):
        prune_heads(once, [(0, 1)])
    with pytest.raises(AttnkitError, match="head L3H0 is outside this model's 3 layers × 4 heads"):
        prune_heads(once, [(3, 0)])
    assert once.config.attnkit_heads == [[0, 2], [0, 1, 2, 3], [1, 3]]  # a refused call changes nothing


def test_save_and_load_with_attnkit_and_plain_transformers(tmp_path):
    model, tok = tiny_bert(3, 4)
    inputs = {k: v for k, v in tok(["the cat sat on the mat", "a dog"], ["is it here", "then"], padding=True,
                                   return_tensors="pt").items()}
    expect = zeroed_reference(model, HEADS, inputs)
    pruned = prune_heads(copy.deepcopy(model), HEADS)
    pruned.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    saved = json.loads((tmp_path / "m" / "config.json").read_text())
    assert saved["attnkit_heads"] == [[0, 2], [], [0, 1, 3]] and saved["num_attention_heads"] == 4
    plain = load_pruned_model(tmp_path / "m")  # transformers only: no attnkit attention
    assert plain.config._attn_implementation != "attnkit"
    loaded, _ = attnkit.load_model(tmp_path / "m", device="cpu")
    for m in (plain, loaded):
        with torch.no_grad():
            got = m(**inputs).last_hidden_state
        torch.testing.assert_close(valid(got, inputs), valid(expect, inputs), atol=2e-6, rtol=1e-5)
    with pytest.raises(Exception):  # noqa: B017 - transformers alone cannot load it: that is why the loader exists
        AutoModel.from_pretrained(tmp_path / "m")
    with pytest.raises(AttnkitError, match="is not a pruned model"):
        (tmp_path / "full").mkdir()
        model.save_pretrained(tmp_path / "full")
        load_pruned_model(tmp_path / "full")


def test_a_classifier_keeps_its_head_and_loads_bare_or_with_it(tmp_path):
    torch.manual_seed(0)
    clf = BertForSequenceClassification(BertConfig(num_labels=3, **tiny_config(3, 40))).eval()
    inputs = inputs_of_three()
    pruned = prune_heads(copy.deepcopy(clf), HEADS)
    pruned.save_pretrained(tmp_path / "clf")
    with torch.no_grad():
        logits = pruned(**inputs).logits
        hidden = pruned.bert(**inputs).last_hidden_state
    back = load_pruned_model(tmp_path / "clf", AutoModelForSequenceClassification)
    bare = load_pruned_model(tmp_path / "clf")
    with torch.no_grad():
        torch.testing.assert_close(back(**inputs).logits, logits, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(bare(**inputs).last_hidden_state, hidden, atol=1e-6, rtol=1e-6)


def test_measurements_of_a_pruned_model_are_those_of_the_zeroed_full_model():
    model, tok = tiny_bert(3, 4)
    texts = ["the cat sat on the mat, and the dog ran.", ("is it here?", "the red house is here."), "a dog."]
    full = attnkit.instrument(copy.deepcopy(model), tok)
    pruned = attnkit.instrument(prune_heads(copy.deepcopy(model), HEADS), tok)
    iv = attnkit.Intervention.from_heads(full, HEADS, mode="zero")
    for weighting in ("attention", "norm"):
        with attnkit.intervene(full, iv):
            expect = attnkit.extract(texts, (full, tok), max_length=32, weighting=weighting)
        got = attnkit.extract(texts, (pruned, tok), max_length=32, weighting=weighting, per_sample=True)
        assert got.mean.shape == (3, 4, 28)
        # the heads the model kept measure as in the zeroed full model; a removed head has no attention, so no
        # features: NaN (never 0), in the means, the stds and every sample's row, and named in meta
        removed = np.zeros((3, 4), dtype=bool)
        removed[1], removed[0, [1, 3]], removed[2, 2] = True, True, True
        np.testing.assert_allclose(got.mean[~removed], expect.mean[~removed], atol=1e-5)
        assert np.isnan(got.mean[removed]).all() and np.isnan(got.std[removed]).all()
        assert np.isnan(got.per_sample[:, removed]).all() and np.isfinite(got.per_sample[:, ~removed]).all()
        assert np.isfinite(got.mean[~removed]).all()
        assert got.meta["removed_heads"] == [[0, 1], [0, 3], [1, 0], [1, 1], [1, 2], [1, 3], [2, 2]]
        assert (got.removed == removed).all() and got.n_removed == 7
    # an intervention on a pruned model names heads in the unpruned numbering
    more = attnkit.Intervention.from_heads(pruned, [(2, 1)], mode="uniform")
    both = attnkit.Intervention.from_heads(full, HEADS, mode="zero").set(2, 1, mode="uniform")
    enc = tok(["the cat sat on the mat"], return_tensors="pt")
    with torch.no_grad(), attnkit.intervene(pruned, more):
        got = pruned(**enc).last_hidden_state
    with torch.no_grad(), attnkit.intervene(full, both):
        expect = full(**enc).last_hidden_state
    torch.testing.assert_close(got, expect, atol=2e-6, rtol=1e-5)


def test_gates_of_removed_heads_get_no_importance():
    from attnkit.ablation import head_importance

    model, tok = tiny_bert(3, 4)
    pruned = attnkit.instrument(prune_heads(copy.deepcopy(model), HEADS), tok)
    enc = tok(["the cat sat on the mat", "a big red house"], padding=True, return_tensors="pt")

    def losses():
        for i in range(2):
            out = pruned(**{k: v[i:i + 1] for k, v in enc.items()}).last_hidden_state
            yield out.pow(2).mean()

    imp = head_importance(pruned, losses, normalize_layers=False)["raw"]
    kept = pruned_head_grid(pruned)
    assert (imp[~kept] == 0).all() and (imp[kept] > 0).all()


def test_sizes_count_what_was_removed():
    model = tiny("bert")
    inputs = reference_inputs(model, 2, 16)
    T, L, D, hidden = 2 * 16, 16, 8, 32
    flops = [forward_flops(m, inputs) for m in (model, prune_heads(copy.deepcopy(model), HEADS))]
    # per head: q, k, v and output projections 4 · 2·T·hidden·D, the two attention products 2 · 2·B·L²·D
    assert flops[0] - flops[1] == len(HEADS) * (8 * T * hidden * D + 4 * 2 * L * L * D)
    params = count_parameters(model) - len(HEADS) * (3 * (hidden * D + D) + hidden * D)
    rows = pruned_sizes(model, [[], HEADS], repeats=1, batch_size=2, length=16)
    assert rows[0]["params"] == count_parameters(model) and rows[1]["params"] == params
    assert rows[0]["flops_per_token"] == flops[0] / T and rows[1]["flops_per_token"] == flops[1] / T
    assert all(r["tokens_per_s"] > 0 for r in rows)


def importance_curve(model, tok, **kwargs):
    """run_experiment("importance") on `model` (instrumented here) with a tiny differentiable task."""
    from attnkit.ablation import run_experiment

    model = attnkit.instrument(model, tok)
    enc = tok(["the cat sat on the mat", "a big red house"], padding=True, return_tensors="pt")

    def evaluate(iv):
        with torch.no_grad(), attnkit.intervene(model, iv):
            return {"score": float(model(**enc).last_hidden_state.pow(2).mean())}

    def losses():
        for i in range(2):
            yield model(**{k: v[i:i + 1] for k, v in enc.items()}).last_hidden_state.pow(2).mean()

    return run_experiment("importance", model, evaluate, "score", losses=losses, progress=False, n_boot=10, **kwargs)


def test_the_importance_curve_gives_each_step_the_size_of_its_pruned_model():
    """ablate --experiment importance: each step's params and FLOPs are those of prune_heads on that step's heads,
    counted here from the model itself; mode uniform (nothing removable) adds no size columns."""
    model, tok = tiny_bert(3, 4)
    table = importance_curve(model, tok, mode="zero", step=0.25, max_share=0.5)
    assert [r["pruned"] for r in table.rows] == [0, 3, 6]
    inputs = reference_inputs(model)
    T = inputs["input_ids"].numel()
    gone: list = []
    for r in table.rows:
        gone += attnkit.interventions.parse_heads(r["newly_pruned"], (3, 4)) if r["newly_pruned"] else []
        pruned = prune_heads(copy.deepcopy(model), gone)
        assert r["params"] == count_parameters(pruned), r
        assert r["flops_per_token"] == forward_flops(pruned, inputs) / T, r
        assert r["tokens_per_s"] > 0
    assert table.rows[2]["params"] < table.rows[1]["params"] < table.rows[0]["params"]
    uniform = importance_curve(model, tok, mode="uniform", step=0.25, max_share=0.25)
    assert all("params" not in r for r in uniform.rows)


def test_the_importance_curve_of_an_already_pruned_model_steps_through_the_heads_it_has():
    """Removed heads have importance 0; they must not be the curve's first 'pruned' heads, nor in its ranking."""
    model, tok = tiny_bert(3, 4)
    model = prune_heads(model, HEADS)
    has = pruned_head_grid(model)
    table = importance_curve(model, tok, mode="zero", step=0.5)
    n = int(has.sum())
    assert [r["pruned"] for r in table.rows] == [0, n // 2, n] and table.rows[-1]["share"] == 1.0
    newly = [h for r in table.rows if r["newly_pruned"]
             for h in attnkit.interventions.parse_heads(r["newly_pruned"], (3, 4))]
    assert sorted(newly) == sorted(map(tuple, np.argwhere(has).tolist()))  # each head it has, once; no removed one
    ranked = attnkit.interventions.parse_heads(table.extra["ranking"], (3, 4))
    assert sorted(ranked) == sorted(newly)
    assert table.rows[-1]["params"] < table.rows[0]["params"] == count_parameters(model)


# --- the command line -------------------------------------------------------------------------------------------
def run(*args):
    res = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return res.exit_code, res.output


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model, tok = tiny_bert(3, 4)
    d = tmp_path_factory.mktemp("tiny") / "model"
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_prune_command_and_its_refusals(model_dir, tmp_path):
    out = tmp_path / "pruned"
    res = CliRunner().invoke(main, ["prune", str(model_dir), "--heads", "L1,L0H1,L0H3,L2H2", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert res.stderr.splitlines() == [f"attnkit prune: loading {model_dir}",
                                       f"attnkit prune: removing 7 head(s) and writing {out}"]
    code, text = res.exit_code, res.stdout
    assert "heads per layer now: 2 0 3 (5 in all)" in text
    model, _ = attnkit.load_model(out, device="cpu")
    assert pruned_head_grid(model).sum(1).tolist() == [2, 0, 3]
    umask = os.umask(0)  # the files get the mode any new file gets (model.safetensors was 0600)
    os.umask(umask)
    assert {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()} == {
        f.name: 0o666 & ~umask for f in out.iterdir()}
    for args, message in [
        (("--heads", "L0H1", "-o", out), f"Error: --out '{out}' already exists: use --overwrite to replace it"),
        (("--heads", "L0H4", "-o", tmp_path / "x"), "Error: head L0H4 is outside this model's 3 layers × 4 heads"),
        (("--heads", "L0-1", "-o", tmp_path / "x"), "Error: cannot read head 'L0-1': write heads as L<layer>H<head>"),
        (("--heads", ",", "-o", tmp_path / "x"), "Error: --heads names no head"),
        (("--fraction", "0.5", "-o", tmp_path / "x"), "Error: --fraction needs --importance FILE"),
        (("-o", tmp_path / "x"), "Error: give the heads to remove with --heads or --importance"),
        (("--heads", "L0H1", "--fraction", "0.5", "-o", tmp_path / "x"), "Error: --fraction goes with --importance"),
        (("--heads", "L0H1", "-o", model_dir), "is the model being pruned"),
    ]:
        code, text = run("prune", model_dir, *args, "-q")
        assert code == 1 and message in text and len(text.strip().splitlines()) == 1, (args, text)
    code, text = run("prune", out, "--heads", "L1H2", "-o", tmp_path / "x")
    assert code == 1 and "head L1H2 was already pruned from this model" in text
    (tmp_path / "file").write_text("x")
    code, text = run("prune", model_dir, "--heads", "L0H1", "-o", tmp_path / "file")
    assert code != 0 and not (tmp_path / "file").is_dir()
    # --overwrite replaces the directory
    res = CliRunner().invoke(main, ["prune", str(model_dir), "--heads", "L2H0", "-o", str(out), "--overwrite", "-q"])
    assert res.exit_code == 0 and res.stderr == "", res.output
    assert pruned_head_grid(attnkit.load_model(out, device="cpu")[0]).sum() == 11


def test_prune_by_importance_follows_the_iterative_order(model_dir, tmp_path):
    rows = [{"setting": "baseline", "newly_pruned": ""}, {"setting": "prune 3 heads", "newly_pruned": "L2H1,L0H0,L1H3"},
            {"setting": "prune 6 heads", "newly_pruned": "L1H0,L1H1,L0H2"}]
    imp = {"experiment": "importance", "main_metric": "spearman", "rows": rows,
           "importance": np.ones((3, 4)).tolist()}
    d = tmp_path / "ablation"
    d.mkdir()
    (d / "importance.json").write_text(json.dumps(imp))
    out = tmp_path / "p"
    code, text = run("prune", model_dir, "--importance", d, "--fraction", "0.34", "-o", out)  # 4 of 12 heads
    assert code == 0, text
    assert "removed 4 head(s): L2H1,L0H0,L1H3,L1H0" in text
    # on the pruned model, the heads already gone are skipped
    code, text = run("prune", out, "--importance", d / "importance.json", "--fraction", "0.5", "-o", tmp_path / "q")
    assert code == 0 and "removed 2 head(s): L1H1,L0H2" in text, text
    for fraction, status, message in [
            ("0", 2, "Invalid value for '--fraction': 0.0 is not in the range 0<x<=1"),  # a usage error (issue 25)
            ("1.5", 2, "Invalid value for '--fraction': 1.5 is not in the range 0<x<=1"),
            ("0.01", 1, "--fraction 0.01 of 12 heads rounds to no head"),
            ("0.75", 1, "orders 6 of the 12 heads, fewer than the 9 that --fraction 0.75 asks for")]:
        code, text = run("prune", model_dir, "--importance", d, "--fraction", fraction, "-o", tmp_path / "z")
        assert code == status and message in text, text
        assert not (tmp_path / "z").exists()
    (d / "importance.json").write_text(json.dumps({**imp, "importance": [[1.0]]}))
    code, text = run("prune", model_dir, "--importance", d, "--fraction", "0.5", "-o", tmp_path / "z")
    assert code == 1 and "ranks 1 layers × 1 heads, but the model has 3 × 4" in text
    (d / "importance.json").write_text(json.dumps({**imp, "experiment": "heads"}))
    code, text = run("prune", model_dir, "--importance", d, "--fraction", "0.5", "-o", tmp_path / "z")
    assert code == 1 and "field experiment: must be \"importance\"" in text


@pytest.mark.slow
def test_every_command_leaves_the_removed_heads_of_a_pruned_model_out(model_dir, tmp_path):
    """A removed head has no attention: NaN features (never 0), named in meta.json, and every analysis leaves it
    out and says how many it left out (issue: a cluster of all-zero heads, averages pulled down by them)."""
    import csv

    out = tmp_path / "pruned"
    assert run("prune", model_dir, "--heads", "L1,L0H1", "-o", out)[0] == 0
    removed = [[0, 1], [1, 0], [1, 1], [1, 2], [1, 3]]
    gone = np.zeros((3, 4), dtype=bool)
    gone[tuple(np.array(removed).T)] = True
    corpus = tmp_path / "corpus.txt"
    rng = np.random.default_rng(0)
    corpus.write_text("\n".join(" ".join(rng.choice(WORDS, 6 + i % 5)) + (" ." if i % 2 else " , then ran .")
                                for i in range(40)) + "\n")
    runs, norm = tmp_path / "run", tmp_path / "norm"
    outputs = {}
    for name, args in (
            ("extract", ["extract", corpus, "--model", out, "-o", runs, "--max-length", 32, "--per-sample", "-q"]),
            ("norm", ["extract", corpus, "--model", out, "-o", norm, "--max-length", 32, "-q", "--weighting", "norm"]),
            ("distances", ["distances", runs, "-q"]),
            ("cluster", ["cluster", runs, "-k", 2, "--stability", 2, "--seeds", 1, "-q"]),
            ("patterns", ["patterns", runs]), ("export", ["export", runs, "-o", tmp_path / "t.csv"]),
            ("compare", ["compare", runs, norm]),
            ("compare-models", ["compare-models", model_dir, out, corpus, "-o", tmp_path / "cmp", "--max-length", 32,
                                "-q"])):
        code, text = run(*args)
        assert code == 0, (args, text)
        outputs[name] = text
    feats = attnkit.HeadFeatures.load(runs)
    assert feats.meta["removed_heads"] == removed and (feats.removed == gone).all()
    assert np.isnan(feats.mean[gone]).all() and np.isfinite(feats.mean[~gone]).all()
    assert np.isnan(feats.per_sample[:, gone]).all() and np.isfinite(feats.per_sample[:, ~gone]).all()
    # distances: the removed heads' rows are NaN; the summary is over the 7 others
    dist = attnkit.run.HeadDistances.load(runs)
    assert dist.meta["removed_heads"] == removed and np.isnan(dist.per_token[gone.reshape(-1)]).all()
    assert np.isfinite(dist.per_token[np.ix_(~gone.reshape(-1), ~gone.reshape(-1))]).all()
    assert "left out 5 head(s) removed by pruning" in outputs["distances"]
    # cluster: 7 heads in 2 clusters, the removed ones in none
    data = json.loads((runs / "clusters.json").read_text())
    assert data["removed_heads"] == removed and len(data["heads"]) == 7
    assert sum(c["n_heads"] for c in data["clusters"]) == 7
    assert "3 layers × 4 heads (5 removed by pruning left out)" in outputs["cluster"]
    assert "  L1   - - - -" in outputs["cluster"]
    # patterns: the removed heads have no class and count in no share
    pat = json.loads((runs / "patterns.json").read_text())
    labels = np.load(runs / "pattern_labels.npy")
    assert (labels[:, gone] == -1).all() and (labels[:, ~gone] >= 0).all()
    assert pat["removed_heads"] == removed and pat["weighting"] == "attention" and pat["n_examples"] == 40
    assert all(pat["per_layer"][c][1] is None for c in pat["classes"])
    assert pat["per_head"]["vertical"][0][1] is None and pat["per_head"]["vertical"][0][0] is not None
    assert abs(sum(pat["overall"].values()) - 1) < 1e-9
    assert "left out 5 head(s) removed by pruning" in outputs["patterns"]
    # export: empty cells for removed heads, and the column count it states is the file's
    with open(tmp_path / "t.csv") as f:
        table = list(csv.reader(f))
    assert len(table) == 13 and len(table[0]) == 2 + 2 * 28 and table[0][:3] == ["layer", "head", "cls"]
    assert table[2][2:] == [""] * 56 and all(c != "" for c in table[1])  # L0H1 removed, L0H0 kept
    assert "12 rows, one per head × 58 columns" in outputs["export"]
    assert "5 head(s) removed by pruning have empty (NaN) cells" in outputs["export"]
    assert "(5 removed by pruning left out)" in outputs["compare"]
    # compare-models: no cosine for a head removed from B
    cmp = json.loads((tmp_path / "cmp" / "compare_models.json").read_text())
    assert cmp["removed_heads"] == removed and cmp["row_cosine"][0][1] is None and cmp["per_layer"]["row_cosine"][1] is None
    assert cmp["row_cosine"][0][0] is not None and "L1   no head left" in outputs["compare-models"]
    assert "left out 5 head(s) removed by pruning from A or B" in outputs["compare-models"]
    assert all(h["layer"] != 1 for h in cmp["most_changed"])
    # the report draws the run with its clusters.json (removed heads listed apart) and distances
    code, text = run("report", runs, "-q", "--no-svg", "--examples", 1)
    assert code == 0, text
    page = (runs / "report.html").read_text()
    assert "removed" in page
    stsb = tmp_path / "dev.tsv"
    stsb.write_text("index\tgenre\tsentence1\tsentence2\tscore\n" + "".join(
        f"{i}\tx\t{' '.join(rng.choice(WORDS, 5))}\t{' '.join(rng.choice(WORDS, 4))}\t{i % 5}.0\n" for i in range(8)))
    # ablate: removed heads are no settings (12 heads − 5 removed = 7 settings after the baseline); layer 1 has none
    for experiment, n_rows in (("heads", 8), ("layers", 3)):
        code, text = run("ablate", out, "--task", "stsb", "--data", stsb, "--experiment", experiment, "-o",
                         tmp_path / experiment, "--quiet", "--resamples", 0)
        assert code == 0, text
        res = json.loads((tmp_path / experiment / f"{experiment}.json").read_text())
        assert len(res["rows"]) == n_rows and res["removed_heads"] == removed, experiment
        assert "5 head(s) removed by pruning left out" in text
    assert not any(r.get("layer") == 1 for r in res["rows"])
    # Michel's curve on a model pruned before: the sizes of every step are those of the heads it still has
    code, text = run("ablate", out, "--task", "stsb", "--data", stsb, "--experiment", "importance", "--step", 0.5,
                     "-o", tmp_path / "imp", "--quiet")
    assert code == 0, text
    sizes = [r["params"] for r in json.loads((tmp_path / "imp" / "importance.json").read_text())["rows"]
             if r.get("params") is not None]
    assert len(sizes) >= 2 and sizes == sorted(sizes, reverse=True)
    conllu = tmp_path / "t.conllu"
    sent = [("the", 2, "det"), ("cat", 3, "nsubj"), ("sat", 0, "root"), ("on", 6, "case"), ("the", 6, "det"),
            ("mat", 3, "obl")]
    conllu.write_text("".join("".join(f"{j + 1}\t{w}\t{w}\t_\t_\t_\t{h}\t{r}\t_\t_\n" for j, (w, h, r) in
                                      enumerate(sent)) + "\n" for _ in range(12)))
    code, text = run("probe", conllu, "--model", out, "-o", tmp_path / "probe", "--min-count", 1, "-q")
    assert code == 0, text
    assert "left out 5 head(s) removed by pruning" in text
    probe = json.loads((tmp_path / "probe" / "probe.json").read_text())
    assert probe["removed_heads"] == removed
    assert all(not gone[b["best"]["layer"], b["best"]["head"]] for b in probe["relations"].values())
    with open(tmp_path / "probe" / "probe.csv") as f:
        heads = {(int(r["layer"]), int(r["head"])) for r in csv.DictReader(f)}
    assert len(heads) == 7 and (0, 1) not in heads


def test_unknown_architectures_are_refused():
    from transformers import AlbertConfig, AlbertModel

    torch.manual_seed(0)
    model = AlbertModel(AlbertConfig(vocab_size=30, embedding_size=8, hidden_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=32))
    with pytest.raises(AttnkitError, match="pruning heads needs to know where a 'albert' model keeps its attention "
                                           "projections; supported model types: bart, bert, camembert, clip_vision_model"):
        prune_heads(model, [(0, 0)])


def test_maps_in_training_and_head_values_of_removed_heads(model_dir, tmp_path):
    """Maps of a pruned layer cover the unpruned heads in training mode as in eval mode; a patch or mean value for
    a removed head is refused (it would silently do nothing, unlike on the full model with the head zeroed)."""
    out = tmp_path / "pruned"
    assert run("prune", model_dir, "--heads", "L0H1", "-o", out)[0] == 0
    model, tok = attnkit.load_model(str(out))
    H = model.config.num_attention_heads
    for m in model.modules():  # attention dropout on: the training branch of the attention function
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.5
    enc = tok(["the cat sat", "a dog ran on the mat"], padding=True, return_tensors="pt")
    L = enc["input_ids"].shape[1]
    for train in (True, False):
        model.train(train)
        maps = model(**enc, output_attentions=True).attentions
        assert [tuple(m.shape) for m in maps] == [(2, H, L, L)] * model.config.num_hidden_layers, train
        assert float(maps[0][:, 1].abs().sum()) == 0.0  # the removed head's map
    model.eval()
    D = model.config.hidden_size // H
    iv = attnkit.Intervention.for_model(model).set(0, 1, mode="mean", value=torch.ones(D))
    with pytest.raises(AttnkitError, match="^head L0H1 was pruned from this model: it has no output to patch"):
        with attnkit.intervene(model, iv):
            model(**enc)
