"""The guard parses a body without its media URLs' base64 payloads (`_without_media`: no check
reads them) and answers every body exactly as the whole-body parse does: the same `Checked`,
or the same refusal (status, code, message). Bounds of the tiny Qwen2.5-Omni thinker, as in
test_server_guard.py."""

from __future__ import annotations

import base64
import json

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from starlette.testclient import TestClient

from ec_connectors.config import GuardSettings
from ec_connectors.guard import server_guard
from ec_connectors.guard.request_checks import check_request
from ec_connectors.guard.server_guard import ServerGuard
from ec_connectors.protocol.refusals import Refusal
from encoder_service.local.requests import image_part, sample_image_png
from tests.ec_connectors.guard.test_server_guard import MODEL, PRODUCERS, Upstream
from tests.ec_connectors.guard.test_server_guard import bounds as bounds  # noqa: F401 (fixture)
from tests.hostile import body, grid_part, hostile_request

SCOPE = {"headers": [(b"content-type", b"application/json")]}
ID = "a" * 64
PAYLOAD = base64.b64encode(sample_image_png(7, 128)).decode()  # ~65 KB: left out
URL = "data:image/png;base64," + PAYLOAD


def _image(uuid: str | None = ID, url: str = URL) -> dict:
    part = {"type": "image_url", "image_url": {"url": url}}
    if uuid is not None:
        part["uuid"] = uuid
    return part


def _whole(raw: bytes, bounds):
    """The guard's answer with the whole body parsed (as before `_without_media`)."""
    try:
        parsed = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        parsed = server_guard._json(raw)
    return check_request(parsed, bounds)


def _answer(check):
    try:
        return check()
    except Refusal as exc:
        return ("refused", exc.status, exc.code, exc.message)


def _same(raw: bytes, bounds) -> object:
    guard = ServerGuard(None, bounds=bounds, api_keys=[])
    got = _answer(lambda: guard._check(SCOPE, raw))
    assert got == _answer(lambda: _whole(raw, bounds)), raw[:300]
    return got


def _enc(value: object) -> bytes:
    return json.dumps(value).encode()


def _nested(depth: int) -> list:
    out: list = [1]
    for _ in range(depth):
        out = [out]
    return out


PENDING = {"epd": {"items": {ID: {"pending": True}}}}
FRAME = base64.b64encode(sample_image_png(8, 64)).decode()
FRAMES_URL = "data:video/jpeg;base64," + ",".join([FRAME] * 6)  # vLLM's list of frames


def _video(url: str = FRAMES_URL) -> dict:
    return {"type": "video_url", "video_url": {"url": url}, "uuid": ID}

CASES = {
    "new item": _enc(body(MODEL, [_image()], ec_transfer_params=PENDING)),
    "no uuid, two images": _enc(body(MODEL, [_image(None), _image(None)])),
    "json spacing": _enc(body(MODEL, [_image()])).replace(b'"url": "', b'"url" :\n\t "'),
    "list body": _enc([{"url": URL}]),
    "bad uuid": _enc(body(MODEL, [_image(uuid="")])),
    "too many items": _enc(body(MODEL, [_image(f"i{k}") for k in range(65)])),
    "with a metadata-only part": _enc(body(MODEL, [_image(), grid_part([1, 8, 8])])),
    "huge grid beside": _enc(body(MODEL, [_image(), grid_part([1, 100000, 100000])])),
    "params over their limit, a data url in them": _enc(body(MODEL, [_image()], ec_transfer_params={
        "epd": {"items": {}}, "url": "data:x;base64," + PAYLOAD * 5})),
    "params holding a data url": _enc(body(MODEL, [_image()], ec_transfer_params={
        "epd": {"items": {}}, "url": URL})),
    "invalid json after the url": _enc(body(MODEL, [_image()]))[:-1] + b', "x": }',
    "trailing junk": _enc(body(MODEL, [_image()])) + b"x",
    "NaN (json only)": _enc(body(MODEL, [_image()]))[:-1] + b', "temperature": NaN}',
    "escaped slash in the payload": _enc(body(MODEL, [_image(url=URL[:5000] + "\\/"
                                                            + URL[5000:])])),
    "control byte in the payload": _enc(body(MODEL, [_image()])).replace(
        PAYLOAD[100:104].encode(), b"\x01AAA", 1),
    "bad padding": _enc(body(MODEL, [_image(url=URL + "A")])),
    "escaped key in text": _enc(body(MODEL, [{"type": "text", "text": 'say "url": "' + URL}])),
    "deep": _enc(body(MODEL, [_image()], x=_nested(70))),
    "frame list": _enc(body(MODEL, [_video()])),
    "frame list, an empty frame": _enc(body(MODEL, [_video(FRAMES_URL + ",,")])),
    "frame list, a frame with a quote escaped": _enc(body(MODEL, [_video(
        FRAMES_URL + ',ab"cd')])),
    "frame list, an escaped slash": _enc(body(MODEL, [_video(FRAMES_URL + ",ab\\/cd")])),
    "frame list, a bad frame": _enc(body(MODEL, [_video(FRAMES_URL + ",A")])),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_body_gets_the_answer_of_the_whole_body_parse(bounds, case):
    _same(CASES[case], bounds)


def test_a_new_items_payload_is_never_parsed(bounds, monkeypatch):
    """The decode instance's usual body for a new item (raw media, uuid, pending params):
    checked in full, its ~65 KB payload never handed to the JSON parser."""
    raw = CASES["new item"]
    seen: list[int] = []
    decode = msgspec.json.decode
    monkeypatch.setattr(msgspec.json, "decode", lambda data, *a, **k: (
        seen.append(len(data)), decode(data, *a, **k))[1])
    checked = ServerGuard(None, bounds=bounds, api_keys=[])._check(SCOPE, raw)
    assert checked.item_ids == [ID, ID] and checked.items == 1 and not checked.metadata_only
    assert seen and max(seen) < 1024 < len(PAYLOAD)
    seen.clear()  # a body the reduced parse cannot answer for is parsed whole
    bad = CASES["invalid json after the url"]
    with pytest.raises(Refusal, match="not valid JSON"):
        ServerGuard(None, bounds=bounds, api_keys=[])._check(SCOPE, bad)
    assert len(bad) in seen


def test_a_frame_lists_payload_is_left_out_of_the_parse(bounds):
    """A video as a list of frames (comma-joined base64) is elided like one payload: the
    guard's parse of a 120-frame clip's 25 MB body took 16-30 ms, ~5 ms without it."""
    raw = CASES["frame list"]
    reduced = server_guard._without_media(raw)
    assert reduced is not None and len(reduced) < 300 < len(raw)
    assert b'"data:video/jpeg;base64,"' in reduced
    for case in ("frame list, a frame with a quote escaped", "frame list, a bad frame"):
        assert server_guard._without_media(CASES[case]) is None, case  # parsed whole


@settings(max_examples=40, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(case=hostile_request(MODEL, PRODUCERS))
def test_hostile_bodies_with_media_get_the_same_refusal(bounds, case):
    if isinstance(case.get("messages"), list) and case["messages"]:
        content = case["messages"][0].get("content")
        if isinstance(content, list):
            content.insert(0, _image("hostile-image"))
    got = _same(_enc(case), bounds)
    assert isinstance(got, tuple) and got[0] == "refused"


def test_vllm_gets_the_body_as_sent(bounds):
    up = Upstream()
    guard = ServerGuard(up.app, bounds=bounds, api_keys=[],
                        settings=GuardSettings(guard_max_body_bytes=1 << 20))
    sent = _enc(body(MODEL, [image_part(sample_image_png(3, 128))]))
    r = TestClient(guard).post("/v1/chat/completions", content=sent,
                               headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert up.bodies == [sent]  # byte for byte: the payload was left out of the check only
