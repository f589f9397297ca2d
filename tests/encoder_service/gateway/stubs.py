"""Stand-ins for the gateway's upstreams, shared by its fast-lane test modules: `Stub`, a
recording stand-in for a vLLM server over real HTTP (uvicorn), `FakeEncoder`, an in-process
EncoderClient for router logic, and `Lab`, which starts stubs and real gateways on one test
module's own ports (modules run side by side under xdist). The e2e tests
(tests/e2e/test_gateway.py) use real vLLM servers instead."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from encoder_service.gateway.config import GatewayConfig
from encoder_service.gateway.media.parsing import MediaPart
from encoder_service.gateway.server import GatewayThread
from encoder_service.gateway.upstreams.encoder_clients import EncoderFailed
from encoder_service.local.processes import metric_value
from tests.helpers import free_port

MODEL = "tiny-llava"


def _uuids(body: dict[str, Any]) -> list[str]:
    return [p["uuid"] for m in body["messages"] for p in m["content"]
            if isinstance(p, dict) and "uuid" in p]


def _has_embeds(body: dict[str, Any]) -> bool:
    return any(p.get("type", "").endswith("_embeds") for m in body["messages"]
               for p in m["content"] if isinstance(p, dict))


async def _failed_stream() -> AsyncIterator[str]:
    """vLLM streams the role chunk before the engine runs, then the engine's error."""
    yield 'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}\n\n'
    yield 'data: {"error": {"message": "Internal server error", "code": 500}}\n\n'
    yield "data: [DONE]\n\n"


async def _stream(ids: bool, break_at_end: bool = False) -> AsyncIterator[str]:
    """Three chunks a, b, c (c finishes); vLLM's token ids when asked (the prompt's in the
    first). `break_at_end`: the connection breaks off where [DONE] would come."""
    for i, t in enumerate(("a", "b", "c")):
        event: dict[str, Any] = {"t": t, **({"prompt_token_ids": [1, 2]} if ids and not i
                                            else {})}
        if ids:
            event["choices"] = [{"delta": {"content": t}, "token_ids": [i],
                                 "finish_reason": "stop" if t == "c" else None}]
        yield f"data: {json.dumps(event)}\n\n"
    if break_at_end:
        raise ConnectionAbortedError("the stub breaks the stream off")  # no last chunk
    yield "data: [DONE]\n\n"


async def _stalled(stall_s: float, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    """vLLM's role chunk at once, then `stall_s` before the answer (an engine still busy)."""
    yield 'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}\n\n'
    await asyncio.sleep(stall_s)
    async for event in rest:
        yield event


class Stub:
    """A recording stand-in for a vLLM server: answers chat completions (streamed or not),
    returns producer-style ec_transfer_params, can be told to fail."""

    def __init__(self, role: str, port: int) -> None:
        self.role = role
        self.calls: list[dict] = []
        self.headers: list[dict[str, str]] = []  # each chat call's request headers
        self.fail = False
        self.metadata: dict | None = None  # encoder: placeholder metadata it publishes
        self.fail_metadata_only = False  # decoder: fail requests with *_embeds parts
        self.refusal: tuple[int, dict] | None = None  # decoder: answer this (status, body)
        self.delay = 0.0  # seconds before answering
        self.serial = False  # answer chat calls one at a time (vLLM's queue of long encodes)
        self._one_at_a_time = asyncio.Lock()
        self.break_at_end = False  # decoder: streams break off after the finishing chunk
        self.stall_s = 0.0  # decoder: a stream's role chunk, then this long before the rest
        self.netloc = f"127.0.0.1:{port}"  # an encoder names itself as its items' location
        self.url = f"http://{self.netloc}"
        app = Starlette(routes=[Route("/v1/chat/completions", self._chat, methods=["POST"]),
                                Route("/v1/completions", self._completions, methods=["POST"]),
                                Route("/health", self._health)])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                                    log_level="error"))
        self.server.install_signal_handlers = lambda: None
        threading.Thread(target=self.server.run, daemon=True).start()
        while not self.server.started:
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True

    async def _chat(self, request: Request) -> Response:
        body = await request.json()
        self.calls.append(body)
        self.headers.append(dict(request.headers))
        if self.serial:
            async with self._one_at_a_time:
                await asyncio.sleep(self.delay)
        else:
            await asyncio.sleep(self.delay)
        if self.fail:
            return JSONResponse({"error": "boom"}, status_code=500)
        handoff = body.get("kv_transfer_params") == {"do_remote_decode": True}
        if self.role == "prefill" and handoff:  # E/P/D: one token, the KV kept for a decode
            return JSONResponse({"choices": [{"message": {"content": "o"}}],
                                 "kv_transfer_params": {
                                     "do_remote_prefill": True, "remote_block_ids": [1, 2],
                                     "remote_engine_id": self.netloc}})
        if self.role == "encoder":
            extra = {"metadata": self.metadata} if self.metadata else {}
            return JSONResponse({"choices": [], "ec_transfer_params": {
                "epd": {"items": {i: {"location": self.netloc, **extra}
                                  for i in _uuids(body)}}}})
        return self._decode(body)

    def _decode(self, body: dict[str, Any]) -> Response:
        embeds = _has_embeds(body)
        if self.refusal is not None and (embeds or not self.fail_metadata_only):
            return JSONResponse(self.refusal[1], status_code=self.refusal[0])
        if embeds and self.fail_metadata_only:
            if not body.get("stream"):  # vLLM: the engine failed the request
                return JSONResponse({"error": {"message": "Internal server error"}},
                                    status_code=500)
            return StreamingResponse(_failed_stream(), media_type="text/event-stream")
        if body.get("stream"):
            events = _stream(body.get("return_token_ids") is True, self.break_at_end)
            if self.stall_s:
                events = _stalled(self.stall_s, events)
            return StreamingResponse(events, media_type="text/event-stream")
        return JSONResponse({"choices": [{"message": {"content": "ok"}}],
                             "seen": _uuids(body)})

    async def _health(self, request: Request) -> Response:
        return JSONResponse({})

    async def _completions(self, request: Request) -> Response:  # the gateway's probes
        await asyncio.sleep(self.delay)
        if self.fail:
            return JSONResponse({"error": "boom"}, status_code=500)
        return JSONResponse({"choices": [{"text": "."}]})


class Lab:
    """Stubs and gateways on one test module's own ports."""

    def __init__(self, ports: Iterable[int]) -> None:
        self.ports = iter(ports)

    def port(self) -> int:
        return free_port(self.ports)

    def stub(self, role: str) -> Stub:
        return Stub(role, self.port())

    def gateway(self, enc: list[str], dec: list[str], **extra: Any) -> GatewayThread:
        """A started gateway in front of `enc` and `dec` (probes off unless `routing` says)."""
        extra.setdefault("routing", {"probe_interval_s": 0})  # probes: test_routing.py
        cfg = GatewayConfig.build({"port": self.port(), "model": MODEL, "encoders": enc,
                                   "decoders": dec, **extra})
        return GatewayThread(cfg).start()


def post(gw: GatewayThread, body: Any, **kw: Any) -> httpx.Response:
    return httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=10, **kw)


def body_with_url(url: str) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]}]}


def parts_request(*parts: dict, **extra: Any) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": [
        *parts, {"type": "text", "text": "hi"}]}], **extra}


def metric(gw: GatewayThread, name: str) -> float:
    return metric_value(httpx.get(gw.url + "/metrics").text, name)


class FakeEncoder:
    """Unit-test stand-in for an EncoderClient (router logic only)."""

    def __init__(self, name: str, fail: bool = False, delay: float = 0.0) -> None:
        self.name, self.fail, self.delay = name, fail, delay
        self.calls: list[list[str]] = []

    async def encode(self, items, request_id):
        self.calls.append([it.item_id for it in items])
        await asyncio.sleep(self.delay)
        if self.fail:
            raise EncoderFailed(f"{self.name} down")
        return {it.item_id: {"by": self.name} for it in items}


def items(n: int) -> list[MediaPart]:
    return [MediaPart(f"i{k}", "image", 1, {}) for k in range(n)]
