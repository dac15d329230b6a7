"""glibc's heap keeps memory the forwards free (shared/design/cpu-kernel-review.md §5-6).

glibc serves an allocation above its mmap threshold (128 KB) with mmap and gives it back to the kernel on free,
but each such free raises the threshold to the freed size ("dynamic threshold"). After the first large tensor is
freed, the L-dependent buffers of every later layer come from the heap, and freed heap memory stays in the
process: extraction of SmolLM2 at L=2048 rose 324 MB in irregular jumps where sdpa rose 192 MB, with the same
tensors alive. A fixed threshold (`mallopt(M_MMAP_THRESHOLD, 128 KB)`, which also turns the dynamic threshold
off) removed the whole gap at no measurable cost. It changes where memory comes from, never a number.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD = 128 * 1024
ENV = "MALLOC_MMAP_THRESHOLD_"  # glibc's own variable: a user who sets it has chosen

_done: bool | None = None


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") else None
    except OSError:
        return None


def limit_heap_retention() -> bool:
    """Fix glibc's mmap threshold at 128 KB, once per process, so large freed buffers go back to the kernel;
    True when it is in force (set here or by the user's MALLOC_MMAP_THRESHOLD_), False where there is no glibc
    (macOS, musl: nothing to do)."""
    global _done
    if _done is None:
        if os.environ.get(ENV):
            _done = True
        else:
            libc = _libc()
            _done = bool(libc is not None and libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1)
    return _done


__all__ = ["MMAP_THRESHOLD", "limit_heap_retention"]
