"""Share encoder calls between concurrent requests' new images.

`CoalescingClient`: concurrent requests' new images share calls to an encoder whose cost
is per call rather than per item (a vLLM encoder). Video and audio, and items with other
processor settings, never share; a shared call the encoder refuses for its content is split
back into its requests, so a bad item fails its own request only."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from encoder_service.gateway.media.parsing import MediaPart
from encoder_service.gateway.telemetry import tracing
from encoder_service.gateway.upstreams.encoder_clients import (
    EncoderClient,
    EncoderFailed,
    PoolEncoderClient,
    VllmEncoderClient,
)
from encoder_service.gateway.upstreams.encoder_progress import EncoderProgress, EncoderSilent


@dataclass
class _Waiter:
    items: Sequence[MediaPart]
    request_id: str
    future: asyncio.Future[dict[str, Any]]
    # what must match for two requests' items to share a call (None: never shares): the
    # request's canonical settings, which its items' ids already cover
    key: bytes | None = field(init=False)
    # the trace its request's calls join (tracing.py; None: not traced): a shared call
    # joins its first request's
    trace: tuple | None = field(init=False, default_factory=tracing.active)

    def __post_init__(self) -> None:
        self.key = (None if any(it.modality != "image" for it in self.items)
                    else self.items[0].settings)


_SPLIT_ON = frozenset({400, 413, 422})  # the encoder refused the content, not the call
# vLLM's refusal of a prompt over `--limit-mm-per-prompt` (multimodal/processing/context.py)
_PER_PROMPT = re.compile(r"At most (\d+) image\(s\) may be provided in one prompt")
logger = logging.getLogger("epd.gateway")


class CoalescingClient:
    """An encoder client that batches concurrent requests' images into shared calls.

    An EncoderClient in front of one whose cost is per call rather than per item (a vLLM
    encoder: its API server and engine work per request; docs/benchmarks.md, "Shared calls to
    vLLM encoders", has the CPU per image by call size): concurrent requests' new images
    share calls. At most `max_calls` calls are in flight; images that arrive while
    they all are wait and go together in the next (no timer: an idle encoder gets a request
    at once), at most `max_items` per call, only with the same processor settings. Video and
    audio go alone at once (their cost is the encode, and their token counts could overflow
    one prompt). A shared call the encoder refuses for its content (400/413/422: one bad
    item, a prompt too long) is split back into its requests, each sent alone, so a bad item
    fails its own request only; one refused for vLLM's `--limit-mm-per-prompt` also lowers
    `max_items` to that limit for every later call (a shared call it would refuse again costs
    the encoder a parse and the requests a round trip). Every wait has a deadline: the
    inner client's `progress` rules where it has them (encoder_progress.py: a request
    queued behind calls waits while the encoder answers them), else `timeout_s`."""

    def __init__(self, inner: EncoderClient, max_items: int, max_calls: int,
                 timeout_s: float, on_call: Callable[[int], None] | None = None) -> None:
        self.inner = inner
        self.name = inner.name
        self.max_items = max_items
        self.max_calls = max_calls
        self.timeout_s = timeout_s
        self.on_call = on_call  # items per call sent (a metric)
        self._queue: list[_Waiter] = []
        self._calls = 0
        self._tasks: set[asyncio.Task] = set()

    @property
    def waiting(self) -> int:
        """Images waiting for a shared call (every call slot busy): a load signal."""
        return sum(len(w.items) for w in self._queue)

    async def encode(self, items: Sequence[MediaPart], request_id: str) -> dict[str, Any]:
        waiter = _Waiter(items, request_id, asyncio.get_running_loop().create_future())
        if waiter.key is None or len(items) >= self.max_items:
            return await self._alone(waiter)
        self._queue.append(waiter)
        self._pump()
        progress: EncoderProgress | None = getattr(self.inner, "progress", None)
        try:
            if progress is None:
                return await asyncio.wait_for(asyncio.shield(waiter.future), self.timeout_s)
            # queued behind calls in flight: waits while the encoder answers them
            return await progress.within(asyncio.shield(waiter.future), counted=False)
        except asyncio.TimeoutError:
            raise EncoderFailed(f"{self.name}: no answer within {self.timeout_s} s") from None
        except EncoderSilent as exc:
            raise EncoderFailed(f"{self.name}: {exc}") from None
        finally:
            if waiter in self._queue:  # timed out or cancelled before its call went out
                self._queue.remove(waiter)
            waiter.future.cancel()  # no-op once answered; else its call's answer is dropped

    async def _alone(self, waiter: _Waiter) -> dict[str, Any]:
        if self.on_call is not None:
            self.on_call(len(waiter.items))
        return await self.inner.encode(waiter.items, waiter.request_id)

    def _pump(self) -> None:
        while self._queue and self._calls < self.max_calls:
            first = self._queue.pop(0)
            batch, n = [first], len(first.items)
            for w in list(self._queue):
                if w.key == first.key and n + len(w.items) <= self.max_items:
                    self._queue.remove(w)
                    batch.append(w)
                    n += len(w.items)
            self._calls += 1
            task = asyncio.ensure_future(self._send(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, batch: list[_Waiter]) -> None:
        tracing.activate(batch[0].trace)  # this task's own context, whoever pumped it
        try:
            if len(batch) == 1:
                results: list[Any] = [await _settled(self._alone(batch[0]))]
            else:
                items = list({it.item_id: it for w in batch for it in w.items}.values())
                rid = f"{batch[0].request_id}+{len(batch) - 1}"
                if self.on_call is not None:
                    self.on_call(len(items))
                made = await _settled(self.inner.encode(items, rid))
                if isinstance(made, EncoderFailed) and made.status in _SPLIT_ON:
                    self._learn_limit(made, len(items))
                    results = await asyncio.gather(*(_settled(self._alone(w)) for w in batch))
                else:
                    results = [made if isinstance(made, BaseException) else
                               {it.item_id: made[it.item_id] for it in w.items
                                if it.item_id in made} for w in batch]
            for w, result in zip(batch, results, strict=True):
                if w.future.done():
                    continue
                if isinstance(result, BaseException):
                    w.future.set_exception(result)
                else:
                    w.future.set_result(result)
        finally:
            for w in batch:  # cancelled mid-call (shutdown): nobody waits forever
                if not w.future.done():
                    w.future.set_exception(EncoderFailed(f"{self.name}: call cancelled"))
            self._calls -= 1
            self._pump()

    def _learn_limit(self, refusal: EncoderFailed, sent: int) -> None:
        """Lower `max_items` to the per-prompt image limit a refusal of `sent` items names."""
        m = _PER_PROMPT.search(str(refusal))
        if m is None:
            return
        limit = max(1, int(m.group(1)))
        if limit < min(self.max_items, sent):
            logger.warning("encoder %s takes at most %d image(s) per prompt (vLLM's "
                           "--limit-mm-per-prompt); its shared calls now carry at most %d "
                           "(set routing.coalesce_items to %d to skip this refusal)",
                           self.name, limit, limit, limit)
            self.max_items = limit


async def _settled(call: Awaitable[dict[str, Any]]) -> dict[str, Any] | EncoderFailed:
    """The call's answer, or its EncoderFailed as a value (one result per waiter)."""
    try:
        return await call
    except EncoderFailed as exc:
        return exc


class EncoderClientMaker:
    """Make the right encoder client for an encoder URL.

    `maker(url)`: the client of the encoder at `url`: an `epd encoder` pool's (it batches
    across calls itself), else a vLLM producer's behind a coalescing client (`coalesce_items`
    1: every request alone, still counted)."""

    def __init__(self, pool_encoders: bool, model: str, client: httpx.AsyncClient,
                 timeout_s: float, coalesce_items: int, encoder_calls: int,
                 observe_items: Callable[[float], None]) -> None:
        self.pool_encoders, self.model, self.client = pool_encoders, model, client
        self.timeout_s = timeout_s
        self.coalesce_items, self.encoder_calls = coalesce_items, encoder_calls
        self.observe_items = observe_items

    def __call__(self, url: str) -> EncoderClient:
        if self.pool_encoders:
            return PoolEncoderClient(url, self.client, self.timeout_s)
        return CoalescingClient(VllmEncoderClient(url, self.model, self.client, self.timeout_s),
                                self.coalesce_items, self.encoder_calls, self.timeout_s,
                                self.observe_items)
