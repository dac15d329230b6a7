"""tools/render_report.sh: a screenshot of the whole page, and a clear failure on bad paths."""
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "render_report.sh"
BROWSER = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
needs_chromium = pytest.mark.skipif(BROWSER is None, reason="no chromium (apt-get install -y chromium)")


def render(*args):
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=120)


def png_size(path) -> tuple[int, int]:
    head = Path(path).read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


@pytest.fixture
def page(tmp_path):
    """A 5200 px tall page (taller than the old fixed 4000 px window)."""
    path = tmp_path / "report.html"
    path.write_text('<!DOCTYPE html><html><head><style>body{margin:0}</style></head><body>'
                    '<div style="height:5200px;background:#ddeeff">tall</div></body></html>\n')
    return path


@needs_chromium
def test_whole_page_is_rendered(tmp_path, page):
    out = tmp_path / "shot.png"
    r = render(page, out, 900)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(out)
    assert png_size(out) == (900, 5200)


@needs_chromium
def test_bad_paths_fail_with_a_message(tmp_path, page):
    name = f"attnkit-render-test-{tmp_path.name}.png"
    r = render(page, tmp_path / "missing-folder" / name)
    assert r.returncode == 1 and "output folder" in r.stderr and "does not exist" in r.stderr
    assert not (Path("/") / name).exists() and not (tmp_path / name).exists()
    r = render(tmp_path / "nothing.html", tmp_path / "x.png")
    assert r.returncode == 1 and "nothing.html does not exist" in r.stderr
    r = render(tmp_path, tmp_path / "x.png")
    assert r.returncode == 1 and "is not a file" in r.stderr
    r = render(page, tmp_path)
    assert r.returncode == 1 and "is a folder" in r.stderr
    r = render(page, tmp_path / "x.png", "wide")
    assert r.returncode == 1 and "WIDTHxHEIGHT" in r.stderr
    assert not (tmp_path / "x.png").exists()
    assert render().returncode == 1
