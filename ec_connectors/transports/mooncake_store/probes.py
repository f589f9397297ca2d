"""The scheduler's non-blocking check of whether an item is in the store.

The scheduler's non-blocking "is it in the store?": answers from a bounded cache, unknown keys
asked of the master in batches (`batch_is_exist`) by a background thread, so a scheduler step
never waits on the store."""

from __future__ import annotations

import threading
import time

from ec_connectors.transports.mooncake_store.client import (
    RPC_FAILED,
    StoreClient,
    StoreUnavailable,
)
from epd_common.lru import BoundedLRU

_PROBE_BATCH = 256
_PROBE_CACHE = 65536


class ProbeCache:
    """A cache of store lookups, filled in batches by a background thread.

    Non-blocking "is it in the store?" for the scheduler: answers from a cache; unknown keys
    are asked in batches by a background thread. An answer not back within `timeout_s` is
    "no" (the request encodes locally rather than wait on a slow master)."""

    def __init__(self, client: StoreClient, timeout_s: float, ttl_s: float) -> None:
        self.client = client
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        self._answers: BoundedLRU[str, tuple[bool | None, float]] = BoundedLRU(_PROBE_CACHE)
        self._pending: list[str] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="epd-store-probe", daemon=True)
        self._thread.start()

    def probe(self, key: str) -> bool | None:
        now = time.monotonic()
        entry = self._answers.get(key)
        if entry is not None:
            answer, t = entry
            if answer is None:
                if now - t < self.timeout_s:
                    return None
                return False
            if now - t < self.ttl_s:
                return answer
        if not self.client.alive:
            return False
        with self._cond:
            self._answers[key] = (None, now)
            self._pending.append(key)
            self._cond.notify()
        return None

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                keys, self._pending = self._pending[:_PROBE_BATCH], self._pending[_PROBE_BATCH:]
            deadline = time.monotonic() + self.timeout_s
            try:
                rcs = self.client.bounded(lambda k=keys: self.client.store.batch_is_exist(k),
                                           deadline)
            except StoreUnavailable:
                rcs = None
            now = time.monotonic()
            with self._cond:
                for i, key in enumerate(keys):
                    if rcs is None or rcs[i] < 0:
                        self._answers.pop(key, None)  # unknown: ask again next time
                        if rcs is not None and rcs[i] == RPC_FAILED:
                            self.client.set_alive(False, "probe RPC failed")
                    else:
                        self._answers[key] = (rcs[i] == 1, now)

    def forget(self, key: str) -> None:
        self._answers.pop(key, None)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=2)
