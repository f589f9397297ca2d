"""The front end of the rival benchmark's `vllm_epd` and `vllm_pd_text` deployments
(rivals/run.py): the flow of vLLM's disaggregated-encoder proxy
(examples/online_serving/disaggregated_encoder/disagg_epd_proxy.py), which is also vLLM's
P/D proxy's flow once the encoder is left out. Run as a module:
`python -m benchmarks.rivals.epd_front --port P [--encoder URL] --prefill URL --decode URL`.

For each chat request, as that proxy does it:
1. a request with media (image_url, audio_url, input_audio, video_url parts) goes first to
   the encoder (ECExampleConnector ec_producer) as it came, one token, not streamed; the
   front waits for its answer (an encoder failure is a 502, nothing retried);
2. the prefill instance (ec_consumer, NixlConnector) gets the request with
   `kv_transfer_params` `{"do_remote_decode": true, ...}`, one token, not streamed; its
   answer's `kv_transfer_params` (engine id, block ids, host, side-channel port) go into
3. the request the decode instance (NixlConnector) gets: the original request plus them;
   its answer is relayed as it streams.
Without an encoder (`vllm_pd_text`) step 1 never happens. Each request's log line
(benchmarks/harness/fronts.py) holds `encode_ms` and `prefill_ms` (each hop sent -> its
whole answer read) and `first_token_ms` (the decode request sent -> its first chunk).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.fronts import Front, FrontProcess, serve
from benchmarks.harness.report import ms

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


class EpdFront(Front):
    def __init__(self, encoder: str | None, prefills: list[str], decodes: list[str]) -> None:
        super().__init__()
        self.encoder = encoder
        self.prefills, self.decodes = itertools.cycle(prefills), itertools.cycle(decodes)

    async def prepare(self, body: dict[str, Any], rid: str, hops: dict[str, float | None]
                      ) -> tuple[dict[str, Any], str]:
        """(the decode request, its URL), after the encode and the prefill."""
        if self.encoder and has_mm_input(body):
            t = time.perf_counter()
            await self.hop(self.encoder, encoder_body(body), rid, "encoder")
            hops["encode_ms"] = ms(time.perf_counter() - t)
        t = time.perf_counter()
        answer = await self.hop(next(self.prefills), prefill_body(body), rid, "prefill")
        hops["prefill_ms"] = ms(time.perf_counter() - t)
        return decode_body(body, answer), next(self.decodes)


def process(name: str, port: int, work_dir: Path, *, encoder: str, prefills: list[str],
            decodes: list[str]) -> FrontProcess:
    """This front as a process of its own (no `encoder`: P/D only)."""
    return FrontProcess(name, port, work_dir, module="benchmarks.rivals.epd_front", args=[
        *(["--encoder", encoder] if encoder else []),
        *(x for u in prefills for x in ("--prefill", u)),
        *(x for u in decodes for x in ("--decode", u))])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--encoder")
    p.add_argument("--prefill", action="append", required=True)
    p.add_argument("--decode", action="append", required=True)
    a = p.parse_args(argv)
    serve(EpdFront(a.encoder, a.prefill, a.decode), a.port)


if __name__ == "__main__":
    main()
