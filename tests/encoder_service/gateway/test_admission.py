"""The gateway's door (admission.py, app.py's /v1/completions) over real HTTP, a real
gateway in front of stub upstreams (stubs.py): a body that is not JSON, that does not arrive
in time, a request beyond the concurrency limit, a completions request for another model:
each a clear 4xx with its reason, before any upstream call."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.encoder_service.gateway.stubs import MODEL, Lab, metric, post
from tests.helpers import port_block

LAB = Lab(port_block(__name__))
gateway = LAB.gateway


def test_invalid_json_is_a_400(gw, stubs):
    r = httpx.post(gw.url + "/v1/chat/completions", content=b"{nope", timeout=10)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "bad_json"
    assert metric(gw, "epd_gateway_rejected_total") >= 1


def test_completions_checks_the_model_before_any_upstream_call(gw, stubs):
    enc, dec = stubs
    before = (len(enc.calls), len(dec.calls))
    r = httpx.post(gw.url + "/v1/completions", json={"model": "other", "prompt": "x"})
    assert r.status_code == 404 and "not served here" in r.json()["error"]["message"]
    assert (len(enc.calls), len(dec.calls)) == before


def test_requests_beyond_the_concurrency_limit_get_429_with_retry_after():
    enc, dec = LAB.stub("encoder"), LAB.stub("decoder")
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
