"""`attnkit extract` that stands still after its first checkpoint, for tests that interrupt a run.

    python tests/paused_extract.py FD extract CORPUS -o RUN ...

runs the command line (the arguments after FD) with one change: right after the first checkpoint is on disk it
writes its pid to file descriptor FD (inherited from the test, the write end of a pipe) and waits for a signal.
SIGINT or SIGTERM then interrupt it where a real run would be interrupted, SIGKILL kills it there; the run
cannot finish before the test has signalled, however fast or loaded the machine is. Tokenisation workers, when
the run has any, are running while it waits.
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from attnkit.cli.main import main
from attnkit.jobs import extract_job


def start_paused(args, **popen) -> subprocess.Popen:
    """Start `attnkit <args>` in a subprocess and return once it stands still after its first checkpoint (its
    output in pipes). Fails with the run's stderr when it ends before that."""
    r, w = os.pipe()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(w), *map(str, args)], env=env,
                            pass_fds=(w,), stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)
    os.close(w)
    with os.fdopen(r) as ready:
        line = ready.readline()  # blocks until the run pauses, or ends (EOF)
    if not line:
        _, err = proc.communicate()
        raise AssertionError(f"the run ended before its first checkpoint: {err.decode()}")
    return proc


def _pause_after_first_checkpoint(fd: int) -> None:
    real_save = extract_job.Checkpoints.save
    state = {"paused": False}

    def save(self, extraction_state):
        real_save(self, extraction_state)
        if not state["paused"]:
            state["paused"] = True
            os.write(fd, f"{os.getpid()}\n".encode())
            os.close(fd)
            # until a signal handler raises (SIGINT, SIGTERM) or the process is killed. Not signal.pause(): a
            # signal that lands after the loop's last check and before pause() starts would be waited for forever;
            # a handler pending when a sleep starts runs when it ends
            while True:
                time.sleep(0.05)

    extract_job.Checkpoints.save = save


if __name__ == "__main__":
    # Ctrl-C as in a terminal, even when the tests run where SIGINT is ignored (a background job of a
    # non-interactive shell, nohup): Python then leaves it ignored, and the run would never see the test's SIGINT
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _pause_after_first_checkpoint(int(sys.argv[1]))
    sys.exit(main(sys.argv[2:], prog_name="attnkit"))
