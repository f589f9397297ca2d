"""Consumer: does the stored item a metadata-only part names fit that part?

Gathers what is known of the item (its producer's entry in the request's `ec_transfer_params`, a
copy loaded here, vLLM's encoder cache entry) and what the part asks (its modality, rows and
placeholder metadata), and asks `scheduler_hooks/fit.py`. A misfit fails the request before vLLM
schedules it (`plan_item`), with the reason on the board (`embedding_mismatch`, a 400).

A misfit is the request's, not the item's: the item stays usable by requests it fits. The
load `decide` failed for a token count (before this check knew the rows) is therefore not
answered to the next metadata-only request from memory (`refits`): that request is checked
against the rows, and loads the item again when it fits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from scheduler_hooks.fit import Asked, Known, is_mismatch, misfit
from scheduler_hooks.item_table import Item, ItemState

if TYPE_CHECKING:
    from ec_connectors.placeholders import Placeholders
    from ec_connectors.sched.hints import RequestHints
    from scheduler_hooks.encoder_cache import EncoderCacheView


class PartFit:
    def __init__(self, placeholders: Placeholders, hints: RequestHints,
                 engine_cache: EncoderCacheView) -> None:
        self.placeholders, self.hints, self.engine_cache = placeholders, hints, engine_cache

    def check(self, request: Any, i: int, load: Item | None) -> str:
        """Check that a metadata-only part's item fits it; the reason when not.

        "" when the item the request's `i`-th (metadata-only) part names fits it as far
        as is known, else the reason. `load`: the item's current load (`ItemTable.current`)."""
        feature = request.mm_features[i]
        known = self._known(request.request_id, feature.identifier, load)
        if not known:
            return ""
        rows = request.get_num_encoder_embeds(i)
        if all(k.metadata is None and k.rows in (0, rows) for k in known):
            return ""  # the usual case: no metadata to compare, the rows fit
        asked = Asked(feature.modality, rows, self.placeholders.asked(feature))
        return next((why for k in known if (why := misfit(asked, k))), "")

    @staticmethod
    def refits(load: Item | None) -> bool:
        """Whether a load that failed on its token count is checked again.

        A load failed for a token count: a metadata-only request is checked again (and
        loads the item again when it fits) instead of failing on that memory."""
        return (load is not None and load.state is ItemState.FAILED
                and is_mismatch(load.error))

    def _known(self, req_id: str, item_id: str, load: Item | None) -> list[Known]:
        known: list[Known] = []
        entry = self.hints.described(req_id, item_id)
        if entry is not None:
            rows = entry.shape[0] if entry.shape else entry.num_embeds
            if rows or entry.metadata is not None:
                known.append(Known(rows, "its producer's ec_transfer_params", entry.metadata))
        if load is not None and load.num_embeds and (
                load.state is ItemState.STAGED or self.refits(load)):
            known.append(Known(load.num_embeds, "as loaded here"))
        cached = self.engine_cache.rows(item_id)
        if cached:
            known.append(Known(cached, "in vLLM's encoder cache"))
        return known
