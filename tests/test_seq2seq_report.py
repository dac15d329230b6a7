"""`attnkit cluster` and `attnkit report` on a run of an encoder–decoder over (source, target) pairs
(docs/seq2seq.md §5): the run records attnkit's layers (encoder, decoder and cross-attention together) as its
model's, so the clusters it is given are recognised as its own, and example maps, not drawn for pairs yet, are
refused by name when asked for."""
from __future__ import annotations

import json

import pytest

from .test_seq2seq_extract import PAIRS, cli, extract_args, save_seq2seq, write_tsv


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    model = save_seq2seq("bart", tmp_path_factory.mktemp("bart"))
    where = tmp_path_factory.mktemp("run")
    corpus = write_tsv(where / "pairs.tsv", PAIRS * 3)
    code, text = cli(*extract_args(corpus, model, where / "run"))
    assert code == 0, text
    return where / "run"


def test_the_run_records_every_kind_of_layer_and_clusters_and_reports(run_dir):
    meta = json.loads((run_dir / "meta.json").read_text())
    assert len(meta["layer_kinds"]) == 6  # 2 encoder, 2 decoder, 2 cross-attention layers
    assert (meta["model_identity"]["n_layers"], meta["model_identity"]["n_heads"]) == (6, 4)
    code, text = cli("cluster", run_dir, "-k", 3, "-q")
    assert code == 0, text
    code, text = cli("report", run_dir, "-q")
    assert code == 0, text
    html = (run_dir / "report.html").read_text()
    assert "L5H3" in html  # a head of the last cross-attention layer is in the report
    assert ">4 · cross 0</td>" in html  # the per-layer table names each layer's kind


def test_example_maps_of_pairs_are_refused_by_name(run_dir):
    code, text = cli("report", run_dir, "--examples", 2, "--overwrite")
    assert code != 0
    assert "encoder–decoder" in text and "not drawn yet" in text


def test_export_names_the_kind_columns_it_writes(run_dir, tmp_path):
    code, text = cli("export", run_dir, "-o", tmp_path / "heads.csv")
    assert code == 0, text
    header = (tmp_path / "heads.csv").read_text().splitlines()[0].split(",")
    assert header[:4] == ["layer", "head", "kind", "kind_layer"]
    assert f"× {len(header)} columns: layer, head, kind, kind_layer, " in text


def test_the_report_after_distances_by_kind_notes_them_and_pairs_no_heads_across_kinds(run_dir):
    code, text = cli("cluster", run_dir, "-k", 3, "-q", "--overwrite")
    assert code == 0, text
    code, text = cli("distances", run_dir, "-q", "--overwrite")
    assert code == 0, text
    assert {p.name for p in run_dir.glob("distances*.npz")} == {"distances_encoder.npz", "distances_decoder.npz",
                                                                 "distances_cross.npz"}
    code, text = cli("report", run_dir, "-q", "--overwrite")
    assert code == 0, text
    html = (run_dir / "report.html").read_text()
    assert "compared within each kind only" in html and "distances_cross.npz" in html
    assert "No distances.npz" not in html
    # one map per kind, of that kind's heads alone (the page embeds the figures; RUN/figures keeps their files);
    # none of the whole model
    for kind in ("encoder", "decoder", "cross"):
        assert f"Jensen-Shannon divergences between the {kind} heads" in html
        assert (run_dir / "figures" / f"mds_js_{kind}.png").is_file()
        assert f"{kind} heads, mean JS divergence per token: within a layer " in html
    assert "Jensen-Shannon divergences between heads" not in html and not (run_dir / "figures" / "mds_js.png").exists()


def test_a_kind_without_its_distances_or_with_another_models_is_named_and_not_drawn(run_dir, tmp_path):
    """The report maps the kinds whose distances_KIND.npz is the run's: a missing file is named with the command
    that writes it, another model's is listed among the results not shown, with why."""
    import shutil

    import numpy as np

    code, text = cli("distances", run_dir, "-q", "--overwrite")
    assert code == 0, text
    other = tmp_path / "other"
    shutil.copytree(run_dir, other)
    (other / "distances_cross.npz").unlink()
    with np.load(other / "distances_decoder.npz") as z:
        arrays = dict(z)
    ident = json.loads(str(arrays["model_identity"]))
    arrays["model_identity"] = np.array(json.dumps({**ident, "name": "another-model", "path": "/elsewhere"}))
    np.savez(other / "distances_decoder.npz", **arrays)
    code, text = cli("report", other, "-q", "--overwrite")
    assert code == 0, text
    html = (other / "report.html").read_text()
    drawn = {k for k in ("encoder", "decoder", "cross") if f"divergences between the {k} heads" in html}
    assert drawn == {"encoder"}
    assert "No map of the cross heads: run `attnkit distances RUN` for distances_cross.npz." in html
    assert "No map of the decoder heads: distances_decoder.npz is not this run&#39;s" in html
    assert "Jensen-Shannon distances of the decoder heads" in html


def test_a_run_whose_identity_counts_the_encoders_layers_alone_still_clusters_and_reports(run_dir, tmp_path):
    """A run extracted before the model identity counted attnkit's layers records the encoder's (2 of 6)."""
    import shutil

    old = tmp_path / "old"
    shutil.copytree(run_dir, old)
    meta = json.loads((old / "meta.json").read_text())
    meta["model_identity"]["n_layers"] = 2
    (old / "meta.json").write_text(json.dumps(meta))
    code, text = cli("cluster", old, "-k", 3, "-q", "--overwrite")
    assert code == 0, text
    code, text = cli("report", old, "-q", "--overwrite")
    assert code == 0, text


def test_the_head_panel_lists_each_heads_nearest_among_its_own_kind(run_dir):
    """The panel's nearest heads by divergence of an encoder–decoder's run: an independent argsort of the head's kind's
    distances_KIND.npz (self excluded), never a head of another kind; a kind without its file gives its heads none."""
    import re

    import numpy as np

    from attnkit.run import HeadDistances

    code, text = cli("distances", run_dir, "-q", "--overwrite")
    assert code == 0, text
    by_kind = HeadDistances.load_by_kind(run_dir)
    (run_dir / "distances_cross.npz").unlink()
    try:
        code, text = cli("report", run_dir, "-q", "--overwrite")
        assert code == 0, text
        page = (run_dir / "report.html").read_text()
    finally:  # (the other tests of this module expect every kind's file)
        code, text = cli("distances", run_dir, "-q", "--overwrite")
        assert code == 0, text
    data = json.loads(re.search(r'id="attnkit-data">(.*?)</script>', page, re.S).group(1))
    kinds = [k for k, _ in json.loads((run_dir / "meta.json").read_text())["layer_kinds"]]
    H = data["H"]
    assert data["near"]["js_source"].startswith("distances_KIND.npz")
    for kind in ("encoder", "decoder"):
        heads = [l * H + h for l, k in enumerate(kinds) if k == kind for h in range(H)]
        d_kind = by_kind[kind].per_token
        for i, m in enumerate(heads):
            d = d_kind[i].copy()
            d[i] = np.inf
            want = [heads[j] for j in np.argsort(d, kind="stable")[:5]]
            assert [x[0] for x in data["near"]["js"][m]] == want
            np.testing.assert_allclose([x[1] for x in data["near"]["js"][m]], np.sort(d)[:5], atol=1e-6)
    cross = [l * H + h for l, k in enumerate(kinds) if k == "cross" for h in range(H)]
    assert all(data["near"]["js"][m] == [] for m in cross)
