"""What the gateway admits as a chat request's media, over real HTTP (a real gateway, stub
upstreams: stubs.py): bad input is a clear 4xx with its reason and no upstream call; media
URLs follow the destination policy (urls.py) and reach vLLM inlined; video frame lists,
audio formats and processor settings get their own content ids (parsing.py), signed with
the deployment secret."""

from __future__ import annotations

import base64
import io
import threading
import time

import numpy as np
import pytest
import soundfile
import uvicorn
from starlette.applications import Starlette
from starlette.routing import Route

from ec_connectors.protocol.keys import content_item_id
from encoder_service.gateway.config import GatewayConfig, GatewayConfigError
from encoder_service.local.requests import (
    audio_part,
    data_url,
    sample_frames,
    sample_image_png,
    sample_wav,
    video_part,
)
from tests.encoder_service.gateway.stubs import (
    MODEL,
    Lab,
    body_with_url,
    metric,
    parts_request,
    post,
)
from tests.helpers import port_block

LAB = Lab(port_block(__name__))
gateway = LAB.gateway


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
    port = LAB.port()

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


def test_b64_helper_rejects_padding_garbage():
    from encoder_service.gateway.media.parsing import _b64
    from encoder_service.gateway.wire import GatewayError

    assert _b64(base64.b64encode(b"abc").decode(), "x") == b"abc"
    with pytest.raises(GatewayError):
        _b64("YWJj\x00", "x")


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


def test_with_the_secret_the_gateway_signs_the_ids_it_derives(stubs, tmp_path):
    from ec_connectors.protocol.item_ids import IdSigner
    from ec_connectors.protocol.secret_file import read_secret

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


def _prepare(part: dict, **limits):
    import asyncio

    from encoder_service.gateway.media.parsing import prepare_chat

    cfg = GatewayConfig(model=MODEL, decoders=["http://127.0.0.1:9"], limits=limits)

    async def no_fetch(url):
        raise AssertionError("nothing to fetch")

    return asyncio.run(prepare_chat(parts_request(part), cfg.media_rules, no_fetch))


def test_a_frame_lists_id_covers_each_frame_after_its_length_and_large_ones_leave_the_loop(
        monkeypatch):
    """The id of a frame list is the hash of its frames, each after its 8-byte length (the
    frames' bytes, never joined); media over 1 MB are decoded, hashed and checked on a
    thread, the event loop free for other requests meanwhile."""
    from encoder_service.gateway.media import parsing

    threads: list[bool] = []
    identify = parsing._identify
    monkeypatch.setattr(parsing, "_identify", lambda *a: (
        threads.append(threading.current_thread() is threading.main_thread()), identify(*a))[1])
    for frames, on_loop in ((sample_frames(4), True), (sample_frames(8, 40, 224), False)):
        threads.clear()
        prepared = _prepare(video_part(frames), max_media_bytes=16 << 20)
        joined = b"".join(len(f).to_bytes(8, "little") + f for f in frames)
        assert prepared.items[0].item_id == content_item_id(joined, GatewayConfig(
            model=MODEL, decoders=["http://127.0.0.1:9"]).namespace)
        assert prepared.items[0].nbytes == len(joined)
        assert threads == [on_loop], len(joined)


@pytest.mark.parametrize("tail, status, code", [
    (",", 400, "bad_part"), (",,", 400, "bad_part"), (",@@", 400, "bad_base64"),
    (",é", 400, "bad_base64"), ("", 200, None)])
def test_a_frame_list_with_an_empty_or_broken_frame_is_refused(tail, status, code):
    from encoder_service.gateway.wire import GatewayError

    part = video_part(sample_frames(3))
    part["video_url"]["url"] += tail
    if status == 200:
        assert len(_prepare(part).items) == 1
        return
    with pytest.raises(GatewayError) as err:
        _prepare(part)
    assert (err.value.status, err.value.reason) == (status, code)
