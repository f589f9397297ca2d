"""Non-blocking availability index: which item keys the transport holds.

Lookups are a dict/set membership test: no filesystem stat, no network round trip on the
scheduler's hot path. A background thread refreshes the view from the transport's listing;
events (our own saves, producer announcements) add keys immediately.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

# Under vLLM's logger (as ec_connectors/log.py does), so messages show in vLLM's log stream.
logger = logging.getLogger(f"vllm.epd.{__name__}")

_EVENT_GRACE_S = 5.0  # keep an announced key this long even if a scan has not seen it yet


class AvailabilityIndex:
    def __init__(self, list_keys: Callable[[], Iterable[str]], interval_s: float,
                 start: bool = True) -> None:
        self._list_keys = list_keys
        self._interval_s = interval_s
        self._scanned: frozenset[str] = frozenset()
        self._announced: dict[str, float] = {}
        self._stop = threading.Event()
        self.scans = 0
        self._thread: threading.Thread | None = None
        if start:
            self.refresh()
            self._thread = threading.Thread(target=self._loop, name="epd-index", daemon=True)
            self._thread.start()

    def __contains__(self, key: object) -> bool:
        return key in self._scanned or key in self._announced

    def __len__(self) -> int:
        return len(self._scanned | self._announced.keys())

    def add(self, key: str) -> None:
        self._announced[key] = time.monotonic()

    def discard(self, key: str) -> None:
        self._announced.pop(key, None)
        if key in self._scanned:
            self._scanned = self._scanned - {key}

    def refresh(self) -> None:
        """One scan, swapped in atomically (readers never see a half-built set)."""
        keys = frozenset(self._list_keys())
        self._scanned = keys
        cutoff = time.monotonic() - _EVENT_GRACE_S
        for key, ts in list(self._announced.items()):
            if key in keys or ts < cutoff:
                self._announced.pop(key, None)
        self.scans += 1

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.refresh()
            except Exception:
                logger.exception("EPD: availability index refresh failed")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
