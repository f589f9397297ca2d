"""The deferral state machine of a consumer's scheduler: one `Staging` per item being loaded.

    LOADING --(every worker rank staged it)--> READY --(placed: forgotten)
       |                                         |
       +--(a rank failed, deadline passed)--> FAILED <--(wrong token count, never placed)
    FAILED is answered "encode locally" for `failed_memory_s`, then forgotten (a later
    request may try again). Each staging counts the requests waiting for it; a READY copy
    nobody waits for any more (its requests got the item from vLLM's own encoder cache,
    finished or were aborted) is dropped at the end of the step (`unwanted`), and any READY
    item never placed is dropped after `ready_ttl_s` at the latest.

Pure logic over plain values (times are passed in): no vLLM, no sockets, no transports.
The table is shared by two threads (the scheduler's and the control channel's), so every
change of state goes through its lock and `Staging.move`, which checks `TRANSITIONS`.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field


class Status(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"


TRANSITIONS: dict[Status, frozenset[Status]] = {
    Status.LOADING: frozenset({Status.READY, Status.FAILED}),
    Status.READY: frozenset({Status.FAILED}),  # token count mismatch found at schedule time
    Status.FAILED: frozenset(),
}


DEADLINE_PASSED = "deadline passed"


class IllegalTransition(RuntimeError):
    pass


@dataclass
class Staging:
    """One item on its way into the workers' staging memory. `deadline`: while LOADING, when
    to give up; once FAILED, when it failed (the start of its memory)."""

    status: Status
    started: float
    deadline: float
    ranks_ok: set[int] = field(default_factory=set)
    num_embeds: int = 0
    error: str = ""
    ready_at: float = 0.0  # when it became READY (latency of the staged -> scheduled stage)
    waiters: set[str] = field(default_factory=set)  # requests deferred on this item

    def move(self, to: Status, now: float, why: str = "") -> None:
        if to not in TRANSITIONS[self.status]:
            raise IllegalTransition(f"{self.status.value} -> {to.value}")
        self.status = to
        if to is Status.FAILED:
            self.error, self.deadline = why, now
        elif to is Status.READY:
            self.ready_at = now


class StagingTable:
    """Item id -> Staging for one scheduler. Methods that change state take the lock."""

    def __init__(self, failed_memory_s: float, ready_ttl_s: float) -> None:
        self.failed_memory_s = failed_memory_s
        self.ready_ttl_s = ready_ttl_s
        self.lock = threading.Lock()
        self._items: dict[str, Staging] = {}

    def get(self, item_id: str) -> Staging | None:
        return self._items.get(item_id)

    def __len__(self) -> int:
        return len(self._items)

    def current(self, item_id: str, now: float) -> Staging | None:
        """The item's staging, or None when there is none or its failure is old enough to
        forget (so the caller may start a new attempt)."""
        st = self._items.get(item_id)
        if st is not None and st.status is Status.FAILED and now - st.deadline > \
                self.failed_memory_s:
            with self.lock:
                if self._items.get(item_id) is st:
                    del self._items[item_id]
            return None
        return st

    def begin(self, item_id: str, now: float, timeout_s: float, have_workers: bool) -> Staging:
        """A new LOADING attempt (FAILED at once without workers to load it)."""
        st = Staging(Status.LOADING, now, now + timeout_s)
        if not have_workers:
            st.move(Status.FAILED, now, "no worker connected")
        with self.lock:
            self._items[item_id] = st
        return st

    def staged(self, item_id: str, rank: int, ok: bool, num_embeds: int, error: str,
               ranks: set[int], now: float) -> Status | None:
        """A worker's report. Returns the new status when it changed (READY once every rank
        in `ranks` staged it, FAILED at the first failure), else None."""
        with self.lock:
            st = self._items.get(item_id)
            if st is None or st.status is not Status.LOADING:
                return None
            if not ok:
                st.move(Status.FAILED, now, error)
                return Status.FAILED
            st.ranks_ok.add(rank)
            st.num_embeds = num_embeds
            if st.ranks_ok >= ranks:
                st.move(Status.READY, now)
                return Status.READY
            return None

    def fail(self, st: Staging, why: str, now: float) -> bool:
        """Mark `st` FAILED unless it already is; True if this call failed it."""
        with self.lock:
            if st.status is Status.FAILED:
                return False
            st.move(Status.FAILED, now, why)
            return True

    def expire(self, st: Staging, now: float) -> bool:
        """A LOADING item past its deadline fails; True if this call failed it."""
        if st.status is not Status.LOADING or now <= st.deadline:
            return False
        with self.lock:
            if st.status is not Status.LOADING:
                return False
            st.move(Status.FAILED, now, DEADLINE_PASSED)
            return True

    def forget(self, item_id: str) -> None:
        with self.lock:
            self._items.pop(item_id, None)

    def want(self, item_id: str, req_id: str) -> None:
        """`req_id` waits for the item (it is deferred until the item is READY)."""
        with self.lock:
            st = self._items.get(item_id)
            if st is not None:
                st.waiters.add(req_id)

    def release(self, item_id: str, req_id: str) -> bool:
        """`req_id` no longer needs the item. True when that leaves a live staging (LOADING
        or READY) nobody waits for: the caller passes it to `unwanted` at the end of the step."""
        with self.lock:
            st = self._items.get(item_id)
            if st is None or req_id not in st.waiters:
                return False
            st.waiters.discard(req_id)
            return not st.waiters and st.status is not Status.FAILED

    def unwanted(self, candidates: set[str], placed: set[str] | dict[str, int]) -> list[str]:
        """Forget the READY candidates nobody waits for and that were not placed this step
        (returned: their staged copies must be dropped on the workers). Candidates still
        LOADING stay in `candidates` until they land or fail; the rest leave it."""
        dropped: list[str] = []
        with self.lock:
            for item_id in list(candidates):
                st = self._items.get(item_id)
                if st is not None and st.status is Status.LOADING and not st.waiters:
                    continue
                candidates.discard(item_id)
                if (st is not None and st.status is Status.READY and not st.waiters
                        and item_id not in placed):
                    del self._items[item_id]
                    dropped.append(item_id)
        return dropped

    def sweep(self, now: float) -> list[str]:
        """Forget READY items nobody placed within `ready_ttl_s` (returned: their staged
        memory must be dropped on the workers) and FAILED ones past their memory."""
        stale: list[str] = []
        with self.lock:
            for item_id, st in list(self._items.items()):
                if st.status is Status.READY and now - st.started > self.ready_ttl_s:
                    stale.append(item_id)
                    del self._items[item_id]
                elif st.status is Status.FAILED and now - st.deadline > self.failed_memory_s:
                    del self._items[item_id]
        return stale
