"""The chat flow (chat.py) over real HTTP, a real gateway in front of stub upstreams
(stubs.py): content ids and ec_transfer_params reach the decode instance, encoder failures
fall back to raw media, metadata-only parts (and their raw-media retry), and overlap (the
decode request goes out while its new items are encoded)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ec_connectors.protocol.keys import content_item_id
from encoder_service.local.requests import chat_body, data_url, image_part, sample_image_png
from tests.encoder_service.gateway.stubs import MODEL, Lab, metric, parts_request, post
from tests.helpers import port_block

LAB = Lab(port_block(__name__))
gateway = LAB.gateway


# -- routing: ids, params, encoder failures -------------------------------------------------
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
    assert sent["ec_transfer_params"]["epd"]["items"][ida] == {"location": enc.netloc}
    assert r.headers["x-request-id"]


def test_encoder_failure_retries_then_falls_back_to_raw_media(stubs):
    enc, dec = stubs
    dead = f"http://127.0.0.1:{LAB.port()}"  # nothing listens there
    g = gateway([dead, enc.url], [dec.url], cooldown_s=30)
    try:
        from encoder_service.gateway.upstreams.routing import rendezvous

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


def test_text_only_chat_goes_straight_to_a_decoder(gw, stubs):
    enc, dec = stubs
    calls = len(enc.calls)
    r = post(gw, {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]})
    assert r.status_code == 200 and r.json()["seen"] == []
    assert len(enc.calls) == calls and "ec_transfer_params" not in dec.calls[-1]


# -- metadata-only parts ---------------------------------------------------------------------
@pytest.fixture
def meta_stubs():
    """An encoder that publishes placeholder metadata, and a decoder."""
    enc, dec = LAB.stub("encoder"), LAB.stub("decoder")
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


# -- overlap: the decode request goes out while its new items are encoded -------------------
@pytest.fixture
def overlap_stubs(tmp_path):
    """`routing.overlap: auto` with an availability the gateway follows (an empty directory)."""
    enc, dec = LAB.stub("encoder"), LAB.stub("decoder")
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


def test_requests_queued_behind_a_busy_encoder_wait_for_it_and_none_goes_raw():
    """An encoder that answers its calls one after another (as vLLM works through queued
    video encodes) is busy, not down: calls and coalesced requests queued behind the first
    wait past `timeouts.encoder_s` while it keeps answering, and every item reaches the
    decode instance encoded (no fallback to raw media). An encoder that then answers nothing
    still fails a call within `encoder_s`, and the request goes raw."""
    enc, dec = LAB.stub("encoder"), LAB.stub("decoder")
    enc.delay, enc.serial = 0.4, True
    gws = [gateway([enc.url], [dec.url], timeouts={"encoder_s": 0.7},
                   routing={"probe_interval_s": 0, "coalesce_items": n, "encoder_calls": 1})
           for n in (1, 8)]  # every request its own call; requests sharing calls
    try:
        for k, g in enumerate(gws):
            imgs = [sample_image_png(300 + 10 * k + i) for i in range(4)]
            t0 = time.monotonic()
            with ThreadPoolExecutor(4) as ex:
                rs = list(ex.map(lambda im, g=g: post(g, chat_body(MODEL, im, "x")), imgs))
            took = time.monotonic() - t0
            assert [r.status_code for r in rs] == [200] * 4
            assert metric(g, "epd_gateway_fallbacks_total") == 0
            assert took > 0.7  # the last one waited past encoder_s, and was not given up on
            sent = {i for c in dec.calls[-4:] for i in c["ec_transfer_params"]["epd"]["items"]}
            assert sent == {content_item_id(im, MODEL) for im in imgs}
        enc.delay = 10.0  # now it answers nothing in time
        g = gws[0]
        t0 = time.monotonic()
        r = post(g, chat_body(MODEL, sample_image_png(399), "x"))
        assert r.status_code == 200 and "ec_transfer_params" not in dec.calls[-1]
        assert metric(g, "epd_gateway_fallbacks_total") == 1
        assert time.monotonic() - t0 < 5.0  # the call and its one retry, not the 10 s
    finally:
        for g in gws:
            g.stop()
        enc.stop()
        dec.stop()
