"""HTTP front of the encoder pool (FastAPI + uvicorn): `epd encoder --model DIR ...`.

POST /v1/encode   {"items": [{"id", "modality": "image" | "video" | "audio",
                               "data": base64 | data URL}],   (video: a data URL, a JPEG
                   frame list data:video/jpeg;base64,<f1>,<f2>,... or a container; audio:
                   what vLLM decodes, wav/flac/mp3/ogg at any rate; all decoded and
                   preprocessed by vLLM's own code: models.py)
                   "timeout_s"?, "keep"?, "on_failure"?: "text_only" | "fail"}
  200: {"items": {id: {"status": "ok", "num_embeds", "shape", "dtype", ...}
                  | {"status": "failed", "code", "error"}},
        "ec_transfer_params": {...}, "fallback": null | "text_only"}
       (failed items appear only under the text-only policy; the gateway then sends those
       items raw, and the decode instance encodes them itself)
  400: bad request or, under on_failure=fail, bad media (names the item)
  429 / 503 + Retry-After: queue full / memory budget full
  500 / 504: under on_failure=fail, an item failed to encode / missed its deadline
POST /v1/release  {"item_ids": [...], "keep"?}: the decode side has prefilled these items:
                  discard them (default) or keep them for multi-turn reuse
GET  /health, /metrics (Prometheus), /v1/stats (JSON)
With a deployment secret (transport `secret_file` or $EPD_SECRET_FILE), or `$VLLM_API_KEY`,
every /v1 route needs the deployment's API key (`Authorization: Bearer <key>`, as a vLLM
server of the deployment: ec_connectors.protocol.api_keys.server_api_key); 401 without it.
/health and /metrics stay open.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ec_connectors.protocol.api_keys import server_api_key
from ec_connectors.protocol.http_api import RequireKey
from encoder_service.encoder_pool.batching import EncoderPool
from encoder_service.encoder_pool.config import PoolConfig, PoolConfigError
from encoder_service.encoder_pool.encode_handler import (
    EncodeHandler,
    EncodeRequest,
    ReleaseRequest,
    invalid_request,
)
from encoder_service.encoder_pool.jobs import Worker
from encoder_service.encoder_pool.lifecycle import FeatureStore
from encoder_service.encoder_pool.metrics import make_registry
from encoder_service.encoder_pool.models import MediaEncoder, load_encoder
from encoder_service.encoder_pool.publish import Publisher
from epd_common.config_files import read_config_file

if TYPE_CHECKING:
    from ec_connectors.config import EPDConfig


def build_pool(config: PoolConfig, encoders: list[MediaEncoder] | None = None) -> EncoderPool:
    """Build the encoder pool's workers over the configured devices.

    Workers over `config.devices` (one encoder per device, shared by that device's
    workers), or over the given encoders (tests)."""
    if encoders is None:
        encoders = [load_encoder(config.model, device=d, dtype=config.dtype)
                    for d in config.devices]
    workers = [Worker(enc, name=f"{getattr(enc, 'device', 'dev')}-{i}-{j}")
               for i, enc in enumerate(encoders) for j in range(config.workers_per_device)]
    store = FeatureStore(config.cpu_budget_bytes, config.retain)
    return EncoderPool(workers, store, max_batch_size=config.max_batch_size,
                       max_batch_tokens=config.max_batch_tokens,
                       max_wait_ms=config.max_wait_ms, max_queue_items=config.max_queue_items,
                       retry_after_s=config.retry_after_s,
                       video_chunk_tokens=config.video_chunk_tokens)


def _stats(pool: EncoderPool) -> dict[str, Any]:
    """GET /v1/stats: the batcher's counters and the feature store's states and bytes."""
    s, store = pool.stats, pool.store
    return {"batches": s.batches, "items_encoded": s.items_encoded,
            "items_failed": s.items_failed, "rejected": s.rejected,
            "oom_failures": s.oom_failures, "reuse_hits": s.reuse_hits,
            "chunked_items": s.chunked_items, "chunks": s.chunks,
            "mean_batch_size": (sum(s.batch_sizes) / len(s.batch_sizes)
                                if s.batch_sizes else 0.0),
            "states": {k.value: v for k, v in store.counts().items()},
            "bytes": {"cpu": store.used}, "peak_bytes": {"cpu": store.peak},
            "budget_bytes": {"cpu": store.budget},
            "evictions": store.evictions,
            "workers": {w.name: {"batches": w.batches, "items": w.items}
                        for w in pool.workers}}


def create_app(config: PoolConfig, pool: EncoderPool | None = None,
               transport: EPDConfig | None = None) -> FastAPI:
    """Create the encoder pool's ASGI app.

    `transport`: `config.transport_config()` when the caller made it already (it reads
    the model's weights for their fingerprint)."""
    pool = pool or build_pool(config)
    transport = transport or config.transport_config()
    publisher = Publisher(transport, config.engine_id)
    registry, batch_hist = make_registry(pool, publisher)
    pool.on_batch = lambda size, _s: batch_hist.observe(size)
    handler = EncodeHandler(config, pool, publisher, transport.ids)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await pool.start()
        try:
            yield
        finally:
            await pool.stop()
            publisher.close()

    app = FastAPI(title="epd encoder pool", lifespan=lifespan)
    app.add_exception_handler(RequestValidationError, invalid_request)  # type: ignore[arg-type]
    app.state.pool, app.state.publisher, app.state.config = pool, publisher, config
    key = server_api_key(transport.secret_file)
    if key is not None:  # an encoder of the deployment, as its vLLM servers: keyed
        app.add_middleware(RequireKey, keys=[key], prefixes=("/v1",))

    @app.post("/v1/encode")
    async def encode(req: EncodeRequest) -> JSONResponse:
        return await handler(req)

    @app.post("/v1/release")
    async def release(req: ReleaseRequest) -> dict[str, str]:
        return {i: pool.store.release(i, req.keep).value for i in req.item_ids}

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = bool(publisher.transport.health().get("ok"))
        return JSONResponse({"ok": ok}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/stats")
    async def stats() -> dict[str, Any]:
        return _stats(pool)

    return app


def parse_config(argv: list[str] | None = None) -> PoolConfig:
    """Parse the encoder pool's CLI flags and config file into a PoolConfig.

    CLI flags over an optional config file (JSON, or TOML with suffix .toml); one
    validated PoolConfig."""
    p = argparse.ArgumentParser(prog="epd encoder", description="Batching encoder pool server")
    p.add_argument("--config", type=Path, help="PoolConfig fields (.json or .toml file)")
    p.add_argument("--model", type=Path)
    p.add_argument("--served-model-name")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--max-batch-size", type=int)
    p.add_argument("--max-wait-ms", type=float)
    p.add_argument("--max-queue-items", type=int)
    p.add_argument("--cpu-budget-bytes", type=int)
    p.add_argument("--retain", choices=["discard", "keep"])
    p.add_argument("--on-failure", choices=["text_only", "fail"])
    p.add_argument("--storage-path", help="safetensors transport directory (shared with the "
                                          "vLLM consumers)")
    args = p.parse_args(argv)
    values = read_config_file(args.config, error=PoolConfigError) if args.config else {}
    for key in ("model", "served_model_name", "host", "port", "max_batch_size", "max_wait_ms",
                "max_queue_items", "cpu_budget_bytes", "retain", "on_failure"):
        v = getattr(args, key)
        if v is not None:
            values[key] = v
    if args.storage_path:
        values.setdefault("transport", {})["storage_path"] = args.storage_path
    if "model" not in values:
        p.error("--model (or a config file with 'model') is required")
    return PoolConfig.from_dict(values)


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    try:
        config = parse_config(argv)
        transport = config.transport_config()  # its errors are config errors
    except (PoolConfigError, ValueError) as exc:
        print(f"epd encoder: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(create_app(config, transport=transport), host=config.host, port=config.port,
                log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
