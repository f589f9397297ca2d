"""The front end of the rival benchmark's `vllm_epd` and `vllm_pd_text` deployments
(benchmarks/rivals.py): the flow of vLLM's disaggregated-encoder proxy
(examples/online_serving/disaggregated_encoder/disagg_epd_proxy.py), which is also vLLM's
P/D proxy's flow once the encoder is left out. Run as a script:
`rival_epd_front.py --port P [--encoder URL] --prefill URL --decode URL`.

For each chat request, as that proxy does it:
1. a request with media (image_url, audio_url, input_audio, video_url parts) goes first to
   the encoder (ECExampleConnector ec_producer) as it came, one token, not streamed; the
   front waits for its answer (an encoder failure is a 502, nothing retried);
2. the prefill instance (ec_consumer, NixlConnector) gets the request with
   `kv_transfer_params` `{"do_remote_decode": true, ...}`, one token, not streamed; its
   answer's `kv_transfer_params` (engine id, block ids, host, side-channel port) go into
3. the request the decode instance (NixlConnector) gets: the original request plus them;
   its answer is relayed as it streams.
Without an encoder (`vllm_pd_text`) step 1 never happens.

Timings (for rivals.py, in the gateway's log format so one parser reads both): one INFO line
per request at its end, `request rid=... encode_ms=... prefill_ms=... first_token_ms=...
total_ms=...`: prefill_ms from the prefill request sent to its whole answer read,
first_token_ms from the decode request sent to the first chunk of its answer (the gateway's
own `first_token_ms` for E/P/D counts the same: its decode leg sent -> first chunk).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import logging
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from encoder_service.local.processes import ManagedProcess  # noqa: E402

logger = logging.getLogger("epd.rival_front")
PATH = "/v1/chat/completions"
MM_TYPES = {"image_url", "audio_url", "input_audio", "video_url"}


def has_mm_input(body: dict[str, Any]) -> bool:
    for msg in body.get("messages") or []:
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, list) and any(
                isinstance(p, dict) and p.get("type") in MM_TYPES for p in content):
            return True
    return False


def _one_token(body: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(body)
    out.update(max_tokens=1, stream=False)
    out.pop("stream_options", None)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def encoder_body(body: dict[str, Any]) -> dict[str, Any]:
    """The encoder's request: the request itself, one token, not streamed."""
    return _one_token(body)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill instance's request: one token, its KV cache kept for a remote decode."""
    out = _one_token(body)
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False,
                                 "remote_engine_id": None, "remote_block_ids": None,
                                 "remote_host": None, "remote_port": None}
    return out


def decode_body(body: dict[str, Any], prefill_answer: Any) -> dict[str, Any]:
    """The decode instance's request: the original one plus the prefill answer's
    `kv_transfer_params` (none in the answer: the decode instance computes the prompt)."""
    out = dict(body)
    params = (prefill_answer or {}).get("kv_transfer_params") if isinstance(
        prefill_answer, dict) else None
    if params:
        out["kv_transfer_params"] = params
    return out


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


class EpdFront:
    def __init__(self, encoder: str | None, prefills: list[str], decodes: list[str],
                 timeout_s: float = 600.0) -> None:
        self.encoder = encoder
        self.prefills, self.decodes = itertools.cycle(prefills), itertools.cycle(decodes)
        self.client = httpx.AsyncClient(timeout=timeout_s,
                                        limits=httpx.Limits(max_connections=256))

    async def _hop(self, url: str, body: dict[str, Any], rid: str, what: str) -> Any:
        try:
            r = await self.client.post(url + PATH, json=body, headers={"x-request-id": rid})
        except httpx.HTTPError as exc:
            raise FrontError(f"{what}: {type(exc).__name__}: {exc}") from None
        if r.status_code != 200:
            raise FrontError(f"{what}: HTTP {r.status_code}: {r.text[:300]}")
        return r.json()

    async def prepare(self, body: dict[str, Any], rid: str, info: dict[str, str]
                      ) -> tuple[dict[str, Any], str]:
        """(the decode request, its URL), after the encode and the prefill."""
        if self.encoder and has_mm_input(body):
            t = time.perf_counter()
            await self._hop(self.encoder, encoder_body(body), rid, "encoder")
            info["encode_ms"] = _ms(time.perf_counter() - t)
        t = time.perf_counter()
        answer = await self._hop(next(self.prefills), prefill_body(body), rid, "prefill")
        info["prefill_ms"] = _ms(time.perf_counter() - t)
        return decode_body(body, answer), next(self.decodes)


class FrontError(RuntimeError):
    pass


def build_app(front: EpdFront):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    async def chat(request):
        t0 = time.perf_counter()
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        info: dict[str, str] = {}
        try:
            raw = await request.json()
        except ValueError:
            return JSONResponse({"error": {"message": "body is not JSON"}}, status_code=400)
        try:
            body, decode = await front.prepare(raw, rid, info)
        except FrontError as exc:
            logger.warning("request rid=%s failed: %s", rid, exc)
            return JSONResponse({"error": {"message": str(exc)}}, status_code=502)
        url = decode + PATH
        sent = time.perf_counter()
        if not body.get("stream"):
            r = await front.client.post(url, json=body, headers={"x-request-id": rid})
            _done(rid, info, time.perf_counter() - sent, t0)
            return Response(r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type"))
        req = front.client.build_request("POST", url, json=body,
                                         headers={"x-request-id": rid})
        r = await front.client.send(req, stream=True)

        async def relay():
            first = None
            try:
                async for chunk in r.aiter_raw():
                    if first is None and chunk:
                        first = time.perf_counter() - sent
                    yield chunk
            finally:
                await r.aclose()
                _done(rid, info, first, t0)

        return StreamingResponse(relay(), status_code=r.status_code,
                                 media_type=r.headers.get("content-type"))

    async def health(request):
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route(PATH, chat, methods=["POST"]), Route("/health", health)])


def _done(rid: str, info: dict[str, str], first: float | None, t0: float) -> None:
    logger.info("request rid=%s %s first_token_ms=%s total_ms=%s", rid,
                " ".join(f"{k}={v}" for k, v in info.items()), _ms(first),
                _ms(time.perf_counter() - t0))


@dataclass
class EpdFrontProcess(ManagedProcess):
    """This file as a process of its own (as our gateway runs in the benchmark); its log
    (`log_path`) holds the per-request timing lines."""

    name: str
    port: int
    work_dir: Path
    encoder: str = ""  # none: P/D only
    prefills: list[str] = field(default_factory=list)
    decodes: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        return [sys.executable, __file__, "--port", str(self.port),
                *(["--encoder", self.encoder] if self.encoder else []),
                *(x for u in self.prefills for x in ("--prefill", u)),
                *(x for u in self.decodes for x in ("--decode", u))]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--encoder")
    p.add_argument("--prefill", action="append", required=True)
    p.add_argument("--decode", action="append", required=True)
    a = p.parse_args(argv)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    import uvicorn

    uvicorn.run(build_app(EpdFront(a.encoder, a.prefill, a.decode)),  # type: ignore[arg-type]
                host="127.0.0.1", port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
