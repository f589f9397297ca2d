"""Where a consumer's items come from: each request's `ec_transfer_params`, parsed once per
request (malformed params are ignored: its media is encoded locally), and the location to
pull an item from (the params' own, only from configured producers: params are
client-controlled; else the producers' announcements, `Transport.locate`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ec_connectors.log import get_logger
from ec_connectors.protocol.keys import safe_key
from ec_connectors.protocol.params import BadParams, Source, TransferParams
from scheduler_hooks.decisions import pull_location

logger = get_logger(__name__)


class RequestHints:
    def __init__(self, producers: list[str],
                 locate: Callable[[str], tuple[str, int] | None]) -> None:
        self.producers = producers
        self.locate = locate
        self._by_req: dict[str, dict[str, Source]] = {}

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._by_req

    def of(self, request: Any) -> dict[str, Source]:
        """Item id -> Source the request's params name (parsed on its first look)."""
        req_id = request.request_id
        hints = self._by_req.get(req_id)
        if hints is None:
            try:
                hints = TransferParams.parse(getattr(request, "ec_transfer_params",
                                                     None)).sources()
            except BadParams as exc:
                logger.warning("EPD: request %s: ignoring malformed ec_transfer_params (%s); "
                               "its media will be encoded locally", req_id, exc)
                hints = {}
            self._by_req[req_id] = hints
        return hints

    def forget(self, req_id: str) -> None:
        self._by_req.pop(req_id, None)

    def source(self, item_id: str, hints: dict[str, Source]) -> Source:
        """Where to pull the item from, and its size when known."""
        source = hints.get(item_id, Source())
        location = pull_location(source.location, self.producers)
        if location != source.location:
            logger.warning("EPD: ignoring location %r for item %r: not a configured producer",
                           source.location, item_id)
            source = Source(location, source.nbytes)
        key = safe_key(item_id)
        if not source.location and key is not None:
            found = self.locate(key)
            if found is not None:
                return Source(found[0], source.nbytes or found[1])
        return source
