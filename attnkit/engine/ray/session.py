"""The Ray session of a run: importing Ray (an optional extra), joining or starting a cluster, the resources
of the model actors, Ray's own log lines kept off the terminal, and the one check that a Ray address goes with
the Ray engine."""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import tempfile

from ...errors import AttnkitError, arg, check_int

INSTALL_HINT = "pip install 'attnkit[distributed]'"


def import_ray():
    """`ray` with Ray Data, or an AttnkitError saying how to install it."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise AttnkitError(f"the ray engine needs Ray Data, which is not installed: {INSTALL_HINT}") from None
    return ray


def check_ray_address(engine: str, address: str | None) -> None:
    """A Ray address is for the Ray engine only, and something must answer there (before any work)."""
    if address and engine != "ray":
        raise AttnkitError(f"{arg('ray_address')} needs {arg('engine', 'ray')}")
    if address and engine == "ray":
        check_reachable(address)


CONNECT_TIMEOUT_S = 10.0  # how long a cluster address may take to accept a connection


def check_reachable(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Refuse, in at most `timeout` seconds, a cluster address ("host:port", "ray://host:port") where nothing
    accepts connections: Ray itself retries such an address for minutes. Other forms ("auto") are left to
    Ray."""
    target = address[len("ray://"):] if address.startswith("ray://") else address
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return
    host = host.strip("[]")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except (OSError, OverflowError, ValueError) as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else (getattr(exc, "strerror", None) or str(exc))
        raise AttnkitError(f"could not reach the Ray cluster at {address!r} ({reason}): is its head node running "
                           f"(ray start --head), and is {arg('ray_address')} right?") from None


@contextlib.contextmanager
def ray_session(address: str | None):
    """Yield a label of the cluster in use. An already initialised Ray is used as it is (and left running);
    otherwise `address=None` starts a local cluster and anything else connects to one ("auto",
    "host:6379", "ray://host:10001"); both are shut down at the end."""
    ray = import_ray()
    if ray.is_initialized():
        yield address or "connected"
        return
    kwargs = {"logging_level": logging.ERROR}
    if address is not None:
        check_reachable(address)
    try:
        if address is None:
            ray.init(include_dashboard=False, **kwargs)
        else:
            ray.init(address=address, **kwargs)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        where = f"the Ray cluster at {address!r}" if address else "a local Ray cluster"
        raise AttnkitError(f"could not start or reach {where}: {first}") from None
    try:
        yield address or "local"
    finally:
        ray.shutdown()


@contextlib.contextmanager
def quiet_ray_data(ray):
    """Ray Data announces every execution, and draws progress bars of its own: the driver shows its own."""
    logger = logging.getLogger("ray.data")
    ctx = ray.data.DataContext.get_current()
    saved = (logger.level, ctx.enable_progress_bars, ctx.print_on_execution_start)
    logger.setLevel(logging.ERROR)
    ctx.enable_progress_bars, ctx.print_on_execution_start = False, False
    try:
        yield
    finally:
        logger.setLevel(saved[0])
        ctx.enable_progress_bars, ctx.print_on_execution_start = saved[1:]


@contextlib.contextmanager
def ray_logs_aside():
    """Ray's C++ core writes log lines straight to file descriptor 2, errors among them that are not (in a normal
    run, Ray Data's actor pools print "Actor ... has constructor arguments in the object store and max_restarts
    > 0 ..."). Inside the block, descriptor 2 goes to a temporary file (the local cluster Ray starts inherits it)
    while `sys.stderr`, and so attnkit's messages and progress bar, keeps the terminal. The file is removed when
    the block ends well; when it ends in an error, the error names the file (AttnkitError) or a line on stderr
    does."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # no file behind sys.stderr: nothing to set aside
        yield None
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    log = tempfile.NamedTemporaryFile(prefix="attnkit-ray-", suffix=".log", delete=False)  # noqa: SIM115
    os.dup2(log.fileno(), fd)
    terminal = os.fdopen(os.dup(saved), "w", buffering=1, encoding=getattr(sys.stderr, "encoding", None) or "utf-8",
                         errors="replace")
    previous, sys.stderr = sys.stderr, terminal
    failed = None
    try:
        yield log.name
    except AttnkitError as exc:
        failed = AttnkitError(f"{exc.template} (Ray's own messages: {log.name})")
    except BaseException:
        failed = True
        raise
    finally:
        terminal.flush()
        sys.stderr = previous
        os.dup2(saved, fd)
        os.close(saved)
        terminal.close()
        log.close()
        if failed is None:
            os.unlink(log.name)
        elif failed is True:
            print(f"Ray's own messages of this run: {log.name}", file=sys.stderr)
    if isinstance(failed, AttnkitError):
        raise failed from None


def plan_actors(ray, num_actors: int | None, cpus_per_actor: int) -> tuple[int, dict]:
    """How many model actors, and the resources of each: one GPU (and `cpus_per_actor` CPUs) each when the
    cluster has GPUs, else `cpus_per_actor` CPUs each, leaving CPUs for the tokenisation tasks."""
    res = ray.cluster_resources()
    gpus, cpus = int(res.get("GPU", 0)), int(res.get("CPU", 0))
    if num_actors is not None:
        check_int(num_actors, "num_actors")
    check_int(cpus_per_actor, "cpus_per_actor")
    if gpus:
        return (num_actors or gpus), {"num_gpus": 1, "num_cpus": cpus_per_actor}
    spare = cpus - cpus_per_actor
    if spare < 1:
        raise AttnkitError(f"the Ray cluster has {cpus} CPU(s) and no GPU: a model actor of {cpus_per_actor} "
                           "CPU(s) would leave none for tokenisation")
    n = num_actors or max(1, (cpus - max(1, cpus // 8)) // cpus_per_actor)
    if n * cpus_per_actor > cpus - 1:
        raise AttnkitError(f"{n} CPU model actors of {cpus_per_actor} CPU(s) would take every CPU of the cluster "
                           f"({cpus}), leaving none for tokenisation: use at most {spare // cpus_per_actor}")
    return n, {"num_cpus": cpus_per_actor}


__all__ = ["CONNECT_TIMEOUT_S", "INSTALL_HINT", "check_ray_address", "check_reachable", "import_ray", "plan_actors",
           "quiet_ray_data", "ray_logs_aside", "ray_session"]
