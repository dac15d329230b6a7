"""The example inputs of the report (issue 30 §3): the shortest inputs of the run's corpus, their maps from
`attnkit.attention_maps` embedded as 8-bit values within a size budget, and `--examples` 4 by default when the run's
model and corpus can be read. The interactive view is tested in tests/test_report_browser.py."""
import base64
import html
import json
import re

import numpy as np
import pytest
from click.testing import CliRunner

from attnkit.analysis.report import (
    DEFAULT_EXAMPLES,
    MAPS_BUDGET_BYTES,
    build_report,
    example_inputs,
    within_budget,
)
from attnkit.jobs.maps import AttentionMaps, attention_maps

from .synthetic import WORDS, rich_run, tiny_bert


def test_example_inputs_are_the_shortest_first():
    tok = lambda *parts, truncation=True, max_length=64: {"input_ids": [0] * min(max_length, 2 + sum(
        len(p.split()) for p in parts))}
    texts = ["a b c d e f g", "a", "a b c d", ("a b", "c d e"), "a b c d e", "a b c d"]
    # tokens: 9, 3, 6, 7, 7, 6 → at least 6 tokens, shortest first, ties in corpus order
    assert example_inputs(texts, 4, tok, min_tokens=6) == [2, 5, 3, 4]
    assert example_inputs(["a", "b c"], 4, tok, min_tokens=6) == [0, 1]  # nothing long enough: the shortest
    assert example_inputs(texts, 2, tok, max_length=5, min_tokens=5) == [0, 2]  # counted after truncation: ties


def test_the_maps_stay_within_their_budget():
    maps = [AttentionMaps("x", ["t"] * n, np.zeros((6, 12, n, n), dtype=np.float32)) for n in (10, 40, 90, 120)]
    kept = within_budget(maps)
    sizes = [6 * 12 * n * n for n in (10, 40, 90, 120)]
    assert len(kept) == 3 and sum(sizes[:3]) <= MAPS_BUDGET_BYTES < sum(sizes)
    assert within_budget(maps, budget=sizes[0] - 1) == []


@pytest.fixture(scope="module")
def with_examples(tmp_path_factory):
    run = tmp_path_factory.mktemp("examples") / "run"
    rich_run(run, n_samples=8)
    model, tok = tiny_bert(n_layers=3, n_heads=4)
    texts = [" ".join(WORDS[i:i + 3 + (5 * i) % 8]) + " ." for i in range(10)]
    page = build_report(run, svg=False, do_sweep=False, examples=3, texts=texts, model=(model, tok)).read_text()
    data = json.loads(re.search(r'id="attnkit-data">(.*?)</script>', page, re.S).group(1))
    return page, data, texts, (model, tok)


def test_the_embedded_maps_are_the_models_maps(with_examples):
    page, data, texts, model = with_examples
    idx = sorted(range(len(texts)), key=lambda i: (len(model[1](texts[i])["input_ids"]), i))[:3]
    assert len(data["maps"]["texts"]) == 3
    for i, t in enumerate(idx):
        maps = attention_maps(texts[t], model, max_length=64)
        assert data["maps"]["texts"][i]["tokens"] == maps.tokens
        n = len(maps.tokens)
        for m in range(12):
            w = maps.head(m // 4, m % 4)
            q = np.frombuffer(base64.b64decode(data["maps"]["data"][i][m]), dtype=np.uint8).reshape(n, n)
            mx = data["maps"]["max"][i][m]
            assert mx == pytest.approx(w.max(), abs=1e-5)
            np.testing.assert_allclose(q / 255.0 * mx, w, atol=mx / 255 / 2 + 1e-5)
    ids = re.findall(r'<section id="([^"]+)">', page)
    assert ids[:3] == ["findings", "explorer", "inputs"] and "examples" in ids
    assert "Attention on example inputs" in page and 'id="hv-draw"' in page


def same_model_in_clusters(run, model: str) -> None:
    """clusters.json names the run's model as meta.json does (a clusters.json of another model is refused)."""
    data = json.loads((run / "clusters.json").read_text())
    data["run"]["model"] = model
    (run / "clusters.json").write_text(json.dumps(data))


def test_the_report_command_embeds_four_inputs_by_default_when_it_can(tmp_path, monkeypatch):
    from attnkit.cli.analysis import report_cmd

    assert DEFAULT_EXAMPLES == 4
    run = tmp_path / "run"
    rich_run(run, n_samples=6)  # a synthetic run: no model or corpus recorded
    r = CliRunner().invoke(report_cmd, [str(run), "--no-svg"])
    assert r.exit_code == 0, r.output
    assert "no example inputs (the run records no corpus); give --examples 0" in r.output
    assert '"maps":null' in (run / "report.html").read_text()
    r = CliRunner().invoke(report_cmd, [str(run), "--no-svg", "-q", "--examples", "2", "--overwrite"])
    assert r.exit_code == 1 and "Traceback" not in r.output  # asked for: that they cannot be made is an error
    # a run that records its model and corpus: 4 inputs from its corpus, with its model
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(" ".join(WORDS[i:i + 2 + i % 6]) + " ." for i in range(12)) + "\n")
    meta = json.loads((run / "meta.json").read_text())
    import hashlib

    meta.update(model="tiny", settings={"reading": {"paths": [str(corpus)], "format": "text", "text_unit": "line"}},
                max_length=64, inputs=[{"path": "corpus.txt", "sha256": hashlib.sha256(corpus.read_bytes()).hexdigest()}])
    (run / "meta.json").write_text(json.dumps(meta))
    same_model_in_clusters(run, "tiny")
    import attnkit.models

    monkeypatch.setattr(attnkit.models, "load_model", lambda name, device=None: tiny_bert(3, 4))
    r = CliRunner().invoke(report_cmd, [str(run), "--no-svg", "-q", "--overwrite"])
    assert r.exit_code == 0, r.output
    data = json.loads(re.search(r'id="attnkit-data">(.*?)</script>', (run / "report.html").read_text(),
                                re.S).group(1))
    assert len(data["maps"]["texts"]) == 4


def test_a_file_that_meta_json_names_without_its_hash_is_not_read_into_the_page(tmp_path, monkeypatch):
    """A shared run directory whose meta.json names a file of the reader's machine as its corpus, with no SHA-256 to
    check it against: the report reads nothing of it unless asked to (`--examples N`, `--corpus`)."""
    from attnkit.cli.analysis import report_cmd

    run = tmp_path / "run"
    rich_run(run, n_samples=6)
    (run / "per_sample_rows.csv").unlink()  # a run without the rows table (attnkit 0.1): the examples' texts would
    ps = json.loads((run / "per_sample.json").read_text())  # be read from the corpus again
    del ps["rows"]
    (run / "per_sample.json").write_text(json.dumps(ps))
    secret = tmp_path / "secret.txt"
    secret.write_text("the cat sat on the mat and the password is hunter2 .\n" * 10)
    meta = json.loads((run / "meta.json").read_text())
    meta.update(model="tiny", settings={"reading": {"paths": [str(secret)], "format": "text", "text_unit": "line"}})
    (run / "meta.json").write_text(json.dumps(meta))
    same_model_in_clusters(run, "tiny")
    import attnkit.models

    monkeypatch.setattr(attnkit.models, "load_model", lambda name, device=None: tiny_bert(3, 4))
    r = CliRunner().invoke(report_cmd, [str(run), "--no-svg"])
    assert r.exit_code == 0, r.output
    assert "no example inputs (meta.json records no SHA-256 of the run's inputs to check them against)" in r.output
    page = html.unescape((run / "report.html").read_text())
    assert "hunter2" not in page and "the examples' texts were not read again (meta.json records no SHA-256" in page
