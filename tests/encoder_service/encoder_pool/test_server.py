"""The encoder pool server over real HTTP (uvicorn on a port), with the real tiny-LLaVA
encoder (vLLM's own, in-process) and the real safetensors transport. No vLLM server here
(see tests/e2e/test_connector_safetensors.py and test_qwen_modalities.py)."""

from __future__ import annotations

import asyncio
import base64
import io
import time
from pathlib import Path

import httpx
import pytest
import torch
from PIL import Image

from ec_connectors.protocol.keys import item_key, namespace_key
from ec_connectors.protocol.params import TransferParams
from ec_connectors.transports.safetensors_fs import SafetensorsTransport
from encoder_service.encoder_pool.config import PoolConfig, PoolConfigError
from encoder_service.encoder_pool.media import decode_image
from encoder_service.encoder_pool.models import load_encoder
from encoder_service.encoder_pool.server import build_pool, create_app, main, parse_config
from encoder_service.local.processes import metric_value
from encoder_service.local.requests import sample_image_png
from encoder_service.local.testmodels import SPECS, build
from tests.helpers import WORK, Served, port_block

NS = "tiny-llava"
PORTS = port_block(__name__)  # one per test that serves the app (two share one)


@pytest.fixture(scope="module")
def model() -> Path:
    return build(WORK / "models" / "tiny-llava", SPECS["tiny"])


@pytest.fixture(scope="module")
def pool_server(model, tmp_path_factory):
    storage = tmp_path_factory.mktemp("pool-store")
    cfg = PoolConfig.from_dict({
        "model": model, "served_model_name": NS, "max_wait_ms": 20,
        "max_image_pixels": 300 * 300, "max_media_bytes": 400_000,
        "transport": {"storage_path": str(storage)},
    })
    with Served(create_app(cfg), PORTS[0]) as s:
        s.storage = storage
        s.client = httpx.Client(base_url=s.url, timeout=60)
        yield s
        s.client.close()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def png(side: int, seed: int = 0) -> bytes:
    return sample_image_png(seed, side)


def test_encode_publishes_what_the_encoder_computes(pool_server, model):
    s = pool_server
    imgs = {f"img-{n}": png(112, seed=n) for n in range(3)}
    r = s.client.post("/v1/encode", json={"items": [
        {"id": k, "data": "data:image/png;base64," + b64(v)} for k, v in imgs.items()]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["fallback"] is None
    assert set(TransferParams.parse(body["ec_transfer_params"]).items) == set(imgs)
    assert body["ec_transfer_params"]["epd"]["namespace"] == NS
    reader = SafetensorsTransport(s.storage, NS, 1 << 30)
    ref = load_encoder(model)
    for item_id, data in imgs.items():
        info = body["items"][item_id]
        assert info["status"] == "ok" and info["shape"] == [64, 128]
        assert info["dtype"] == "bfloat16" and info["num_embeds"] == 64
        stored = reader.get(item_id, deadline=time.monotonic() + 5)
        expected = ref.encode([ref.prepare(decode_image(item_id, data, 10**6))])[0]
        assert stored is not None and stored.dtype == torch.bfloat16
        assert torch.equal(stored, expected)  # the same code on the same input
    # the same image again: served from memory, no new encode
    before = s.client.get("/v1/stats").json()
    r = s.client.post("/v1/encode", json={"items": [{"id": "img-0", "data": b64(imgs["img-0"])}]})
    after = s.client.get("/v1/stats").json()
    assert r.status_code == 200 and after["items_encoded"] == before["items_encoded"]
    assert after["reuse_hits"] == before["reuse_hits"] + 1
    # released (gone from memory) but still stored: answered from the transport, no encode
    assert s.client.post("/v1/release", json={"item_ids": ["img-0"]}).json() == {
        "img-0": "discarded"}
    r = s.client.post("/v1/encode", json={"items": [{"id": "img-0", "data": b64(imgs["img-0"])}]})
    again = s.client.get("/v1/stats").json()
    assert r.status_code == 200 and r.json()["items"]["img-0"]["status"] == "ok"
    assert r.json()["items"]["img-0"]["checksum"] == body["items"]["img-0"]["checksum"]
    assert again["items_encoded"] == before["items_encoded"]
    assert again["reuse_hits"] == after["reuse_hits"] + 1
    # nor decoded: its id (the gateway's signed content id) names its media, so the bytes are
    # not read again (a long video's decoding and preprocessing cost hundreds of ms)
    r = s.client.post("/v1/encode", json={"items": [{"id": "img-0", "data": "AA=="}]})
    assert r.status_code == 200 and r.json()["items"]["img-0"]["status"] == "ok"
    # gone from the transport too: encoded again
    assert reader.delete("img-0")
    r = s.client.post("/v1/encode", json={"items": [{"id": "img-0", "data": b64(imgs["img-0"])}]})
    assert r.status_code == 200 and r.json()["items"]["img-0"]["status"] == "ok"
    assert s.client.get("/v1/stats").json()["items_encoded"] == before["items_encoded"] + 1


def test_hostile_ids_stay_inside_the_storage_dir(pool_server, tmp_path):
    s = pool_server
    hostile = ["../../../../tmp/epd-pool-escape", str(tmp_path / "abs"), "a/../../b"]
    r = s.client.post("/v1/encode", json={"items": [
        {"id": h, "data": b64(png(112, seed=50 + n))} for n, h in enumerate(hostile)]})
    assert r.status_code == 200, r.text
    ns_dir = s.storage / namespace_key(NS)
    for h in hostile:
        assert (ns_dir / (item_key(h) + ".safetensors")).is_file()
    assert not Path("/tmp/epd-pool-escape.safetensors").exists()
    assert not any(tmp_path.iterdir())
    assert s.client.post("/v1/encode", json={"items": [{"id": "x" * 70000, "data": "AA=="}]}
                         ).status_code in (400, 422)


def test_bad_media_rejected_at_the_door_or_text_only_fallback(pool_server):
    s = pool_server
    good = png(112, seed=7)
    truncated = good[: len(good) // 2]
    big = io.BytesIO()
    Image.new("RGB", (400, 400)).save(big, format="PNG")  # 160k pixels > 90k limit
    cases = {"truncated": b64(truncated), "big": b64(big.getvalue()), "notb64": "%%%%",
             "text": b64(b"hello, not an image")}
    for name, data in cases.items():
        r = s.client.post("/v1/encode", json={"on_failure": "fail", "items": [
            {"id": "ok-1", "data": b64(good)}, {"id": name, "data": data}]})
        assert r.status_code == 400, (name, r.text)
        assert f"'{name}'" in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "bad_media"
    assert "pixels" in s.client.post("/v1/encode", json={"on_failure": "fail", "items": [
        {"id": "big", "data": cases["big"]}]}).json()["error"]["message"]
    r = s.client.post("/v1/encode", json={"items": [  # server default policy: text_only
        {"id": "ok-2", "data": b64(good)}, {"id": "truncated", "data": cases["truncated"]}]})
    assert r.status_code == 200
    body = r.json()
    assert body["fallback"] == "text_only"
    assert body["items"]["ok-2"]["status"] == "ok"
    assert body["items"]["truncated"]["code"] == "bad_media"
    assert set(TransferParams.parse(body["ec_transfer_params"]).items) == {"ok-2"}
    too_big = "A" * 600_000
    r = s.client.post("/v1/encode", json={"on_failure": "fail",
                                          "items": [{"id": "huge", "data": too_big}]})
    assert r.status_code == 400 and "limit" in r.json()["error"]["message"]
    for bad, code in (({"items": []}, "invalid_request"),
                      ({"items": [{"id": "a", "data": "x", "extra": 1}]}, "invalid_request"),
                      ({"items": [{"id": "a", "data": "AA=="}] * 2}, "duplicate_ids"),
                      ({"items": [{"id": f"i{k}", "data": "AA=="} for k in range(65)]},
                       "too_many_items")):
        r = s.client.post("/v1/encode", json=bad)
        assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_metrics_follow_the_lifecycle_and_release_discards(pool_server):
    s = pool_server

    def metric(name):
        return metric_value(s.client.get("/metrics").text, name)

    r = s.client.post("/v1/encode", json={"items": [{"id": "m-1", "data": b64(png(112, 77))}]})
    assert r.status_code == 200
    text = s.client.get("/metrics").text
    assert 'epd_pool_features{state="encoded_cpu"}' in text
    assert 'epd_pool_feature_bytes{tier="cpu"}' in text and "epd_pool_batch_size_bucket" in text
    held = metric('epd_pool_feature_bytes{tier="cpu"}')
    assert held >= 64 * 128 * 2
    assert s.client.post("/v1/release", json={"item_ids": ["m-1"]}).json() == {
        "m-1": "discarded"}
    assert metric('epd_pool_feature_bytes{tier="cpu"}') == held - 64 * 128 * 2
    per_state = [metric(f'epd_pool_state_bytes{{state="{state}"}}')
                 for state in ("encoding", "encoded_cpu", "discarded")]
    assert sum(per_state) == metric('epd_pool_feature_bytes{tier="cpu"}') and per_state[2] == 0
    assert metric("epd_pool_published_total") >= 1
    assert s.client.get("/health").json() == {"ok": True}


class SlowEncoder:
    """The real encoder, slowed down, so a queue fills (logic test of backpressure)."""

    def __init__(self, real, delay):
        self.real, self.delay = real, delay
        self.modalities, self.hidden_size = real.modalities, real.hidden_size
        self.dtype, self.device = real.dtype, real.device

    def prepare(self, item):
        return self.real.prepare(item)

    def estimate_tokens(self, *a, **k):
        return self.real.estimate_tokens(*a, **k)

    def encode(self, items):
        time.sleep(self.delay)
        return self.real.encode(items)

    def placeholder_metadata(self, item):
        return self.real.placeholder_metadata(item)


def test_full_queue_answers_429_with_retry_after(model, tmp_path):
    cfg = PoolConfig.from_dict({"model": model, "served_model_name": NS, "max_batch_size": 1,
                                "max_wait_ms": 0, "max_queue_items": 1, "retry_after_s": 2,
                                "transport": {"storage_path": str(tmp_path)}})
    pool = build_pool(cfg, encoders=[SlowEncoder(load_encoder(model), 1.0)])
    with Served(create_app(cfg, pool), PORTS[1]) as s:
        async def go():
            async with httpx.AsyncClient(base_url=s.url, timeout=30) as c:
                async def gauge(name):
                    return metric_value((await c.get("/metrics")).text, name)

                def req(n):
                    return asyncio.ensure_future(c.post("/v1/encode", json={"items": [
                        {"id": f"q{n}", "data": b64(png(112, 200 + n))}]}))

                running = req(0)  # wait until it is on the worker and the queue is empty
                for _ in range(200):
                    if await gauge("epd_pool_worker_outstanding_tokens") > 0:
                        break
                    await asyncio.sleep(0.01)
                async def settle(admitted, depth):
                    for _ in range(500):
                        if (await gauge('epd_pool_features{state="encoding"}') == admitted
                                and await gauge("epd_pool_queue_depth") == depth):
                            return
                        await asyncio.sleep(0.01)

                # one forms the next batch (admitted, then taken off the queue by the batch
                # loop, which waits for the worker); then one fills the queue
                queued = [req(1)]
                await settle(admitted=2, depth=0)
                queued.append(req(2))
                await settle(admitted=3, depth=1)
                refused = await req(3)
                return refused, await running, await asyncio.gather(*queued)

        refused, first, others = asyncio.run(go())
    assert first.status_code == 200 and [r.status_code for r in others] == [200, 200]
    assert refused.status_code == 429, refused.text
    assert refused.headers["Retry-After"] == "2"
    assert "queue is full" in refused.json()["error"]["message"]
    assert refused.json()["error"]["code"] == "queue_full"


def test_config_errors_are_clear(model, tmp_path):
    with pytest.raises(PoolConfigError, match="max_batch_size"):
        PoolConfig.from_dict({"model": model, "max_batch_size": 0})
    with pytest.raises(PoolConfigError, match="no config.json"):
        PoolConfig.from_dict({"model": tmp_path})
    with pytest.raises(PoolConfigError, match="bogus"):
        PoolConfig.from_dict({"model": model, "bogus": 1})
    cfg = PoolConfig.from_dict({"model": model, "transport": {"storage_pth": "/x"}})
    with pytest.raises(ValueError, match="storage_pth"):
        cfg.transport_config()
    with pytest.raises(PoolConfigError, match="gpu_budget_bytes: Extra inputs.*Known keys: "
                                              ".*cpu_budget_bytes"):
        PoolConfig.from_dict({"model": model, "gpu_budget_bytes": 1})  # no GPU tier


def test_config_file_json_or_toml_under_flags(model, tmp_path, capsys):
    toml = tmp_path / "pool.toml"
    toml.write_text(f'model = "{model}"\nmax_batch_size = 4\nretain = "keep"\n'
                    f'[transport]\nstorage_path = "{tmp_path / "ec"}"\n')
    cfg = parse_config(["--config", str(toml), "--max-batch-size", "2"])
    assert cfg.max_batch_size == 2 and cfg.retain == "keep"  # flags win over the file
    assert cfg.transport == {"storage_path": str(tmp_path / "ec")}
    js = tmp_path / "pool.json"
    js.write_text(f'{{"model": "{model}", "max_wait_ms": 7}}')
    assert parse_config(["--config", str(js)]).max_wait_ms == 7
    js.write_text("{")
    with pytest.raises(PoolConfigError, match="cannot parse config file .*pool.json as JSON"):
        parse_config(["--config", str(js)])
    assert main(["--config", str(tmp_path / "nope.toml")]) == 2
    assert "nope.toml does not exist" in capsys.readouterr().err


def test_qwen_pool_serves_images_frame_lists_and_containers_with_their_metadata(tmp_path):
    from encoder_service.local.requests import sample_frames, sample_mp4, video_part

    spec = SPECS["qwen-vl"]
    qmodel = build(WORK / "models" / spec.model_name, spec)
    cfg = PoolConfig.from_dict({"model": qmodel, "served_model_name": spec.model_name,
                                "transport": {"storage_path": str(tmp_path)}})
    with Served(create_app(cfg), PORTS[1]) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        video = video_part(sample_frames(5, n=3, size=112))["video_url"]["url"]
        mp4 = video_part(sample_mp4(6, n=4, width=112, height=112, fps=2))["video_url"]["url"]
        mp4_6fps = video_part(sample_mp4(6, n=5, width=112, height=112, fps=6))
        r = c.post("/v1/encode", json={"items": [
            {"id": "img", "data": b64(png(140, 1))},
            {"id": "vid", "modality": "video", "data": video},
            {"id": "mp4", "modality": "video", "data": mp4},
            {"id": "mp4-6fps", "modality": "video", "data": mp4_6fps["video_url"]["url"]},
            {"id": "junk", "modality": "video", "data": "data:video/mp4;base64,AAAA"}]})
        assert r.status_code == 200, r.text
        items = r.json()["items"]
        assert items["img"]["metadata"] == {"image_grid_thw": [1, 10, 10]}
        assert items["img"]["num_embeds"] == 25
        # 3 frames -> 2 temporal patches (the last frame repeated), 8x8 patches each. A frame
        # list is read as 1 fps: 2 s per temporal patch, which a metadata-only part cannot
        # carry to the consumer (Qwen2.5-VL's second_per_grid_ts), so no metadata is
        # published and the consumer gets the raw media; so for a 6 fps mp4 (0.33 s)
        assert not items["vid"].get("metadata")
        assert items["vid"]["num_embeds"] == 32
        assert not items["mp4-6fps"].get("metadata")
        # 4 frames of a 2 fps mp4: 1 s per temporal patch, what a metadata-only consumer
        # assumes, so its metadata is published
        assert items["mp4"]["metadata"] == {"video_grid_thw": [2, 8, 8]}
        assert items["mp4"]["num_embeds"] == 32
        assert items["junk"]["status"] == "failed"
        assert "cannot decode video" in items["junk"]["error"]


def test_omni_pool_resamples_audio_as_vllm_and_refuses_junk(tmp_path):
    from encoder_service.local.requests import sample_audio

    spec = SPECS["qwen-omni"]
    omodel = build(WORK / "models" / spec.model_name, spec)
    cfg = PoolConfig.from_dict({"model": omodel, "served_model_name": spec.model_name,
                                "transport": {"storage_path": str(tmp_path)}})
    with Served(create_app(cfg), PORTS[2]) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        r = c.post("/v1/encode", json={"items": [
            {"id": "a16", "modality": "audio", "data": b64(sample_audio(1, seconds=2.0))},
            {"id": "a44", "modality": "audio",
             "data": b64(sample_audio(2, 1.0, rate=44100, channels=2, fmt="FLAC"))},
            {"id": "junk", "modality": "audio", "data": b64(b"RIFF" + b"x" * 64)}]})
        assert r.status_code == 200, r.text
        items = r.json()["items"]
        # 2 s at 16 kHz: 200 mel frames -> 50 embeddings after the encoder's two strides
        assert items["a16"]["metadata"] == {"audio_feature_lengths": [200]}
        assert items["a16"]["num_embeds"] == 50
        # 1 s at 44.1 kHz stereo: resampled to 16 kHz mono as vLLM does, 100 mel frames
        assert items["a44"]["metadata"] == {"audio_feature_lengths": [100]}
        assert items["a44"]["num_embeds"] == 25
        assert items["junk"]["status"] == "failed" and "cannot decode" in items["junk"]["error"]


def test_with_the_secret_the_pool_refuses_ids_nobody_signed(model, tmp_path, monkeypatch):
    from ec_connectors.protocol.api_keys import api_key
    from ec_connectors.protocol.item_ids import IdSigner
    from ec_connectors.protocol.secret_file import read_secret

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    secret = tmp_path / "secret"
    secret.write_bytes(b"pool-deployment-secret-0123456789")
    secret.chmod(0o600)
    cfg = PoolConfig.from_dict({"model": model, "served_model_name": NS, "transport": {
        "storage_path": str(tmp_path / "store"), "secret_file": str(secret)}})
    key = {"authorization": f"Bearer {api_key(read_secret(secret))}"}
    with Served(create_app(cfg), PORTS[3]) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        # an encoder of the deployment: its API needs the deployment's key, health does not
        item = {"id": IdSigner(read_secret(secret)).sign("image-a"), "data": b64(png(112))}
        for path, body in (("/v1/encode", {"items": [item]}),
                           ("/v1/release", {"item_ids": [item["id"]]})):
            for headers in ({}, {"authorization": "Bearer wrong"}):
                r = c.post(path, json=body, headers=headers)
                assert r.status_code == 401 and r.json()["error"]["message"], r.text
        assert c.get("/v1/stats").status_code == 401
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
        assert c.get("/v1/stats", headers=key).json()["items_encoded"] == 0  # nothing ran
        c.headers.update(key)
        r = c.post("/v1/encode", json={"items": [{"id": "image-b", "data": b64(png(112))}]})
        assert r.status_code == 403 and "not signed" in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "unsigned_id"
        signed = IdSigner(read_secret(secret)).sign("image-b")
        r = c.post("/v1/encode", json={"items": [{"id": signed, "data": b64(png(112))}]})
        assert r.status_code == 200 and r.json()["items"][signed]["status"] == "ok"


def test_a_full_memory_budget_is_a_503_with_its_reason(model, tmp_path):
    cfg = PoolConfig.from_dict({"model": model, "served_model_name": NS, "cpu_budget_bytes": 1,
                                "transport": {"storage_path": str(tmp_path)}})
    with Served(create_app(cfg), PORTS[4]) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        r = c.post("/v1/encode", json={"items": [{"id": "a", "data": b64(png(112))}]})
    assert r.status_code == 503 and r.headers["Retry-After"], r.text
    assert r.json()["error"]["code"] == "over_budget"
    assert r.json()["error"]["type"] == "service_unavailable_error"
