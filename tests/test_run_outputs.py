"""attnkit/run/outputs.py: output directories are checked before the work; OS errors while writing end in one
line and leave no temporary files."""
import errno
import os

import pytest

from attnkit import AttnkitError
from attnkit.run import atomic_write
from attnkit.run.outputs import ensure_writable_dir


def test_output_under_a_file_is_refused_before_the_work(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(AttnkitError, match="is a file, not a directory"):
        ensure_writable_dir(tmp_path / "f" / "sub" / "run")
    with pytest.raises(AttnkitError, match="exists and is not a directory"):
        ensure_writable_dir(tmp_path / "f")
    assert ensure_writable_dir(tmp_path / "a" / "b").is_dir()
    assert os.listdir(tmp_path / "a" / "b") == []  # the probe file is gone


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_unwritable_directory_is_refused(tmp_path, monkeypatch, code):
    import tempfile

    def refuse(*a, **k):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", refuse)
    with pytest.raises(AttnkitError, match=os.strerror(code)):
        ensure_writable_dir(tmp_path / "out")


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_failed_atomic_write_is_one_line_and_leaves_no_temp_file(tmp_path, monkeypatch, code):
    def full(f):
        f.write(b"partial")
        raise OSError(code, os.strerror(code))

    with pytest.raises(AttnkitError) as e:
        atomic_write(tmp_path / "x.json", full)
    assert str(e.value) == f"could not write {tmp_path / 'x.json'}: {os.strerror(code)}"
    assert os.listdir(tmp_path) == []

    def no_replace(src, dst):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "replace", no_replace)
    with pytest.raises(AttnkitError, match=os.strerror(code)):
        atomic_write(tmp_path / "y.json", lambda f: f.write(b"{}"))
    assert os.listdir(tmp_path) == []


def test_interrupted_atomic_write_keeps_the_old_file(tmp_path):
    (tmp_path / "x").write_text("old")

    def interrupted(f):
        f.write(b"new")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(tmp_path / "x", interrupted)
    assert os.listdir(tmp_path) == ["x"] and (tmp_path / "x").read_text() == "old"


def test_features_save_on_full_disk_is_one_line(tmp_path, feats, full_disk):
    with pytest.raises(AttnkitError, match="could not write .*features.npz: No space left on device"):
        feats.save(tmp_path / "run")
    assert os.listdir(tmp_path / "run") == []


