"""Tiers: several transports behind one, tried in order.

Tiers: several transports behind one, e.g. `"transport": ["mooncake", "mooncake_store",
"safetensors"]`: the producer's pool (TE pull) first, the store (items any instance made)
next, the shared directory last; when every tier misses, vLLM encodes locally.

Save: every tier is written (a failed tier is logged and counted; the save fails only when
every tier failed). Load: each tier is asked once without waiting for absent items, in order;
a tier that is down (dead master) is skipped; then the round repeats with backoff until the
deadline (a producer's save may still be under way). Each tier's hits, misses, bytes and hit
latency go to the connector stats (`tier_<name>_*`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from ec_connectors.log import get_logger
from ec_connectors.protocol.stored import ItemInfo
from ec_connectors.transports.base import Transport, TransportEvents, Want

if TYPE_CHECKING:
    import torch

logger = get_logger(__name__)

_BACKOFF_S = (0.005, 0.2)


class TieredTransport(Transport):
    name = "tiered"

    def __init__(self, tiers: list[Transport]) -> None:
        if not tiers:
            raise ValueError("TieredTransport needs at least one tier")
        self.tiers = tiers
        self.batches_loads = any(t.batches_loads for t in tiers)
        self.reads_in_scheduler = any(t.reads_in_scheduler for t in tiers)
        self.writes_fast = all(t.writes_fast for t in tiers)  # a save writes every tier
        self.announces = any(t.announces for t in tiers)
        self.own = TransportEvents()
        self.totals: dict[str, float] = {}  # tier_<name>_<what>: for health() and benchmarks
        self._on_news: Callable[[], None] | None = None

    @property
    def on_news(self) -> Callable[[], None] | None:  # type: ignore[override]
        return self._on_news

    @on_news.setter
    def on_news(self, fn: Callable[[], None] | None) -> None:
        self._on_news = fn
        for tier in self.tiers:  # each tier's news is the tiers' news
            tier.on_news = fn

    @property
    def events(self) -> TransportEvents:  # type: ignore[override]
        """The tiers' events summed (the worker folds these into connector counters)."""
        merged = TransportEvents()
        for source in (self.own, *(t.events for t in self.tiers)):
            for name, value in source.counters().items():
                setattr(merged, name, getattr(merged, name) + value)
        return merged

    def _count(self, tier: Transport, what: str, value: float = 1) -> None:
        name = f"tier_{tier.name}_{what}"
        self.totals[name] = self.totals.get(name, 0) + value
        if self.stats_sink is not None:
            self.stats_sink.inc(name, value)

    def _hit(self, tier: Transport, tensor: torch.Tensor, elapsed: float) -> None:
        self._count(tier, "hits")
        self._count(tier, "bytes", tensor.nbytes)
        if self.stats_sink is not None:
            self.stats_sink.observe(f"tier_{tier.name}_get_s", elapsed)

    # -- save --------------------------------------------------------------------------------
    def put(self, item_id: str, tensor: torch.Tensor) -> ItemInfo:
        infos: list[ItemInfo] = []
        errors: list[str] = []
        for tier in self.tiers:
            if not tier.available:
                self._count(tier, "put_failures")
                errors.append(f"{tier.name}: unavailable")
                continue
            try:
                infos.append(tier.put(item_id, tensor))
            except Exception as exc:
                self._count(tier, "put_failures")
                errors.append(f"{tier.name}: {exc}")
                logger.warning("EPD: tier %s did not store item %r: %s", tier.name, item_id,
                               exc)
        if not infos:
            raise RuntimeError(f"no tier stored item {item_id!r}: {'; '.join(errors)}")
        # The first tier's description (a peer tier's carries its location).
        return infos[0]

    # -- load --------------------------------------------------------------------------------
    def get(self, item_id: str, deadline: float, location: str = "",
            nbytes: int = 0, *, wait: bool = True) -> torch.Tensor | None:
        return self.get_many([Want(item_id, location, nbytes)], deadline, wait=wait)[0]

    def get_small(self, item_id: str, max_bytes: int) -> torch.Tensor | None:
        """Read a small item from the tiers that read in the scheduler.

        From the tiers that read in the scheduler, in order, up to the first available
        tier that does not: that one is preferred, and only the workers read it."""
        skipped: list[Transport] = []
        for tier in self.tiers:
            if not tier.available:
                skipped.append(tier)
                continue
            if not tier.reads_in_scheduler:
                break
            t0 = time.perf_counter()
            tensor = tier.get_small(item_id, max_bytes)
            if tensor is not None:
                for down in skipped:
                    self._count(down, "skipped")
                self._hit(tier, tensor, time.perf_counter() - t0)
                return tensor
        return None  # not counted: the workers' load that follows counts misses and skips

    def get_many(self, wants: list[Want], deadline: float, *, wait: bool = True
                 ) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = [None] * len(wants)
        todo = list(range(len(wants)))
        backoff = _BACKOFF_S[0]
        counted: set[str] = set()  # misses and skips count once per tier per load
        while True:
            for tier in self.tiers:
                if not todo:
                    return out
                first = tier.name not in counted
                counted.add(tier.name)
                if not tier.available:
                    if first:
                        self._count(tier, "skipped", len(todo))
                    continue
                t0 = time.perf_counter()
                got = tier.get_many([wants[i] for i in todo], deadline, wait=False)
                elapsed = time.perf_counter() - t0
                missed = []
                for i, tensor in zip(todo, got, strict=True):
                    if tensor is None:
                        missed.append(i)
                        continue
                    out[i] = tensor
                    self._hit(tier, tensor, elapsed)
                if first and missed:
                    self._count(tier, "misses", len(missed))
                todo = missed
            if not todo:
                return out
            if not wait or time.monotonic() + backoff > deadline:
                self.own.missing += len(todo)
                return out
            time.sleep(backoff)  # a producer's save may still be under way
            backoff = min(backoff * 2, _BACKOFF_S[1])

    # -- everything else: every tier -----------------------------------------------------------
    def probe(self, item_id: str) -> bool | None:
        answers = [t.probe(item_id) for t in self.tiers if t.available]
        if any(answers):
            return True
        return None if None in answers else False

    def exists(self, item_id: str) -> bool:
        return any(t.exists(item_id) for t in self.tiers if t.available)

    def list_keys(self) -> Iterable[str]:
        return itertools.chain.from_iterable(t.list_keys() for t in self.tiers)

    def delete(self, item_id: str) -> bool:
        # True when any tier removed a copy. The list is built whole first, so every tier
        # deletes its copy: any() over a generator would stop at the first tier that did.
        return any([t.delete(item_id) for t in self.tiers])

    def locate(self, key: str) -> tuple[str, int] | None:
        for tier in self.tiers:
            found = tier.locate(key)
            if found is not None:
                return found
        return None

    @property
    def endpoint(self) -> str:
        return next((t.endpoint for t in self.tiers if t.endpoint), "")

    @property
    def available(self) -> bool:
        return any(t.available for t in self.tiers)

    def renew(self, item_id: str) -> None:
        for tier in self.tiers:
            tier.renew(item_id)

    def expect(self, item_id: str) -> None:
        for tier in self.tiers:
            tier.expect(item_id)

    def save_failed(self, item_id: str, reason: str) -> None:
        for tier in self.tiers:
            tier.save_failed(item_id, reason)

    def reap(self) -> None:
        for tier in self.tiers:
            tier.reap()

    def health(self) -> dict[str, object]:
        tiers = [t.health() for t in self.tiers]
        return {"transport": self.name, "ok": any(bool(h.get("ok")) for h in tiers),
                "tiers": tiers, "counters": dict(self.totals)}

    def close(self) -> None:
        for tier in self.tiers:
            try:
                tier.close()
            except Exception as exc:  # close the others regardless
                logger.warning("EPD: closing tier %s: %s", tier.name, exc)
