"""Mid-stream failover: the I/O half.

Mid-stream failover, the I/O half: open the continuation of a broken answer on another
decode instance, as `failover.plan` decides (token-in from a clean cut, or a replay of the
same request), and hand the relay its stream with the repeated part set to be checked and
dropped. Everything here goes through `DecodePool.open`, so keys, deadlines and the
instance choice are the pool's."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from encoder_service.gateway.telemetry.metrics import RESUME, GatewayMetrics
from encoder_service.gateway.upstreams.decoders import DecodePool, Upstream, UpstreamError
from encoder_service.gateway.upstreams.failover import (
    GenerateToChat,
    StreamTracker,
    generate_request,
    plan,
    rendered_params,
    skip_for,
)
from encoder_service.gateway.wire import DecodeError, GatewayError, json_decode, json_encode

logger = logging.getLogger("epd.gateway")

_MAX_RENDER_BYTES = 1 << 24

# the continuation: its upstream, chunk iterator and first bytes
Resumed = tuple[Upstream, AsyncIterator[bytes], bytes]
# resume(tracker, failed_url) for one answer (tracker None: a whole answer, asked again)
ResumeFn = Callable[[StreamTracker | None, str], Awaitable[Resumed | None]]


class Resumer:
    """Continue broken answers on another instance.

    Continues broken answers on the other decode instances of `decoders`; under E/P/D,
    when none is usable, on a prefill instance of `prefills` (a whole vLLM server)."""

    def __init__(self, decoders: DecodePool, model: str, decode_timeout_s: float,
                 prefills: DecodePool | None = None, metrics: GatewayMetrics | None = None
                 ) -> None:
        self.decoders, self.model, self.timeout = decoders, model, decode_timeout_s
        self.prefills, self.metrics = prefills, metrics

    def bound(self, sent: dict[str, Any], rid: str) -> ResumeFn:
        """`resume` for the answer to `sent` (the body the decode instance was sent)."""

        def resume(tracker: StreamTracker | None, failed_url: str) -> Awaitable[Resumed | None]:
            return self.resume(sent, tracker, failed_url, rid)

        return resume

    async def resume(self, sent: dict[str, Any], tracker: StreamTracker | None,
                     failed_url: str, rid: str) -> Resumed | None:
        """Open another instance's continuation of a broken answer.

        Another instance continuing the answer `tracker` saw break off at `failed_url`
        (its upstream, chunk iterator and first bytes; `tracker` switched to it), or None
        when it cannot be continued exactly. `tracker` None: a non-streamed answer, asked
        again whole."""
        self.decoders.cool_down(failed_url)
        if tracker is None:
            up = await self._open("/v1/chat/completions", sent, rid, failed_url)
            return None if up is None else (up, up.chunks(), b"")
        rendered = await self._render(sent, rid, failed_url)
        how, cut = plan(sent, rendered_params(rendered), tracker)
        if how is None:
            logger.info("failover rid=%s not continued: %s", rid, cut)
            return None
        if how == "token_in":
            req = generate_request(rendered, sent, tracker, cut)
            up = None if req is None else await self._open(
                "/inference/v1/generate", req, rid, failed_url)
            if up is not None:
                to_chat = GenerateToChat(tracker.stream_id, str(sent.get("model", self.model)))
                tracker.resume(skip_for(tracker, cut))
                return up, _converted(up, to_chat), b""
            how, cut = plan(sent, None, tracker)  # no token-in API after all: replay?
            if how is None:
                return None
        up = await self._open("/v1/chat/completions", sent, rid, failed_url)
        if up is None:
            return None
        tracker.resume(skip_for(tracker, cut))
        return up, up.chunks(), b""

    async def _render(self, sent: dict[str, Any], rid: str, failed_url: str) -> Any:
        """Render the same request on another instance, for a token-in continuation.

        `/v1/chat/completions/render` of the same request on another instance (None: no
        token-in API there, or it refused)."""
        body = {k: v for k, v in sent.items() if k not in ("stream", "stream_options")}
        up = await self._open("/v1/chat/completions/render", body, rid, failed_url)
        if up is None:
            return None
        try:
            data = await asyncio.wait_for(up.read(), self.timeout)
            return json_decode(data) if len(data) < _MAX_RENDER_BYTES else None
        except (UpstreamError, asyncio.TimeoutError, DecodeError):
            return None
        finally:
            await up.release()

    async def _open(self, path: str, body: dict[str, Any], rid: str,
                    failed_url: str) -> Upstream | None:
        """Open a request on an instance other than the one that failed.

        `body` to `path` on an instance other than `failed_url`: the answer once it began
        with a 200, else None (released)."""
        content = json_encode(body)
        try:
            up = await self.decoders.open("POST", path, content, f"{rid}-resume",
                                          exclude={failed_url})
        except GatewayError as exc:  # no other instance, or none answered
            if self.prefills is None:
                logger.warning("failover rid=%s %s not possible: %s", rid, path, exc.message)
                return None
            try:  # E/P/D: the prefill instances are whole vLLM servers of the same model
                up = await self.prefills.open("POST", path, content, f"{rid}-resume",
                                              exclude={failed_url})
            except GatewayError as exc2:
                logger.warning("failover rid=%s %s not possible: %s; %s", rid, path,
                               exc.message, exc2.message)
                return None
            logger.info("failover rid=%s %s on prefill instance %s (no decode instance "
                        "usable)", rid, path, up.url)
            if self.metrics is not None and path != "/v1/chat/completions/render":
                self.metrics.prefill_answers.labels(RESUME).inc()
        if up.status_code != 200:
            try:
                why = (await asyncio.wait_for(up.read(), 5.0))[:300]
            except (UpstreamError, asyncio.TimeoutError):
                why = b""
            finally:
                await up.release()
            logger.warning("failover rid=%s %s on %s answered %d: %r", rid, path, up.url,
                           up.status_code, why)
            return None
        return up


async def _converted(up: Upstream, to_chat: GenerateToChat) -> AsyncIterator[bytes]:
    async for chunk in up.chunks():
        out = to_chat.feed(chunk)
        if out:
            yield out
