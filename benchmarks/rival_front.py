"""The front end of the rival benchmark's `ec_mooncake` deployment (benchmarks/rivals.py):
an OpenAI-compatible endpoint driving vLLM's ECMooncakeConnector the way it must be driven,
since our gateway speaks only our connector's protocol. Run as a script it serves one
encoder (ec_producer) and prefill/decode instances (ec_consumer):
`rival_front.py --port P --encoder URL --decoder URL=tcp://HOST:EC_PORT [--config JSON]`.

ECMooncakeConnector pushes (vllm/distributed/ec_transfer/ec_connector/mooncake/): the
producer's worker reserves room in the consumer's registered pool over the consumer's
control socket, writes the encoder output there with the Transfer Engine and tells the
consumer's scheduler it is ready; the consumer's scheduler holds a request until the push of
each of its items has arrived (60 s, then a retryable 500). So for each chat request:

1. the request is parsed and its media tagged as our gateway does it (`prepare_chat`: the
   same checks, a content id as each part's `uuid`, so both instances name the item alike);
2. the front picks the consumer (round-robin) before the encode, and gives every media part,
   in order, a transfer id of its own;
3. the encoder gets the media parts (`max_tokens` 1) with `ec_transfer_params`
   `{"consumer_zmq": "tcp://HOST:EC_PORT", "ec_items": [{"transfer_id": ...}, ...]}`
   (`consumer_zmq`: that consumer's `ec_ip`/`ec_port`; `ec_items` matched to the request's
   items by position: ECMooncakeScheduler._request_transfer_id; no `mm_hash`, which would
   have to echo the engine's own identifier);
4. once the encoder answered (as vLLM's EPD proxy example waits for its encoders), the
   consumer gets the request with `ec_transfer_params` `{"ec_items": [the same transfer
   ids]}`; media parts whose placeholder metadata the encoder returned (its
   `ec_transfer_params`: `{mm_hash: {"item_indices", "metadata", "transfer_id"}}`) become
   metadata-only parts (`metadata_only_body`, as our gateway and recent vLLM proxies send
   them; LLaVA has none, so its images go raw), and the answer is relayed as it streams.
An encoder failure is a 502 (vLLM's proxy does the same); nothing is retried.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from encoder_service.gateway.config import GatewayConfig  # noqa: E402
from encoder_service.gateway.media.parsing import metadata_only_body, prepare_chat  # noqa: E402
from encoder_service.gateway.wire import GatewayError  # noqa: E402
from encoder_service.local.processes import ManagedProcess  # noqa: E402


def media_parts(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The media parts of a prepared body (those `prepare_chat` gave a `uuid`), in prompt
    order, repeats kept: vLLM counts every occurrence as an item."""
    out = []
    for msg in body.get("messages", []):
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, list):
            out += [p for p in content if isinstance(p, dict) and "uuid" in p]
    return out


def encoder_body(body: dict[str, Any], model: str, consumer_zmq: str,
                 ec_items: list[dict[str, str]]) -> dict[str, Any]:
    """The producer's request: the media parts alone, one token, the push's destination."""
    out = {"model": model, "max_tokens": 1, "temperature": 0.0,
           "messages": [{"role": "user", "content": [
               *media_parts(body), {"type": "text", "text": "."}]}],
           "ec_transfer_params": {"consumer_zmq": consumer_zmq, "ec_items": ec_items}}
    for key in ("media_io_kwargs", "mm_processor_kwargs"):  # the same processing as PD's
        if key in body:
            out[key] = body[key]
    return out


def metadata_by_uuid(params: Any, uuids: list[str]) -> dict[str, dict[str, Any]]:
    """{uuid: placeholder metadata} from a producer's `ec_transfer_params` (keyed by the
    engine's identifier; `item_indices` are positions among the request's items)."""
    out: dict[str, dict[str, Any]] = {}
    if not isinstance(params, dict):
        return out
    for entry in params.values():
        if not isinstance(entry, dict) or not entry.get("metadata"):
            continue
        for i in entry.get("item_indices") or []:
            if isinstance(i, int) and 0 <= i < len(uuids):
                out[uuids[i]] = entry["metadata"]
    return out


def consumer_body(body: dict[str, Any], uuids: list[str], answer: Any,
                  ec_items: list[dict[str, str]]) -> dict[str, Any]:
    meta = metadata_by_uuid((answer or {}).get("ec_transfer_params"), uuids)
    out = metadata_only_body(body, meta)[0] if meta else dict(body)
    out["ec_transfer_params"] = {"ec_items": ec_items}
    return out


async def _no_fetch(url: str) -> tuple[bytes, str | None]:
    raise GatewayError(400, "this front takes data: URLs only", "bad_part")


class MooncakeFront:
    def __init__(self, cfg: GatewayConfig, encoder: str, decoders: list[tuple[str, str]],
                 timeout_s: float = 600.0) -> None:
        self.cfg, self.encoder = cfg, encoder
        self.decoders = itertools.cycle(decoders)
        self.client = httpx.AsyncClient(timeout=timeout_s,
                                        limits=httpx.Limits(max_connections=256))

    async def prepare(self, raw: Any) -> tuple[dict[str, Any], bool, str]:
        """(the consumer's request, streamed?, its URL), after the encode."""
        prepared = await prepare_chat(raw, self.cfg.media_rules, _no_fetch)
        body = prepared.body
        decoder, consumer_zmq = next(self.decoders)
        uuids = [p["uuid"] for p in media_parts(body)]
        if not uuids:
            return body, prepared.stream, decoder
        rid = uuid.uuid4().hex
        ec_items = [{"transfer_id": f"{rid}-{i}"} for i in range(len(uuids))]
        try:
            r = await self.client.post(
                self.encoder + "/v1/chat/completions", headers={"x-request-id": rid},
                json=encoder_body(body, self.cfg.model, consumer_zmq, ec_items))
        except httpx.HTTPError as exc:
            raise GatewayError(502, f"encoder: {type(exc).__name__}: {exc}",
                               "encoder_failed") from None
        if r.status_code != 200:
            raise GatewayError(502, f"encoder: HTTP {r.status_code}: {r.text[:300]}",
                               "encoder_failed")
        return consumer_body(body, uuids, r.json(), ec_items), prepared.stream, decoder


def build_app(front: MooncakeFront):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    async def chat(request):
        try:
            body, stream, decoder = await front.prepare(await request.json())
        except GatewayError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        except ValueError:
            return JSONResponse({"error": {"message": "body is not JSON"}}, status_code=400)
        url = decoder + "/v1/chat/completions"
        if not stream:
            r = await front.client.post(url, json=body)
            return Response(r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type"))
        req = front.client.build_request("POST", url, json=body)
        r = await front.client.send(req, stream=True)

        async def relay():
            try:
                async for chunk in r.aiter_raw():
                    yield chunk
            finally:
                await r.aclose()

        return StreamingResponse(relay(), status_code=r.status_code,
                                 media_type=r.headers.get("content-type"))

    async def health(request):
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/health", health)])


@dataclass
class FrontProcess(ManagedProcess):
    """This file as a process of its own (as our gateway runs in the benchmark)."""

    name: str
    port: int
    work_dir: Path
    encoder: str = ""
    decoders: list[tuple[str, str]] = field(default_factory=list)  # (url, consumer_zmq)
    model: str = ""
    config: dict = field(default_factory=dict)  # gateway config keys (limits)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        return [sys.executable, __file__, "--port", str(self.port), "--model", self.model,
                "--encoder", self.encoder, "--config", json.dumps(self.config),
                *(x for url, zmq in self.decoders for x in ("--decoder", f"{url}={zmq}"))]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--encoder", required=True)
    p.add_argument("--decoder", action="append", required=True, help="URL=tcp://HOST:PORT")
    p.add_argument("--config", default="{}", help="gateway config keys (JSON): limits")
    a = p.parse_args(argv)
    decoders = [tuple(d.split("=", 1)) for d in a.decoder]
    cfg = GatewayConfig.build({**json.loads(a.config), "model": a.model,
                               "decoders": [u for u, _ in decoders]})
    import uvicorn

    uvicorn.run(build_app(MooncakeFront(cfg, a.encoder, decoders)),  # type: ignore[arg-type]
                host="127.0.0.1", port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
