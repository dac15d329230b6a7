"""The report in a real browser (headless Chromium driven by Selenium): click a head in the grid and read its
panel; sort a table; colour the grid by a feature. Skipped where Chromium, chromedriver or selenium is missing
(`apt-get install -y chromium chromium-driver`, `pip install -e ".[test]"`)."""
import csv
import json
import shutil

import numpy as np
import pytest

from attnkit.analysis.report import build_report

from .synthetic import rich_run

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
DRIVER = shutil.which("chromedriver")
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
pytestmark = pytest.mark.skipif(BROWSER is None or DRIVER is None,
                                reason="no chromium/chromedriver (apt-get install -y chromium chromium-driver)")


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1400,2000"):
        opts.add_argument(flag)
    opts.binary_location = BROWSER
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=DRIVER))
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    run = tmp_path_factory.mktemp("browser") / "run"
    f, per, texts, dist = rich_run(run)
    return build_report(run, svg=False), f, per, texts


def _panel_rows(driver, css):
    return [[td.text for td in tr.find_elements("css selector", "td")]
            for tr in driver.find_elements("css selector", f"#panel table.{css} tbody tr")]


def test_clicking_a_head_shows_its_panel(browser, report):
    page, f, per, texts = report
    from selenium.webdriver.support.ui import Select, WebDriverWait

    browser.get(page.as_uri())
    WebDriverWait(browser, 20).until(lambda d: d.find_element("id", "panel").get_attribute("data-head") == "L0H0")
    browser.find_element("css selector", '#grid td[data-head="L2H3"]').click()
    WebDriverWait(browser, 10).until(lambda d: d.find_element("id", "panel").get_attribute("data-head") == "L2H3")
    assert browser.find_element("id", "panel-title").text.startswith("L2H3 · layer 2, head 3")
    assert browser.execute_script("return location.hash") == "#L2H3"
    assert "selected" in browser.find_element("css selector", '#grid td[data-head="L2H3"]').get_attribute("class")
    # its features with their spread
    feats = {r[0]: r[1:3] for r in _panel_rows(browser, "panel-table") if len(r) == 4}
    for n in ("cls", "sep", "entropy", "win_3"):
        j = f.names.index(n)
        assert feats[n] == [f"{f.mean[2, 3, j]:.3f}", f"{f.std[2, 3, j]:.3f}"]
    # its type, as clusters.json says
    run = page.parent
    head = next(h for h in json.loads((run / "clusters.json").read_text())["heads"] if (h["layer"], h["head"]) == (2, 3))
    assert f"type {head['type']}" in browser.find_element("css selector", "#panel p.type").text
    # its top examples for a chosen feature, with their texts
    Select(browser.find_element("id", "example-feature")).select_by_value("entropy")
    top = _panel_rows(browser, "examples-top")
    col = per[:, 2, 3, f.names.index("entropy")]
    want = np.argsort(-col, kind="stable")[:3]
    assert [int(r[0]) for r in top] == list(want)
    assert [r[2] for r in top] == [texts[i] for i in want]
    # probe accuracy per relation over the baseline, best first
    best = {}
    for r in csv.DictReader(open(run / "probe.csv")):
        if (int(r["layer"]), int(r["head"])) == (2, 3):
            gain = float(r["accuracy"]) - float(r["baseline_accuracy"])
            best[r["relation"]] = max(best.get(r["relation"], -9), gain)
    probe = _panel_rows(browser, "probe")
    assert probe[0][0] == max(best, key=best.get) and probe[0][3] == f"{max(best.values()):+.3f}"
    # pattern shares and the ablation effect
    shares = json.loads((run / "patterns.json").read_text())["per_head"]
    assert [r[1] for r in _panel_rows(browser, "patterns")] == [f"{100 * shares[c][2][3]:.1f}%" for c in shares]
    delta = next(r for r in json.loads((run / "heads.json").read_text())["rows"][1:] if (r["layer"], r["head"]) == (2, 3))
    assert f"{delta['delta_spearman']:+.2f}" in _panel_rows(browser, "ablation")[0][1]
    # a nearest head is a link that selects it
    browser.find_element("css selector", "#panel a.head").click()
    assert browser.find_element("id", "panel").get_attribute("data-head") != "L2H3"


def test_tables_sort_and_the_grid_colours_by_a_feature(browser, report):
    page, f, *_ = report
    from selenium.webdriver.support.ui import Select

    browser.get("about:blank")
    browser.get(page.as_uri() + "#L1H1")
    assert browser.find_element("id", "panel").get_attribute("data-head") == "L1H1"  # the address keeps the head
    browser.execute_script("document.querySelectorAll('#tables details').forEach(d => d.open = true)")
    table = browser.find_element("css selector", "#tables table.sortable")
    header = [th.text.rstrip(" ⇅▲▼?") for th in table.find_elements("css selector", "thead th")]
    col = header.index("sep")
    th = table.find_elements("css selector", "thead th")[col]
    th.click()
    values = [float(tr.find_elements("css selector", "td")[col].text)
              for tr in table.find_elements("css selector", "tbody tr")]
    assert values == sorted(values) and len(values) == f.n_layers * f.n_heads
    th.click()
    values = [float(tr.find_elements("css selector", "td")[col].text)
              for tr in table.find_elements("css selector", "tbody tr")]
    assert values == sorted(values, reverse=True)
    Select(browser.find_element("id", "grid-colour")).select_by_value("sep")
    cell = browser.find_element("css selector", '#grid td[data-head="L2H1"]')
    assert cell.text == f"{f.mean[2, 1, f.names.index('sep')]:.2f}"
