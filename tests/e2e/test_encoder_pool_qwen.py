"""Encoder pool -> real vLLM on the tiny Qwen2.5-Omni thinker (the same vision transformer
code path as Qwen2.5-VL, plus audio).

1. The pool encodes an image, a video (frame list) and an audio clip and publishes them with
   their placeholder metadata; a vLLM consumer given metadata-only parts (no media at all)
   loads the pool's embeddings and answers with the same greedy tokens as when it encodes the
   same media itself (raw media under an id nobody published: the aggregated path).
2. Parity: for seeded generated media (videos of 2-9 frames as JPEG frame lists and mp4 at
   several sizes and fps; audio at 8-48 kHz, mono and stereo, wav/flac/ogg/mp3; images) the
   pool's embedding is bit-identical to the one vLLM's encoder computes for the same item, and
   its placeholder metadata is the one vLLM publishes. The vLLM server is `ec_both`: it
   saves what it encodes itself (as an encoder-only producer would) and consumes what the
   pool published, so one server gives both sides. Bit-identical, not close: the pool runs
   vLLM's own media IO, processor and towers (encoder_pool/models.py); a copy of the towers
   was within 1e-3 and still changed a greedy answer. The pool encodes every video in chunks
   of one temporal group (`video_chunk_tokens` 1): each chunked embedding, assembled by its
   position map, is bit-identical to vLLM's whole encode."""

from __future__ import annotations

import random
import time

import httpx
import pytest
import torch

from ec_connectors.transports.safetensors_fs import SafetensorsTransport
from encoder_service.encoder_pool.config import PoolConfig
from encoder_service.encoder_pool.server import create_app
from encoder_service.local.processes import VllmServer
from encoder_service.local.requests import (
    audio_part,
    image_part,
    sample_audio,
    sample_frames,
    sample_image_png,
    sample_mp4,
    sample_wav,
    video_part,
)
from encoder_service.local.testmodels import SPECS, build
from encoder_service.local.up import epd_config
from tests.e2e.client import answer_parts, metric, post_parts
from tests.helpers import WORK, Served, port_block, wait_for

SPEC = SPECS["qwen-omni"]
MODEL = SPEC.model_name
BASE_PORT = port_block(__name__)[0]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = build(WORK / "models" / MODEL, SPEC)
    storage = tmp_path_factory.mktemp("pool-qwen-store")
    cons = VllmServer("pool-qwen-consumer", model, BASE_PORT, WORK / "test-pool-qwen",
                      epd_config("ec_both", storage), cpu_core=1, served_name=MODEL)
    cfg = PoolConfig.from_dict({"model": model, "served_model_name": MODEL,
                                "video_chunk_tokens": 1,  # one temporal group per chunk
                                "transport": {"storage_path": str(storage)}})
    cons.start()  # the pool loads while vLLM starts
    # vLLM's encoder runs on one core with one torch thread: so does the pool here, so that
    # "bit-identical" compares the same arithmetic (with two threads a large image's matmuls
    # may sum in another order on some CPUs: a few bf16 values one ulp apart)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        app = create_app(cfg)
        cons.wait()
        with Served(app, BASE_PORT + 1) as pool, httpx.Client(timeout=120) as c:
            yield {"cons": cons, "pool": pool, "client": c, "storage": storage}
    finally:
        torch.set_num_threads(threads)
        cons.stop()


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
    before = metric(c, "loads_total")
    got = answer_parts(c, c["cons"], [{"type": kind, kind: metadata, "uuid": item_id}], MODEL,
                       ec_transfer_params=params)
    # the pool's embedding was loaded
    assert wait_for(lambda: metric(c, "loads_total") >= before + 1, 15, 0.2)
    reference = answer_parts(c, c["cons"], [{**part, "uuid": f"{item_id}-encoded-here"}], MODEL)
    assert got == reference


def parity_cases(seed: int) -> list[tuple[str, dict]]:
    """(name, content part): every frame count 2-9 once as a JPEG frame list and once as an
    mp4 (sizes and fps drawn; 128x96 included: the size of the reported break), every sample
    rate 8-48 kHz mono and stereo over wav/flac/ogg/mp3, and images of odd sizes."""
    rng = random.Random(seed)
    sizes = [(128, 96), (112, 112), (80, 120), (64, 48), (96, 64), (140, 84)]
    out = []
    for n in range(2, 10):
        w, h = (128, 96) if n == 6 else rng.choice(sizes)
        out.append((f"list-{n}f-{w}x{h}",
                    video_part(sample_frames(rng.randrange(1 << 16), n, width=w, height=h))))
        w, h = rng.choice(sizes)
        fps = rng.choice([1, 2, 4, 10, 24])
        out.append((f"mp4-{n}f-{w}x{h}-{fps}fps",
                    video_part(sample_mp4(rng.randrange(1 << 16), n, w, h, fps))))
    formats = ["WAV", "FLAC", "OGG", "MP3"]
    for i, rate in enumerate([8000, 16000, 22050, 44100, 48000]):
        for channels in (1, 2):
            fmt = formats[(2 * i + channels) % 4]
            seconds = round(rng.uniform(0.5, 3.0), 2)
            out.append((f"audio-{rate}hz-{channels}ch-{fmt.lower()}-{seconds}s", audio_part(
                sample_audio(rng.randrange(1 << 16), seconds, rate, channels, fmt),
                fmt.lower())))
    out.append(("list-12f-64x48", video_part(sample_frames(rng.randrange(1 << 16), 12,
                                                          width=64, height=48))))
    for side in (29, 140, 333):
        out.append((f"image-{side}", image_part(sample_image_png(rng.randrange(1 << 16), side))))
    return out


def media_of(part: dict) -> tuple[str, str]:
    if part["type"] == "input_audio":
        return "audio", part["input_audio"]["data"]
    modality = part["type"].removesuffix("_url")
    return modality, part[f"{modality}_url"]["url"]


def test_pool_embedding_is_bit_identical_to_vllms_encoder(cluster):
    c = cluster
    reader = SafetensorsTransport(c["storage"], MODEL, 1 << 30)
    cases = parity_cases(2611)
    before = c["client"].get(c["pool"].url + "/v1/stats").json()["chunked_items"]
    for name, part in cases:
        r = post_parts(c, c["cons"], [{**part, "uuid": f"vllm-{name}"}], MODEL, "describe",
                       max_tokens=1)
        assert r.status_code == 200, (name, r.text)
        vllm_meta = r.json()["ec_transfer_params"]["epd"]["items"][f"vllm-{name}"]["metadata"]
        modality, data = media_of(part)
        r = c["client"].post(c["pool"].url + "/v1/encode", json={"items": [
            {"id": f"pool-{name}", "modality": modality, "data": data}]})
        assert r.status_code == 200, (name, r.text)
        info = r.json()["items"][f"pool-{name}"]
        assert info["status"] == "ok", (name, info)
        assert info["metadata"] == vllm_meta, name
        deadline = time.monotonic() + 10
        ours, theirs = reader.get(f"pool-{name}", deadline), reader.get(f"vllm-{name}", deadline)
        assert ours is not None and theirs is not None, name
        assert ours.dtype == theirs.dtype == torch.bfloat16
        assert ours.shape == theirs.shape and torch.equal(ours, theirs), name
    chunked = c["client"].get(c["pool"].url + "/v1/stats").json()["chunked_items"] - before
    # every video of 4 or more frames (2 or more temporal groups) went in chunks
    assert chunked >= sum(1 for name, _ in cases if name.startswith(("list", "mp4"))
                          and int(name.split("-")[1].removesuffix("f")) >= 4)


@pytest.mark.parametrize("name", ["list-6f-128x96", "audio-44100hz-2ch"])
def test_reported_breaks_answer_as_aggregated_vllm(cluster, name):
    """A 6-frame 128x96 JPEG frame list (a copy of the vision tower changed its greedy
    answer) and 44.1 kHz stereo audio (the pool refused it): metadata-only parts fed by
    the pool answer as vLLM encoding the media itself."""
    c = cluster
    part = next(p for n, p in parity_cases(2611) if n.startswith(name))
    modality, data = media_of(part)
    item_id = f"answer-{name}"
    r = c["client"].post(c["pool"].url + "/v1/encode", json={"items": [
        {"id": item_id, "modality": modality, "data": data}]})
    assert r.status_code == 200 and r.json()["items"][item_id]["status"] == "ok", r.text
    params = r.json()["ec_transfer_params"]
    kind = f"{modality}_embeds"
    metadata = params["epd"]["items"][item_id]["metadata"]
    for max_tokens in (8, 24):  # first encode, then the consumer's cache
        got = answer_parts(c, c["cons"], [{"type": kind, kind: metadata, "uuid": item_id}],
                           MODEL, ec_transfer_params=params, max_tokens=max_tokens)
        assert got == answer_parts(c, c["cons"], [{**part, "uuid": f"{item_id}-raw-{max_tokens}"}],
                                   MODEL, max_tokens=max_tokens)
