"""`epd up` with the Mooncake Transfer Engine, end to end: a real `epd up` subprocess (1
encoder + 1 vLLM prefill/decode + gateway on the tiny model, TCP loopback) beside the
session's aggregated vLLM server (the reference). Two deployments (each `epd up` costs a minute
of vLLM start-up on two cores): `transport = "mooncake"` with the batching encoder pool (`epd
encoder`) as the encoder backend, no master; `transport = "tiered"` (Transfer Engine, Mooncake
Store, shared directory) with a vLLM encoder: `epd up` starts the store master first, the item
lands in every tier, and the master is gone after the stop. Answers through the gateway must
equal the aggregated server's greedy tokens; the decode instance must really load the
embedding (vllm:epd_loads_total); a repeated image must be a gateway cache hit (Mooncake
availability: the producers' announcements) with no encoder call.
Both run with a deployment secret: every encoder and prefill/decode server answers
401 to a call without the deployment's API key while the gateway's answers still work. Each
deployment's listening sockets are scanned (psutil): all on 127.0.0.1, but for the Mooncake
Transfer Engine's own two per process, which Mooncake binds to every interface with no setting
to change it (docs/trust.md), and which the scan matches against what the engine logged."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
from pathlib import Path

import httpx
import psutil
import pytest

from ec_connectors.protocol.secret import api_key, read_secret
from encoder_service.local.processes import VllmServer, metric_value
from encoder_service.local.requests import chat_body, sample_image_png
from encoder_service.local.testmodels import SPECS, build
from tests.e2e.client import MODEL_NAME
from tests.helpers import WORK, alive, descendants, epd_up, wait_for

pytest.importorskip("mooncake.engine")
PROMPT = "what is in this picture"
POOL_UP, POOL_MC = 18660, 16610  # gateway, encoder +1, decode +2; mooncake (announcements +1000)
TIERED_UP, TIERED_MC, TIERED_MASTER = 18670, 16620, 19950  # master: RPC, metadata +1, metrics +2
HIT = 'epd_gateway_items_total{outcome="cache_hit"}'
ENCODED = 'epd_gateway_items_total{outcome="encoded"}'
FALLBACK = 'epd_gateway_items_total{outcome="fallback"}'
LOADS = "vllm:epd_loads_total"


@pytest.fixture(scope="module")
def model():
    return build(WORK / "models" / "tiny-llava", SPECS["tiny"])


@pytest.fixture(scope="module")
def client():
    with httpx.Client(timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def agg(aggregated):
    """The session's aggregated reference; the first deployment waits for it."""
    return aggregated


@contextlib.contextmanager
def deployment(name: str, conf: dict, agg: VllmServer):
    work = WORK / "test-up-mooncake" / name
    procs: set[int] = set()
    with epd_up(conf, work, also_ready=agg.healthy) as (up, gw, log_path):
        procs = descendants(up.pid)
        yield {"gw": gw, "enc": f"http://127.0.0.1:{conf['base_port'] + 1}",
               "dec": f"http://127.0.0.1:{conf['base_port'] + 2}", "log": log_path,
               "work": work, "procs": procs, "up_pid": up.pid}
    assert up.returncode == 0, log_path.read_text()[-3000:]
    assert wait_for(lambda: not any(alive(p) for p in procs), timeout=10), "left behind"


def config(model, base_port: int, mc_port: int, **more) -> dict:
    return {"model": str(model), "base_port": base_port, "transport": "mooncake",
            "mooncake_base_port": mc_port, "cpu_cores": [0, 1],
            "connector_extra": {"memory_pool_bytes": 128 << 20},
            "gateway": {"timeouts": {"encoder_s": 30}}, **more}


def secret_file(name: str) -> Path:
    path = WORK / "test-up-mooncake" / name / "secret"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(32).hex().encode())
    path.chmod(0o600)
    return path


def bearer(secret: Path) -> dict[str, str]:
    return {"authorization": f"Bearer {api_key(read_secret(secret))}"}


def assert_keyed(client, d, secret: Path, pool: bool = False) -> None:
    """Every encoder and prefill/decode server refuses a call without the deployment's key
    (401), health stays open, and the key opens them."""
    key = bearer(secret)
    calls = [("dec", "POST", "/v1/chat/completions"), ("dec", "POST", "/v1/completions"),
             ("dec", "GET", "/v1/models"), ("dec", "POST", "/inference/v1/generate")]
    calls += ([("enc", "POST", "/v1/encode"), ("enc", "POST", "/v1/release"),
               ("enc", "GET", "/v1/stats")] if pool else
              [("enc", "POST", "/v1/chat/completions"), ("enc", "GET", "/v1/models")])
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
            "prompt": "hi", "max_tokens": 1, "items": [], "item_ids": ["x"]}
    for server, method, path in calls:
        for headers in ({}, {"authorization": "Bearer not-the-key"}):
            r = client.request(method, d[server] + path, json=body, headers=headers)
            assert r.status_code == 401, (server, path, r.status_code, r.text[:300])
    for server in ("enc", "dec"):
        assert client.get(d[server] + "/health").status_code == 200
    assert client.get(d["dec"] + "/v1/models", headers=key).status_code == 200
    assert client.get(d["enc"] + ("/v1/stats" if pool else "/v1/models"),
                      headers=key).status_code == 200


# what the Transfer Engine logs about its two listeners (the Store client's engine too)
_TE_RPC = re.compile(rb"Transfer Engine RPC using [^,]+, listening on \S+:(\d+)")
_TE_TCP = re.compile(rb"TcpTransport: listen on port (\d+)")


def assert_listeners(d, library: frozenset[int] = frozenset()) -> set[tuple[str, int]]:
    """No listener of the stack on a wildcard address but the Transfer Engine's handshake
    and TCP data ports, exactly those its processes logged (two per engine), and `library`:
    other ports Mooncake binds to every interface whatever it is told (docs/trust.md)."""
    te_ports: set[int] = set()
    engines = 0
    for log in (d["work"] / "up" / "logs").glob("*.log"):
        text = log.read_bytes()
        engines += len(_TE_RPC.findall(text))
        for pattern in (_TE_RPC, _TE_TCP):
            te_ports.update(int(m) for m in pattern.findall(text))
    listening: list[tuple[int, str, int]] = []
    for pid in d["procs"] | {d["up_pid"]}:
        with contextlib.suppress(psutil.Error):
            for c in psutil.Process(pid).net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    listening.append((pid, c.laddr.ip, c.laddr.port))
    wildcard = {port for _, ip, port in listening if ipaddress.ip_address(ip).is_unspecified}
    others = {(ip, port) for _, ip, port in listening if port not in wildcard}
    assert all(ipaddress.ip_address(ip).is_loopback for ip, _ in others), others
    assert engines >= 2 and len(te_ports) == 2 * engines, (engines, te_ports)
    assert wildcard == te_ports | library, (wildcard, te_ports, library)
    port = int(d["gw"].rsplit(":", 1)[1])
    assert {port, port + 1, port + 2} <= {p for _, p in others}  # gateway, servers: loopback
    return others


def ask(client, url, image) -> list[int]:
    r = client.post(url + "/v1/chat/completions",
                    json=chat_body(MODEL_NAME, image, PROMPT, max_tokens=8))
    assert r.status_code == 200, r.text
    ids = r.json()["choices"][0]["token_ids"]
    assert ids
    return ids


def metric(client, url, name) -> float:
    return metric_value(client.get(url + "/metrics").text, name)


def encoder_calls(client, url) -> float:
    return metric(client, url, "vllm:request_success_total")


OVERLAPPED = 'epd_gateway_items_total{outcome="overlapped"}'


def assert_overlapped(client, d, agg, seed: int) -> None:
    """A new image goes to the decode instance while it is encoded, and the decode instance
    loads it (not encodes it) and answers as aggregated vLLM does."""
    image = sample_image_png(seed=seed)
    ref, loads = ask(client, agg.url, image), metric(client, d["dec"], LOADS)
    overlapped = metric(client, d["gw"], OVERLAPPED)
    assert ask(client, d["gw"], image) == ref
    assert metric(client, d["gw"], OVERLAPPED) == overlapped + 1
    assert metric(client, d["gw"], FALLBACK) == 0
    assert wait_for(lambda: metric(client, d["dec"], LOADS) >= loads + 1, timeout=5,
                    interval=0.1), "the decode instance did not load the embedding"


def test_epd_up_mooncake_encoder_pool(model, client, agg):
    secret = secret_file("pool")
    conf = config(model, POOL_UP, POOL_MC, encoder_backend="pool", secret_file=str(secret),
                  pool={"max_wait_ms": 1, "cpu_budget_bytes": 64 << 20})
    with deployment("pool", conf, agg) as d:
        assert_keyed(client, d, secret, pool=True)
        assert_listeners(d)
        image = sample_image_png(seed=702)
        ref = ask(client, agg.url, image)
        loads = metric(client, d["dec"], LOADS)
        assert ask(client, d["gw"], image) == ref
        assert metric(client, d["gw"], ENCODED) == 1 and metric(client, d["gw"], FALLBACK) == 0
        assert wait_for(lambda: metric(client, d["dec"], LOADS) >= loads + 1, timeout=5,
                        interval=0.1), "the decode instance did not load the embedding"
        stats = client.get(d["enc"] + "/v1/stats", headers=bearer(secret)).json()
        assert stats["items_encoded"] == 1
        # released after the first token: the pool no longer holds the feature
        assert stats["bytes"]["cpu"] > 0 or stats["states"].get("encoded_cpu", 0) == 0
        assert wait_for(lambda: client.get(d["enc"] + "/v1/stats", headers=bearer(secret))
                        .json()["bytes"]["cpu"] == 0, timeout=5, interval=0.1), \
            "the gateway did not release the item"
        assert ask(client, d["gw"], image) == ref
        assert metric(client, d["gw"], HIT) == 1
        assert client.get(d["enc"] + "/v1/stats",
                          headers=bearer(secret)).json()["items_encoded"] == 1
        # a new image: sent to the decode instance while the pool encodes it (overlap); it
        # waits for the pool's announcement, then pulls from the pool
        assert_overlapped(client, d, agg, seed=703)


def test_epd_up_tiered_vllm_encoder_starts_the_store_master_first_and_stops_it(
        model, client, agg):
    """The Transfer Engine in front of the store and the shared directory, a vLLM encoder,
    a deployment secret. One deployment for the checks of `epd up` with a vLLM encoder over
    the Transfer Engine (keys, listeners, announcements: a gateway cache hit, overlap) and
    those of the tiered transport (store master first and last, every tier written)."""
    secret = secret_file("tiered")
    conf = config(model, TIERED_UP, TIERED_MC, transport="tiered", master_port=TIERED_MASTER,
                  secret_file=str(secret))
    master_metrics = f"http://127.0.0.1:{TIERED_MASTER + 2}"
    with deployment("tiered", conf, agg) as d:
        (master,) = [p for p in d["procs"] if b"mooncake_master" in _cmdline(p)]
        assert_keyed(client, d, secret)
        # the Store clients' engines too; the master's RPC and metrics ports on loopback, its
        # HTTP metadata server on every interface (mooncake_master ignores
        # --http_metadata_server_host)
        loopback = assert_listeners(d, library=frozenset({TIERED_MASTER + 1}))
        assert {TIERED_MASTER, TIERED_MASTER + 2} <= {p for _, p in loopback}
        log = d["log"].read_text()
        assert log.index("mooncake-master healthy") < log.index("starting encoder-0")
        assert "requires the API key" in log
        key = api_key(read_secret(secret)).encode()  # never logged, by us or by vLLM
        assert not [f for f in (d["log"], *(d["work"] / "up" / "logs").glob("*.log"))
                    if key in f.read_bytes()]
        image = sample_image_png(seed=701)
        ref = ask(client, agg.url, image)
        loads, encoded = metric(client, d["dec"], LOADS), metric(client, d["gw"], ENCODED)
        assert ask(client, d["gw"], image) == ref
        assert metric(client, d["gw"], ENCODED) == encoded + 1
        assert metric(client, d["gw"], FALLBACK) == 0
        assert wait_for(lambda: metric(client, d["dec"], LOADS) >= loads + 1, timeout=5,
                        interval=0.1), "the decode instance did not load the embedding"
        # saves write every tier: the store (a key on the master) and the shared directory
        assert wait_for(lambda: metric(client, master_metrics, "master_key_count") >= 1,
                        timeout=5, interval=0.1), "the item never reached the store"
        assert list((d["work"] / "up" / "ec-cache").rglob("*.safetensors"))
        # the same image again: the producer holds it (announced), no encoder call
        calls, hits = encoder_calls(client, d["enc"]), metric(client, d["gw"], HIT)
        assert ask(client, d["gw"], image) == ref
        assert metric(client, d["gw"], HIT) == hits + 1
        assert metric(client, d["gw"], ENCODED) == encoded + 1
        assert encoder_calls(client, d["enc"]) == calls
        assert "availability=mooncake" in d["log"].read_text()
        # a new image: sent to the decode instance while encoded (overlap; the encoder was
        # seen to publish no placeholder metadata); it waits for the announcement, then pulls
        assert_overlapped(client, d, agg, seed=702)
        assert metric(client, d["dec"], "vllm:epd_transport_down_total") == 0
    assert not alive(master), "the store master outlived epd up"
    assert "stopping mooncake-master" in d["log"].read_text()


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""
