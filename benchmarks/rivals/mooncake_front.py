"""The front end of the rival benchmark's `ec_mooncake` deployment (rivals/run.py): an
OpenAI-compatible endpoint driving vLLM's ECMooncakeConnector the way it must be driven,
since our gateway speaks only our connector's protocol. Run as a module it serves one
encoder (ec_producer) and prefill/decode instances (ec_consumer):
`python -m benchmarks.rivals.mooncake_front --port P --model M --encoder URL
--decoder URL=tcp://HOST:EC_PORT [--config JSON]`.

ECMooncakeConnector pushes (vllm/distributed/ec_transfer/ec_connector/mooncake/): the
producer's worker reserves room in the consumer's registered pool over the consumer's
control socket, writes the encoder output there with the Transfer Engine and tells the
consumer's scheduler it is ready; the consumer's scheduler holds a request until the push of
each of its items has arrived (then a retryable 500). So for each chat request:

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
   them; LLaVA has none, so its images go raw), and the answer is relayed as it streams
   (benchmarks/harness/fronts.py, which also logs each request's `encode_ms`).
An encoder failure is a 502 (vLLM's proxy does the same); nothing is retried.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.harness.fronts import Front, FrontError, FrontProcess, serve
from benchmarks.harness.report import ms
from encoder_service.gateway.config import GatewayConfig
from encoder_service.gateway.media.parsing import metadata_only_body, prepare_chat
from encoder_service.gateway.wire import GatewayError


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


class MooncakeFront(Front):
    def __init__(self, cfg: GatewayConfig, encoder: str, decoders: list[tuple[str, str]]
                 ) -> None:
        super().__init__()
        self.cfg, self.encoder = cfg, encoder
        self.decoders = itertools.cycle(decoders)

    async def prepare(self, body: dict[str, Any], rid: str, hops: dict[str, float | None]
                      ) -> tuple[dict[str, Any], str]:
        """(the consumer's request, its URL), after the encode."""
        try:
            prepared = await prepare_chat(body, self.cfg.media_rules, _no_fetch)
        except GatewayError as exc:
            raise FrontError(exc.status, exc.message, exc.body()) from None
        body = prepared.body
        decoder, consumer_zmq = next(self.decoders)
        uuids = [p["uuid"] for p in media_parts(body)]
        if not uuids:
            return body, decoder
        tid = uuid.uuid4().hex  # unique whatever request id the client sent
        ec_items = [{"transfer_id": f"{tid}-{i}"} for i in range(len(uuids))]
        t = time.perf_counter()
        answer = await self.hop(self.encoder, encoder_body(body, self.cfg.model, consumer_zmq,
                                                           ec_items), rid, "encoder")
        hops["encode_ms"] = ms(time.perf_counter() - t)
        return consumer_body(body, uuids, answer, ec_items), decoder


def process(name: str, port: int, work_dir: Path, *, encoder: str,
            decoders: list[tuple[str, str]], model: str, config: dict) -> FrontProcess:
    """This front as a process of its own: `decoders` as (URL, consumer_zmq), `config` the
    gateway config keys it parses requests with (limits)."""
    return FrontProcess(name, port, work_dir, module="benchmarks.rivals.mooncake_front", args=[
        "--model", model, "--encoder", encoder, "--config", json.dumps(config),
        *(x for url, zmq in decoders for x in ("--decoder", f"{url}={zmq}"))])


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
    serve(MooncakeFront(cfg, a.encoder, decoders), a.port)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
