"""Encoder pool -> real vLLM, end to end: a vLLM encoder-only producer and a vLLM
prefill/decode consumer (EPDConnector, safetensors transport) on the tiny LLaVA, and the
pool's HTTP server publishing into the same storage.

1. The pool's embedding of an image is bit-identical to the one vLLM's producer saves for
   it (the pool runs vLLM's own media IO, processor and tower: encoder_pool/models.py).
2. A vLLM consumer fed the pool's embedding (it really loads it: loads_total + 1) answers
   with the same greedy tokens as vLLM computing the image itself (the consumer's own
   vision tower on an id nobody published: the aggregated path, loads_total unchanged)."""

from __future__ import annotations

import base64
import io
import time

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from ec_connectors.transports.safetensors_fs import SafetensorsTransport
from encoder_service.encoder_pool.config import PoolConfig
from encoder_service.encoder_pool.server import create_app
from encoder_service.local.processes import VllmServer, start_all
from encoder_service.local.requests import sample_image_png
from encoder_service.local.testmodels import SPECS, build
from encoder_service.local.up import epd_config
from tests.e2e.client import MODEL_NAME, ask, metric
from tests.helpers import WORK, Served, port_block, wait_for

BASE_PORT = port_block(__name__)[0]


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


MIME = {13: "image/jpeg"}


def pool_encode(c, image, item_id) -> dict:
    r = c["client"].post(c["pool"].url + "/v1/encode", json={"items": [
        {"id": item_id, "data": base64.b64encode(image).decode()}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["items"][item_id]["status"] == "ok", body
    return body["ec_transfer_params"]


def exif_rotated_jpeg(seed: int) -> bytes:
    """A photo stored sideways with EXIF orientation 6 (shown rotated 90 degrees)."""
    rng = np.random.default_rng(seed)
    img = Image.fromarray((rng.random((80, 140, 3)) * 255).astype("uint8"))
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    img.save(buf, format="JPEG", exif=exif.tobytes())
    return buf.getvalue()


def transparent_png(seed: int) -> bytes:
    """An RGBA image with a transparent half (vLLM composes it onto white)."""
    rng = np.random.default_rng(seed)
    rgba = (rng.random((112, 112, 4)) * 255).astype("uint8")
    rgba[:, :56, 3] = 0
    buf = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(buf, format="PNG")
    return buf.getvalue()


def test_pool_embedding_matches_the_vllm_producers(cluster):
    """Including a photo with EXIF orientation and a transparent PNG: the pool decodes as
    vLLM does (rotation applied, transparency onto white)."""
    c = cluster
    reader = SafetensorsTransport(c["storage"], MODEL_NAME, 1 << 30)
    images = {11: sample_image_png(11), 12: sample_image_png(12), 13: exif_rotated_jpeg(13),
              14: transparent_png(14)}
    for seed, image in images.items():
        ask(c, c["prod"], image, f"vllm-{seed}", max_tokens=1, mime=MIME.get(seed))
        pool_encode(c, image, f"pool-{seed}")
        from_vllm = reader.get(f"vllm-{seed}", deadline=time.monotonic() + 10)
        from_pool = reader.get(f"pool-{seed}", deadline=time.monotonic() + 10)
        assert from_vllm is not None and from_pool is not None
        assert from_pool.shape == from_vllm.shape == (64, 128)
        assert from_pool.dtype == from_vllm.dtype == torch.bfloat16
        assert torch.equal(from_pool, from_vllm), seed
        other = reader.get("vllm-11", deadline=time.monotonic() + 1)
        if seed == 12:  # and it is not close to a different image's embedding
            assert not torch.allclose(from_pool.float(), other.float(), rtol=0.02, atol=0.03)


def test_vllm_consumer_fed_by_the_pool_answers_like_vllm_itself(cluster):
    c = cluster
    for seed in (21, 22):
        image = sample_image_png(seed)
        before = metric(c, "loads_total")
        reference = ask(c, c["cons"], image, f"local-{seed}")["choices"][0]["token_ids"]
        time.sleep(1.0)  # vLLM publishes connector stats a step later
        assert metric(c, "loads_total") == before, "the reference must be the consumer's own encode"
        params = pool_encode(c, image, f"pool-chat-{seed}")
        answer = ask(c, c["cons"], image, f"pool-chat-{seed}", params)
        assert answer["choices"][0]["token_ids"] == reference and reference
        assert wait_for(lambda b=before: metric(c, "loads_total") >= b + 1, timeout=15,
                        interval=0.2)
