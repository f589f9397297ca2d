"""Where a consumer's items come from, per request's transfer params.

Where a consumer's items come from: each request's `ec_transfer_params`, parsed once per
request (malformed params are ignored: its media is encoded locally), and the location to
pull an item from (the params' own, only from configured producers: params are
client-controlled; else the producers' announcements, `Transport.locate`), and what the
params say an item is (`described`: its producer's entry, checked by `part_fit.py`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ec_connectors.log import get_logger
from ec_connectors.protocol.keys import safe_key
from ec_connectors.protocol.params import BadParams, ItemEntry, Source, TransferParams
from scheduler_hooks.decisions import pull_location

logger = get_logger(__name__)


class RequestHints:
    def __init__(self, producers: list[str],
                 locate: Callable[[str], tuple[str, int] | None]) -> None:
        self.producers = producers
        self.locate = locate
        self._by_req: dict[str, dict[str, Source]] = {}
        self._entries: dict[str, dict[str, ItemEntry]] = {}  # requests whose params describe

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._by_req

    def of(self, request: Any) -> dict[str, Source]:
        """Item id -> Source the request's params name (parsed on its first look)."""
        req_id = request.request_id
        hints = self._by_req.get(req_id)
        if hints is None:
            try:
                params = TransferParams.parse(getattr(request, "ec_transfer_params", None))
                hints = params.sources()
                if params.items:
                    self._entries[req_id] = params.items
            except BadParams as exc:
                logger.warning("EPD: request %s: ignoring malformed ec_transfer_params (%s); "
                               "its media will be encoded locally", req_id, exc)
                hints = {}
            self._by_req[req_id] = hints
        return hints

    def described(self, req_id: str, item_id: str) -> ItemEntry | None:
        """The request's params' entry of the item (its producer's description), if any."""
        entries = self._entries.get(req_id)
        return entries.get(item_id) if entries else None

    def forget(self, req_id: str) -> None:
        self._by_req.pop(req_id, None)
        self._entries.pop(req_id, None)

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
