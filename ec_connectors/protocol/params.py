"""The typed `ec_transfer_params`, the wire object every process passes on.

`ec_transfer_params`: the one wire object that crosses every process (producer -> gateway
-> consumer), typed. Every writer builds it with these types and every reader parses it with
`TransferParams.parse`, so the producer, the encoder pool, the gateway and the consumer agree
through one definition instead of hand-written dict edits.

On the wire (JSON, or a plain dict inside a vLLM request: vLLM passes `ec_transfer_params`
through as a dict)::

    {"epd": {"transport": "mooncake", "namespace": "<model>", "producer": "<engine id>",
             "items": {"<item id>": {"num_embeds": 64, "key": "...", "shape": [64, 896],
                                     "dtype": "bfloat16", "nbytes": 114688,
                                     "checksum": "<xxh3 hex>", "location": "host:port",
                                     "pending": true, "metadata": {"image_grid_thw": [1, 8, 8]}}},
             "endpoint": "host:port"}}

Every field is optional and left out when empty (`omit_defaults`), so the bytes are those the
dict writers made before: a producer's entry, a gateway's `{"pending": true}` promise, an
availability hint `{"location", "nbytes"}`. `items` may also be a list of ids (`{"epd":
{"items": ["a", "b"]}}`: "look them up").

Use:
  - write:   ``TransferParams(transport=..., namespace=..., producer=..., endpoint=...,
    items={item_id: ItemEntry.describe(item_id, num_embeds, info)}).to_dict()`` (or
    ``.to_json()``); a promise is ``ItemEntry(pending=True)``; add metadata with
    ``entry.with_metadata(meta)`` and drop it with ``entry.with_metadata(None)`` (entries are
    frozen: share them freely).
  - read:    ``TransferParams.parse(value)`` (a dict, or None) / ``TransferParams.from_json(b)``
    -> ``TransferParams`` or `BadParams` with a message fit for a 400 answer (a peer's
    answer passes ``bad_items=[]``: a malformed entry fails that item alone);
    ``.sources()`` -> ``{item_id: Source}`` (where each item lives, the consumer's view).

Trust: nothing parsed here is trusted (a client writes `ec_transfer_params` of its own; an
encoder's answer is a peer's). `parse` bounds what it keeps: at most MAX_ITEMS items, ids
non-empty strings of at most MAX_ID_BYTES, every field of its JSON type (no coercion: `true`
is no integer), numbers and strings within the bounds below, locations and the endpoint
`host:port`. Unknown keys are ignored and not kept (a re-encoded object carries only these
fields: a gateway forwards what it understood, never a peer's extras). Placeholder
`metadata` that is not a small object of numbers or flat lists of numbers (at most
MAX_METADATA_BYTES as JSON) is dropped, not refused: it only lets a request go metadata-only,
and without it the item goes with its raw media. What the values mean (is this location a
configured producer, does nbytes fit this model) is the reader's to check
(`scheduler_hooks.decisions.pull_location`, `ec_connectors.guard.request_checks`).
"""

from __future__ import annotations

from typing import Annotated, Any, NamedTuple

import msgspec

from ec_connectors.protocol.keys import MAX_ID_BYTES, item_key
from ec_connectors.protocol.stored import ItemInfo
from epd_common.net import parse_endpoint

PARAMS_KEY = "epd"  # our object inside `ec_transfer_params` (other connectors' keys untouched)
MAX_ITEMS = 1024
# Qwen3-VL's video metadata holds a timestamp per temporal group, so it grows with the clip:
# the bound leaves room for the gateway's longest clip (max_video_frames); a tighter one made
# long videos (the items EPD exists for) lose metadata-only and go with all their frames.
MAX_METADATA_BYTES = 16 * 1024
_MAX_NBYTES = 1 << 40
_MAX_NAME = 1024  # transport, namespace (a model name or path), producer (an engine id)

_Count = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
_Name = Annotated[str, msgspec.Meta(max_length=_MAX_NAME)]


class BadParams(ValueError):
    """Malformed `ec_transfer_params`; the message names what and where (a 400's reason)."""


class Source(NamedTuple):
    """Where a request says an item lives, its size, and whether it is pending.

    Where a request says an item lives ("" = ask the transport), its size (0 = unknown),
    and whether it is still being made (`pending`: a gateway sent the request while the item
    is encoded; the consumer waits for it to land, up to its load deadline)."""

    location: str = ""
    nbytes: int = 0
    pending: bool = False


class ItemEntry(msgspec.Struct, frozen=True, omit_defaults=True):
    """One item of `TransferParams.items`: what a consumer needs to find and check it.

    A producer fills what it knows (`describe`); a gateway's promise is `pending` alone, an
    availability hint `location` and `nbytes`; `metadata` is the item's placeholder metadata
    (`image_grid_thw`, ...: a metadata-only request needs it, a consumer never reads it)."""

    num_embeds: _Count = 0
    key: Annotated[str, msgspec.Meta(max_length=256)] = ""  # the producer's storage key
    shape: Annotated[list[_Count], msgspec.Meta(max_length=8)] = []
    dtype: Annotated[str, msgspec.Meta(max_length=32)] = ""
    nbytes: Annotated[int, msgspec.Meta(ge=0, lt=_MAX_NBYTES)] = 0
    checksum: Annotated[str, msgspec.Meta(max_length=128)] = ""
    location: str = ""  # peer transports: who serves it ("" = the params' endpoint, or ask)
    pending: bool = False  # still being encoded: wait for it to land
    metadata: dict[str, Any] | None = None

    @classmethod
    def describe(cls, item_id: str, num_embeds: int, info: ItemInfo | None,
                 with_location: bool = False) -> ItemEntry:
        """Build a producer's entry for one item.

        A producer's entry: the item's key, and what its save reported (`info`; None for
        an item stored before, whose save this producer did not see)."""
        if info is None:
            return cls(num_embeds=num_embeds, key=item_key(item_id))
        return cls(num_embeds=num_embeds, key=item_key(item_id), shape=list(info.shape),
                   dtype=info.dtype, nbytes=info.nbytes, checksum=info.checksum,
                   location=info.location if with_location else "")

    def with_metadata(self, metadata: dict[str, Any] | None) -> ItemEntry:
        return msgspec.structs.replace(self, metadata=metadata)

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


class TransferParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The `{"epd": {...}}` object of `ec_transfer_params`.

    The `{"epd": {...}}` object of `ec_transfer_params`: who made the items (`transport`,
    `namespace`, `producer`: informational, no reader acts on them), where a peer transport
    serves them (`endpoint`: the default of every entry's `location`), and the items (always
    written, `{}` included, as the dict writers did)."""

    transport: _Name = ""
    namespace: _Name = ""
    producer: _Name = ""
    items: dict[str, ItemEntry]
    endpoint: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The value of a request's or an answer's `ec_transfer_params` (plain dicts)."""
        return {PARAMS_KEY: msgspec.to_builtins(self)}

    def to_json(self) -> bytes:
        return msgspec.json.encode({PARAMS_KEY: self})

    def sources(self) -> dict[str, Source]:
        """Item id -> where the params say it lives (the consumer's view)."""
        return {item_id: Source(e.location or self.endpoint, e.nbytes, e.pending)
                for item_id, e in self.items.items()}

    @classmethod
    def from_json(cls, data: bytes | str) -> TransferParams:
        try:
            value = msgspec.json.decode(data)
        except msgspec.DecodeError as exc:
            raise BadParams(f"ec_transfer_params is not JSON: {exc}") from None
        return cls.parse(value)

    @classmethod
    def parse(cls, params: Any, *, bad_items: list[str] | None = None) -> TransferParams:
        """Parse untrusted `ec_transfer_params` into a TransferParams.

        Untrusted `ec_transfer_params` (a dict, or None) -> TransferParams; absent or
        another connector's params -> no items. Raises BadParams on anything malformed;
        with `bad_items` (a peer's answer, where one bad entry fails that item alone), a
        malformed entry is left out and its id appended there instead."""
        if params is None:
            return cls(items={})
        if not isinstance(params, dict):
            raise BadParams("ec_transfer_params must be an object")
        body = params.get(PARAMS_KEY)
        if body is None:
            return cls(items={})
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
        head = {k: body[k] for k in ("transport", "namespace", "producer") if k in body}
        head["items"] = {}
        try:
            out = msgspec.convert(head, cls)
        except msgspec.ValidationError as exc:
            raise BadParams(f"ec_transfer_params.{PARAMS_KEY}: {exc}") from None
        out.endpoint = _location(body.get("endpoint"))
        entries: dict[str, ItemEntry] = {}
        for item_id in ids:
            _check_id(item_id)
            entry = items.get(item_id) if isinstance(items, dict) else None
            try:
                entries[item_id] = _entry(item_id, entry)
            except BadParams:
                if bad_items is None:
                    raise
                bad_items.append(item_id)
        out.items = entries
        return out


def valid_metadata(meta: Any) -> dict[str, Any] | None:
    """Return placeholder metadata if it is well-formed, else None.

    Placeholder metadata when it is well-formed: a non-empty object of at most
    MAX_METADATA_BYTES (as JSON) mapping names to numbers or non-empty flat lists of
    numbers; else None."""
    if not isinstance(meta, dict) or not meta:
        return None
    for key, value in meta.items():
        values = value if isinstance(value, list) else [value]
        if not isinstance(key, str) or not values or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            return None
    if len(msgspec.json.encode(meta)) > MAX_METADATA_BYTES:
        return None
    return meta


def _check_id(item_id: Any) -> None:
    if not isinstance(item_id, str) or not item_id:
        raise BadParams("item ids must be non-empty strings")
    if len(item_id.encode("utf-8", "surrogatepass")) > MAX_ID_BYTES:
        raise BadParams("an item id is too long")


def _location(value: Any) -> str:
    if value in (None, ""):
        return ""
    try:
        parse_endpoint(value)
    except ValueError as exc:
        raise BadParams(f"bad item location: {exc}") from None
    return value


_EMPTY = ItemEntry()


def _entry(item_id: str, raw: Any) -> ItemEntry:
    if raw is None:
        return _EMPTY
    if not isinstance(raw, dict):
        raise BadParams(f"item {item_id[:64]!r} must map to an object")
    fields = dict(raw)
    meta = valid_metadata(fields.pop("metadata", None))
    location = _location(fields.pop("location", None))
    try:
        entry = msgspec.convert(fields, ItemEntry)
    except msgspec.ValidationError as exc:
        raise BadParams(f"item {item_id[:64]!r}: {exc}") from None
    if meta is None and not location:
        return entry
    return msgspec.structs.replace(entry, metadata=meta, location=location)
