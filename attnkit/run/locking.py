"""One attnkit command at a time per run directory.

`run_lock(directory, command)` takes an exclusive, non-blocking lock (`filelock`, an OS lock on
RUN/.attnkit.lock that the OS releases when the process dies, even by SIGKILL) for the duration of a
command that writes into the directory. The holder writes its pid and command line into
RUN/.attnkit.lock.owner, so a second command is refused with one line that names them:

    RUN is in use by `attnkit extract` (pid 1234); wait for it to finish or choose another directory
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

from filelock import FileLock, Timeout

from ..errors import AttnkitError
from .files import FEATURES_FILE, LOCK_FILE, OWNER_FILE
from .outputs import ensure_writable_dir


def lock_owner(directory) -> dict | None:
    """{"pid", "command"} of the command holding `directory`'s lock as it recorded itself, or None."""
    try:
        data = json.loads((Path(directory) / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@contextlib.contextmanager
def run_lock(directory, command: str):
    """Hold the exclusive lock of run directory `directory` (created if needed) while the block runs.

    `command` names the holder in the refusal another process gets (e.g. "attnkit cluster").
    Raises AttnkitError at once, without waiting, when another process holds the lock.
    """
    directory = ensure_writable_dir(directory, "run directory")
    lock = FileLock(str(directory / LOCK_FILE), timeout=0, thread_local=False)
    try:
        lock.acquire()
    except Timeout:
        owner = lock_owner(directory) or {}
        who = f"`{owner['command']}` (pid {owner['pid']})" if "pid" in owner and "command" in owner \
            else "another attnkit command"
        raise AttnkitError(f"{directory} is in use by {who}; wait for it to finish or choose another directory") \
            from None
    except OSError as exc:
        raise AttnkitError(f"cannot lock run directory {directory}: {exc.strerror or exc}") from None
    owner_path = directory / OWNER_FILE
    try:
        try:
            owner_path.write_text(json.dumps({"pid": os.getpid(), "command": command}) + "\n")
        except OSError:
            pass  # the lock holds without it; only the refusal message is less specific
        yield directory
    finally:
        with contextlib.suppress(OSError):
            owner_path.unlink()
        lock.release()


@contextlib.contextmanager
def lock_if_run(directory, command: str):
    """`run_lock` when `directory` is a run directory (it holds features.npz), else nothing: for commands
    that write a file wherever they are told to (export, compare --json)."""
    if (Path(directory) / FEATURES_FILE).is_file():
        with run_lock(directory, command):
            yield
    else:
        yield


def remove_if_only_lock(path) -> None:
    """Remove directory `path` when nothing but the lock files is in it (a command that created it and then
    failed leaves nothing behind)."""
    path = Path(path)
    if not path.is_dir():
        return
    if not {p.name for p in path.iterdir()} - {LOCK_FILE, OWNER_FILE}:
        shutil.rmtree(path, ignore_errors=True)


__all__ = ["LOCK_FILE", "OWNER_FILE", "lock_if_run", "lock_owner", "remove_if_only_lock", "run_lock"]
