"""Track which items vLLM's own encoder cache holds.

Which items vLLM's own encoder cache holds, so a request that needs one of them is
neither deferred nor sent a load: vLLM serves it from its cache without asking the connector.

An item enters the cache when vLLM allocates it for a request (`update_state_after_alloc`,
whether the connector placed it or vLLM encoded it) and leaves when vLLM evicts it: every
step's `SchedulerOutput.free_encoder_mm_hashes` lists the evicted ones. Entries that requests
merely stopped referencing stay cached (vLLM evicts them only when it needs the space), and
vLLM reuses them, so they stay here too. The view can only be stale in one direction: an entry
evicted earlier in the same step, or dropped by a cache reset after a weight update. vLLM then
asks `has_cache_item` as for any other item and encodes it itself: slower, never wrong.
Each entry's row count is kept (`rows`): a metadata-only part naming a cached item with
another grid must not be served from it (`fit.py`). Pure logic over plain values.
"""

from __future__ import annotations

from collections.abc import Iterable


class EncoderCacheView:
    def __init__(self) -> None:
        self._items: dict[str, int] = {}  # item id -> its rows (0: not known)

    def allocated(self, item_id: str, rows: int = 0) -> None:
        self._items[item_id] = rows

    def evicted(self, item_ids: Iterable[str]) -> None:
        for item_id in item_ids:
            self._items.pop(item_id, None)

    def rows(self, item_id: str) -> int:
        """The rows of the cached entry (0: not cached, or not known)."""
        return self._items.get(item_id, 0)

    def __contains__(self, item_id: object) -> bool:
        return item_id in self._items

    def __len__(self) -> int:
        return len(self._items)
