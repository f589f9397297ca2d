"""Turn untrusted item ids (client-supplied `uuid`s, mm hashes) into safe storage keys.

A key is `<readable prefix>-<32 hex digest>`: the prefix keeps logs and directory listings
readable, the digest of the whole id keeps keys unique. Keys contain only `[A-Za-z0-9_-]`,
never start with a dot and have a bounded length, so `../../x`, absolute paths, NUL bytes
and megabyte-long ids can neither escape a directory nor break a filesystem or store.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from functools import lru_cache

MAX_ID_BYTES = 64 * 1024  # ids longer than this are refused outright
_PREFIX_LEN = 40
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


class InvalidItemId(ValueError):
    """An item id that cannot be used at all (wrong type, empty, absurdly long)."""


@lru_cache(maxsize=65536)
def item_key(item_id: str) -> str:
    """Safe, deterministic storage key for `item_id` (memoized: it sits on hot paths)."""
    if not isinstance(item_id, str):
        raise InvalidItemId(f"item id must be a string, got {type(item_id).__name__}")
    raw = item_id.encode("utf-8", "surrogatepass")
    if not raw:
        raise InvalidItemId("item id is empty")
    if len(raw) > MAX_ID_BYTES:
        raise InvalidItemId(f"item id is {len(raw)} bytes; the limit is {MAX_ID_BYTES}")
    digest = hashlib.blake2b(raw, digest_size=16).hexdigest()
    prefix = _UNSAFE.sub("_", item_id)[:_PREFIX_LEN].strip("_-")  # never a leading "-"
    return f"{prefix}-{digest}" if prefix else digest


def safe_key(item_id: object) -> str | None:
    """`item_key`, or None for an id that cannot be used (callers treat it as a miss)."""
    try:
        return item_key(item_id)  # type: ignore[arg-type]
    except (InvalidItemId, TypeError):
        return None


def namespace_key(name: str) -> str:
    """Directory / key-prefix name for a namespace (model name, deployment)."""
    return item_key(name)


def content_item_id(data: bytes | Sequence[bytes], namespace: str) -> str:
    """Derive an item id from the media bytes, namespaced by model.

    Item id derived from the media bytes, namespaced by model: the same image always maps
    to the same id, so any instance can reuse its embedding. `data` may come in chunks (the
    id of their concatenation, which is never made: a clip's frames are 19 MB)."""
    h = hashlib.sha256(namespace.encode() + b"\0")
    for chunk in (data,) if isinstance(data, (bytes, bytearray, memoryview)) else data:
        h.update(chunk)
    return h.hexdigest()
