"""A forked process that holds a run directory's lock (attnkit.run.locking.run_lock) until it is killed:
another process, as the lock must exclude, started in milliseconds (fork inherits the loaded modules)."""
import contextlib
import multiprocessing


def _hold(directory, command, ready):
    from attnkit.run.locking import run_lock

    with run_lock(directory, command):
        ready.set()
        multiprocessing.Event().wait(120)


@contextlib.contextmanager
def lock_held(directory, command="attnkit extract"):
    """Yield the pid of a child process holding `directory`'s lock as `command`."""
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    proc = ctx.Process(target=_hold, args=(str(directory), command, ready), daemon=True)
    proc.start()
    try:
        assert ready.wait(30), "the lock holder did not start"
        yield proc.pid
    finally:
        proc.kill()
        proc.join()
