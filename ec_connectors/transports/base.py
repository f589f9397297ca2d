"""The transport interface.

Transports own only transport mechanics: where bytes go and how they come back. Readiness,
deadlines, retries and lifecycle live above them (worker.py, scheduler_hooks/)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import xxhash

from ec_connectors.protocol.stored import ItemInfo

if TYPE_CHECKING:  # torch is imported where tensors are touched: catalogs stay torch-free
    import torch


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """Zero-copy byte view of a contiguous CPU tensor (any dtype, bf16 included)."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def host_copy(tensor: torch.Tensor, pinned: bool = True) -> torch.Tensor:
    """A host copy of a device tensor (a CPU tensor is returned as it is).

    `pinned`: into page-locked memory from torch's caching host allocator, so the device copies
    by DMA at full link speed with no fresh allocation per item; a pageable destination makes
    the driver stage every byte through its own bounce buffer (docs/transports.md, GPU)."""
    import torch

    tensor = tensor.detach()
    if tensor.device.type == "cpu":
        return tensor
    if not pinned:
        return tensor.to("cpu")
    try:
        out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    except RuntimeError:  # an accelerator torch cannot pin host memory for
        return tensor.to("cpu")
    out.copy_(tensor)  # synchronous: the bytes are on the host when this returns
    return out


def checksum(data: memoryview | bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def describe(info: ItemInfo) -> tuple[torch.dtype, tuple[int, ...]]:
    """dtype and shape of an item, checked against its byte size (untrusted metadata)."""
    import torch

    dtype = dtype_from_name(info.dtype)
    shape = tuple(int(d) for d in info.shape)
    numel = 1
    for d in shape:
        if d < 0:
            raise ValueError(f"negative dimension in {shape}")
        numel *= d
    if numel * torch.empty((), dtype=dtype).element_size() != info.nbytes:
        raise ValueError(f"shape {shape} of {info.dtype} is not {info.nbytes} bytes")
    return dtype, shape


class Want(NamedTuple):
    """One item a load asks for: its id, and where it lives / its size when known."""

    item_id: str
    location: str = ""
    nbytes: int = 0


@dataclass(frozen=True)
class Placement:
    """Where a transport instance lives: process, roles and worker.

    Where a transport instance lives: vLLM's scheduler process or a worker, which roles
    the connector plays, and which worker it is (peer-to-peer transports derive ports)."""

    role: str = "worker"  # "scheduler" | "worker"
    is_producer: bool = True
    is_consumer: bool = True
    dp_rank: int = 0
    rank: int = 0
    world_size: int = 1  # workers of one engine (tp * pp)


@dataclass
class TransportEvents:
    """Counters a transport bumps for the connector's stats.

    Counters a transport bumps; the worker folds them into connector stats (the field
    names that are also connector counters, see stats.COUNTERS)."""

    evictions: int = 0
    evicted_bytes: int = 0
    corrupt: int = 0
    missing: int = 0
    pull_timeouts: int = 0
    peer_disconnects: int = 0
    transport_down: int = 0
    held_in_place: int = 0
    errors: list[str] = field(default_factory=list)

    def counters(self) -> dict[str, int]:
        return {k: v for k, v in vars(self).items() if isinstance(v, int)}


class KeyWatch(Protocol):
    """Changes to a transport's keys as they happen (ec_connectors/sched/index.py)."""

    def read(self, timeout_s: float) -> tuple[list[str], list[str], bool]:
        """(keys added, keys removed, lost track: rescan), waiting at most `timeout_s`."""
        ...

    def wake(self) -> None:
        """Make a read blocked in another thread return at once, with nothing."""
        ...

    def close(self) -> None: ...


class Transport(ABC):
    """Moves whole embeddings keyed by item id. Blocking calls: run them off the hot path."""

    name: str = "base"
    # Where per-tier counters and latencies go (the worker's StatsRecorder: inc/observe).
    stats_sink: Any = None
    # True when get_many moves several items in one call (workers then hand one request's
    # items over together; otherwise each item gets its own loader thread, in parallel).
    batches_loads: bool = False
    # get_small works in vLLM's scheduler process (a read of shared storage: no worker
    # memory, no peer): a consumer reads small items there and hands them to its workers
    # inline, in the step's connector metadata (no deferral, no worker round trip).
    reads_in_scheduler: bool = False
    # put of a small item returns in about a file write (no network, no peer): a producer
    # writes such items on the model runner's thread instead of handing them to its writer.
    writes_fast: bool = False
    # a producer's save reaches this process's `locate` at once (announcements), so a
    # consumer can wait for a pending item there instead of asking its workers to poll
    announces: bool = False

    def __init__(self) -> None:
        self.events = TransportEvents()
        # set by the scheduler side: called (on any thread) when items became visible here,
        # so a scheduler idling on deferred requests wakes at once
        self.on_news: Callable[[], None] | None = None

    @abstractmethod
    def put(self, item_id: str, tensor: torch.Tensor) -> ItemInfo:
        """Store `tensor` (CPU, contiguous) under `item_id`; readers never see a partial item."""

    @abstractmethod
    def get(self, item_id: str, deadline: float, location: str = "",
            nbytes: int = 0, *, wait: bool = True) -> torch.Tensor | None:
        """The verified item, waiting for it until `deadline` (time.monotonic()); None = miss.

        `location`/`nbytes`: where it lives and its size, when known (peer transports).
        `wait=False`: an item not stored right now is a miss at once (tiered lookups ask every
        tier before waiting on any); a transfer under way still has until `deadline`."""

    def get_many(self, wants: list[Want], deadline: float, *, wait: bool = True
                 ) -> list[torch.Tensor | None]:
        """Several items at once (one request's), in order; None = that item missed.

        Transports with a batch call override this; the default asks one by one."""
        return [self.get(w.item_id, deadline, w.location, w.nbytes, wait=wait) for w in wants]

    def get_small(self, item_id: str, max_bytes: int) -> torch.Tensor | None:
        """Read a small stored item now, without waiting; None otherwise.

        The verified item, if it is stored now and holds at most `max_bytes`, without
        waiting; None otherwise (missing, larger, damaged: the caller then loads it through
        the workers, which wait, count and report). Only where `reads_in_scheduler`."""
        return None

    @abstractmethod
    def exists(self, item_id: str) -> bool:
        """Whether the item is stored now (may touch the medium: not for hot paths)."""

    @abstractmethod
    def list_keys(self) -> Iterable[str]:
        """Keys of the stored items (`protocol.keys.item_key`), for the availability index."""

    @abstractmethod
    def delete(self, item_id: str) -> bool:
        """Remove an item; True when something was removed."""

    def watch_keys(self) -> KeyWatch | None:
        """Key changes as they happen, or None (then `list_keys` is polled)."""
        return None

    def probe(self, item_id: str) -> bool | None:
        """Check, without blocking, whether an unlisted item is stored.

        Scheduler hot path, never blocks: is the item stored where `list_keys` cannot see
        (a store without listing)? True/False, or None while an asynchronous check is under
        way (the caller defers and asks again next step). Default: False."""
        return False

    @property
    def available(self) -> bool:
        """False while the medium is known to be down (tiered lookups skip it)."""
        return True

    def locate(self, key: str) -> tuple[str, int] | None:
        """Where a stored item lives and its size, from memory.

        Scheduler process: (location, nbytes) of a stored item, from memory; None if
        unknown or if the transport needs no location."""
        return None

    @property
    def endpoint(self) -> str:
        """Where peers reach this instance ("" for transports without peers)."""
        return ""

    def renew(self, item_id: str) -> None:
        """A consumer is being promised this stored item again: keep it (no-op by default)."""
        return None

    def expect(self, item_id: str) -> None:
        """Producer: note that an item's save is queued.

        Producer: the item's save is queued (a `put` or a `save_failed` follows), so a
        peer asking for it now is told to wait rather than that it is unknown. No-op by
        default (transports whose readers wait for an item to appear)."""
        return None

    def save_failed(self, item_id: str, reason: str) -> None:
        """Tell waiting consumers that the producer could not store an item.

        The producer could not store `item_id`: tell consumers waiting for it, where the
        transport can, so they stop waiting (local encode) instead of running out their
        deadline. No-op by default."""
        return None

    def reap(self) -> None:
        """Periodic housekeeping (worker loader threads call it); no-op by default."""
        return None

    def health(self) -> dict[str, object]:
        return {"transport": self.name, "ok": True}

    def close(self) -> None:
        return None
