"""Non-blocking availability index: which item keys the transport holds.

Lookups are a dict/set membership test: no filesystem stat, no network round trip on the
scheduler's hot path. A background thread keeps the view current: from the transport's
change feed where it has one (inotify on a local directory: a new file is known at once, and
nothing is listed again but on lost track or every _FULL_SCAN_S), else by listing it every
`interval_s`. Events (our own saves, producer announcements) add keys immediately.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from ec_connectors.log import get_logger

if TYPE_CHECKING:
    from ec_connectors.transports.base import KeyWatch

logger = get_logger(__name__)

_EVENT_GRACE_S = 5.0  # keep an announced key this long even if a scan has not seen it yet
_FULL_SCAN_S = 60.0  # with a change feed: a full listing this often anyway (belt and braces)


class AvailabilityIndex:
    def __init__(self, list_keys: Callable[[], Iterable[str]], interval_s: float,
                 start: bool = True, watch: Callable[[], KeyWatch | None] | None = None,
                 on_change: Callable[[], None] | None = None) -> None:
        self._list_keys = list_keys
        self._on_change = on_change  # called on the index thread when keys were added
        self._interval_s = interval_s
        self._scanned: set[str] = set()
        self._announced: dict[str, float] = {}
        self._stop = threading.Event()
        self.scans = 0
        self._thread: threading.Thread | None = None
        self._watch: KeyWatch | None = None
        if start:
            self._watch = watch() if watch is not None else None  # before the scan: no gap
            self.refresh()
            self._thread = threading.Thread(target=self._loop, name="epd-index", daemon=True)
            self._thread.start()

    def __contains__(self, key: object) -> bool:
        return key in self._scanned or key in self._announced

    def __len__(self) -> int:
        return len(self._scanned | self._announced.keys())

    def add(self, key: str) -> None:
        self._announced[key] = time.monotonic()

    @property
    def watching(self) -> bool:
        return self._watch is not None

    def discard(self, key: str) -> None:
        self._announced.pop(key, None)
        self._scanned.discard(key)

    def refresh(self) -> None:
        """One scan, swapped in atomically (readers never see a half-built set)."""
        keys = set(self._list_keys())
        self._scanned = keys
        cutoff = time.monotonic() - _EVENT_GRACE_S
        for key, ts in list(self._announced.items()):
            if key in keys or ts < cutoff:
                self._announced.pop(key, None)
        self.scans += 1

    def _loop(self) -> None:
        if self._watch is not None:
            self._follow(self._watch)
        while not self._stop.wait(self._interval_s):
            try:
                self.refresh()
            except Exception:
                logger.exception("EPD: availability index refresh failed")

    def _follow(self, watch: KeyWatch) -> None:
        """Apply the change feed; list again when it lost track and every _FULL_SCAN_S.

        Returns (to scanning) only if the feed breaks."""
        last_scan = time.monotonic()
        while not self._stop.is_set():
            try:
                added, removed, lost = watch.read(timeout_s=0.5)
                keys = self._scanned
                keys.update(added)
                keys.difference_update(removed)
                if added and self._on_change is not None:
                    self._on_change()
                if lost or time.monotonic() - last_scan > _FULL_SCAN_S:
                    self.refresh()
                    last_scan = time.monotonic()
            except Exception:
                logger.exception("EPD: availability index change feed failed; scanning every "
                                 "%.2f s instead", self._interval_s)
                return

    def close(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.wake()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._watch is not None:
            self._watch.close()
