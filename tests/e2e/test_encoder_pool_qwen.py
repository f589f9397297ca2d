"""Encoder pool -> real vLLM on the tiny Qwen2.5-Omni thinker (the same vision transformer
code path as Qwen2.5-VL, plus audio): the pool encodes an image, a video (frame list) and an
audio clip and publishes them with their placeholder metadata; a vLLM consumer given
metadata-only parts (no media at all) loads the pool's embeddings and answers with the same
greedy tokens as when it encodes the same media itself (raw media under an id nobody
published: the aggregated path)."""

from __future__ import annotations

import copy

import httpx
import pytest

from encoder_service.encoder_pool.config import PoolConfig
from encoder_service.encoder_pool.server import create_app
from encoder_service.local.processes import VllmServer, metric_value, start_all
from encoder_service.local.requests import (
    audio_part,
    image_part,
    parts_body,
    sample_frames,
    sample_image_png,
    sample_wav,
    video_part,
)
from encoder_service.local.testmodel import SPECS, build
from encoder_service.local.up import epd_config
from tests.helpers import WORK, Served, wait_for

SPEC = SPECS["qwen-omni"]
MODEL = SPEC.model_name
BASE_PORT = 18430


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = build(WORK / "models" / MODEL, SPEC)
    storage = tmp_path_factory.mktemp("pool-qwen-store")
    cons = VllmServer("pool-qwen-consumer", model, BASE_PORT, WORK / "test-pool-qwen",
                      epd_config("ec_consumer", storage), cpu_core=1, served_name=MODEL)
    start_all([cons], progress=lambda m: print(f"[pool-qwen] {m}", flush=True))
    cfg = PoolConfig.from_dict({"model": model, "served_model_name": MODEL,
                                "transport": {"storage_path": str(storage)}})
    try:
        with Served(create_app(cfg), BASE_PORT + 1) as pool, httpx.Client(timeout=120) as c:
            yield {"cons": cons, "pool": pool, "client": c}
    finally:
        cons.stop()


def answer(c, parts, **extra) -> list[int]:
    r = c["client"].post(c["cons"].url + "/v1/chat/completions",
                         json=parts_body(MODEL, copy.deepcopy(parts), "describe this", **extra))
    assert r.status_code == 200, r.text
    ids = r.json()["choices"][0]["token_ids"]
    assert ids
    return ids


def loads(c) -> float:
    return metric_value(c["client"].get(c["cons"].url + "/metrics").text,
                        "vllm:epd_loads_total")


@pytest.mark.parametrize("modality", ["image", "video", "audio"])
def test_pool_embedding_serves_a_metadata_only_request(cluster, modality):
    c = cluster
    part = {"image": lambda: image_part(sample_image_png(800, size=140)),
            "video": lambda: video_part(sample_frames(801, n=4)),
            "audio": lambda: audio_part(sample_wav(802))}[modality]()
    item_id = f"pool-qwen-{modality}"
    data = (part["input_audio"]["data"] if modality == "audio"
            else part[f"{modality}_url"]["url"])
    r = c["client"].post(c["pool"].url + "/v1/encode", json={"items": [
        {"id": item_id, "modality": modality, "data": data}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["items"][item_id]["status"] == "ok", body
    params = body["ec_transfer_params"]
    metadata = params["epd"]["items"][item_id]["metadata"]
    kind = f"{modality}_embeds"
    before = loads(c)
    got = answer(c, [{"type": kind, kind: metadata, "uuid": item_id}],
                 ec_transfer_params=params)
    assert wait_for(lambda: loads(c) >= before + 1, 15, 0.2)  # the pool's embedding
    reference = answer(c, [{**part, "uuid": f"{item_id}-encoded-here"}])
    assert got == reference
