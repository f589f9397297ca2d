"""What the encoder pool queues and runs: jobs, workers, the batch being formed, refusals.

A job is one item, or one chunk of a long video (`WholeItem` assembles the chunks); a batch
forms under an item and a token budget (`FormingBatch`); `Waiter` is a formed batch waiting
for a worker; `Overloaded` and `ItemFailed` are the refusals and failures callers see.
"""

from __future__ import annotations

import asyncio
import itertools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from encoder_service.encoder_pool.chunking import Assembly
from encoder_service.encoder_pool.media import MediaItem
from encoder_service.encoder_pool.models import MediaEncoder

# How long a formed batch may be passed over for batches of less remaining work (a long
# video's chunk behind images arriving): then it goes first, so every item progresses
AGING_S = 1.0


class Overloaded(RuntimeError):
    """The modality's queue is full; retry after `retry_after_s`."""

    def __init__(self, msg: str, retry_after_s: float) -> None:
        super().__init__(msg)
        self.retry_after_s = retry_after_s


class ItemFailed(RuntimeError):
    """One item could not be encoded. `code`: timeout | oom | encode_error."""

    def __init__(self, item_id: str, code: str, reason: str) -> None:
        super().__init__(f"item {item_id!r}: {reason}")
        self.item_id, self.code, self.reason = item_id, code, reason


# `code` of a refused admission (epd_pool_rejected_total): a modality's queue full (the
# client gets 429 queue_full/overloaded), the feature budget full (503 over_budget); every
# one exported from the start at 0
QUEUE_FULL, BUDGET = "queue_full", "budget"
REJECT_CODES = (QUEUE_FULL, BUDGET)


@dataclass
class PoolStats:
    batches: int = 0
    items_encoded: int = 0
    items_failed: dict[str, int] = field(default_factory=dict)
    batch_sizes: list[int] = field(default_factory=list)  # last 1024 batches
    oom_failures: int = 0
    reuse_hits: int = 0
    chunked_items: int = 0  # videos encoded in chunks
    chunks: int = 0
    rejected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REJECT_CODES, 0))

    def fail(self, code: str) -> None:
        self.items_failed[code] = self.items_failed.get(code, 0) + 1

    def reject(self, code: str) -> None:
        """An admission refused, `code` one of REJECT_CODES."""
        self.rejected[code] += 1


@dataclass
class WholeItem:
    """The item a chunk job belongs to: its embedding assembling, and its waiters."""

    item_id: str
    assembly: Assembly
    future: asyncio.Future
    failed: bool = False
    undispatched: int = 0  # rows of its chunks not handed to a worker yet


@dataclass
class Waiter:
    """A formed batch waiting for a worker."""

    modality: str
    rest: int  # rows still to encode of its largest item
    since: float
    ticket: int

    def rank(self, now: float) -> tuple[int, int, int]:
        """Lower goes first: aged batches in arrival order, then shortest remaining work."""
        if now - self.since >= AGING_S:
            return (0, self.ticket, 0)
        return (1, self.rest, self.ticket)


def rows_left(jobs: list[Job]) -> int:
    return max((j.whole.undispatched if j.whole is not None else j.tokens) for j in jobs)


@dataclass
class Job:
    item: MediaItem
    tokens: int
    deadline: float
    enqueued: float
    future: asyncio.Future
    whole: WholeItem | None = None  # set on a chunk job
    chunk: int = 0


class Worker:
    """One encoder replica with its own thread; at most `max_inflight` batches outstanding."""

    _ids = itertools.count()

    def __init__(self, encoder: MediaEncoder, name: str | None = None, max_inflight: int = 1):
        self.encoder = encoder
        self.name = name or f"worker-{next(self._ids)}"
        self.max_inflight = max_inflight
        self.inflight = 0
        self.outstanding_tokens = 0
        self.batches = 0
        self.items = 0
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"epd-{self.name}")

    @property
    def eligible(self) -> bool:
        return self.inflight < self.max_inflight


class FormingBatch:
    """A batch being formed, under its item and token limits.

    `carry`: the job that did not fit the token budget (it opens the next batch); the first job
    always fits."""

    def __init__(self, first: Job, max_items: int, max_tokens: int) -> None:
        self.jobs = [first]
        self.max_items = max_items
        self.budget = max_tokens - first.tokens
        self.carry: Job | None = None

    @property
    def open(self) -> bool:
        return len(self.jobs) < self.max_items and self.carry is None

    def add(self, job: Job) -> None:
        if job.tokens > self.budget:
            self.carry = job
        else:
            self.jobs.append(job)
            self.budget -= job.tokens
