"""`attnkit extract` end to end: outputs, interruption and resume, and one-line errors for bad input."""
import json
import os
import re
import signal
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from attnkit import HeadFeatures
from attnkit.cli.main import main

WORDS = "river bridge bread harbour library glacier orchestra market lighthouse forest".split()


def _write_corpus(folder):
    lines = [f"The {WORDS[i % 10]} was quiet, and the {WORDS[(i * 3) % 10]} was {'near' if i % 2 else 'far'}. "
             f"It was {i} days old." for i in range(48)]
    p = folder / "corpus.txt"
    p.write_text("\n".join(lines) + "\n")
    return p


@pytest.fixture()
def corpus(tmp_path):
    return _write_corpus(tmp_path)


def run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return result.exit_code, result.output


def test_extract_writes_run_directory(corpus, tmp_path):
    out = tmp_path / "run"
    code, text = run("extract", corpus, "-o", out, "--max-length", 12, "--limit", 10, "-q", "--backend", "reference")
    assert code == 0, text
    assert "10 samples" in text and "truncated" in text
    feats = HeadFeatures.load(out)
    assert feats.mean.shape == (6, 12, 28) and feats.n_samples == 10
    np.testing.assert_allclose(feats.mean[..., :21].sum(-1), 1.0, atol=1e-5)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["settings"]["max_length"] == 12 and meta["n_truncated"] > 0
    assert meta["backend"] in ("reference", "fused-cpu") and "torch" in meta["versions"]
    with np.load(out / "features.npz") as z:
        assert set(z.files) == {"mean", "std", "names"}
    # a finished run is never silently replaced
    code, text = run("extract", corpus, "-o", out, "-q")
    assert code == 1 and "already holds a finished run" in text
    assert HeadFeatures.load(out).n_samples == 10


def _extract_args(corpus, out, *extra):
    return ["extract", corpus, "-o", out, "--batch-size", 1, "--checkpoint-every", 1, "-q", "--backend", "reference",
            "--max-length", 24, "--threads", 1, *extra]  # one thread: every run sums in the same order


@pytest.fixture(scope="module")
def uninterrupted_run(tmp_path_factory):
    """The run that every interrupted-and-resumed run must equal, extracted once for the module (it is only
    read)."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    full = folder / "full"
    assert run("extract", _write_corpus(folder), "-o", full, "--batch-size", 1, "-q", "--backend", "reference",
               "--max-length", 24, "--threads", 1)[0] == 0
    return full


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_interrupted_run_resumes_to_identical_numbers(corpus, tmp_path, sig, paused_extract, uninterrupted_run):
    full = uninterrupted_run
    part = tmp_path / "part"
    # the run stands still after its first checkpoint until the signal comes (tests/paused_extract.py): it cannot
    # finish first, however fast the machine
    proc = paused_extract(_extract_args(corpus, part))
    proc.send_signal(sig)
    proc.wait(timeout=60)
    assert proc.returncode != 0
    again = ["extract", corpus, "-o", part, "--batch-size", 1, "-q", "--backend", "reference", "--max-length", 24,
             "--resume"]
    if sig != signal.SIGKILL:
        assert proc.returncode == 128 + sig  # 130 or 143, as a shell says
        # the hint is the whole command to continue with: the one that ran, with --resume
        again = _resume_hint(proc.stderr.read().decode())
        assert again == ["attnkit", *map(str, _extract_args(corpus, part)), "--resume"]
        again = again[1:]
    assert (part / "checkpoint.npz").exists() and not (part / "features.npz").exists()
    with np.load(part / "checkpoint.npz") as z:
        assert 0 < int(z["next_index"]) < 48
    code, text = run(*again)
    assert code == 0, text
    a, b = HeadFeatures.load(full), HeadFeatures.load(part)
    assert b.n_samples == 48 and b.n_tokens == a.n_tokens
    np.testing.assert_array_equal(a.mean, b.mean)
    np.testing.assert_array_equal(a.std, b.std)
    assert not (part / "checkpoint.npz").exists()


def test_an_interrupted_run_of_units_resumes_at_a_unit_to_identical_numbers(corpus, tmp_path, paused_extract):
    """Batches of several samples are planned in units (attnkit/engine/plan.py): a checkpoint falls at the end of a
    unit, and the resumed run cuts the rest of the plan into the same units and forwards."""
    from attnkit.engine.plan import plan_batches

    args = ["--batch-size", 2, "-q", "--backend", "reference", "--max-length", 24, "--threads", 1]
    full, part = tmp_path / "full", tmp_path / "part"
    assert run("extract", corpus, "-o", full, *args)[0] == 0
    proc = paused_extract(["extract", corpus, "-o", part, "--checkpoint-every", 1, *args])
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    assert proc.returncode == 130
    segments = [ln for ln in Path(corpus).read_text().splitlines() if ln.strip()]
    units = list(plan_batches(segments, 2, 4096, grouped=True))
    assert max(pb.n_forwards for pb in units) > 1
    with np.load(part / "checkpoint.npz") as z:
        assert int(z["next_index"]) in {pb.end for pb in units[:-1]}
    code, text = run("extract", corpus, "-o", part, *args, "--resume")
    assert code == 0, text
    a, b = HeadFeatures.load(full), HeadFeatures.load(part)
    assert b.n_samples == a.n_samples == len(segments) and b.n_tokens == a.n_tokens
    np.testing.assert_allclose(b.mean, a.mean, rtol=1e-12, atol=0)
    np.testing.assert_allclose(b.std, a.std, rtol=1e-9, atol=1e-12)


def _resume_hint(stderr: str) -> list[str]:
    """The command an interrupted extract says to continue with, as arguments."""
    import shlex

    m = re.search(r"checkpoint saved\. Continue with: (.+)$", stderr.strip())
    assert m, stderr
    return shlex.split(m.group(1))


def test_resume_errors(corpus, tmp_path):
    out = tmp_path / "r"
    code, text = run("extract", corpus, "-o", out, "--resume", "-q")
    assert code == 1 and "nothing to resume" in text
    out.mkdir()
    (out / "checkpoint.npz").write_bytes(b"not a zip file")
    code, text = run("extract", corpus, "-o", out, "--resume", "-q")
    assert code == 1 and "corrupt" in text
    code, text = run("extract", corpus, "-o", out, "-q")
    assert code == 1 and "interrupted run" in text
    # a checkpoint made with other settings is refused, naming the setting
    good = tmp_path / "g"
    from attnkit.run.head_features import FeatureAccumulator
    from attnkit.run.rundir import RunDir

    acc = FeatureAccumulator(6, 12, [f"f{i}" for i in range(28)])
    RunDir(good).save_checkpoint(acc, 1, 0, {"max_length": 64})
    code, text = run("extract", corpus, "-o", good, "--resume", "-q")
    assert code == 1 and "max_length" in text and "other settings" in text


def test_bad_model_inputs(corpus, tmp_path):
    code, text = run("extract", corpus, "--model", tmp_path / "nope", "-o", tmp_path / "x", "-q")
    assert code == 1 and "not found" in text
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    code, text = run("extract", corpus, "--model", broken, "-o", tmp_path / "x", "-q")
    assert code == 1 and "could not load a model" in text and "missing the weights" in text and "Traceback" not in text
    code, text = run("extract", corpus, "--max-length", 4096, "-o", tmp_path / "x", "-q")
    assert code == 1 and "exceeds the model's 512 positions" in text
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok\n\xc3\x28 broken\n")
    code, text = run("extract", bad, "-o", tmp_path / "x", "-q")
    assert code == 1 and "bad.txt:2" in text and "UTF-8" in text
    assert not (tmp_path / "x").exists()


def test_unsupported_model_type_from_disk(tmp_path, minilm):
    from transformers import DebertaV2Config, DebertaV2Model

    _, tok = minilm
    path = tmp_path / "deberta"
    DebertaV2Model(DebertaV2Config(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=1,
                                   num_attention_heads=4, intermediate_size=64)).save_pretrained(path)
    tok.save_pretrained(path)
    corpus = tmp_path / "c.txt"
    corpus.write_text("one line.\n")
    code, text = run("extract", corpus, "--model", path, "-o", tmp_path / "x", "-q")
    assert code == 1 and "deberta-v2" in text


def test_help_explains_options():
    code, text = run("extract", "--help")
    assert code == 0
    for opt in ("--model", "--max-length", "--batch-size", "--device", "--dtype", "--num-windows", "--sentences",
                "--limit", "--out", "--resume"):
        assert opt in text


def test_many_inputs_are_recorded_in_meta(corpus, tmp_path):
    import gzip

    second = tmp_path / "more" / "b.jsonl.gz"
    second.parent.mkdir()
    with gzip.open(second, "wt") as f:
        f.write('{"text": "A question?", "text_pair": "An answer."}\n{"text": "Alone."}\n')
    out = tmp_path / "run"
    code, text = run("extract", corpus, tmp_path / "more", "-o", out, "--max-length", 16, "-q", "--workers", 1,
                     "--backend", "reference")
    assert code == 0, text
    meta = json.loads((out / "meta.json").read_text())
    inputs = meta["inputs"]
    assert [i["format"] for i in inputs] == ["text", "jsonl"] and inputs[1]["compression"] == "gzip"
    assert inputs[0]["text_unit"] == "line" and inputs[0]["n_segments"] == 48 and inputs[1]["n_segments"] == 2
    assert all(len(i["sha256"]) == 64 for i in inputs)
    assert meta["n_samples"] == 50 and meta["settings"]["batch_size"] == 16 and meta["workers"] == 1
    import torch

    assert meta["threads"] == torch.get_num_threads()  # CPU numbers can depend on it (docs/pipeline.md §3)


def test_truncation_warning_suggests_a_length(corpus, tmp_path):
    code, text = run("extract", corpus, "-o", tmp_path / "t", "--max-length", 8, "-q", "--backend", "reference")
    assert code == 0, text
    m = re.search(r"warning: (\d+)% of segments were longer than --max-length 8 .* --max-length (\d+) would cover 95%", text)
    assert m and int(m.group(1)) == 100 and 18 <= int(m.group(2)) <= 30


def test_resume_refuses_impossible_checkpoints_and_other_backends(corpus, tmp_path):
    out = tmp_path / "r"
    proc_args = ("extract", corpus, "-o", out, "--max-length", 16, "-q", "--batch-size", 8)
    assert run(*proc_args, "--backend", "reference")[0] == 0
    settings = json.loads((out / "meta.json").read_text())["settings"]
    from attnkit.run.head_features import FeatureAccumulator
    from attnkit.run.rundir import RunDir

    acc = FeatureAccumulator(6, 12, json.loads((out / "meta.json").read_text())["feature_names"])
    acc.update(np.full((8, 6, 12, 28), 0.5), 80)
    ck = tmp_path / "ck"
    settings_full = settings
    RunDir(ck).save_checkpoint(acc, 8, 0, settings_full)
    code, text = run("extract", corpus, "-o", ck, "--max-length", 16, "-q", "--batch-size", 8, "--backend", "fused",
                     "--resume")
    if settings["backend"] == "reference":
        assert code == 1 and "backend" in text and "other settings" in text
    RunDir(ck).save_checkpoint(acc, 9, 0, settings_full)  # 8 samples summed for 9 segments
    code, text = run("extract", corpus, "-o", ck, "--max-length", 16, "-q", "--batch-size", 8, "--backend",
                     "reference", "--resume")
    assert code == 1 and "impossible" in text and "8 samples summed for 9 segments" in text
    acc.sum[0, 0, 0] = np.nan
    RunDir(ck).save_checkpoint(acc, 8, 0, settings_full)
    code, text = run("extract", corpus, "-o", ck, "--max-length", 16, "-q", "--batch-size", 8, "--backend",
                     "reference", "--resume")
    assert code == 1 and f"checkpoint {ck / 'checkpoint.npz'} is impossible (array 'sum' holds NaN or infinite " \
        "values for 1 of the model's 72 heads (L0H0))" in text
    # issue 46 item 6: every head's sums NaN were taken for heads removed by pruning, and resumed (exit 0) into an
    # all-NaN features.npz; the model's own pruned heads are the only ones that may be NaN
    acc.sum[:] = np.nan
    RunDir(ck).save_checkpoint(acc, 8, 0, settings_full)
    code, text = run("extract", corpus, "-o", ck, "--max-length", 16, "-q", "--batch-size", 8, "--backend",
                     "reference", "--resume")
    assert code == 1 and "array 'sum' holds NaN or infinite values for 72 of the model's 72 heads (L0H0, L0H1, " \
        "L0H2, L0H3, L0H4 ...)); start over with --overwrite" in text, text
    assert not (ck / "features.npz").exists()
    acc.sum[:] = 0.5
    acc.m2[2, 3] = np.inf
    RunDir(ck).save_checkpoint(acc, 8, 0, settings_full)
    code, text = run("extract", corpus, "-o", ck, "--max-length", 16, "-q", "--batch-size", 8, "--backend",
                     "reference", "--resume")
    assert code == 1 and "array 'm2' holds NaN or infinite values for 1 of the model's 72 heads (L2H3)" in text


def test_output_problems_are_found_before_the_work(corpus, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, text = run("extract", corpus, "-o", blocker / "run", "-q")
    assert code == 1 and "is a file" in text and "Traceback" not in text
    from attnkit.run.locking import run_lock

    busy = tmp_path / "busy"
    with run_lock(busy, "attnkit cluster"):
        code, text = run("extract", corpus, "-o", busy, "-q", "--limit", 4, "--backend", "reference")
    assert code == 1 and f"pid {os.getpid()}" in text and "attnkit cluster" in text
    assert not (busy / "features.npz").exists()


def test_overwrite_removes_outputs_of_the_old_run(corpus, tmp_path):
    out = tmp_path / "o"
    assert run("extract", corpus, "-o", out, "-q", "--limit", 6, "--max-length", 16, "--backend", "reference")[0] == 0
    (out / "clusters.json").write_text("{}")
    (out / "figures").mkdir()
    code, text = run("extract", corpus, "-o", out, "-q", "--limit", 8, "--max-length", 16, "--backend", "reference",
                     "--per-sample")
    assert code == 1 and text.strip().splitlines()[-1] == (
        f"Error: {out} already holds a finished run without per_sample.npy (only a new measurement of its corpus "
        f"adds it): give --overwrite to replace it (it removes {out}/{{features.npz, meta.json, clusters.json, "
        f"figures}}), or write elsewhere")
    code, text = run("extract", corpus, "-o", out, "-q", "--limit", 8, "--max-length", 16, "--backend", "reference",
                     "--overwrite")
    assert code == 0 and f"--overwrite removed {out}/{{features.npz, meta.json, clusters.json, figures}}" in text
    assert HeadFeatures.load(out).n_samples == 8
    assert not (out / "clusters.json").exists() and not (out / "figures").exists()


def test_per_sample_rows_are_traceable_to_their_inputs(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.tsv"
    lines = [f"Line {i} of a, {'short' if i % 2 else 'a somewhat longer line here'}." for i in range(5)]
    a.write_text("\n".join(lines) + "\n")
    pairs = [(f"Left {i}.", f"Right side {'x ' * i}end.") for i in range(6)]
    b.write_text("sentence1\tsentence2\n" + "".join(f"{x}\t{y}\n" for x, y in pairs))
    out = tmp_path / "run"
    code, text = run("extract", a, b, "-o", out, "-q", "--per-sample", "--max-length", 24, "--backend", "reference",
                     "--window", 4, "--batch-size", 3)
    assert code == 0, text
    assert text.strip().endswith(f"wrote {out}/features.npz, meta.json, per_sample.npy, per_sample.json, "
                                 "per_sample_rows.csv")
    feats = HeadFeatures.load(out)
    per = np.load(out / "per_sample.npy")
    assert per.dtype == np.float32 and per.shape == (11, 6, 12, 28)
    np.testing.assert_allclose(per.astype(np.float64).mean(0), feats.mean, atol=1e-6)
    import csv

    rows = list(csv.DictReader(open(out / "per_sample_rows.csv")))
    assert [(r["input"], r["position"]) for r in rows] == [("0", str(i)) for i in range(5)] + \
        [("1", str(i)) for i in range(6)]
    assert [r["text"] for r in rows] == lines + [x for x, _ in pairs]
    assert [r["text_pair"] for r in rows] == [""] * 5 + [y for _, y in pairs]
    meta = json.loads((out / "meta.json").read_text())
    assert [d["path"] for d in meta["inputs"]] == [str(a), str(b)]


def test_standard_input(corpus, tmp_path):
    out = tmp_path / "s"
    result = CliRunner().invoke(main, ["extract", "-", "-o", str(out), "-q", "--max-length", "16", "--backend",
                                       "reference"], input="One line here.\nAnother line, there.\n")
    assert result.exit_code == 0, result.output
    meta = json.loads((out / "meta.json").read_text())
    assert meta["n_samples"] == 2 and meta["inputs"][0]["path"] == "-"


def test_analysis_refuses_a_corpus_changed_since_the_run(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("One line here.\nTwo lines there.\n")
    out = tmp_path / "run"
    assert run("extract", corpus, "-o", out, "-q", "--max-length", 16, "--backend", "reference")[0] == 0
    corpus.write_text("One line here.\nTwo lines there.\nA third one.\n")
    code, text = run("distances", out, "-q")
    assert code == 1 and "changed since" in text and not (out / "distances.npz").exists()


def test_run_directories_inside_a_corpus_directory_are_not_read(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "c.txt").write_text("One line here.\nTwo lines there.\n")
    assert run("extract", data, "-o", data / "run1", "-q", "--max-length", 16, "--backend", "reference")[0] == 0
    code, text = run("extract", data, "-o", data / "run2", "-q", "--max-length", 16, "--backend", "reference")
    assert code == 0, text
    assert HeadFeatures.load(data / "run2").n_samples == 2


def test_export_does_not_replace_a_file_it_was_not_told_to(corpus, tmp_path):
    out = tmp_path / "run"
    assert run("extract", corpus, "-o", out, "-q", "--limit", 3, "--max-length", 16, "--backend", "reference")[0] == 0
    precious = tmp_path / "notes.csv"
    precious.write_text("mine\n")
    code, text = run("export", out, "-o", precious)
    assert code == 1 and "--overwrite" in text and precious.read_text() == "mine\n"
    assert run("export", out, "-o", precious, "--overwrite")[0] == 0 and precious.read_text().startswith("layer,head")


def test_devices_and_columns_that_cannot_work_are_refused(corpus, tmp_path):
    code, text = run("extract", corpus, "--device", "mps", "-o", tmp_path / "x", "-q")
    assert code == 1 and "attnkit runs on cpu or cuda" in text
    code, text = run("extract", corpus, "--columns", ",sentence2", "-o", tmp_path / "x", "-q")
    assert code == 2 and "empty column name" in text
    assert not (tmp_path / "x").exists()


# --- issue 21 -------------------------------------------------------------------------------------------------
def _finished(corpus, out, *extra):
    code, text = run("extract", corpus, "-o", out, "-q", "--max-length", 16, "--batch-size", 8, "--backend",
                     "reference", *extra)
    assert code == 0, text
    return json.loads((out / "meta.json").read_text())


def test_a_checkpoint_of_another_head_count_is_refused_before_use(corpus, tmp_path):
    meta = _finished(corpus, tmp_path / "ok")
    from attnkit.run.head_features import FeatureAccumulator
    from attnkit.run.rundir import RunDir

    acc = FeatureAccumulator(6, 3, meta["feature_names"])  # 3 heads; the model has 12
    acc.update(np.full((8, 6, 3, 28), 0.5), 80)
    ck = tmp_path / "ck"
    RunDir(ck).save_checkpoint(acc, 8, 0, meta["settings"])
    code, text = run("extract", corpus, "-o", ck, "--max-length", 16, "-q", "--batch-size", 8, "--backend",
                     "reference", "--resume")
    assert code == 1 and "Traceback" not in text
    assert text.strip() == (f"Error: checkpoint {ck}/checkpoint.npz holds sums of shape (6, 3, 28) (sum), but the "
                            "model measures 6 layers × 12 heads × 28 features: it belongs to another model or "
                            "feature set; start over with --overwrite")


def test_a_resume_names_the_input_that_changed(corpus, tmp_path):
    meta = _finished(corpus, tmp_path / "ok")
    from attnkit.run.head_features import FeatureAccumulator
    from attnkit.run.rundir import RunDir

    acc = FeatureAccumulator(6, 12, meta["feature_names"])
    acc.update(np.full((8, 6, 12, 28), 0.5), 80)
    ck = tmp_path / "ck"
    RunDir(ck).save_checkpoint(acc, 8, 0, meta["settings"], inputs=meta["inputs"])
    before = corpus.stat().st_size
    corpus.write_text(corpus.read_text() + "One more line at the end.\n")
    code, text = run("extract", corpus, "-o", ck, "--max-length", 16, "-q", "--batch-size", 8, "--backend",
                     "reference", "--resume")
    assert code == 1
    assert re.fullmatch(rf"Error: cannot resume: the run directory was made with other settings \(input {corpus} "
                        rf"changed \(size {before} then, {corpus.stat().st_size} now(, mtime \S+ then, \S+ now)?\)\)",
                        text.strip()), text
    assert meta["inputs"][0]["sha256"] not in text


def test_an_interrupted_overwrite_resumed_ends_like_an_uninterrupted_one(corpus, tmp_path, paused_extract):
    """The old run's clusters.json and per_sample.npy described features the resumed overwrite replaced."""
    out = tmp_path / "run"
    _finished(corpus, out, "--limit", 6, "--per-sample")
    (out / "clusters.json").write_text("{}")
    (out / "figures").mkdir()
    proc = paused_extract(_extract_args(corpus, out, "--overwrite"))  # stands still after its first checkpoint
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)
    assert proc.returncode == 130 and (out / "clusters.json").exists()  # the old run stays until the new finishes
    # the command to continue with resumes the overwrite: --resume in place of --overwrite, which it contradicts
    again = _resume_hint(proc.stderr.read().decode())
    assert again == ["attnkit", *map(str, _extract_args(corpus, out)), "--resume"]
    code, text = run(*again[1:])
    assert code == 0, text
    assert HeadFeatures.load(out).n_samples == 48
    assert not (out / "clusters.json").exists() and not (out / "figures").exists()
    assert not (out / "per_sample.npy").exists() and not (out / "per_sample.json").exists()


def test_standard_input_past_the_look_ahead_streams(tmp_path):
    import hashlib

    data = "sentence\tlabel\n" + "".join(f"Row number {i} here.\t1\n" for i in range(300))  # > 200 peeked lines
    out = tmp_path / "s"
    result = CliRunner().invoke(main, ["extract", "-", "--format", "tsv", "-o", str(out), "-q", "--max-length", "16",
                                       "--backend", "reference", "--batch-size", "64"], input=data)
    assert result.exit_code == 0, result.output
    meta = json.loads((out / "meta.json").read_text())
    assert meta["n_samples"] == 300
    assert meta["inputs"][0]["sha256"] == hashlib.sha256(data.encode()).hexdigest()
    assert len(meta["settings"]["corpus_sha256"]) == 64


def test_empty_and_impossible_devices_and_models_are_refused(corpus, tmp_path):
    out = tmp_path / "x"
    for args, message in ((["--devices", ""], "--devices is empty"), (["--device", ""], "--device is empty"),
                          (["--model", ""], "--model is empty"),
                          (["--devices", "cpu:7"], "device 'cpu:7' does not exist: the CPU is one device"),
                          (["--device", "cpu:1"], "device 'cpu:1' does not exist: the CPU is one device")):
        code, text = run("extract", corpus, "-o", out, "-q", *args)
        assert code == 1 and text.strip().startswith(f"Error: {message}") and len(text.strip().splitlines()) == 1, text
    code, text = run("compare-models", "", "default", corpus, "-o", out, "-q")
    assert code == 1 and text.strip().startswith("Error: the model path is empty"), text
    assert not out.exists()


def test_an_empty_corpus_is_refused_before_the_model_loads(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    code, text = run("extract", empty, "-o", tmp_path / "run")
    # one line: no model line, no progress bar of zero segments before it, and no run directory left
    assert code == 1 and text == f"Error: corpus {str(empty)!r} has no text (text format)\n", text
    assert not (tmp_path / "run").exists()


def test_a_fresh_run_names_no_file_it_did_not_replace(corpus, tmp_path):
    """The run's own checkpoint, on disk when it finishes, is neither 'removed' nor 'made before these results'."""
    code, text = run("extract", corpus, "-o", tmp_path / "run", "--batch-size", 1, "--checkpoint-every", 1,
                     "--max-length", 16, "--backend", "reference", "-q")
    assert code == 0 and "note:" not in text and "checkpoint" not in text and "removed" not in text, text
    assert not (tmp_path / "run" / "checkpoint.npz").exists()


def _eager_max_logits(texts, max_length):
    """Each head's max logit over `texts`, independently of attnkit's kernels: the embedded MiniLM under
    transformers' eager attention, its query and key projections taken by hooks, every sample alone (no padding),
    the scores q·kᵀ/√d of every row and key in float64."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from attnkit.models import default_model_path

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    H = model.config.num_attention_heads
    out = np.full((model.config.num_hidden_layers, H), -np.inf)
    seen = {}
    hooks = []
    for i, layer in enumerate(model.encoder.layer):
        for name in ("query", "key"):
            hooks.append(getattr(layer.attention.self, name).register_forward_hook(
                lambda mod, args, res, i=i, name=name: seen.__setitem__((i, name), res.detach())))
    with torch.no_grad():
        for text in texts:
            enc = tok(text, truncation=True, max_length=max_length, return_tensors="pt")
            model(**enc)
            for i in range(out.shape[0]):
                q, k = (seen[i, n][0].double() for n in ("query", "key"))
                n, d = q.shape[0], q.shape[1] // H
                q, k = q.view(n, H, d).transpose(0, 1), k.view(n, H, d).transpose(0, 1)
                s = q @ k.transpose(1, 2) * d**-0.5
                out[i] = np.maximum(out[i], s.amax((1, 2)).numpy())
    for h in hooks:
        h.remove()
    return out


def test_max_logit_is_measured_saved_recorded_and_exported(corpus, tmp_path):
    out = tmp_path / "run"
    code, text = run("extract", corpus, "-o", out, "--max-length", 16, "--limit", 12, "--batch-size", 5, "-q",
                     "--backend", "reference", "--max-logit")
    assert code == 0, text
    feats = HeadFeatures.load(out)
    texts = corpus.read_text().splitlines()[:12]
    want = _eager_max_logits(texts, 16)
    assert feats.max_logit.shape == (6, 12)
    np.testing.assert_allclose(feats.max_logit, want, rtol=1e-5, atol=1e-5)
    assert json.loads((out / "meta.json").read_text())["settings"]["max_logit"] is True
    code, text = run("export", out, "-o", tmp_path / "t.csv")
    assert code == 0, text
    import pandas as pd

    df = pd.read_csv(tmp_path / "t.csv")
    assert df.columns[-1] == "max_logit"
    np.testing.assert_allclose(df["max_logit"].to_numpy().reshape(6, 12), feats.max_logit, rtol=1e-12)
    # a run without --max-logit has no such array, column or setting
    plain = tmp_path / "plain"
    assert run("extract", corpus, "-o", plain, "--max-length", 16, "--limit", 4, "-q", "--backend", "reference")[0] == 0
    assert HeadFeatures.load(plain).max_logit is None
    assert "max_logit" not in json.loads((plain / "meta.json").read_text())["settings"]
    assert "max_logit" not in HeadFeatures.load(plain).to_pandas().columns


def test_max_logit_on_the_fused_cpu_op_takes_no_second_pass(corpus, tmp_path, monkeypatch):
    """--max-logit on the fused CPU kernel: the op measures it while it runs (the blocked q·kᵀ pass of
    attnkit.kernels.statistics raises here), and it is eager's."""
    from attnkit import ops
    from attnkit.kernels import statistics

    if not ops.fused_max_logit("cpu"):
        pytest.skip("a build whose CPU op has no max logit")

    def no_second_pass(*_a, **_k):
        raise AssertionError("a second q·kᵀ pass")

    monkeypatch.setattr(statistics, "max_logits", no_second_pass)
    monkeypatch.setattr("attnkit.engine.extract.max_logits", no_second_pass, raising=False)  # (its earlier import)
    out = tmp_path / "run"
    code, text = run("extract", corpus, "-o", out, "--max-length", 16, "--limit", 12, "--batch-size", 5, "-q",
                     "--backend", "fused", "--max-logit")
    assert code == 0, text
    want = _eager_max_logits(corpus.read_text().splitlines()[:12], 16)
    np.testing.assert_allclose(HeadFeatures.load(out).max_logit, want, rtol=1e-5, atol=1e-5)


def test_max_logit_resumes_to_the_same_max_and_a_resume_must_keep_the_choice(corpus, tmp_path, paused_extract):
    full, part = tmp_path / "full", tmp_path / "part"
    args = ["--batch-size", 1, "-q", "--backend", "reference", "--max-length", 24, "--threads", 1, "--max-logit"]
    assert run("extract", corpus, "-o", full, *args)[0] == 0
    proc = paused_extract(["extract", corpus, "-o", part, "--checkpoint-every", 1, *args])
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    assert proc.returncode == 130
    with np.load(part / "checkpoint.npz") as z:
        assert 0 < int(z["next_index"]) < 48
        first = z["max_logit"]
    assert first.shape == (6, 12) and np.isfinite(first).all()
    # the choice is part of the run: a resume without it is refused, naming it
    code, text = run("extract", corpus, "-o", part, *args[:-1], "--resume")
    assert code != 0 and "max_logit" in text and "True then, None now" in text and len(text.strip().splitlines()) == 1
    code, text = run("extract", corpus, "-o", part, *args, "--resume")
    assert code == 0, text
    a, b = HeadFeatures.load(full), HeadFeatures.load(part)
    np.testing.assert_array_equal(a.max_logit, b.max_logit)
    np.testing.assert_array_equal(a.mean, b.mean)
    assert np.all(b.max_logit >= first)
    # a run made without it cannot be resumed with it either
    plain = tmp_path / "plain"
    proc = paused_extract(["extract", corpus, "-o", plain, "--checkpoint-every", 1, *args[:-1]])
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    code, text = run("extract", corpus, "-o", plain, *args, "--resume")
    assert code != 0 and "max_logit: None then, True now" in text


def test_max_logit_refuses_engines_and_devices_that_cannot_measure_it(corpus, tmp_path):
    code, text = run("extract", corpus, "-o", tmp_path / "r", "--engine", "ray", "--max-logit", "-q")
    assert code == 1 and "--max-logit is measured by the local engine only (drop --engine ray)" in text
    code, text = run("extract", corpus, "-o", tmp_path / "d", "--devices", "cpu,cpu", "--max-logit", "-q",
                     "--limit", 2)
    assert code != 0 and "--max-logit is measured on one device only" in text


def test_a_ray_run_whose_model_is_not_here_stops_before_any_work(corpus, tmp_path):
    """The machine that runs the command writes the run from the model's config: a model missing here is named
    before the cluster is reached or a shard measured. (On a remote cluster the model may be on the nodes alone as
    far as the engine is concerned, and the command used to fail only after measuring the whole corpus.) The
    "cluster" is a socket that accepts connections and answers nothing: reaching Ray there would hang."""
    import socket

    pytest.importorskip("ray")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"127.0.0.1:{server.getsockname()[1]}"
        code, text = run("extract", corpus, "-o", tmp_path / "r", "--engine", "ray", "--ray-address", address,
                         "--model", tmp_path / "nowhere", "-q")
    assert code == 1 and "could not read the config of model" in text and "nowhere" in text, text
    assert len(text.strip().splitlines()) == 1 and not (tmp_path / "r").exists()
