"""The consumer scheduler's budget and gauges over its items (`scheduler_hooks.item_table`).

The item table holds every item's state, bytes, deadline and waiters; `EPDSchedulerSide`
moves items there, one call per signal (a worker's Staged, vLLM's alloc, free, eviction, a
request's end, the end of a step). This book adds what the table leaves to its user:
  the budget   `reserve` starts a load (LOADING) only if its bytes fit `max_staged_bytes`
               (LOADING + STAGED, what the connector holds; else the item waits); an unknown
               size is estimated from the bytes per embedding seen so far (`staged`)
  the gauges   bytes per state (`feature_bytes`), published when they changed, at most once
               per stats take (`flush`, run by the StatsRecorder before vLLM takes the stats
               or asks whether any are pending): never on every move
  the errors   a move the table refuses is a bug: logged and counted (`lifecycle_errors`),
               the item dropped from the books; it never fails a request
Thread-safe (the table's lock: the scheduler's thread, the control channel's, the inline
reader's).
"""

from __future__ import annotations

from ec_connectors.log import get_logger
from ec_connectors.stats import StatsRecorder
from scheduler_hooks.item_table import Item, ItemState, ItemTable

logger = get_logger(__name__)


class StagingBudget:
    def __init__(self, items: ItemTable, budget: int, stats: StatsRecorder) -> None:
        self.items = items
        self.budget = budget
        self.stats = stats
        self._per_embed = 0  # bytes per embedding seen (sizes unknown before a load)
        self._published = items.version
        items.on_illegal = self._illegal
        stats.on_take(self.flush)

    def reserve(self, item_id: str, nbytes: int, num_embeds: int, now: float,
                timeout_s: float, have_workers: bool = True) -> Item | None:
        """Start a load of an item if the staging budget has room for it.

        Start a load of the item (LOADING, `timeout_s` to land), reserving its bytes
        (`nbytes`, else estimated from its embeddings); None when the budget has no room."""
        need = nbytes or num_embeds * self._per_embed
        return self.items.begin(item_id, now, timeout_s, need, have_workers, self.budget)

    def staged(self, item_id: str, rank: int, ok: bool, num_embeds: int, error: str,
               ranks: set[int], now: float, nbytes: int = 0) -> ItemState | None:
        """A rank's report (`ItemTable.staged`); a STAGED item teaches the size per embedding."""
        state = self.items.staged(item_id, rank, ok, num_embeds, error, ranks, now, nbytes)
        if state is ItemState.STAGED and nbytes and num_embeds:
            self._per_embed = max(self._per_embed, -(-nbytes // num_embeds))
        return state

    def flush(self) -> None:
        """Publish the bytes per state if they changed since the last time (O(states))."""
        with self.items.lock:
            version = self.items.version
            if version == self._published:
                return
            self._published = version
            values = self.items.by_state()
        self.stats.gauge("feature_bytes", values)

    def _illegal(self, why: str) -> None:
        self.stats.inc("lifecycle_errors")
        logger.error("EPD: item table: %s (dropped from the books)", why)
