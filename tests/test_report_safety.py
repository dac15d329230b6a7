"""The report runs no script that came from a file: a payload in every field that reaches the page is escaped
(element text, attributes, the JSON data), and a damaged file is a one-line error that names it, not a traceback
or a silent "missing" (issue 25 §2-4). In a real browser: tests/test_report_browser.py."""
import csv
import json
import re
from html.parser import HTMLParser

import numpy as np
import pytest
from click.testing import CliRunner

from attnkit.analysis.report import build_report
from attnkit.analysis.report_html import safe_json
from attnkit.errors import AttnkitError

from .synthetic import rich_run

PAYLOADS = ('"><img src=x onerror="window.pwned=1;alert(1)">', "</script><script>window.pwned=1;alert(1)</script>",
            "' onmouseover='alert(1)' x='", "<!--<script>alert(1)//", "\u2028\u2029<svg onload=alert(1)>")
P = PAYLOADS[0] + PAYLOADS[1] + PAYLOADS[2] + PAYLOADS[4]  # one string that tries each way out


class Page(HTMLParser):
    """Every element of a page with its attributes, and the text of its script elements."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags, self.scripts, self._in_script = [], [], None

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag == "script":
            self._in_script = dict(attrs).get("type", "js")
            self.scripts.append([self._in_script, ""])

    def handle_endtag(self, tag):
        if tag == "script":
            self._in_script = None

    def handle_data(self, data):
        if self._in_script is not None:
            self.scripts[-1][1] += data


def assert_inert(page: str) -> dict:
    """No element the page did not write itself: no event handler attribute, no script but the data and report.js,
    no <img> but embedded PNGs, no <svg> in the HTML; returns the embedded data."""
    p = Page()
    p.feed(page)
    for tag, attrs in p.tags:
        assert not [a for a in attrs if a.lower().startswith("on")], (tag, attrs)
        assert tag not in ("svg", "iframe", "object", "embed"), (tag, attrs)
        if tag == "img":
            assert attrs["src"].startswith("data:image/png;base64,")
        for a in ("href", "src"):
            assert not (attrs.get(a) or "").lower().startswith("javascript:")
    assert [t for t, _ in p.scripts] == ["application/json", "js"]
    assert "window.pwned" not in p.scripts[1][1] and "alert(" not in p.scripts[1][1]
    raw = p.scripts[0][1]
    assert all(c not in raw for c in "<>&'\u2028\u2029")  # the JSON cannot end its element nor break a script
    return json.loads(raw)


def strings(x):
    """Every string in a JSON value (keys included)."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield k
            yield from strings(v)
    elif isinstance(x, list):
        for v in x:
            yield from strings(v)
    elif isinstance(x, str):
        yield x


def _set(path, fn):
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def _rename_type(run, payload):
    def fn(d):
        old = d["clusters"][0]["type"]
        d["clusters"][0]["type"] = payload
        for h in d["heads"]:
            if h["type"] == old:
                h["type"] = payload
    _set(run / "clusters.json", fn)


def _sweep(run, payload):
    from attnkit.analysis.clustering import cluster, stability_over_seeds, sweep
    from attnkit.analysis.results import save_clusters
    from attnkit.run import HeadFeatures

    f = HeadFeatures.load(run)
    c = cluster(f, k=4, n_stability=2)
    rows = sweep(f, ks=(2, 3), n_stability=2, n_seeds=2)
    rows[0]["type_names"] = [payload]
    save_clusters(run, c, f, rows, stability_over_seeds(f, n_seeds=2, first=c, k=4, n_stability=2))


def _feature_name(run, payload):
    from attnkit.run import HeadFeatures

    f = HeadFeatures.load(run)
    mean = np.concatenate([f.mean, np.full(f.mean.shape[:2] + (1,), 0.5)], axis=2)
    HeadFeatures(mean, np.full_like(mean, 0.01), f.names + [payload], f.n_samples, f.n_tokens,
                 {k: v for k, v in f.meta.items() if k != "feature_names"}).save(run)


def _probe_csv(run, payload):
    rows = list(csv.DictReader(open(run / "probe.csv")))
    for r in rows:
        if r["relation"] == "det":
            r["relation"] = payload
    with open(run / "probe.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def _texts(run, payload):
    rows = list(csv.DictReader(open(run / "per_sample_rows.csv")))
    for r in rows:
        r["text"] = payload + r["text"]
    with open(run / "per_sample_rows.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


# every field of a file that reaches the page (the value must come back intact where the page shows it)
FIELDS = {
    # the run's model, named alike where the run's clusters record it (a clusters.json of another model is refused)
    "meta.json model": lambda run, p: [_set(run / "meta.json", lambda d: d.update(model=p)),
                                       _set(run / "clusters.json", lambda d: d["run"].update(model=p))],
    "meta.json setting name": lambda run, p: _set(run / "meta.json", lambda d: d.update({p: 1})),
    "meta.json nested setting": lambda run, p: _set(run / "meta.json", lambda d: d.update(
        settings={"reading": {"paths": [p]}, p: {"x": [p, {p: p}]}})),
    "meta.json inputs": lambda run, p: _set(run / "meta.json", lambda d: d.update(inputs=[{"path": p}])),
    "features.npz feature name": _feature_name,
    "clusters.json type": _rename_type,
    "clusters.json sweep type_names": _sweep,
    "clusters.json settings": lambda run, p: _set(run / "clusters.json", lambda d: d["settings"].update(
        method=p, **{p: [p]})),
    "patterns.json classes": lambda run, p: _set(run / "patterns.json", lambda d: [
        d[k].__setitem__(p, d[k].pop("block")) for k in ("per_head", "per_layer", "overall")]
        + [d.__setitem__("classes", [p if c == "block" else c for c in d["classes"]])]),
    "patterns.json rules": lambda run, p: _set(run / "patterns.json", lambda d: d["rules"].update({p: p})),
    "probe.json model": lambda run, p: _set(run / "probe.json", lambda d: d.update(model=p)),
    "probe.json baseline_offset": lambda run, p: _set(run / "probe.json", lambda d: d.update(
        relations={"nsubj": {"baseline_offset": p}})),
    "probe.csv relation": _probe_csv,
    "heads.meta.json task and model": lambda run, p: _set(run / "heads.meta.json", lambda d: d.update(task=p,
                                                                                                       model=p)),
    "heads.json setting": lambda run, p: _set(run / "heads.json", lambda d: d["rows"][1].update(setting=p)),
    "per_sample_rows.csv text": _texts,
}


@pytest.fixture
def fewer_figures(monkeypatch):
    """The report without its t-SNE, MDS and heatmap sections (figures of numbers only, and the slowest)."""
    from attnkit.analysis import report

    monkeypatch.setattr(report, "SECTIONS", [s for s in report.SECTIONS if s not in (report.head_maps,
                                                                                     report.heatmaps)])


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    run = tmp_path_factory.mktemp("clean") / "run"
    rich_run(run, n_samples=8)
    return run


@pytest.mark.parametrize("field", list(FIELDS))
def test_a_payload_in_any_field_is_shown_as_text(field, clean, tmp_path, fewer_figures):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(clean, run)
    FIELDS[field](run, P)
    page = build_report(run, svg=False, do_sweep=False).read_text()
    data = assert_inert(page)
    for p in PAYLOADS[:3]:  # not one payload in the markup as written
        assert p not in page
    assert "&lt;img src=x onerror=" in page or any(P in x for x in strings(data))  # shown, as text


def test_the_run_directory_name_is_escaped_in_the_title(clean, tmp_path):
    import shutil

    run = tmp_path / '"><img src=x onerror=alert(1)>'
    shutil.copytree(clean, run)
    page = build_report(run, svg=False, do_sweep=False).read_text()
    assert_inert(page)
    assert "<title>attnkit report: &#34;&gt;&lt;img src=x onerror=alert(1)&gt;</title>" in page


def test_example_tokens_are_data_not_markup(clean, tmp_path, monkeypatch):
    """Tokens of the example inputs go into the JSON data (escaped) and are drawn as text by report.js."""
    import shutil

    import attnkit.jobs.maps as maps_module

    run = tmp_path / "run"
    shutil.copytree(clean, run)

    def fake_maps(text, model, max_length=64):
        toks = ["[CLS]", PAYLOADS[1], PAYLOADS[0], "[SEP]"][:len(text.split()) + 2]
        n = len(toks)
        return maps_module.AttentionMaps(text, toks, np.full((3, 4, n, n), 1.0 / n, dtype=np.float32))

    monkeypatch.setattr(maps_module, "attention_maps", fake_maps)
    tok = lambda *parts, **kw: {"input_ids": list(range(len(" ".join(parts).split()) + 2))}
    page = build_report(run, svg=False, do_sweep=False, examples=2, texts=["a b", "a b c d e f g", "a"],
                        model=(object(), tok)).read_text()
    data = assert_inert(page)
    assert data["maps"]["texts"][0]["tokens"][1:3] == [PAYLOADS[1], PAYLOADS[0]]


def test_safe_json_escapes_what_could_end_a_script():
    text = str(safe_json({"a": "</script><!--\u2028\u2029&'"}))
    assert text == '{"a":"\\u003c/script\\u003e\\u003c!--\\u2028\\u2029\\u0026\\u0027"}'
    assert json.loads(text) == {"a": "</script><!--\u2028\u2029&'"}


# --- damaged files: one line naming the file ---------------------------------------------------------------------
def _drop_class(d):
    del d["per_head"]["block"]


def _ragged(d):
    d["per_head"]["block"][1] = d["per_head"]["block"][1][:2]


DAMAGED = {
    "patterns.json per_head lacks a class": ("patterns.json", _drop_class, "patterns.json is unreadable: field "
                                             "per_head lacks the class(es) 'block'"),
    "patterns.json per_head is ragged": ("patterns.json", _ragged, "patterns.json is unreadable: field "
                                         "per_head.block is ragged"),
    "patterns.json n_examples is a string": ("patterns.json", lambda d: d.update(n_examples="<b>9</b>"),
                                             "patterns.json: field n_examples: expected an integer"),
    "ablation experiment is a path": ("heads.meta.json", lambda d: d.update(experiment="../../../../etc/passwd"),
                                      "heads.meta.json: field experiment: "),
    "ablation delta is a word": ("heads.json", lambda d: d["rows"][2].update(delta_spearman="big"),
                                 "heads.json: field rows[2].delta_spearman: expected a number or null"),
    "ablation metric is markup": ("heads.json", lambda d: d.update(main_metric="<i>x</i>"),
                                  "heads.json: field main_metric: "),
    "probe.json layers is a string": ("probe.json", lambda d: d.update(layers="3"),
                                      "probe.json: field layers: expected an integer"),
    "clusters.json sweep n_seeds is markup": ("clusters.json", lambda d: d["stability"].update(
        sweep=[{"k": 2, "stability": 1.0, "silhouette": 0.5, "n_seeds": "<script>alert(1)</script>",
                "stability_mean": 1.0, "stability_min": 1.0, "stability_max": 1.0}]),
        "clusters.json: field stability.sweep[0].n_seeds: expected an integer"),
    "patterns.json is not JSON": ("patterns.json", None, "patterns.json is not valid JSON"),
    "per_sample_rows.csv lacks its row column": ("per_sample_rows.csv", "text,x\nabc,1\n",
                                                 "per_sample_rows.csv is unreadable: KeyError: 'row'"),
}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_a_damaged_file_is_one_line_naming_it(case, clean, tmp_path, fewer_figures):
    import shutil

    from attnkit.cli.analysis import report_cmd

    name, change, message = DAMAGED[case]
    run = tmp_path / "run"
    shutil.copytree(clean, run)
    if change is None:
        (run / name).write_text('{"classes": ["vertical", ')
    elif isinstance(change, str):
        (run / name).write_text(change)
    else:
        _set(run / name, change)
    with pytest.raises(AttnkitError, match=re.escape(message)):
        build_report(run, svg=False, do_sweep=False)
    r = CliRunner().invoke(report_cmd, [str(run), "--no-svg", "-q", "--examples", "0"])
    assert r.exit_code == 1 and "Traceback" not in r.output and message in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1
    assert not (run / "report.html").exists()


def test_an_ablation_table_is_found_by_the_meta_files_name_only(clean, tmp_path):
    """The experiment field never names a file: E.meta.json is read with E.json, whatever it says."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(clean, run)
    (run / "other.meta.json").write_text(json.dumps({"experiment": "heads"}))  # no other.json beside it
    page = build_report(run, svg=False, do_sweep=False).read_text()
    elsewhere = page.split('<section id="elsewhere">')[1].split("</section>")[0]
    assert "other.json is missing beside other.meta.json" in elsewhere


# --- per_sample.npy that cannot be used --------------------------------------------------------------------------
def _garbage(path):
    path.write_bytes(b"\x93NUMPY garbage" * 10)


def _truncated(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _wrong_shape(path):
    np.save(path, np.zeros((8, 2, 2, 3), dtype=np.float32))


@pytest.mark.parametrize("damage", [_garbage, _truncated, _wrong_shape])
def test_a_damaged_per_sample_file_is_named_as_damaged(damage, clean, tmp_path, fewer_figures):
    import shutil

    from attnkit.cli.analysis import report_cmd

    run = tmp_path / "run"
    shutil.copytree(clean, run)
    damage(run / "per_sample.npy")
    page = build_report(run, svg=False, do_sweep=False).read_text()
    data = assert_inert(page)
    assert data["examples"] is None
    assert data["notes"]["examples"].startswith("per_sample.npy is damaged and was not used: ")
    assert "No per_sample.npy" not in page and "per_sample.npy is damaged and was not used" in page.split("<nav")[0]
    r = CliRunner().invoke(report_cmd, [str(run), "--no-svg", "-q", "--examples", "0", "--overwrite"])
    assert r.exit_code == 0 and "per_sample.npy is damaged and was not used" in r.output, r.output
