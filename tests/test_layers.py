"""The import layering of docs/architecture.md, checked on the source: every import of every module of attnkit
(lazy imports inside functions included) goes to its own layer or one below, no module imports the package root,
the modules import each other without a cycle, and no private name crosses a module.

The modules are parsed (ast), not imported, so the check sees every import whatever runs."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "attnkit"

# docs/architecture.md, bottom to top: a module may import its own layer and the layers below it.
LAYERS = [
    ("core", ["attnkit.errors", "attnkit.features"]),
    ("ops", ["attnkit.reference", "attnkit.ops", "attnkit.words", "attnkit.kernels", "attnkit.process"]),
    ("files", ["attnkit.run", "attnkit.corpus"]),
    ("model", ["attnkit.tokens", "attnkit.attention", "attnkit.hf_attention", "attnkit.models", "attnkit.interventions",
               "attnkit.arch", "attnkit.caching", "attnkit.embedded", "attnkit.training"]),
    ("plotting", ["attnkit.plotting"]),
    ("engine", ["attnkit.engine"]),
    ("jobs", ["attnkit.jobs"]),
    ("analyses", ["attnkit.analysis", "attnkit.ablation", "attnkit.probe"]),
    ("cli", ["attnkit.cli"]),
    ("root", ["attnkit", "attnkit.compare", "attnkit.per_sample"]),  # the package and its re-export modules
]
# packages of one layer that must not import each other either
SIBLINGS = ("attnkit.analysis", "attnkit.ablation", "attnkit.probe")


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules(root: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def layer_of(module: str) -> int:
    """The layer of `module`: that of the longest prefix LAYERS names."""
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), i
    if rank is None:
        raise AssertionError(f"{module} is in no layer of docs/architecture.md")
    return rank


def imports_of(module: str, path: Path, modules: dict) -> list[tuple[str, int, list[str]]]:
    """(imported attnkit module, line, names taken from it) for every import statement anywhere in the file."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, []) for a in node.names if a.name.split(".")[0] == "attnkit"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "attnkit":
                continue
            names = [a.name for a in node.names]
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
            out += [(s, node.lineno, []) for s in subs]  # `from . import ops`: the submodule itself
            rest = [n for n in names if f"{target}.{n}" not in modules]
            if rest or not subs:
                out.append((target, node.lineno, rest))
    return out


def import_graph(root: Path = PACKAGE) -> tuple[dict, list]:
    modules = all_modules(root)
    graph = {m: set() for m in modules}
    edges = []
    for m, path in modules.items():
        for target, line, names in imports_of(m, path, modules):
            if target != m:
                graph[m].add(target)
                edges.append((m, target, line, names))
    return graph, edges


def find_cycle(graph: dict) -> list | None:
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def layering_problems(root: Path = PACKAGE) -> list[str]:
    graph, edges = import_graph(root)
    problems = []
    for importer, target, line, names in edges:
        where = f"{importer} (line {line})"
        if target == "attnkit" and importer != "attnkit":
            problems.append(f"{where} imports the package root")
        elif layer_of(target) > layer_of(importer):
            problems.append(f"{where} imports {target}: layer {LAYERS[layer_of(target)][0]} is above "
                            f"{LAYERS[layer_of(importer)][0]}")
        own, other = (next((p for p in SIBLINGS if m == p or m.startswith(p + ".")), None) for m in (importer, target))
        if own and other and own != other:
            problems.append(f"{where} imports {target}: {own} and {other} do not import each other")
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        if private:
            problems.append(f"{where} imports the private name(s) {', '.join(private)} of {target}")
    cycle = find_cycle(graph)
    if cycle:
        problems.append("import cycle: " + " → ".join(cycle))
    return problems


def test_imports_follow_the_layers_without_cycles():
    problems = layering_problems()
    assert not problems, "\n".join(problems)


def test_every_module_is_in_a_layer():
    for m in all_modules():
        layer_of(m)


def test_at_most_thirteen_modules_under_the_package_root():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 13, top


@pytest.mark.parametrize("bad, problem", [
    ("from ..cli.options import RUN\n", "imports attnkit.cli.options: layer cli is above files"),
    ("def lazy():\n    from ..engine import run_extraction\n", "imports attnkit.engine: layer engine is above files"),
    ("from .. import __version__\n", "imports the package root"),
    ("from .head_features import _short\n", "private name(s) _short"),
    ("from .rundir import RunDir\n", "import cycle"),
])
def test_the_check_finds_an_upward_import_a_cycle_and_a_private_name(tmp_path, bad, problem):
    """The check itself: a copy of the package with one bad import added to attnkit/run/files.py."""
    import shutil

    copy = tmp_path / "attnkit"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "*.so", "data"))
    files = copy / "run" / "files.py"
    files.write_text(files.read_text() + "\n" + bad)
    problems = layering_problems(copy)
    assert any(problem in p for p in problems), problems


def test_only_the_command_line_imports_click():
    """The library and the jobs behind the command line report through callbacks; click is the cli's."""
    users = []
    for m, path in all_modules().items():
        if m == "attnkit.cli" or m.startswith("attnkit.cli."):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            users += [f"{m} (line {node.lineno})" for n in names if n.split(".")[0] == "click"]
    assert not users, users
