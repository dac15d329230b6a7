"""Jensen-Shannon distances of an encoder–decoder's heads (attnkit/engine/distances.py, docs/seq2seq.md §9), on a
tiny random BART and T5 over (source, target) pairs: heads are compared within each kind, and each kind's sums equal
those computed with numpy from eager attention's maps of each pair alone (encoder heads over the source's rows,
decoder and cross-attention heads over the target's); comparing across kinds, and `attnkit distances` on a run of
pairs, are refused by name."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from attnkit.cli.main import main
from attnkit.engine.distances import DistanceCollector, collect_distances
from attnkit.errors import AttnkitError
from attnkit.run.distances import HeadDistances

from .test_seq2seq_extract import PAIRS, model_dir  # noqa: F401  (the module's fixture of tiny BART and T5)


def plogp(x: np.ndarray) -> np.ndarray:
    return np.where(x > 0, x * np.log(np.where(x > 0, x, 1.0)), 0.0)


def js_sums(maps: list[np.ndarray]) -> np.ndarray:
    """Σ over rows of JS(A_i[s], A_j[s]) between the heads of `maps` (layers of 1 × H × Lq × Lk, unpadded)."""
    a = np.concatenate(maps, axis=1)[0]  # M × Lq × Lk
    M = a.shape[0]
    out = np.zeros((M, M))
    for i in range(M):
        for j in range(M):
            m = (a[i] + a[j]) / 2
            out[i, j] = (0.5 * plogp(a[i]).sum(-1) + 0.5 * plogp(a[j]).sum(-1) - plogp(m).sum(-1)).sum()
    return out


def eager_sums(path, pairs) -> dict:
    """Per kind, the JS sums over every pair alone through the eager model, teacher-forced as attnkit extracts."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    start = model.config.decoder_start_token_id
    total = {"encoder": 0.0, "decoder": 0.0, "cross": 0.0}
    rows = {"encoder": 0, "decoder": 0, "cross": 0}
    for src, tgt in pairs:
        s = tok(src)["input_ids"]
        t = [start] + tok(text_target=tgt)["input_ids"][:-1]
        with torch.no_grad():
            out = model(input_ids=torch.tensor([s]), decoder_input_ids=torch.tensor([t]), output_attentions=True)
        for kind, maps, n in (("encoder", out.encoder_attentions, len(s)), ("decoder", out.decoder_attentions, len(t)),
                              ("cross", out.cross_attentions, len(t))):
            total[kind] = total[kind] + js_sums([m.double().numpy() for m in maps])
            rows[kind] += n
    return {k: (total[k], rows[k]) for k in total}


def test_distances_within_each_kind_equal_numpy_from_eager_maps(model_dir):  # noqa: F811
    kind, path = model_dir
    _, got = collect_distances(PAIRS, str(path), max_length=32, batch_size=4)
    want = eager_sums(path, PAIRS)
    assert sorted(got) == ["cross", "decoder", "encoder"]
    for k, (total, rows) in want.items():
        assert (got[k].n_layers, got[k].n_heads, got[k].n_rows) == (2, 4, rows), (kind, k)
        assert total.max() > 0.01
        np.testing.assert_allclose(got[k].total, total, rtol=1e-4, atol=1e-6, err_msg=f"{kind} {k}")
    # smoothed: each row spread over the keys it sees (a cross row: the source's), the divergences smaller
    _, smooth = collect_distances(PAIRS, str(path), max_length=32, batch_size=4, smoothing=0.01)
    for k in want:
        off = ~np.eye(8, dtype=bool)
        assert np.all(smooth[k].total[off] < got[k].total[off] + 1e-9) and smooth[k].meta["smoothing"] == 0.01


def test_comparisons_across_kinds_are_refused():
    collector = DistanceCollector(6, kinds=["encoder"] * 2 + ["decoder"] * 2 + ["cross"] * 2)
    with pytest.raises(AttnkitError, match="compared within each kind"):
        collector.result()
    with pytest.raises(AttnkitError, match="given no kinds"):
        DistanceCollector(6).by_kind()


def extract_run(path, tmp_path):
    tsv = tmp_path / "pairs.tsv"
    tsv.write_text("source\ttarget\n" + "".join(f"{s}\t{t}\n" for s, t in PAIRS))
    run = tmp_path / "run"
    res = CliRunner().invoke(main, ["extract", "--model", str(path), str(tsv), "-o", str(run), "--max-length", "32",
                                    "--batch-size", "4", "-q"])
    assert res.exit_code == 0, res.output
    return run


def test_the_command_writes_one_file_per_kind_equal_to_collect_distances(model_dir, tmp_path):  # noqa: F811
    kind, path = model_dir
    run = extract_run(path, tmp_path)
    res = CliRunner().invoke(main, ["distances", str(run), "--batch-size", "4", "-q"])
    assert res.exit_code == 0, res.output
    assert not (run / "distances.npz").exists()
    assert sorted(p.name for p in run.glob("distances_*.npz")) == ["distances_cross.npz", "distances_decoder.npz",
                                                                    "distances_encoder.npz"]
    for k in ("encoder", "decoder", "cross"):
        assert f"between {k} heads" in res.output and f"distances_{k}.npz" in res.output
    got = HeadDistances.load_by_kind(run)
    _, want = collect_distances(PAIRS, str(path), max_length=32, batch_size=4)
    assert sorted(got) == ["cross", "decoder", "encoder"]
    for k, d in want.items():
        assert (got[k].n_layers, got[k].n_heads, got[k].n_rows, got[k].meta["kind"]) == (2, 4, d.n_rows, k)
        assert got[k].meta["corpus_sha256"] and got[k].meta["model_identity"]["n_layers"] == 6
        np.testing.assert_allclose(got[k].total, d.total, rtol=1e-6, atol=1e-9, err_msg=f"{kind} {k}")
    assert sorted(HeadDistances.load_by_kind(run, ["cross"])) == ["cross"]
    with pytest.raises(AttnkitError, match="no layers of kind 'all'"):
        HeadDistances.load_by_kind(run, ["all"])
    with pytest.raises(AttnkitError, match="collect distances first"):
        HeadDistances.load(run)  # no matrix over all heads: a reader of distances.npz never pairs heads across kinds
    # a file of one kind under another's name is refused, not read as that kind's
    (run / "distances_decoder.npz").write_bytes((run / "distances_cross.npz").read_bytes())
    with pytest.raises(AttnkitError, match="of kind 'cross', not 'decoder'"):
        HeadDistances.load_by_kind(run)

    # earlier distances are replaced only with --overwrite, before the model loads; the report goes with them
    res = CliRunner().invoke(main, ["distances", str(run)])
    assert res.exit_code != 0 and "distances_encoder.npz" in res.output and "--overwrite" in res.output, res.output
    assert "loading the model" not in res.output
    res = CliRunner().invoke(main, ["distances", str(run), "--engine", "ray"])
    assert res.exit_code != 0 and "local engine" in res.output, res.output
    res = CliRunner().invoke(main, ["distances", str(run), "--batch-size", "4", "--overwrite", "-q"])
    assert res.exit_code == 0, res.output
    assert HeadDistances.load_by_kind(run)["decoder"].meta["kind"] == "decoder"


SINGLE_STACK_ARRAYS = {"total", "per_token", "n_rows", "n_layers", "n_heads", "rows_per_sample", "smoothing",
                       "measure", "removed_heads", "model_identity", "corpus_sha256"}  # what main writes


def test_a_run_of_one_stack_keeps_its_one_file_and_has_no_kinds(run):
    rng = np.random.default_rng(0)
    a = rng.random((12, 12))
    dist = HeadDistances(a + a.T, 40, 3, 4, {"smoothing": 0.0, "corpus_sha256": "ab",
                                             "model_identity": {"name": "m", "n_layers": 3, "n_heads": 4}})
    path = dist.save(run)
    assert path == run / "distances.npz" and not list(run.glob("distances_*.npz"))
    with np.load(path) as z:
        assert set(z.files) == SINGLE_STACK_ARRAYS
    back = HeadDistances.load(run)
    np.testing.assert_array_equal(back.total, a + a.T)
    assert "kind" not in back.meta
    with pytest.raises(AttnkitError, match="one stack"):
        HeadDistances.load_by_kind(run)
    with pytest.raises(AttnkitError, match="per kind of encoder, decoder, cross, not 'all'"):
        HeadDistances(a + a.T, 40, 3, 4, {"kind": "all"}).save(run)


def test_removed_heads_are_numbered_within_their_kind(tmp_path):
    """A pruned encoder–decoder's run: each kind's file records its removed heads by layer within the kind."""
    from types import SimpleNamespace

    from attnkit.jobs.distances_job import _save

    removed = np.zeros((6, 4), dtype=bool)
    removed[1, 2] = removed[4, 0] = removed[5, 3] = True  # encoder 1, cross 0 and cross 1
    run_feats = SimpleNamespace(removed=removed, layer_kinds=[("encoder", 0), ("encoder", 1), ("decoder", 0),
                                                              ("decoder", 1), ("cross", 0), ("cross", 1)])
    dist = {k: HeadDistances(np.zeros((8, 8)), 5, 2, 4, {"kind": k}) for k in ("encoder", "decoder", "cross")}
    _save(tmp_path, dist, run_feats, {"corpus_sha256": "ab"})
    for k, want in (("encoder", [[1, 2]]), ("decoder", []), ("cross", [[0, 0], [1, 3]])):
        with np.load(tmp_path / f"distances_{k}.npz") as z:
            assert z["removed_heads"].tolist() == want and str(z["kind"]) == k and str(z["corpus_sha256"]) == "ab"
