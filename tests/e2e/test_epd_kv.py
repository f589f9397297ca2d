"""E/P/D end to end: `epd up --prefill 1 --decode 1` (a vLLM encoder, a prefill instance and a
decode instance, both EC consumers with vLLM's NixlConnector on cpu buffers, the gateway in
front; tiny LLaVA, embeddings read over NIXL: the shared E_P_D fleet, tests/e2e/fleets.py)
beside the session's aggregated vLLM server. First the connector over NIXL alone, between the
encoder and the prefill instance called directly, its producer killed mid-read.
An image request through the gateway answers the aggregated server's greedy tokens; the
decode instance's own metrics show it loaded the prompt's KV cache (vLLM's
prompt_tokens_by_source: external_kv_transfer, at most the last token computed) and neither
encoded nor loaded the image (EPDConnector: no load, no local encode; the prefix it was
handed covers the item); the gateway counts one handoff and no failure; a streamed answer is
the same too. The same deployment runs with tracing on (a receiver in this process,
epd_testkit/trace_sink.py): one image request with a caller's traceparent is one trace across the
gateway, the encoder's vLLM, the prefill instance's vLLM (and its connector's load) and the
decode instance's vLLM; `epd top --once` lists every instance; idle, the KV instances do not
spin (NIXL's progress thread off: ec_connectors/plugin.py). Then the decode instance is
killed mid-stream: the stream goes on, exact, on the prefill instance, which also answers
the requests sent while the decode instance is down (it comes back: one restart). Last, the
prefill instance is killed: the next request is still answered exactly, the decode instance
computing the prompt itself, the failed handoff logged and counted."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from encoder_service.local.requests import chat_body, sample_image_png
from tests.e2e import fleets
from tests.e2e.client import (
    MODEL_NAME,
    PROMPT,
    answer,
    ask,
    case,
    encode,
    metric,
    metric_at,
    stream_killing,
    tokens,
    wait_metric,
)
from tests.helpers import ServerAt, descendants, server_pid, wait_for

pytest.importorskip("nixl._api")
# the shared E_P_D fleet: gateway, encoder +1, decode +2, prefill +3
BASE = fleets.E_P_D_PORT
ENCODER, DECODE, PREFILL = (f"http://127.0.0.1:{BASE + i}" for i in (1, 2, 3))
TRACE, CALLER = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"


def by_source(text: str, source: str) -> float:
    """vllm:prompt_tokens_by_source_total{source=...} in a /metrics text."""
    pattern = re.compile(r'^vllm:prompt_tokens_by_source_total\{[^}]*source="'
                         + source + r'"[^}]*\} (\S+)$', re.M)
    return sum(float(v) for v in pattern.findall(text))


def streamed(c, url: str, image: bytes) -> list[int]:
    """The token ids of a streamed greedy answer."""
    body = {**chat_body(MODEL_NAME, image, PROMPT), "stream": True, "return_token_ids": True}
    ids: list[int] = []
    with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:]).get("choices") or ():
                    ids += choice.get("token_ids") or []
    return ids


def kill_server(root: int, port: int) -> None:
    """SIGKILL the session of the vLLM server under `root` that serves `port`."""
    os.killpg(os.getpgid(server_pid(root, port)), signal.SIGKILL)


def tree_cpu_s(pids: set[int]) -> float:
    """CPU seconds (user + system) the live processes of `pids` have used."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
    return total


@pytest.fixture(scope="module")
def deployment(e_p_d_fleet, aggregated):
    """The shared E_P_D fleet (tests/e2e/fleets.py). The last two tests kill its decode and
    its prefill instance; `epd up` restarts them (one restart each)."""
    fleet = e_p_d_fleet.ensure()
    aggregated.wait()
    with httpx.Client(timeout=120) as c:
        yield {"up": fleet.up.proc, "gw": fleet.gw, "log": fleet.log_path, "c": c,
               "sink": fleet.extra["sink"], "agg": aggregated}


@pytest.fixture(scope="module")
def nixl_pair(deployment):
    """The encoder (the NIXL producer) and the prefill instance (a NIXL consumer), called
    directly."""
    yield {"agg": deployment["agg"], "prod": ServerAt(ENCODER), "cons": ServerAt(PREFILL),
           "client": deployment["c"], "endpoint": fleets.e_p_d_endpoint(),
           "up": deployment["up"]}


def test_nixl_reads_equal_aggregated_and_a_killed_producer_costs_a_recompute(nixl_pair,
                                                                            e_p_d_fleet):
    """EPDConnector over NIXL (UCX on loopback) between the encoder, whose agent registers
    its items where they lie, and the prefill instance, which READs them: the answer equals
    the aggregated server's; the encoder killed while the prefill instance's read is in
    flight costs a local encode, never an error or another answer. `epd up` restarts the
    encoder; the test ends once it is back."""
    c = nixl_pair
    image, item_id, reference = case(c, seed=601)
    params = encode(c, image, item_id)
    assert params["epd"]["transport"] == "nixl" and params["epd"]["endpoint"] == c["endpoint"]
    loads = metric(c, "loads_total")
    assert tokens(ask(c, c["cons"], image, item_id, params)) == reference
    assert wait_metric(c, "loads_total", loads + 1) == loads + 1
    assert metric(c, "held_in_place_total", server=c["prod"]) >= 1
    # Killed mid-transfer: the next item is encoded, then its producer (API server,
    # EngineCore, the worker holding the NIXL agent) is frozen, so the consumer's pull is
    # surely in flight when the kill lands.
    image, item_id, reference = case(c, seed=602)
    params = encode(c, image, item_id)
    fallbacks = metric(c, "local_encode_fallbacks_total")
    producer = os.getpgid(server_pid(c["up"].pid, fleets.E_P_D_PORT + 1))
    os.killpg(producer, signal.SIGSTOP)
    answer: dict = {}
    asking = threading.Thread(target=lambda: answer.update(
        ask(c, c["cons"], image, item_id, params)))
    t0 = time.monotonic()
    asking.start()
    time.sleep(1.0)
    assert asking.is_alive()  # waiting on the frozen producer
    os.killpg(producer, signal.SIGKILL)
    asking.join(60)
    assert tokens(answer) == reference  # encoded locally: the same answer, no error
    assert time.monotonic() - t0 < 12  # within the load deadline, not a hang
    assert wait_metric(c, "local_encode_fallbacks_total", fallbacks + 1) >= fallbacks + 1
    e_p_d_fleet.ensure()  # the encoder restarted by `epd up`, for the tests after


def test_epd_up_prefill_decode_hands_the_kv_cache_over(deployment):
    d = deployment
    c, gw, aggregated = d["c"], d["gw"], d["agg"]
    image = sample_image_png(seed=71)
    ref = answer(c, aggregated.url, image)
    assert answer(c, gw, image) == ref
    text = lambda: c.get(DECODE + "/metrics").text  # noqa: E731
    assert wait_for(lambda: by_source(text(), "external_kv_transfer") > 0, timeout=10,
                    interval=0.2), "the decode instance loaded no KV cache"
    m = text()
    external, local = by_source(m, "external_kv_transfer"), by_source(m, "local_compute")
    assert external >= 64 and local <= 1, (external, local)  # 64 image tokens at least
    for name in ("vllm:epd_loads_total", "vllm:epd_local_encode_fallbacks_total"):
        assert metric_at(c, DECODE, name) == 0, name
    assert metric_at(c, gw, "epd_kv_handoffs_total") == 1
    assert metric_at(c, gw, "epd_kv_handoff_failures_total") == 0
    # streamed: the same tokens, a second handoff
    assert streamed(c, gw, sample_image_png(seed=73)) == answer(
        c, aggregated.url, sample_image_png(seed=73))
    assert metric_at(c, gw, "epd_kv_handoffs_total") == 2


def test_one_request_one_trace_across_gateway_encoder_prefill_and_decode(deployment):
    """The caller's traceparent continued: the gateway's spans under the caller's span, each
    vLLM server's `llm_request` under the gateway span that called it, the prefill
    instance's connector wait, when its request waited (its loads, with the worker's read and
    staging times), under the gateway's `epd.prefill`."""
    d = deployment
    sink = d["sink"]
    r = d["c"].post(d["gw"] + "/v1/chat/completions",
                    json=chat_body(MODEL_NAME, sample_image_png(seed=901), "What is it?"),
                    headers={"traceparent": f"00-{TRACE}-{CALLER}-01"})
    assert r.status_code == 200, r.text
    # (the prefill instance's `epd.connector.wait` only when its request waited for the item:
    # one that landed before the scheduler looked is loaded without a wait)
    want = {("epd-gateway", "epd.stream"), ("epd-encoder-0", "llm_request"),
            ("epd-prefill-0", "llm_request"), ("epd-decode-0", "llm_request")}

    def missing(spans) -> set:
        return want - {(s["service"], s["name"]) for s in spans if s["trace_id"] == TRACE}

    spans = [s for s in sink.wait_for(lambda got: not missing(got), timeout_s=60)
             if s["trace_id"] == TRACE]
    assert not missing(spans), (missing(spans), sorted((s["service"], s["name"])
                                                       for s in spans))
    gw = {s["name"]: s for s in spans if s["service"] == "epd-gateway"}
    root = gw["POST /v1/chat/completions"]
    assert root["parent_id"] == CALLER
    for name in ("epd.parse", "epd.items", "epd.prefill", "epd.decode"):
        assert gw[name]["parent_id"] == root["span_id"], name
    assert gw["epd.encoder_call"]["parent_id"] == gw["epd.items"]["span_id"]
    assert gw["epd.item"]["attributes"]["epd.outcome"] == "encoded"

    def vllm(service: str, name: str = "llm_request") -> dict:
        return next(s for s in spans if s["service"] == service and s["name"] == name)

    assert vllm("epd-encoder-0")["parent_id"] == gw["epd.encoder_call"]["span_id"]
    assert vllm("epd-prefill-0")["parent_id"] == gw["epd.prefill"]["span_id"]
    assert vllm("epd-decode-0")["parent_id"] == gw["epd.decode"]["span_id"]
    waits = [s for s in spans if s["name"] == "epd.connector.wait"]
    for wait in waits:  # under the prefill hop, its loads under it, with the worker's times
        assert wait["service"] == "epd-prefill-0"
        assert wait["parent_id"] == gw["epd.prefill"]["span_id"]
        loads = [s for s in spans if s["name"] == "epd.connector.load"]
        assert loads and all(s["parent_id"] == wait["span_id"] for s in loads)
        assert loads[0]["attributes"]["epd.rank0.get_s"] > 0


def test_epd_top_once_lists_every_instance(deployment):
    """`epd top --once --json` against the running deployment: the encoder, the prefill and
    the decode instance, each up, and the requests sent so far: three by this test itself
    (it once counted on the module's earlier tests and failed when run alone)."""
    d = deployment
    for seed in (74, 75, 76):
        ask(d["c"], d["gw"], sample_image_png(seed=seed), max_tokens=4)
    done = subprocess.run([sys.executable, "-m", "encoder_service.cli", "top", "--once",
                           "--json", d["gw"]], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    frame = json.loads(done.stdout)
    rows = {r["url"]: r for r in frame["instances"]}
    assert {u: (r["role"], r["state"]) for u, r in rows.items()} == {
        ENCODER: ("encoder", "up"), PREFILL: ("prefill", "up"), DECODE: ("decode", "up")}
    sent = metric_at(d["c"], d["gw"], "epd_gateway_requests_total")
    assert frame["totals"]["requests"] == sent >= 3
    assert rows[PREFILL]["requests"] >= 3 and rows[DECODE]["requests"] >= 3
    assert rows[PREFILL]["ttft_p50_s"] is not None and rows[DECODE]["ttft_p50_s"] is not None


def test_idle_kv_instances_do_not_spin(deployment):
    """NIXL's progress thread (on in vLLM's NixlConnector) busy-polled a core per idle KV
    instance; ec_connectors/plugin.py creates the agent without it. After a moment idle,
    each server with NixlConnector (its whole process tree) uses under 10% of a core."""
    root = deployment["up"].pid
    servers = {port: server_pid(root, port) for port in (BASE + 2, BASE + 3)}  # decode, prefill
    trees = {port: {pid} | descendants(pid) for port, pid in servers.items()}
    time.sleep(2)  # the earlier tests' stragglers (notifications, spans) settle
    before = {port: tree_cpu_s(pids) for port, pids in trees.items()}
    t0 = time.monotonic()
    time.sleep(4)
    wall = time.monotonic() - t0
    pct = {port: round((tree_cpu_s(pids) - before[port]) / wall * 100, 1)
           for port, pids in trees.items()}
    assert all(p < 10 for p in pct.values()), f"idle CPU, % of a core by port: {pct}"


def test_a_decode_instance_killed_mid_stream_goes_on_on_the_prefill_instance(deployment):
    """E/P/D with its one decode instance SIGKILLed after the first tokens of a long greedy
    stream: the gateway continues the answer on the prefill instance (a whole vLLM server of
    the same model), exact; a request sent while the decode instance is down is answered by
    the prefill instance in full, equal to aggregated vLLM's. The decode instance is
    restarted and serves again."""
    d = deployment
    c, gw, aggregated = d["c"], d["gw"], d["agg"]
    image = sample_image_png(seed=74)
    long = {"max_tokens": 200, "ignore_eos": True}
    ref = answer(c, aggregated.url, image, **long)
    body = {**chat_body(MODEL_NAME, image, PROMPT), **long, "stream": True}
    got, errors, killed = stream_killing(c, gw, body,
                                         lambda: kill_server(d["up"].pid, BASE + 2))
    assert killed and not errors and got == ref  # one uninterrupted, exact stream
    assert metric_at(c, gw, 'epd_prefill_answers_total{stage="resume"}') == 1
    other = sample_image_png(seed=75)  # the decode instance is down (restarting)
    assert answer(c, gw, other) == answer(c, aggregated.url, other)
    assert metric_at(c, gw, 'epd_prefill_answers_total{stage="start"}') >= 1

    def decode_up() -> bool:
        rows = c.get(gw + "/instances").json()["decoders"]
        return rows[0]["state"] == "up"

    assert wait_for(decode_up, timeout=180, interval=1), "the decode instance did not return"


def test_a_killed_prefill_instance_leaves_the_decode_instance_to_compute(deployment):
    d = deployment
    c, gw, aggregated = d["c"], d["gw"], d["agg"]
    failed = metric_at(c, gw, "epd_kv_handoff_failures_total")
    local = by_source(c.get(DECODE + "/metrics").text, "local_compute")
    kill_server(d["up"].pid, BASE + 3)
    image = sample_image_png(seed=72)
    assert answer(c, gw, image) == answer(c, aggregated.url, image)
    assert metric_at(c, gw, "epd_kv_handoff_failures_total") == failed + 1
    assert wait_for(lambda: by_source(c.get(DECODE + "/metrics").text, "local_compute")
                    > local, timeout=10, interval=0.2), "the decode instance did not compute"
    assert "kv handoff failed" in d["log"].read_text()
