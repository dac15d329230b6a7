"""The command line's integer and path options, adversarially (hypothesis): a value out of range or a path that
cannot be used ends in one line on stderr and a non-zero exit, and nothing that existed is changed.

The integer options are found on the commands themselves (every click.IntRange), so an option added later is
covered; their ranges are the library's (attnkit.errors.INT_RANGES), checked here against Python too.
"""
import os
import shutil
import tempfile
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnkit.cli.main import main
from attnkit.errors import INT_RANGES, AttnkitError, check_int

from .synthetic import layered_truth, make_features
from .test_probe import to_conllu, toy_sentences

# arguments that make each command valid but for the option under test (paths inside the sandbox)
BASE = {
    "extract": ["corpus.txt", "-o", "new-run", "-q"],
    "cluster": ["run", "-q"],
    "distances": ["run", "-q"],
    "report": ["run", "-q"],
    "compare": ["run", "run2"],
    "patterns": ["run", "-q"],
    "compare-models": ["default", "default", "corpus.txt", "-o", "new-compare", "-q"],
    "ablate": ["default", "--task", "stsb", "--data", "dev.tsv", "--experiment", "heads", "-q"],
    "export": ["run", "-q"],
    "probe": ["gold.conllu", "-o", "new-probe", "-q"],
    "detect-heads": ["default", "-o", "new-heads", "-q"],
}


def integer_options():
    """(command, option, IntRange) for every integer option of every command."""
    out = []
    for name, command in main.commands.items():
        for p in command.params:
            if isinstance(p, click.Option) and isinstance(p.type, click.IntRange):
                out.append((name, max(p.opts, key=len), p.type))
    return out


INTEGER_OPTIONS = integer_options()

# paths that cannot be used where each path option or argument wants one (in the sandbox: FILE is a regular file,
# adir an existing directory, emptydir a directory without corpus files, missing* do not exist)
BAD_PATHS = {
    "extract": [("-o", v) for v in ("", " ", "FILE", "FILE/sub")] + [("CORPUS", v) for v in ("missing.txt", "", "emptydir")],
    "probe": [("-o", v) for v in ("", "FILE", "FILE/sub")] + [("CORPUS", "missing.conllu")],
    "compare-models": [("-o", v) for v in ("", "FILE", "FILE/sub")],
    "ablate": [("-o", v) for v in ("", "FILE")] + [("--data", "missing.tsv"), ("--clusters", "missing")],
    "export": [("-o", v) for v in ("", "adir", "FILE/sub.csv")],
    "compare": [("--json", v) for v in ("", "adir", "FILE/sub.json")],
    "cluster": [("RUN", v) for v in ("missing", "FILE", "", "adir")],
    "distances": [("RUN", v) for v in ("missing", "FILE", "")] + [("--corpus", v) for v in ("missing.txt", "adir")],
    "report": [("RUN", v) for v in ("missing", "FILE")] + [("--corpus", "missing.txt")],
    "patterns": [("RUN", v) for v in ("missing", "FILE", "adir")],
}
PATH_CASES = [(cmd, opt, value) for cmd, cases in BAD_PATHS.items() for opt, value in cases]


@pytest.fixture(scope="module")
def sandbox():
    root = Path(tempfile.mkdtemp(prefix="attnkit-limits-"))
    feats = make_features(layered_truth(L=3, H=4, seed=1))
    feats.save(root / "run")
    feats.save(root / "run2")
    (root / "corpus.txt").write_text("One line here.\nTwo lines there.\n")
    (root / "dev.tsv").write_text("sentence1\tsentence2\tscore\nA man.\tA person.\t4.0\nA dog.\tA cat.\t1.0\n")
    (root / "gold.conllu").write_text(to_conllu(toy_sentences(2, seed=1)))
    (root / "FILE").write_text("precious\n")
    (root / "adir").mkdir()
    (root / "adir" / "keep.txt").write_text("kept\n")
    (root / "emptydir").mkdir()
    yield root
    shutil.rmtree(root, ignore_errors=True)


def snapshot(root: Path) -> dict:
    """Every file under `root` with its size, modification time and bytes, and every directory (whose times
    change when a command checks that it can write there, and whose entries are listed themselves)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            out[str((Path(dirpath) / name).relative_to(root))] = "dir"
        for name in filenames:
            p = Path(dirpath) / name
            st_ = p.stat()
            out[str(p.relative_to(root))] = (st_.st_size, st_.st_mtime_ns, p.read_bytes())
    return out


def invoke_in(root: Path, args: list[str]):
    before = snapshot(root)
    cwd = os.getcwd()
    os.chdir(root)
    try:
        result = CliRunner().invoke(main, args)
    finally:
        os.chdir(cwd)
    after = snapshot(root)
    assert {k: v for k, v in after.items() if k in before} == before, f"attnkit {' '.join(args)} changed what it found"
    return result


def assert_one_line_refusal(result, args, names):
    err = result.stderr.strip()
    assert result.exit_code != 0, f"attnkit {args} was accepted: {result.output}"
    assert result.exception is None or isinstance(result.exception, SystemExit), (args, result.exception)
    assert len(err.splitlines()) == 1 and err.startswith("Error: "), (args, result.stderr)
    assert any(n in err for n in names), (args, err)


def bad_integers(draw_range: click.IntRange, option: str):
    choices = [st.sampled_from(["1.5", "abc", "", "1e3", " ", "0x10"])]
    if draw_range.min is not None:
        choices.append(st.integers(max_value=draw_range.min - 1, min_value=draw_range.min - 10**30))
    if draw_range.max is not None:
        choices.append(st.integers(min_value=draw_range.max + 1, max_value=draw_range.max + 10**30))
    return st.one_of(choices)


@st.composite
def integer_case(draw):
    command, option, rng = draw(st.sampled_from(INTEGER_OPTIONS))
    return command, option, str(draw(bad_integers(rng, option)))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=integer_case())
def test_integer_options_out_of_range_are_refused_in_one_line(sandbox, case):
    command, option, value = case
    args = [command, *BASE[command], option, value]
    result = invoke_in(sandbox, args)
    assert_one_line_refusal(result, args, [option])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(PATH_CASES))
def test_unusable_paths_are_refused_in_one_line(sandbox, case):
    command, option, value = case
    base = list(BASE[command])
    if option in ("RUN", "CORPUS"):  # the first argument is the one under test
        args = [command, value, *base[1:]]
        names = ["RUN", "CORPUS", "corpus", value or "''", "path"]
    elif option in base:  # replace the option's value
        i = base.index(option)
        args = [command, *base[:i + 1], value, *base[i + 2:]]
        names = [option, "--out", "path", value]
    else:
        args = [command, *base, option, value]
        names = [option, value or "''", "path"]
    result = invoke_in(sandbox, args)
    names += list(Path(value).parts)  # the message may name the part of the path that is wrong
    assert_one_line_refusal(result, args, [n for n in names if n.strip()])


def test_every_integer_option_has_the_librarys_range():
    """The command line takes its limits from the library's table, and the library refuses the same values."""
    names = {p.name: p.type for c in main.commands.values() for p in c.params
             if isinstance(p, click.Option) and isinstance(p.type, click.IntRange)}
    assert set(names) <= set(INT_RANGES), set(names) - set(INT_RANGES)
    for name, rng in names.items():
        assert (rng.min, rng.max) == INT_RANGES[name], name
        lo, hi = INT_RANGES[name]
        with pytest.raises(AttnkitError, match=f"^{name} must be"):
            check_int(lo - 1, name)
        if hi is not None:
            with pytest.raises(AttnkitError, match=f"^{name} must be at most {hi}, got {hi + 1}$"):
                check_int(hi + 1, name)
        with pytest.raises(AttnkitError, match=f"^{name} must be"):
            check_int(1.5, name)
