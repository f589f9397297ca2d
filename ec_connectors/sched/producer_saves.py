"""A producer's bookkeeping of its items and saves, in its scheduler process.

A producer's bookkeeping in its scheduler process: which items each request made (and
their token counts), which saves the workers have yet to report, what each save reported
(shape, dtype, checksum, where it is served), and from these the `ec_transfer_params` a
finished request returns. The control channel's thread reports saves; the scheduler's thread
reads: every shared table is behind the book's lock. `saving` (asked whenever an idle engine
looks for work) costs O(the saves due since): a heap of deadlines, never a scan."""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ec_connectors.protocol.params import ItemEntry
from ec_connectors.protocol.stored import ItemInfo
from epd_common.lru import BoundedLRU

if TYPE_CHECKING:
    from vllm.v1.request import Request

_MAX_SAVED_INFOS = 65536


class ProducerSaves:
    def __init__(self, vouched: Callable[[str], bool]) -> None:
        self._vouched = vouched  # ids the deployment vouches for (others are not offered)
        self._lock = threading.Lock()
        self._made: dict[str, dict[str, int]] = {}  # request -> item -> num_embeds
        # items being encoded -> (worker ranks yet to report the save, deadline)
        self._saving: dict[str, tuple[set[int], float]] = {}
        # (deadline, seq, item, its _saving entry): `saving` pops the due ones
        self._due: list[tuple[float, int, str, tuple[set[int], float]]] = []
        self._seq = itertools.count()
        self._saved: BoundedLRU[str, ItemInfo] = BoundedLRU(_MAX_SAVED_INFOS)

    def made(self, req_id: str, item_id: str, num_embeds: int) -> None:
        self._made.setdefault(req_id, {})[item_id] = num_embeds

    def expect_save(self, item_id: str, ranks: set[int], deadline: float) -> None:
        """Expect every rank's save report for an item vLLM encodes this step.

        vLLM encodes the item this step: every rank in `ranks` will report its save (a
        report lost for good stops counting at `deadline`). No rank: nothing to await."""
        with self._lock:
            if not ranks:
                self._saving.pop(item_id, None)
                return
            entry = self._saving[item_id] = (ranks, deadline)
            if len(self._due) > 2 * len(self._saving) + 64:  # amortized O(1) per entry
                self._due = [d for d in self._due if self._saving.get(d[2]) is d[3]]
                heapq.heapify(self._due)
            heapq.heappush(self._due, (deadline, next(self._seq), item_id, entry))

    def saved(self, item_id: str, rank: int, info: ItemInfo | None) -> None:
        """A worker's report (control thread): `info` when the save succeeded."""
        with self._lock:
            waiting = self._saving.get(item_id)
            if waiting is not None:
                waiting[0].discard(rank)
                if not waiting[0]:
                    del self._saving[item_id]
            if info is not None:
                self._saved[item_id] = info

    def info(self, item_id: str) -> ItemInfo | None:
        with self._lock:
            return self._saved.get(item_id)

    def saving(self, now: float) -> bool:
        """Whether saves are still to be reported (those past their deadline are dropped)."""
        if not self._saving:
            return False
        with self._lock:
            while self._due and self._due[0][0] <= now:
                _, _, item_id, entry = heapq.heappop(self._due)
                if self._saving.get(item_id) is entry:  # else reported or expected anew
                    del self._saving[item_id]
            return bool(self._saving)

    def finish(self, request: Request, metadata: dict[str, dict[str, Any]],
               with_location: bool, stored: Callable[[str], bool] = lambda _: False,
               ) -> dict[str, ItemEntry] | None:
        """The transfer-params entries a finished request returns.

        The entries a finished request returns (and the request is forgotten): the items
        it made, those `stored` says are stored (vLLM asks the connector nothing about an
        item its own encoder cache still holds, e.g. the same image seconds later: offered
        all the same), and the others it has placeholder `metadata` for (stored before:
        deduplicated), each with its metadata; only vouched-for ids. None: it made nothing
        and has no metadata (no params at all)."""
        made = self._made.pop(request.request_id, None) or {}
        for i, feature in enumerate(request.mm_features):
            if feature.identifier not in made and stored(feature.identifier):
                made[feature.identifier] = request.get_num_encoder_embeds(i)
        if not made and not metadata:
            return None
        out: dict[str, ItemEntry] = {}
        for item_id, num_embeds in made.items():
            if self._vouched(item_id):  # a client-chosen id was not saved: not offered
                out[item_id] = ItemEntry.describe(item_id, num_embeds, self.info(item_id),
                                                  with_location)
        for i, feature in enumerate(request.mm_features):
            item_id = feature.identifier
            if item_id not in metadata or not self._vouched(item_id):
                continue
            entry = out.get(item_id)
            if entry is None:
                entry = ItemEntry.describe(item_id, request.get_num_encoder_embeds(i),
                                           self.info(item_id), with_location)
            out[item_id] = entry.with_metadata(metadata[item_id])
        return out
