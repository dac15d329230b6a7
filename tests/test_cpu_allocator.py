"""attnkit's CPU allocator (csrc/cpu/block_allocator.cpp, attnkit.ops.hold_cpu_allocator): every CPU block a plain
malloc aligned inside it, in c10's place while an instrumented model runs a CPU forward, so that glibc's heap
reuses the holes freed activations leave (docs/decoders.md §7, "Memory: what glibc keeps")."""
from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import attnkit
from attnkit import ops
from attnkit.models import attention_modules
from tests.synthetic import tiny_bert, tiny_decoder

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
    t.resize_(1 << 20)  # the storage grows through the allocator it was made by, after that one was taken out
    t[-1] = 2.0
    assert t[:10].sum().item() == 10 and t[-1].item() == 2.0
    assert from_block_allocator(t)


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


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_a_cpu_forward_of_an_instrumented_model_holds_it_and_gives_it_back(kind):
    model = attnkit.instrument(tiny_bert()[0] if kind == "bert" else tiny_decoder(kind))
    seen = []
    hook = attention_modules(model)[0].register_forward_pre_hook(
        lambda *_: seen.append((ops.cpu_allocator_holders(), from_block_allocator(torch.empty(100)))))
    ids = torch.randint(5, min(100, model.config.vocab_size), (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        out = model(input_ids=ids)[0]
    assert seen == [(1, True)]
    assert ops.cpu_allocator_holders() == 0 and not from_block_allocator(torch.empty(100))
    assert torch.isfinite(out).all()

    hook.remove()

    # an exception inside the forward gives the hold back too
    def fail(*_):
        raise ValueError("stop here")

    hook = attention_modules(model)[0].register_forward_pre_hook(fail)
    with pytest.raises(ValueError, match="stop here"), torch.inference_mode():
        model(input_ids=ids)
    hook.remove()
    assert ops.cpu_allocator_holders() == 0


def test_nested_forwards_hold_it_once_each():
    outer = attnkit.instrument(tiny_decoder("llama"))
    inner = attnkit.instrument(tiny_decoder("llama", seed=1))
    ids = torch.randint(5, 100, (1, 6), generator=torch.Generator().manual_seed(1))
    seen = []

    def run_inner(*_):
        seen.append(ops.cpu_allocator_holders())
        inner(input_ids=ids)
        seen.append(ops.cpu_allocator_holders())

    hook = attention_modules(outer)[0].register_forward_pre_hook(run_inner)
    with torch.inference_mode():
        outer(input_ids=ids)
    hook.remove()
    assert seen == [1, 1]
