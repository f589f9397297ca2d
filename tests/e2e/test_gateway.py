"""The gateway end to end: `epd up` (a real subprocess: vLLM encoder + vLLM prefill/decode +
gateway on the tiny model; the shared E_PD fleet, tests/e2e/fleets.py) beside the session's
aggregated vLLM server (the reference).
Answers through the gateway must equal the aggregated server's; counts come from /metrics. The
last tests kill servers under `epd up` (a decode instance's API server and the encoder's
EngineCore, then the encoder's API server: each is restarted and taken back, no request
fails; tests/e2e/outage.py), then stop `epd up` with SIGINT and check that nothing is left
behind, in any session it ever started."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from encoder_service.local.processes import metric_value
from encoder_service.local.requests import chat_body, sample_image_png
from epd_common import child_process
from epd_common.child_process import session_members
from tests.e2e import fleets
from tests.e2e.client import FIELDS, MODEL_NAME, PROMPT, answer, ask, metric_at, stream_killing
from tests.e2e.outage import (
    Traffic,
    engine_core,
    instance_states,
    server_session,
    sessions_of,
    wait_back,
)
from tests.helpers import ROOT, alive, descendants, port_block, wait_for

UP_PORT = port_block(__name__)[0]  # this module's own: replicas, proxies (+20..+26)
FLEET = fleets.E_PD_PORT  # the shared E_PD fleet: gateway, encoder +1, decode +2
ENC_URL, DEC_URL = f"http://127.0.0.1:{FLEET + 1}", f"http://127.0.0.1:{FLEET + 2}"
GW = f"http://127.0.0.1:{FLEET}"


@pytest.fixture(scope="module")
def cluster(e_pd_fleet, aggregated):
    """The shared E_PD fleet (tests/e2e/fleets.py): its `epd up` (encoder, decode instance)
    and its second decode instance. The kill tests leave what they kill to `epd up`, which
    restarts it; the last two stop the second decode instance and the whole `epd up`,
    which the fleet starts again for a later user."""
    fleet = e_pd_fleet.ensure()
    aggregated.wait()
    with httpx.Client(timeout=120) as client:
        yield {"agg": aggregated, "up": fleet.up.proc, "client": client, "log": fleet.log_path,
               "storage": Path(fleet.conf["storage_path"]), "work": fleet.work,
               "dec2": fleet.beside[0]}


def gw_metric(c, name) -> float:
    return metric_at(c, GW, name)


def finished(c, url, reason) -> float:
    """vllm:request_success_total for one finish reason."""
    text = c["client"].get(url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{")
               and f'finished_reason="{reason}"' in line)


def test_answers_equal_the_aggregated_server_streamed_and_not(cluster):
    c = cluster
    image = sample_image_png(seed=501)
    ref = answer(c, c["agg"], image)
    encoded = gw_metric(c, 'epd_gateway_items_total{outcome="encoded"}')
    assert answer(c, GW, image) == ref
    assert gw_metric(c, 'epd_gateway_items_total{outcome="encoded"}') == encoded + 1
    # a fresh image, streamed: now that the encoder was seen to publish no placeholder
    # metadata (LLaVA), the decode request goes out while the image is encoded (overlap)
    image2 = sample_image_png(seed=502)
    ref2 = answer(c, c["agg"], image2)
    overlapped = gw_metric(c, 'epd_gateway_items_total{outcome="overlapped"}')
    body = {**chat_body(MODEL_NAME, image2, PROMPT, max_tokens=8), "stream": True}
    tokens = []
    with c["client"].stream("POST", GW + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                tokens += json.loads(line[6:])["choices"][0].get("token_ids") or []
    # Not one chunk per token: under load vLLM may put several tokens in one chunk.
    assert tokens == ref2
    assert gw_metric(c, 'epd_gateway_items_total{outcome="overlapped"}') == overlapped + 1
    assert gw_metric(c, 'epd_gateway_items_total{outcome="fallback"}') == 0
    models = c["client"].get(GW + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL_NAME]


def test_repeated_image_skips_encoding(cluster):
    c = cluster
    image = sample_image_png(seed=503)
    ref = answer(c, c["agg"], image)
    assert answer(c, GW, image) == ref
    enc_calls = finished(c, ENC_URL, "length") + finished(c, ENC_URL, "stop")
    hits = gw_metric(c, 'epd_gateway_items_total{outcome="cache_hit"}')
    assert answer(c, GW, image) == ref
    assert gw_metric(c, 'epd_gateway_items_total{outcome="cache_hit"}') == hits + 1
    time.sleep(0.5)
    assert finished(c, ENC_URL, "length") + finished(c, ENC_URL, "stop") == enc_calls


def assert_aborted_early(c, tokens_before: float, what: str) -> None:
    """The decode instance stopped the 900-token request long before its end (client
    aborts are not counted in vllm:request_success_total, so count generated tokens)."""
    assert wait_for(lambda: metric_at(c, DEC_URL, "vllm:num_requests_running") == 0,
                    timeout=10, interval=0.1), f"{what}: still running on the decode instance"
    made = metric_at(c, DEC_URL, "vllm:generation_tokens_total") - tokens_before
    assert made < 450, f"{what}: {made:.0f} tokens generated after the client left"


def test_client_disconnect_aborts_the_upstream_request(cluster):
    c = cluster
    long = {"max_tokens": 900, "ignore_eos": True}
    gone = gw_metric(c, "epd_gateway_client_disconnects_total")
    tokens = metric_at(c, DEC_URL, "vllm:generation_tokens_total")
    body = {**chat_body(MODEL_NAME, sample_image_png(seed=504), PROMPT), **long, "stream": True}
    with httpx.Client(timeout=60) as client, client.stream(
            "POST", GW + "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # first token seen: hang up
    assert_aborted_early(c, tokens, "streamed")
    # non-streamed: the client hangs up once the decode instance is generating (watched on
    # its metrics, not timed: on an idle machine 900 tokens take about a second)
    tokens = metric_at(c, DEC_URL, "vllm:generation_tokens_total")
    body = {**chat_body(MODEL_NAME, sample_image_png(seed=505), PROMPT), **long}
    payload = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", FLEET), timeout=60) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
        assert wait_for(lambda: metric_at(c, DEC_URL, "vllm:num_requests_running") >= 1,
                        timeout=30, interval=0.02), "the request never reached the decode"
    assert_aborted_early(c, tokens, "non-streamed")
    assert gw_metric(c, "epd_gateway_client_disconnects_total") == gone + 2
    # control: the same request left alone does generate all 900 tokens
    tokens = metric_at(c, DEC_URL, "vllm:generation_tokens_total")
    ask(c, GW, sample_image_png(seed=505), max_tokens=900, ignore_eos=True)
    assert wait_for(lambda: metric_at(c, DEC_URL, "vllm:generation_tokens_total")
                    >= tokens + 900, timeout=5, interval=0.1)


class Gateway2:
    """Another `epd gateway` process over this cluster's servers (a stateless replica)."""

    def __init__(self, c, port: int, decoders: list[str]) -> None:
        self.log = open(c["work"] / f"gateway-{port}.log", "wb")  # noqa: SIM115 - stop()
        self.proc = child_process.popen(
            [sys.executable, "-m", "encoder_service.cli", "gateway", "--port", str(port),
             "--model", MODEL_NAME, "--encoder", ENC_URL,
             *(x for d in decoders for x in ("--decoder", d)),
             "--storage-path", str(c["storage"])],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                return c["client"].get(self.url + "/health").status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_for(up, timeout=60, interval=0.2), "second gateway did not start"

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=30)
        self.log.close()


def test_sixteen_concurrent_requests_for_one_new_image_encode_once_across_two_gateways(
        cluster):
    """A second gateway process over the same encoder and decode instance (stateless
    replicas): 8 requests through each at once for an image nobody encoded yet. Single flight
    inside each gateway, affinity across them, and the encoder's own cache: one encode."""
    c = cluster
    image = sample_image_png(seed=777)
    ref = answer(c, c["agg"], image)
    gw2 = Gateway2(c, UP_PORT + 20, [DEC_URL])
    gw2_url = gw2.url
    try:
        def items(outcome: str) -> float:
            return sum(metric_value(c["client"].get(u + "/metrics").text,
                                    f'epd_gateway_items_total{{outcome="{outcome}"}}')
                       for u in (GW, gw2_url))

        saves = metric_at(c, ENC_URL, "vllm:epd_saves_total")
        before = {o: items(o) for o in ("encoded", "shared", "cache_hit")}
        start = threading.Barrier(16)

        def one(i: int) -> list[int]:
            body = chat_body(MODEL_NAME, image, PROMPT, max_tokens=8)
            with httpx.Client(timeout=120) as client:
                start.wait(timeout=30)  # all 16 at once
                r = client.post((GW, gw2_url)[i % 2] + "/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(one, range(16)))
        assert answers == [ref] * 16
        wait_for(lambda: metric_at(c, ENC_URL, "vllm:epd_saves_total") > saves, timeout=5)
        time.sleep(0.5)  # a second save, if there were one, would be counted by now
        assert metric_at(c, ENC_URL, "vllm:epd_saves_total") - saves == 1  # one encode
        delta = {o: items(o) - n for o, n in before.items()}
        print("two gateways, 16 requests:", delta)
        assert delta["encoded"] <= 2  # at most one leader per gateway; the rest shared or hit
        assert sum(delta.values()) == 16
        listed = c["client"].get(gw2_url + "/instances").json()
        assert [e["url"] for e in listed["encoders"]] == [ENC_URL]
    finally:
        gw2.stop()


def test_concurrent_requests_new_images_share_calls_to_the_vllm_encoder(cluster):
    """Twelve requests at once, each with an image nobody encoded: the gateway sends the
    vLLM encoder fewer calls than requests (images that arrive while its calls are busy go
    together, routing.coalesce_items), every image is encoded once, every answer is the
    aggregated server's."""
    c = cluster
    images = [sample_image_png(seed=930 + i) for i in range(12)]
    refs = [answer(c, c["agg"], im) for im in images]
    calls = gw_metric(c, "epd_gateway_encoder_call_items_count")
    items = gw_metric(c, "epd_gateway_encoder_call_items_sum")
    saves = metric_at(c, ENC_URL, "vllm:epd_saves_total")
    start = threading.Barrier(12)

    def one(i: int) -> list[int]:
        with httpx.Client(timeout=120) as client:
            start.wait(timeout=30)
            r = client.post(GW + "/v1/chat/completions",
                            json=chat_body(MODEL_NAME, images[i], PROMPT, max_tokens=8))
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(12) as pool:
        assert list(pool.map(one, range(12))) == refs
    assert gw_metric(c, "epd_gateway_encoder_call_items_sum") == items + 12
    n_calls = gw_metric(c, "epd_gateway_encoder_call_items_count") - calls
    print("12 new images, encoder calls:", n_calls)
    assert 0 < n_calls < 12
    # The encoder's engine steps until its workers report the saves (has_pending_push_work):
    # the count is current once the burst is over, not at the next request.
    wait_for(lambda: metric_at(c, ENC_URL, "vllm:epd_saves_total") >= saves + 12, timeout=5)
    assert metric_at(c, ENC_URL, "vllm:epd_saves_total") - saves == 12  # each encoded once


@pytest.fixture(scope="module")
def second_decoder(cluster):
    """A second real decode instance on the same storage (started with the cluster, for the
    tests of membership and failover)."""
    cluster["dec2"].wait()
    return cluster["dec2"]


def test_decode_instances_join_and_leave_under_load_and_no_request_is_lost(cluster,
                                                                           second_decoder):
    """A gateway replica serving with one decode instance: under load, the second joins,
    then the first leaves (drained); every answer equals the aggregated server's."""
    c, dec2 = cluster, second_decoder
    gw2 = Gateway2(c, UP_PORT + 23, [DEC_URL])
    images = [sample_image_png(seed=850 + i) for i in range(4)]
    refs = [answer(c, c["agg"], im) for im in images]
    admin = gw2.url + "/admin/instances"  # no secret: loopback callers may
    try:
        def one(i: int) -> bool:
            body = chat_body(MODEL_NAME, images[i % 4], PROMPT, max_tokens=8)
            with httpx.Client(timeout=120) as client:
                r = client.post(gw2.url + "/v1/chat/completions", json=body)
            return r.status_code == 200 and r.json()["choices"][0]["token_ids"] == refs[i % 4]

        with ThreadPoolExecutor(4) as pool:
            results = [pool.submit(one, i) for i in range(24)]
            time.sleep(0.5)
            joined = c["client"].post(admin, json={"role": "decoder", "url": dec2.url,
                                                   "action": "add"})
            assert joined.status_code == 200, joined.text
            time.sleep(0.5)
            left = c["client"].post(admin, json={"role": "decoder", "url": DEC_URL,
                                                 "action": "remove"}, timeout=120)
            assert left.json()["drained"] is True, left.text
            assert all(f.result() for f in results)
        listed = c["client"].get(gw2.url + "/instances").json()
        assert [d["url"] for d in listed["decoders"]] == [dec2.url]
        assert listed["decoders"][0]["requests"] > 0  # the newcomer served some
    finally:
        gw2.stop()




def test_vllm_proxy_registration_moves_real_decode_instances(cluster, second_decoder):
    """vLLM's own EPD proxy registration (POST and DELETE /instances, as vLLM 0.32-0.34's
    launch scripts send it: docs/compatibility.md) on a gateway replica serving with the
    first decode instance: the second joins as `prefill_decode` and the first leaves, a
    request is answered by the newcomer as the aggregated server answers it; then the first
    joins back and the second leaves, and the first answers again."""
    c, dec2 = cluster, second_decoder
    gw2 = Gateway2(c, UP_PORT + 21, [DEC_URL])
    url = gw2.url + "/instances"  # no secret: loopback callers may

    def served(instance: str) -> float:
        return metric_at(c, instance, "vllm:request_success_total")

    def moves(joining: str, leaving: str, seed: int) -> None:
        joined = c["client"].post(url, json={"role": "prefill_decode", "url": joining})
        assert joined.json() == {"registered": True}, joined.text
        left = c["client"].delete(url, params={"url": leaving}, timeout=120)
        assert left.json() == {"removed": True}, left.text
        assert [d["url"] for d in c["client"].get(url).json()["decoders"]] == [joining]
        image, before = sample_image_png(seed=seed), served(joining)
        assert answer(c, gw2.url, image) == answer(c, c["agg"], image)
        assert wait_for(lambda: served(joining) > before, timeout=5, interval=0.1)

    try:
        moves(dec2.url, DEC_URL, seed=871)
        moves(DEC_URL, dec2.url, seed=872)
    finally:
        gw2.stop()


def test_streams_cut_mid_answer_continue_exactly_for_each_field_or_end_with_an_error(
        cluster, second_decoder):
    """Both decode instances behind proxies that break each stream off after a few events
    (a real TCP close, as a dying instance does). Per request field the answer either goes
    on exactly (ids and text equal the aggregated server's, the usage chunk too) or stops
    with an error event after a correct prefix: never a wrong token."""
    from epd_testkit.conformance import CuttingProxy

    c, dec2 = cluster, second_decoder
    proxies = [CuttingProxy(u, UP_PORT + 24 + i, seed=i, max_events=12).start()
               for i, u in enumerate([DEC_URL, dec2.url])]
    gw2 = Gateway2(c, UP_PORT + 26, [p.url for p in proxies])
    try:
        for n, (fields, how) in enumerate(FIELDS):
            image = sample_image_png(seed=870 + n)
            body = {**chat_body(MODEL_NAME, image, PROMPT), "temperature": 0.0, **fields}
            ref = c["client"].post(c["agg"].url + "/v1/chat/completions",
                                   json={**body, "stream": True}).text
            got = c["client"].post(gw2.url + "/v1/chat/completions",
                                   json={**body, "stream": True}).text

            def parse(sse: str) -> tuple[list[int], str, list[dict], dict | None]:
                ids, text, errors, usage = [], "", [], None
                for line in sse.splitlines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        errors.append(event)
                    usage = event.get("usage") or usage
                    for ch in event.get("choices") or ():
                        ids += ch.get("token_ids") or []
                        text += (ch.get("delta") or {}).get("content") or ""
                return ids, text, errors, usage

            r_ids, r_text, _, r_usage = parse(ref)
            g_ids, g_text, errors, g_usage = parse(got)
            assert r_ids, fields
            if how == "refused":
                assert errors and r_ids[:len(g_ids)] == g_ids and r_text.startswith(g_text)
                continue
            assert not errors, (fields, errors)
            assert (g_ids, g_text) == (r_ids, r_text), (fields, how)
            if r_usage is not None:
                assert g_usage is not None and g_usage["completion_tokens"] == r_usage[
                    "completion_tokens"]
        assert sum(p.cuts for p in proxies) >= len(FIELDS) - 1  # streams were really cut
        text = c["client"].get(gw2.url + "/metrics").text
        assert metric_value(text, 'epd_gateway_failovers_total{outcome="resumed"}') >= len(
            FIELDS) - 2
    finally:
        gw2.stop()
        for p in proxies:
            p.stop()


ENCODED = 'epd_gateway_items_total{outcome="encoded"}'


def restarts(c, name: str) -> float:
    return gw_metric(c, f'epd_restarts_total{{instance="{name}"}}')


def test_epd_up_restarts_killed_servers_and_no_request_fails(cluster, second_decoder):
    """`epd up` supervises its servers. With the second decode instance joined to its
    gateway (so that one may be down), the decode instance's API server and the encoder's
    EngineCore are SIGKILLed together while requests flow: no process of either server's
    session remains (the API server's engine went with it; the encoder's API server exits
    once its engine is dead), both are restarted on their ports and taken back by the
    gateway within 120 s, every request is answered correctly (the items go raw while the
    encoder is down), and each restarted server then serves a new request. The encoder's
    API server: test_encoder_killed_mid_run_..."""
    from ec_connectors.protocol.keys import content_item_id
    from encoder_service.gateway.upstreams.routing import rendezvous

    c, dec2, client = cluster, second_decoder, cluster["client"]
    admin = GW + "/admin/instances"
    joined = client.post(admin, json={"role": "decoder", "url": dec2.url, "action": "add"})
    assert joined.status_code == 200, joined.text
    try:
        enc, dec = (server_session(c["up"].pid, FLEET + i) for i in (1, 2))
        before = {n: restarts(c, n) for n in ("decode-0", "encoder-0")}
        c.setdefault("sessions", set()).update({enc, dec})
        core = engine_core(enc)
        with Traffic(c, GW, first_seed=10_000) as traffic:  # clear of every seed below
            assert wait_for(lambda: traffic.sent >= 2, timeout=30)
            # both at once: their restarts overlap (two vLLM starts in parallel), and a
            # request finds one decode instance refusing while the encoder is gone too
            t0 = time.monotonic()
            os.kill(dec, signal.SIGKILL)  # decode-0's API server
            os.kill(core, signal.SIGKILL)  # the encoder's EngineCore (its API server stays)
            for session in (dec, enc):
                assert wait_for(lambda s=session: not session_members(s), timeout=20,
                                interval=0.1), "a process of a killed server remains"
            assert wait_for(lambda: "down" in instance_states(client, GW).values(),
                            timeout=10, interval=0.1)
            took = wait_back(client, GW, [DEC_URL, ENC_URL], t0)
        print(f"decode API server and encoder EngineCore killed: both back within "
              f"{took:.0f} s, {traffic.sent} requests meanwhile")
        assert not traffic.failures, traffic.failures
        assert {n: restarts(c, n) - k for n, k in before.items()} == {"decode-0": 1,
                                                                      "encoder-0": 1}
        log = c["log"].read_text()
        assert "WARNING: decode-0 killed by SIGKILL" in log
        assert "WARNING: encoder-0 exited" in log and "restarted encoder-0" in log
        # each serves a new request: an image whose affinity is decode-0, encoded
        image = next(im for im in (sample_image_png(seed=n) for n in range(1100, 1200))
                     if rendezvous(content_item_id(im, MODEL_NAME), [DEC_URL, dec2.url])[0]
                     == DEC_URL)
        ref = answer(c, c["agg"], image)
        served, encoded = metric_at(c, DEC_URL, "vllm:request_success_total"), gw_metric(
            c, ENCODED)
        assert answer(c, GW, image) == ref
        assert gw_metric(c, ENCODED) == encoded + 1
        assert wait_for(lambda: metric_at(c, DEC_URL, "vllm:request_success_total")
                        > served, timeout=5, interval=0.1)
    finally:
        client.post(admin, json={"role": "decoder", "url": dec2.url, "action": "remove"},
                    timeout=120)


class LongStreams:
    """`n` long greedy text streams through `gateway` on threads (600 tokens, `ignore_eos`),
    each read to its end; `errors`: those that ended with an error event or failed."""

    def __init__(self, gateway: str, n: int) -> None:
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._one, args=(gateway,), daemon=True)
                        for _ in range(n)]
        for t in self.threads:
            t.start()

    def _one(self, gateway: str) -> None:
        body = {"model": MODEL_NAME, "stream": True, "temperature": 0.0, "max_tokens": 600,
                "ignore_eos": True, "messages": [{"role": "user", "content": PROMPT}]}
        try:
            with httpx.Client(timeout=300) as client, client.stream(
                    "POST", gateway + "/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith('data: {"error"'):
                        self.errors.append(line)
        except httpx.HTTPError as exc:
            self.errors.append(repr(exc))

    def open(self) -> int:
        return sum(t.is_alive() for t in self.threads)

    def join(self) -> None:
        for t in self.threads:
            t.join(timeout=300)


def test_in_flight_per_decode_instance_equals_its_open_requests_through_a_kill(
        cluster, second_decoder):
    """What load-aware routing reads: GET /instances' `inflight` of each decode instance is
    the number of requests that instance is really serving (its own vLLM's running and
    waiting requests), with streams open while decode-0 is SIGKILLed (its streams continue
    on the second instance), and again once `epd up` restarted it and the gateway took it
    back (the count once drifted there: 0 on an instance streaming an answer)."""
    c, dec2, client = cluster, second_decoder, cluster["client"]
    admin = GW + "/admin/instances"
    urls = [DEC_URL, dec2.url]

    def listed() -> dict[str, int]:
        return {d["url"]: d["inflight"] for d in client.get(GW + "/instances").json()[
            "decoders"]}

    def serving(url: str) -> int:
        try:
            return int(metric_at(client, url, "vllm:num_requests_running")
                       + metric_at(client, url, "vllm:num_requests_waiting"))
        except httpx.HTTPError:  # killed: it serves nothing
            return 0

    def exact(total: int) -> bool:
        counts = listed()
        return sum(counts.values()) == total and counts == {u: serving(u) for u in urls}

    joined = client.post(admin, json={"role": "decoder", "url": dec2.url, "action": "add"})
    assert joined.status_code == 200, joined.text
    try:
        streams = LongStreams(GW, 4)
        assert wait_for(lambda: exact(4), timeout=60, interval=0.2), (listed(), [
            serving(u) for u in urls])
        assert min(listed().values()) > 0  # both serve some (least loaded: 2 and 2)
        dec = server_session(c["up"].pid, FLEET + 2)
        c.setdefault("sessions", set()).add(dec)
        t0 = time.monotonic()
        os.kill(dec, signal.SIGKILL)  # decode-0's API server, mid-stream
        assert wait_for(lambda: listed() == {DEC_URL: 0, dec2.url: streams.open()}
                        and exact(streams.open()), timeout=30, interval=0.2), (
            listed(), streams.open(), serving(dec2.url))
        wait_back(client, GW, [DEC_URL], t0)
        streams.join()
        assert not streams.errors, streams.errors  # every stream went on exactly
        assert wait_for(lambda: listed() == dict.fromkeys(urls, 0), timeout=10), listed()
        again = LongStreams(GW, 4)  # on both again, the restarted one included
        assert wait_for(lambda: exact(4), timeout=60, interval=0.2), (listed(), [
            serving(u) for u in urls])
        assert listed()[DEC_URL] > 0
        again.join()
        assert not again.errors, again.errors
        assert wait_for(lambda: listed() == dict.fromkeys(urls, 0), timeout=10), listed()
    finally:
        client.post(admin, json={"role": "decoder", "url": dec2.url, "action": "remove"},
                    timeout=120)


def test_a_decode_instance_killed_mid_stream_the_answer_goes_on_elsewhere(cluster,
                                                                          second_decoder):
    """A second decode instance serves a long greedy stream and is SIGKILLed after the first
    tokens. The gateway continues the answer on the other instance through vLLM's token-in
    API (`epd up` decode instances serve it): the same prompt plus the tokens already sent.
    The client gets one stream whose tokens are exactly the aggregated server's: none
    repeated, none missing. The second decode instance stays dead: the fleet starts it
    again for a later user."""
    from ec_connectors.protocol.keys import content_item_id
    from encoder_service.gateway.upstreams.routing import rendezvous

    c, dec2 = cluster, second_decoder
    gw2 = None
    try:
        gw2 = Gateway2(c, UP_PORT + 22, [DEC_URL, dec2.url])
        image = next(im for im in (sample_image_png(seed=n) for n in range(800, 900))
                     if rendezvous(content_item_id(im, MODEL_NAME), [DEC_URL, dec2.url])[0]
                     == dec2.url)  # its affinity: the instance that will die
        long = {"max_tokens": 300, "ignore_eos": True}
        ref = answer(c, c["agg"], image, **long)
        body = {**chat_body(MODEL_NAME, image, PROMPT), **long, "stream": True}
        with httpx.Client(timeout=120) as client:
            got, errors, killed = stream_killing(
                client, gw2.url, body, lambda: os.killpg(dec2.proc.pid, signal.SIGKILL))
        text = c["client"].get(gw2.url + "/metrics").text
        resumed = metric_value(text, 'epd_gateway_failovers_total{outcome="resumed"}')
        refused = metric_value(text, 'epd_gateway_failovers_total{outcome="refused"}')
        print(f"failover: resumed={resumed} refused={refused} after {len(got)} of "
              f"{len(ref)} tokens")
        assert killed and resumed == 1 and refused == 0
        assert not errors and got == ref  # one uninterrupted, exact stream
    finally:
        if gw2 is not None:
            gw2.stop()


def test_encoder_killed_mid_run_answers_stay_correct_and_it_comes_back(cluster):
    """The encoder's API server SIGKILLed between requests: the next request goes raw
    (fallback), and each after it until the encoder is back (a restart from its warm fork
    server can beat the rest); its EngineCore goes with it, `epd up` restarts it and the
    gateway takes it back within 120 s while requests flow, all answered; then it encodes
    again."""
    c = cluster
    images = [sample_image_png(seed=600 + i) for i in range(5)]
    refs = [answer(c, c["agg"], im) for im in images]
    fallbacks = gw_metric(c, 'epd_gateway_items_total{outcome="fallback"}')
    restarted = restarts(c, "encoder-0")
    encoder = server_session(c["up"].pid, FLEET + 1)
    c.setdefault("sessions", set()).add(encoder)
    for i, (im, ref) in enumerate(zip(images, refs, strict=True)):
        if i == 2:
            t0 = time.monotonic()
            os.kill(encoder, signal.SIGKILL)  # the API server alone
        assert answer(c, GW, im) == ref, f"request {i}"
    fell_back = gw_metric(c, 'epd_gateway_items_total{outcome="fallback"}') - fallbacks
    assert 1 <= fell_back <= 3, fell_back  # the three requests from the kill on
    assert "encoder failure" in c["log"].read_text()
    assert wait_for(lambda: not session_members(encoder), timeout=10, interval=0.1), \
        "the killed encoder's EngineCore remains"
    with Traffic(c, GW, first_seed=20_000) as traffic:  # clear of seed 1399 below
        took = wait_back(c["client"], GW, [ENC_URL], t0)
    print(f"encoder API server killed: back in {took:.0f} s, {traffic.sent} requests meanwhile")
    assert not traffic.failures, traffic.failures
    assert restarts(c, "encoder-0") == restarted + 1
    encoded, image = gw_metric(c, ENCODED), sample_image_png(seed=1399)
    assert answer(c, GW, image) == answer(c, c["agg"], image)
    assert gw_metric(c, ENCODED) == encoded + 1


def test_epd_up_stops_everything_on_sigint_kills_included(cluster):
    """Ctrl-C (SIGINT; every other `epd up` test stops it with SIGTERM) stops every process
    `epd up` started and all they started, in every session it had (killed servers too).
    The fleet's `epd up` stays stopped: the fleet starts it again for a later user."""
    c = cluster
    up = c["up"]
    procs = descendants(up.pid)
    assert len(procs) >= 2  # the decode instance's API server and engine core at least
    # and every server session `epd up` ever had, those of servers killed and restarted too
    sessions = (sessions_of(procs) | c.get("sessions", set())) - {os.getsid(0)}
    up.send_signal(signal.SIGINT)
    assert up.wait(timeout=90) == 0
    assert wait_for(lambda: not any(alive(p) for p in procs), timeout=10)
    assert not any(session_members(s) for s in sessions), "left behind"
    with pytest.raises(httpx.ConnectError):
        httpx.get(DEC_URL + "/health", timeout=2)
    assert "stopped" in c["log"].read_text()
