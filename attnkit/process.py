"""Every change attnkit makes to the process it runs in, in one place (docs/process.md).

A library that measures inside someone else's Python process must leave it as it found it: each change below is
made by one function of this module, undone when its scope ends (on any exception, KeyboardInterrupt included,
since every scope is a `finally`), listed by `process_changes()` while it holds, and kept from happening by its
opt-out environment variable (`OPT_OUTS`; "0" opts out, "1" or unset lets attnkit make it):

  openmp_waits       OMP_WAIT_POLICY / GOMP_SPINCOUNT in the environment from the command line's start until torch
                     has been imported (libgomp reads them then, once), then taken out (`environ_until_torch`)
  torch_threads      torch.set_num_threads during a run of the local engine (`torch_threads`)
  tokenizer_threads  TOKENIZERS_PARALLELISM=false during a run whose forwards run on the calling thread
                     (`tokenizer_threads_off`)
  import_hook        a finder in sys.meta_path from `import attnkit` until transformers is imported, which then
                     registers attnkit's attention with it (`after_import`)

This module imports nothing heavy: the command line calls it before torch is imported, and `import attnkit`
installs the import hook through it. torch and attnkit.ops are imported inside the functions that need them.
"""
from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from .errors import AttnkitError

# change -> the environment variable that keeps attnkit from making it ("0")
OPT_OUTS = {
    "openmp_waits": "ATTNKIT_OPENMP_WAITS",
    "torch_threads": "ATTNKIT_TORCH_THREADS",
    "tokenizer_threads": "ATTNKIT_TOKENIZER_THREADS",
    "import_hook": "ATTNKIT_IMPORT_HOOK",
}
OPENMP_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # what libgomp reads of attnkit's choice, when it loads


@dataclass(frozen=True)
class ProcessChange:
    """One change attnkit holds in the process now: `name` (a key of `OPT_OUTS`), `what` it changes, the `scope`
    that holds it (and so when it ends), `since` (time.time() when it began) and `opt_out` (the variable, =0)."""
    name: str
    what: str
    scope: str
    since: float
    opt_out: str


def allowed(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether attnkit may make change `name`: its opt-out variable unset, empty or "1" (yes), "0" (no); any
    other value is an AttnkitError naming the variable."""
    var = OPT_OUTS[name]
    value = (os.environ if environ is None else environ).get(var, "").strip()
    if value in ("", "1"):
        return True
    if value == "0":
        return False
    raise AttnkitError(f"{var} must be 0 (attnkit leaves that part of the process alone) or 1, got {value!r} "
                       f"(docs/process.md)")


_lock = threading.Lock()
_held: dict[int, ProcessChange] = {}
_tokens = itertools.count()


def _begin(name: str, what: str, scope: str) -> int:
    token = next(_tokens)
    with _lock:
        _held[token] = ProcessChange(name, what, scope, time.time(), f"{OPT_OUTS[name]}=0")
    return token


def _end(token: int | None) -> None:
    with _lock:
        _held.pop(token, None)


@contextlib.contextmanager
def holding(name: str, what: str, scope: str) -> Iterator[None]:
    """Lists change `name` in `process_changes()` for the duration of the block (the caller makes and undoes
    the change itself, inside the block)."""
    token = _begin(name, what, scope)
    try:
        yield
    finally:
        _end(token)


def process_changes() -> list[ProcessChange]:
    """What attnkit has changed in this process now, oldest first: one record per change held (a change held by
    several threads at once, once per holder). Empty while attnkit holds nothing: before anything ran, and after
    every scope ended."""
    with _lock:
        return sorted(_held.values(), key=lambda c: c.since)


# --- torch's threads and the tokenizer's --------------------------------------------------------------------
@contextlib.contextmanager
def torch_threads() -> Iterator[int]:
    """A scope inside which attnkit may call torch.set_num_threads (a run of the local engine); the caller's
    count comes back when it ends. Yields the caller's count. With ATTNKIT_TORCH_THREADS=0 the engine keeps that
    count (attnkit/engine/local.py asks `allowed("torch_threads")`)."""
    import torch

    before = torch.get_num_threads()
    try:
        with holding("torch_threads", f"torch.set_num_threads (the caller's {before} comes back)",
                     "a run of the local engine"):
            yield before
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


@contextlib.contextmanager
def scoped_environ(name: str, values: Mapping[str, str], scope: str) -> Iterator[bool]:
    """`values` in os.environ for the duration of the block, then each variable as it was (unset again where it
    was unset); listed as change `name`. Nothing where its opt-out says 0. Yields whether it set them."""
    if not allowed(name):
        yield False
        return
    saved = {k: os.environ.get(k) for k in values}
    try:
        with holding(name, ", ".join(f"{k}={v}" for k, v in values.items()) + " in os.environ", scope):
            os.environ.update(values)
            yield True
    finally:
        _restore(saved)


def _restore(saved: Mapping[str, str | None]) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


TOKENIZER_THREADS = "TOKENIZERS_PARALLELISM"  # the Rust tokenizer reads it before every batch


def tokenizer_threads_off():
    """The Rust tokenizer's own thread pool off while torch's threads run on this machine's cores: its threads
    spin after each batch the caller tokenises and take CPU time from the forwards (docs/pipeline.md §4)."""
    return scoped_environ("tokenizer_threads", {TOKENIZER_THREADS: "false"},
                          "a run whose forwards run on the calling thread")


# --- what is read once, at an import ------------------------------------------------------------------------
class _AfterImport(importlib.abc.MetaPathFinder):
    """A finder that removes itself at the first import of `module` and calls `then()` once it has loaded (also
    when loading it failed)."""

    def __init__(self, module: str, then: Callable[[], None], token: int | None):
        self.module, self.then, self.token = module, then, token

    def remove(self) -> None:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        _end(self.token)

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.module:
            return None
        self.remove()
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            self.then()
            return spec
        exec_module, then = spec.loader.exec_module, self.then

        def exec_then(module):
            try:
                exec_module(module)
            finally:
                then()

        spec.loader.exec_module = exec_then
        return spec


def after_import(name: str, module: str, then: Callable[[], None], what: str) -> _AfterImport | None:
    """Call `then()` right after `module` is first imported, through a finder in sys.meta_path that removes
    itself at that import and is listed as change `name` meanwhile; None (and no finder) where `name` is opted
    out."""
    if not allowed(name):
        return None
    finder = _AfterImport(module, then, _begin(name, what, f"until {module} is imported"))
    sys.meta_path.insert(0, finder)
    return finder


_openmp: dict = {"read": None, "finder": None, "saved": {}}


def environ_until_torch(values: Mapping[str, str]) -> bool:
    """Put `values` (OpenMP variables) into os.environ until torch has been imported, when libgomp reads them,
    then restore the variables as they were: a subprocess started later does not inherit them. False, and
    nothing set, where torch is already loaded (libgomp has read its variables) or ATTNKIT_OPENMP_WAITS=0."""
    if "torch" in sys.modules or not allowed("openmp_waits"):
        return False
    end_environ_until_torch()
    _openmp["saved"] = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    watch_torch_import(", ".join(f"{k}={v}" for k, v in values.items()) + " in os.environ")
    return True


def watch_torch_import(what: str = "nothing in os.environ") -> None:
    """Note the OpenMP variables libgomp reads when torch is imported (`openmp_in_effect`), through a finder in
    sys.meta_path until then; nothing where torch is already loaded."""
    if "torch" in sys.modules or _openmp["finder"] is not None:
        return
    _openmp["finder"] = after_import("openmp_waits", "torch", _torch_loaded,
                                     what + "; a finder in sys.meta_path notes what libgomp reads when torch loads")


def _torch_loaded() -> None:
    _openmp["read"] = {k: os.environ[k] for k in OPENMP_VARIABLES if os.environ.get(k)}
    end_environ_until_torch()


def end_environ_until_torch() -> None:
    """Take out what `environ_until_torch` put in (the command line calls it when a command ends that never
    imported torch; the import of torch calls it otherwise)."""
    finder, _openmp["finder"] = _openmp["finder"], None
    if finder is not None:
        finder.remove()
    saved, _openmp["saved"] = _openmp["saved"], {}
    _restore(saved)


def _starting_environ(path: str = "/proc/self/environ") -> dict[str, str] | None:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError:
        return None
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {k: v for k, _, v in pairs}


def openmp_in_effect(environ: Mapping[str, str] | None = None, modules=None,
                     starting: Callable[[], dict | None] = _starting_environ) -> tuple[dict[str, str], str]:
    """The OpenMP variables libgomp read (`OPENMP_VARIABLES` that are set) and how attnkit knows:
      - "read at torch's import": attnkit watched torch load (the command line) and saw them then;
      - "torch not loaded yet": what the environment says now, which libgomp will read;
      - "set when the process started": torch loaded without attnkit watching; a variable counts only if the
        process's starting environment (/proc/self/environ) has the same value, so it was there when libgomp
        loaded. A variable set later (os.environ after torch was imported) had no effect and is left out."""
    environ = os.environ if environ is None else environ
    modules = sys.modules if modules is None else modules
    if _openmp["read"] is not None:
        return dict(_openmp["read"]), "read at torch's import"
    now = {k: environ[k] for k in OPENMP_VARIABLES if environ.get(k)}
    if "torch" not in modules:
        return now, "torch not loaded yet"
    start = starting() or {}
    return {k: v for k, v in now.items() if start.get(k) == v}, "set when the process started"


__all__ = ["OPENMP_VARIABLES", "OPT_OUTS", "ProcessChange", "after_import", "allowed", "end_environ_until_torch",
           "environ_until_torch", "holding", "openmp_in_effect", "process_changes",
           "scoped_environ", "tokenizer_threads_off", "torch_threads", "watch_torch_import"]
