"""attnkit/run/locking.py: one command at a time per run directory; a second one is refused naming the holder."""
import contextlib
import json
import multiprocessing
import os

import pytest

from attnkit import AttnkitError
from attnkit.run.locking import LOCK_FILE, OWNER_FILE, lock_owner, run_lock


def test_second_command_is_refused_naming_the_holder(tmp_path, lock_held):
    run = tmp_path / "run"
    with lock_held(run, "attnkit extract") as pid:
        assert lock_owner(run) == {"pid": pid, "command": "attnkit extract"}
        with pytest.raises(AttnkitError) as e:
            with run_lock(run, "attnkit cluster"):
                pass
        assert str(e.value) == (f"{run} is in use by `attnkit extract` (pid {pid}); "
                                "wait for it to finish or choose another directory")
    # a killed holder leaves its lock to the OS: the next command gets the directory
    with run_lock(run, "attnkit cluster"):
        assert lock_owner(run)["pid"] == os.getpid()
    assert not (run / OWNER_FILE).exists()


def test_a_finished_command_leaves_no_lock_file(tmp_path, feats):
    from click.testing import CliRunner

    from attnkit.cli.main import main

    run = tmp_path / "run"
    with run_lock(run, "attnkit cluster"):
        assert (run / LOCK_FILE).is_file()  # held while the command runs
    assert sorted(os.listdir(run)) == []
    feats.save(run)
    # (a given k and one short stability measure: the lock is the same whatever the clustering does)
    r = CliRunner().invoke(main, ["cluster", str(run), "-q", "-k", "2", "--stability", "2", "--seeds", "1"])
    assert r.exit_code == 0, r.output
    assert not (run / LOCK_FILE).exists() and not (run / OWNER_FILE).exists()
    assert (run / "clusters.json").is_file()


def test_a_lock_taken_on_a_lock_file_its_holder_removed_is_taken_again_at_the_path(tmp_path, monkeypatch):
    """A command opens the lock file; its holder finishes, removes the file and lets go; a third command makes
    the file again and locks it; only then does the first take the lock on the file it opened, which no longer
    exists. It must not believe it holds the directory: it tries again at the path and is refused, the third
    holding it. (The interleaving is made by hand: the first `acquire` runs, then the others act.)"""
    import fcntl

    import filelock

    run = tmp_path / "run"
    run.mkdir()
    real_acquire = filelock.FileLock.acquire
    third = []

    def acquire(self, *args, **kwargs):
        out = real_acquire(self, *args, **kwargs)
        if not third:  # the file this lock holds goes; a third process's lock on a new one at the path
            (run / LOCK_FILE).unlink()
            third.append(os.open(run / LOCK_FILE, os.O_RDWR | os.O_CREAT))
            fcntl.flock(third[0], fcntl.LOCK_EX | fcntl.LOCK_NB)  # another open file: a lock of its own
        return out

    monkeypatch.setattr(filelock.FileLock, "acquire", acquire)
    try:
        with pytest.raises(AttnkitError, match="is in use by another process"):
            with run_lock(run, "attnkit cluster"):
                pass
        assert (run / LOCK_FILE).is_file()  # the third's lock file is left alone
        os.close(third[0])  # the third ends: the directory is free
        with run_lock(run, "attnkit cluster"):
            assert lock_owner(run)["pid"] == os.getpid()
    finally:
        with contextlib.suppress(OSError):
            os.close(third[0])


def test_second_cli_command_exits_with_one_line(tmp_path, feats, lock_held):
    from click.testing import CliRunner

    from attnkit.cli.main import main

    run = tmp_path / "run"
    feats.save(run)
    with lock_held(run, "attnkit extract") as pid:
        r = CliRunner().invoke(main, ["cluster", str(run), "-q"])
    assert r.exit_code == 1
    assert r.stderr.strip() == (f"Error: {run} is in use by `attnkit extract` (pid {pid}); "
                                "wait for it to finish or choose another directory")
    assert not (run / "clusters.json").exists()


# --- a lock stays valid as long as it is held (issue 21) ------------------------------------------------------
def _small_corpus(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("One line here.\nTwo lines there.\n")
    return corpus


def test_a_refused_extract_never_removes_the_directory_another_command_holds(tmp_path, lock_held, monkeypatch):
    """Two extracts start into a new directory: the refused one saw it absent (it may even have created it), and
    another command takes the lock just before it tries. Its cleanup must leave the holder's directory and lock
    alone, so a third command is still refused."""
    import filelock
    from click.testing import CliRunner

    from attnkit.cli.main import main

    run = tmp_path / "new-run"
    corpus = _small_corpus(tmp_path)
    real_acquire = filelock.FileLock.acquire
    me, holder = os.getpid(), {}
    stack = contextlib.ExitStack()

    def acquire(self, *args, **kwargs):
        # the holder stands still holding the lock from the moment before this process's first attempt
        if os.getpid() == me and "pid" not in holder:
            holder["pid"] = stack.enter_context(lock_held(run, "attnkit extract"))
        return real_acquire(self, *args, **kwargs)

    monkeypatch.setattr(filelock.FileLock, "acquire", acquire)
    with stack:
        r = CliRunner().invoke(main, ["extract", str(corpus), "-o", str(run), "-q", "--backend", "reference"])
        assert r.exit_code == 1, r.output
        assert r.stderr.strip() == (f"Error: {run} is in use by `attnkit extract` (pid {holder['pid']}); wait for it "
                                    "to finish or choose another directory")
        assert (run / LOCK_FILE).is_file() and lock_owner(run)["pid"] == holder["pid"]
        monkeypatch.setattr(filelock.FileLock, "acquire", real_acquire)
        with pytest.raises(AttnkitError, match=f"in use by `attnkit extract` \\(pid {holder['pid']}\\)"):
            with run_lock(run, "attnkit extract --overwrite"):
                pass
    assert not (run / "features.npz").exists()


def test_an_extract_into_a_running_run_is_told_it_is_in_use(tmp_path, lock_held):
    """While a run holds its directory (with its checkpoint), a second extract hears that the directory is in use,
    not that it holds an interrupted run to resume."""
    from click.testing import CliRunner

    from attnkit.cli.main import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint.npz").write_bytes(b"a checkpoint of the running run")
    with lock_held(run, "attnkit extract") as pid:
        r = CliRunner().invoke(main, ["extract", str(_small_corpus(tmp_path)), "-o", str(run), "-q"])
    assert r.exit_code == 1
    assert r.stderr.strip() == (f"Error: {run} is in use by `attnkit extract` (pid {pid}); wait for it to finish or "
                                "choose another directory")


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _hold_with_flock(path, ready):
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    ready.set()
    multiprocessing.Event().wait(120)


def test_a_lock_held_by_another_tool_does_not_name_a_stale_owner(tmp_path):
    """A killed holder leaves its owner record behind; a lock taken since by another tool (`flock`) must not be
    put on that dead pid."""
    run = tmp_path / "run"
    run.mkdir()
    dead = _dead_pid()
    (run / OWNER_FILE).write_text(json.dumps({"pid": dead, "command": "attnkit extract"}) + "\n")
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    proc = ctx.Process(target=_hold_with_flock, args=(str(run / LOCK_FILE), ready), daemon=True)
    proc.start()
    try:
        assert ready.wait(30)
        assert lock_owner(run) is None
        with pytest.raises(AttnkitError) as e:
            with run_lock(run, "attnkit cluster"):
                pass
        assert str(e.value) == (f"{run} is in use by another process; wait for it to finish or choose another "
                                "directory")
    finally:
        proc.kill()
        proc.join()


def test_temporary_files_of_killed_writers_are_removed_by_the_next_holder(tmp_path, lock_held):
    run = tmp_path / "run"
    run.mkdir()
    dead = _dead_pid()
    stale = [run / f".checkpoint.npz.{dead}.tmp", run / "shards" / f".shard-000001.npz.{dead}.tmp"]
    stale[1].parent.mkdir()
    kept = [run / f".checkpoint.npz.{os.getpid()}.tmp", run / "notes.tmp", run / "checkpoint.npz"]
    for p in stale + kept:
        p.write_bytes(b"x")
    with lock_held(tmp_path / "elsewhere") as live:  # a live writer's file stays
        kept.append(run / f".meta.json.{live}.tmp")
        kept[-1].write_bytes(b"x")
        with run_lock(run, "attnkit extract"):
            assert not any(p.exists() for p in stale)
            assert all(p.exists() for p in kept)


# --- lock files on every exit, and what a killed holder leaves (issue 46 item 5) ---------------------------------
def test_a_command_interrupted_after_it_wrote_leaves_no_lock_files(tmp_path):
    """Ctrl-C once a command that created its directory has written into it (a checkpoint): the directory stays
    with what was written, and without lock files (the cleanup of a directory it created took the lock again and
    left an empty .attnkit.lock)."""
    from attnkit.run.locking import output_directory

    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        with output_directory(run, "attnkit extract") as out:
            (out / "checkpoint.npz").write_bytes(b"a checkpoint")
            raise KeyboardInterrupt
    assert sorted(os.listdir(run)) == ["checkpoint.npz"]
    with pytest.raises(KeyboardInterrupt):  # and into a directory that was there before
        with output_directory(run, "attnkit extract"):
            raise KeyboardInterrupt
    assert sorted(os.listdir(run)) == ["checkpoint.npz"]


def test_an_extract_interrupted_with_a_checkpoint_leaves_no_lock_files(tmp_path, monkeypatch):
    """The command line's Ctrl-C after the first checkpoint (raised where the checkpoint was just saved, as
    tests/paused_extract.py's SIGINT is): exit 130, the checkpoint kept, no lock file left."""
    from click.testing import CliRunner

    from attnkit.cli.main import main
    from attnkit.jobs import extract_job

    real_save, saved = extract_job.Checkpoints.save, []

    def save(self, state):
        real_save(self, state)
        if not saved:  # (the interruption saves once more)
            saved.append(state.next_index)
            raise KeyboardInterrupt

    monkeypatch.setattr(extract_job.Checkpoints, "save", save)
    corpus, run = tmp_path / "c.txt", tmp_path / "run"
    corpus.write_text("".join(f"Line {i} of a small corpus.\n" for i in range(40)))
    r = CliRunner().invoke(main, ["extract", str(corpus), "-o", str(run), "-q", "--batch-size", "4",
                                  "--checkpoint-every", "1", "--workers", "0"])
    assert r.exit_code == 130, r.output
    assert f"interrupted after {saved[0]} segments; checkpoint saved" in r.stderr
    assert sorted(os.listdir(run)) == ["checkpoint.npz"]


def test_what_a_killed_holder_left_neither_blocks_nor_names_anyone(tmp_path, lock_held):
    """A holder killed by SIGKILL leaves its lock file and owner record: the next command is not refused, the check
    a command line makes first removes both (holding the lock), and so does a command that takes the lock."""
    from attnkit.run.locking import check_not_in_use

    run = tmp_path / "run"
    with lock_held(run, "attnkit extract"):
        pass  # killed
    assert sorted(os.listdir(run)) == [LOCK_FILE, OWNER_FILE]
    assert lock_owner(run) is None  # its pid no longer runs
    check_not_in_use(run)
    assert os.listdir(run) == []
    with lock_held(run, "attnkit extract"):
        pass
    with run_lock(run, "attnkit cluster"):
        assert lock_owner(run)["command"] == "attnkit cluster"
    assert os.listdir(run) == []
    # a record naming a pid that runs again (reused), with no lock held: no refusal, and it goes
    (run / OWNER_FILE).write_text(json.dumps({"pid": os.getpid(), "command": "attnkit extract"}) + "\n")
    check_not_in_use(run)
    assert os.listdir(run) == []
    check_not_in_use(tmp_path / "missing")  # creates nothing
    assert not (tmp_path / "missing").exists()


def test_the_first_check_refuses_a_held_directory_and_leaves_its_lock_alone(tmp_path, lock_held):
    from attnkit.run.locking import check_not_in_use

    run = tmp_path / "run"
    with lock_held(run, "attnkit extract") as pid:
        with pytest.raises(AttnkitError, match=f"is in use by `attnkit extract` \\(pid {pid}\\)"):
            check_not_in_use(run)
        assert sorted(os.listdir(run)) == [LOCK_FILE, OWNER_FILE]
        assert lock_owner(run)["pid"] == pid
