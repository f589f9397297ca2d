"""A consumer's view of the gateway's `pending` promises.

A consumer's view of the gateway's `pending` promises: an item the request names as still
being encoded (the gateway sent the request beside the encode) is waited for until its save
reaches this process, for at most `load_timeout_s` from the first look at it. `state` says
where a promise stands (`scheduler_hooks.decisions.Promise`); `went_by` starts its clock or,
once it landed, stops it (`pending_s`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ec_connectors.protocol.params import Source
from ec_connectors.stats import StatsRecorder
from scheduler_hooks.decisions import Promise

if TYPE_CHECKING:
    from ec_connectors.sched.index import AvailabilityIndex
    from ec_connectors.transports.base import Transport


class Promises:
    def __init__(self, index: AvailabilityIndex, transport: Transport, timeout_s: float,
                 stats: StatsRecorder) -> None:
        self.index, self.transport, self.timeout_s, self.stats = (index, transport,
                                                                 timeout_s, stats)
        self._first: dict[str, float] = {}  # item -> first looked at, until it lands

    def __len__(self) -> int:
        return len(self._first)

    def state(self, item_id: str, key: str | None, source: Source | None,
              now: float) -> Promise:
        if key is None or source is None or not source.pending:
            return Promise.NONE
        if self._landed(key):
            return Promise.LANDED
        first = self._first.get(item_id, now)
        return Promise.WAITING if now - first < self.timeout_s else Promise.EXPIRED

    def went_by(self, item_id: str, promise: Promise, now: float) -> None:
        """A plan went by `promise`: start its clock, or stop it (it landed)."""
        if promise is Promise.LANDED:
            first = self._first.pop(item_id, None)
            if first is not None:
                self.stats.observe("pending_s", now - first)
        elif promise is not Promise.NONE:
            self._first.setdefault(item_id, now)

    def _landed(self, key: str) -> bool:
        """Whether a producer's save of `key` has reached this process.

        Where nothing here follows saves (a store that cannot list, a shared directory only
        scanned), True: the workers' load waits for the item instead."""
        if key in self.index:
            return True
        if self.transport.announces:
            return self.transport.locate(key) is not None
        return not self.index.watching

    def sweep(self, now: float) -> None:
        """Forget promises nobody asks about any more (their requests left)."""
        if self._first:
            cutoff = now - 2 * self.timeout_s
            self._first = {k: t for k, t in self._first.items() if t > cutoff}
