"""The control plane (admin.py) over real HTTP, a real gateway in front of stub upstreams
(stubs.py): instances join and leave at run time under load (admin token, draining, the
last decode instance stays), and /instances lists them. (Forward probes: test_routing.py.)"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from ec_connectors.protocol.api_keys import admin_token
from encoder_service.local.requests import chat_body, sample_image_png
from tests.encoder_service.gateway.stubs import MODEL, Lab
from tests.helpers import port_block

LAB = Lab(port_block(__name__))


def test_instances_join_and_leave_while_load_runs_and_nothing_is_lost(tmp_path):
    enc, first, second = LAB.stub("encoder"), LAB.stub("decoder"), LAB.stub("decoder")
    for s in (first, second):
        s.delay = 0.05
    secret = tmp_path / "secret"
    secret.write_bytes(b"a-deployment-secret-of-some-length")
    secret.chmod(0o600)
    g = LAB.gateway([enc.url], [first.url], secret_file=str(secret))
    token = {"authorization": f"Bearer {admin_token(secret.read_bytes())}"}
    try:
        admin = g.url + "/admin/instances"
        join = {"role": "decoder", "url": second.url, "action": "add"}
        assert httpx.post(admin, json=join).status_code == 403  # no token, no change
        assert httpx.post(admin, json=join, headers={"authorization": "Bearer x"}
                          ).status_code == 403
        bad = httpx.post(admin, json={**join, "url": "ftp://x"}, headers=token)
        assert bad.status_code == 400 and "base URL" in bad.text

        def ask(n: int) -> int:
            return httpx.post(g.url + "/v1/chat/completions", timeout=30, json=chat_body(
                MODEL, sample_image_png(seed=n % 7), "x")).status_code

        with ThreadPoolExecutor(8) as pool:
            load = [pool.submit(ask, n) for n in range(60)]
            time.sleep(0.2)
            assert httpx.post(admin, json=join, headers=token).json()["state"] == "up"
            time.sleep(0.2)
            left = httpx.post(admin, headers=token, timeout=30, json={
                "role": "decoder", "url": first.url, "action": "remove"}).json()
            codes = [f.result() for f in load]
        assert codes == [200] * 60
        assert left == {"url": first.url, "role": "decoder", "state": "removed",
                        "drained": True}
        seen = len(second.calls)
        assert seen > 0 and ask(99) == 200 and len(second.calls) == seen + 1
        listed = httpx.get(g.url + "/instances").json()
        assert [d["url"] for d in listed["decoders"]] == [second.url]
        assert listed["encoders"][0]["url"] == enc.url and listed["encoders"][0]["items"] > 0
        last = httpx.post(admin, headers=token, json={"role": "decoder", "url": second.url,
                                                      "action": "remove"})
        assert last.status_code == 409  # the last decode instance stays
    finally:
        g.stop()
        for s in (enc, first, second):
            s.stop()


def test_vllm_registration_format_joins_and_leaves_under_the_admin_rule(tmp_path):
    """vLLM's EPD proxy registration (POST/DELETE /instances, vLLM 0.32-0.34), as its
    launch scripts send it: the admin token in X-API-Key."""
    enc, first, second = LAB.stub("encoder"), LAB.stub("decoder"), LAB.stub("decoder")
    secret = tmp_path / "secret"
    secret.write_bytes(b"a-deployment-secret-of-some-length")
    secret.chmod(0o600)
    g = LAB.gateway([], [first.url], secret_file=str(secret))
    key = {"x-api-key": admin_token(secret.read_bytes())}
    url = g.url + "/instances"
    try:
        pd = {"role": "prefill_decode", "url": second.url + "/"}
        assert httpx.post(url, json=pd).status_code == 403  # no key, no change
        assert httpx.post(url, json=pd, headers={"x-api-key": "wrong"}).status_code == 403
        assert httpx.post(url, json={**pd, "role": "vision"}, headers=key).status_code == 400
        assert httpx.post(url, json={**pd, "ec_zmq_addrs": ["tcp://a:1", "tcp://b:2"]},
                          headers=key).status_code == 400  # one address per DP replica
        split = httpx.post(url, json={"role": "decode", "url": second.url}, headers=key)
        assert split.status_code == 409 and "E+PD" in split.text  # no split roles here
        assert httpx.post(url, json=pd, headers=key).json() == {"registered": True}
        assert httpx.post(url, json=pd, headers=key).json() == {"registered": False}
        moved = httpx.post(url, json={"role": "encode", "url": second.url}, headers=key)
        assert moved.status_code == 409  # one role per URL
        bearer = {"authorization": key["x-api-key"].join(("Bearer ", ""))}
        assert httpx.post(url, json={"role": "encode", "url": enc.url},
                          headers=bearer).json() == {"registered": True}
        listed = httpx.get(url).json()
        assert [d["url"] for d in listed["decoders"]] == [first.url, second.url]
        assert [e["url"] for e in listed["encoders"]] == [enc.url]

        gone = httpx.delete(url, params={"url": first.url}, headers=key, timeout=30)
        assert gone.json() == {"removed": True}
        assert httpx.delete(url, params={"url": first.url}, headers=key).json() == {
            "removed": False}
        before = len(second.calls), len(enc.calls)
        ok = httpx.post(g.url + "/v1/chat/completions", timeout=30,
                        json=chat_body(MODEL, sample_image_png(seed=3), "x"))
        assert ok.status_code == 200
        assert len(second.calls) == before[0] + 1 and len(enc.calls) > before[1]
        last = httpx.delete(url, params={"url": second.url}, headers=key)
        assert last.status_code == 409  # the last prefill/decode instance stays
    finally:
        g.stop()
        for s in (enc, first, second):
            s.stop()
