"""Every file `attnkit report` reads, missing, damaged and from another model (issue 34 §2 and §6): a file the page
cannot do without is a one-line error that names it; a result of another command that is another model's (or
another run's) is listed under "Results not shown here" with the reason, never shown as this run's; per-sample
examples whose rows table is missing or cut short are left out, naming it. The model identity each command records
(attnkit/run/identity.py) and how older files without it are compared. And the glossary's "defined in" column
(issue 35 §6)."""
from __future__ import annotations

import html
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from attnkit.analysis.report import build_report
from attnkit.errors import AttnkitError
from attnkit.run.identity import config_sha256, model_identity, model_mismatch, recorded_identity

from .synthetic import rich_run, tiny_decoder

RUN_MODEL = {"name": "A", "path": "/models/A", "model_type": "bert", "n_layers": 3, "n_heads": 4,
             "config_sha256": "a" * 64}
OTHER_MODEL = {**RUN_MODEL, "name": "B", "path": "/models/B"}  # the same shape and configuration: a fine-tune


def _set(path: Path, fn) -> None:
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def _detected(run: Path, identity: dict | None = RUN_MODEL, n_layers: int = 3) -> None:
    """detected_heads.csv and .json of detect-heads, as it writes them (3 × 4 heads, two kinds)."""
    rng = np.random.default_rng(0)
    lines = ["layer,head,previous,induction"] + [f"{l},{h},{rng.random():.4f},{rng.random():.4f}"
                                                  for l in range(n_layers) for h in range(4)]
    (run / "detected_heads.csv").write_text("\n".join(lines) + "\n")
    meta = {"model": "A", "model_type": "bert", "kinds": ["previous", "induction"], "length": 8, "n_sequences": 4,
            "seed": 0, "bos": None, "corpus": "attnkit default corpus", "n_layers": n_layers, "n_heads": 4}
    if identity is not None:
        meta["model_identity"] = {**identity, "n_layers": n_layers}
    (run / "detected_heads.json").write_text(json.dumps(meta))


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    """A run of model A that records its identity, with every result attnkit can attach, all of model A; and a
    run of the same corpus under norm weighting, to include."""
    root = tmp_path_factory.mktemp("inputs")
    run = root / "run"
    f, *_ = rich_run(run, n_samples=8)
    _set(run / "meta.json", lambda d: d.update(model="A", model_type="bert", model_identity=RUN_MODEL,
                                               settings={"corpus_sha256": "c" * 64}))
    _set(run / "clusters.json", lambda d: d["run"].update(model="A"))
    for name in ("probe.json", "heads.meta.json"):
        _set(run / name, lambda d: d.update(model="A", model_identity=RUN_MODEL))
    _detected(run)
    from attnkit.run import HeadDistances, HeadFeatures

    dist = HeadDistances.load(run)  # the run's distances, of its model and corpus
    dist.meta.update(model_identity=RUN_MODEL, corpus_sha256="c" * 64)
    dist.save(run)

    HeadFeatures(f.mean * 0.5, f.std, f.names, f.n_samples, f.n_tokens,
                 {**json.loads((run / "meta.json").read_text()), "weighting": "norm"}).save(root / "norm")
    return root


@pytest.fixture
def fewer_figures(monkeypatch):
    from attnkit.analysis import report

    monkeypatch.setattr(report, "SECTIONS", [s for s in report.SECTIONS if s not in (report.head_maps,
                                                                                     report.heatmaps)])


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _bad_json(path: Path) -> None:
    path.write_text('{"model": "A", ')


def _other_identity(path: Path) -> None:
    _set(path, lambda d: d.update(model_identity=OTHER_MODEL))


def _features_of_other_shape(path: Path) -> None:
    np.savez(path, mean=np.full((2, 4, 28), 0.1), std=np.full((2, 4, 28), 0.01),
             names=np.array(json.loads((path.parent / "meta.json").read_text()).get("feature_names")
                            or [f"f{i}" for i in range(28)]))


def _distances_of_other_shape(path: Path) -> None:
    from attnkit.run.distances import HeadDistances

    HeadDistances(np.ones((8, 8)) - np.eye(8), 100, 2, 4).save(path.parent)


def _per_sample_of_other_shape(path: Path) -> None:
    np.save(path, np.zeros((8, 2, 4, 28), dtype=np.float32))


def _rows_of_another_run(path: Path) -> None:
    text = path.read_text()
    path.write_text(text + "".join(f"{i},0,{i},more,\n" for i in range(8, 12)))


def _rows_cut_short(path: Path) -> None:
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:5]))  # the header and 4 of the 8 rows, each complete


def _probe_rows_cut_short(path: Path) -> None:
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-6]))


def _probe_rows_of_another_model(path: Path) -> None:
    path.write_text(path.read_text() + "nsubj,5,0,dep->head,10,50,0.2,-1,0.4\n")


def _heads_table_of_another_model(path: Path) -> None:
    _set(path, lambda d: d["rows"].append({"setting": "L5H0 zero", "layer": 5, "head": 0, "spearman": 79.0,
                                           "delta_spearman": -1.0}))


def _detected_rows_cut_short(path: Path) -> None:
    path.write_text("\n".join(path.read_text().splitlines()[:-1]) + "\n")


def _detected_rows_of_another_model(path: Path) -> None:
    path.write_text(path.read_text() + "5,0,0.1,0.1\n")


# (the file, relative to the run or to the included norm run "norm/…"; what is done to it) → what the report does:
# ("error", text): a one-line error naming the file; ("elsewhere", text): listed as not shown, with the reason;
# ("note", text): the page says so; ("gone", key): the result is simply not there (nothing claims it).
CASES = {
    ("meta.json", "missing"): ("error", "meta.json is missing: the report needs the run's record"),
    ("meta.json", "damaged"): ("error", "meta.json is not valid JSON"),
    ("meta.json", "another model's"): ("error", "meta.json: field n_layers is 5 but"),
    ("features.npz", "missing"): ("error", "features.npz is missing"),
    ("features.npz", "damaged"): ("error", "features.npz is unreadable or corrupt"),
    ("features.npz", "another model's"): ("error", "meta.json: field n_layers is 3 but"),
    ("clusters.json", "missing"): ("note", "clusters.json was missing; clustered now"),
    ("clusters.json", "damaged"): ("error", "clusters.json is not valid JSON"),
    ("clusters.json", "another model's"): ("error", "clusters.json is another run's (made with the model B"),
    ("distances.npz", "missing"): ("gone", "near"),  # no nearest heads by divergence (the MDS map's note: below)
    ("distances.npz", "damaged"): ("error", "distances.npz is unreadable or corrupt"),
    ("distances.npz", "another model's"): ("elsewhere", "made with a model of 2 layers × 4 heads, the run's has 3 × 4"),
    ("per_sample.npy", "missing"): ("note", "No per_sample.npy in this run"),
    ("per_sample.npy", "damaged"): ("note", "per_sample.npy is damaged and was not used"),
    ("per_sample.npy", "another model's"): ("note", "per_sample.npy is damaged and was not used"),
    ("per_sample.json", "damaged"): ("note", "per_sample.npy is damaged and was not used: "),
    ("per_sample.json", "another model's"): ("note", "per_sample.npy is damaged and was not used"),
    ("per_sample_rows.csv", "missing"): ("note", "per_sample_rows.csv is missing (per_sample.json lists it): the top "
                                                 "and bottom examples are left out"),
    ("per_sample_rows.csv", "damaged"): ("note", "per_sample_rows.csv is cut short or damaged: it describes 4 of the "
                                                 "8 rows of per_sample.npy in order: the top and bottom examples are "
                                                 "left out"),
    ("per_sample_rows.csv", "another model's"): ("note", "per_sample_rows.csv describes 12 rows, per_sample.npy holds "
                                                         "8: it is another run's"),
    ("patterns.json", "missing"): ("gone", "patterns"),
    ("patterns.json", "damaged"): ("error", "patterns.json is not valid JSON"),
    ("patterns.json", "another model's"): ("elsewhere", "it classified 999 examples, the run measured 8 samples"),
    ("probe.json", "missing"): ("gone", "probe"),
    ("probe.json", "damaged"): ("error", "probe.json is not valid JSON"),
    ("probe.json", "another model's"): ("elsewhere", "made with the model in /models/B, the run with the one in "
                                                     "/models/A"),
    ("probe.csv", "missing"): ("elsewhere", "probe.csv is missing beside probe.json"),
    ("probe.csv", "damaged"): ("error", "probe.csv is unreadable: ValueError: relation"),
    ("probe.csv", "another model's"): ("error", "probe.csv is unreadable: ValueError: line"),
    ("heads.meta.json", "missing"): ("gone", "ablation"),
    ("heads.meta.json", "damaged"): ("error", "heads.meta.json is not valid JSON"),
    ("heads.meta.json", "another model's"): ("elsewhere", "made with the model in /models/B"),
    ("heads.json", "missing"): ("elsewhere", "heads.json is missing beside heads.meta.json"),
    ("heads.json", "damaged"): ("error", "heads.json is not valid JSON"),
    ("heads.json", "another model's"): ("elsewhere", "heads.json names head L5H0, outside the run's 3 × 4"),
    ("detected_heads.json", "missing"): ("gone", "detected"),
    ("detected_heads.json", "damaged"): ("error", "detected_heads.json is not valid JSON"),
    ("detected_heads.json", "another model's"): ("elsewhere", "made with the model in /models/B"),
    ("detected_heads.csv", "missing"): ("elsewhere", "detected_heads.csv is missing beside detected_heads.json"),
    ("detected_heads.csv", "damaged"): ("error", "detected_heads.csv is unreadable: it lacks 1 of the 12 heads"),
    ("detected_heads.csv", "another model's"): ("error", "detected_heads.csv is unreadable: ValueError: line 14 is "
                                                         "out of range"),
    ("norm/meta.json", "missing"): ("elsewhere", "meta.json is missing beside features.npz"),
    ("norm/meta.json", "damaged"): ("error", "norm/meta.json is not valid JSON"),
    ("norm/meta.json", "another model's"): ("elsewhere", "made with the model in /models/B"),
    ("norm/features.npz", "damaged"): ("error", "norm/features.npz is unreadable or corrupt"),
    # where the corpus matters: a run of the other weighting must have measured the same samples
    ("norm/meta.json", "another corpus's"): ("elsewhere", "not one corpus under two weightings: corpus_sha256 differ"),
}
DAMAGE = {
    "missing": lambda path: path.unlink(),
    "damaged": {".json": _bad_json, ".npz": _truncate, ".npy": _truncate}.get,
}
ANOTHER = {
    "meta.json": lambda p: _set(p, lambda d: d.update(n_layers=5)),
    "features.npz": _features_of_other_shape,
    "clusters.json": lambda p: _set(p, lambda d: d["run"].update(model="B")),
    "distances.npz": _distances_of_other_shape,
    "per_sample.npy": _per_sample_of_other_shape,
    "per_sample.json": lambda p: _set(p, lambda d: d.update(names=["x"] * len(d["names"]))),
    "per_sample_rows.csv": _rows_of_another_run,
    "patterns.json": lambda p: _set(p, lambda d: d.update(n_examples=999)),
    "probe.json": _other_identity, "probe.csv": _probe_rows_of_another_model,
    "heads.meta.json": _other_identity, "heads.json": _heads_table_of_another_model,
    "detected_heads.json": _other_identity, "detected_heads.csv": _detected_rows_of_another_model,
    "norm/meta.json": _other_identity,
}
DAMAGED_TABLES = {"per_sample_rows.csv": _rows_cut_short, "probe.csv": _probe_rows_cut_short,
                  "detected_heads.csv": _detected_rows_cut_short}


def _page_data(page: str) -> dict:
    return json.loads(re.search(r'id="attnkit-data">(.*?)</script>', page, re.S).group(1))


def _visible(page: str) -> str:
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", page)))


@pytest.mark.parametrize("name, how", list(CASES), ids=[f"{n} {h}" for n, h in CASES])
def test_every_file_the_report_reads(name, how, clean, tmp_path, fewer_figures):
    from attnkit.cli.analysis import report_cmd

    shutil.copytree(clean, tmp_path / "c")
    run, norm = tmp_path / "c" / "run", tmp_path / "c" / "norm"
    path = (norm / name[5:]) if name.startswith("norm/") else run / name
    base = name.rsplit("/", 1)[-1]
    if how == "missing":
        path.unlink()
    elif how == "damaged":
        (DAMAGED_TABLES.get(base) or DAMAGE["damaged"](path.suffix))(path)
    elif how == "another corpus's":
        _set(path, lambda d: d["settings"].update(corpus_sha256="d" * 64))
    else:
        ANOTHER[name](path)
    kind, text = CASES[name, how]
    include = [str(norm)]
    if kind == "error":
        with pytest.raises(AttnkitError, match=re.escape(text)):
            build_report(run, svg=False, do_sweep=False, include=include)
        r = CliRunner().invoke(report_cmd, [str(run), "--no-svg", "-q", "--examples", "0", "--include", str(norm)])
        assert r.exit_code != 0 and "Traceback" not in r.output and text in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1 and not (run / "report.html").exists()
        return
    # (k given: where clusters.json is missing the report clusters now, at k = 4, without a k sweep to wait for)
    page = build_report(run, svg=False, do_sweep=False, include=include, k=4).read_text()
    data = _page_data(page)
    if kind == "elsewhere":
        elsewhere = _visible(page.split('<section id="elsewhere">')[1].split("</section>")[0])
        assert text in elsewhere
        if base == "heads.meta.json" or base == "heads.json":
            assert data["ablation"] == [] and '<section id="ablation">' not in page
        if base.startswith("detected_heads"):
            assert data["detected"] is None and '<section id="detected">' not in page
        if base.startswith("probe"):
            assert data["probe"] is None and '<section id="probe">' not in page
        if base == "distances.npz":
            assert data["near"]["js"] is None
        if base == "patterns.json":
            assert data["patterns"] is None and '<section id="patterns">' not in page
        if name.startswith("norm/"):
            assert "survives" not in _visible(page.split('<section id="findings">')[1].split("</section>")[0])
    elif kind == "note":
        assert text in _visible(page)
        if base.startswith("per_sample"):
            assert data["examples"] is None and data["notes"]["examples"].startswith(text.split(":")[0])
        if base.startswith("per_sample") and (base, how) != ("per_sample.npy", "missing"):  # damage is warned of
            r = CliRunner().invoke(report_cmd, [str(run), "--no-svg", "-q", "--examples", "0", "--overwrite"])
            assert r.exit_code == 0 and text.split(":")[0] in r.output, r.output  # said on the terminal too
    elif text == "near":
        assert data["near"]["js"] is None and data["near"]["feat"]
    else:
        assert data[text] in (None, []) and f'<section id="{text}">' not in page
        assert '<section id="elsewhere">' not in page


def test_the_clean_run_shows_everything_it_has(clean, tmp_path, fewer_figures):
    """The cases above start from a run whose every result is shown: what they leave out, they left out."""
    shutil.copytree(clean, tmp_path / "c")
    page = build_report(tmp_path / "c" / "run", svg=False, do_sweep=False, include=[tmp_path / "c" / "norm"])
    text = page.read_text()
    data = _page_data(text)
    assert data["probe"] and data["patterns"] and data["detected"] and data["ablation"] and data["examples"]
    assert data["near"]["js"]
    assert '<section id="elsewhere">' not in text and "survives" in _visible(text)
    assert "no model identity" not in _visible(text)


# --- issue 34 §2: another model's results included -------------------------------------------------------------
def test_another_models_ablation_of_the_same_shape_is_not_shown_as_this_runs(clean, tmp_path, fewer_figures):
    """The issue's case, where the shapes cannot tell: a loss ablation of another model included into the run."""
    shutil.copytree(clean, tmp_path / "c")
    run, other = tmp_path / "c" / "run", tmp_path / "other"
    other.mkdir()
    rows = [{"setting": "baseline", "layer": None, "head": None, "loss": 3.0}] + [
        {"setting": f"L{l}H{h} zero", "layer": l, "head": h, "loss": 3.0 + (l == 0 and h == 2),
         "delta_loss": float(l == 0 and h == 2), "delta_loss_lo": 0.0, "delta_loss_hi": 2.0}
        for l in range(3) for h in range(4)]
    (other / "heads.json").write_text(json.dumps({"experiment": "heads", "main_metric": "loss", "rows": rows}))
    (other / "heads.meta.json").write_text(json.dumps({"experiment": "heads", "model": "B", "task": "lm",
                                                       "model_identity": OTHER_MODEL}))
    page = build_report(run, svg=False, do_sweep=False, include=[other]).read_text()
    findings = _visible(page.split('<section id="findings">')[1].split("</section>")[0])
    assert "L0H2" not in findings and "raises loss" not in findings
    assert all(a["source"] != "other/heads.json" for a in _page_data(page)["ablation"])
    elsewhere = _visible(page.split('<section id="elsewhere">')[1].split("</section>")[0])
    assert "other/heads.meta.json made with the model in /models/B, the run with the one in /models/A" in elsewhere
    # the same table of the run's own model is shown, and read as a loss
    _set(other / "heads.meta.json", lambda d: d.update(model_identity=RUN_MODEL))
    (run / "report.html").unlink()
    page = build_report(run, svg=False, do_sweep=False, include=[other]).read_text()
    assert "disabling L0H2 alone raises loss the most" in _visible(page)


def _with_distances(run: Path, **meta) -> None:
    """Rewrite RUN/distances.npz with `meta` (model_identity, corpus_sha256; None: not recorded, as older files)."""
    from attnkit.run import HeadDistances

    dist = HeadDistances.load(run)
    dist.meta.update(meta)
    dist.save(run)


@pytest.mark.parametrize("meta, why", [
    ({"model_identity": OTHER_MODEL}, "made with the model in /models/B, the run with the one in /models/A"),
    ({"model_identity": {**RUN_MODEL, "path": None, "name": "B", "config_sha256": "b" * 64}},
     "made with another model (B: its configuration differs from that of the run's model, /models/A)"),
    ({"corpus_sha256": "d" * 64}, "measured over another corpus than the run's (corpus_sha256 differ)"),
])
def test_another_models_distances_of_the_same_shape_are_not_shown(meta, why, clean, tmp_path, fewer_figures):
    """distances.npz copied from another model's run (or measured over another corpus) of the run's layers × heads:
    listed under "Results not shown here" with the reason; no MDS map and no nearest heads by divergence."""
    from attnkit.cli.analysis import report_cmd

    shutil.copytree(clean, tmp_path / "c")
    run = tmp_path / "c" / "run"
    _with_distances(run, **meta)
    page = build_report(run, svg=False, do_sweep=False).read_text()
    elsewhere = _visible(page.split('<section id="elsewhere">')[1].split("</section>")[0])
    assert f"Jensen-Shannon distances distances.npz {why}" in elsewhere
    assert _page_data(page)["near"]["js"] is None
    # the command line too (its checks before the page read the same file)
    r = CliRunner().invoke(report_cmd, [str(run), "--no-svg", "-q", "--examples", "0", "--overwrite", "-k", "2"])
    assert r.exit_code == 0 and why in _visible((run / "report.html").read_text()), r.output


def test_older_distances_without_identity_are_compared_by_their_shape(clean, tmp_path, fewer_figures):
    shutil.copytree(clean, tmp_path / "c")
    run = tmp_path / "c" / "run"
    _with_distances(run, model_identity=None, corpus_sha256=None)
    assert set(np.load(run / "distances.npz").files).isdisjoint({"model_identity", "corpus_sha256"})
    page = build_report(run, svg=False, do_sweep=False).read_text()
    assert _page_data(page)["near"]["js"] and '<section id="elsewhere">' not in page
    assert ("distances.npz records no model identity (made before attnkit recorded it): it was compared with the "
            "run by layers × heads") in _visible(page)


def test_distances_record_their_model_and_corpus(tmp_path):
    from attnkit.run import HeadDistances

    meta = {"model_identity": RUN_MODEL, "corpus_sha256": "c" * 64, "smoothing": 0.0, "removed_heads": [],
            "rows_per_sample": None}
    HeadDistances(np.ones((12, 12)) - np.eye(12), 10, 3, 4, meta).save(tmp_path)
    assert HeadDistances.load(tmp_path).meta == meta
    arrays = dict(np.load(tmp_path / "distances.npz"))
    arrays["model_identity"] = np.array('{"name": "A", "n_layers": 0, "n_heads": 4}')
    np.savez(tmp_path / "distances.npz", **arrays)
    with pytest.raises(AttnkitError, match=r"array 'model_identity': field n_layers: "):
        HeadDistances.load(tmp_path)
    arrays["model_identity"] = np.array("{not json")
    np.savez(tmp_path / "distances.npz", **arrays)
    with pytest.raises(AttnkitError, match="array 'model_identity' is not valid JSON"):
        HeadDistances.load(tmp_path)


def test_an_included_directory_of_nothing_is_named(clean, tmp_path, fewer_figures):
    shutil.copytree(clean, tmp_path / "c")
    (tmp_path / "c" / "empty").mkdir()
    (tmp_path / "c" / "empty" / "notes.txt").write_text("nothing attnkit wrote")
    page = build_report(tmp_path / "c" / "run", svg=False, do_sweep=False, include=[tmp_path / "c" / "empty"])
    elsewhere = _visible(page.read_text().split('<section id="elsewhere">')[1].split("</section>")[0])
    assert "c/empty it holds no result attnkit report can show" in elsewhere


@pytest.mark.parametrize("recorded, shown", [
    ({"model": "/elsewhere/tiny-llama"}, False),  # another name
    ({"model": "A"}, True),  # the run's model by name: compared in part, and the page says so
    ({"model": "models/A"}, True),  # a relative path of a directory of that name
    ({}, True),  # nothing to compare but the table's heads
])
def test_an_older_ablation_without_identity_is_compared_by_what_it_records(recorded, shown, clean, tmp_path,
                                                                          fewer_figures):
    shutil.copytree(clean, tmp_path / "c")
    run = tmp_path / "c" / "run"
    def older(d):
        del d["model_identity"], d["model"]
        d.update(recorded)

    _set(run / "heads.meta.json", older)
    page = build_report(run, svg=False, do_sweep=False).read_text()
    sources = [a["source"] for a in _page_data(page)["ablation"]]
    assert ("heads.json" in sources) == shown
    text = _visible(page)
    if shown:
        assert ("heads.meta.json records no model identity (made before attnkit recorded it): it was compared with "
                "the run by layers × heads, model type and model name only") in text
    else:
        assert "heads.meta.json made with the model /elsewhere/tiny-llama, the run with /models/A" in text


def test_an_older_run_compares_every_result_by_what_it_has(clean, tmp_path, fewer_figures):
    shutil.copytree(clean, tmp_path / "c")
    run = tmp_path / "c" / "run"
    _set(run / "meta.json", lambda d: d.pop("model_identity"))
    page = build_report(run, svg=False, do_sweep=False).read_text()
    assert _page_data(page)["detected"] is not None
    assert ("This run's meta.json records no model identity (made before attnkit recorded it): distances.npz, "
            "probe.json, detected_heads.json, heads.meta.json were compared with it by layers × heads") in _visible(page)


def test_identity_does_not_depend_on_the_head_a_model_is_loaded_with(tmp_path, decoder_tokenizer):
    from attnkit.models import load_model

    for name, seed, vocab in (("a", 0, len(decoder_tokenizer)), ("b", 1, len(decoder_tokenizer)),
                              ("c", 0, len(decoder_tokenizer) + 8)):
        tiny_decoder("llama", vocab=vocab, n_layers=2, seed=seed).save_pretrained(tmp_path / name)
        decoder_tokenizer.save_pretrained(tmp_path / name)
    a = [model_identity(load_model(str(tmp_path / "a"), device="cpu", task=t)[0], str(tmp_path / "a"))
         for t in (None, "causal-lm")]
    assert a[0] == a[1] and a[0]["path"] == str((tmp_path / "a").resolve())
    assert (a[0]["n_layers"], a[0]["model_type"]) == (2, "llama")
    b = model_identity(load_model(str(tmp_path / "b"), device="cpu")[0], "b")
    c = model_identity(load_model(str(tmp_path / "c"), device="cpu")[0], "c")
    assert b["config_sha256"] == a[0]["config_sha256"] != c["config_sha256"]  # the same shape, another vocabulary
    ra = recorded_identity({"model_identity": a[0]})
    assert model_mismatch(ra, recorded_identity({"model_identity": a[1]})) is None
    assert "made with the model in" in model_mismatch(ra, recorded_identity({"model_identity": b}))
    assert "configuration differs" in model_mismatch(ra, recorded_identity({"model_identity": c}))
    assert config_sha256(load_model(str(tmp_path / "a"), device="cpu")[0].config) == a[0]["config_sha256"]


def test_the_commands_record_the_identity_the_report_compares(tmp_path, decoder_tokenizer):
    """extract, detect-heads and ablate record the same identity of one model; the report shows their results, and
    not those of another model of the same shape (the issue's --include of another model's ablation)."""
    from attnkit.cli.main import main

    from .conftest import SENTENCES

    for name, seed in (("llama", 0), ("other-model", 1)):
        tiny_decoder("llama", vocab=len(decoder_tokenizer), n_layers=2, seed=seed).save_pretrained(tmp_path / name)
        decoder_tokenizer.save_pretrained(tmp_path / name)
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(s.lower() for s in SENTENCES[:6]) + "\n")

    def run(*args):
        r = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
        assert r.exit_code == 0, r.output

    run("extract", corpus, "--model", tmp_path / "llama", "--max-length", 32, "-o", tmp_path / "run", "-q")
    run("detect-heads", tmp_path / "llama", "-o", tmp_path / "run", "--length", 8, "--sequences", 2)
    run("distances", tmp_path / "run", "-q")
    for model, out in (("llama", "run"), ("other-model", "other")):
        run("ablate", tmp_path / model, "--task", "lm", "--data", corpus, "--experiment", "layers", "--mode", "zero",
            "--resamples", 50, "-o", tmp_path / out, "-q")
    ids = [json.loads((tmp_path / "run" / f).read_text())["model_identity"]
           for f in ("meta.json", "detected_heads.json", "layers.meta.json")]
    assert ids[0] == ids[1] == ids[2] and ids[0]["path"] == str((tmp_path / "llama").resolve())
    from attnkit.run import HeadDistances

    dist = HeadDistances.load(tmp_path / "run")  # distances record the model and corpus that extract recorded
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert dist.meta["model_identity"] == ids[0] and dist.meta["corpus_sha256"] == meta["settings"]["corpus_sha256"]
    other = json.loads((tmp_path / "other" / "layers.meta.json").read_text())["model_identity"]
    assert other["config_sha256"] == ids[0]["config_sha256"] and other["path"] != ids[0]["path"]
    run("cluster", tmp_path / "run", "-k", 2, "--stability", 1, "-q")  # (the report then makes no k sweep)
    run("report", tmp_path / "run", "--include", tmp_path / "other", "--examples", 0, "-q")
    page = (tmp_path / "run" / "report.html").read_text()
    assert [a["source"] for a in _page_data(page)["ablation"]] == ["layers.json"]
    assert _page_data(page)["detected"] is not None and "no model identity" not in page
    assert _page_data(page)["near"]["js"] is not None
    elsewhere = _visible(page.split('<section id="elsewhere">')[1].split("</section>")[0])
    assert f"other/layers.meta.json made with the model in {tmp_path.resolve() / 'other'}" in elsewhere


# --- issue 35 §6: the glossary says where each feature is defined ------------------------------------------------
def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_glossary_names_the_section_that_defines_each_feature(clean, tmp_path, fewer_figures):
    from attnkit.features import feature_section, feature_section_title

    shutil.copytree(clean, tmp_path / "c")
    page = build_report(tmp_path / "c" / "run", svg=False, do_sweep=False).read_text()
    glossary = page.split('<section id="glossary">')[1].split("</section>")[0]
    cells = dict(re.findall(r'<tr id="glossary-[^"]+"><td class="l"><b>([^<]+)</b></td><td class="l">[^<]*</td>'
                            r'<td class="l">([^<]+)</td>', glossary))
    assert cells["win_3"] == ("docs/features.md § 2. Features of one query row › The 21 exclusive distance buckets "
                              "(5 + N in general)")
    assert cells["entropy"] == "docs/features.md § 2. Features of one query row › The row features"
    docs = (Path(__file__).resolve().parent.parent / "docs" / "features.md").read_text()
    headings = re.findall(r"^(#{2,3}) (.+)$", docs, re.M)
    for name in list(cells) + ["sink", "cls_entropy"]:
        where = feature_section_title(name)
        # the heading it names, as docs/features.md writes it (without its markup), under the section it names
        *parents, last = where.split(" › ")
        found = [i for i, (_, h) in enumerate(headings) if h.replace("`", "") == last]
        assert len(found) == 1, (name, where)
        if parents:
            section = [h for lvl, h in headings[:found[0]] if lvl == "##"][-1]
            assert section == parents[0]
        assert _slug(headings[found[0]][1]) == feature_section(name)  # the anchor it stands for


def test_distances_refuse_a_model_directory_replaced_since_the_run(tmp_path, decoder_tokenizer):
    """The distances job records the model it loaded; one that is no longer the run's (its directory now holds
    another configuration) is refused by name, not recorded as the run's."""
    from attnkit.cli.main import main

    from .conftest import SENTENCES

    model = tmp_path / "llama"
    tiny_decoder("llama", vocab=len(decoder_tokenizer), n_layers=2, seed=0).save_pretrained(model)
    decoder_tokenizer.save_pretrained(model)
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(s.lower() for s in SENTENCES[:4]) + "\n")
    r = CliRunner().invoke(main, ["extract", str(corpus), "--model", str(model), "--max-length", "32", "-o",
                                  str(tmp_path / "run"), "-q"])
    assert r.exit_code == 0, r.output
    tiny_decoder("llama", vocab=len(decoder_tokenizer) + 8, n_layers=2, seed=0).save_pretrained(model)
    r = CliRunner().invoke(main, ["distances", str(tmp_path / "run"), "-q"])
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert "is not the one it measured: made with another model" in r.output, r.output
    assert not (tmp_path / "run" / "distances.npz").exists()
