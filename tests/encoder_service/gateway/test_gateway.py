"""Gateway logic over real HTTP (uvicorn + httpx), with a small recording stub in place of
vLLM (the e2e tests in test_gateway_e2e.py use real vLLM servers): input validation, SSRF
policy, routing, retries and fallbacks."""

from __future__ import annotations

import asyncio
import base64
import io
import itertools
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import soundfile
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from ec_connectors.protocol.keys import content_item_id
from encoder_service.gateway.config import GatewayConfig, GatewayConfigError
from encoder_service.gateway.encoder_clients import EncoderFailed, EncoderRouter
from encoder_service.gateway.parsing import MediaPart
from encoder_service.gateway.server import GatewayThread
from encoder_service.local.processes import metric_value
from encoder_service.local.requests import (
    audio_part,
    chat_body,
    data_url,
    image_part,
    sample_frames,
    sample_image_png,
    sample_wav,
    video_part,
)
from tests.helpers import free_port as _free_port

MODEL = "tiny-llava"
# this module's stubs and gateways, and test_routing.py's (it borrows Stub and gateway)
PORTS = itertools.chain(range(18500, 18540), range(18720, 18800))


def free_port() -> int:
    return _free_port(PORTS)


class Stub:
    """A recording stand-in for a vLLM server: answers chat completions (streamed or not),
    returns producer-style ec_transfer_params, can be told to fail."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.calls: list[dict] = []
        self.fail = False
        self.metadata: dict | None = None  # encoder: placeholder metadata it publishes
        self.fail_metadata_only = False  # decoder: fail requests with *_embeds parts
        self.refusal: tuple[int, dict] | None = None  # decoder: answer this (status, body)
        self.delay = 0.0  # seconds before answering
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"

        async def chat(request: Request):
            body = await request.json()
            self.calls.append(body)
            await asyncio.sleep(self.delay)
            if self.fail:
                return JSONResponse({"error": "boom"}, status_code=500)
            ids = [p["uuid"] for m in body["messages"] for p in m["content"]
                   if isinstance(p, dict) and "uuid" in p]
            if self.role == "encoder":
                extra = {"metadata": self.metadata} if self.metadata else {}
                return JSONResponse({"choices": [], "ec_transfer_params": {
                    "epd": {"items": {i: {"by": self.url, **extra} for i in ids}}}})
            embeds = any(p.get("type", "").endswith("_embeds") for m in body["messages"]
                         for p in m["content"] if isinstance(p, dict))
            if self.refusal is not None and (embeds or not self.fail_metadata_only):
                return JSONResponse(self.refusal[1], status_code=self.refusal[0])
            if embeds and self.fail_metadata_only:
                if not body.get("stream"):  # vLLM: the engine failed the request
                    return JSONResponse({"error": {"message": "Internal server error"}},
                                        status_code=500)

                async def failed():  # vLLM streams the role chunk before the engine runs
                    yield 'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}\n\n'
                    yield 'data: {"error": {"message": "Internal server error", "code": 500}}\n\n'
                    yield "data: [DONE]\n\n"
                return StreamingResponse(failed(), media_type="text/event-stream")
            if body.get("stream"):
                ids = body.get("return_token_ids") is True

                async def gen():  # vLLM's token ids when asked (the prompt's in the first)
                    for i, t in enumerate(("a", "b", "c")):
                        event = {"t": t, **({"prompt_token_ids": [1, 2]} if ids and not i
                                            else {})}
                        if ids:
                            event["choices"] = [{"delta": {"content": t}, "token_ids": [i]}]
                        yield f"data: {json.dumps(event)}\n\n"
                    yield "data: [DONE]\n\n"
                return StreamingResponse(gen(), media_type="text/event-stream")
            return JSONResponse({"choices": [{"message": {"content": "ok"}}], "seen": ids})

        async def health(request: Request):
            return JSONResponse({})

        async def completions(request: Request):  # the gateway's probes
            await asyncio.sleep(self.delay)
            if self.fail:
                return JSONResponse({"error": "boom"}, status_code=500)
            return JSONResponse({"choices": [{"text": "."}]})

        app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                                Route("/v1/completions", completions, methods=["POST"]),
                                Route("/health", health)])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                                    log_level="error"))
        self.server.install_signal_handlers = lambda: None
        threading.Thread(target=self.server.run, daemon=True).start()
        while not self.server.started:
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True


@pytest.fixture(scope="module")
def stubs():
    enc, dec = Stub("encoder"), Stub("decoder")
    yield enc, dec
    enc.stop()
    dec.stop()


def gateway(enc: list[str], dec: list[str], **extra) -> GatewayThread:
    extra.setdefault("routing", {"probe_interval_s": 0})  # probes: test_routing.py
    cfg = GatewayConfig.build({"port": free_port(), "model": MODEL, "encoders": enc,
                               "decoders": dec, **extra})
    return GatewayThread(cfg).start()


@pytest.fixture(scope="module")
def gw(stubs):
    enc, dec = stubs
    g = gateway([enc.url], [dec.url], limits={"max_request_bytes": 200_000,
                                              "max_media_bytes": 50_000},
                media={"modalities": ["image"]})
    yield g
    g.stop()


def post(gw, body, **kw):
    return httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=10, **kw)


def body_with_url(url: str) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]}]}


def metric(gw, name: str) -> float:
    return metric_value(httpx.get(gw.url + "/metrics").text, name)


# -- bad input: a clear 4xx and no upstream call -------------------------------------------
BAD = {
    "malformed base64": (lambda: body_with_url("data:image/png;base64,@@notbase64@@"), 400,
                         "malformed base64"),
    "non-image bytes": (lambda: body_with_url(data_url(b"this is not an image" * 10)), 400,
                        "decodable image"),
    "oversized media item": (lambda: body_with_url(data_url(b"\x89PNG" + b"0" * 60_000)), 413,
                             "larger than 50000"),
    "oversized request": (lambda: {**body_with_url(data_url(sample_image_png(1))),
                                   "pad": "x" * 250_000}, 413, "request body is larger"),
    "http URL (disabled)": (lambda: body_with_url("http://example.com/cat.png"), 400,
                            "disabled"),
    "file URL": (lambda: body_with_url("file:///etc/passwd"), 400, "scheme"),
    "unknown part type": (lambda: {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_pil", "image_pil": "x"}]}]}, 400, "unsupported content part"),
    "audio on an image model": (lambda: {"model": MODEL, "messages": [{"role": "user",
        "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]},
        400, "does not accept audio"),
    "other model": (lambda: {**body_with_url(data_url(sample_image_png(1))), "model": "gpt"},
                    404, "not served here"),
    "not an object": (lambda: [1, 2], 400, "JSON object"),
    "too many pixels": (lambda: body_with_url(data_url(_png((4100, 4100), "1"))), 413,
                        "the limit is"),
    "too many items": (lambda: {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(_png((8, 8)))}}] * 17}]}, 400,
        "more than 16 media items"),
    "processor kwargs not an object": (lambda: {**body_with_url(data_url(_png((8, 8)))),
                                                "mm_processor_kwargs": "x"}, 400,
                                       "must be an object"),
    "processor kwargs too large": (lambda: {**body_with_url(data_url(_png((8, 8)))),
                                            "mm_processor_kwargs": {"x": "y" * 5000}}, 413,
                                   "larger than"),
    "data URL without base64": (lambda: body_with_url("data:image/png,abc"), 400,
                                "data:<mime>;base64"),
}


def _png(size: tuple[int, int], mode: str = "RGB") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, size).save(buf, "PNG")
    return buf.getvalue()


# each refusal's machine-readable reason (docs/errors.md)
CODES = {"malformed base64": "bad_base64", "non-image bytes": "not_an_image",
         "oversized media item": "media_too_large", "oversized request": "request_too_large",
         "http URL (disabled)": "url_disabled", "file URL": "bad_url",
         "unknown part type": "bad_part", "audio on an image model": "modality_disabled",
         "other model": "unknown_model", "not an object": "bad_request",
         "too many pixels": "image_too_large", "too many items": "too_many_items",
         "processor kwargs not an object": "bad_kwargs",
         "processor kwargs too large": "kwargs_too_large",
         "data URL without base64": "bad_data_url"}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_gets_a_clear_4xx_and_no_upstream_call(gw, stubs, case):
    make, status, words = BAD[case]
    enc, dec = stubs
    before = (len(enc.calls), len(dec.calls))
    r = post(gw, make())
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == CODES[case]
    assert r.json()["error"]["type"] == ("not_found_error" if status == 404
                                         else "invalid_request_error")
    assert (len(enc.calls), len(dec.calls)) == before


def test_invalid_json_is_a_400(gw, stubs):
    r = httpx.post(gw.url + "/v1/chat/completions", content=b"{nope", timeout=10)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "bad_json"
    assert metric(gw, "epd_gateway_rejected_total") >= 1


def test_forbidden_destinations_when_urls_are_enabled(stubs):
    enc, dec = stubs
    g = gateway([enc.url], [dec.url], media={"allow_http_urls": True})
    try:
        before = (len(enc.calls), len(dec.calls))
        for url in (dec.url + "/health", "http://localhost:1/x", "http://169.254.169.254/meta",
                    "http://[::1]:80/x", "http://10.1.2.3/x"):
            r = post(g, body_with_url(url))
            assert r.status_code == 403, (url, r.text)
            assert "non-public address" in r.json()["error"]["message"]
            assert r.json()["error"]["code"] == "forbidden_url"
        assert (len(enc.calls), len(dec.calls)) == before
    finally:
        g.stop()


def test_allowed_hosts_lets_a_private_image_server_through(stubs):
    """The policy is an allow-list, not a wall: an operator-listed CIDR is fetched, and the
    image reaches the decode instance inlined (vLLM never fetches URLs itself)."""
    enc, dec = stubs
    image = sample_image_png(5)
    port = free_port()

    async def img(request):
        from starlette.responses import Response

        return Response(image, media_type="image/png")

    async def redirect(request):
        from starlette.responses import RedirectResponse

        return RedirectResponse(f"http://127.0.0.1:{port}/i.png")

    srv = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/i.png", img),
                                                         Route("/r", redirect)]),
                                        host="127.0.0.1", port=port, log_level="error"))
    srv.install_signal_handlers = lambda: None
    threading.Thread(target=srv.run, daemon=True).start()
    g = gateway([enc.url], [dec.url],
                media={"allow_http_urls": True, "allowed_hosts": ["127.0.0.0/8"]})
    try:
        while not srv.started:
            time.sleep(0.01)
        r = post(g, body_with_url(f"http://127.0.0.1:{port}/i.png"))
        assert r.status_code == 200, r.text
        part = dec.calls[-1]["messages"][0]["content"][0]
        assert part["image_url"]["url"] == data_url(image)
        assert part["uuid"] == content_item_id(image, MODEL)
    finally:
        g.stop()
    # every redirect hop is checked: an allowed name may not bounce to a non-allowed address
    g = gateway([enc.url], [dec.url],
                media={"allow_http_urls": True, "allowed_hosts": ["localhost"]})
    try:
        calls = len(dec.calls)
        r = post(g, body_with_url(f"http://localhost:{port}/r"))
        assert r.status_code == 403 and "127.0.0.1" in r.text
        assert len(dec.calls) == calls
    finally:
        g.stop()
        srv.should_exit = True


# -- routing -------------------------------------------------------------------------------
def test_items_get_content_ids_and_params_reach_the_decoder(gw, stubs):
    enc, dec = stubs
    a, b = sample_image_png(11), sample_image_png(12)
    body = chat_body(MODEL, a, "x")
    body["messages"][0]["content"].insert(1, {"type": "image_url", "uuid": "../../evil",
                                              "image_url": {"url": data_url(b)}})
    body["ec_transfer_params"] = {"epd": {"items": ["forged"]}}
    r = post(gw, body)
    assert r.status_code == 200, r.text
    ida, idb = content_item_id(a, MODEL), content_item_id(b, MODEL)
    assert r.json()["seen"] == [ida, idb]  # client uuid replaced by the content id
    sent = dec.calls[-1]
    assert set(sent["ec_transfer_params"]["epd"]["items"]) == {ida, idb}  # forged one dropped
    assert sent["ec_transfer_params"]["epd"]["items"][ida] == {"by": enc.url}
    assert r.headers["x-request-id"]


def test_streamed_answer_is_passed_through(gw, stubs):
    body = {**chat_body(MODEL, sample_image_png(13), "x"), "stream": True}
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=10) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    assert [json.loads(line[6:])["t"] for line in text.split("\n\n")
            if line.startswith("data: {")] == ["a", "b", "c"]
    assert text.rstrip().endswith("data: [DONE]")


def test_token_ids_reach_a_streaming_client_only_when_it_asked(gw, stubs):
    """The gateway asks the decode instance for token ids (failover needs them) and removes
    them from the stream of a client that did not ask."""
    _, dec = stubs
    for asked in (False, True):
        body = {**chat_body(MODEL, sample_image_png(14), "x"), "stream": True}
        if not asked:
            del body["return_token_ids"]
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body,
                          timeout=10) as r:
            text = r.read().decode()
        assert dec.calls[-1]["return_token_ids"] is True
        events = [json.loads(line[6:]) for line in text.split("\n\n")
                  if line.startswith("data: {")]
        assert [e["t"] for e in events] == ["a", "b", "c"]
        assert ("prompt_token_ids" in events[0]) is asked
        assert all(("token_ids" in e["choices"][0]) is asked for e in events)


def test_encoder_failure_retries_then_falls_back_to_raw_media(stubs):
    enc, dec = stubs
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    g = gateway([dead, enc.url], [dec.url], cooldown_s=30)
    try:
        from encoder_service.gateway.routing import rendezvous

        # an image whose encoder (by affinity) is the dead one: the first request is retried
        # on the other; then the dead one cools down and is not tried again
        img = next(im for im in (sample_image_png(seed) for seed in range(21, 200))
                   if rendezvous(content_item_id(im, MODEL), [dead, enc.url])[0] == dead)
        ok = 0
        for _ in range(2):
            r = post(g, chat_body(MODEL, img, "x"))
            assert r.status_code == 200
            ok += content_item_id(img, MODEL) in dec.calls[-1]["ec_transfer_params"]["epd"][
                "items"]
        assert ok == 2
        assert metric(g, "epd_gateway_retries_total") == 1
        enc.fail = True
        r = post(g, chat_body(MODEL, sample_image_png(22), "x"))
        assert r.status_code == 200  # answered: raw media to the decoder, no params
        assert "ec_transfer_params" not in dec.calls[-1]
        assert dec.calls[-1]["messages"][0]["content"][0]["image_url"]["url"].startswith("data:")
        assert metric(g, "epd_gateway_fallbacks_total") == 1
        assert metric(g, 'epd_gateway_items_total{outcome="fallback"}') == 1
    finally:
        enc.fail = False
        g.stop()


def test_decoder_failure_before_first_byte_retries_on_another(stubs):
    enc, dec = stubs
    dead = f"http://127.0.0.1:{free_port()}"
    g = gateway([enc.url], [dead, dec.url])
    try:
        from encoder_service.gateway.routing import rendezvous

        # the first image's decode instance (by affinity) is the dead one: retried on the
        # other; the dead one then cools down, so the second is not retried
        first = next(im for im in (sample_image_png(seed) for seed in range(31, 200))
                     if rendezvous(content_item_id(im, MODEL), [dead, dec.url])[0] == dead)
        for img in (first, sample_image_png(300)):
            assert post(g, chat_body(MODEL, img, "x")).status_code == 200
        assert metric(g, 'epd_gateway_retries_total{target="decode"}') == 1
    finally:
        g.stop()
    g = gateway([enc.url], [dead])
    try:
        r = post(g, chat_body(MODEL, sample_image_png(33), "x"))
        assert r.status_code == 502 and "no prefill/decode instance" in r.text
        assert r.json()["error"]["code"] == "decode_unavailable"
    finally:
        g.stop()


class FakeEncoder:
    """Unit-test stand-in for an EncoderClient (router logic only)."""

    def __init__(self, name: str, fail: bool = False, delay: float = 0.0) -> None:
        self.name, self.fail, self.delay, self.calls = name, fail, delay, []

    async def encode(self, items, request_id):
        self.calls.append([it.item_id for it in items])
        await asyncio.sleep(self.delay)
        if self.fail:
            raise EncoderFailed(f"{self.name} down")
        return {it.item_id: {"by": self.name} for it in items}


def items(n: int) -> list[MediaPart]:
    return [MediaPart(f"i{k}", "image", 1, {}) for k in range(n)]


def test_router_groups_items_one_call_per_encoder():
    a, b = FakeEncoder("a"), FakeEncoder("b")
    out, errors = asyncio.run(EncoderRouter([a, b]).encode(items(5), "r"))
    assert not errors and not out.failed and out.calls == 2
    assert sorted(len(c) for c in a.calls + b.calls) == [2, 3]
    assert set(out.hints) == {f"i{k}" for k in range(5)}


def test_router_prefers_the_least_loaded_encoder():
    a, b = FakeEncoder("a", delay=0.3), FakeEncoder("b", delay=0.3)
    router = EncoderRouter([a, b])

    async def run():
        first = asyncio.create_task(router.encode(items(1), "r1"))
        await asyncio.sleep(0.05)  # one encoder now has a call in flight
        await router.encode([MediaPart("other", "image", 1, {})], "r2")  # not a shared item
        await first

    asyncio.run(run())
    assert len(a.calls) == 1 and len(b.calls) == 1  # the second went to the idle one


def test_router_retries_once_then_reports_failed_items_and_cools_down():
    a, b, c = FakeEncoder("a", fail=True), FakeEncoder("b", fail=True), FakeEncoder("c")
    router = EncoderRouter([a, b], cooldown_s=60)
    out, errors = asyncio.run(router.encode(items(1), "r"))
    assert out.retries == 1 and out.failed == ["i0"] and len(errors) == 2
    assert len(a.calls) + len(b.calls) == 2  # once each, never a third call
    router = EncoderRouter([a, c], cooldown_s=60)
    for _ in range(3):
        out, _ = asyncio.run(router.encode(items(1), "r"))
        assert not out.failed
    assert len(a.calls) <= 2  # after one failure, a cools down and c takes the work


# -- config --------------------------------------------------------------------------------
def test_config_errors_name_the_key():
    with pytest.raises(GatewayConfigError, match="decoders"):
        GatewayConfig.build({"encoders": []})
    with pytest.raises(GatewayConfigError, match="limits.max_media_byte"):
        GatewayConfig.build({"decoders": ["http://a:1"], "limits": {"max_media_byte": 1}})
    with pytest.raises(GatewayConfigError, match="base URL"):
        GatewayConfig.build({"decoders": ["ftp://a"]})
    with pytest.raises(GatewayConfigError, match="allowed_hosts"):
        GatewayConfig.build({"decoders": ["http://a:1"], "media": {"allowed_hosts": ["1.2/99"]}})
    cfg = GatewayConfig.build({"decoders": ["http://a:1/"]})
    assert cfg.decoders == ["http://a:1"] and not cfg.media.allow_http_urls


def test_b64_helper_rejects_padding_garbage():
    from encoder_service.gateway.errors import GatewayError
    from encoder_service.gateway.parsing import _b64

    assert _b64(base64.b64encode(b"abc").decode(), "x") == b"abc"
    with pytest.raises(GatewayError):
        _b64("YWJj\x00", "x")


def test_text_only_chat_goes_straight_to_a_decoder(gw, stubs):
    enc, dec = stubs
    calls = len(enc.calls)
    r = post(gw, {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]})
    assert r.status_code == 200 and r.json()["seen"] == []
    assert len(enc.calls) == calls and "ec_transfer_params" not in dec.calls[-1]


def test_completions_checks_the_model_before_any_upstream_call(gw, stubs):
    enc, dec = stubs
    before = (len(enc.calls), len(dec.calls))
    r = httpx.post(gw.url + "/v1/completions", json={"model": "other", "prompt": "x"})
    assert r.status_code == 404 and "not served here" in r.json()["error"]["message"]
    assert (len(enc.calls), len(dec.calls)) == before


# -- video, audio, metadata-only parts ------------------------------------------------------
def parts_request(*parts, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": [
        *parts, {"type": "text", "text": "hi"}]}], **extra}


@pytest.fixture
def meta_stubs():
    """An encoder that publishes placeholder metadata, and a decoder."""
    enc, dec = Stub("encoder"), Stub("decoder")
    enc.metadata = {"image_grid_thw": [1, 8, 8]}
    g = gateway([enc.url], [dec.url])
    yield enc, dec, g
    g.stop()
    enc.stop()
    dec.stop()


def test_decode_instance_gets_metadata_only_parts(meta_stubs):
    enc, dec, g = meta_stubs
    image = sample_image_png(40)
    r = post(g, parts_request(image_part(image), image_part(image)))
    assert r.status_code == 200, r.text
    item_id = content_item_id(image, MODEL)
    want = {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 8, 8]},
            "uuid": item_id}
    sent = dec.calls[-1]
    assert sent["messages"][0]["content"][:2] == [want, want]  # no media bytes at all
    assert "image_url" not in json.dumps(sent)
    # the decode instance reads the params, not the metadata (sent once, in the part)
    assert "metadata" not in sent["ec_transfer_params"]["epd"]["items"][item_id]
    assert metric(g, 'epd_gateway_items_total{outcome="metadata_only"}') == 2


def test_metadata_only_failure_is_retried_once_with_raw_media(meta_stubs):
    enc, dec, g = meta_stubs
    dec.fail_metadata_only = True
    for stream in (False, True):
        n = len(dec.calls)
        body = parts_request(image_part(sample_image_png(41 + stream)), stream=stream)
        r = post(g, body)
        assert r.status_code == 200, r.text
        if stream:  # one clean stream: the failed attempt's chunks never reach the client
            assert "error" not in r.text and r.text.count("assistant") == 0
            assert [json.loads(line[6:])["t"] for line in r.text.splitlines()
                    if line.startswith("data: {")] == ["a", "b", "c"]
        # a plain 500 of the only decode instance is asked once more there (decoders.py),
        # then with the raw media; a stream's error comes in a 200, after the headers
        *failed, second = dec.calls[n:]
        assert len(failed) == (1 if stream else 2)
        first = failed[0]
        assert all(f == first for f in failed)
        assert "image_embeds" in json.dumps(first) and "image_embeds" not in json.dumps(second)
        assert second["messages"][0]["content"][0]["type"] == "image_url"
        assert second["ec_transfer_params"]  # raw media plus the params: loads what it can
    assert metric(g, "epd_gateway_raw_retries_total") == 2


EMBEDDING_UNAVAILABLE = (503, {"error": {
    "message": "item 'x': not in the transport. The request names an embedding this server "
               "could not use and carries no media to encode it from", "type":
    "service_unavailable_error", "code": "embedding_unavailable"}})  # the decode's guard


def test_a_decode_instance_refusal_with_a_reason(meta_stubs):
    """A metadata-only request the decode instance answers with 503 embedding_unavailable
    (server_guard.py) is asked again with the raw media: the client gets the answer. A
    request with its media that is refused anyway gets the decode instance's reason."""
    enc, dec, g = meta_stubs
    dec.fail_metadata_only, dec.refusal = True, EMBEDDING_UNAVAILABLE
    n = len(dec.calls)
    r = post(g, parts_request(image_part(sample_image_png(45))))
    assert r.status_code == 200, r.text
    assert len(dec.calls) == n + 2 and metric(g, "epd_gateway_raw_retries_total") == 1
    dec.fail_metadata_only = False  # now the raw request is refused too
    r = post(g, parts_request(image_part(sample_image_png(46))))
    assert r.status_code == 503 and r.json() == EMBEDDING_UNAVAILABLE[1]


def test_video_frame_lists_audio_and_processor_kwargs(stubs):
    enc, dec = stubs
    g = gateway([enc.url], [dec.url])
    try:
        frames = sample_frames(50)
        video = video_part(frames)
        r = post(g, parts_request(video))
        assert r.status_code == 200, r.text
        plain = dec.calls[-1]["messages"][0]["content"][0]["uuid"]
        r = post(g, parts_request(video, mm_processor_kwargs={"fps": 1}))
        assert r.status_code == 200, r.text
        with_kwargs = dec.calls[-1]["messages"][0]["content"][0]["uuid"]
        assert plain != with_kwargs  # other settings, other embedding
        assert enc.calls[-1]["mm_processor_kwargs"] == {"fps": 1}  # encoders get them too
        # the same frames sent in another order are another video
        r = post(g, parts_request(video_part(frames[::-1])))
        assert dec.calls[-1]["messages"][0]["content"][0]["uuid"] != plain
        r = post(g, parts_request(audio_part(sample_wav(51))))
        assert r.status_code == 200, r.text
        for fmt in ("FLAC", "MP3", "OGG"):  # what libsndfile decodes, as audio_url too
            buf = io.BytesIO()
            soundfile.write(buf, np.zeros(8000, "float32"), 16000, format=fmt)
            r = post(g, parts_request({"type": "audio_url", "audio_url": {
                "url": data_url(buf.getvalue(), f"audio/{fmt.lower()}")}}))
            assert r.status_code == 200, (fmt, r.text)
        too_long = gateway([enc.url], [dec.url], limits={"max_audio_seconds": 1.5})
        try:
            r = post(too_long, parts_request(audio_part(sample_wav(52, seconds=2.0))))
            assert r.status_code == 413 and "lasts 2.0 s" in r.text
        finally:
            too_long.stop()
        for part, status, reason in (
            (video_part([frames[0], b"junk" * 100]), 400, "not_an_image"),
            ({"type": "video_url", "video_url": {"url": data_url(b"junk" * 100, "video/mp4")}},
             400, "not_a_video"),
            (audio_part(b"RIFF" + b"junk" * 100), 400, "not_audio"),
            (video_part(frames * 300), 413, "video_too_long"),
        ):
            n = len(dec.calls), len(enc.calls)
            r = post(g, parts_request(part))
            assert r.status_code == status, (reason, r.text)
            assert metric(g, f'epd_gateway_rejected_total{{reason="{reason}"}}') == 1
            assert (len(dec.calls), len(enc.calls)) == n
        r = post(g, parts_request(video, mm_processor_kwargs="fps=1"))
        assert r.status_code == 400 and "must be an object" in r.text
    finally:
        g.stop()


def test_requests_beyond_the_concurrency_limit_get_429_with_retry_after():
    enc, dec = Stub("encoder"), Stub("decoder")
    dec.delay = 1.0
    g = gateway([], [dec.url], limits={"max_concurrent_requests": 2})
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: post(g, body), range(4)))
        codes = sorted(r.status_code for r in answers)
        assert codes == [200, 200, 429, 429], codes
        refused = next(r for r in answers if r.status_code == 429)
        assert refused.headers["retry-after"] == "1"
        assert "max_concurrent_requests" in refused.json()["error"]["message"]
        assert refused.json()["error"]["code"] == "overloaded"
        assert post(g, body).status_code == 200  # slots come back
    finally:
        g.stop()
        enc.stop()
        dec.stop()


def test_a_body_that_does_not_arrive_in_time_is_a_408(stubs):
    enc, dec = stubs
    g = gateway([enc.url], [dec.url], limits={"body_read_timeout_s": 0.5})
    try:
        host, port = g.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                         b"content-type: application/json\r\ncontent-length: 1000\r\n\r\n{")
            t0 = time.monotonic()
            reply = sock.recv(4096).decode()
            assert time.monotonic() - t0 < 3
            while "}}" not in reply and time.monotonic() - t0 < 3:  # the body may come later
                reply += sock.recv(4096).decode()
        assert reply.startswith("HTTP/1.1 408"), reply
        assert '"code":"body_timeout"' in reply.replace(" ", "")
        assert metric(g, 'epd_gateway_rejected_total{reason="body_timeout"}') == 1
    finally:
        g.stop()


def test_with_the_secret_the_gateway_signs_the_ids_it_derives(stubs, tmp_path):
    from ec_connectors.protocol.secret import IdSigner, read_secret

    enc, dec = stubs
    secret = tmp_path / "secret"
    secret.write_bytes(b"gateway-deployment-secret-012345")
    secret.chmod(0o600)
    g = gateway([enc.url], [dec.url], secret_file=str(secret))
    try:
        image = sample_image_png(60)
        assert post(g, body_with_url(data_url(image))).status_code == 200
        sent = dec.calls[-1]["messages"][0]["content"][0]["uuid"]
        signer = IdSigner(read_secret(secret))
        assert sent == signer.sign(content_item_id(image, MODEL)) and signer.vouched(sent)
        assert not signer.vouched(content_item_id(image, MODEL))
        assert not IdSigner(b"x" * 32).vouched(sent)  # another deployment's secret
    finally:
        g.stop()
    bad = tmp_path / "open"
    bad.write_bytes(b"x" * 32)
    bad.chmod(0o644)
    with pytest.raises(GatewayConfigError, match="chmod 600"):
        GatewayConfig.build({"decoders": ["http://a:1"], "secret_file": str(bad)})


# -- overlap: the decode request goes out while its new items are encoded -------------------
@pytest.fixture
def overlap_stubs(tmp_path):
    """`routing.overlap: auto` with an availability the gateway follows (an empty directory)."""
    enc, dec = Stub("encoder"), Stub("decoder")
    g = gateway([enc.url], [dec.url], routing={"probe_interval_s": 0},
                availability={"kind": "safetensors", "storage_path": str(tmp_path)})
    yield enc, dec, g
    g.stop()
    enc.stop()
    dec.stop()


def early_decode(g, enc, dec, image) -> tuple[httpx.Response, float]:
    """Post `image` with a slow encoder; how long until the decode request went out."""
    n, enc.delay = len(dec.calls), 0.5
    try:
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(post, g, chat_body(MODEL, image, "x"))
            t = time.monotonic()
            while len(dec.calls) == n and time.monotonic() - t < 5:
                time.sleep(0.005)
            waited = time.monotonic() - t
            return answer.result(), waited
    finally:
        enc.delay = 0.0


def test_overlap_sends_the_decode_request_while_the_item_is_encoded(overlap_stubs):
    enc, dec, g = overlap_stubs
    # the first image is not overlapped: the gateway does not know yet whether its encoders
    # publish placeholder metadata (then the decode instance should get metadata only)
    r, waited = early_decode(g, enc, dec, sample_image_png(59))
    assert r.status_code == 200 and waited >= 0.45
    assert metric(g, 'epd_gateway_items_total{outcome="overlapped"}') == 0
    image = sample_image_png(60)
    r, waited = early_decode(g, enc, dec, image)
    assert r.status_code == 200, r.text
    assert waited < 0.4, "the decode request waited for the encoder"
    sent = dec.calls[-1]
    item = content_item_id(image, MODEL)
    assert sent["ec_transfer_params"]["epd"]["items"] == {item: {"pending": True}}
    assert sent["messages"][0]["content"][0]["image_url"]["url"].startswith("data:")  # raw
    assert metric(g, 'epd_gateway_items_total{outcome="overlapped"}') == 1


def test_overlap_an_encoder_failure_asks_again_without_the_promise(overlap_stubs):
    """A pending item that will not land: the early decode request is given up and the
    request goes again with raw media only (the decode instance encodes it at once instead
    of waiting out its deadline)."""
    enc, dec, g = overlap_stubs
    assert post(g, chat_body(MODEL, sample_image_png(65), "x")).status_code == 200  # learn
    enc.fail, enc.delay = True, 0.1
    try:
        for stream in (False, True):
            n = len(dec.calls)
            body = {**chat_body(MODEL, sample_image_png(61 + stream), "x"), "stream": stream}
            r = post(g, body)
            assert r.status_code == 200, r.text
            first, second = dec.calls[n:]
            assert list(first["ec_transfer_params"]["epd"]["items"].values()) == [
                {"pending": True}]
            assert "ec_transfer_params" not in second
            assert second["messages"][0]["content"][0]["image_url"]["url"].startswith("data:")
    finally:
        enc.fail, enc.delay = False, 0.0
    assert metric(g, 'epd_gateway_items_total{outcome="overlapped"}') == 0
    assert metric(g, "epd_gateway_fallbacks_total") == 2


def test_overlap_never_for_modalities_whose_encoders_publish_metadata(overlap_stubs):
    """Items whose encoders publish placeholder metadata wait for it and go metadata-only
    (no media for the decode instance to decode), whatever came before."""
    enc, dec, g = overlap_stubs
    enc.metadata = {"image_grid_thw": [1, 8, 8]}
    try:
        for seed in (66, 67):
            r, waited = early_decode(g, enc, dec, sample_image_png(seed))
            assert r.status_code == 200 and waited >= 0.45
            assert dec.calls[-1]["messages"][0]["content"][0]["type"] == "image_embeds"
        assert metric(g, 'epd_gateway_items_total{outcome="overlapped"}') == 0
    finally:
        enc.metadata = None
