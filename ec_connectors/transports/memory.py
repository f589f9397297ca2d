"""A registered memory pool that transfers read from and write into.

A registered memory pool: one buffer per process, registered with the transfer engine once,
carved up by an allocator. Transfers read from and write into pool memory directly.

- `Allocator`: offsets only (no memory). Aligned first-fit over a free list kept sorted by
  offset; a freed block merges with its free neighbours. A double free, a free of an offset
  that was never handed out, and any overlap between free and allocated ranges raise
  `PoolCorruption` instead of silently corrupting data.
- `MemoryPool`: the backing tensor (CPU, pinned when CUDA is present, or CUDA for GPUDirect)
  plus the allocator, and a blocking `allocate(nbytes, deadline)` for backpressure.
- `PoolBuffer`: a zero-copy view of one block: `as_tensor(dtype, shape)`, `as_bytes()`,
  `release()` (exactly once).
"""

from __future__ import annotations

import bisect
import ctypes
import threading
import time
from collections.abc import Callable

import torch

DEFAULT_ALIGNMENT = 4096  # page size: good for RDMA registration and for memcpy


class PoolCorruption(RuntimeError):
    """The allocator was asked to do something that would corrupt memory (double free...)."""


class PoolExhausted(MemoryError):
    """No block of the requested size became free before the deadline."""


def _align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def typed_view(raw: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...] | list[int],
               offset: int = 0) -> torch.Tensor:
    """Bytes of a flat uint8 tensor from `offset` as `dtype` and `shape` (no copy, checked)."""
    shape = tuple(int(d) for d in shape)
    need = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if offset < 0 or offset + need > raw.numel():
        raise ValueError(f"{shape} of {dtype} at offset {offset} needs {offset + need} "
                         f"bytes; the buffer has {raw.numel()}")
    return raw[offset:offset + need].view(dtype).view(shape)


class Allocator:
    """Aligned first-fit allocator over [0, capacity). Not thread-safe: MemoryPool locks."""

    def __init__(self, capacity: int, alignment: int = DEFAULT_ALIGNMENT) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        if capacity < alignment:
            raise ValueError(f"capacity {capacity} is smaller than the alignment {alignment}")
        self.alignment = alignment
        self.capacity = capacity // alignment * alignment
        self._free_starts: list[int] = [0]  # sorted
        self._free_sizes: dict[int, int] = {0: self.capacity}
        self._used: dict[int, int] = {}  # offset -> size
        self.used_bytes = 0

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a new block of at least `nbytes` (aligned), or None when nothing fits."""
        if nbytes <= 0:
            raise ValueError(f"allocation size must be positive, got {nbytes}")
        size = _align_up(nbytes, self.alignment)
        for i, start in enumerate(self._free_starts):
            free = self._free_sizes[start]
            if free < size:
                continue
            del self._free_sizes[start]
            if free == size:
                del self._free_starts[i]
            else:
                self._free_starts[i] = start + size
                self._free_sizes[start + size] = free - size
            self._used[start] = size
            self.used_bytes += size
            return start
        return None

    def free(self, offset: int) -> None:
        size = self._used.pop(offset, None)
        if size is None:
            if self._covering_free(offset) is not None:
                raise PoolCorruption(f"double free of offset {offset}")
            raise PoolCorruption(f"free of offset {offset}, which was never allocated")
        self.used_bytes -= size
        i = bisect.bisect_left(self._free_starts, offset)
        # Overlap checks: a free block must not reach into this one, nor this one into it.
        if i > 0:
            prev = self._free_starts[i - 1]
            if prev + self._free_sizes[prev] > offset:
                raise PoolCorruption(f"block {offset}+{size} overlaps free block {prev}")
        if i < len(self._free_starts) and offset + size > self._free_starts[i]:
            raise PoolCorruption(f"block {offset}+{size} overlaps free block "
                                 f"{self._free_starts[i]}")
        start, length = offset, size
        if i < len(self._free_starts) and self._free_starts[i] == offset + size:  # merge right
            nxt = self._free_starts.pop(i)
            length += self._free_sizes.pop(nxt)
        if i > 0:  # merge left
            prev = self._free_starts[i - 1]
            if prev + self._free_sizes[prev] == offset:
                start = prev
                length += self._free_sizes.pop(prev)
                self._free_starts.pop(i - 1)
                i -= 1
        self._free_starts.insert(i, start)
        self._free_sizes[start] = length

    def _covering_free(self, offset: int) -> int | None:
        i = bisect.bisect_right(self._free_starts, offset) - 1
        if i >= 0:
            start = self._free_starts[i]
            if start + self._free_sizes[start] > offset:
                return start
        return None

    def block_size(self, offset: int) -> int:
        return self._used[offset]

    @property
    def free_blocks(self) -> list[tuple[int, int]]:
        return [(s, self._free_sizes[s]) for s in self._free_starts]

    @property
    def largest_free(self) -> int:
        return max(self._free_sizes.values(), default=0)

    def check(self) -> None:
        """Full consistency check (tests): blocks tile [0, capacity) without overlap."""
        spans = sorted([(s, n, "free") for s, n in self._free_sizes.items()]
                       + [(s, n, "used") for s, n in self._used.items()])
        pos = 0
        for start, size, kind in spans:
            if start != pos:
                raise PoolCorruption(f"{kind} block at {start}, expected {pos}")
            pos = start + size
        if pos != self.capacity:
            raise PoolCorruption(f"blocks end at {pos}, capacity is {self.capacity}")


class PoolBuffer:
    """Zero-copy view of one pool block. `release()` returns it to the pool, once."""

    __slots__ = ("_pool", "offset", "nbytes", "addr", "_released")

    def __init__(self, pool: MemoryPool, offset: int, nbytes: int) -> None:
        self._pool = pool
        self.offset = offset
        self.nbytes = nbytes
        self.addr = pool.base_addr + offset
        self._released = False

    def _raw(self) -> torch.Tensor:
        if self._released:
            raise PoolCorruption(f"use of released buffer at offset {self.offset}")
        return self._pool.storage[self.offset:self.offset + self.nbytes]

    def as_tensor(self, dtype: torch.dtype, shape: tuple[int, ...] | list[int],
                  offset: int = 0) -> torch.Tensor:
        """View the block's bytes as a tensor, without a copy.

        The block's bytes from `offset` as a tensor of `dtype` and `shape` (no copy; valid
        until release)."""
        return typed_view(self._raw(), dtype, shape, offset)

    def as_bytes(self) -> memoryview:
        """The block as a byte view (CPU pools only; no copy; valid until release)."""
        raw = self._raw()
        if raw.device.type != "cpu":
            raise TypeError("as_bytes() needs a CPU pool; use as_tensor() on a device pool")
        return memoryview(raw.numpy()).cast("B")

    def write(self, tensor: torch.Tensor, offset: int = 0) -> None:
        """Copy a tensor's bytes into the block.

        Copy `tensor`'s bytes into the block from `offset` (one copy; device to host
        handled by torch)."""
        src = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        if offset < 0 or offset + src.numel() > self.nbytes:
            raise ValueError(f"{src.numel()} bytes at offset {offset} do not fit a "
                             f"{self.nbytes}-byte buffer")
        self._raw()[offset:offset + src.numel()].copy_(src)

    def hand_over(self, dtype: torch.dtype, shape: tuple[int, ...] | list[int],
                  offset: int = 0) -> torch.Tensor:
        """Hand the block over to a tensor that frees it when gone.

        A tensor that owns this block (CPU pools): no copy; the block goes back to the pool
        when the tensor and every view of it are gone. Do not release() it yourself after."""
        view = self.as_tensor(dtype, shape, offset)
        if view.device.type != "cpu":
            raise TypeError("hand_over() needs a CPU pool; clone() a device view instead")
        raw = (ctypes.c_uint8 * max(1, view.nbytes)).from_address(view.data_ptr())
        raw._epd_owner = _Owner(self)  # dies with the last tensor that shares `raw`
        return torch.frombuffer(raw, dtype=torch.uint8)[:view.nbytes].view(dtype).view(
            view.shape)

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        if self._released:
            raise PoolCorruption(f"buffer at offset {self.offset} released twice")
        self._released = True
        self._pool._free(self.offset)

    def __repr__(self) -> str:
        return f"PoolBuffer(offset={self.offset}, nbytes={self.nbytes})"


class _Owner:
    """Releases a handed-over block when the last tensor sharing it is collected."""

    __slots__ = ("buf",)

    def __init__(self, buf: PoolBuffer) -> None:
        self.buf = buf

    def __del__(self) -> None:
        if not self.buf.released:
            self.buf.release()


def _backing(capacity: int, device: str) -> torch.Tensor:
    if device == "cuda":
        return torch.empty(capacity, dtype=torch.uint8, device="cuda")
    if device != "cpu":
        raise ValueError(f"memory_pool_device must be 'cpu' or 'cuda', got {device!r}")
    # Pinned host memory speeds up host<->GPU copies; without CUDA there is nothing to pin
    # for (RDMA registration pins pages itself).
    return torch.empty(capacity, dtype=torch.uint8, pin_memory=torch.cuda.is_available())


class MemoryPool:
    """One registered buffer and its allocator. Thread-safe."""

    def __init__(self, capacity: int, device: str = "cpu", alignment: int = DEFAULT_ALIGNMENT,
                 register: Callable[[int, int], None] | None = None) -> None:
        self.allocator = Allocator(capacity, alignment)
        self.device = device
        self.storage = _backing(self.allocator.capacity, device)
        self.base_addr = self.storage.data_ptr()
        self.capacity = self.allocator.capacity
        self._cond = threading.Condition()
        self._closed = False
        if register is not None:  # once, for the pool's whole life: never per transfer
            register(self.base_addr, self.capacity)

    def try_allocate(self, nbytes: int) -> PoolBuffer | None:
        with self._cond:
            if self._closed:
                raise PoolExhausted("pool is closed")
            offset = self.allocator.alloc(nbytes)
        return None if offset is None else PoolBuffer(self, offset, nbytes)

    def allocate(self, nbytes: int, deadline: float) -> PoolBuffer:
        """A block of `nbytes`, waiting for frees until `deadline` (time.monotonic())."""
        if _align_up(nbytes, self.allocator.alignment) > self.capacity:
            raise PoolExhausted(f"{nbytes} bytes exceed the whole pool ({self.capacity} bytes)")
        with self._cond:
            while True:
                if self._closed:
                    raise PoolExhausted("pool is closed")
                offset = self.allocator.alloc(nbytes)
                if offset is not None:
                    return PoolBuffer(self, offset, nbytes)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PoolExhausted(
                        f"no {nbytes}-byte block free in time ({self.used_bytes} of "
                        f"{self.capacity} bytes in use, largest free block "
                        f"{self.allocator.largest_free})")
                self._cond.wait(left)

    def _free(self, offset: int) -> None:
        with self._cond:
            self.allocator.free(offset)
            self._cond.notify_all()

    def wait_for_change(self, timeout: float) -> None:
        """Sleep until some block is freed or `timeout` passes (eviction loops)."""
        with self._cond:
            self._cond.wait(timeout)

    def notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    @property
    def used_bytes(self) -> int:
        return self.allocator.used_bytes

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
