"""The one write path of every command that writes (issue 25, §1; attnkit/run/locking.py `output_directory`,
`output_file`): an output that is, lies inside or holds an input is refused before anything is written; the
working directory is never replaced; a second writer is refused while the first holds the lock; a refusal after
--overwrite removes nothing; nothing is written through a symbolic link that leads out of the output.

Each case uses the cheapest invocation of each command (in-process, tiny model, synthetic run); almost every
refusal comes before any model loads. Concurrency is made deterministic by holding the lock in a forked process
(conftest `lock_held`) while the second writer runs."""
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from attnkit.cli.main import main

from .synthetic import WORDS, rich_run, tiny_bert


def cli(*args, input=None):
    """(exit status, output) of `attnkit ARGS`; an exception other than the CLI's own exit fails the test."""
    res = CliRunner().invoke(main, [str(a) for a in args], input=input)
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    return res.exit_code, res.output


def refused(code, text, *words):
    """A refusal: status 1 or 2, one line of output starting with Error:, naming `words`."""
    lines = text.strip().splitlines()
    assert code in (1, 2) and len(lines) == 1 and lines[0].startswith("Error: "), (code, text)
    for w in words:
        assert w in text, (w, text)


def tree(root) -> dict:
    """Every file and link under `root` with its bytes (or link target): what a refusal must leave as it was."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            if name.startswith(".attnkit.lock"):
                continue
            out[rel] = ("->", os.readlink(p)) if os.path.islink(p) else Path(p).read_bytes()
    return out


@dataclass
class World:
    root: Path
    model: Path  # root/models/m: a tiny BERT, 3 layers × 4 heads
    run: Path  # a synthetic run with everything the analysis writes (tests/synthetic.py rich_run)
    run2: Path  # a second clustered run
    corpus: Path  # root/data/c.txt
    conllu: Path  # root/data/t.conllu
    stsb: Path  # root/data/dev.tsv
    empty: Path  # root/data/empty.txt


def _build(root: Path) -> World:
    model, tok = tiny_bert(3, 4)
    m = root / "models" / "m"
    model.save_pretrained(m)
    tok.save_pretrained(m)
    data = root / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    (data / "c.txt").write_text("\n".join(" ".join(rng.choice(WORDS, 6)) + " ." for _ in range(6)) + "\n")
    sent = [("the", 2, "det"), ("cat", 3, "nsubj"), ("sat", 0, "root")]
    (data / "t.conllu").write_text("".join("".join(f"{j + 1}\t{w}\t{w}\t_\t_\t_\t{h}\t{r}\t_\t_\n"
                                                   for j, (w, h, r) in enumerate(sent)) + "\n" for _ in range(4)))
    (data / "dev.tsv").write_text("index\tgenre\tsentence1\tsentence2\tscore\n" + "".join(
        f"{i}\tx\t{' '.join(rng.choice(WORDS, 5))}\t{' '.join(rng.choice(WORDS, 4))}\t{i % 5}.0\n" for i in range(6)))
    (data / "empty.txt").write_text("\n\n")
    rich_run(root / "run")
    rich_run(root / "run2", seed=4)
    return World(root, m, root / "run", root / "run2", data / "c.txt", data / "t.conllu", data / "dev.tsv",
                 data / "empty.txt")


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    return tmp_path_factory.mktemp("world")


@pytest.fixture(scope="module")
def built(template):
    return _build(template / "w")


@pytest.fixture
def w(built, tmp_path):
    """A fresh copy of the world for each test (tests change it)."""
    root = tmp_path / "w"
    shutil.copytree(built.root, root, symlinks=True)
    return World(*(root / Path(getattr(built, f)).relative_to(built.root) if f != "root" else root
                   for f in World.__dataclass_fields__))


# The cheapest invocation of each command that writes into an output it is given (-o, --json).
WRITERS = {
    "prune": lambda w, out: ["prune", w.model, "--heads", "L0H0", "-o", out, "-q"],
    "extract": lambda w, out: ["extract", w.corpus, "--model", w.model, "--max-length", 16, "--backend",
                               "reference", "-o", out, "-q"],
    "ablate": lambda w, out: ["ablate", w.model, "--task", "stsb", "--data", w.stsb, "--experiment", "heads",
                              "--resamples", 0, "-o", out, "-q"],
    "probe": lambda w, out: ["probe", w.conllu, "--model", w.model, "--min-count", 1, "-o", out, "-q"],
    "compare-models": lambda w, out: ["compare-models", w.model, w.model, w.corpus, "--max-length", 16, "-o", out,
                                      "-q"],
    "export": lambda w, out: ["export", w.run, "-o", out],
    "compare": lambda w, out: ["compare", w.run, w.run2, "--json", out],
}
# The commands that write into the run they read.
RUN_WRITERS = {
    "cluster": lambda w: ["cluster", w.run, "-k", 2, "--stability", 2, "--seeds", 1, "-q"],
    "distances": lambda w: ["distances", w.run, "--corpus", w.corpus, "-q"],
    "report": lambda w: ["report", w.run, "--no-svg", "-q"],
    "patterns": lambda w: ["patterns", w.run, "-q"],
}


# --- output = input, output inside an input, an input inside the output ---------------------------------------
EQUAL = {"prune": lambda w: w.model, "extract": lambda w: w.corpus, "ablate": lambda w: w.stsb,
         "probe": lambda w: w.conllu, "compare-models": lambda w: w.model,
         "export": lambda w: w.run / "features.npz", "compare": lambda w: w.run / "clusters.json"}
INSIDE = {"prune": "model", "extract": "model", "ablate": "model", "probe": "model", "compare-models": "model"}
HOLDS = {"prune": lambda w: w.model.parent, "extract": lambda w: w.corpus.parent, "ablate": lambda w: w.stsb.parent,
         "probe": lambda w: w.conllu.parent, "compare-models": lambda w: w.model.parent}


@pytest.mark.parametrize("command", sorted(EQUAL))
def test_an_output_that_is_an_input_is_refused(w, command):
    before = tree(w.root)
    code, text = cli(*WRITERS[command](w, EQUAL[command](w)), "--overwrite")
    refused(code, text, *(() if EQUAL[command](w).is_file() and command not in ("export", "compare")
                          else ("elsewhere",)))  # a file where a directory goes is refused as such
    assert tree(w.root) == before


@pytest.mark.parametrize("command", sorted(INSIDE))
def test_an_output_inside_an_input_is_refused(w, command):
    before = tree(w.root)
    code, text = cli(*WRITERS[command](w, w.model / "sub"), "--overwrite")
    refused(code, text, "lies inside", "write elsewhere")
    assert tree(w.root) == before and not (w.model / "sub").exists()


@pytest.mark.parametrize("command", sorted(HOLDS))
def test_an_output_holding_an_input_is_refused(w, command):
    before = tree(w.root)
    code, text = cli(*WRITERS[command](w, HOLDS[command](w)), "--overwrite")
    refused(code, text, "holds", "write elsewhere")
    assert tree(w.root) == before


# --- the working directory: `.`, `..` and an empty path -------------------------------------------------------
@pytest.mark.parametrize("out", [".", ".."])
def test_prune_never_replaces_the_working_directory(w, monkeypatch, out):
    """`cd sand/w && attnkit prune ... -o .. --overwrite` deleted everything in sand (issue 25)."""
    cwd = w.root / "sand" / "w"
    cwd.mkdir(parents=True)
    (cwd / "config.json").write_text("{}")  # even one that looks like a model directory
    (w.root / "sand" / "keep.txt").write_text("mine")
    monkeypatch.chdir(cwd)
    before = tree(w.root)
    code, text = cli("prune", w.model, "--heads", "L0H0", "-o", out, "--overwrite", "-q")
    refused(code, text, "the working directory")
    assert tree(w.root) == before


def test_prune_into_the_parent_of_the_model_is_refused_and_deletes_nothing(w):
    """`attnkit prune par/m -o par --overwrite` deleted the model and its neighbours (issue 25)."""
    (w.model.parent / "neighbour.txt").write_text("mine")
    before = tree(w.root)
    code, text = cli("prune", w.model, "--heads", "L0H0", "-o", w.model.parent, "--overwrite", "-q")
    refused(code, text, "holds the model being pruned")
    assert tree(w.root) == before


@pytest.mark.parametrize("command", sorted(WRITERS))
def test_an_empty_output_path_is_a_usage_error(w, command):
    code, text = cli(*WRITERS[command](w, ""))
    refused(code, text)
    assert code == 2


def test_extract_into_the_working_directory_holding_its_corpus_is_refused(w, monkeypatch):
    monkeypatch.chdir(w.corpus.parent)
    before = tree(w.root)
    code, text = cli("extract", w.corpus.name, "--model", w.model, "-o", ".", "-q")
    refused(code, text, "holds", "a corpus input")
    assert tree(w.root) == before


def test_a_run_command_on_the_working_directory_writes_only_its_own_files(w, monkeypatch):
    """`cd RUN && attnkit cluster . --overwrite` is how a run is analysed: it replaces clusters.json and the report
    drawn from it, and nothing else."""
    monkeypatch.chdir(w.run)
    (w.run / "report.html").write_text("old")
    before = tree(w.root)
    code, text = cli("cluster", ".", "-k", 2, "--stability", 2, "--seeds", 1, "-q", "--overwrite")
    assert code == 0, text
    after = tree(w.root)
    changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
    assert changed == {"run/clusters.json", "run/report.html"} and "run/report.html" not in after


# --- a symbolic link leading out of the output ------------------------------------------------------------------
@pytest.fixture
def outside(w):
    d = w.root / "outside"
    d.mkdir()
    return d


@pytest.mark.parametrize("command", ["report", "patterns"])
def test_figures_are_never_written_through_a_link_out_of_the_run(w, outside, command):
    """`attnkit report r` with r/figures a link to a folder outside the run wrote five PNGs there (issue 25)."""
    shutil.rmtree(w.run / "figures", ignore_errors=True)
    (w.run / "figures").symlink_to(outside, target_is_directory=True)
    before = tree(w.root)
    code, text = cli(*RUN_WRITERS[command](w), "--overwrite")
    refused(code, text, "figures leads out of", "symbolic link")
    assert tree(w.root) == before and list(outside.iterdir()) == []


def test_compare_models_refuses_a_figures_link_before_the_work(w, outside):
    out = w.root / "cmp"
    out.mkdir()
    (out / "figures").symlink_to(outside, target_is_directory=True)
    code, text = cli(*WRITERS["compare-models"](w, out))
    refused(code, text, "leads out of")
    assert list(outside.iterdir()) == [] and tree(out) == {"figures": ("->", str(outside))}


def test_extract_overwrite_removes_a_figures_link_not_what_it_leads_to(w, outside):
    (outside / "precious.png").write_bytes(b"x")
    out = w.root / "r"
    assert cli(*WRITERS["extract"](w, out))[0] == 0
    (out / "figures").symlink_to(outside, target_is_directory=True)
    code, text = cli(*WRITERS["extract"](w, out), "--overwrite")
    assert code == 0, text
    assert (outside / "precious.png").read_bytes() == b"x" and not (out / "figures").exists()


# --- two writers at once ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", sorted(WRITERS) + sorted(RUN_WRITERS))
def test_a_second_writer_is_refused_while_the_first_holds_the_output(w, lock_held, command):
    if command in RUN_WRITERS:
        out, args = w.run, RUN_WRITERS[command](w)
    elif command in ("export", "compare"):
        out = w.run
        args = WRITERS[command](w, w.run / ("t.csv" if command == "export" else "c.json"))
    else:
        out = w.root / "new"
        args = WRITERS[command](w, out)
    with lock_held(out, "attnkit extract") as pid:
        before = tree(w.root)
        code, text = cli(*args)
        after = tree(w.root)
    refused(code, text, "is in use by `attnkit extract`", f"pid {pid}")
    assert after == before


def test_two_prunes_into_one_new_directory_one_wins_cleanly(w, lock_held):
    """`prune -o p & prune -o p`: both said "wrote p" and p held only the last (issue 25). Held by the first, p
    refuses the second; once the first is done, the second is told that p exists."""
    out = w.root / "p"
    with lock_held(out, "attnkit prune") as pid:
        refused(*cli("prune", w.model, "--heads", "L0H0", "-o", out, "-q"), f"`attnkit prune` (pid {pid})")
    assert cli("prune", w.model, "--heads", "L0H0", "-o", out, "-q")[0] == 0
    kept = tree(out)
    refused(*cli("prune", w.model, "--heads", "L1H1", "-o", out, "-q"), "already exists", "--overwrite")
    assert tree(out) == kept


# --- a refusal after --overwrite removes nothing ---------------------------------------------------------------
def test_a_refused_mean_ablation_keeps_head_means(w):
    """`ablate --mode mean --mean-corpus empty.txt --overwrite` deleted OUT/head_means.npz before refusing."""
    out = w.root / "ab"
    out.mkdir()
    (out / "head_means.npz").write_bytes(b"earlier means")
    (out / "heads.csv").write_text("earlier table")
    before = tree(out)
    code, text = cli("ablate", w.model, "--task", "stsb", "--data", w.stsb, "--experiment", "heads", "--mode",
                     "mean", "--mean-corpus", w.empty, "--overwrite", "-o", out, "-q")
    refused(code, text, "has no text")
    assert tree(out) == before


def test_a_refused_ablate_leaves_no_empty_output(w):
    out = w.root / "ab"
    code, text = cli("ablate", w.model, "--task", "stsb", "--data", w.empty, "--experiment", "heads", "-o", out)
    refused(code, text)
    assert not out.exists()


def test_prune_overwrite_replaces_only_a_model_directory(w):
    out = w.root / "notmodel"
    (out / "sub").mkdir(parents=True)
    (out / "config.json").write_text("{}")
    (out / "sub" / "data.txt").write_text("mine")
    before = tree(out)
    code, text = cli("prune", w.model, "--heads", "L0H0", "-o", out, "--overwrite", "-q")
    refused(code, text, "is not a model directory")
    assert tree(out) == before


# (command, arguments after the command's own, what its refusal names): each is refused after --overwrite
OVERWRITE_REFUSALS = {
    "extract": lambda w: (["extract", w.empty, "--model", w.model, "-o", w.run, "--overwrite", "-q"], "has no text"),
    "cluster": lambda w: (["cluster", w.run, "--features", "nosuch", "--overwrite", "-q"], "nosuch"),
    "distances": lambda w: (["distances", w.run, "--corpus", w.empty, "--overwrite", "-q"], ""),
    "report": lambda w: (["report", w.run, "--examples", 1, "--corpus", w.empty, "--overwrite", "-q"], ""),
    "export": lambda w: (["export", w.run, "-o", w.run / "meta.json", "--overwrite"], "meta.json"),
    "compare": lambda w: (["compare", w.run, w.run2, "--json", w.run2 / "features.npz", "--overwrite"], "features"),
    "probe": lambda w: (["probe", w.root / "missing.conllu", "--model", w.model, "-o", w.run, "--overwrite", "-q"],
                        "missing.conllu"),
    "compare-models": lambda w: (["compare-models", w.model, w.model, w.empty, "-o", w.run, "--overwrite", "-q"],
                                 "has no text"),
}


@pytest.mark.parametrize("command", sorted(OVERWRITE_REFUSALS))
def test_a_refusal_after_overwrite_removes_nothing(w, command):
    args, words = OVERWRITE_REFUSALS[command](w)
    (w.run / "report.html").write_text("the report of these results")
    (w.run / "probe_heatmap.png").write_bytes(b"png")
    (w.run / "compare_models.json").write_text("{}")
    before = tree(w.root)
    code, text = cli(*args)
    refused(code, text, words)
    assert tree(w.root) == before


def test_what_readme_s_commands_and_the_examples_write_in_the_checkout_is_left_out_of_git():
    """Issue 46 item 3: README's SmolLM2 command and examples/induction_heads.py wrote into the repository root
    where .gitignore did not reach. Every output README's command blocks name (-o, --out), the commands' own
    default outputs (extract, probe, ablate) and the examples' default --out, made in the checkout, are ignored
    by git (asked of git itself: `git check-ignore`)."""
    import ast
    import re
    import subprocess

    from attnkit.ablation.options import AblateOptions, ablate_out

    root = Path(__file__).resolve().parent.parent
    if shutil.which("git") is None or subprocess.run(["git", "-C", str(root), "rev-parse", "--is-inside-work-tree"],
                                                     capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    blocks = re.findall(r"```bash\n(.*?)```", (root / "README.md").read_text(), re.S)
    outputs = {m for block in blocks for m in re.findall(r"(?:^|\s)(?:-o|--out)\s+([^\s;&|]+)", block)}
    assert "attnkit-run" in outputs  # README's first command
    outputs |= {str(p.default) for command in ("extract", "probe") for p in main.commands[command].params
                if p.name == "out"}
    outputs.add(ablate_out(AblateOptions(model="default", task_name="stsb", data="d", experiment="heads")))
    for example in sorted((root / "examples").glob("*.py")):
        for node in ast.walk(ast.parse(example.read_text())):
            if isinstance(node, ast.Call) and node.args and getattr(node.args[0], "value", None) == "--out":
                outputs |= {kw.value.value for kw in node.keywords if kw.arg == "default"}
    assert "runs/induction_heads" in outputs
    for out in sorted(outputs):
        made = subprocess.run(["git", "-C", str(root), "check-ignore", "-q", "--no-index", f"{out}/features.npz"])
        assert made.returncode == 0, f"{out}/ (written by a command README shows) is not ignored by git"
