"""Image, video and audio end to end on the tiny Qwen2.5-Omni thinker: `epd up` (a vLLM
encoder, a vLLM prefill/decode instance, the gateway); the reference answers are the decode
instance's own, given the raw media with no ids: it computes every item itself, as an
aggregated server does. Through the gateway the decode instance gets metadata-only parts (no
media bytes); its greedy tokens must equal the reference's. A metadata-only part the decode
instance cannot get fails that request only, with a 503 and its reason, and the engine keeps
serving. Hostile metadata-only requests (tests/hostile.py) sent straight to the decode
instance end in a 4xx with a reason within 1 s, its memory stays put (server_guard.py)."""

from __future__ import annotations

import base64
import copy
import json
import os
import random
import time

import httpx
import psutil
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from ec_connectors.protocol.keys import item_key
from ec_connectors.transports.safetensors_fs import SafetensorsTransport
from encoder_service.encoder_pool.config import PoolConfig
from encoder_service.encoder_pool.server import create_app
from encoder_service.local.requests import (
    audio_part,
    image_part,
    parts_body,
    sample_audio,
    sample_frames,
    sample_image_png,
    sample_mp4,
    sample_wav,
    video_part,
)
from encoder_service.local.testmodels import SPECS, build
from tests.e2e.client import answer_parts, metric, metric_at, post_parts
from tests.helpers import WORK, Served, ServerAt, epd_up, port_block, wait_for
from tests.hostile import HUGE_GRID, grid_part, hostile_request, meta_part

SPEC = SPECS["qwen-omni"]
MODEL = SPEC.model_name
PROMPT = "describe this"
UP_PORT = port_block(__name__)[0]  # up: gateway, encoder +1, decode +2
POOL_PORT = UP_PORT + 4  # the encoder pool's tests (below)
ENC_URL, DEC_URL = f"http://127.0.0.1:{UP_PORT + 1}", f"http://127.0.0.1:{UP_PORT + 2}"
GW = f"http://127.0.0.1:{UP_PORT}"
META_ONLY = 'epd_gateway_items_total{outcome="metadata_only"}'
ENCODED = 'epd_gateway_items_total{outcome="encoded"}'
HITS = 'epd_gateway_items_total{outcome="cache_hit"}'
# vLLM refuses per-request processor kwargs unless told to trust them (behind the gateway)
TRUST_KWARGS = ["--trust-request-mm-kwargs"]
LOAD_TIMEOUT_S = 4  # a promised item that never lands fails its request after this


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """`epd up`; the reference answers come from its decode instance sent the raw media
    with no ids: it computes every item itself, as an aggregated server does (vLLM names
    such items by its own hashes, which no gateway request uses, so nothing is loaded)."""
    build(WORK / "models" / MODEL, SPEC)
    work = WORK / "test-qwen-e2e"
    storage = tmp_path_factory.mktemp("ec-store")
    conf = {"model": "qwen-omni", "base_port": UP_PORT, "cpu_cores": [0, 1],
            "storage_path": str(storage), "transport": "safetensors",  # tests read its files
            "connector_extra": {"load_timeout_s": LOAD_TIMEOUT_S},
            "vllm_args": TRUST_KWARGS, "gateway": {"timeouts": {"encoder_s": 30}}}
    with epd_up(conf, work, interval=1.0), httpx.Client(timeout=120) as client:
        yield {"agg": ServerAt(DEC_URL), "client": client, "storage": storage,
               "cons": DEC_URL}


def post(c, url, parts, **extra) -> httpx.Response:
    return post_parts(c, url, parts, MODEL, PROMPT, **extra)


def tokens(c, url, parts, **extra) -> list[int]:
    return answer_parts(c, url, parts, MODEL, PROMPT, **extra)


def gw(c, name) -> float:
    return metric_at(c, GW, name)


def samples(seed):
    return {"image": [image_part(sample_image_png(seed))],
            "video": [video_part(sample_frames(seed + 1))],
            "audio": [audio_part(sample_wav(seed + 2))],
            "mixed": [image_part(sample_image_png(seed + 3)),
                      video_part(sample_frames(seed + 4)), audio_part(sample_wav(seed + 5))]}


def test_each_modality_metadata_only_equals_aggregated(cluster):
    c = cluster
    for name, parts in samples(100).items():
        meta, enc = gw(c, META_ONLY), gw(c, ENCODED)
        assert tokens(c, GW, parts) == tokens(c, c["agg"].url, parts), name
        # every item encoded by the encoder and sent to PD without media bytes
        assert gw(c, ENCODED) == enc + len(parts), name
        assert gw(c, META_ONLY) == meta + len(parts), name
    # the same items again: no encode, still metadata-only, same tokens
    parts = samples(100)["mixed"]
    hits, enc, meta = gw(c, HITS), gw(c, ENCODED), gw(c, META_ONLY)
    assert tokens(c, GW, parts) == tokens(c, c["agg"].url, parts)
    assert gw(c, HITS) == hits + 3 and gw(c, ENCODED) == enc
    assert gw(c, META_ONLY) == meta + 3
    assert gw(c, "epd_gateway_raw_retries_total") == 0


def test_processor_kwargs_are_part_of_the_item_id(cluster):
    c = cluster
    parts = [image_part(sample_image_png(200, size=224))]
    small = {"mm_processor_kwargs": {"max_pixels": 112 * 112}}
    assert tokens(c, GW, parts) == tokens(c, c["agg"].url, parts)
    enc = gw(c, ENCODED)
    # same bytes, other settings: a second embedding (a smaller grid), not the first one
    assert tokens(c, GW, parts, **small) == tokens(c, c["agg"].url, parts, **small)
    assert gw(c, ENCODED) == enc + 1


def test_malformed_video_and_audio_get_4xx(cluster):
    c = cluster
    junk = base64.b64encode(b"\x00" * 2048).decode()
    bad = {
        "not_a_video": {"type": "video_url",
                        "video_url": {"url": f"data:video/mp4;base64,{junk}"}},
        "not_an_image": {"type": "video_url",  # a frame list with a broken frame
                         "video_url": {"url": "data:video/jpeg;base64,"
                                       + base64.b64encode(sample_frames(1)[0]).decode()
                                       + "," + junk}},
        "not_audio": {"type": "input_audio", "input_audio": {"data": junk, "format": "wav"}},
        "bad_base64": {"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}},
    }
    for reason, part in bad.items():
        before = gw(c, f'epd_gateway_rejected_total{{reason="{reason}"}}')
        r = post(c, GW, [part])
        assert r.status_code == 400, (reason, r.status_code, r.text)
        assert gw(c, f'epd_gateway_rejected_total{{reason="{reason}"}}') == before + 1


def test_unknown_metadata_only_item_fails_that_request_only(cluster):
    c = cluster
    unknown = [{"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 8, 8]},
                "uuid": "never-encoded-anywhere"}]
    r = post(c, DEC_URL, unknown)
    assert r.status_code == 503, r.text  # the engine failed it; the guard says why
    assert r.json()["error"]["code"] == "embedding_unavailable", r.text
    # the engine keeps serving: a real request, and then a metadata-only part of an item the
    # encoder made (the decode instance has no media for it at all)
    parts = samples(300)["image"]
    ref = tokens(c, c["agg"].url, parts)
    assert tokens(c, DEC_URL, parts) == ref
    encoded = c["client"].post(ENC_URL + "/v1/chat/completions",
                               json=parts_body(MODEL, copy.deepcopy(parts), PROMPT,
                                               max_tokens=1))
    params = encoded.json()["ec_transfer_params"]
    (item_id, entry), = params["epd"]["items"].items()
    assert entry["metadata"] == {"image_grid_thw": [1, 8, 8]}
    meta_only = [{"type": "image_embeds", "image_embeds": entry["metadata"], "uuid": item_id}]
    assert tokens(c, DEC_URL, meta_only, ec_transfer_params=params) == ref


def test_generated_cases_equal_the_aggregated_server_first_encode_and_cache_hit(cluster):
    """The CI slice of the conformance harness (`python -m benchmarks.serving.conformance`
    runs the whole matrix): seeded generated requests (images of several modes and formats,
    frame-list and mp4 videos, audio at 8-48 kHz mono/stereo in wav/flac/ogg, several items,
    multi-turn, sampling fields) through the gateway, answered twice (first encode, cache
    hit): ids and text equal the reference's."""
    from epd_testkit.conformance import ask, cases

    c = cluster
    diffs = []
    for case in cases(seed=11, n=6):
        ref = ask(c["client"], c["agg"].url, case.request(MODEL))
        assert ref.status == 200, (case.kinds, ref.error)
        for path in ("first", "hit"):
            got = ask(c["client"], GW, case.request(MODEL))
            if not got.same(ref):
                diffs.append((path, case.seed, case.kinds, ref.token_ids, got.token_ids,
                              got.error))
    assert not diffs, diffs


def test_audio_at_every_common_rate_and_layout_equals_the_aggregated_server(cluster):
    """44.1/48 kHz stereo from phones and browsers, 22.05 kHz FLAC, 8 kHz: vLLM resamples
    to the model's 16 kHz (torchaudio, pure Python here); answers equal, never a 500."""
    import random

    from epd_testkit.conformance import audio

    c = cluster
    for rate, channels, fmt in ((44100, 2, "WAV"), (22050, 1, "FLAC"), (48000, 2, "OGG"),
                                (8000, 1, "WAV")):
        data = audio(random.Random(rate), rate, channels, fmt, 1.5)
        parts = [audio_part(data, fmt.lower())]
        ref = tokens(c, c["agg"].url, parts)
        assert tokens(c, GW, parts) == ref, (rate, channels, fmt)


# -- refusals of the decode instance (docs/errors.md) -------------------------------------------
def _refusal(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["code"], str) and err["message"] and err["type"], err
    return err["code"]


def _encoded(c, seed: int) -> tuple[list[dict], str, dict]:
    """An image the encoder made (not through the gateway): its parts, id and params."""
    parts = [image_part(sample_image_png(seed))]
    r = c["client"].post(ENC_URL + "/v1/chat/completions",
                         json=parts_body(MODEL, copy.deepcopy(parts), PROMPT, max_tokens=1))
    params = r.json()["ec_transfer_params"]
    (item_id, _), = params["epd"]["items"].items()
    return parts, item_id, params


def test_each_decode_instance_refusal_has_its_reason(cluster):
    c = cluster
    # unknown model
    r = c["client"].post(DEC_URL + "/v1/chat/completions",
                         json=parts_body("no-such-model", [], PROMPT))
    assert _refusal(r, 404) == "model_not_found"
    # a grid that does not match the stored embedding (16 tokens; the request says 32)
    _, item_id, params = _encoded(c, 400)
    wrong = [grid_part([1, 8, 16], "image", item_id)]
    assert _refusal(post(c, DEC_URL, wrong, ec_transfer_params=params), 400) \
        == "embedding_mismatch"
    # verification failure: the stored file damaged in place (the index still lists it)
    _, item_id, params = _encoded(c, 401)
    path, = c["storage"].rglob(item_key(item_id) + ".safetensors")
    with open(path, "r+b") as f:
        f.seek(-16, os.SEEK_END)
        f.write(b"\xff" * 16)
    r = post(c, DEC_URL, [grid_part([1, 8, 8], "image", item_id)], ec_transfer_params=params)
    assert _refusal(r, 503) == "embedding_load_failed"
    assert "missing, corrupt or timed out" in r.json()["error"]["message"]
    # a promise that never lands: the request waits LOAD_TIMEOUT_S, then fails with why
    promised = {"epd": {"items": {"never-made": {"pending": True}}}}
    r = post(c, DEC_URL, [grid_part([1, 8, 8], "image", "never-made")],
             ec_transfer_params=promised)
    assert _refusal(r, 503) == "embedding_timeout"
    # streamed: the error event carries the reason
    r = post(c, DEC_URL, [grid_part([1, 8, 8], "image", "never-anywhere")], stream=True)
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "embedding_unavailable", r.text


def test_a_stored_item_that_does_not_fit_the_part_is_a_400_with_its_id(cluster):
    """A metadata-only part naming a stored image (grid [1, 8, 8], 16 embeddings) with a
    smaller grid, a larger one, a video grid or an audio length: a 400 `embedding_mismatch`
    naming the item (scheduler_hooks/fit.py), before and after vLLM's encoder cache holds
    the item, with the producer's params (its published metadata) and, for another token
    count, without; the engine keeps serving and the item still serves the part it fits."""
    c = cluster
    parts, item_id, params = _encoded(c, 600)
    ref = tokens(c, c["agg"].url, parts)
    wrong = {"smaller grid": grid_part([1, 4, 4], "image", item_id),
             "larger grid": grid_part([1, 16, 16], "image", item_id),
             "video grid for an image": grid_part([1, 8, 8], "video", item_id),
             "audio for an image": meta_part("audio", {"audio_feature_lengths": [64]},
                                             item_id)}
    right = [grid_part([1, 8, 8], "image", item_id)]

    def refused(name: str, part: dict, **extra) -> None:
        r = post(c, DEC_URL, [part], **extra)
        assert _refusal(r, 400) == "embedding_mismatch", (name, extra.keys())
        assert item_id in r.json()["error"]["message"], (name, r.text)
        assert c["client"].get(DEC_URL + "/health").status_code == 200, name

    for cached in (False, True):  # the second round: vLLM's encoder cache holds the item
        for name, part in wrong.items():
            refused(name, part, ec_transfer_params=params)
        for name in ("smaller grid", "larger grid"):  # no params: the rows tell
            refused(name, wrong[name])
        # the item is not spoiled for the part it fits (served, or placed again)
        assert tokens(c, DEC_URL, right, ec_transfer_params=params) == ref, cached
        assert tokens(c, DEC_URL, right) == ref, cached
    # without the producer's metadata a video grid of the image's row count cannot be told
    # apart (a stored item records no modality): answered, never the engine's death
    r = post(c, DEC_URL, [wrong["video grid for an image"]])
    assert r.status_code in (200, 400), r.text
    # a metadata-only video that cannot be had fails alone (Qwen2.5-Omni gives every video a
    # `use_audio_in_video` field: it was taken for media and sent to vLLM's encoder with no
    # frames, which killed the engine)
    r = post(c, DEC_URL, [grid_part([1, 8, 8], "video", "never-encoded-video")])
    assert _refusal(r, 503) == "embedding_unavailable"
    assert tokens(c, DEC_URL, right, ec_transfer_params=params) == ref


def _server_rss(port: int) -> tuple[psutil.Process, int]:
    """The process listening on `port` (vLLM's API server) and its tree's RSS."""
    pid = next(conn.pid for conn in psutil.net_connections("tcp")
               if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid)
    proc = psutil.Process(pid)
    return proc, sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])


def test_hostile_metadata_only_requests_end_in_a_4xx_within_a_second(cluster):
    """A reported grid [1, 100000, 100000] (it OOM-killed this server), then 500 generated
    hostile requests: each a 4xx with a reason within 1 s, memory within 1 GiB of the start,
    the server healthy and answering after."""
    c = cluster
    client = httpx.Client(timeout=10)
    proc, rss0 = _server_rss(UP_PORT + 2)
    times: list[float] = []

    def refused(body: dict) -> None:
        t0 = time.perf_counter()
        # json.dumps, not httpx's encoder: generated bodies may hold NaN or Infinity, which
        # a hostile client can send as they are (Python's JSON parser takes them)
        r = client.post(DEC_URL + "/v1/chat/completions", content=json.dumps(body),
                        headers={"content-type": "application/json"})
        times.append(time.perf_counter() - t0)
        assert 400 <= r.status_code < 500 and times[-1] < 1.0, (r.status_code, r.text[:300])
        assert isinstance(r.json()["error"]["code"], str), r.text[:300]

    refused(parts_body(MODEL, [grid_part(HUGE_GRID)], PROMPT))

    @settings(max_examples=500, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=hostile_request(MODEL))
    def each(body):
        refused(body)

    try:
        each()
    finally:
        client.close()
    _, rss1 = _server_rss(UP_PORT + 2)
    times.sort()
    print(f"\n{len(times)} hostile requests: median {times[len(times) // 2] * 1e3:.1f} ms, "
          f"max {times[-1] * 1e3:.1f} ms; API server tree RSS {rss0 / 2**20:.0f} -> "
          f"{rss1 / 2**20:.0f} MiB")
    assert len(times) >= 501 and proc.is_running()
    assert rss1 - rss0 < 1 << 30
    assert c["client"].get(DEC_URL + "/health").status_code == 200
    parts = samples(500)["image"]
    assert tokens(c, DEC_URL, parts) == tokens(c, c["agg"].url, parts)


# -- the encoder pool publishing into the same storage ----------------------------------------
# Encoder pool -> real vLLM on the tiny Qwen2.5-Omni thinker (the same vision transformer code
# path as Qwen2.5-VL, plus audio), beside this module's `epd up`:
# 1. the pool encodes an image, a video (frame list) and an audio clip and publishes them with
#    their placeholder metadata; the decode instance given metadata-only parts (no media at
#    all) loads the pool's embeddings and answers with the same greedy tokens as when it
#    encodes the same media itself (raw media under an id nobody published).
# 2. Parity: for seeded generated media (videos of 2-9 frames as JPEG frame lists and mp4 at
#    several sizes and fps; audio at 8-48 kHz, mono and stereo, wav/flac/ogg/mp3; images) the
#    pool's embedding is bit-identical to the one the vLLM encoder saves for the same item, and
#    its placeholder metadata is the one vLLM publishes. Bit-identical, not close: the pool
#    runs vLLM's own media IO, processor and towers (encoder_pool/models.py); a copy of the
#    towers was within 1e-3 and still changed a greedy answer. The pool encodes every video in
#    chunks of one temporal group (`video_chunk_tokens` 1): each chunked embedding, assembled
#    by its position map, is bit-identical to vLLM's whole encode.


@pytest.fixture(scope="module")
def pool(cluster):
    """The batching encoder pool's HTTP server (in this process) on the deployment's storage.
    vLLM's encoder runs on one core with one torch thread: so does the pool here, so that
    "bit-identical" compares the same arithmetic (with two threads a large image's matmuls may
    sum in another order on some CPUs: a few bf16 values one ulp apart)."""
    model = build(WORK / "models" / MODEL, SPEC)
    cfg = PoolConfig.from_dict({"model": model, "served_model_name": MODEL,
                                "video_chunk_tokens": 1,  # one temporal group per chunk
                                "transport": {"storage_path": str(cluster["storage"])}})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with Served(create_app(cfg), POOL_PORT) as served:
            yield served
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("modality", ["image", "video", "audio"])
def test_pool_embedding_serves_a_metadata_only_request(cluster, pool, modality):
    c = {**cluster, "pool": pool}
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


def test_pool_embedding_is_bit_identical_to_vllms_encoder(cluster, pool):
    c = {**cluster, "pool": pool}
    reader = SafetensorsTransport(c["storage"], MODEL, 1 << 30)
    cases = parity_cases(2611)
    before = c["client"].get(c["pool"].url + "/v1/stats").json()["chunked_items"]
    for name, part in cases:
        r = post_parts(c, ENC_URL, [{**part, "uuid": f"vllm-{name}"}], MODEL, "describe",
                       max_tokens=1)  # the encoder saves what it encodes
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
def test_reported_breaks_answer_as_aggregated_vllm(cluster, pool, name):
    """A 6-frame 128x96 JPEG frame list (a copy of the vision tower changed its greedy
    answer) and 44.1 kHz stereo audio (the pool refused it): metadata-only parts fed by
    the pool answer as vLLM encoding the media itself."""
    c = {**cluster, "pool": pool}
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
