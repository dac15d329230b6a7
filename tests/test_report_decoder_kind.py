"""A decoder run's report speaks decoder (issue 35 item 3): its head types are named by a decoder's classes and agree
with the shares shown beside them, its glossary, tables and panel leave out the features that are 0 for every head of
a causal model (cls_entropy, next) and define `cls` as the first position, its clustering refuses them, and its head
view shows byte-level BPE tokens as text."""
from __future__ import annotations

import html
import json
import re
import shutil

import pytest
from click.testing import CliRunner

from attnkit.analysis.naming import DECODER_CLASSES, ENCODER_CLASSES
from attnkit.cli.main import main

from .conftest import SENTENCES
from .synthetic import tiny_decoder
from .test_str_tokens import byte_bpe  # noqa: F401  (the fixture)


def run(*args, code: int = 0):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result.output


def section(page: str, name: str) -> str:
    start = page.index(f'<section id="{name}"')
    return page[start:page.index("</section>", start)]


def page_data(page: str) -> dict:
    start = page.index('id="attnkit-data"')
    return json.loads(page[page.index(">", start) + 1:page.index("</script>", start)])


def cells(row: str) -> list[str]:
    return [re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", "", c))).strip()
            for c in re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", row, re.S)]


def types_table(page: str) -> tuple[list[str], list[list[str]]]:
    """The findings' table of head types: its header and rows, as text."""
    body = section(page, "findings")
    table = body[body.index("<table", body.index("Head types")):]
    table = table[:table.index("</table>")]
    rows = re.findall(r"<tr>(.*?)</tr>", table, re.S)
    return cells(rows[0]), [cells(r) for r in rows[1:]]


@pytest.fixture(scope="module")
def decoder_run(tmp_path_factory, byte_bpe):  # noqa: F811
    root = tmp_path_factory.mktemp("decoder-kind")
    model = root / "gpt"
    tiny_decoder("llama", vocab=len(byte_bpe), n_layers=3).save_pretrained(model)
    byte_bpe.save_pretrained(model)
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(SENTENCES * 2) + "\n")
    run("extract", corpus, "--model", model, "--max-length", 32, "-o", root / "run", "-q")
    run("cluster", root / "run", "-k", 3, "--stability", 2, "-q")
    run("report", root / "run", "--examples", 2, "-q")
    return root


@pytest.fixture(scope="module")
def page(decoder_run):
    return (decoder_run / "run" / "report.html").read_text()


def test_types_are_named_by_a_decoders_classes_and_agree_with_the_shares_beside_them(decoder_run, page):
    data = json.loads((decoder_run / "run" / "clusters.json").read_text())
    names = [c["type"] for c in data["clusters"]]
    assert all(n.split("+")[0].split(" ")[0] in DECODER_CLASSES for n in names), names
    assert not any("#" in n or n.split("+")[0] in ENCODER_CLASSES for n in names)
    header, rows = types_table(page)
    assert header[:3] == ["type", "heads", "share"] and header[3:3 + len(DECODER_CLASSES)] == list(DECODER_CLASSES)
    assert [r[0] for r in rows] == names
    for r in rows:  # the share a name starts with is the largest class share shown beside it
        shown = {c: float(v) for c, v in zip(header[3:], r[3:]) if c in DECODER_CLASSES}
        assert shown[r[0].split("+")[0].split(" ")[0]] == max(shown.values()), (r, header)
    for c in data["clusters"]:  # clusters.json keeps the class shares the names are made of
        assert sum(c["profile"][k] for k in DECODER_CLASSES) == pytest.approx(1.0, abs=1e-5)


def test_the_glossary_tables_and_panel_leave_out_what_is_zero_for_every_decoder_head(page):
    glossary = section(page, "glossary")
    rows = {cells(r)[0]: cells(r)[1] for r in re.findall(r"<tr id=[^>]*>(.*?)</tr>", glossary, re.S)}
    assert "cls_entropy" not in rows and "next" not in rows and "prev" in rows and "entropy" in rows
    assert "first position" in rows["cls"] and "[CLS]" not in rows["cls"]
    assert "EOS" in rows["sep"]
    tables = section(page, "tables")
    assert "cls_entropy" not in tables and ">next<" not in tables
    data = page_data(page)
    assert "cls_entropy" not in data["features"]["names"] and "next" not in data["features"]["names"]
    assert len(data["features"]["mean"][0]) == len(data["features"]["names"])
    assert "cls_entropy" not in section(page, "explorer")


def test_the_head_view_shows_byte_level_tokens_as_text(page):
    tokens = [t for text in page_data(page)["maps"]["texts"] for t in text["tokens"]]
    assert tokens and not any("Ġ" in t for t in tokens)
    assert any(t.startswith(" ") for t in tokens)


def test_clustering_a_decoder_run_leaves_out_its_constant_features(decoder_run, tmp_path):
    shutil.copytree(decoder_run / "run", tmp_path / "run")  # a new clustering removes the report
    decoder_run = tmp_path
    out = run("cluster", decoder_run / "run", "-k", 2, "--stability", 0, "--features", "cls,cls_entropy",
              "--overwrite", "-q", code=1)  # as an unknown feature
    assert "cls_entropy is 0 for every head of a decoder's run (the CLS row is row 0, which sees only itself)" in out
    run("cluster", decoder_run / "run", "-k", 2, "--stability", 0, "--features", "all", "--overwrite", "-q")
    data = json.loads((decoder_run / "run" / "clusters.json").read_text())
    assert "cls_entropy" not in data["settings"]["features"] and "next" not in data["settings"]["features"]
    assert "prev" in data["settings"]["features"]


def test_the_head_view_in_a_browser_draws_the_tokens_text(decoder_run, page, byte_bpe):  # noqa: F811
    from .test_report_browser import BROWSER, DRIVER

    if BROWSER is None or DRIVER is None:
        pytest.skip("no chromium/chromedriver (apt-get install -y chromium chromium-driver)")
    from selenium.webdriver.support.ui import WebDriverWait

    from .test_report_browser import chromium

    driver = chromium()
    try:
        driver.get((decoder_run / "run" / "report.html").as_uri())
        WebDriverWait(driver, 20).until(lambda d: d.find_elements("css selector", "#hv-draw text.tok-q"))
        drawn = [e.get_attribute("textContent") for e in driver.find_elements("css selector", "#hv-draw text.tok-q")]
        first = page_data(page)["maps"]["texts"][0]["tokens"]
        assert drawn == first
        assert "".join(drawn).strip() in {s.strip() for s in SENTENCES}  # the text itself, token by token
        assert not any("Ġ" in t for t in drawn)
    finally:
        driver.quit()
