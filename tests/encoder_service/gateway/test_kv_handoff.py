"""E/P/D through a real gateway in front of stub upstreams (stubs.py): the prefill instance
gets the request for one token with `kv_transfer_params: {"do_remote_decode": true}` (and
the items' ec_transfer_params), the decode instance gets the kv_transfer_params the prefill
answered; a handoff that fails (prefill instance down or failing) leaves the decode instance
to compute the prompt itself, counted by reason (epd_kv_handoff_failures_total); with no
decode instance usable, the prefill instance answers the request in full."""

from __future__ import annotations

import pytest

from ec_connectors.protocol.keys import content_item_id
from encoder_service.gateway.upstreams.kv_handoff import handoff_params, prefill_body
from encoder_service.local.requests import chat_body, sample_image_png
from tests.encoder_service.gateway.stubs import MODEL, Lab, metric, post
from tests.helpers import port_block

LAB = Lab(port_block(__name__))
FAILED = "epd_kv_handoff_failures_total"


@pytest.fixture(scope="module")
def epd():
    enc, dec, pre = LAB.stub("encoder"), LAB.stub("decoder"), LAB.stub("prefill")
    g = LAB.gateway([enc.url], [dec.url], prefills=[pre.url])
    yield enc, dec, pre, g
    g.stop()
    for s in (enc, dec, pre):
        s.stop()


def test_prefill_then_decode_with_the_handed_kv_params(epd):
    enc, dec, pre, g = epd
    image = sample_image_png(41)
    body = {**chat_body(MODEL, image, "x", max_tokens=7), "stream": False,
            "min_tokens": 3}
    r = post(g, body)
    assert r.status_code == 200, r.text
    item = content_item_id(image, MODEL)
    p, d = pre.calls[-1], dec.calls[-1]
    assert p["max_tokens"] == 1 and p["stream"] is False and "min_tokens" not in p
    assert p["kv_transfer_params"] == {"do_remote_decode": True}
    assert item in p["ec_transfer_params"]["epd"]["items"]  # the prefill loads the item
    assert d["kv_transfer_params"]["do_remote_prefill"] is True
    assert d["kv_transfer_params"]["remote_engine_id"] == pre.netloc
    assert d["max_tokens"] == 7 and d["min_tokens"] == 3
    assert item in d["ec_transfer_params"]["epd"]["items"]  # a failed load: it computes
    assert metric(g, "epd_kv_handoffs_total") == 1 and metric(g, FAILED) == 0


def test_a_failed_prefill_leaves_the_decode_instance_to_compute(epd):
    enc, dec, pre, g = epd
    pre.fail = True
    try:
        r = post(g, chat_body(MODEL, sample_image_png(42), "x"))
    finally:
        pre.fail = False
    assert r.status_code == 200, r.text
    assert "kv_transfer_params" not in dec.calls[-1]
    assert metric(g, f'{FAILED}{{reason="status"}}') == 1


def test_a_clients_kv_transfer_params_never_reach_an_instance(epd):
    """They name a host and port for a server's KV connector to dial: the gateway's own
    handoff replaces them, and a failed handoff sends none at all."""
    enc, dec, pre, g = epd
    forged = {"do_remote_prefill": True, "remote_host": "10.9.9.9", "remote_port": 5600,
              "remote_engine_id": "evil", "remote_block_ids": [0, 1]}
    body = {**chat_body(MODEL, sample_image_png(43), "x"), "kv_transfer_params": forged}
    assert post(g, body).status_code == 200
    assert pre.calls[-1]["kv_transfer_params"] == {"do_remote_decode": True}
    assert dec.calls[-1]["kv_transfer_params"]["remote_engine_id"] == pre.netloc
    pre.fail = True
    try:
        body = {**chat_body(MODEL, sample_image_png(44), "x"), "kv_transfer_params": forged}
        assert post(g, body).status_code == 200
    finally:
        pre.fail = False
    assert "kv_transfer_params" not in dec.calls[-1]


def test_no_prefill_instance_answering_is_no_lost_request():
    enc, dec = LAB.stub("encoder"), LAB.stub("decoder")
    dead = f"http://127.0.0.1:{LAB.port()}"  # nothing listens there
    g = LAB.gateway([enc.url], [dec.url], prefills=[dead])
    try:
        r = post(g, chat_body(MODEL, sample_image_png(43), "x"))
        assert r.status_code == 200, r.text
        assert "kv_transfer_params" not in dec.calls[-1]
        assert metric(g, f'{FAILED}{{reason="unavailable"}}') == 1
    finally:
        g.stop()
        enc.stop()
        dec.stop()


def test_prefill_body_and_answer_parsing():
    body = {"messages": [], "stream": True, "stream_options": {"include_usage": True},
            "max_completion_tokens": 9, "kv_transfer_params": {"x": 1}}
    assert prefill_body(body) == {"messages": [], "max_tokens": 1, "stream": False,
                                  "kv_transfer_params": {"do_remote_decode": True}}
    assert body["stream"] is True  # left as it was
    assert handoff_params(b'{"kv_transfer_params": {"do_remote_prefill": true}}') == {
        "do_remote_prefill": True}
    for bad in (b"nope", b"[]", b'{"kv_transfer_params": null}',
                b'{"kv_transfer_params": {"do_remote_prefill": false}}'):
        assert handoff_params(bad) is None


def test_prefill_instances_are_probed_and_a_failing_one_is_tried_last():
    """E/P/D: the periodic forward probe covers prefill instances too (listed under
    `prefills` in /instances): one whose probe fails cools down until a probe passes."""
    import httpx

    from tests.helpers import wait_for

    enc, dec, pre = LAB.stub("encoder"), LAB.stub("decoder"), LAB.stub("prefill")
    g = LAB.gateway([enc.url], [dec.url], prefills=[pre.url],
                    routing={"probe_interval_s": 0.2, "probe_timeout_s": 0.5})

    def prefill() -> dict:
        return httpx.get(g.url + "/instances").json()["prefills"][0]

    try:
        assert wait_for(lambda: prefill().get("probe", {}).get("ok") is True, timeout=10,
                        interval=0.1)
        pre.fail = True  # its engine answers 500
        assert wait_for(lambda: prefill()["probe"]["ok"] is False, timeout=10, interval=0.1)
        assert prefill()["state"] == "cooling_down"
        pre.fail = False
        assert wait_for(lambda: prefill()["state"] == "up", timeout=10, interval=0.1)
    finally:
        g.stop()
        for s in (enc, dec, pre):
            s.stop()


def test_no_decode_instance_usable_leaves_the_prefill_instance_to_answer_in_full():
    """A prefill instance is a whole vLLM server with the prompt's KV cache: when no decode
    instance answers, it gets the request as the client sent it (no handoff params) and its
    answer goes back; counted (epd_prefill_answers_total{stage="start"})."""
    enc, pre = LAB.stub("encoder"), LAB.stub("prefill")
    dead = f"http://127.0.0.1:{LAB.port()}"  # nothing listens there
    g = LAB.gateway([enc.url], [dead], prefills=[pre.url])
    try:
        r = post(g, {**chat_body(MODEL, sample_image_png(45), "x", max_tokens=5),
                     "stream": False})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "ok"
        handoff, whole = pre.calls[-2:]
        assert handoff["kv_transfer_params"] == {"do_remote_decode": True}
        assert "kv_transfer_params" not in whole and whole["max_tokens"] == 5
        assert metric(g, 'epd_prefill_answers_total{stage="start"}') == 1
        r = post(g, {**chat_body(MODEL, sample_image_png(46), "x"), "stream": True})
        assert r.status_code == 200 and "data: [DONE]" in r.text
    finally:
        g.stop()
        enc.stop()
        pre.stop()
