"""Which items vLLM's own encoder cache holds, so a request that needs one of them is
neither deferred nor sent a load: vLLM serves it from its cache without asking the connector.

An item enters the cache when vLLM allocates it for a request (`update_state_after_alloc`,
whether the connector placed it or vLLM encoded it) and leaves when vLLM evicts it: every
step's `SchedulerOutput.free_encoder_mm_hashes` lists the evicted ones. Entries that requests
merely stopped referencing stay cached (vLLM evicts them only when it needs the space), and
vLLM reuses them, so they stay here too. The view can only be stale in one direction: an entry
evicted earlier in the same step, or dropped by a cache reset after a weight update. vLLM then
asks `has_cache_item` as for any other item and encodes it itself: slower, never wrong.
Pure logic over plain values.
"""

from __future__ import annotations

from collections.abc import Iterable


class EncoderCacheView:
    def __init__(self) -> None:
        self._items: set[str] = set()

    def allocated(self, item_id: str) -> None:
        self._items.add(item_id)

    def evicted(self, item_ids: Iterable[str]) -> None:
        self._items.difference_update(item_ids)

    def __contains__(self, item_id: object) -> bool:
        return item_id in self._items

    def __len__(self) -> int:
        return len(self._items)
