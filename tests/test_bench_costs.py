"""bench/costs.py (issue 38's table in one run) at smoke sizes: the rows that need neither ../shared nor a converted
decoder print a table line each, with numbers, and the JSON holds the same. No figure is judged here (timings
never belong in unit tests); the script is run as a user runs it."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "costs.py"


def costs(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)


def test_quick_rows_print_one_table_with_numbers(tmp_path):
    out = tmp_path / "costs.json"
    res = costs("--quick", "--only", "minilm,lengths", "--json", str(out), "--stsb", str(tmp_path / "none.tsv"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    table = res.stdout[res.stdout.index("| case |"):].splitlines()
    head = res.stdout[:res.stdout.index("| case |")].splitlines()[-2]
    assert "(lscpu)" in head and "torch " in head and "threads" in head and "--quick" in head
    rows = [r for r in table[2:] if r.startswith("| ")]
    assert [r.split(" | ")[0] for r in rows] == ["| MiniLM at L=128", "| the kernel against sdpa"]
    for r in rows:
        cells = r.split(" | ")
        assert re.search(r"\d\.\d\d", cells[2]) and "python bench/cpu_capability.py" in cells[2], r
        assert cells[4] == "n/a (--quick)"
        assert re.fullmatch(r"[\d.]+, [\d.]+, [\d.]+ → [\d.]+, [\d.]+, [\d.]+ \|", cells[5]), r  # uptime's loads
    saved = json.loads(out.read_text())
    assert saved["quick"] is True and saved["machine"]["torch"]
    assert [x["row"] for x in saved["lines"]] == ["minilm", "lengths"]
    lengths = saved["lines"][1]["figures"]["rows"]
    assert [(x["L"], x["mask"]) for x in lengths] == [(128, "causal"), (128, "full"), (256, "causal"), (256, "full")]
    assert all(x["wall_over_sdpa"] > 0 for x in lengths)


def test_unknown_row_is_a_usage_error():
    res = costs("--only", "short,everything")
    assert res.returncode == 2
    assert "unknown row everything" in res.stderr and "Traceback" not in res.stderr
