"""glibc's mmap threshold, fixed by extraction (attnkit/engine/heap.py): a freed large buffer raises glibc's
dynamic threshold, after which buffers of that size stay in the heap when freed (the RSS growth of
shared/design/cpu-kernel-review.md §6). Measured in a fresh process through glibc's own counters: after a 4 MB
buffer is freed, a 512 KB one is an mmapped block (given back to the kernel when freed) only with the fix."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from attnkit.engine.heap import limit_heap_retention

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not limit_heap_retention(),
                                reason="glibc only")

PROBE = textwrap.dedent("""
    import ctypes, sys
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
    libc.mallinfo2.restype = Info
    if sys.argv[1] == "fix":
        from attnkit.engine.heap import limit_heap_retention
        assert limit_heap_retention()
    libc.free(libc.malloc(4 << 20))  # glibc's dynamic threshold rises to 4 MB
    before = libc.mallinfo2().hblks
    p = libc.malloc(512 << 10)
    print(libc.mallinfo2().hblks - before)
    libc.free(p)
""")


def mmapped_blocks(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=env, check=True)
    return int(out.stdout.strip())


def test_fixed_threshold_keeps_large_buffers_out_of_the_heap():
    assert mmapped_blocks("default") == 0  # glibc alone: the 512 KB buffer comes from the heap
    assert mmapped_blocks("fix") == 1


def test_measuring_fixes_the_threshold(monkeypatch):
    from attnkit.engine import forward, heap

    calls = []
    monkeypatch.setattr(forward, "limit_heap_retention", lambda: calls.append(1) or heap.limit_heap_retention())
    import attnkit
    from tests.synthetic import tiny_decoder

    model = attnkit.instrument(tiny_decoder("llama"))
    with forward.measuring(model):
        pass
    assert calls == [1]
