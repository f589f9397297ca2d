"""Scheduler role of EPDConnector (runs in vLLM's EngineCore process): wires the pure policy
of `scheduler_hooks/` (availability index, staging state machine, decisions) to vLLM's
scheduler API, the control channel to the workers and the transports.

Consumer flow for one item:
  ensure_cache_available: the params say `pending` (a gateway sent the request while the item
      is encoded): defer, asking nobody, until its save shows here (index, announcements),
      then as below; not landed within load_timeout_s -> as an item nobody promised
  ensure_cache_available: the item is known (index or the request's ec_transfer_params)
      -> small (inline_max_bytes) and the transport reads here: read and verify it on the
         inline reader thread, waiting at most _INLINE_WAIT_S -> READY, usually this step
         (no deferral; its bytes go to the workers in the step's metadata); a miss there
         (not written yet, larger, damaged) takes the workers' path:
      -> send Prefetch to every worker, defer the request (LOADING, with a deadline)
  Staged from all workers (control thread) -> READY; any failure -> FAILED
  has_cache_item: True only for READY items (O(1) dict lookup)
  update_state_after_alloc -> the item goes into this step's metadata; the worker places it
  deadline passed / FAILED -> local encode (default) or the request fails (on_unavailable=fail)
  a metadata-only item (no media: vLLM cannot encode it) that is unknown, late or failed
      -> the request fails (take_unavailable_requests); never scheduled without its embedding
  a step that scheduled nothing because requests wait on us waits for news (_IDLE_WAIT_S)
Producer flow: update_state_after_alloc records the request's items; request_finished returns
them as ec_transfer_params, each with its placeholder metadata (so the consumer's request can
be metadata-only); `has_cache_item` answers "already stored" so nothing is encoded twice.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING, Any

from ec_connectors.config import EPDConfig
from ec_connectors.control import ControlEndpoint
from ec_connectors.log import get_logger
from ec_connectors.messages import (
    ControlMessage,
    Drop,
    Hello,
    Prefetch,
    Renew,
    Saved,
    Staged,
    WorkerStats,
)
from ec_connectors.metadata import EPDConnectorMetadata, InlineItem
from ec_connectors.protocol.items import ItemInfo
from ec_connectors.protocol.keys import safe_key
from ec_connectors.protocol.params import BadParams, ItemEntry, Source, TransferParams
from ec_connectors.refusals import ReasonBoard, board_dir, classify
from ec_connectors.stats import StatsRecorder
from ec_connectors.transports.base import Transport, dtype_name, tensor_bytes
from scheduler_hooks.decisions import Verdict, covered, decide, pull_location, unavailable_action
from scheduler_hooks.encoder_cache import EncoderCacheView
from scheduler_hooks.index import AvailabilityIndex
from scheduler_hooks.staging import DEADLINE_PASSED, StagingTable, Status

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from ec_connectors.placeholders import Placeholders

logger = get_logger(__name__)

_FAILED_MEMORY_S = 5.0  # how long a failed item is answered "encode locally" without retrying
_SCHEDULER_GRACE_S = 1.0  # scheduler deadline = worker deadline + this (dead-worker guard)
_MAX_SAVED_INFOS = 65536
_INLINE = -1  # the "rank" that stages inline items: this scheduler side itself
# A scheduler step waits this long for a small item's read before deferring the request
# (the read goes on; the item is READY a step later). A local read takes ~0.1 ms.
_INLINE_WAIT_S = 0.005
_INLINE_HELD_MAX = 64 << 20  # bytes read inline and not yet placed; beyond: the workers
# A step that scheduled nothing while requests wait on us: the engine would come straight
# back (vLLM sleeps 1 ms) and send its workers another empty step, again and again, taking
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
        self._pending: dict[str, float] = {}  # consumer: pending item -> first asked for
        # producer: items being encoded -> (worker ranks yet to report the save, deadline)
        self._saving: dict[str, tuple[set[int], float]] = {}
        self._deferred_step = False  # a request was deferred in this step
        self._lock = threading.Lock()  # workers, endpoints, saved infos (control thread)
        self._workers: dict[int, bytes] = {}
        self.staging = StagingTable(_FAILED_MEMORY_S, config.staged_ttl_s)
        self._said_yes: set[str] = set()  # has_cache_item answered True this step
        self._renewed: set[str] = set()  # producer: Renew sent this step
        self._to_place: dict[str, int] = {}
        self._inline: dict[str, InlineItem] = {}  # read here, READY, not yet placed
        self._inline_bytes = 0
        self._to_place_inline: dict[str, InlineItem] = {}
        self._reader = (ThreadPoolExecutor(1, thread_name_prefix="epd-inline")
                        if is_consumer and transport.reads_in_scheduler
                        and config.inline_max_bytes else None)
        self._req_items: dict[str, dict[str, int]] = {}
        self._req_hints: dict[str, dict[str, Source]] = {}
        self._req_deferred_since: dict[str, float] = {}  # consumer: first deferral of a request
        self._req_waits: dict[str, set[str]] = {}  # consumer: items a request waited for
        self._unwanted: set[str] = set()  # staged items whose last waiter left (end of step)
        self.engine_cache = EncoderCacheView()  # consumer: items vLLM's encoder cache holds
        self._endpoints: dict[int, str] = {}  # worker rank -> where it serves items
        self._unavailable: set[str] = set()
        # why a request was failed, for the API server's answer (refusals.py)
        self.reasons = ReasonBoard(board_dir(config.control_dir, engine_id))
        self._fallbacks_logged: set[tuple[str, str]] = set()
        self._saved: OrderedDict[str, ItemInfo] = OrderedDict()
        self._last_sweep = time.monotonic()
        self.channel = ControlEndpoint(address, bind=True, on_message=self._on_control,
                                       name="epd-sched-ctl")

    # -- control channel (runs on the channel thread) ---------------------------------------
    def _on_control(self, msg: ControlMessage, peer: bytes | None, _payload: list) -> None:
        if isinstance(msg, Hello):
            with self._lock:
                self._workers[msg.rank] = peer or b""
                if msg.endpoint:
                    self._endpoints[msg.rank] = msg.endpoint
            logger.info("EPD: worker rank %d (pid %d) connected%s", msg.rank, msg.pid,
                        f", serving items at {msg.endpoint}" if msg.endpoint else "")
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
            with self._lock:
                waiting = self._saving.get(msg.item_id)
                if waiting is not None:
                    waiting[0].discard(msg.rank)
                    if not waiting[0]:
                        del self._saving[msg.item_id]
                if info is not None:
                    self._saved[msg.item_id] = info
                    self._saved.move_to_end(msg.item_id)
                    while len(self._saved) > _MAX_SAVED_INFOS:
                        self._saved.popitem(last=False)
            if info is not None:
                self.index.add(info.key)
            self._news.set()

    def _on_staged(self, msg: Staged) -> None:
        with self._lock:
            ranks, peers = set(self._workers), list(self._workers.values())
        now = time.monotonic()
        status = self.staging.staged(msg.item_id, msg.rank, msg.ok, msg.num_embeds, msg.error,
                                     ranks, now)
        if status is Status.READY:
            st = self.staging.get(msg.item_id)
            if st is not None:
                self.stats.observe("load_s", now - st.started)
        elif status is Status.FAILED:
            for peer in peers:  # another rank may have staged it: free that memory
                self.channel.send(Drop(item_id=msg.item_id), to=peer)

    def _source(self, item_id: str, key: str, hints: dict[str, Source]) -> Source:
        """Where to pull from: the request's params (only configured producers, when a list
        is configured: params are client-controlled), else the producers' announcements."""
        source = hints.get(item_id, Source())
        location = pull_location(source.location, self.config.producers)
        if location != source.location:
            logger.warning("EPD: ignoring location %r for item %r: not a configured producer",
                           source.location, item_id)
            source = Source(location, source.nbytes)
        if not source.location:
            found = self.transport.locate(key)
            if found is not None:
                return Source(found[0], source.nbytes or found[1])
        return source

    def _load(self, item_id: str, source: Source, now: float) -> None:
        """Start loading a known item (LOADING): a small one on the inline reader, waiting a
        moment for it (READY now, in the usual case); any other through the workers."""
        timeout = self.config.load_timeout_s + _SCHEDULER_GRACE_S
        if (self._reader is None or source.nbytes > self.config.inline_max_bytes
                or self._inline_bytes >= _INLINE_HELD_MAX):
            with self._lock:
                peers = list(self._workers.values())
            self.staging.begin(item_id, now, timeout, have_workers=bool(peers))
            self._prefetch(item_id, source, peers)
            return
        self.staging.begin(item_id, now, timeout, have_workers=True)
        wait_futures([self._reader.submit(self._read_inline, item_id, source, now)],
                     timeout=_INLINE_WAIT_S)

    def _prefetch(self, item_id: str, source: Source, peers: list[bytes]) -> None:
        for peer in peers:
            self.channel.send(Prefetch(item_id=item_id, timeout_s=self.config.load_timeout_s,
                                       location=source.location, nbytes=source.nbytes),
                              to=peer)

    def _read_inline(self, item_id: str, source: Source, started: float) -> None:
        """Inline reader thread: the verified item becomes READY here, its bytes held until
        placed; a miss (not written yet, larger, damaged) goes to the workers, which wait
        for it until the deadline and count what fails."""
        try:
            tensor = self.transport.get_small(item_id, self.config.inline_max_bytes)
        except Exception:  # a transport bug costs the fast path, not the item
            logger.exception("EPD: inline read of item %r failed; the workers load it", item_id)
            tensor = None
        if tensor is None:
            with self._lock:
                peers = list(self._workers.values())
            self._prefetch(item_id, source, peers)
            return
        item: InlineItem = (tensor_bytes(tensor).tobytes(), dtype_name(tensor.dtype),
                            tuple(tensor.shape))
        with self._lock:
            self._inline[item_id] = item
            self._inline_bytes += len(item[0])
        now = time.monotonic()
        rows = int(tensor.shape[0]) if tensor.dim() else 1
        if self.staging.staged(item_id, _INLINE, True, rows, "", {_INLINE}, now) \
                is Status.READY:
            self.stats.observe("load_s", now - started)
            self.stats.inc("inline_loads")
            self._news.set()
        else:  # forgotten or failed meanwhile
            self._take_inline(item_id)

    def _take_inline(self, item_id: str) -> InlineItem | None:
        with self._lock:
            item = self._inline.pop(item_id, None)
            if item is not None:
                self._inline_bytes -= len(item[0])
        return item

    # -- vLLM scheduler hooks ------------------------------------------------------------------
    def has_cache_item(self, identifier: str) -> bool:
        if self.is_consumer:
            st = self.staging.get(identifier)
            if st is not None and st.status is Status.READY:
                self._said_yes.add(identifier)
                return True
            return False
        if self._stored(identifier):  # producer: already stored -> do not encode it again
            self.stats.inc("skipped_saves")
            self._said_yes.add(identifier)  # not encoded, so no save to wait for
            if identifier not in self._renewed:  # promised again: workers keep it
                self._renewed.add(identifier)
                for peer in list(self._workers.values()):
                    self.channel.send(Renew(item_id=identifier), to=peer)
            return True
        return False

    def _hints(self, request: Request) -> dict[str, Source]:
        req_id = request.request_id
        hints = self._req_hints.get(req_id)
        if hints is None:
            try:
                hints = TransferParams.parse(getattr(request, "ec_transfer_params",
                                                     None)).sources()
            except BadParams as exc:
                logger.warning("EPD: request %s: ignoring malformed ec_transfer_params (%s); "
                               "its media will be encoded locally", req_id, exc)
                hints = {}
            self._req_hints[req_id] = hints
        return hints

    def _stored(self, item_id: str) -> bool | None:
        """Producer: is the item stored already (index, or a store probe; None = asking)?"""
        key = safe_key(item_id)
        if key is None:
            return False
        return True if key in self.index else self.transport.probe(item_id)

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        if not self.is_consumer:
            # Producer: wait (bounded by store_probe_timeout_s) for a store's answer, so
            # has_cache_item can say "already stored" for what another instance encoded.
            # Every item is asked (a list, not a short-circuiting generator): one step starts
            # the store probes of all of them.
            asking = [self._stored(f.identifier) is None for f in request.mm_features]
            if any(asking):
                self.stats.inc("deferrals")
                self._deferred_step = True
                return False
            return True
        req_id = request.request_id
        first_look = req_id not in self._req_hints  # a prefix hit shows on the first look
        hints = self._hints(request)
        waits = self._req_waits.get(req_id, ())
        ready = True
        now = time.monotonic()
        for i, feature in enumerate(request.mm_features):
            item_id = feature.identifier
            pos = feature.mm_position
            done = covered(pos.offset, pos.length, num_computed_tokens)
            if done or item_id in self.engine_cache:
                # In the KV cache, or in vLLM's own encoder cache (placed there, or encoded;
                # vLLM serves it: no load, no wait): a copy staged for it is not needed. A
                # preempted request whose item was evicted since is loaded again.
                if not done:
                    self.stats.inc("engine_cache_hits")
                elif first_look:  # computed before this request ran: the prefix cache
                    self.stats.inc("prefix_cached")
                if item_id in waits:  # (no lock taken for the usual running request)
                    self._release(item_id, req_id)
                continue
            if self.staging.current(item_id, now) is None:
                key = safe_key(item_id)
                source = hints.get(item_id)
                if key is not None and source is not None and source.pending:
                    wait = self._wait_pending(item_id, key, now)
                    if wait:
                        ready = False  # still being encoded: wait for it to land
                        continue
                    if wait is None:  # never landed: as an item nobody promised
                        self._pending_expired(request, feature, item_id)
                        if self._metadata_only(feature):
                            ready = False
                        continue
                known = key is not None and (item_id in hints or key in self.index)
                if key is not None and not known:
                    known = self.transport.probe(item_id)  # stores that cannot list
                    if known is None:  # asked in the background: wait a step or two
                        ready = False
                        continue
                if not known:
                    if self._metadata_only(feature):
                        ready = False
                        self._on_unavailable(request, item_id, True, "not in the transport",
                                             metadata_only=True)
                        continue
                    logger.debug("EPD: request %s item %r is not in the transport; vLLM "
                                 "encodes it locally", req_id, item_id)
                    continue
                self._load(item_id, self._source(item_id, key, hints), now)
            self.staging.want(item_id, req_id)
            self._req_waits.setdefault(req_id, set()).add(item_id)
            d = decide(self.staging, item_id, request.get_num_encoder_embeds(i), now)
            if d.verdict is Verdict.WAIT:
                ready = False
            elif d.verdict is Verdict.UNAVAILABLE:
                if d.just_failed:
                    if d.why == DEADLINE_PASSED:
                        self.stats.inc("timeouts")
                    logger.warning("EPD: item %r for request %s: %s; not loaded", item_id,
                                   req_id, d.why)
                no_media = self._metadata_only(feature)
                if no_media:
                    ready = False  # never schedule it without its embedding
                self._on_unavailable(request, item_id, no_media or item_id in hints, d.why,
                                     metadata_only=no_media)
        if not ready:
            self.stats.inc("deferrals")
            self._deferred_step = True
            self._req_deferred_since.setdefault(req_id, now)
        else:
            since = self._req_deferred_since.pop(req_id, None)
            if since is not None:
                self.stats.observe("defer_s", now - since)
        return ready

    def _wait_pending(self, item_id: str, key: str, now: float) -> bool | None:
        """A pending item (sent by a gateway while it is encoded): True = wait for it to
        land, False = it landed (load it now), None = it did not land in load_timeout_s."""
        if self._landed(key):
            first = self._pending.pop(item_id, None)
            if first is not None:
                self.stats.observe("pending_s", now - first)
            return False
        first = self._pending.setdefault(item_id, now)
        return True if now - first < self.config.load_timeout_s else None

    def _landed(self, key: str) -> bool:
        """Whether a producer's save of `key` has reached this process. Where nothing here
        follows saves (a store that cannot list, a shared directory only scanned), True: the
        workers' load waits for the item instead."""
        if key in self.index:
            return True
        if self.transport.announces:
            return self.transport.locate(key) is not None
        return not self.index.watching

    def _pending_expired(self, request: Request, feature: Any, item_id: str) -> None:
        # once per request and item (a failing request is asked about again until vLLM
        # takes it out)
        if ((request.request_id, item_id) not in self._fallbacks_logged
                and request.request_id not in self._unavailable):
            self.stats.inc("timeouts")
        self._on_unavailable(request, item_id, True,
                             f"promised as pending, not stored within "
                             f"{self.config.load_timeout_s:g} s",
                             metadata_only=self._metadata_only(feature))

    def _release(self, item_id: str, req_id: str) -> None:
        """The request no longer waits for the item; a staged copy nobody waits for any
        more is dropped at the end of the step (build_connector_meta)."""
        if self.staging.release(item_id, req_id):
            self._unwanted.add(item_id)

    def _metadata_only(self, feature: Any) -> bool:
        return self.placeholders is not None and self.placeholders.metadata_only(feature)

    def _on_unavailable(self, request: Request, item_id: str, promised: bool, why: str,
                        metadata_only: bool = False) -> None:
        policy = "fail" if metadata_only else self.config.on_unavailable
        if unavailable_action(promised, policy) == "fail":
            if request.request_id not in self._unavailable:
                logger.error("EPD: failing request %s: item %r unavailable (%s)%s",
                             request.request_id, item_id, why,
                             "; the request is metadata-only (no media to encode locally): "
                             "retry it with the raw media" if metadata_only else "")
                self._unavailable.add(request.request_id)
                self.stats.inc("failed_requests")
                self.reasons.post(item_id, classify(why), f"item {item_id[:80]!r}: {why}")
            return
        key = (request.request_id, item_id)
        if key not in self._fallbacks_logged:
            self._fallbacks_logged.add(key)
            self.stats.inc("local_encode_fallbacks")
            logger.info("EPD: request %s encodes item %r locally (%s)",
                        request.request_id, item_id, why or "not available")

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        item_id = request.mm_features[index].identifier
        num_embeds = request.get_num_encoder_embeds(index)
        if self.is_producer:
            self._req_items.setdefault(request.request_id, {})[item_id] = num_embeds
            if item_id not in self._said_yes:  # vLLM encodes it this step; the save follows
                deadline = (time.monotonic() + self.config.save_queue_timeout_s
                            + self.config.load_timeout_s)
                with self._lock:
                    self._saving[item_id] = (set(self._workers), deadline)
        if self.is_consumer:
            self.engine_cache.allocated(item_id)
        if self.is_consumer and item_id in self._said_yes:
            self._to_place[item_id] = num_embeds
            inline = self._take_inline(item_id) if self._inline else None
            if inline is not None:
                self._to_place_inline[item_id] = inline
            st = self.staging.get(item_id)
            if st is not None and st.ready_at:
                self.stats.observe("staged_to_scheduled_s", time.monotonic() - st.ready_at)
            self.staging.forget(item_id)
            self.stats.inc("hits")

    def build_connector_meta(self, evicted: Iterable[str] = (),
                             idle: bool = False) -> EPDConnectorMetadata:
        """This step's placements (`evicted`: what vLLM's encoder cache evicted this step).
        `idle`: the step scheduled nothing; if that is because requests wait on us, wait
        for news (at most _IDLE_WAIT_S) instead of letting the engine spin."""
        if idle and self._deferred_step:
            self._news.wait(_IDLE_WAIT_S)
        self._news.clear()  # before the next step looks: no news between is lost
        self._deferred_step = False
        self.engine_cache.evicted(evicted)
        place, self._to_place = self._to_place, {}
        inline, self._to_place_inline = self._to_place_inline, {}
        self._said_yes.clear()
        self._renewed.clear()
        if self._unwanted:  # staged copies nobody waits for: free their memory now
            dropped = self.staging.unwanted(self._unwanted, place)
            if dropped:
                self.stats.inc("unwanted_drops", len(dropped))
                self._drop(dropped)
        self._sweep()
        return EPDConnectorMetadata(place=place, inline=inline)

    def _drop(self, item_ids: list[str]) -> None:
        if not item_ids:
            return
        with self._lock:
            peers = list(self._workers.values())
        for item_id in item_ids:
            if self._take_inline(item_id) is not None:
                continue  # held here, not on the workers
            for peer in peers:
                self.channel.send(Drop(item_id=item_id), to=peer)

    def _sweep(self) -> None:
        """Once a second: forget READY items nobody scheduled (request aborted) so memory
        staged on workers is released, and FAILED ones past their memory."""
        now = time.monotonic()
        if now - self._last_sweep < 1.0:
            return
        self._last_sweep = now
        self._drop(self.staging.sweep(now))
        self.reasons.sweep(now)
        if self._pending:  # promises nobody asks about any more (their requests left)
            cutoff = now - 2 * self.config.load_timeout_s
            self._pending = {k: t for k, t in self._pending.items() if t > cutoff}

    def has_pending_push_work(self) -> bool:
        """Whether the engine should step once more although no request needs it. vLLM
        publishes connector stats only with a step's output and an idle engine takes no
        steps, so without this the last stats of a burst would wait for the next request:
        - stats that arrived after this step took its own (a worker's report raced it);
        - producer: saves of items vLLM encoded that the workers have not reported yet
          (a report lost for good stops counting at save_queue_timeout_s + load_timeout_s).
        The steps are empty and vLLM sleeps 1 ms between them; no wait of ours, which would
        hold back a request arriving meanwhile."""
        if self.stats.pending:
            return True
        if not self._saving:
            return False
        now = time.monotonic()
        with self._lock:
            self._saving = {k: v for k, v in self._saving.items() if v[1] > now and v[0]}
            return bool(self._saving)

    def update_connector_output(self, finished_saves: set[str] | None) -> None:
        # The control channel normally told us already; this is the vLLM-sanctioned path.
        for item_id in finished_saves or ():
            key = safe_key(item_id)
            if key is not None:
                self.index.add(key)

    def take_unavailable_requests(self) -> set[str]:
        out, self._unavailable = self._unavailable, set()
        return out

    def request_finished(self, request: Request) -> dict[str, Any] | None:
        req_id = request.request_id
        self._req_hints.pop(req_id, None)
        self._req_deferred_since.pop(req_id, None)
        for item_id in self._req_waits.pop(req_id, ()):
            self._release(item_id, req_id)
        if self._fallbacks_logged:
            self._fallbacks_logged = {k for k in self._fallbacks_logged if k[0] != req_id}
        items = self._req_items.pop(req_id, None) or {}
        if not self.is_producer:
            return None
        metadata = (self.placeholders.describe(request.mm_features)
                    if self.placeholders is not None and request.mm_features else {})
        if not items and not metadata:
            return None
        described: dict[str, ItemEntry] = {}
        endpoint = self._endpoints.get(min(self._endpoints), "") if self._endpoints else ""
        for item_id, num_embeds in items.items():
            if self.ids.vouched(item_id):  # a client-chosen id was not saved: not offered
                described[item_id] = ItemEntry.describe(item_id, num_embeds,
                                                        self._saved.get(item_id),
                                                        with_location=bool(endpoint))
        for i, feature in enumerate(request.mm_features):
            item_id = feature.identifier
            if item_id not in metadata or not self.ids.vouched(item_id):
                continue
            entry = described.get(item_id)
            if entry is None:  # stored before (deduplicated): described too
                entry = ItemEntry.describe(item_id, request.get_num_encoder_embeds(i),
                                           self._saved.get(item_id),
                                           with_location=bool(endpoint))
            described[item_id] = entry.with_metadata(metadata[item_id])
        return TransferParams(transport=self.transport.name,
                              namespace=self.config.namespace or "", producer=self.engine_id,
                              items=described, endpoint=endpoint).to_dict()

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.shutdown(wait=False, cancel_futures=True)
        self.index.close()
        self.channel.close()
        self.transport.close()
        self.reasons.close()
