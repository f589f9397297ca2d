"""The API server's guard (ec_connectors/guard/server_guard.py) in-process, around a small ASGI app
standing in for vLLM's routes, with the bounds of the real tiny Qwen2.5-Omni thinker (vLLM's
own ModelConfig and processor info, as in the server). The slow lane sends the same hostile
requests to a real prefill/decode server (tests/e2e/test_qwen_modalities.py)."""

from __future__ import annotations

import base64
import io
import json
import time

import numpy as np
import pytest
import torch
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.testclient import TestClient

from ec_connectors.config import GuardSettings
from ec_connectors.guard.request_checks import ModelBounds
from ec_connectors.guard.server_guard import ServerGuard
from ec_connectors.protocol.refusals import (
    EMBEDDING_MISMATCH,
    EMBEDDING_UNAVAILABLE,
    ReasonBoard,
    classify,
    failure_status,
)
from encoder_service.local.testmodels import SPECS, build
from tests.helpers import WORK
from tests.hostile import HUGE_GRID, body, grid_part, hostile_request, meta_part

MODEL = "tiny-qwen-omni"
KEY = "deployment-key"
PRODUCERS = ("127.0.0.1:17000",)


@pytest.fixture(scope="module")
def bounds() -> ModelBounds:
    from vllm.config import ModelConfig

    path = build(WORK / "models" / MODEL, SPECS["qwen-omni"])
    config = ModelConfig(model=str(path), max_model_len=1024, runner="generate",
                         enable_mm_embeds=True)
    return ModelBounds.from_vllm(config, producers=PRODUCERS)


class Upstream:
    """What vLLM (a FastAPI app) would answer: records the bodies it got; `mode` picks an
    answer; `engine` runs first, as the engine would while the request is in flight."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.mode = "ok"
        self.engine = lambda: None

        async def handle(request: Request):
            self.bodies.append(await request.body())
            self.engine()
            if self.mode == "engine_failed":  # vLLM's GenerationError answer
                return JSONResponse({"error": {"message": "Internal server error",
                                               "type": "InternalServerError", "code": 500}},
                                    status_code=500)
            if self.mode == "stream_failed":
                async def events():
                    yield 'data: {"choices": [{"delta": {"role": "assistant"}}]}\n\n'
                    yield ('data: {"error": {"message": "Internal server error", '
                           '"type": "InternalServerError", "code": 500}}\n\n')
                    yield "data: [DONE]\n\n"
                return StreamingResponse(events(), media_type="text/event-stream")
            if self.mode == "no_model":
                return JSONResponse({"error": {"message": "The model `x` does not exist.",
                                               "type": "NotFoundError", "code": 404}},
                                    status_code=404)
            if self.mode == "unauthorized":  # vLLM's AuthenticationMiddleware
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
            return JSONResponse({"ok": True})

        self.app = FastAPI()
        for path in ("/v1/chat/completions", "/inference/v1/generate", "/pause", "/tokenize",
                     "/health", "/metrics", "/ping", "/version", "/v1/models"):
            self.app.add_api_route(path, handle, methods=["GET", "POST"])


@pytest.fixture
def guarded(bounds, tmp_path):
    up = Upstream()
    board = ReasonBoard(tmp_path / "reasons")
    guard = ServerGuard(up.app, bounds=bounds, api_keys=[KEY],
                        settings=GuardSettings(guard_max_body_bytes=1 << 20), reasons=board)
    client = TestClient(guard, headers={"Authorization": f"Bearer {KEY}"})
    return client, up, board


def _refused(r, status: int | None = None) -> str:
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    if status is not None:
        assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["code"], str) and err["code"] and err["message"], err
    assert err["type"].endswith("_error")
    return err["code"]


def test_bounds_come_from_the_served_model(bounds):
    assert bounds.max_model_len == 1024 and bounds.merge_size == 2
    assert bounds.hidden_size == 128
    assert bounds.modalities == {"image", "video", "audio"}
    assert bounds.fields["image"] == {"image_embeds": "values", "image_grid_thw": "metadata"}
    assert bounds.fields["audio"]["audio_feature_lengths"] == "metadata"


def test_the_huge_grid_is_refused_before_vllm_sees_it(guarded):
    client, up, _ = guarded
    t0 = time.perf_counter()
    r = client.post("/v1/chat/completions", json=body(MODEL, [grid_part(HUGE_GRID)]))
    assert time.perf_counter() - t0 < 1.0
    assert _refused(r, 400) == "context_length_exceeded"
    assert "2500000000 tokens" in r.json()["error"]["message"]
    assert up.bodies == []


def test_a_request_within_bounds_reaches_vllm_unchanged(guarded):
    client, up, _ = guarded
    rows = np.ones((16, 128), np.float16)
    buf = io.BytesIO()
    np.save(buf, rows)
    parts = [grid_part([1, 8, 8], "image", "a"), grid_part([2, 8, 16], "video", "b"),
             meta_part("audio", {"audio_feature_lengths": [200]}, "c"),
             meta_part("image", {"image_grid_thw": [1, 8, 8],
                                 "image_embeds": base64.b64encode(buf.getvalue()).decode()}),
             {"type": "image_embeds", "image_embeds": _torch_b64(torch.zeros(5, 128))}]
    sent = json.dumps(body(MODEL, parts, ec_transfer_params={"epd": {"items": {
        "a": {"location": PRODUCERS[0], "nbytes": 4096}, "b": {"pending": True}}}})).encode()
    r = client.post("/v1/chat/completions", content=sent,
                    headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert up.bodies == [sent]  # byte for byte


def _torch_b64(t: torch.Tensor) -> str:
    buf = io.BytesIO()
    torch.save(t, buf)
    return base64.b64encode(buf.getvalue()).decode()


@settings(max_examples=50, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(case=hostile_request(MODEL, PRODUCERS))
def test_hostile_requests_get_a_4xx_with_a_reason(guarded, case):
    client, up, _ = guarded
    before = len(up.bodies)
    t0 = time.perf_counter()
    r = client.post("/v1/chat/completions", json=case)
    assert time.perf_counter() - t0 < 1.0
    _refused(r)
    assert len(up.bodies) == before  # vLLM never saw it


def test_every_generated_case_kind_is_refused(guarded):
    """Each family of the strategy at least once (the 50 derandomized examples above may
    not draw every one): the family names are the strategy's cases."""
    client, up, _ = guarded
    bodies = {
        "params_host": body(MODEL, [grid_part([1, 8, 8])], ec_transfer_params={
            "epd": {"items": {"item-x": {"location": "10.9.9.9:1234"}}}}),
        "unknown_type": body(MODEL, [{"type": "pointcloud_embeds",
                                      "pointcloud_embeds": {}, "uuid": "u"}]),
        "no_uuid": body(MODEL, [grid_part([1, 8, 8], uuid=None)]),
        "escaped_key": None,
        "generate_tokens": {"token_ids": [1] * 2000, "sampling_params": {}},
    }
    # a key spelled with a JSON escape is still seen (vLLM's parser unescapes it)
    escaped = json.dumps(body(MODEL, [grid_part(HUGE_GRID)])).replace(
        "image_embeds", "image\\u005fembeds")
    for name, b in bodies.items():
        if b is None:
            r = client.post("/v1/chat/completions", content=escaped,
                            headers={"content-type": "application/json"})
        else:
            r = client.post("/inference/v1/generate" if "token_ids" in b
                            else "/v1/chat/completions", json=b)
        _refused(r)
        assert up.bodies == [], name


def test_body_and_json_limits(guarded):
    client, up, _ = guarded
    big = body(MODEL, [grid_part([1, 8, 8])], pad="x" * (1 << 20))
    assert _refused(client.post("/v1/chat/completions", json=big), 413) == "body_too_large"
    bad = client.post("/v1/chat/completions", content=b'{"ec_transfer_params": [1,',
                      headers={"content-type": "application/json"})
    assert _refused(bad, 400) == "invalid_json"
    deep = b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b', "x": "\\u0041"}'
    # what msgspec refuses and vLLM's json reads (NaN, a lone surrogate) is read as json does
    nan = b'{"messages": [{"role": "user", "content": [{"type": "image_embeds", ' \
        b'"image_embeds": {"image_grid_thw": [1, NaN, 8]}, "uuid": "\\ud800"}]}]}'
    assert _refused(client.post("/v1/chat/completions", content=nan), 400) == "bad_grid"
    assert _refused(client.post("/v1/chat/completions", content=deep), 400) == "invalid_json"
    assert up.bodies == []


def test_deployment_key_on_every_route_but_health(bounds):
    up = Upstream()
    client = TestClient(ServerGuard(up.app, bounds=bounds, api_keys=[KEY],
                                    settings=GuardSettings()))
    for path in ("/v1/chat/completions", "/inference/v1/generate", "/pause", "/tokenize",
                 "/v1/models"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                        {"Authorization": f"Basic {KEY}"}):
            r = client.post(path, json={}, headers=headers)
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
        r = client.post(path, json={}, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200, path
    for path in ("/health", "/metrics", "/ping", "/version"):
        assert client.get(path).status_code == 200, path
    assert up.bodies == [b"{}"] * 5 + [b""] * 4
    # no key configured: nothing enforced
    open_client = TestClient(ServerGuard(up.app, bounds=bounds, api_keys=[],
                                         settings=GuardSettings()))
    assert open_client.post("/pause", json={}).status_code == 200


def test_key_from_the_environment(bounds, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    up = Upstream()
    client = TestClient(ServerGuard(up.app, bounds=bounds, settings=GuardSettings()))
    assert client.post("/pause", json={}).status_code == 401
    assert client.post("/pause", json={},
                       headers={"Authorization": "Bearer from-env"}).status_code == 200


def test_vllm_error_answers_get_a_code(guarded):
    client, up, _ = guarded
    up.mode = "no_model"
    r = client.post("/v1/chat/completions", json=body("x", []))
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert r.json()["error"]["type"] == "not_found_error"
    up.mode = "unauthorized"
    r = client.post("/v1/chat/completions", json=body("x", []))
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = client.get("/no-such-route")  # FastAPI's {"detail": ...} becomes the same shape
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_an_engine_failure_of_a_lost_embedding_is_a_503_with_its_reason(guarded):
    client, up, board = guarded
    up.mode = "engine_failed"
    lost = body(MODEL, [grid_part([1, 8, 8], uuid="lost-item")])
    r = client.post("/v1/chat/completions", json=lost)  # no reason posted: vLLM's 500
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
    up.engine = lambda: board.post("lost-item", EMBEDDING_UNAVAILABLE,
                                   "item 'lost-item': not in the transport")
    r = client.post("/v1/chat/completions", json=lost)
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == EMBEDDING_UNAVAILABLE and "not in the transport" in err["message"]
    assert err["type"] == "service_unavailable_error"
    up.mode = "stream_failed"  # streamed: the error event carries the reason
    r = client.post("/v1/chat/completions", json={**lost, "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == EMBEDDING_UNAVAILABLE
    # a reason older than the request is not this request's
    up.mode, up.engine = "engine_failed", lambda: None
    old = ReasonBoard(board.dir)
    (board.dir / next(p.name for p in board.dir.iterdir() if not p.name.startswith("."))
     ).write_text(json.dumps({"code": EMBEDDING_MISMATCH, "message": "m",
                              "at": time.time() - 60}))
    assert old.read(["lost-item"], time.time()) is None
    assert client.post("/v1/chat/completions", json=lost).status_code == 500


def test_an_item_that_does_not_fit_its_part_is_a_400_with_its_id(guarded):
    """The stored item is not what the metadata-only part says (scheduler_hooks/fit.py): the
    request is wrong, not the server, so a 400 (a 503 would invite the same retry)."""
    client, up, board = guarded
    up.mode = "engine_failed"
    misfit = body(MODEL, [grid_part([1, 4, 4], uuid="stored-item")])
    up.engine = lambda: board.post("stored-item", EMBEDDING_MISMATCH, "item 'stored-item': "
                                   "token count: the item holds 16 embeddings, the image "
                                   "part (image_grid_thw [1, 4, 4]) takes 4")
    r = client.post("/v1/chat/completions", json=misfit)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == EMBEDDING_MISMATCH and err["type"] == "invalid_request_error"
    assert "stored-item" in err["message"] and "metadata its producer" in err["message"]
    up.mode = "stream_failed"
    r = client.post("/v1/chat/completions", json={**misfit, "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == EMBEDDING_MISMATCH
    assert events[-1]["error"]["type"] == "invalid_request_error"


def test_reason_codes_and_board(tmp_path):
    assert classify("not in the transport") == "embedding_unavailable"
    assert classify("promised as pending, not stored within 10 s") == "embedding_timeout"
    assert classify("deadline passed") == "embedding_timeout"
    assert classify("token count: the item holds 4 embeddings, the request expects 16") \
        == "embedding_mismatch"
    assert classify("embedding mismatch: its producer published it as image_grid_thw "
                    "[1, 8, 8]; the video part asks for video_grid_thw [1, 8, 8]") \
        == "embedding_mismatch"
    assert failure_status("embedding_mismatch") == 400
    assert failure_status("embedding_unavailable") == 503
    assert classify("not available (missing, corrupt or timed out)") == "embedding_load_failed"
    board = ReasonBoard(tmp_path / "b")
    t0 = time.time()
    board.post("a", "embedding_unavailable", "why")
    assert board.read(["zzz", "a"], t0) == ("embedding_unavailable", "why")
    board.sweep(now=time.monotonic() + 61)
    assert board.read(["a"], t0) is None and list(board.dir.iterdir()) == []
    board.post("b", "embedding_timeout", "why")
    board.close()  # the engine stops: nothing of it is left
    assert not board.dir.exists()


def test_qwen3_video_timestamps_are_bounded():
    """Qwen3-VL's video metadata also holds `timestamps` (seconds, rendered as text)."""
    from ec_connectors.guard.request_checks import check_request
    from ec_connectors.protocol.refusals import Refusal

    q3 = ModelBounds(1024, frozenset({"image", "video"}), {"video": {
        "video_embeds": "values", "video_grid_thw": "metadata", "timestamps": "metadata"}},
        256, 2)
    ok = meta_part("video", {"video_grid_thw": [2, 6, 6], "timestamps": [0.5, 2.5]}, "v")
    assert check_request(body(MODEL, [ok]), q3).tokens == 18 + 2
    for bad in ([], [float("nan")], [-1], [1e300], "x", [True], [0.5] * 2000):
        part = meta_part("video", {"video_grid_thw": [2, 6, 6], "timestamps": bad}, "v")
        with pytest.raises(Refusal) as exc:
            check_request(body(MODEL, [part]), q3)
        assert exc.value.code == "bad_metadata"
