"""A producer worker's encoder outputs on the host, waiting to be stored.

A producer worker's encoder outputs on the host, between vLLM handing them over (`save`) and
the transport taking them (`put` returned or failed): the producer's ENCODED_CPU state.

    (vLLM encodes) --save--> ENCODED_CPU --written / failed--> DISCARDED (the transport
                                                               holds the item, or nobody)

Bounded by count (`max_pending_saves`) and bytes (`max_pending_save_bytes`): a 125 MB video
embedding is 8000 times a small image's, so a count alone bounds nothing. `enter` waits for
room at most `timeout_s` (backpressure on vLLM's model runner, which calls `save`), then
refuses: the save fails loudly and consumers encode the item themselves; never an OOM,
never a dropped request. An item larger than the byte budget enters when nothing else is
held (a wait for room always ends). Thread-safe.
"""

from __future__ import annotations

import threading
import time


class SaveQueue:
    def __init__(self, max_items: int, max_bytes: int) -> None:
        self.max_items, self.max_bytes = max_items, max_bytes
        self.items = 0
        self.bytes = 0
        self.peak_bytes = 0
        self._room = threading.Condition()

    def _fits(self, nbytes: int) -> bool:
        return self.items < self.max_items and (
            self.items == 0 or self.bytes + nbytes <= self.max_bytes)

    def enter(self, nbytes: int, timeout_s: float) -> bool:
        """Hold `nbytes` for one item: True, or False when no room came within `timeout_s`."""
        with self._room:
            if not self._room.wait_for(lambda: self._fits(nbytes), timeout=timeout_s):
                return False
            self.items += 1
            self.bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.bytes)
            return True

    def leave(self, nbytes: int) -> None:
        """The item is written or failed: its bytes are the transport's, or freed."""
        with self._room:
            self.items -= 1
            self.bytes -= nbytes
            self._room.notify_all()

    def drain(self, timeout_s: float) -> bool:
        """Wait until nothing is held (tests, shutdown); False at the deadline."""
        deadline = time.monotonic() + timeout_s
        with self._room:
            return self._room.wait_for(lambda: self.items == 0,
                                       timeout=max(0.0, deadline - time.monotonic()))
