"""Image, video and audio end to end on the tiny Qwen2.5-Omni thinker: `epd up` (a vLLM
encoder, a vLLM prefill/decode instance, the gateway) beside an aggregated vLLM server (the
reference). Through the gateway the decode instance gets metadata-only parts (no media
bytes); its greedy tokens must equal the aggregated server's. A metadata-only part the decode
instance cannot get fails that request only, and the engine keeps serving."""

from __future__ import annotations

import base64
import copy
import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

from ec_connectors import child_process
from encoder_service.local.processes import VllmServer, metric_value
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
from tests.helpers import ROOT, WORK, wait_for

SPEC = SPECS["qwen-omni"]
MODEL = SPEC.model_name
PROMPT = "describe this"
AGG_PORT, UP_PORT = 18680, 18670  # up: gateway 18670, encoder 18671, decode 18672
ENC_URL, DEC_URL = f"http://127.0.0.1:{UP_PORT + 1}", f"http://127.0.0.1:{UP_PORT + 2}"
GW = f"http://127.0.0.1:{UP_PORT}"
META_ONLY = 'epd_gateway_items_total{outcome="metadata_only"}'
ENCODED = 'epd_gateway_items_total{outcome="encoded"}'
HITS = 'epd_gateway_items_total{outcome="cache_hit"}'
# vLLM refuses per-request processor kwargs unless told to trust them (behind the gateway)
TRUST_KWARGS = ["--trust-request-mm-kwargs"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = build(WORK / "models" / MODEL, SPEC)
    work = WORK / "test-qwen-e2e"
    conf = tmp_path_factory.mktemp("up") / "up.json"
    conf.write_text(json.dumps({
        "model": "qwen-omni", "base_port": UP_PORT, "cpu_cores": [0, 1],
        "storage_path": str(tmp_path_factory.mktemp("ec-store")),
        "vllm_args": TRUST_KWARGS, "gateway": {"timeouts": {"encoder_s": 30}}}))
    agg = VllmServer("aggregated", model, AGG_PORT, work, None, cpu_core=0,
                     served_name=MODEL, extra_args=TRUST_KWARGS).start()
    work.mkdir(parents=True, exist_ok=True)
    up_log = open(work / "epd-up.log", "wb")  # noqa: SIM115 - closed at teardown
    up = child_process.popen([sys.executable, "-m", "encoder_service.cli", "up", "--config",
                              str(conf)], cwd=ROOT, stdout=up_log, stderr=subprocess.STDOUT,
                             env=dict(os.environ, EPD_WORK_DIR=str(work)))
    client = httpx.Client(timeout=120)

    def ready() -> bool:
        if up.poll() is not None:
            raise RuntimeError(f"epd up exited: {(work / 'epd-up.log').read_text()[-3000:]}")
        try:
            return agg.healthy() and client.get(GW + "/health").status_code == 200
        except httpx.HTTPError:
            return False

    try:
        assert wait_for(ready, timeout=420, interval=1.0), "cluster not ready in 420 s"
        yield {"agg": agg, "client": client}
    finally:
        client.close()
        agg.stop()
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
            up.wait(timeout=90)
        up_log.close()


def post(c, url, parts, **extra) -> httpx.Response:
    body = parts_body(MODEL, copy.deepcopy(parts), PROMPT, **extra)
    return c["client"].post(url + "/v1/chat/completions", json=body)


def tokens(c, url, parts, **extra) -> list[int]:
    r = post(c, url, parts, **extra)
    assert r.status_code == 200, r.text
    ids = r.json()["choices"][0]["token_ids"]
    assert ids
    return ids


def gw(c, name) -> float:
    return metric_value(c["client"].get(GW + "/metrics").text, name)


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
    assert r.status_code >= 500, r.text  # vLLM's retryable per-request error
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
    """The CI slice of the conformance harness (benchmarks/conformance.py runs the whole
    matrix): seeded generated requests (images of several modes and formats, frame-list and
    mp4 videos, audio at 8-48 kHz mono/stereo in wav/flac/ogg, several items, multi-turn,
    sampling fields) through the gateway, answered twice (first encode, cache hit): ids and
    text equal the aggregated server's."""
    from encoder_service.local.conformance import ask, cases

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

    from encoder_service.local.conformance import audio

    c = cluster
    for rate, channels, fmt in ((44100, 2, "WAV"), (22050, 1, "FLAC"), (48000, 2, "OGG"),
                                (8000, 1, "WAV")):
        data = audio(random.Random(rate), rate, channels, fmt, 1.5)
        parts = [audio_part(data, fmt.lower())]
        ref = tokens(c, c["agg"].url, parts)
        assert tokens(c, GW, parts) == ref, (rate, channels, fmt)
