"""`epd top` (gateway/top.py) over real HTTP: a real gateway in front of stub upstreams
(stubs.py), read by the real `epd` command line in a child process (one frame, live frames,
Ctrl-C) and by its functions; and GET /instances behind the client keys (admin.py)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ec_connectors.protocol.api_keys import admin_token
from ec_connectors.protocol.secret_file import SECRET_ENV
from encoder_service.gateway.auth import CLIENT_KEY_ENV
from encoder_service.gateway.telemetry import top
from encoder_service.gateway.telemetry.metrics import GatewayMetrics
from encoder_service.local.requests import chat_body, sample_image_png
from tests.encoder_service.gateway.stubs import MODEL, Lab
from tests.helpers import ROOT, port_block, wait_for

LAB = Lab(port_block(__name__))
KEY = "top-test-client-key-0001"


def epd(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`epd ARGS` in a child process (the real command line), without inherited keys."""
    base = {k: v for k, v in os.environ.items() if k not in (CLIENT_KEY_ENV, SECRET_ENV)}
    return subprocess.run([sys.executable, "-m", "encoder_service.cli", *args], cwd=ROOT,
                          env={**base, **(env or {})}, capture_output=True, text=True,
                          timeout=60)


def ask(url: str, n: int, model: str = MODEL) -> int:
    return httpx.post(url + "/v1/chat/completions", timeout=30, json=chat_body(
        model, sample_image_png(seed=n), "x")).status_code


def table(text: str) -> dict[str, list[str]]:
    """The instance rows of a frame: url -> its cells."""
    rows = [line.split() for line in text.splitlines()]
    return {r[1]: r for r in rows if r and r[0] in ("encoder", "prefill", "decode")}


def frame_json(url: str) -> dict:
    out = io.StringIO()
    assert top.main(["--once", "--json", url], out=out) == 0
    return json.loads(out.getvalue())


def test_one_frame_shows_every_instance_and_what_each_was_sent():
    enc, pre = LAB.stub("encoder"), LAB.stub("prefill")
    dec1, dec2 = LAB.stub("decoder"), LAB.stub("decoder")
    g = LAB.gateway([enc.url], [dec1.url, dec2.url], prefills=[pre.url])
    try:
        assert [ask(g.url, n) for n in range(5)] == [200] * 5
        assert ask(g.url, 9, model="no-such-model") == 404
        done = epd("top", "--once", g.url)
        assert done.returncode == 0, done.stderr
        assert "\x1b[" not in done.stdout  # --once: no escape codes
        rows = table(done.stdout)
        assert {u: r[0] for u, r in rows.items()} == {
            enc.url: "encoder", pre.url: "prefill", dec1.url: "decode", dec2.url: "decode"}
        assert {r[2] for r in rows.values()} == {"up"}
        assert "requests 6 (2xx 5 4xx 1)" in done.stdout
        assert "refused: unknown_model=1" in done.stdout and "encoded=5" in done.stdout

        done = epd("top", "--once", "--json", g.url)
        assert done.returncode == 0, done.stderr
        frame = json.loads(done.stdout)
        per = {r["url"]: r for r in frame["instances"]}
        assert per[pre.url]["requests"] == len(pre.calls) == 5
        for d in (dec1, dec2):  # what each decode instance was given, as it saw it
            assert per[d.url]["requests"] == len(d.calls)
            assert (per[d.url]["ttft_p50_s"] is not None) == bool(d.calls)
        assert len(dec1.calls) + len(dec2.calls) == 5
        assert per[enc.url]["items"] == 5 and per[enc.url]["requests"] == len(enc.calls)
        assert per[enc.url]["ttft_p50_s"] is None  # no per-encoder first token
        assert per[pre.url]["ttft_p50_s"] is not None
        assert {r["inflight"] for r in per.values()} == {0}
        assert {r["queue"] for r in per.values()} == {r["staged_bytes"] for r in per.values()
                                                       } == {None}
        t = frame["totals"]
        assert t["requests"] == 6 and t["refused"] == {"unknown_model": 1}
        assert t["items"]["encoded"] == 5 and t["inflight"] == 0
        assert 0 < t["ttft_p50_s"] <= t["ttft_p99_s"]

        # requests in flight: held by slow decode instances while the frame is taken
        for d in (dec1, dec2):
            d.delay = 2.0
        before = len(dec1.calls) + len(dec2.calls)
        with ThreadPoolExecutor(3) as pool:
            held = [pool.submit(ask, g.url, 20 + n) for n in range(3)]
            assert wait_for(lambda: len(dec1.calls) + len(dec2.calls) == before + 3,
                            timeout=10)
            frame = frame_json(g.url)
            assert [f.result() for f in held] == [200] * 3
        per = {r["url"]: r for r in frame["instances"]}
        assert frame["totals"]["inflight"] == 3
        assert per[dec1.url]["inflight"] + per[dec2.url]["inflight"] == 3
        assert per[enc.url]["inflight"] == per[pre.url]["inflight"] == 0
    finally:
        g.stop()
        for s in (enc, pre, dec1, dec2):
            s.stop()


def test_a_stopped_instance_shows_down_after_a_probe_then_live_frames_until_ctrl_c():
    enc, dec1, dec2 = LAB.stub("encoder"), LAB.stub("decoder"), LAB.stub("decoder")
    g = LAB.gateway([enc.url], [dec1.url, dec2.url],
                    routing={"probe_interval_s": 0.2, "probe_timeout_s": 0.5})

    def rows() -> dict[str, list[str]]:
        out = io.StringIO()
        assert top.main(["--once", g.url], out=out) == 0
        return table(out.getvalue())

    try:
        assert wait_for(lambda: all(r[-4] == "ok" for r in rows().values()), timeout=10,
                        interval=0.1)  # every instance probed: "ok 1ms 0s ago"
        dec2.stop()
        assert wait_for(lambda: rows()[dec2.url][2] == "down", timeout=10, interval=0.1)
        now = rows()
        assert "FAIL" in now[dec2.url] and now[dec1.url][2] == now[enc.url][2] == "up"

        # live: frames redrawn in place, a request counted between two, Ctrl-C exits 0
        live = subprocess.Popen([sys.executable, "-m", "encoder_service.cli", "top",
                                 "--interval", "0.2", g.url], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        seen = _reader(live)
        try:
            assert wait_for(lambda: "".join(seen).count("epd top") >= 2, timeout=20)
            assert ask(g.url, 1) == 200
            assert wait_for(lambda: "requests 1 " in "".join(seen), timeout=10)
        finally:
            live.send_signal(signal.SIGINT)
            rc = live.wait(timeout=10)
        text = "".join(seen)
        assert rc == 0, live.stderr.read() if live.stderr else ""
        assert text.startswith(top.HOME) and "(quantiles: last " in text
        assert "req/s" in text and dec2.url in text
    finally:
        g.stop()
        for s in (enc, dec1):
            s.stop()


def _reader(proc: subprocess.Popen) -> list[str]:
    """What `proc` writes to stdout, as it comes."""
    seen: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        while chunk := proc.stdout.read(1):
            seen.append(chunk)

    threading.Thread(target=pump, daemon=True).start()
    return seen


def test_an_unreachable_gateway_is_an_error_once_and_a_retry_line_live():
    dead = f"http://127.0.0.1:{LAB.port()}"  # nothing listens there
    done = epd("top", "--once", dead)
    assert done.returncode == 1 and "unreachable" in done.stderr and done.stdout == ""
    live = subprocess.Popen([sys.executable, "-m", "encoder_service.cli", "top",
                             "--interval", "0.1", dead], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    seen = _reader(live)
    try:
        assert wait_for(lambda: "".join(seen).count("retrying every 0.1 s") >= 2, timeout=20)
    finally:
        live.send_signal(signal.SIGINT)
        assert live.wait(timeout=10) == 0
    assert "unreachable" in "".join(seen)


def test_instances_needs_a_client_key_or_the_admin_token_once_client_keys_are_set(
        tmp_path, monkeypatch):
    monkeypatch.delenv(CLIENT_KEY_ENV, raising=False)
    secret = tmp_path / "secret"
    secret.write_bytes(b"top-test-deployment-secret-0123456789")
    secret.chmod(0o600)
    enc, dec = LAB.stub("encoder"), LAB.stub("decoder")
    keyed = LAB.gateway([enc.url], [dec.url], api_keys=[KEY], secret_file=str(secret))
    open_ = LAB.gateway([enc.url], [dec.url])
    admin = admin_token(secret.read_bytes())
    try:
        url = keyed.url + "/instances"
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}):
            r = httpx.get(url, headers=headers)
            assert r.status_code == 401, (headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert "admin token" in r.json()["error"]["message"]
            assert dec.url not in r.text
        for token in (KEY, admin):
            r = httpx.get(url, headers={"authorization": f"Bearer {token}"})
            assert r.status_code == 200, r.text
            assert [d["url"] for d in r.json()["decoders"]] == [dec.url]
        assert httpx.get(keyed.url + "/metrics").status_code == 200  # metrics stay open
        listed = httpx.get(open_.url + "/instances")  # no client keys: open as before
        assert listed.status_code == 200 and listed.json()["decoders"][0]["url"] == dec.url

        refused = epd("top", "--once", keyed.url)
        assert refused.returncode == 1 and "401" in refused.stderr
        assert "--api-key" in refused.stderr and dec.url not in refused.stdout
        done = epd("top", "--once", keyed.url, env={CLIENT_KEY_ENV: KEY})
        assert done.returncode == 0, done.stderr
        assert table(done.stdout)[dec.url][:3] == ["decode", dec.url, "up"]
        # the same command line in this process: a flag, the secret (admin token), no keys
        monkeypatch.delenv(SECRET_ENV, raising=False)
        for args, env in (([keyed.url, "--api-key", KEY], {}),
                          ([keyed.url, "--secret-file", str(secret)], {}),
                          ([keyed.url], {SECRET_ENV: str(secret)}), ([open_.url], {})):
            for k, v in env.items():
                monkeypatch.setenv(k, v)
            out = io.StringIO()
            assert top.main(["--once", *args], out=out) == 0, args
            assert table(out.getvalue())[dec.url][:3] == ["decode", dec.url, "up"]
    finally:
        keyed.stop()
        open_.stop()
        for s in (enc, dec):
            s.stop()


# -- quantiles and windows, from the gateway's own metrics registry ------------------------
def test_quantiles_follow_prometheus_and_a_live_frame_covers_only_its_interval():
    assert top.quantile(0.5, {0.1: 0, 0.2: 10, float("inf"): 10}) == pytest.approx(0.15)
    assert top.quantile(0.5, {0.1: 5, 0.2: 10, float("inf"): 10}) == 0.1
    assert top.quantile(0.99, {0.1: 5, 0.2: 5, float("inf"): 10}) == 0.2  # past the last
    assert top.quantile(0.5, {0.1: 0, float("inf"): 0}) is None
    # a counter reset (the gateway restarted) between two readings: the new counts alone
    assert top.delta({1.0: 2}, {1.0: 5}) == {1.0: 2}
    assert top.delta({1.0: 7}, {1.0: 5}) == {1.0: 2}

    m = GatewayMetrics()
    url = "http://10.0.0.7:8000"
    listed = {"encoders": [], "decoders": [{"url": url, "state": "cooling_down",
                                            "inflight": 2, "requests": 20, "affinity": 3}]}

    def snap(at: float) -> top.Snapshot:
        from prometheus_client import generate_latest

        return top.Snapshot(at, top.parse_metrics(generate_latest(m.registry).decode()),
                            listed)

    for _ in range(10):
        m.instance_first_token.labels(url).observe(0.004)
        m.requests.labels("chat", "200").inc()
    first = snap(100.0)
    for _ in range(10):
        m.instance_first_token.labels(url).observe(0.4)
        m.requests.labels("chat", "200").inc()
    second = snap(102.0)
    whole = top.make_frame(second, None, url).rows[0]
    window = top.make_frame(second, first, url)
    assert whole["ttft_p50_s"] == pytest.approx(0.005) and 0.2 < whole["ttft_p99_s"] <= 0.5
    assert 0.2 < window.rows[0]["ttft_p50_s"] <= 0.5  # the last interval's ten
    assert window.totals["req_per_s"] == 5.0 and window.window == "last 2.0 s"
    assert (window.rows[0]["state"], window.rows[0]["hits"]) == ("cooling", 3)
    text = top.render(window, clock="12:00:00")
    assert table(text)[url][:6] == ["decode", url, "cooling", "2", "-", "20"]
    assert "20 (2xx 20)  5.0 req/s" in text


def test_elastic_roles_and_each_scale_decision_get_a_line():
    """`epd up`'s elastic roles (GET /instances' "scaling", scaler.py): a line per role, then
    one per recent decision, newest last; in --json too; none without elastic roles."""
    scaling = {"roles": {"decode": {"serving": 1, "starting": 0, "draining": 1, "wanted": 1,
                                    "min": 1, "max": 2, "load": 0.5}},
               "decisions": [{"at": 1000.0 + i, "role": "decode", "direction": d,
                              "reason": r, "instance": "decode-1", "detail": f"why {i}"}
                             for i, (d, r) in enumerate([("up", "load_above_target"),
                                                         ("down", "idle")] * 4)]}
    snap = top.Snapshot(0.0, {}, {"encoders": [], "decoders": [], "scaling": scaling})
    frame = top.make_frame(snap, None, "http://gw")
    text = top.render(frame, clock="12:00:00")
    assert "elastic decode: 1 serving (1..2), 0 starting, 1 draining, load 0.5" in text
    lines = [ln for ln in text.splitlines() if ln.startswith("scale ")]
    assert len(lines) == 5 and lines[-1].startswith("scale decode down ")
    assert lines[-1].endswith("decode-1 (idle): why 7")
    assert json.loads(top.as_json(frame))["scaling"] == scaling
    plain = top.make_frame(top.Snapshot(0.0, {}, {"encoders": [], "decoders": []}), None, "u")
    assert "elastic" not in top.render(plain) and "scale " not in top.render(plain)
