"""attnkit's CPU allocator (csrc/cpu/block_allocator.cpp, attnkit.ops.hold_cpu_allocator): every CPU block a plain
malloc aligned inside it, for the thread that holds it (attnkit's own measuring forwards,
attnkit.process.measuring_forward), so that glibc's heap reuses the holes freed activations leave (docs/process.md).
A routing allocator registered once in c10's slot decides per allocation: no swap races another thread."""
from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from attnkit import ops

pytestmark = pytest.mark.skipif(not ops._CPU_ALLOCATOR, reason="the extension has no CPU allocator (not built)")


def from_block_allocator(t: torch.Tensor) -> bool:
    """Whether `t`'s storage is one of the block allocator's: the 8 bytes before its data hold the pointer malloc
    returned, 16 to 64 bytes before the data. c10's own blocks (posix_memalign) have glibc's chunk size there."""
    data = t.untyped_storage().data_ptr()
    raw = ctypes.c_uint64.from_address(data - 8).value
    return 16 <= data - raw <= 64


@pytest.fixture(autouse=True)
def no_holds_left():
    assert ops.cpu_allocator_holders() == 0
    yield
    assert ops.cpu_allocator_holders() == 0


@pytest.mark.parametrize("n", [1, 3, 4096, 1 << 16, (1 << 22) + 5])
def test_blocks_are_aligned_as_c10s_and_hold_their_values(n):
    assert ops.hold_cpu_allocator()
    try:
        t = torch.arange(n, dtype=torch.float32)
        assert from_block_allocator(t)
        assert t.data_ptr() % 64 == 0
        assert t[-1].item() == n - 1 and t.sum().item() == pytest.approx(n * (n - 1) / 2, rel=1e-6)
    finally:
        ops.release_cpu_allocator()
    assert not from_block_allocator(torch.arange(n, dtype=torch.float32))
    assert t.sum().item() == pytest.approx(n * (n - 1) / 2, rel=1e-6)  # still readable, freed by its own deleter
    del t


def test_empty_tensors_and_resizes():
    assert ops.hold_cpu_allocator()
    try:
        e = torch.empty(0)
        assert e.numel() == 0
        t = torch.ones(10)
    finally:
        ops.release_cpu_allocator()
    # the storage grows through the routing allocator it was made by, which after the hold gives c10's blocks; the
    # old block is freed by its own deleter
    t.resize_(1 << 20)
    t[-1] = 2.0
    assert t[:10].sum().item() == 10 and t[-1].item() == 2.0
    assert not from_block_allocator(t)


def test_holds_are_counted_and_the_last_release_restores_c10s():
    assert ops.hold_cpu_allocator() and ops.hold_cpu_allocator()
    assert ops.cpu_allocator_holders() == 2
    ops.release_cpu_allocator()
    assert from_block_allocator(torch.empty(1000))
    ops.release_cpu_allocator()
    assert not from_block_allocator(torch.empty(1000))
    with pytest.raises(RuntimeError, match="release_cpu_allocator without"):
        ops.release_cpu_allocator()


def test_the_numbers_do_not_depend_on_the_allocator():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(257, 96, generator=g), torch.randn(96, 300, generator=g)

    def work():
        h = torch.nn.functional.gelu(x @ w)
        return torch.softmax(h @ h.T, dim=-1) @ h

    plain = work()
    assert ops.hold_cpu_allocator()
    try:
        held = work()
        assert from_block_allocator(held)
    finally:
        ops.release_cpu_allocator()
    assert torch.equal(plain, held)


def test_holds_from_several_threads():
    def work(_):
        for _ in range(200):
            assert ops.hold_cpu_allocator()
            x = torch.randn(64, 64)
            (x @ x).sum()
            ops.release_cpu_allocator()

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(work, range(4)))  # re-raises a worker's exception
    assert not from_block_allocator(torch.empty(1000))


def test_another_thread_allocates_through_c10s_while_one_holds_it():
    """A DataLoader's thread, or the user's own, allocating while attnkit measures: its tensors are c10's, and
    the routing allocator it goes through was registered before (nothing is swapped under it)."""
    assert ops.hold_cpu_allocator()
    try:
        here = torch.empty(1000)
        with ThreadPoolExecutor(1) as pool:
            there = pool.submit(lambda: torch.empty(1000)).result()
        assert from_block_allocator(here) and not from_block_allocator(there)
        assert ops.cpu_allocator_holders() == 1 and ops.cpu_allocator_registered()
    finally:
        ops.release_cpu_allocator()
    assert ops.cpu_allocator_registered()  # it stays in c10's slot, forwarding to c10's allocator


def test_a_release_on_another_thread_is_refused():
    assert ops.hold_cpu_allocator()
    try:
        with ThreadPoolExecutor(1) as pool, pytest.raises(RuntimeError, match="on this thread"):
            pool.submit(ops.release_cpu_allocator).result()
    finally:
        ops.release_cpu_allocator()


def test_tensors_freed_after_or_during_a_hold_go_back_to_their_own_allocator():
    """A block freed after its hold ended, and a c10 block freed during a hold, each go back to the allocator that
    made them (every DataPtr carries its deleter; the raw deleter looks the pointer up)."""
    assert ops.hold_cpu_allocator()
    try:
        t = torch.ones(100)
    finally:
        ops.release_cpu_allocator()
    c10s = torch.ones(100)
    assert ops.hold_cpu_allocator()
    try:
        del c10s
        u = torch.ones(100)
    finally:
        ops.release_cpu_allocator()
    del t
    assert u.sum().item() == 100 and from_block_allocator(u)
