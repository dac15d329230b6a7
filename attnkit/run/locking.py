"""One attnkit command at a time per run directory, and the one write path of every command that writes.

`output_directory(out, command, inputs=...)` is that path (docs/files.md, "Where commands write"): the output
checked against the inputs, created, locked (`run_lock`), bounded (nothing written outside it), and removed
again when the command created it and failed; `output_file` does the same for a command that writes one file.

`run_lock(directory, command)` takes an exclusive, non-blocking lock (`filelock`, an OS lock on
RUN/.attnkit.lock that the OS releases when the process dies, even by SIGKILL) for the duration of a
command that writes into the directory. The holder writes its pid and command line into
RUN/.attnkit.lock.owner, so a second command is refused with one line that names them:

    RUN is in use by `attnkit extract` (pid 1234); wait for it to finish or choose another directory

A lock stays valid as long as it is held: nothing removes the lock file of another holder. A command removes
its lock files when it ends, however it ends (Ctrl-C included), while it still holds the lock (a run keeps no
empty .attnkit.lock), and
`remove_if_only_lock` removes a directory a command created itself (`make_run_dir`) after taking the lock
itself, so it never removes a directory another command holds. Removing a locked file is safe only because
every command checks, once it has the lock, that the file it locked is still the one at the path (`_acquire`):
a command that opened the file just before its holder removed it, and locked it just after, holds a lock on
a file that no longer exists, and tries again at the path instead of believing it holds the directory (the
OS lock is on the file, not on its name; filelock's documentation warns of exactly this, and leaves Unix lock
files in place for it). Whoever takes the lock also removes what writers killed by SIGKILL left behind: their lock
files, and the pid-named temporary files of `atomic_write` (`.NAME.PID.tmp`) whose process no longer runs.
`check_not_in_use` gives a command line the refusal of a directory in use before the command imports anything
heavy or loads a model.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

from filelock import FileLock, Timeout

from ..errors import AttnkitError
from .files import DISTANCE_SHARDS_DIR, FEATURE_SHARDS_DIR, FEATURES_FILE, LOCK_FILE, OWNER_FILE
from .outputs import check_no_file_in_the_way, check_output_place, ensure_writable_dir, writing_into

_TEMPORARY = re.compile(r"^\..+\.(\d+)\.tmp$")  # atomic_write's temporary files: .NAME.PID.tmp


def process_alive(pid: int) -> bool:
    """Whether a process with this pid runs (on this machine)."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # it exists but is not ours (or cannot be asked): do not call it dead
    return True


def lock_owner(directory) -> dict | None:
    """{"pid", "command"} of the command holding `directory`'s lock as it recorded itself, or None (also when
    the recorded process no longer runs: a stale record left by a killed holder does not name the holder of a
    lock taken since, e.g. by another tool)."""
    try:
        data = json.loads((Path(directory) / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("pid"), int) or not process_alive(data["pid"]):
        return None
    return data


def in_use_error(directory) -> AttnkitError:
    """The refusal of a command whose run directory another process holds, naming the holder as it recorded
    itself."""
    owner = lock_owner(directory) or {}
    who = f"`{owner['command']}` (pid {owner['pid']})" if "pid" in owner and "command" in owner \
        else "another process"
    return AttnkitError(f"{directory} is in use by {who}; wait for it to finish or choose another directory")


_LOCK_TRIES = 20  # takes of a lock whose file its holder removed meanwhile (each is at once: the lock never waits)


def _locked_file(lock: FileLock) -> int | None:
    """The descriptor of the file `lock` holds locked (filelock keeps it in its context, in 3.x and 4.x alike), or
    None where this filelock does not say: then nothing may remove a lock file (see `_let_go`)."""
    fd = getattr(getattr(lock, "_context", None), "lock_file_fd", None)
    return fd if isinstance(fd, int) else None


def _holds_the_file_at(lock: FileLock, path: Path) -> bool:
    """Whether the file `lock` holds is the one at `path` now (not one its holder removed before it was taken)."""
    fd = _locked_file(lock)
    if fd is None:
        return True  # cannot tell: lock files are then never removed, so the file is the one at the path
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _take(directory: Path) -> FileLock | None:
    """The held lock of `directory`, or None when another process holds it; AttnkitError when it cannot be taken
    at all. The lock is taken on the file at the path (a lock taken on a file its holder removed in between is
    given back and taken again)."""
    path = directory / LOCK_FILE
    for _ in range(_LOCK_TRIES):
        lock = FileLock(str(path), timeout=0, thread_local=False)
        try:
            lock.acquire()
        except Timeout:
            return None
        except OSError as exc:
            raise AttnkitError(f"cannot lock run directory {directory}: {exc.strerror or exc}") from None
        if _holds_the_file_at(lock, path):
            return lock
        lock.release()
    raise AttnkitError(f"cannot lock run directory {directory}: its lock file keeps being replaced")


def _acquire(directory: Path) -> FileLock:
    """The held lock of `directory` (`_take`), or AttnkitError naming its holder."""
    lock = _take(directory)
    if lock is None:
        raise in_use_error(directory)
    return lock


def _let_go(directory: Path, lock: FileLock) -> None:
    """Release `lock` (held, on `directory`'s lock file) leaving no lock files behind, on any exit (Ctrl-C
    included): the owner record (this command's, or a stale one a killed holder left: while the lock is held no
    other holder has written one) and the lock file are removed while the lock is still held, so a command leaves
    no empty .attnkit.lock; whoever opened the file meanwhile finds it removed once it has it, and takes the lock
    at the path again (`_take`). The lock file stays only where filelock does not tell which file it locked, as
    filelock itself leaves it."""
    try:
        with contextlib.suppress(OSError):
            (directory / OWNER_FILE).unlink()
        if _locked_file(lock) is not None and _holds_the_file_at(lock, directory / LOCK_FILE):
            with contextlib.suppress(OSError):
                (directory / LOCK_FILE).unlink()
    finally:
        lock.release()


def check_not_in_use(directory) -> None:
    """Refuse at once, as `run_lock` would (AttnkitError naming the holder), when another process holds the lock
    of `directory`: for a command line, which checks this before its imports and its model load (the command's
    own lock checks it again). Lock files that a killed holder left behind (an empty .attnkit.lock, a stale
    .attnkit.lock.owner) are removed on the way, the lock held meanwhile. Creates nothing: a directory without
    lock files is free, and one whose lock cannot be taken (not writable, ...) is left to the command's checks."""
    directory = Path(directory)
    if not any(os.path.lexists(directory / name) for name in (LOCK_FILE, OWNER_FILE)):
        return
    try:
        lock = _take(directory)
    except AttnkitError:
        return
    if lock is None:
        raise in_use_error(directory)
    _let_go(directory, lock)


def remove_stale_temporaries(directory) -> list[Path]:
    """Remove the temporary files (`.NAME.PID.tmp`) that writers killed before they renamed them left in
    `directory` and its shard folders, when their process no longer runs; returns what was removed. Call it
    holding the directory's lock."""
    removed = []
    for folder in (Path(directory), Path(directory) / FEATURE_SHARDS_DIR, Path(directory) / DISTANCE_SHARDS_DIR):
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            m = _TEMPORARY.match(name)
            if m and int(m.group(1)) != os.getpid() and not process_alive(int(m.group(1))):
                with contextlib.suppress(OSError):
                    (folder / name).unlink()
                    removed.append(folder / name)
    return removed


@contextlib.contextmanager
def run_lock(directory, command: str):
    """Hold the exclusive lock of run directory `directory` (created if needed) while the block runs.

    `command` names the holder in the refusal another process gets (e.g. "attnkit cluster").
    Raises AttnkitError at once, without waiting, when another process holds the lock.
    """
    directory = ensure_writable_dir(directory, "run directory")
    lock = _acquire(directory)
    owner_path = directory / OWNER_FILE
    try:
        try:
            owner_path.write_text(json.dumps({"pid": os.getpid(), "command": command}) + "\n")
        except OSError:
            pass  # the lock holds without it; only the refusal message is less specific
        remove_stale_temporaries(directory)
        with writing_into(directory):  # nothing is written outside it, not even through a symbolic link
            yield directory
    finally:
        _let_go(directory, lock)


def make_run_dir(path) -> bool:
    """Create run directory `path` (and its parents) if needed, checking that it can be written; True when
    this call created `path` itself (then, and only then, may a failed command remove it again:
    `remove_if_only_lock`)."""
    path = check_no_file_in_the_way(path, "run directory")
    ensure_writable_dir(path.parent, "parent directory")
    try:
        os.mkdir(path)
        created = True
    except FileExistsError:
        created = False
    except OSError as exc:
        raise AttnkitError(f"cannot create run directory {str(path)!r}: {exc.strerror or exc}") from None
    ensure_writable_dir(path, "run directory")
    return created


@contextlib.contextmanager
def lock_if_run(directory, command: str):
    """`run_lock` when `directory` is a run directory (it holds features.npz), else nothing: for commands
    that write a file wherever they are told to (export, compare --json)."""
    if (Path(directory) / FEATURES_FILE).is_file():
        with run_lock(directory, command):
            yield
    else:
        yield


@contextlib.contextmanager
def output_directory(out, command: str, *, inputs=(), whole: bool = False, name: str = "out"):
    """The one write path of every command that writes into a directory (docs/files.md, "Where commands write").

    In this order, before the block (the command's work) runs: `out` is checked against what the command reads
    (`check_output_place`: never an input, inside one or holding one; with `whole`, never the working directory
    or a directory holding it), created when missing (`make_run_dir`), and locked (`run_lock`: a second command
    is refused at once). While the block runs, nothing is written outside `out` (a symbolic link leading out of
    it is refused). If the block fails and this call created `out`, it is removed again while nothing but the
    lock is in it. The block checks the overwrite policy (`claim_outputs`) under the lock and removes what it
    replaces only after its new results are written. Yields the directory."""
    with writing_into():  # a command started inside another's block is bounded by its own output only
        out = check_output_place(out, inputs, whole=whole, name=name)
        created = make_run_dir(out)
        try:
            with run_lock(out, command) as directory:
                yield directory
        except BaseException:
            if created:  # leave nothing behind for a command that never got anywhere (never a directory in use)
                remove_if_only_lock(out)
            raise


@contextlib.contextmanager
def output_file(path, command: str, *, inputs=(), name: str = "out"):
    """The write path of a command that writes one file anywhere (export -o, compare --json): `path` is checked
    against what the command reads (`check_output_place`), its directory must be writable, and that directory is
    locked when it is a run directory; nothing is written outside it while the block runs. Yields the path."""
    with writing_into():
        path = check_output_place(path, inputs, name=name)
        ensure_writable_dir(path.parent, "output directory")
        with lock_if_run(path.parent, command), writing_into(path.parent):
            yield path


def remove_if_only_lock(path) -> bool:
    """Remove directory `path` when nothing but the lock files is in it and no other process holds its lock
    (a command that created it and then failed leaves nothing behind). The lock is taken first and the lock
    file removed while held, so a lock another command holds, or takes meanwhile, is never removed; a directory
    that holds more keeps no lock file of this call either (`_let_go`). True when the directory was removed."""
    path = Path(path)
    if not path.is_dir():
        return False
    try:
        lock = _take(path)
    except AttnkitError:
        return False
    if lock is None:
        return False  # in use: not ours to remove
    try:
        if {p.name for p in path.iterdir()} - {LOCK_FILE, OWNER_FILE}:
            return False
        with contextlib.suppress(FileNotFoundError):
            (path / OWNER_FILE).unlink()
        with contextlib.suppress(FileNotFoundError):
            (path / LOCK_FILE).unlink()
        path.rmdir()
        return True
    except OSError:
        return False
    finally:
        _let_go(path, lock)


__all__ = ["LOCK_FILE", "OWNER_FILE", "check_not_in_use", "in_use_error", "lock_if_run", "lock_owner", "make_run_dir",
           "output_directory", "output_file", "process_alive", "remove_if_only_lock", "remove_stale_temporaries",
           "run_lock"]
