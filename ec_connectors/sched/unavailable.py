"""What becomes of a consumer's requests whose items cannot arrive.

What becomes of a consumer's requests whose items cannot arrive: a request that must fail
is failed once (vLLM takes it out through `take`) with its reason posted for the API
server's answer (refusals.py); an item vLLM encodes locally instead is logged and counted
once per request and item (a deferred request is looked at again every step). Each call
costs O(the request's own items): the fallbacks are kept per request, so a request's end
touches its own (never a scan of every live request's)."""

from __future__ import annotations

from pathlib import Path

from ec_connectors.log import get_logger
from ec_connectors.protocol.refusals import ReasonBoard, classify
from ec_connectors.stats import StatsRecorder

logger = get_logger(__name__)


class Unavailable:
    def __init__(self, board: Path, stats: StatsRecorder) -> None:
        self.reasons = ReasonBoard(board)
        self.stats = stats
        self._failing: set[str] = set()  # requests to fail, not yet taken by vLLM
        self._fallbacks: dict[str, set[str]] = {}  # request -> its items encoded locally

    def reported(self, req_id: str, item_id: str) -> bool:
        """Whether the request already fails, or fell back on this item."""
        return item_id in self._fallbacks.get(req_id, ()) or req_id in self._failing

    def fail(self, req_id: str, item_id: str, why: str, metadata_only: bool) -> None:
        if req_id in self._failing:
            return
        logger.error("EPD: failing request %s: item %r unavailable (%s)%s", req_id, item_id,
                     why, "; the request is metadata-only (no media to encode locally): "
                     "retry it with the raw media" if metadata_only else "")
        self._failing.add(req_id)
        self.stats.inc("failed_requests")
        self.reasons.post(item_id, classify(why), f"item {item_id[:80]!r}: {why}")

    def local_encode(self, req_id: str, item_id: str, why: str) -> None:
        items = self._fallbacks.setdefault(req_id, set())
        if item_id not in items:
            items.add(item_id)
            self.stats.inc("local_encode_fallbacks")
            logger.info("EPD: request %s encodes item %r locally (%s)", req_id, item_id,
                        why or "not available")

    def take(self) -> set[str]:
        """The requests to fail (each once)."""
        out, self._failing = self._failing, set()
        return out

    def finished(self, req_id: str) -> None:
        self._fallbacks.pop(req_id, None)

    def sweep(self, now: float) -> None:
        self.reasons.sweep(now)

    def close(self) -> None:
        self.reasons.close()
