"""Encoder pool -> real vLLM, end to end: a vLLM encoder-only producer and a vLLM
prefill/decode consumer (EPDConnector, safetensors transport) on the tiny LLaVA, and the
pool's HTTP server publishing into the same storage.

1. The pool's embedding of an image is close (bf16 tolerance) to the one vLLM's producer
   saves for it.
2. A vLLM consumer fed the pool's embedding (it really loads it: loads_total + 1) answers
   with the same greedy tokens as vLLM computing the image itself (the consumer's own
   vision tower on an id nobody published: the aggregated path, loads_total unchanged)."""

from __future__ import annotations

import base64
import time

import httpx
import pytest
import torch

from ec_connectors.transports.safetensors_fs import SafetensorsTransport
from encoder_service.encoder_pool.config import PoolConfig
from encoder_service.encoder_pool.server import create_app
from encoder_service.local.processes import VllmServer, metric_value, start_all
from encoder_service.local.requests import chat_body, sample_image_png
from encoder_service.local.testmodel import SPECS, build
from encoder_service.local.up import epd_config
from tests.e2e.client import MODEL_NAME
from tests.helpers import WORK, Served, wait_for

PROMPT = "what is in this picture"
BASE_PORT = 18420


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = build(WORK / "models" / "tiny-llava", SPECS["tiny"])
    storage = tmp_path_factory.mktemp("pool-ec-store")
    logs = WORK / "test-pool-e2e"
    prod = VllmServer("pool-e2e-producer", model, BASE_PORT, logs,
                      epd_config("ec_producer", storage), cpu_core=0)
    cons = VllmServer("pool-e2e-consumer", model, BASE_PORT + 1, logs,
                      epd_config("ec_consumer", storage), cpu_core=1)
    start_all([prod, cons], progress=lambda m: print(f"[pool-e2e] {m}", flush=True))
    cfg = PoolConfig.from_dict({"model": model, "served_model_name": MODEL_NAME,
                                "transport": {"storage_path": str(storage)}})
    try:
        with Served(create_app(cfg), BASE_PORT + 2) as pool, httpx.Client(timeout=120) as c:
            yield {"prod": prod, "cons": cons, "pool": pool, "client": c, "storage": storage}
    finally:
        prod.stop()
        cons.stop()


def chat(c, server, image, item_id, params=None, max_tokens=8) -> dict:
    r = c["client"].post(server.url + "/v1/chat/completions",
                         json=chat_body(MODEL_NAME, image, PROMPT, item_id=item_id,
                                        max_tokens=max_tokens, ec_transfer_params=params))
    assert r.status_code == 200, r.text
    return r.json()


def pool_encode(c, image, item_id) -> dict:
    r = c["client"].post(c["pool"].url + "/v1/encode", json={"items": [
        {"id": item_id, "data": base64.b64encode(image).decode()}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["items"][item_id]["status"] == "ok", body
    return body["ec_transfer_params"]


def loads(c) -> float:
    text = c["client"].get(c["cons"].url + "/metrics").text
    return metric_value(text, "vllm:epd_loads_total")


def test_pool_embedding_matches_the_vllm_producers(cluster):
    c = cluster
    reader = SafetensorsTransport(c["storage"], MODEL_NAME, 1 << 30)
    for seed in (11, 12):
        image = sample_image_png(seed)
        chat(c, c["prod"], image, f"vllm-{seed}", max_tokens=1)
        pool_encode(c, image, f"pool-{seed}")
        from_vllm = reader.get(f"vllm-{seed}", deadline=time.monotonic() + 10)
        from_pool = reader.get(f"pool-{seed}", deadline=time.monotonic() + 10)
        assert from_vllm is not None and from_pool is not None
        assert from_pool.shape == from_vllm.shape == (64, 128)
        assert from_pool.dtype == from_vllm.dtype == torch.bfloat16
        torch.testing.assert_close(from_pool.float(), from_vllm.float(), rtol=0.02, atol=0.03)
        other = reader.get("vllm-11", deadline=time.monotonic() + 1)
        if seed == 12:  # and it is not close to a different image's embedding
            assert not torch.allclose(from_pool.float(), other.float(), rtol=0.02, atol=0.03)


def test_vllm_consumer_fed_by_the_pool_answers_like_vllm_itself(cluster):
    c = cluster
    for seed in (21, 22):
        image = sample_image_png(seed)
        before = loads(c)
        reference = chat(c, c["cons"], image, f"local-{seed}")["choices"][0]["token_ids"]
        time.sleep(1.0)  # vLLM publishes connector stats a step later
        assert loads(c) == before, "the reference must be the consumer's own encode"
        params = pool_encode(c, image, f"pool-chat-{seed}")
        answer = chat(c, c["cons"], image, f"pool-chat-{seed}", params)
        assert answer["choices"][0]["token_ids"] == reference and reference
        assert wait_for(lambda b=before: loads(c) >= b + 1, timeout=15, interval=0.2)
