"""End to end with real `vllm serve` processes on the locally built tiny LLaVA: the session's
aggregated server (the reference), an encoder-only producer and two prefill/decode consumers
of the shared E_PD fleet (tests/e2e/fleets.py), EPDConnector over the safetensors transport.
The producer also writes each item into same-host shared memory (tiers ["shm",
"safetensors"]), which the tight-cache consumer reads first: the shm transport between real
vLLM processes. Counts come from the consumers' Prometheus /metrics.

The encoder pool's HTTP server publishes into the same storage (one set of servers for both):
1. the pool's embedding of an image is bit-identical to the one vLLM's producer saves for it;
2. a vLLM consumer fed the pool's embedding (it really loads it: loads_total + 1) answers
   with the same greedy tokens as vLLM computing the image itself (the consumer's own
   vision tower on an id nobody published: the aggregated path, loads_total unchanged)."""

from __future__ import annotations

import base64
import io
import random
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from ec_connectors.transports.safetensors_fs import SafetensorsTransport
from encoder_service.encoder_pool.config import PoolConfig
from encoder_service.encoder_pool.server import create_app
from encoder_service.local.processes import metric_value
from encoder_service.local.requests import sample_image_png
from tests.e2e import fleets
from tests.e2e.client import (
    MODEL_NAME,
    ask,
    ask_before_encoding,
    case,
    encode,
    metric,
    tokens,
    wait_metric,
)
from tests.helpers import Served, ServerAt, port_block, wait_for

BASE_PORT = port_block(__name__)[0]


@pytest.fixture(scope="module")
def cluster(e_pd_fleet, aggregated):
    """On the shared E_PD fleet (tests/e2e/fleets.py): its encoder is the producer, its
    second decode instance the consumer of the shared directory alone, its decode instance
    the tight-cache consumer reading shared memory first. These tests kill nothing."""
    fleet = e_pd_fleet.ensure()
    aggregated.wait()
    prod, cons, tight = (ServerAt(fleet.url(i)) for i in (1, 3, 2))
    with httpx.Client(timeout=120) as client:
        yield {"agg": aggregated, "prod": prod, "cons": cons, "tight": tight,
               "storage": Path(fleet.conf["storage_path"]), "client": client,
               "model": fleets.llava()}


def stored_file(c, item_id) -> Path:
    from ec_connectors.protocol.keys import item_key, namespace_key

    return c["storage"] / namespace_key(MODEL_NAME) / (item_key(item_id) + ".safetensors")


@pytest.mark.parametrize("consumer", ["cons", "tight"], ids=["safetensors", "shm"])
def test_consumer_output_equals_aggregated_and_uses_producer_embedding(cluster, consumer):
    c = {**cluster, "cons": cluster[consumer]}  # metric() reads this consumer's counters
    image, item_id, reference = case(c, seed=101)
    params = encode(c, image, item_id)
    loads, shm_hits = metric(c, "loads_total"), metric(c, "tier_shm_hits_total")
    answer = ask(c, c["cons"], image, item_id, params)
    assert tokens(answer) == reference
    assert wait_metric(c, "loads_total", loads + 1) == loads + 1  # really loaded, once
    if consumer == "tight":  # from the producer's shared-memory arena, not the directory
        assert wait_metric(c, "tier_shm_hits_total", shm_hits + 1) == shm_hits + 1


def test_single_deferred_request_with_no_other_traffic(cluster):
    """The consumer gets the request before the producer has made the item: it must defer
    (zero-token steps on vLLM's V1 runner) and still load it when it lands."""
    c = cluster
    image, item_id, reference = case(c, seed=202)
    loads = metric(c, "loads_total")
    assert tokens(ask_before_encoding(c, image, item_id)) == reference
    assert wait_metric(c, "loads_total", loads + 1) == loads + 1


def test_corrupted_cache_file_still_yields_the_correct_answer(cluster):
    c = cluster
    image, item_id, reference = case(c, seed=303)
    params = encode(c, image, item_id)
    path = stored_file(c, item_id)
    assert wait_for(path.exists, timeout=10)
    data = bytearray(path.read_bytes())
    for i in range(1, 200, 7):
        data[-i] ^= 0x5A
    path.write_bytes(bytes(data))
    loads, fallbacks = metric(c, "loads_total"), metric(c, "local_encode_fallbacks_total")
    assert tokens(ask(c, c["cons"], image, item_id, params)) == reference
    assert wait_metric(c, "local_encode_fallbacks_total", fallbacks + 1) == fallbacks + 1
    assert metric(c, "loads_total") == loads  # the corrupt bytes were never used


def test_hostile_item_ids_write_nothing_outside_the_storage_dir(cluster, tmp_path):
    c = cluster
    tag = uuid.uuid4().hex[:8]
    escape_rel = Path("/tmp") / f"epd-escape-{tag}"
    hostile = [f"../../../../../../tmp/epd-escape-{tag}", str(tmp_path / f"abs-{tag}"),
               f"..\\..\\{tag}", "x" * 3000]
    for n, item_id in enumerate(hostile):
        image, item_id, reference = case(c, seed=400 + n, item_id=item_id)
        params = encode(c, image, item_id)
        loads = metric(c, "loads_total")
        assert tokens(ask(c, c["cons"], image, item_id, params)) == reference
        assert wait_metric(c, "loads_total", loads + 1) == loads + 1
    assert not escape_rel.exists()
    assert not (tmp_path / f"abs-{tag}").exists()
    files = [p for p in c["storage"].rglob("*") if p.is_file()]
    assert files and all(p.parent.parent == c["storage"] for p in files)
    assert all(len(p.name) < 120 for p in files)


def test_an_item_inside_a_prefix_cache_hit_is_neither_waited_for_nor_moved(cluster):
    """The same long request twice: the second one's image tokens are all in vLLM's prefix
    cache (num_computed_tokens covers them), so the connector neither waits for the item
    nor loads it again."""
    from encoder_service.local.requests import chat_body

    c = cluster
    image, item_id, _ = case(c, seed=909)
    params = encode(c, image, item_id)
    prompt = " ".join(["describe every part of this picture in detail"] * 40)  # > 2 blocks
    body = chat_body(MODEL_NAME, image, prompt, item_id=item_id, max_tokens=4,
                     ec_transfer_params=params)
    loads, skipped = metric(c, "loads_total"), metric(c, "prefix_cached_total")
    first = c["client"].post(c["cons"].url + "/v1/chat/completions", json=body)
    assert first.status_code == 200, first.text
    assert wait_metric(c, "loads_total", loads + 1) == loads + 1
    second = c["client"].post(c["cons"].url + "/v1/chat/completions", json=body)
    assert second.status_code == 200, second.text
    assert tokens(second.json()) == tokens(first.json())
    assert wait_metric(c, "prefix_cached_total", skipped + 1) == skipped + 1
    assert metric(c, "loads_total") == loads + 1  # nothing moved the second time


def test_duplicate_requests_under_a_tiny_encoder_cache_lose_nothing_and_leak_nothing(cluster):
    """200 requests, each image asked twice at once, 16 in flight, on a consumer whose vLLM
    encoder cache holds four images: items are staged, shared, evicted and loaded again while
    other requests wait for them. Every answer equals the aggregated one, the engine lives,
    and every staged byte leaves staging."""
    c = cluster
    tight = c["tight"]
    cases = [case(c, seed=700 + n) for n in range(12)]
    params = [encode(c, image, item_id) for image, item_id, _ in cases]
    order = [n for n in range(len(cases)) for _ in range(2)] * 9  # 216 -> 200 below
    random.Random(7).shuffle(order)
    order = order[:200]

    def one(i: int) -> bool:
        n = order[i]
        image, item_id, reference = cases[n]
        promised = params[n] if i % 2 else {"epd": {"items": [item_id]}}  # ids only: looked up
        return tokens(ask(c, tight, image, item_id, promised, max_tokens=4)) == reference[:4]

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(len(order))))
    assert all(results), f"{results.count(False)} answers differ from aggregated serving"
    assert c["client"].get(tight.url + "/health").status_code == 200

    def tight_metric(name: str) -> float:
        return metric_value(c["client"].get(tight.url + "/metrics").text, f"vllm:epd_{name}")

    print({m: tight_metric(f"{m}_total") for m in ("loads", "engine_cache_hits", "deferrals",
                                                   "unwanted_drops", "local_encode_fallbacks")})
    assert tight_metric("loads_total") >= len(cases)  # really loaded, not encoded locally
    assert wait_for(lambda: tight_metric("staged_bytes_total") ==
                    tight_metric("unstaged_bytes_total"), timeout=20, interval=0.5), (
        tight_metric("staged_bytes_total"), tight_metric("unstaged_bytes_total"))
    # the feature lifecycle's books close too: every state's bytes back to zero (the sum of
    # non-negative gauges over every state is zero only when each one is)
    assert 'vllm:epd_feature_bytes{' in c["client"].get(tight.url + "/metrics").text
    assert wait_for(lambda: tight_metric("feature_bytes") == 0, timeout=20, interval=0.5), [
        line for line in c["client"].get(tight.url + "/metrics").text.splitlines()
        if line.startswith("vllm:epd_feature_bytes")]
    assert tight_metric("lifecycle_errors_total") == 0


# -- the encoder pool publishing into the same storage ----------------------------------------
# (the pool runs vLLM's own media IO, processor and tower: encoder_pool/models.py)


@pytest.fixture(scope="module")
def pool(cluster):
    """The batching encoder pool's HTTP server (in this process) on the consumers' storage."""
    cfg = PoolConfig.from_dict({"model": cluster["model"], "served_model_name": MODEL_NAME,
                                "transport": {"storage_path": str(cluster["storage"])}})
    with Served(create_app(cfg), BASE_PORT) as served:
        yield served


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


def test_pool_embedding_matches_the_vllm_producers(cluster, pool):
    """Including a photo with EXIF orientation and a transparent PNG: the pool decodes as
    vLLM does (rotation applied, transparency onto white)."""
    c = {**cluster, "pool": pool}
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


def test_vllm_consumer_fed_by_the_pool_answers_like_vllm_itself(cluster, pool):
    c = {**cluster, "pool": pool}
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
