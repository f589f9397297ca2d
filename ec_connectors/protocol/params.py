"""`ec_transfer_params`: what a producer returns, and what a consumer accepts (untrusted)."""

from __future__ import annotations

from typing import Any, NamedTuple

from ec_connectors.protocol.items import ItemInfo
from ec_connectors.protocol.keys import MAX_ID_BYTES, item_key
from ec_connectors.protocol.net import parse_endpoint

PARAMS_KEY = "epd"
MAX_ITEMS = 1024


class BadParams(ValueError):
    pass


class Source(NamedTuple):
    """Where a request says an item lives ("" = ask the transport), its size (0 = unknown),
    and whether it is still being made (`pending`: a gateway sent the request while the item
    is encoded; the consumer waits for it to land, up to its load deadline)."""

    location: str = ""
    nbytes: int = 0
    pending: bool = False


def producer_params(
    transport: str, namespace: str, engine_id: str, items: dict[str, dict[str, Any]],
    endpoint: str = "",
) -> dict[str, Any]:
    """What `request_finished` returns on a producer; a gateway forwards it unchanged.
    `endpoint`: where a peer transport serves the items (peers pull from there)."""
    body: dict[str, Any] = {"transport": transport, "namespace": namespace,
                            "producer": engine_id, "items": items}
    if endpoint:
        body["endpoint"] = endpoint
    return {PARAMS_KEY: body}


def item_entry(item_id: str, num_embeds: int, info: ItemInfo | None,
               with_location: bool = False) -> dict[str, Any]:
    """One item of `producer_params`: what a consumer needs to find and check it."""
    entry: dict[str, Any] = {"num_embeds": num_embeds, "key": item_key(item_id)}
    if info is not None:
        entry.update(shape=list(info.shape), dtype=info.dtype, nbytes=info.nbytes,
                     checksum=info.checksum)
        if with_location and info.location:  # peer transports: who serves it
            entry["location"] = info.location
    return entry


def _location(value: Any) -> str:
    if value in (None, ""):
        return ""
    try:
        parse_endpoint(value)
    except ValueError as exc:
        raise BadParams(f"bad item location: {exc}") from None
    return value


def item_sources(params: Any) -> dict[str, Source]:
    """Item ids a consumer request says a producer made (or is making: `pending`), with where
    each lives when the params say. Accepts the producer's own params (`{"epd": {"items":
    {id: {...}}}}`) or `{"epd": {"items": [id, ...]}}`. Raises BadParams with a clear message
    on anything else."""
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise BadParams("ec_transfer_params must be an object")
    body = params.get(PARAMS_KEY)
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise BadParams(f"ec_transfer_params.{PARAMS_KEY} must be an object")
    items = body.get("items", [])
    if isinstance(items, dict):
        ids = list(items.keys())
    elif isinstance(items, list):
        ids = items
    else:
        raise BadParams(f"ec_transfer_params.{PARAMS_KEY}.items must be an object or a list")
    if len(ids) > MAX_ITEMS:
        raise BadParams(f"too many items ({len(ids)} > {MAX_ITEMS})")
    default_location = _location(body.get("endpoint"))
    out: dict[str, Source] = {}
    for item_id in ids:
        if not isinstance(item_id, str) or not item_id:
            raise BadParams("item ids must be non-empty strings")
        if len(item_id.encode("utf-8", "surrogatepass")) > MAX_ID_BYTES:
            raise BadParams("an item id is too long")
        entry = items.get(item_id) if isinstance(items, dict) else None
        if entry is not None and not isinstance(entry, dict):
            raise BadParams(f"item {item_id[:64]!r} must map to an object")
        entry = entry or {}
        nbytes = entry.get("nbytes", 0)
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 <= nbytes < 1 << 40:
            raise BadParams(f"item {item_id[:64]!r}: nbytes must be a non-negative integer")
        pending = entry.get("pending", False)
        if not isinstance(pending, bool):
            raise BadParams(f"item {item_id[:64]!r}: pending must be true or false")
        out[item_id] = Source(_location(entry.get("location")) or default_location, nbytes,
                              pending)
    return out
