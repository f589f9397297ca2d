"""Worker-role logic of EPDConnector (runs in each vLLM worker process).

Producer: `save` hands the encoder output to a bounded background writer, so the model
runner never waits on storage; each finished save is reported to the scheduler at once
(control channel) and through `get_finished`.
Consumer: the scheduler asks for items over the control channel *before* it schedules the
request (`Prefetch`); loader threads fetch and verify them into a byte-bounded staging area
and answer `Staged` (the budget's rule is the scheduler's, `scheduler_hooks.item_table.fits`: with
nothing staged, an item larger than `max_staged_bytes` is staged alone). `place`, called from
`start_load_caches` on the step that schedules the request, only moves staged tensors into
vLLM's encoder cache, and the small items the scheduler read itself (already verified) from
the step's metadata.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ec_connectors.config import EPDConfig
from ec_connectors.control.endpoint import ControlEndpoint
from ec_connectors.control.messages import (
    ControlMessage,
    Drop,
    Hello,
    InlineItem,
    Prefetch,
    Renew,
    Saved,
    Staged,
    Stats,
    WorkerStats,
)
from ec_connectors.log import get_logger
from ec_connectors.stats import COUNTERS, StatsRecorder
from ec_connectors.transports.base import Transport, Want, dtype_from_name, host_copy
from ec_connectors.workers.save_queue import SaveQueue
from scheduler_hooks.item_table import fits

logger = get_logger(__name__)
_REAP_MARGIN_S = 10.0  # the worker drops an unplaced copy this long after the scheduler would


class EPDWorker:
    def __init__(
        self,
        config: EPDConfig,
        transport: Transport,
        *,
        is_producer: bool,
        is_consumer: bool,
        address: str,
        rank: int,
        device: torch.device,
    ) -> None:
        self.config = config
        self._ids = config.ids  # which item ids may be shared (protocol/item_ids.py)
        self.transport = transport
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self.rank = rank
        self.device = device
        self.stats = StatsRecorder()
        transport.stats_sink = self.stats  # per-tier counters and latencies (tiered)
        self._lock = threading.Lock()
        self._staged: dict[str, tuple[torch.Tensor, float]] = {}
        self._staged_bytes = 0
        self._saves_done: set[str] = set()
        self._loads_done: set[str] = set()
        self._events_seen: dict[str, int] = {}
        self._wanted: list[tuple[Prefetch, float]] = []  # (prefetch, received) not yet loading
        self._drain_queued = False
        self._saves = SaveQueue(config.max_pending_saves, config.max_pending_save_bytes)
        self._held_lock = threading.Lock()
        self._held_published = 0  # the ENCODED_CPU bytes last published (Prometheus starts at 0)
        self.stats.on_take(self._publish_held)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="epd-writer")
        self._loaders = ThreadPoolExecutor(config.load_threads, thread_name_prefix="epd-loader")
        self.channel = ControlEndpoint(address, bind=False, on_message=self._on_control,
                                       name=f"epd-worker{rank}-ctl")
        self.channel.send(Hello(rank=rank, pid=os.getpid(), endpoint=transport.endpoint))

    # -- producer --------------------------------------------------------------------------
    def save(self, item_id: str, tensor: torch.Tensor) -> None:
        """Queue one encoder output for writing.

        Blocks only while the save queue is full (`max_pending_saves` items or
        `max_pending_save_bytes`: backpressure), at most `save_queue_timeout_s`; then the save
        fails (consumers encode the item)."""
        if not self._ids.vouched(item_id):
            # A client chose this id (not signed by a gateway holding the deployment secret):
            # encoded for its own request only, never shared under a name it picked.
            self.stats.inc("unvouched_ids")
            self._reply(Saved(item_id=item_id, rank=self.rank, ok=False,
                              error="id not vouched for by the deployment"))
            return
        nbytes = tensor.nbytes
        if not self._saves.enter(nbytes, self.config.save_queue_timeout_s):
            logger.warning("EPD: save queue full (%d items, %d bytes) for %.1f s; not storing "
                           "item %r (consumers will encode it locally). Raise "
                           "max_pending_saves / max_pending_save_bytes or check the storage.",
                           self._saves.items, self._saves.bytes,
                           self.config.save_queue_timeout_s, item_id)
            self._failed(item_id, "save queue full")
            return
        try:  # peers asking for it before it is stored are told to wait, not "unknown"
            self.transport.expect(item_id)
        except Exception as exc:  # noqa: BLE001 - a hint only: the save goes on
            logger.warning("EPD: transport.expect(%r) failed: %s", item_id, exc)
        # ENCODED_CPU from here. A device tensor may be freed or reused by vLLM: copy it to
        # host now. A CPU tensor is a fresh encoder output vLLM never mutates: no copy.
        tensor = host_copy(tensor)
        if nbytes <= self.config.inline_max_bytes and self.transport.writes_fast:
            # A small local write costs less than a hand-off to the writer thread,
            # which would take this core and the GIL from the model runner anyway.
            self._write(item_id, tensor, time.perf_counter())
            return
        try:
            self._writer.submit(self._write, item_id, tensor, time.perf_counter())
        except RuntimeError:  # shutting down
            self._saves.leave(nbytes)

    def _publish_held(self) -> None:
        """Publish the bytes held in ENCODED_CPU as a gauge, when they changed.

        The ENCODED_CPU bytes as a gauge, when they changed since the last time: run when
        the stats are taken (once per report), never on every move of the save queue."""
        with self._held_lock:
            held = self._saves.bytes
            if held != self._held_published:
                self._held_published = held
                self.stats.gauge("producer_feature_bytes", {"encoded_cpu": held})

    def _write(self, item_id: str, tensor: torch.Tensor, queued_at: float) -> None:
        t0 = time.perf_counter()
        self.stats.observe("save_wait_s", t0 - queued_at)
        try:
            info = self.transport.put(item_id, tensor)
        except Exception as exc:
            logger.error("EPD: failed to store item %r: %s", item_id, exc)
            self._failed(item_id, str(exc))
            return
        finally:  # -> DISCARDED: the transport holds the item now (or nobody does)
            self._saves.leave(tensor.nbytes)
        self.stats.inc("saves")
        self.stats.inc("save_bytes", info.nbytes)
        self.stats.observe("save_s", time.perf_counter() - t0)
        with self._lock:
            self._saves_done.add(item_id)
        self._reply(Saved(item_id=item_id, rank=self.rank, ok=True, info=info))

    def _failed(self, item_id: str, reason: str) -> None:
        """Count, report and announce a failed save.

        A save failed: counted, reported, and announced through the transport so waiting
        consumers stop at once."""
        self.stats.inc("save_failures")
        try:
            self.transport.save_failed(item_id, reason)
        except Exception as exc:  # noqa: BLE001 - telling is best effort; the deadline holds
            logger.warning("EPD: could not announce the failed save of %r: %s", item_id, exc)
        self._reply(Saved(item_id=item_id, rank=self.rank, ok=False, error=reason))

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued save is written (tests, shutdown)."""
        return self._saves.drain(timeout_s)

    # -- consumer --------------------------------------------------------------------------
    def _on_control(self, msg: ControlMessage, _peer: bytes | None, _payload: list) -> None:
        if isinstance(msg, Prefetch):
            received = time.perf_counter()
            if not self.transport.batches_loads:  # one loader thread per item, in parallel
                self._loaders.submit(self._prefetch, [msg], received)
                return
            # Prefetches that arrive together (one request's items) are loaded together:
            # transports with a batch call (the store's batch_get_into) move them in one go.
            with self._lock:
                self._wanted.append((msg, received))
                if self._drain_queued:
                    return
                self._drain_queued = True
            self._loaders.submit(self._drain_prefetches)
        elif isinstance(msg, Renew):
            self._loaders.submit(self.transport.renew, msg.item_id)  # may touch storage
        elif isinstance(msg, Drop) and self._unstage(msg.item_id) is not None:
            self.report_stats()

    def _drain_prefetches(self) -> None:
        with self._lock:
            batch, self._wanted = self._wanted, []
            self._drain_queued = False
        if batch:
            self._prefetch([m for m, _ in batch], min(t for _, t in batch))

    def _prefetch(self, msgs: list[Prefetch], received: float) -> None:
        self.stats.observe("loader_wait_s", time.perf_counter() - received)
        self._reap()
        wanted: list[Prefetch] = []
        for msg in msgs:
            with self._lock:
                staged = self._staged.get(msg.item_id)
            if staged is None:
                wanted.append(msg)
            else:
                self.channel.send(Staged(item_id=msg.item_id, rank=self.rank, ok=True,
                                         nbytes=staged[0].nbytes,
                                         num_embeds=_rows(staged[0])))
        if not wanted:
            return
        deadline = time.monotonic() + min(m.timeout_s for m in wanted)
        t0 = time.perf_counter()
        get_s = 0.0
        try:
            tensors = self.transport.get_many(
                [Want(m.item_id, m.location, m.nbytes) for m in wanted], deadline)
            get_s = (time.perf_counter() - t0) / len(wanted)
            self.stats.observe("get_s", get_s)
            error = "not available (missing, corrupt or timed out)"
        except Exception as exc:  # a transport bug must cost these items, not the worker
            tensors, error = [None] * len(wanted), f"{type(exc).__name__}: {exc}"
        for msg, tensor in zip(wanted, tensors, strict=True):
            self._stage(msg.item_id, tensor, error, t0 - received, get_s)

    def _stage(self, item_id: str, tensor: torch.Tensor | None, error: str,
               wait_s: float = 0.0, get_s: float = 0.0) -> None:
        t0 = time.perf_counter()
        if tensor is not None and self.device.type != "cpu":
            tensor = tensor.to(self.device)
        if tensor is not None:
            with self._lock:
                held = self._staged.get(item_id)
                if held is not None:  # loaded twice (two prefetches raced): one copy stays
                    tensor = held[0]
                elif not fits(self._staged_bytes, tensor.nbytes, self.config.max_staged_bytes):
                    # The scheduler's rule (it reserved this load by it): alone, any item fits.
                    error = (f"staging full ({self._staged_bytes} of "
                             f"{self.config.max_staged_bytes} bytes)")
                    tensor = None
                else:
                    self._staged[item_id] = (tensor, time.monotonic())
                    self._staged_bytes += tensor.nbytes
                    self.stats.inc("staged_bytes", tensor.nbytes)
        if tensor is None:
            self.stats.inc("load_failures")
            logger.info("EPD: item %r not staged: %s", item_id, error)
            self._reply(Staged(item_id=item_id, rank=self.rank, ok=False, error=error))
            return
        # load_s (prefetch -> staged on every rank) is observed once, by the scheduler side.
        self._reply(Staged(item_id=item_id, rank=self.rank, ok=True, nbytes=tensor.nbytes,
                           num_embeds=_rows(tensor), wait_s=wait_s, get_s=get_s,
                           stage_s=time.perf_counter() - t0))

    def _unstage(self, item_id: str) -> torch.Tensor | None:
        with self._lock:
            entry = self._staged.pop(item_id, None)
            if entry is None:
                return None
            self._staged_bytes -= entry[0].nbytes
        self.stats.inc("unstaged_bytes", entry[0].nbytes)
        return entry[0]

    def _reap(self) -> None:
        """Drop staged items nobody placed within `staged_ttl_s` (aborted requests).

        The scheduler forgets them first (its clock starts earlier, at the prefetch) and drops
        them; the margin keeps this safety net from taking a copy it is about to place."""
        self.transport.reap()
        cutoff = time.monotonic() - self.config.staged_ttl_s - _REAP_MARGIN_S
        stale: list[str] = []
        with self._lock:  # oldest first (`_stage` stamps under the lock): O(expired + 1)
            for k, (_, ts) in self._staged.items():
                if ts >= cutoff:
                    break
                stale.append(k)
        for k in stale:
            self._unstage(k)
            logger.info("EPD: staged item %r expired unplaced", k)

    def place(self, encoder_cache: dict[str, torch.Tensor], items: dict[str, int],
              inline: dict[str, InlineItem] | None = None) -> None:
        """Move this step's items into vLLM's encoder cache.

        Move this step's items into vLLM's encoder cache (start_load_caches): staged ones,
        and those that came `inline` in the metadata."""
        for item_id, num_embeds in items.items():
            carried = inline.get(item_id) if inline else None
            tensor = self._unstage(item_id) if carried is None else _tensor(carried, self.device)
            if item_id in encoder_cache:
                continue
            if tensor is None:
                # Should not happen (the scheduler only places staged items); a synchronous
                # load is the last chance to avoid vLLM's "Encoder cache miss".
                logger.error("EPD: item %r was not staged on rank %d; loading synchronously",
                             item_id, self.rank)
                tensor = self.transport.get(item_id, time.monotonic() + self.config.load_timeout_s)
                if tensor is None:
                    self.stats.inc("load_failures")
                    continue
                tensor = tensor.to(self.device)
            if tensor.shape[0] != num_embeds:
                logger.warning("EPD: item %r has %d embeddings, the request expects %d",
                               item_id, tensor.shape[0], num_embeds)
            encoder_cache[item_id] = tensor
            self.stats.inc("loads")
            self.stats.inc("load_bytes", tensor.nbytes)
            with self._lock:
                self._loads_done.add(item_id)
        self._reap()
        self.report_stats()

    # -- reporting -------------------------------------------------------------------------
    def _fold_transport_events(self) -> None:
        now = self.transport.events.counters()
        with self._lock:
            seen, self._events_seen = self._events_seen, now
        for name, value in now.items():
            if name in COUNTERS and value > seen.get(name, 0):
                self.stats.inc(name, value - seen.get(name, 0))

    def _reply(self, msg: Saved | Staged) -> None:
        """Tell the scheduler side an outcome, with the stats it changed (one message)."""
        msg.stats = self._take_stats()
        self.channel.send(msg)

    def _take_stats(self) -> Stats | None:
        """This interval's stats, transport events included (None when there are none)."""
        self._fold_transport_events()
        stats = self.stats.take()
        return stats.data if stats is not None else None

    def report_stats(self) -> None:
        """Ship this interval's stats to the scheduler side (see WorkerStats)."""
        data = self._take_stats()
        if data is not None:
            self.channel.send(WorkerStats(rank=self.rank, data=data))

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        """(items saved, items loaded) since the last call: completion feedback for vLLM."""
        with self._lock:
            saved, self._saves_done = self._saves_done, set()
            loaded, self._loads_done = self._loads_done, set()
        return saved or None, loaded or None

    @property
    def staged_bytes(self) -> int:
        return self._staged_bytes

    def close(self) -> None:
        self.flush(timeout_s=self.config.save_queue_timeout_s)
        self._writer.shutdown(wait=True)
        self._loaders.shutdown(wait=False, cancel_futures=True)
        self.channel.close()
        with self._lock:
            self._staged.clear()
            self._staged_bytes = 0
        self.transport.close()


def _tensor(item: InlineItem, device: torch.device) -> torch.Tensor:
    data, dtype, shape = item
    if not data:
        return torch.empty(shape, dtype=dtype_from_name(dtype), device=device)
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # writable: vLLM owns it
    return flat.view(dtype_from_name(dtype)).reshape(shape).to(device)


def _rows(tensor: torch.Tensor) -> int:
    return int(tensor.shape[0]) if tensor.dim() else 1
