"""The skeleton of a front end that is not our gateway (the rivals' fronts, benchmarks/
rivals/): a flow turns a client's chat request into the request the final instance answers,
the skeleton relays that answer and logs the request's timings.

A front serves `POST /v1/chat/completions` and `/health`. Per request: the body is read
(400 when it is not JSON), `Front.prepare` runs the flow's hops (a `FrontError` becomes its
status and body), the final request goes to the URL `prepare` named and its answer comes
back as it comes (streamed or whole). One INFO line per request at its end, in the
gateway's format so one parser reads both (rivals/report.py `hop_times`): `request rid=...
<hop>_ms=... first_token_ms=... total_ms=...`, where first_token_ms runs from the final
request sent to the first chunk of its answer (the gateway's own `first_token_ms` for E/P/D
counts the same) and each hop is what `prepare` recorded. `FrontProcess` runs a front's
module as a process of its own, as our gateway runs in the benchmarks; `serve` is that
module's end.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness.env import pythonpath_env
from benchmarks.harness.report import ms
from encoder_service.local.processes import ManagedProcess

logger = logging.getLogger("epd.rival_front")
PATH = "/v1/chat/completions"


class FrontError(RuntimeError):
    """A request the front answers itself: `status`, and the JSON `body` (by default
    `{"error": {"message": ...}}`)."""

    def __init__(self, status: int, message: str, body: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body or {"error": {"message": message}}


class Front:
    """A flow: `prepare` turns the client's body into (the final request, the URL of the
    instance that answers it), recording each hop's time (ms) in `hops`."""

    def __init__(self, timeout_s: float = 600.0) -> None:
        self.client = httpx.AsyncClient(timeout=timeout_s,
                                        limits=httpx.Limits(max_connections=256))

    async def prepare(self, body: dict[str, Any], rid: str, hops: dict[str, float | None]
                      ) -> tuple[dict[str, Any], str]:
        raise NotImplementedError

    async def hop(self, url: str, body: dict[str, Any], rid: str, what: str) -> Any:
        """POST `body` to `url`'s chat route and read its JSON answer; a failure is a 502
        naming `what` (nothing is retried, as vLLM's proxies do)."""
        try:
            r = await self.client.post(url + PATH, json=body, headers={"x-request-id": rid})
        except httpx.HTTPError as exc:
            raise FrontError(502, f"{what}: {type(exc).__name__}: {exc}") from None
        if r.status_code != 200:
            raise FrontError(502, f"{what}: HTTP {r.status_code}: {r.text[:300]}")
        return r.json()


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _done(rid: str, hops: dict[str, float | None], first_s: float | None, t0: float) -> None:
    logger.info("request rid=%s %s first_token_ms=%s total_ms=%s", rid,
                " ".join(f"{k}={_fmt(v)}" for k, v in hops.items()), _fmt(ms(first_s)),
                _fmt(ms(time.perf_counter() - t0)))


def build_app(front: Front):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    async def chat(request):
        t0 = time.perf_counter()
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        hops: dict[str, float | None] = {}
        try:
            raw = await request.json()
        except ValueError:
            return JSONResponse({"error": {"message": "body is not JSON"}}, status_code=400)
        try:
            body, url = await front.prepare(raw, rid, hops)
        except FrontError as exc:
            logger.warning("request rid=%s failed: %s", rid, exc)
            return JSONResponse(exc.body, status_code=exc.status)
        headers = {"x-request-id": rid}
        sent = time.perf_counter()
        if body.get("stream") is not True:
            r = await front.client.post(url + PATH, json=body, headers=headers)
            _done(rid, hops, time.perf_counter() - sent, t0)
            return Response(r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type"))
        r = await front.client.send(front.client.build_request("POST", url + PATH, json=body,
                                                               headers=headers), stream=True)

        async def relay():
            first = None
            try:
                async for chunk in r.aiter_raw():
                    if first is None and chunk:
                        first = time.perf_counter() - sent
                    yield chunk
            finally:
                await r.aclose()
                _done(rid, hops, first, t0)

        return StreamingResponse(relay(), status_code=r.status_code,
                                 media_type=r.headers.get("content-type"))

    async def health(request):
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route(PATH, chat, methods=["POST"]), Route("/health", health)])


def serve(front: Front, port: int) -> None:
    """Serve `front` on 127.0.0.1:`port` until stopped, its request lines on stderr."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    import uvicorn

    uvicorn.run(build_app(front), host="127.0.0.1", port=port, log_level="warning")


@dataclass
class FrontProcess(ManagedProcess):
    """A front's module (`python -m <module> --port P <args>`) as a process of its own; its
    log (`log_path`) holds the per-request timing lines."""

    name: str
    port: int
    work_dir: Path
    module: str = ""
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        return [sys.executable, "-m", self.module, "--port", str(self.port), *self.args]

    def child_env(self) -> dict[str, str]:
        return {**os.environ, **pythonpath_env()}
