"""E/P/D: the prefill hop between the encode and the decode request (`GatewayConfig.prefills`).

The prefill instance (a vLLM EC consumer with a KV connector, e.g. NixlConnector) gets the
decode request's body as it is (metadata-only parts and ec_transfer_params included) asking
for one token, not streamed, with `kv_transfer_params: {"do_remote_decode": true}`; its
answer's `kv_transfer_params` (engine id, block ids, host, port of its KV cache) go into the
body the decode instance gets, which then loads the prompt's KV cache instead of computing
it (vLLM's disaggregated-prefill protocol). Prefill instances are chosen by the request's
first item (rendezvous affinity with bounded loads, `routing.decoders`), with one retry on
another before the first byte (`DecodePool.open`); decode instances by load.

A handoff that cannot happen (no prefill instance answered, an error, an answer without
`kv_transfer_params`) is never a lost request: the decode request goes without them and the
decode instance computes the prompt itself; the reason is logged and counted
(`epd_kv_handoff_failures_total{reason}`). A handoff whose KV cache is gone by the time the
decode instance pulls it (prefill instance killed, blocks freed) is recomputed by the decode
instance itself (`kv_load_failure_policy: "recompute"`, which `epd up` sets).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from encoder_service.gateway.telemetry.metrics import GatewayMetrics
from encoder_service.gateway.upstreams.decoders import DecodePool, UpstreamError
from encoder_service.gateway.wire import DecodeError, GatewayError, json_decode, json_encode, ms

logger = logging.getLogger("epd.gateway")

PATH = "/v1/chat/completions"
# fields of the client's body that make no sense on the one-token prefill request
_DROPPED = ("stream", "stream_options", "max_completion_tokens", "min_tokens", "n",
            "logprobs", "top_logprobs", "kv_transfer_params")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill instance's request for a body.

    The prefill instance's request: `body` for one token, its KV cache kept for a decode
    instance to pull."""
    out = {k: v for k, v in body.items() if k not in _DROPPED}
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    return out


def handoff_params(answer: bytes) -> dict[str, Any] | None:
    """The `kv_transfer_params` of a prefill answer (None when it has none)."""
    try:
        body = json_decode(answer)
    except DecodeError:
        return None
    params = body.get("kv_transfer_params") if isinstance(body, dict) else None
    return params if isinstance(params, dict) and params.get("do_remote_prefill") else None


class KvHandoff:
    """The E/P/D KV-cache handoff from a prefill instance to a decode instance.

    The prefill pool and the hop; `start()` inside the running loop, `close()` at
    shutdown."""

    def __init__(self, pool: DecodePool, metrics: GatewayMetrics) -> None:
        self.pool = pool
        self.metrics = metrics

    async def start(self) -> None:
        await self.pool.start()

    async def close(self) -> None:
        await self.pool.close()

    async def prefill(self, body: dict[str, Any], rid: str, key: str | None,
                      info: dict[str, Any]) -> dict[str, Any] | None:
        """Prefill a request on a prefill instance for the decode request.

        Prefill `body` on a prefill instance; the kv_transfer_params for the decode
        request, or None when the handoff failed (logged, counted: the decode instance
        computes the prompt itself)."""
        t = time.perf_counter()
        reason, detail, params = "", "", None
        try:
            up = await self.pool.open("POST", PATH, json_encode(prefill_body(body)),
                                      f"{rid}-pre", key=key)
        except GatewayError as exc:
            reason, detail = "unavailable", exc.message
        else:
            info["prefill"] = up.url
            try:
                answer = await up.read()
            except UpstreamError as exc:
                reason, detail = "broken", str(exc)
            else:
                if up.status_code != 200:
                    reason, detail = "status", f"HTTP {up.status_code}: {answer[:300]!r}"
                elif (params := handoff_params(answer)) is None:
                    reason, detail = "no_params", "the answer carried no kv_transfer_params"
            finally:
                await up.release()
        seconds = time.perf_counter() - t
        self.metrics.stage_prefill.observe(seconds)
        if "prefill" in info:  # an instance answered (or broke off): its own histogram
            self.metrics.instance_first_token.labels(info["prefill"]).observe(seconds)
        info["prefill_ms"] = ms(seconds)
        if params is None:
            self.metrics.kv_handoff_failures.labels(reason).inc()
            info["kv_handoff"] = reason
            logger.warning("kv handoff failed rid=%s reason=%s detail=%s action=decode "
                           "instance computes the prompt itself", rid, reason, detail)
            return None
        self.metrics.kv_handoffs.inc()
        info["kv_handoff"] = "ok"
        return params
