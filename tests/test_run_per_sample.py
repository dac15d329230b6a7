"""PerSampleWriter: rows land in input order whatever the batch order, resume continues a partial file,
and the result opens memory-mapped."""
import json

import numpy as np
import pytest

from attnkit.engine.plan import plan_batches
from attnkit.errors import AttnkitError
from attnkit.run.per_sample import HEADER_BYTES, PER_SAMPLE_META, PerSampleWriter, load_per_sample, npy_header

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
    assert isinstance(arr, np.memmap) and arr.dtype == np.float16 and arr.shape == (n, L, H, 4)
    np.testing.assert_array_equal(arr, rows.astype(np.float16))
    meta = json.loads((tmp_path / PER_SAMPLE_META).read_text())
    assert meta["names"] == NAMES and meta["n_samples"] == n
    arr2, names = load_per_sample(tmp_path)
    assert names == NAMES and arr2.shape == arr.shape
    assert not (tmp_path / "per_sample.npy.partial").exists()


def test_resume_after_checkpoint(tmp_path):
    n = 13
    rows = _rows(n, 1)
    plan = _plan(n)
    w = PerSampleWriter(tmp_path, L, H, NAMES)
    for pb in plan[:2]:
        w.add(pb.positions, rows[list(pb.positions)])
    w.flush()
    checkpoint = plan[1].end  # segments of the plan done at the checkpoint
    w.add(plan[2].positions, rows[list(plan[2].positions)])  # written after the checkpoint, then a crash
    w.abandon()
    assert not (tmp_path / "per_sample.npy").exists()
    w = PerSampleWriter(tmp_path, L, H, NAMES, resume_after=checkpoint)
    for pb in plan_batches(["x" * ((7 * i) % 11 + 1) for i in range(n)], 3, 5, skip_segments=checkpoint):
        w.add(pb.positions, rows[list(pb.positions)])
    w.close()
    np.testing.assert_array_equal(np.load(tmp_path / "per_sample.npy", mmap_mode="r"), rows.astype(np.float16))


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
    p.write_bytes(npy_header((2, 1, 1, 1)) + np.array([1.5, -2], dtype="<f2").tobytes())
    np.testing.assert_array_equal(np.load(p, mmap_mode="r").ravel(), [1.5, -2])
