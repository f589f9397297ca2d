"""What becomes of a consumer's requests whose items cannot arrive: a request that must fail
is failed once (vLLM takes it out through `take`) with its reason posted for the API
server's answer (refusals.py); an item vLLM encodes locally instead is logged and counted
once per request and item (a deferred request is looked at again every step)."""

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
        self._fallbacks: set[tuple[str, str]] = set()  # (request, item) encoded locally

    def reported(self, req_id: str, item_id: str) -> bool:
        """Whether the request already fails, or fell back on this item."""
        return (req_id, item_id) in self._fallbacks or req_id in self._failing

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
        key = (req_id, item_id)
        if key not in self._fallbacks:
            self._fallbacks.add(key)
            self.stats.inc("local_encode_fallbacks")
            logger.info("EPD: request %s encodes item %r locally (%s)", req_id, item_id,
                        why or "not available")

    def take(self) -> set[str]:
        """The requests to fail (each once)."""
        out, self._failing = self._failing, set()
        return out

    def finished(self, req_id: str) -> None:
        if self._fallbacks:
            self._fallbacks = {k for k in self._fallbacks if k[0] != req_id}

    def sweep(self, now: float) -> None:
        self.reasons.sweep(now)

    def close(self) -> None:
        self.reasons.close()
