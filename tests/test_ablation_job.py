"""ablate: gold scores that make the metric undefined are refused, --limit/--sample, -q, -o checked
before the work and written atomically, SQuAD JSON validated, the output directory locked."""
import json
import os

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from transformers import BertConfig, BertModel, BertTokenizerFast

from attnkit import AttnkitError
from attnkit.ablation import ResultTable, get_task, run_settings
from attnkit.ablation.data import subset
from attnkit.ablation.experiments import Setting
from attnkit.ablation.tasks import SquadTask
from attnkit.cli.ablate import ablate
from attnkit.interventions import Intervention

WORDS = "a man woman is playing riding guitar horse dog cat the on big small".split()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ",", "?", "!"] + WORDS
    tok = BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=64)).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def stsb(path, scores):
    rng = np.random.default_rng(0)
    lines = ["index\tgenre\tsentence1\tsentence2\tscore"]
    for i, s in enumerate(scores):
        a, b = (" ".join(rng.choice(WORDS, size=4)) + "." for _ in range(2))
        lines.append(f"{i}\tx\t{a}\t{b}\t{s}")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def run_ablate(model_dir, data, out, *extra):
    return CliRunner().invoke(ablate, [model_dir, "--task", "stsb", "--data", data, "--experiment", "layers",
                                       "-o", str(out), "-q", *extra])


@pytest.mark.parametrize("scores, problem", [
    (["1.0", "nan", "2.0", "3.0"], ":3: score 'nan' is not a finite number"),
    (["1.0", "2.0", "inf", "3.0"], ":4: score 'inf' is not a finite number"),
    (["2.5"] * 5, "every gold score of the 5 examples evaluated is 2.5"),
])
def test_undefined_gold_is_refused_naming_the_file(tmp_path, scores, problem):
    data = stsb(tmp_path / "dev.tsv", scores)
    with pytest.raises(AttnkitError) as e:
        get_task("stsb", data)
    assert str(e.value).startswith(data) and problem in str(e.value)


def test_constant_gold_in_the_evaluated_examples_is_refused(model_dir, tmp_path):
    data = stsb(tmp_path / "dev.tsv", ["3.0", "3.0", "3.0", "1.0", "4.0", "0.5"])
    r = run_ablate(model_dir, data, tmp_path / "out", "--limit", "3")
    assert r.exit_code == 1, r.output
    assert r.output.strip() == (f"Error: {data}: every gold score of the 3 examples evaluated is 3, so the Spearman "
                                "and Pearson correlations are undefined; use a file (or --limit/--sample) whose "
                                "scores vary")
    assert not (tmp_path / "out" / "layers.csv").exists()
    r = run_ablate(model_dir, data, tmp_path / "out", "--sample", "1")
    assert r.exit_code == 1 and "1 example(s) evaluated, but the Spearman and Pearson correlations need at least two" \
        in r.output
    r = run_ablate(model_dir, data, tmp_path / "out")
    assert r.exit_code == 0, r.output
    rows = json.loads((tmp_path / "out" / "layers.json").read_text())["rows"]
    assert rows[0]["n"] == 6 and np.isfinite(rows[0]["spearman"])


def test_limit_is_the_first_n_and_sample_spreads(model_dir, tmp_path):
    data = stsb(tmp_path / "dev.tsv", [f"{(i * 7) % 11 / 2:.1f}" for i in range(12)])
    task = get_task("stsb", data)
    first = task.examples[:5]
    assert get_task("stsb", data).head(5).examples == first
    assert subset(12, 4) == [0, 4, 7, 11]
    r = run_ablate(model_dir, data, tmp_path / "a", "--limit", "5")
    assert r.exit_code == 0, r.output
    meta = json.loads((tmp_path / "a" / "layers.meta.json").read_text())
    assert meta["limit"] == 5 and meta["sample"] is None and meta["n_examples"] == 5
    r = run_ablate(model_dir, data, tmp_path / "b", "--sample", "4")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "b" / "layers.meta.json").read_text())["n_examples"] == 4
    # the two subsets differ, so do the baselines
    a = json.loads((tmp_path / "a" / "layers.json").read_text())["rows"][0]["spearman"]
    b = json.loads((tmp_path / "b" / "layers.json").read_text())["rows"][0]["spearman"]
    assert a != b


def test_quiet_short_option_and_no_bars(model_dir, tmp_path):
    data = stsb(tmp_path / "dev.tsv", ["1", "2", "3", "4"])
    r = run_ablate(model_dir, data, tmp_path / "out")  # run_ablate passes -q
    assert r.exit_code == 0, r.output
    assert r.stderr == ""


def test_earlier_tables_are_not_replaced_without_overwrite(model_dir, tmp_path):
    data = stsb(tmp_path / "dev.tsv", ["1", "2", "3", "4"])
    out = tmp_path / "out"
    r = run_ablate(model_dir, data, out)
    assert r.exit_code == 0, r.output
    assert r.output.strip().splitlines()[-1] == (f"wrote {out}/layers.csv, {out}/layers.json, {out}/layers.md, "
                                                 f"{out}/layers.examples.csv, {out}/layers.png, "
                                                 f"{out}/layers.meta.json")
    before = (out / "layers.json").read_text()
    r = run_ablate(model_dir, data, out, "--limit", "3")
    assert r.exit_code == 1 and r.output.strip() == (
        f"Error: {out}/{{layers.csv, layers.json, layers.md, layers.examples.csv, layers.png, layers.meta.json}} "
        f"already exist: give --overwrite to replace them (it removes {out}/{{layers.csv, layers.json, layers.md, "
        "layers.examples.csv, layers.png, layers.meta.json}), or write elsewhere")
    assert (out / "layers.json").read_text() == before
    r = run_ablate(model_dir, data, out, "--limit", "3", "--overwrite")
    assert r.exit_code == 0 and f"--overwrite removed {out}/{{layers.csv, layers.json" in r.output
    assert json.loads((out / "layers.meta.json").read_text())["limit"] == 3


def test_output_under_a_file_fails_before_the_model_loads(tmp_path):
    data = stsb(tmp_path / "dev.tsv", ["1", "2", "3"])
    (tmp_path / "f").write_text("x")
    r = run_ablate(str(tmp_path / "no-model"), data, tmp_path / "f" / "out")
    assert r.exit_code == 1 and "is a file, not a directory" in r.output and "not found" not in r.output


def test_tables_on_a_full_disk_are_one_line_and_leave_no_temp_files(tmp_path, full_disk):
    table = ResultTable("heads", "spearman", [{"setting": "baseline", "spearman": 50.0}])
    with pytest.raises(AttnkitError, match=r"could not write .*heads\.csv: No space left on device"):
        table.save(str(tmp_path / "out"))
    assert os.listdir(tmp_path / "out") == []


def test_nan_baseline_is_refused():
    settings = [Setting("baseline", Intervention.identity(1, 2)), Setting("x", Intervention.identity(1, 2))]
    with pytest.raises(AttnkitError, match="baseline spearman is NaN"):
        run_settings("heads", settings, lambda iv: {"spearman": float("nan")}, "spearman", progress=False)
    values = iter([50.0, float("nan")])
    table = run_settings("heads", settings, lambda iv: {"spearman": next(values)}, "spearman", progress=False)
    assert table.rows[0]["spearman"] == 50.0 and np.isnan(table.rows[1]["spearman"])


@pytest.mark.parametrize("content, problem", [
    ({"data": ["a string"]}, "field data[0]: expected an object, got a string"),
    ({"data": [{"paragraphs": [{"context": 5, "qas": []}]}]}, "field data[0].paragraphs[0].context: expected a string"),
    ({"data": [{"paragraphs": [{"context": "c", "qas": [7]}]}]}, "field data[0].paragraphs[0].qas[0]: expected an object"),
    ({"data": [{"paragraphs": [{"context": "c", "qas": [{"id": "1", "question": "q?",
                                                          "answers": [{"text": "c", "answer_start": "0"}]}]}]}]},
     "answers[0].answer_start: expected an integer"),
    ({"version": "1.1"}, "missing 'data'"),
    ([1, 2], "expected an object, got an array"),
])
def test_squad_structure_is_validated(tmp_path, content, problem):
    (tmp_path / "squad.json").write_text(json.dumps(content))
    with pytest.raises(AttnkitError) as e:
        SquadTask(str(tmp_path / "squad.json"))
    assert str(e.value).startswith(str(tmp_path / "squad.json")) and problem in str(e.value)


def test_second_ablate_into_the_same_directory_is_refused(tmp_path, lock_held):
    data = stsb(tmp_path / "dev.tsv", ["1", "2", "3"])
    out = tmp_path / "out"
    with lock_held(out, "attnkit ablate") as pid:
        r = run_ablate("default", data, out)
    assert r.exit_code == 1
    assert r.output.strip() == (f"Error: {out} is in use by `attnkit ablate` (pid {pid}); wait for it to finish "
                                "or choose another directory")
