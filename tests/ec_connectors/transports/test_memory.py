"""The registered pool's allocator and buffer views (no transfer engine needed)."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ec_connectors.transports.memory import Allocator, MemoryPool, PoolCorruption, PoolExhausted


def test_alignment_and_first_fit():
    a = Allocator(1 << 20, alignment=4096)
    x = a.alloc(1)
    y = a.alloc(4097)
    assert (x, y) == (0, 4096)
    assert a.block_size(y) == 8192
    assert a.used_bytes == 4096 + 8192
    a.free(x)
    assert a.alloc(100) == 0  # first fit reuses the hole
    a.check()


def test_neighbours_merge_back_into_one_block():
    a = Allocator(16 * 4096, alignment=4096)
    blocks = [a.alloc(4096) for _ in range(16)]
    assert a.alloc(1) is None
    for off in blocks[::2] + blocks[1::2]:  # free out of order: left, right and both merges
        a.free(off)
    assert a.free_blocks == [(0, 16 * 4096)]
    assert a.used_bytes == 0


def test_double_free_and_unknown_free_are_detected():
    a = Allocator(8 * 4096)
    off = a.alloc(4096)
    a.free(off)
    with pytest.raises(PoolCorruption, match="double free"):
        a.free(off)
    with pytest.raises(PoolCorruption, match="never allocated"):
        a.free(12345 * 4096)


def test_overlap_is_detected():
    a = Allocator(8 * 4096)
    off = a.alloc(2 * 4096)
    # Corrupt the bookkeeping as a buggy caller would (a block that also sits on the free
    # list): the free must refuse instead of handing the same bytes out twice.
    a._free_starts.insert(0, off + 4096)
    a._free_sizes[off + 4096] = 4096
    with pytest.raises(PoolCorruption, match="overlaps"):
        a.free(off)


def test_bad_sizes():
    with pytest.raises(ValueError):
        Allocator(1 << 20, alignment=3000)
    with pytest.raises(ValueError):
        Allocator(1 << 20).alloc(0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40_000)), max_size=120),
       st.randoms(use_true_random=False))
def test_random_alloc_free_keeps_blocks_tiled(ops, rnd):
    a = Allocator(64 * 4096, alignment=256)
    live: dict[int, int] = {}
    for do_alloc, size in ops:
        if do_alloc or not live:
            off = a.alloc(size)
            if off is not None:
                for o, s in live.items():  # never overlaps a live block
                    assert off + size <= o or o + s <= off
                live[off] = size
        else:
            off = rnd.choice(sorted(live))
            a.free(off)
            del live[off]
        a.check()
    for off in list(live):
        a.free(off)
    assert a.free_blocks == [(0, a.capacity)]


def test_buffer_views_are_zero_copy_and_release_once():
    pool = MemoryPool(1 << 20, alignment=4096)
    buf = pool.allocate(3 * 5 * 2, deadline=time.monotonic() + 1)
    t = torch.arange(15, dtype=torch.bfloat16).reshape(3, 5)
    buf.write(t)
    view = buf.as_tensor(torch.bfloat16, (3, 5))
    assert torch.equal(view, t)
    assert view.data_ptr() == pool.base_addr + buf.offset
    assert bytes(buf.as_bytes()) == bytes(t.view(torch.uint8).reshape(-1).numpy())
    pool.storage[buf.offset] = 0  # writes through the pool show in the view
    assert view.view(torch.uint8).reshape(-1)[0] == 0
    buf.release()
    assert pool.used_bytes == 0
    with pytest.raises(PoolCorruption):
        buf.release()
    with pytest.raises(PoolCorruption):
        buf.as_tensor(torch.uint8, (1,))


def test_allocate_waits_for_a_free_then_times_out():
    pool = MemoryPool(4 * 4096, alignment=4096)
    held = pool.allocate(4 * 4096, deadline=time.monotonic() + 1)
    threading.Timer(0.1, held.release).start()
    t0 = time.monotonic()
    again = pool.allocate(4096, deadline=time.monotonic() + 5)
    assert 0.05 < time.monotonic() - t0 < 2
    with pytest.raises(PoolExhausted, match="in use"):
        pool.allocate(4 * 4096, deadline=time.monotonic() + 0.1)
    with pytest.raises(PoolExhausted, match="exceed the whole pool"):
        pool.allocate(1 << 30, deadline=time.monotonic() + 5)
    again.release()


def test_concurrent_alloc_free_stays_consistent():
    pool = MemoryPool(1 << 20, alignment=256)
    errors: list[BaseException] = []

    def churn(seed: int) -> None:
        rnd = random.Random(seed)
        try:
            for _ in range(300):
                b = pool.allocate(rnd.randint(8, 20_000), deadline=time.monotonic() + 5)
                b.write(torch.full((8,), seed, dtype=torch.uint8))
                assert int(b.as_tensor(torch.uint8, (8,))[0]) == seed
                b.release()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert pool.used_bytes == 0
    pool.allocator.check()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pool_views_stay_on_the_device():
    pool = MemoryPool(8 << 20, device="cuda")
    assert pool.storage.is_cuda
    buf = pool.allocate(4096 * 2, deadline=time.monotonic() + 1)
    src = torch.randn(4096, dtype=torch.float32).to(torch.bfloat16)
    buf.write(src)  # host -> device, one copy
    view = buf.as_tensor(torch.bfloat16, (64, 64))
    assert view.is_cuda and view.data_ptr() == pool.base_addr + buf.offset
    assert torch.equal(view.cpu().reshape(-1), src)
    with pytest.raises(TypeError):
        buf.as_bytes()
    with pytest.raises(TypeError):
        buf.hand_over(torch.bfloat16, (64, 64))
    buf.release()
    assert pool.used_bytes == 0


def test_host_copy_keeps_cpu_tensors_and_copies_device_ones_exactly():
    from ec_connectors.transports.base import host_copy

    cpu = torch.arange(12, dtype=torch.bfloat16).view(3, 4)
    assert host_copy(cpu).data_ptr() == cpu.data_ptr()  # already on the host: no copy
    if not torch.cuda.is_available():
        pytest.skip("the device branch needs CUDA (benchmarks/transports/gpu_path.py runs it)")
    dev = torch.randn(300, 4096, device="cuda").to(torch.bfloat16)
    for pinned in (True, False):
        out = host_copy(dev, pinned=pinned)
        assert out.device.type == "cpu" and out.is_pinned() == pinned
        assert out.dtype == dev.dtype and out.shape == dev.shape
        assert torch.equal(out, dev.cpu())
        dev.add_(1)  # the device tensor is reused by vLLM: the copy must not follow it
        assert not torch.equal(out, dev.cpu())
