"""The SCHEDULER role of EPDConnector, in vLLM's EngineCore: vLLM's hooks wired to the policy.

`EPDSchedulerSide` answers vLLM's scheduler hooks without blocking, asks `scheduler_hooks/`
what to do per item (`plan_item`, the item table) and acts through the control channel to
the workers and the transports; its helpers in this package own one concern each (see the
package map). Per item and step, a consumer goes facts -> `plan_item` -> act; a producer
records the request's items and returns them as `ec_transfer_params` (docs/architecture.md,
"The scheduler role, step by step").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from ec_connectors.config import EPDConfig
from ec_connectors.control.endpoint import ControlEndpoint
from ec_connectors.control.messages import (
    ControlMessage,
    Drop,
    EPDConnectorMetadata,
    Hello,
    InlineItem,
    Prefetch,
    Renew,
    Saved,
    Staged,
    WorkerStats,
)
from ec_connectors.log import get_logger
from ec_connectors.protocol.keys import safe_key
from ec_connectors.protocol.params import Source, TransferParams
from ec_connectors.protocol.refusals import board_dir
from ec_connectors.sched.hints import RequestHints
from ec_connectors.sched.index import AvailabilityIndex
from ec_connectors.sched.inline import InlineReader
from ec_connectors.sched.item_steps import ItemSteps
from ec_connectors.sched.load_spans import LoadSpans
from ec_connectors.sched.part_fit import PartFit
from ec_connectors.sched.producer_saves import ProducerSaves
from ec_connectors.sched.promises import Promises
from ec_connectors.sched.roster import WorkerRoster
from ec_connectors.sched.staging_budget import StagingBudget
from ec_connectors.sched.unavailable import Unavailable
from ec_connectors.stats import StatsRecorder
from ec_connectors.transports.base import Transport
from scheduler_hooks.encoder_cache import EncoderCacheView
from scheduler_hooks.item_table import ItemState, ItemTable

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from ec_connectors.placeholders import Placeholders

logger = get_logger(__name__)

_FAILED_MEMORY_S = 5.0  # how long a failed item is answered "encode locally" without retrying
_SCHEDULER_GRACE_S = 1.0  # scheduler deadline = worker deadline + this (dead-worker guard)
# A step that scheduled nothing while requests wait on us: the engine would come straight
# back (vLLM sleeps only briefly) and send its workers another empty step, again and again, taking
# both cores from the encoder being waited for. Instead the step waits for news (an item
# landed, staged or read) at most this long; a request that arrives meanwhile waits that long.
_IDLE_WAIT_S = 0.005


class EPDSchedulerSide:
    """SCHEDULER role, one per engine: answers vLLM's scheduler hooks, never blocking."""

    def __init__(
        self,
        config: EPDConfig,
        transport: Transport,
        *,
        is_producer: bool,
        is_consumer: bool,
        address: str,
        engine_id: str,
        start_index: bool = True,
        placeholders: Placeholders | None = None,
    ) -> None:
        self.config = config
        self.placeholders = placeholders
        self.ids = config.ids  # a producer shares only ids the deployment vouches for
        self.transport = transport
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self.engine_id = engine_id
        self.stats = StatsRecorder()
        transport.stats_sink = self.stats  # per-tier counters of the inline reads (tiered)
        self._news = threading.Event()  # something a deferred request may wait for happened
        transport.on_news = self._news.set
        self.index = AvailabilityIndex(transport.list_keys, config.scan_interval_s,
                                       watch=transport.watch_keys, start=start_index,
                                       on_change=self._news.set)
        self.promises = Promises(self.index, transport, config.load_timeout_s, self.stats)
        self.saves = ProducerSaves(self.ids.vouched)  # producer: made, saving, saved
        self._deferred_step = False  # a request was deferred in this step
        self.workers = WorkerRoster()  # who joined over the control channel
        self.items = ItemTable(_FAILED_MEMORY_S, config.staged_ttl_s)  # consumer: its items
        self.budget = StagingBudget(self.items, config.max_staged_bytes, self.stats)
        self.spans = LoadSpans.make(self.items)  # in vLLM's traces, when it traces
        self._said_yes: set[str] = set()  # has_cache_item answered True this step
        self._renewed: set[str] = set()  # producer: Renew sent this step
        self._to_place: dict[str, int] = {}
        self._to_place_inline: dict[str, InlineItem] = {}
        self.inline = (InlineReader(transport, self.budget, self.stats,
                                    config.inline_max_bytes, on_miss=self._prefetch,
                                    on_ready=self._news.set)
                       if is_consumer and transport.reads_in_scheduler
                       and config.inline_max_bytes else None)
        self.hints = RequestHints(config.producers, transport.locate)  # consumer: params
        self._unwanted: set[str] = set()  # staged items whose last waiter left (end of step)
        self.engine_cache = EncoderCacheView()  # consumer: items vLLM's encoder cache holds
        self.fit = PartFit(placeholders, self.hints, self.engine_cache) if placeholders else None
        # requests to fail, local-encode fallbacks, reasons for the API server's answer
        self.unavailable = Unavailable(board_dir(config.control_dir, engine_id), self.stats)
        self.steps = ItemSteps(  # consumer: each item's facts -> plan -> act
            config, items=self.items, index=self.index, hints=self.hints,
            promises=self.promises, engine_cache=self.engine_cache, fit=self.fit,
            placeholders=placeholders, unavailable=self.unavailable, stats=self.stats,
            probe=transport.probe, load=self._load, release=self._release)
        self._last_sweep = time.monotonic()
        self.channel = ControlEndpoint(address, bind=True, on_message=self._on_control,
                                       name="epd-sched-ctl")

    # -- control channel (runs on the channel thread) ---------------------------------------
    def _on_control(self, msg: ControlMessage, peer: bytes | None, _payload: list) -> None:
        if isinstance(msg, Hello):
            self.workers.hello(msg, peer)
            return
        # vLLM's V1 model runner never collects worker-side connector stats, so workers ship
        # theirs here (alone, or with an outcome) and they leave with the scheduler's (one
        # path, no double count).
        if isinstance(msg, WorkerStats):
            self.stats.merge(msg.data)
        elif isinstance(msg, Staged | Saved) and msg.stats:
            self.stats.merge(msg.stats)
        if isinstance(msg, Staged):
            self._on_staged(msg)
            self._news.set()
        elif isinstance(msg, Saved):
            info = msg.info if msg.ok else None
            self.saves.saved(msg.item_id, msg.rank, info)
            if info is not None:
                self.index.add(info.key)
            self._news.set()

    def _on_staged(self, msg: Staged) -> None:
        self.spans.staged(msg)  # the worker's times, for the request's trace
        ranks = self.workers.ranks()
        now = time.monotonic()
        state = self.budget.staged(msg.item_id, msg.rank, msg.ok, msg.num_embeds, msg.error,
                                     ranks, now, msg.nbytes)
        if state is ItemState.STAGED:
            st = self.items.get(msg.item_id)
            if st is not None:
                self.stats.observe("load_s", now - st.started)
        elif state is ItemState.FAILED:  # another rank may have staged it: free that memory
            self._to_workers(Drop(item_id=msg.item_id))

    def _to_workers(self, msg: ControlMessage) -> None:
        self.workers.broadcast(msg, lambda m, peer: self.channel.send(m, to=peer))

    def _load(self, item_id: str, source: Source, num_embeds: int, now: float) -> bool:
        """Start loading a known item, inline when small, else through the workers.

        Start loading a known item (LOADING): a small one on the inline reader, waiting a
        moment for it (STAGED now, in the usual case); any other through the workers. False:
        the staging budget has no room for it (nothing started)."""
        timeout = self.config.load_timeout_s + _SCHEDULER_GRACE_S
        inline = self.inline is not None and self.inline.takes(source.nbytes)
        have_workers = inline or bool(len(self.workers))
        if self.budget.reserve(item_id, source.nbytes, num_embeds, now, timeout,
                                 have_workers) is None:
            return False
        if inline and self.inline is not None:
            self.inline.read(item_id, source, now)
        else:
            self._prefetch(item_id, source)
        return True

    def _prefetch(self, item_id: str, source: Source) -> None:
        """Every worker loads the item (also the inline reader's path for a miss)."""
        self._to_workers(Prefetch(item_id=item_id, timeout_s=self.config.load_timeout_s,
                                  location=source.location, nbytes=source.nbytes))

    # -- vLLM scheduler hooks ------------------------------------------------------------------
    def has_cache_item(self, identifier: str) -> bool:
        if self.is_consumer:
            if self.items.state(identifier) is ItemState.STAGED:
                self._said_yes.add(identifier)
                return True
            return False
        if self._stored(identifier):  # producer: already stored -> do not encode it again
            self.stats.inc("skipped_saves")
            self._said_yes.add(identifier)  # not encoded, so no save to wait for
            if identifier not in self._renewed:  # promised again: workers keep it
                self._renewed.add(identifier)
                self._to_workers(Renew(item_id=identifier))
            return True
        return False

    def _stored(self, item_id: str) -> bool | None:
        """Producer: is the item stored already (index, or a store probe; None = asking)?"""
        key = safe_key(item_id)
        if key is None:
            return False
        return True if key in self.index else self.transport.probe(item_id)

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        if not self.is_consumer:
            return self._producer_ready(request)
        req_id = request.request_id
        first_look = req_id not in self.hints  # a prefix hit shows on the first look
        hints = self.hints.of(request)
        ready = True
        now = time.monotonic()
        for i in range(len(request.mm_features)):  # every item: each may start its load
            defer = self.steps.step(request, i, hints, num_computed_tokens, now, first_look)
            ready = ready and not defer
        if not ready:
            self.stats.inc("deferrals")
            self._deferred_step = True
            self.steps.deferred(req_id, now)
        else:
            waited = self.steps.ready(req_id)
            if waited is not None:
                since, items = waited
                self.stats.observe("defer_s", now - since)
                self.spans.waited(request, since, now, items)
        return ready

    def _producer_ready(self, request: Request) -> bool:
        """Producer: wait briefly for the store's answers about a request's items.

        Producer: wait (bounded by store_probe_timeout_s) for a store's answer, so
        has_cache_item can say "already stored" for what another instance encoded. Every
        item is asked (a list, not a short-circuiting generator): one step starts the store
        probes of all of them."""
        asking = [self._stored(f.identifier) is None for f in request.mm_features]
        if any(asking):
            self.stats.inc("deferrals")
            self._deferred_step = True
            return False
        return True

    def _release(self, item_id: str, req_id: str) -> None:
        """Stop a request waiting for an item.

        The request no longer waits for the item; a staged copy nobody waits for any
        more is dropped at the end of the step (build_connector_meta)."""
        if self.items.release(item_id, req_id):
            self._unwanted.add(item_id)

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        item_id = request.mm_features[index].identifier
        num_embeds = request.get_num_encoder_embeds(index)
        if self.is_producer:
            self.saves.made(request.request_id, item_id, num_embeds)
            if item_id not in self._said_yes:  # vLLM encodes it this step; the save follows
                deadline = (time.monotonic() + self.config.save_queue_timeout_s
                            + self.config.load_timeout_s)
                ranks = self.workers.ranks()
                self.saves.expect_save(item_id, ranks, deadline)
        if self.is_consumer:
            self.engine_cache.allocated(item_id, num_embeds)
        if self.is_consumer and item_id in self._said_yes:
            self._to_place[item_id] = num_embeds
            now = time.monotonic()
            st = self.items.merged(item_id, request.request_id, now)
            inline = self.inline.take(item_id) if self.inline is not None else None
            if inline is not None:
                self._to_place_inline[item_id] = inline
            if st is not None and st.ready_at:
                self.stats.observe("staged_to_scheduled_s", now - st.ready_at)
            self.stats.inc("hits")

    def update_state_after_free(self, request: Request, index: int) -> None:
        """vLLM's prefill passed the item (its KV cache holds it): a merged one is PREFILLED."""
        if self.is_consumer:
            self.items.prefilled(request.mm_features[index].identifier)

    def build_connector_meta(self, evicted: Collection[str] = (),
                             idle: bool = False) -> EPDConnectorMetadata:
        """This step's placements (`evicted`: what vLLM's encoder cache evicted this step).

        `idle`: the step scheduled nothing; if that is because requests wait on us, wait for
        news (at most _IDLE_WAIT_S) instead of letting the engine spin."""
        if idle and self._deferred_step:
            self._news.wait(_IDLE_WAIT_S)
        self._news.clear()  # before the next step looks: no news between is lost
        self._deferred_step = False
        self.engine_cache.evicted(evicted)
        self.items.evicted(evicted)
        place, self._to_place = self._to_place, {}
        inline, self._to_place_inline = self._to_place_inline, {}
        self._said_yes.clear()
        self._renewed.clear()
        if self._unwanted:  # staged copies nobody waits for: free their memory now
            dropped = self.items.unwanted(self._unwanted, place)
            if dropped:
                self.stats.inc("unwanted_drops", len(dropped))
                self._drop(dropped)
        self._sweep()
        self.items.end_step()  # what vLLM prefilled since the last step: DISCARDED
        return EPDConnectorMetadata(place=place, inline=inline)

    def _drop(self, item_ids: list[str]) -> None:
        for item_id in item_ids:
            if self.inline is None or self.inline.take(item_id) is None:  # else held here
                self._to_workers(Drop(item_id=item_id))

    def _sweep(self) -> None:
        """Once a second: drop unplaced staged items and forget old failures.

        Once a second: drop STAGED items nobody scheduled (request aborted) so memory
        staged on workers is released, and forget FAILED ones past their memory (due ones
        only: `ItemTable.sweep` pops a heap, it scans nothing)."""
        now = time.monotonic()
        if now - self._last_sweep < 1.0:
            return
        self._last_sweep = now
        self._drop(self.items.sweep(now))
        self.unavailable.sweep(now)
        self.promises.sweep(now)

    def has_pending_push_work(self) -> bool:
        """Whether the engine should step once more although no request needs it.

        Whether the engine should step once more although no request needs it. vLLM
        publishes connector stats only with a step's output and an idle engine takes no
        steps, so without this the last stats of a burst would wait for the next request:
        - stats that arrived after this step took its own (a worker's report raced it);
        - producer: saves of items vLLM encoded that the workers have not reported yet
          (a report lost for good stops counting at save_queue_timeout_s + load_timeout_s).
        The steps are empty and vLLM sleeps 1 ms between them; no wait of ours, which would
        hold back a request arriving meanwhile."""
        return self.stats.pending or self.saves.saving(time.monotonic())

    def update_connector_output(self, finished_saves: set[str] | None) -> None:
        # The control channel normally told us already; this is the vLLM-sanctioned path.
        for item_id in finished_saves or ():
            key = safe_key(item_id)
            if key is not None:
                self.index.add(key)

    def take_unavailable_requests(self) -> set[str]:
        return self.unavailable.take()

    def request_finished(self, request: Request) -> dict[str, Any] | None:
        req_id = request.request_id
        self.hints.forget(req_id)
        for item_id in self.steps.finished(req_id):
            self._release(item_id, req_id)
        self.unavailable.finished(req_id)
        self.items.finished(req_id)
        if not self.is_producer:
            return None
        metadata = (self.placeholders.describe(request.mm_features)
                    if self.placeholders is not None and request.mm_features else {})
        endpoint = self.workers.endpoint()
        entries = self.saves.finish(request, metadata, with_location=bool(endpoint),
                                   stored=lambda item_id: self._stored(item_id) is True)
        if entries is None:
            return None
        return TransferParams(transport=self.transport.name,
                              namespace=self.config.namespace or "", producer=self.engine_id,
                              items=entries, endpoint=endpoint).to_dict()

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def close(self) -> None:
        if self.inline is not None:
            self.inline.close()
        self.index.close()
        self.channel.close()
        self.transport.close()
        self.unavailable.close()
