"""PerSampleWriter: rows land in input order whatever the batch order, resume continues a partial file,
the result opens memory-mapped, holds float32 (float16 files of attnkit 0.1 still read), and the rows table
says where each row came from."""
import csv
import json

import numpy as np
import pytest

from attnkit.engine.plan import plan_batches
from attnkit.errors import AttnkitError
from attnkit.run.head_features import HeadFeatures
from attnkit.run.per_sample import (
    HEADER_BYTES,
    PER_SAMPLE_META,
    PER_SAMPLE_ROWS,
    PerSampleWriter,
    load_per_sample,
    npy_header,
    read_rows,
)

L, H, NAMES = 2, 3, ["a", "b", "c", "d"]


def _rows(n, seed=0):
    return np.random.default_rng(seed).random((n, L, H, len(NAMES))).astype(np.float32)


def _plan(n, batch_size=3, window=5):
    texts = ["x" * ((7 * i) % 11 + 1) for i in range(n)]  # varied lengths: the plan reorders inside windows
    return list(plan_batches(texts, batch_size, window))


def test_rows_in_input_order_from_plan_order(tmp_path):
    n = 13
    rows = _rows(n)
    plan = _plan(n)
    assert [p for pb in plan for p in pb.positions] != list(range(n))  # really out of order
    w = PerSampleWriter(tmp_path, L, H, NAMES)
    for pb in plan:
        w.add(pb.positions, rows[list(pb.positions)])
    path = w.close()
    arr = np.load(path, mmap_mode="r")
    assert isinstance(arr, np.memmap) and arr.dtype == np.float32 and arr.shape == (n, L, H, 4)
    np.testing.assert_array_equal(arr, rows)
    meta = json.loads((tmp_path / PER_SAMPLE_META).read_text())
    assert meta["names"] == NAMES and meta["n_samples"] == n and meta["dtype"] == "float32" and "rows" not in meta
    assert not (tmp_path / PER_SAMPLE_ROWS).exists()  # no segments given: no rows table
    arr2, names = load_per_sample(tmp_path)
    assert names == NAMES and arr2.shape == arr.shape
    assert not (tmp_path / "per_sample.npy.partial").exists()


def _texts(n):
    return ["x" * ((7 * i) % 11 + 1) for i in range(n)]


def test_resume_after_checkpoint(tmp_path):
    n = 13
    rows = _rows(n, 1)
    texts = _texts(n)
    plan = _plan(n)
    w = PerSampleWriter(tmp_path, L, H, NAMES)
    for pb in plan[:2]:
        w.add(pb.positions, rows[list(pb.positions)], pb.segments)
    w.flush()
    checkpoint = plan[1].end  # segments of the plan done at the checkpoint
    w.add(plan[2].positions, rows[list(plan[2].positions)], plan[2].segments)  # after the checkpoint, then a crash
    w.abandon()
    assert not (tmp_path / "per_sample.npy").exists()
    w = PerSampleWriter(tmp_path, L, H, NAMES, resume_after=checkpoint)
    for pb in plan_batches(texts, 3, 5, skip_segments=checkpoint):
        w.add(pb.positions, rows[list(pb.positions)], pb.segments)
    w.close([4, 9])
    np.testing.assert_array_equal(np.load(tmp_path / "per_sample.npy", mmap_mode="r"), rows)
    table = list(csv.DictReader(open(tmp_path / PER_SAMPLE_ROWS)))
    assert [r["row"] for r in table] == [str(i) for i in range(n)]
    assert [(r["input"], r["position"]) for r in table] == [("0", str(i)) for i in range(4)] + \
        [("1", str(i)) for i in range(9)]
    assert [r["text"] for r in table] == texts
    assert json.loads((tmp_path / PER_SAMPLE_META).read_text())["rows"] == PER_SAMPLE_ROWS


def test_rows_table_keeps_pairs_and_odd_text_and_reads_back(tmp_path):
    segs = [("Where?", 'Here, "quoted"\nand a new line.'), "plain, text", ("ü ✓", "")]
    w = PerSampleWriter(tmp_path, L, H, NAMES)
    w.add([2, 0], _rows(2), [segs[2], segs[0]])
    w.add([1], _rows(1), [segs[1]])
    w.close()
    df = read_rows(tmp_path)
    assert list(df.index) == [0, 1, 2] and list(df["input"]) == [0, 0, 0] and list(df["position"]) == [0, 1, 2]
    assert list(df["text"]) == ["Where?", "plain, text", "ü ✓"]
    assert list(df["text_pair"]) == ['Here, "quoted"\nand a new line.', "", ""]
    assert list(read_rows(tmp_path, [2]).text) == ["ü ✓"]
    with pytest.raises(AttnkitError, match="the inputs gave 5 segments but 3 samples"):
        w = PerSampleWriter(tmp_path / "b", L, H, NAMES)
        w.add([0, 1, 2], _rows(3), segs)
        w.close([2, 3])


def test_a_resume_without_the_partial_rows_table_goes_on_without_one(tmp_path):
    w = PerSampleWriter(tmp_path, L, H, NAMES)
    w.add([0, 1], _rows(2), ["a", "b"])
    w.flush()
    w.abandon()
    (tmp_path / (PER_SAMPLE_ROWS + ".partial")).unlink()
    w = PerSampleWriter(tmp_path, L, H, NAMES, resume_after=2)
    w.add([2], _rows(1), ["c"])
    w.close()
    assert not w.rows_written and not (tmp_path / PER_SAMPLE_ROWS).exists()
    with pytest.raises(AttnkitError, match="per_sample_rows.csv is missing"):
        read_rows(tmp_path)


def test_float16_files_of_attnkit_0_1_still_read(tmp_path):
    rows = _rows(3).astype(np.float16)
    np.save(tmp_path / "per_sample.npy", rows)
    (tmp_path / PER_SAMPLE_META).write_text(json.dumps({"names": NAMES, "n_samples": 3, "dtype": "float16"}))
    arr, names = load_per_sample(tmp_path)
    assert arr.dtype == np.float16 and names == NAMES
    np.testing.assert_array_equal(arr, rows)
    np.save(tmp_path / "per_sample.npy", rows.astype(np.int32))
    with pytest.raises(AttnkitError, match="holds int32 values"):
        load_per_sample(tmp_path)


def test_missing_and_duplicate_positions_are_refused(tmp_path):
    rows = _rows(4)
    w = PerSampleWriter(tmp_path / "a.npy", L, H, NAMES)
    w.add([0, 3], rows[[0, 3]])
    with pytest.raises(AttnkitError, match="positions missing"):
        w.close()
    w = PerSampleWriter(tmp_path / "b.npy", L, H, NAMES)
    w.add([1, 0], rows[[1, 0]])
    with pytest.raises(AttnkitError, match="written twice"):
        w.add([1], rows[[1]])
    with pytest.raises(AttnkitError, match="shape"):
        w.add([2], rows[[2], :, :, :3])


def test_resume_refuses_other_shapes_and_missing_files(tmp_path):
    w = PerSampleWriter(tmp_path, L, H, NAMES)
    w.add([0], _rows(1))
    w.abandon()
    with pytest.raises(AttnkitError, match="another model"):
        PerSampleWriter(tmp_path, L, H + 1, NAMES, resume_after=1)
    with pytest.raises(AttnkitError, match="fewer than"):
        PerSampleWriter(tmp_path, L, H, NAMES, resume_after=5)
    with pytest.raises(AttnkitError, match="missing"):
        PerSampleWriter(tmp_path / "other", L, H, NAMES, resume_after=0)


def test_header_is_fixed_size_and_readable(tmp_path):
    h = npy_header((123456789, 12, 24, 33))
    assert len(h) == HEADER_BYTES
    p = tmp_path / "x.npy"
    p.write_bytes(npy_header((2, 1, 1, 1)) + np.array([1.5, -2], dtype="<f4").tobytes())
    np.testing.assert_array_equal(np.load(p, mmap_mode="r").ravel(), [1.5, -2])


def test_extract_per_sample_in_python_saves_and_loads(minilm, tmp_path):
    import attnkit

    texts = ["A short one.", ("A question?", "An answer, with a comma."), "Another text that is a bit longer."]
    feats = attnkit.extract(texts, minilm, per_sample=True, batch_size=2, window=2, max_length=32)
    assert feats.per_sample.shape == (3, 6, 12, 28) and feats.per_sample.dtype == np.float32
    np.testing.assert_allclose(feats.per_sample.astype(np.float64).mean(0), feats.mean, atol=1e-6)
    for i, t in enumerate(texts):  # row i is text i, whatever order the batches ran in
        alone = attnkit.extract([t], minilm, max_length=32)
        np.testing.assert_allclose(feats.per_sample[i], alone.mean, atol=2e-6)
    assert attnkit.extract(texts, minilm, max_length=32).per_sample is None
    feats.save(tmp_path / "run")
    back = HeadFeatures.load(tmp_path / "run")
    np.testing.assert_array_equal(back.per_sample, feats.per_sample)
    back.save(tmp_path / "run")  # saving a loaded run into its own directory keeps its rows
    np.testing.assert_array_equal(HeadFeatures.load(tmp_path / "run").per_sample, feats.per_sample)
