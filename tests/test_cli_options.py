"""attnkit/cli/options.py and attnkit/errors.py: options that several commands share have one help text and one
parser, and a library message names a Python argument in Python and the command's option on the command line."""
import pickle

import pytest
from click.testing import CliRunner

from attnkit.cli.main import main
from attnkit.corpus import open_corpus
from attnkit.errors import AttnkitError, arg, spell
from attnkit.jobs.extract_job import ExtractOptions, run_extract_job

SHARED = ("--format", "--device", "--batch-size", "--backend", "--max-length", "--dtype", "--columns", "--limit",
          "--num-windows", "--sentences", "--squad-pairs", "--engine", "--ray-address", "--model")


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_shared_options_have_one_help_text():
    helps: dict[str, set] = {}
    for name, cmd in main.commands.items():
        for p in cmd.params:
            if p.opts and p.opts[-1] in SHARED and not (name == "export" and p.opts[-1] == "--format"):
                # --batch-size says its default only where a command has none of its own
                helps.setdefault(p.opts[-1], set()).add(p.help.split(" [default")[0].rstrip("."))
    assert set(helps) == set(SHARED)
    assert {k: v for k, v in helps.items() if len(v) > 1} == {}


@pytest.mark.parametrize("command", [["extract"], ["probe", "x.conllu"], ["compare-models", "a", "b"],
                                     ["distances", "RUN"], ["report", "RUN"]])
def test_every_columns_option_refuses_an_empty_name(tmp_path, command):
    run = tmp_path / "run"
    run.mkdir()
    args = [run if a == "RUN" else a for a in command]
    for bad in (",sentence2", "sentence1,", " , "):
        r = invoke(*args, "--columns", bad)
        assert r.exit_code == 2 and "empty column name" in r.output, (command, bad, r.output)


def test_library_messages_name_python_arguments_and_the_cli_its_options(tmp_path):
    table = tmp_path / "odd.tsv"
    table.write_text("a\tb\n1\t2\n")
    with pytest.raises(AttnkitError, match="name it with columns "):
        list(open_corpus([table]))
    r = invoke("extract", table, "-o", tmp_path / "out", "-q")
    assert r.exit_code == 1 and "name it with --columns " in r.output

    with pytest.raises(AttnkitError, match="^resume and overwrite contradict each other"):
        run_extract_job(ExtractOptions(resume=True, overwrite=True))
    r = invoke("extract", "--resume", "--overwrite")
    assert r.exit_code == 1 and "--resume and --overwrite contradict each other" in r.output

    with pytest.raises(AttnkitError, match=r"^ray_address needs engine='ray'$"):
        run_extract_job(ExtractOptions(ray_address="auto"))
    r = invoke("extract", "--ray-address", "auto")
    assert r.exit_code == 1 and r.output.strip() == "Error: --ray-address needs --engine ray"
    r = invoke("distances", tmp_path, "--ray-address", "auto")
    assert r.exit_code == 1 and r.output.strip() == "Error: --ray-address needs --engine ray"


def test_arguments_in_messages():
    e = AttnkitError(f"{arg('max_length')} must be an integer; continue with {arg('resume', True)} on "
                     f"{arg('engine', 'ray')}")
    assert str(e) == "max_length must be an integer; continue with resume=True on engine='ray'"
    names = {"max_length": "--max-length", "resume": "--resume", "engine": "--engine"}
    assert e.message(names) == "--max-length must be an integer; continue with --resume on --engine ray"
    assert e.arguments == ["max_length", "resume", "engine"]
    again = pickle.loads(pickle.dumps(e))  # across processes (workers, Ray actors) with its arguments
    assert again.message(names) == e.message(names) and str(again) == str(e)
    assert AttnkitError(e).template == e.template  # wrapping keeps them too
    assert spell(f"use {arg('limit')}") == "use limit" and spell(f"use {arg('limit')}", {"limit": "--limit"}) == \
        "use --limit"


@pytest.mark.parametrize("given", [["--smooth", "-0.1"], ["--smooth=-0.1"], ["--smooth", "-.5"], ["--smooth", "1"]])
def test_an_option_whose_value_may_be_left_out_refuses_a_bad_number_by_name(tmp_path, given):
    # click alone reads "--smooth -0.1" as --smooth followed by an unknown option "-0"
    r = invoke("distances", tmp_path, *given)
    value = given[-1].split("=")[-1]
    assert r.exit_code == 2 and f"Invalid value for '--smooth': {float(value):g}" in r.output, r.output
    assert "No such option" not in r.output
