"""What a stored embedding is and where it lives (msgspec; on every wire that names items)."""

from __future__ import annotations

import msgspec


class ItemInfo(msgspec.Struct, frozen=True, omit_defaults=True):
    """What a stored embedding is and where it lives."""

    item_id: str
    key: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    nbytes: int
    checksum: str  # xxh3-64 hex of the raw tensor bytes
    location: str = ""  # transport-specific (file path, endpoint)
