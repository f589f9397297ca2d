"""The consumer scheduler's inline reader for small items.

The consumer scheduler's inline reader: a small item (at most `inline_max_bytes`, where the
transport reads in the scheduler process) is read and verified here, on one thread, and is
STAGED the step it is asked for, usually: no Prefetch round trip to the workers, no deferral.
Its bytes are held until the step that places it hands them to the workers in the step's
metadata (`take`). A miss (not written yet, larger, damaged, a transport error) goes to the
workers' path (`on_miss`), which waits for the item until its deadline and counts failures."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

from ec_connectors.control.messages import InlineItem
from ec_connectors.log import get_logger
from ec_connectors.protocol.params import Source
from ec_connectors.sched.staging_budget import StagingBudget
from ec_connectors.stats import StatsRecorder
from ec_connectors.transports.base import Transport, dtype_name, tensor_bytes
from scheduler_hooks.item_table import ItemState

logger = get_logger(__name__)

INLINE_RANK = -1  # the "rank" that stages inline items: the scheduler side itself
# A scheduler step waits this long for a small item's read before deferring the request
# (the read goes on; the item is STAGED a step later). A local read takes far less.
_WAIT_S = 0.005
_HELD_MAX = 64 << 20  # bytes read and not yet placed; beyond, new items go to the workers


class InlineReader:
    def __init__(self, transport: Transport, budget: StagingBudget, stats: StatsRecorder,
                 max_bytes: int, *, on_miss: Callable[[str, Source], None],
                 on_ready: Callable[[], None]) -> None:
        self.transport, self.budget, self.stats = transport, budget, stats
        self.max_bytes = max_bytes
        self._on_miss, self._on_ready = on_miss, on_ready
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="epd-inline")
        self._lock = threading.Lock()
        self._held: dict[str, InlineItem] = {}  # read, STAGED, not yet placed
        self.held_bytes = 0

    def __len__(self) -> int:
        return len(self._held)

    def takes(self, nbytes: int) -> bool:
        """Whether an item of `nbytes` (0: unknown) is read here rather than by the workers."""
        return nbytes <= self.max_bytes and self.held_bytes < _HELD_MAX

    def read(self, item_id: str, source: Source, started: float) -> None:
        """Read an item whose load has begun (LOADING), waiting a moment for it."""
        wait_futures([self._pool.submit(self._read, item_id, source, started)],
                     timeout=_WAIT_S)

    def _read(self, item_id: str, source: Source, started: float) -> None:
        """Reader thread: the verified item becomes STAGED, its bytes held until placed."""
        try:
            tensor = self.transport.get_small(item_id, self.max_bytes)
        except Exception:  # a transport bug costs the fast path, not the item
            logger.exception("EPD: inline read of item %r failed; the workers load it", item_id)
            tensor = None
        if tensor is None:
            self._on_miss(item_id, source)
            return
        item: InlineItem = (tensor_bytes(tensor).tobytes(), dtype_name(tensor.dtype),
                            tuple(tensor.shape))
        with self._lock:
            self._held[item_id] = item
            self.held_bytes += len(item[0])
        now = time.monotonic()
        rows = int(tensor.shape[0]) if tensor.dim() else 1
        if self.budget.staged(item_id, INLINE_RANK, True, rows, "", {INLINE_RANK}, now,
                            nbytes=len(item[0])) is ItemState.STAGED:
            self.stats.observe("load_s", now - started)
            self.stats.inc("inline_loads")
            self._on_ready()
        else:  # forgotten or failed meanwhile
            self.take(item_id)

    def take(self, item_id: str) -> InlineItem | None:
        """The item's bytes, no longer held here (None if it is not held)."""
        if not self._held:  # the usual case: no lock taken
            return None
        with self._lock:
            item = self._held.pop(item_id, None)
            if item is not None:
                self.held_bytes -= len(item[0])
        return item

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
