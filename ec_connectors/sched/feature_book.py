"""The consumer scheduler's books on its features: `scheduler_hooks.lifecycle` fed by vLLM's
hooks and the workers' reports, with the byte budget of what the connector holds, and the
bytes per state published as gauges (`feature_bytes`).

Who moves an item (`EPDSchedulerSide` calls one method per signal):
  LOADING    `reserve`: a load starts, if the budget has room (else the item waits)
  STAGED     `staged`: every rank staged it (a worker's Staged, or the inline reader)
  MERGED     `merged`: vLLM allocated it in its encoder cache and the step places it
  PREFILLED  `prefilled`: vLLM's update_state_after_free (the request's prefill passed it)
  DISCARDED  `settle` at the end of each step: PREFILLED ones (vLLM's cache owns the entry
             from then on and evicts it when it needs room), and LOADING/STAGED ones whose
             staging failed or was dropped; `finished`: MERGED for a request that ended
             before its prefill; `evicted`: vLLM evicted the entry (free_encoder_mm_hashes)
Signals about items in another state (vLLM frees entries it encoded itself, a worker's late
report) are not ours and change nothing. A move the table refuses is a bug: it is logged and
counted (`lifecycle_errors`), the item dropped from the books; it never fails a request.
Thread-safe (the scheduler's thread, the control channel's, the inline reader's).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from ec_connectors.log import get_logger
from ec_connectors.stats import StatsRecorder
from scheduler_hooks.lifecycle import HELD, FeatureState, IllegalTransition, Lifecycle, fits
from scheduler_hooks.staging import StagingTable, Status

logger = get_logger(__name__)
S = FeatureState


class FeatureBook:
    def __init__(self, budget: int, stats: StatsRecorder) -> None:
        self.budget = budget
        self.stats = stats
        self.life = Lifecycle()
        self.peak_held = 0  # the most bytes ever held (LOADING + STAGED)
        self.errors = 0
        self._per_embed = 0  # bytes per embedding seen (sizes unknown before a load)
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        return self.life.bytes_in(*HELD)

    def reserve(self, item_id: str, nbytes: int, num_embeds: int) -> bool:
        """A load of the item is about to start: reserve its bytes (`nbytes`, else estimated
        from its embeddings) and return True, or False when the budget has no room."""
        need = nbytes or num_embeds * self._per_embed
        with self._lock:
            if self.life.state(item_id) is not S.DISCARDED:  # an earlier life (a retry)
                self._move(item_id, S.DISCARDED)
            if not fits(self.held, need, self.budget):
                return False
            self.life.begin(item_id, need)
            self.peak_held = max(self.peak_held, self.held)
            self._publish()
        return True

    def staged(self, item_id: str, nbytes: int, num_embeds: int) -> None:
        with self._lock:
            if self.life.state(item_id) is S.LOADING:
                self._move(item_id, S.STAGED, nbytes=nbytes or None)
                self.peak_held = max(self.peak_held, self.held)
            if nbytes and num_embeds:
                self._per_embed = max(self._per_embed, -(-nbytes // num_embeds))

    def merged(self, item_id: str, req_id: str) -> None:
        with self._lock:
            if self.life.state(item_id) is S.LOADING:  # placed before its report was read
                self._move(item_id, S.STAGED)
            if self.life.state(item_id) is S.STAGED:
                self._move(item_id, S.MERGED, owner=req_id)

    def prefilled(self, item_id: str) -> None:
        with self._lock:
            if self.life.state(item_id) is S.MERGED:
                self._move(item_id, S.PREFILLED)

    def finished(self, req_id: str) -> None:
        """A request ended: what was placed for it and never prefilled leaves the books."""
        with self._lock:
            for item_id in self.life.items_in(S.MERGED):
                entry = self.life.get(item_id)
                if entry is not None and entry.owner == req_id:
                    self._move(item_id, S.DISCARDED)

    def evicted(self, item_ids: Iterable[str]) -> None:
        with self._lock:
            for item_id in item_ids:
                if self.life.state(item_id) in (S.MERGED, S.PREFILLED):
                    self._move(item_id, S.DISCARDED)

    def settle(self, staging: StagingTable) -> None:
        """End of a step: PREFILLED items, and LOADING/STAGED ones whose staging is gone
        (failed, dropped, expired), are DISCARDED."""
        with self._lock:
            for item_id in self.life.items_in(S.PREFILLED, *HELD):
                st = staging.get(item_id)
                if (self.life.state(item_id) is S.PREFILLED or st is None
                        or st.status is Status.FAILED):
                    self._move(item_id, S.DISCARDED)

    def _move(self, item_id: str, to: FeatureState, **kw) -> None:
        try:
            self.life.move(item_id, to, **kw)
        except IllegalTransition as exc:
            self.errors += 1
            self.stats.inc("lifecycle_errors")
            logger.error("EPD: feature lifecycle: %s (dropped from the books)", exc)
            if self.life.get(item_id) is not None:
                self.life.move(item_id, S.DISCARDED)
        self._publish()

    def _publish(self) -> None:
        self.stats.gauge("feature_bytes", self.life.by_state())
