"""`ec_transfer_params`: what a producer returns, and what a consumer accepts (untrusted)."""

from __future__ import annotations

from typing import Any

from ec_connectors.keys import MAX_ID_BYTES

PARAMS_KEY = "epd"
MAX_ITEMS = 1024


class BadParams(ValueError):
    pass


def producer_params(
    transport: str, namespace: str, engine_id: str, items: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """What `request_finished` returns on a producer; a gateway forwards it unchanged."""
    return {PARAMS_KEY: {"transport": transport, "namespace": namespace,
                         "producer": engine_id, "items": items}}


def hinted_items(params: Any) -> set[str]:
    """Item ids a consumer request says a producer made. Accepts the producer's own params
    (`{"epd": {"items": {id: {...}}}}`) or `{"epd": {"items": [id, ...]}}`.
    Raises BadParams with a clear message on anything else."""
    if params is None:
        return set()
    if not isinstance(params, dict):
        raise BadParams("ec_transfer_params must be an object")
    body = params.get(PARAMS_KEY)
    if body is None:
        return set()
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
    for item_id in ids:
        if not isinstance(item_id, str) or not item_id:
            raise BadParams("item ids must be non-empty strings")
        if len(item_id.encode("utf-8", "surrogatepass")) > MAX_ID_BYTES:
            raise BadParams("an item id is too long")
    return set(ids)
