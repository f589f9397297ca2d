"""The async encoder pool: queues, dynamic batching and dispatch over workers.

The async encoder pool: per-modality bounded queues, dynamic batching, least-loaded
dispatch over workers, per-item deadlines and failure isolation.

`EncoderPool`'s contract (submit, batch forming, deadlines, out of memory, chunked video) is
written out in docs/architecture.md, "The encoder pool's batching contract".
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Sequence

import torch

from encoder_service.encoder_pool.chunking import Assembly, Chunk, chunk_count, split_video
from encoder_service.encoder_pool.jobs import (
    BUDGET,
    QUEUE_FULL,
    FormingBatch,
    ItemFailed,
    Job,
    Overloaded,
    PoolStats,
    Waiter,
    WholeItem,
    Worker,
    rows_left,
)
from encoder_service.encoder_pool.lifecycle import FeatureStore, PoolItemState
from encoder_service.encoder_pool.media import MediaItem
from encoder_service.encoder_pool.models import MediaEncoder

OOM_ERRORS: tuple[type[BaseException], ...] = (torch.OutOfMemoryError, MemoryError)


class EncoderPool:
    def __init__(self, workers: Sequence[Worker], store: FeatureStore, *,
                 max_batch_size: int = 8, max_batch_tokens: int = 16384,
                 max_wait_ms: float = 5.0, max_queue_items: int = 256,
                 retry_after_s: float = 1.0, video_chunk_tokens: int = 0) -> None:
        if not workers:
            raise ValueError("the pool needs at least one worker")
        self.workers = list(workers)
        self.store = store
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.max_wait_s = max_wait_ms / 1000.0
        self.max_queue_items = max_queue_items
        self.retry_after_s = retry_after_s
        self.video_chunk_tokens = video_chunk_tokens
        self.modalities = sorted({m for w in self.workers for m in w.encoder.modalities})
        self.stats = PoolStats()
        self.on_batch: Callable[[int, float], None] | None = None  # (size, seconds) hook
        self._queues: dict[str, asyncio.Queue[Job]] = {}
        self._inflight: dict[str, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []
        self._batch_tasks: set[asyncio.Task] = set()
        self._worker_free: asyncio.Condition | None = None
        self._tickets = itertools.count()
        self._waiting: dict[int, Waiter] = {}  # batches awaiting a worker, by ticket
        ref = self.workers[0].encoder
        self.hidden_size, self.dtype = ref.hidden_size, ref.dtype

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        self._worker_free = asyncio.Condition()
        for m in self.modalities:
            self._queues[m] = asyncio.Queue(self.max_queue_items)
            self._tasks.append(asyncio.create_task(self._batch_loop(m), name=f"batch-{m}"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._batch_tasks:
            await asyncio.gather(*self._batch_tasks, return_exceptions=True)
        for q in self._queues.values():
            while not q.empty():
                job = q.get_nowait()
                self._finish(job, ItemFailed(job.item.item_id, "encode_error", "pool stopped"))
        for w in self.workers:
            w.executor.shutdown(wait=False, cancel_futures=True)

    def queue_depth(self, modality: str) -> int:
        q = self._queues.get(modality)
        return q.qsize() if q is not None else 0

    def free_slots(self, modality: str) -> int:
        return self.max_queue_items - self.queue_depth(modality)

    @property
    def _chunk_rows(self) -> int:
        """Rows per video chunk; 0 when this pool's encoder may not split videos."""
        chunks = getattr(self.workers[0].encoder, "chunks_video", False)
        return self.video_chunk_tokens if chunks else 0

    def split(self, item: MediaItem) -> list[Chunk]:
        """The chunks `item` is queued as ([]: one job), chunking.split_video's."""
        return split_video(item, self._chunk_rows) if self._chunk_rows else []

    def slots(self, item: MediaItem) -> int:
        """Queue slots `item` takes: one per chunk (counted, not cut)."""
        return (chunk_count(item, self._chunk_rows) if self._chunk_rows else 0) or 1

    # -- admission ---------------------------------------------------------------------
    def estimate_bytes(self, item: MediaItem) -> tuple[int, int]:
        tokens = self.workers[0].encoder.estimate_tokens(item)
        return tokens, tokens * self.hidden_size * self.dtype.itemsize

    def submit(self, item: MediaItem, timeout_s: float, keep: bool = False) -> asyncio.Future:
        """Queue `item`; the future resolves to its embedding or raises ItemFailed."""
        loop = asyncio.get_running_loop()
        if item.modality not in self._queues:
            raise ValueError(f"item {item.item_id!r}: modality {item.modality!r} is not served "
                             f"(served: {', '.join(self.modalities)})")
        pending = self._inflight.get(item.item_id)
        if pending is not None:
            return pending
        feature = self.store.get(item.item_id)
        if feature is not None and feature.tensor is not None:
            self.stats.reuse_hits += 1
            self.store.lookup(item.item_id)  # refresh LRU position
            fut = loop.create_future()
            fut.set_result(feature.tensor)
            return fut
        queue = self._queues[item.modality]
        chunks = self.split(item)
        if self.max_queue_items - queue.qsize() < max(1, len(chunks)):
            self.stats.reject(QUEUE_FULL)
            raise Overloaded(f"{item.modality} queue is full ({self.max_queue_items} items)",
                             self.retry_after_s)
        tokens, nbytes = self.estimate_bytes(item)
        try:
            self.store.begin(item.item_id, item.modality, nbytes, keep=keep)
        except Exception:
            self.stats.reject(BUDGET)
            raise
        now, future = time.monotonic(), loop.create_future()
        if not chunks:
            queue.put_nowait(Job(item, tokens, now + timeout_s, now, future))
        else:
            whole = WholeItem(item.item_id, Assembly(item.item_id, chunks), future,
                           undispatched=sum(c.rows[1] - c.rows[0] for c in chunks))
            for c in chunks:
                queue.put_nowait(Job(c.item, c.rows[1] - c.rows[0], now + timeout_s, now,
                                      future, whole, c.index))
            self.stats.chunked_items += 1
            self.stats.chunks += len(chunks)
        self._inflight[item.item_id] = future
        return future

    async def encode(self, item: MediaItem, timeout_s: float, keep: bool = False
                     ) -> torch.Tensor:
        """Submit and wait, at most `timeout_s`."""
        fut = self.submit(item, timeout_s, keep)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except TimeoutError:
            raise ItemFailed(item.item_id, "timeout",
                             f"not encoded within {timeout_s:.3g} s") from None

    # -- batching ----------------------------------------------------------------------
    async def _batch_loop(self, modality: str) -> None:
        q = self._queues[modality]
        max_tokens = self.max_batch_tokens
        if modality == "video" and self.video_chunk_tokens:  # how long a batch holds a worker
            max_tokens = min(max_tokens, self.video_chunk_tokens)
        carry: Job | None = None  # did not fit the last batch's token budget: opens this one
        try:
            while True:
                forming = FormingBatch(carry or await q.get(), self.max_batch_size, max_tokens)
                form_deadline = forming.jobs[0].enqueued + self.max_wait_s
                while forming.open:
                    if not q.empty():
                        forming.add(q.get_nowait())
                        continue
                    remaining = form_deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    try:
                        forming.add(await asyncio.wait_for(q.get(), remaining))
                    except TimeoutError:
                        break
                worker = await self._acquire_worker(modality, rows_left(forming.jobs))
                while forming.open and not q.empty():  # top up while we waited
                    forming.add(q.get_nowait())
                batch, carry = forming.jobs, forming.carry
                for job in batch:
                    if job.whole is not None:
                        job.whole.undispatched -= job.tokens
                now = time.monotonic()
                live = []
                for job in batch:
                    if job.whole is not None and job.whole.failed:
                        continue  # another chunk failed the item: nothing to encode for
                    if job.deadline <= now:
                        self._finish(job, ItemFailed(job.item.item_id, "timeout",
                                                     "deadline passed while queued"))
                    else:
                        live.append(job)
                if not live:
                    await self._release_worker(worker, 0)
                    continue
                tokens = sum(j.tokens for j in live)
                worker.outstanding_tokens += tokens
                task = asyncio.create_task(self._run_batch(worker, live, tokens))
                self._batch_tasks.add(task)
                task.add_done_callback(self._batch_tasks.discard)
        finally:  # stopped: the job that opens the next batch is answered too
            if carry is not None:
                self._finish(carry, ItemFailed(carry.item.item_id, "encode_error",
                                               "pool stopped"))

    async def _acquire_worker(self, modality: str, rest: int) -> Worker:
        """Wait for the worker to run a formed batch, favouring the shortest remaining work.

        The least loaded eligible worker, for formed batches shortest remaining work first
        (`rest`: rows still to encode of the largest item in the batch, a chunked video's
        whole remainder): the 16 images sent while a video encodes go between its chunks,
        not after them. A batch passed over for `AGING_S` goes first, in the order such
        batches started waiting, so a long video always progresses. (Ticket order alone let
        the video's next chunk, always formed first, win every other release.)"""
        assert self._worker_free is not None
        async with self._worker_free:
            ticket = next(self._tickets)
            me = self._waiting[ticket] = Waiter(modality, rest, time.monotonic(), ticket)
            try:
                while True:
                    now = time.monotonic()
                    ready = [w for w in self.workers if w.eligible
                             and modality in w.encoder.modalities
                             and not any(o.rank(now) < me.rank(now)
                                         and o.modality in w.encoder.modalities
                                         for o in self._waiting.values() if o is not me)]
                    if ready:
                        w = min(ready, key=lambda w: (w.outstanding_tokens, w.inflight,
                                                      w.batches))
                        w.inflight += 1
                        return w
                    await self._worker_free.wait()
            finally:
                del self._waiting[ticket]
                self._worker_free.notify_all()  # younger waiters: another worker may do

    async def _release_worker(self, worker: Worker, tokens: int) -> None:
        assert self._worker_free is not None
        async with self._worker_free:
            worker.inflight -= 1
            worker.outstanding_tokens -= tokens
            self._worker_free.notify_all()

    async def _run_batch(self, worker: Worker, jobs: list[Job], tokens: int) -> None:
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        try:
            results = await loop.run_in_executor(
                worker.executor, self._encode_isolated, worker.encoder,
                [j.item for j in jobs])
        except BaseException as exc:  # executor shut down, cancelled
            results = [ItemFailed(j.item.item_id, "encode_error", repr(exc)) for j in jobs]
        finally:
            await self._release_worker(worker, tokens)
        worker.batches += 1
        worker.items += len(jobs)
        self.stats.batches += 1
        self.stats.batch_sizes = (self.stats.batch_sizes + [len(jobs)])[-1024:]
        if self.on_batch is not None:
            self.on_batch(len(jobs), time.perf_counter() - t0)
        for job, res in zip(jobs, results, strict=True):
            self._finish(job, res)

    def _finish(self, job: Job, result: torch.Tensor | BaseException) -> None:
        whole = job.whole
        if whole is None:
            self._finish_item(job.item.item_id, job.future, result)
            return
        if whole.failed:
            return
        if isinstance(result, torch.Tensor):
            try:
                result = whole.assembly.place(job.chunk, result)
            except ValueError as exc:
                result = ItemFailed(whole.item_id, "encode_error", str(exc))
            if result is None:
                return  # chunks still to come
        elif isinstance(result, ItemFailed):
            result = ItemFailed(whole.item_id, result.code, f"chunk {job.chunk}: "
                                f"{result.reason}")
        whole.failed = isinstance(result, BaseException)
        self._finish_item(whole.item_id, whole.future, result)

    def _finish_item(self, item_id: str, future: asyncio.Future,
                     result: torch.Tensor | BaseException) -> None:
        self._inflight.pop(item_id, None)
        if isinstance(result, torch.Tensor):
            try:
                self.store.encoded(item_id, result)
                self.stats.items_encoded += 1
            except Exception as exc:  # budget: the real size did not fit
                result = ItemFailed(item_id, "budget", str(exc))
        if isinstance(result, BaseException):
            if self.store.state(item_id) is not PoolItemState.DISCARDED:
                self.store.discard(item_id)
            code = result.code if isinstance(result, ItemFailed) else "encode_error"
            self.stats.fail(code)
            if not isinstance(result, ItemFailed):
                result = ItemFailed(item_id, "encode_error", repr(result))
        if not future.done():
            if isinstance(result, BaseException):
                future.set_exception(result)
                future.exception()  # mark retrieved: a timed-out waiter is gone
            else:
                future.set_result(result)

    # -- runs on a worker thread ---------------------------------------------------------
    def _encode_isolated(self, encoder: MediaEncoder, items: list[MediaItem]
                         ) -> list[torch.Tensor | BaseException]:
        """Encode a batch; failures stay with the item that caused them."""
        try:
            out = encoder.encode(items)
            if len(out) != len(items):
                raise RuntimeError(f"encoder returned {len(out)} outputs for {len(items)} items")
            return list(out)
        except OOM_ERRORS:
            if len(items) > 1:
                mid = len(items) // 2
                return (self._encode_isolated(encoder, items[:mid])
                        + self._encode_isolated(encoder, items[mid:]))
            self.stats.oom_failures += 1
            return [ItemFailed(items[0].item_id, "oom", "out of memory (encoded alone); the "
                               "decode instance encodes it from the raw media")]
        except Exception as exc:
            if len(items) > 1:
                return [r for it in items for r in self._encode_isolated(encoder, [it])]
            return [ItemFailed(items[0].item_id, "encode_error", f"encoder failed: {exc!r}")]
