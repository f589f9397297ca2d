"""`epd up` with the Mooncake Transfer Engine, end to end: a real `epd up` subprocess (vLLM
prefill/decode instances and the gateway on the tiny model, TCP loopback) beside the session's
aggregated vLLM server (the reference). Two deployments (each `epd up` costs a minute of vLLM
start-up on two cores): `transport = "mooncake"` with two batching encoder pools (`epd
encoder`) and two decode instances, no master, started EPD_UP_STARTS times in a row (every
start comes up; 1 in the lane); `transport = "tiered"` (Transfer Engine, Mooncake Store,
shared directory) with one vLLM encoder and one decode instance, the shared TIERED fleet
(tests/e2e/fleets.py): `epd up` starts the store master first, the item lands in every tier,
and the master is gone after the stop. Answers through the gateway must equal the aggregated
server's greedy tokens; the decode instance must really load the embedding
(vllm:epd_loads_total); a repeated image must be a gateway cache hit (Mooncake availability:
the producers' announcements) with no encoder call.
Both run with a deployment secret: every encoder and prefill/decode server answers
401 to a call without the deployment's API key while the gateway's answers still work. Each
deployment's listening sockets are scanned (psutil): all on 127.0.0.1 but a Mooncake engine's
own two, which Mooncake binds to every interface with no setting to change it
(docs/trust.md), matched against what the engines logged and the port plan's range: the TE
transport over TCP starts no engine (every listener of the pool deployment is on loopback),
the Store clients do."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
from pathlib import Path

import httpx
import psutil
import pytest

from ec_connectors.protocol import ports
from ec_connectors.protocol.secret import api_key, read_secret
from encoder_service.local.processes import VllmServer
from encoder_service.local.requests import sample_image_png
from encoder_service.local.testmodels import SPECS, build
from encoder_service.local.up_config import UpConfig
from tests.e2e import fleets
from tests.e2e.client import MODEL_NAME, answer, encoder_calls, metric_at
from tests.helpers import MOONCAKE, WORK, alive, descendants, epd_up, port_block, wait_for

pytest.importorskip("mooncake.engine")
# each deployment: gateway, encoder +1, decode +2; a Mooncake side channel (announcements
# +1000, data connections +2000); the tiered one a store master (RPC, metadata +1, metrics +2)
# (the pool deployment: encoders +1 +2, decoders +3 +4, side channels POOL_MC + 10 * i)
POOL_UP = port_block(__name__)[0]
POOL_MC = port_block(__name__, MOONCAKE)[0]
# how often the pool deployment is started in a row (issue 40 asks for 5: EPD_UP_STARTS=5;
# the lane starts it once, each start of its four servers costs ~40-80 s of the two cores)
STARTS = max(1, int(os.environ.get("EPD_UP_STARTS", "1")))
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


def view(conf: dict, work: Path, log_path: Path, up_pid: int) -> dict:
    """What the checks below read of a running `epd up` of config `conf`."""
    up_cfg = UpConfig(**conf)
    urls = [f"http://127.0.0.1:{conf['base_port'] + 1 + i}"
            for i in range(up_cfg.encoders + up_cfg.decoders)]
    encs, decs = urls[:up_cfg.encoders], urls[up_cfg.encoders:]
    return {"gw": f"http://127.0.0.1:{conf['base_port']}", "enc": encs[0], "dec": decs[0],
            "encs": encs, "decs": decs, "log": log_path, "work": work,
            "procs": descendants(up_pid), "up_pid": up_pid, "servers": len(urls),
            "engine_range": ports.engine_env(up_cfg.fixed_ports, os.environ)}


@contextlib.contextmanager
def deployment(name: str, conf: dict, agg: VllmServer | None):
    work = WORK / "test-up-mooncake" / name
    procs: set[int] = set()
    with epd_up(conf, work, also_ready=agg.healthy if agg else lambda: True) as (
            up, gw, log_path):
        d = view(conf, work, log_path, up.pid)
        procs = d["procs"]
        yield d
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


def assert_keyed(client, d, secret: Path, pool: bool = False) -> None:
    """Every encoder and prefill/decode server refuses a call without the deployment's key
    (401), health stays open, and the key opens them."""
    key = fleets.bearer(secret)
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


def assert_listeners(d, engines: int,
                     library: frozenset[int] = frozenset()) -> set[tuple[str, int]]:
    """No listener of the stack on a wildcard address but the `engines` Mooncake engines'
    handshake and TCP data ports, exactly those its processes logged (two per engine), all
    in the port plan's engine range, and `library`: other ports Mooncake binds to every
    interface whatever it is told (docs/trust.md). The Transfer Engine transport over TCP
    starts no engine: with it alone, every listener is on loopback."""
    te_ports: set[int] = set()
    logged = 0
    for log in (d["work"] / "up" / "logs").glob("*.log"):
        text = log.read_bytes()
        logged += len(_TE_RPC.findall(text))
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
    assert logged == engines and len(te_ports) == 2 * engines, (logged, te_ports)
    first, last = (int(v) for v in d["engine_range"].values())
    assert all(first <= p <= last for p in te_ports), (te_ports, first, last)
    assert wildcard == te_ports | library, (wildcard, te_ports, library)
    port = int(d["gw"].rsplit(":", 1)[1])
    # the gateway and every server: on loopback
    assert set(range(port, port + d["servers"] + 1)) <= {p for _, p in others}
    return others


OVERLAPPED = 'epd_gateway_items_total{outcome="overlapped"}'


def assert_overlapped(client, d, agg, seed: int) -> None:
    """A new image goes to the decode instance while it is encoded, and the decode instance
    loads it (not encodes it) and answers as aggregated vLLM does."""
    image = sample_image_png(seed=seed)
    ref, loads = answer(client, agg.url, image), total(client, d["decs"], LOADS)
    overlapped = metric_at(client, d["gw"], OVERLAPPED)
    assert answer(client, d["gw"], image) == ref
    assert metric_at(client, d["gw"], OVERLAPPED) == overlapped + 1
    assert metric_at(client, d["gw"], FALLBACK) == 0
    assert wait_for(lambda: total(client, d["decs"], LOADS) >= loads + 1, timeout=5,
                    interval=0.1), "the decode instance did not load the embedding"


def total(client, urls: list[str], name: str) -> float:
    return sum(metric_at(client, u, name) for u in urls)


def assert_came_up(client, d, agg) -> None:
    """A start came up: every encoder and decode instance healthy (the gateway's probes),
    every listener on loopback with no engine (the TE over TCP starts none), every Mooncake
    process given the port plan's engine range, and a request answered as aggregated vLLM
    does."""
    health = client.get(d["gw"] + "/health").json()
    assert sorted(health["encoders"]) == d["encs"] and sorted(health["decoders"]) == d["decs"]
    assert all([*health["encoders"].values(), *health["decoders"].values()]), health
    assert_listeners(d, engines=0)
    want = {k.encode(): v.encode() for k, v in d["engine_range"].items()}
    envs = [e for e in map(_environ, d["procs"]) if b"MC_TCP_BIND_ADDRESS" in e]
    assert len(envs) >= d["servers"] and all(e.get(k) == v for e in envs
                                             for k, v in want.items())
    image = sample_image_png(seed=704)
    assert answer(client, d["gw"], image) == answer(client, agg.url, image)


def test_epd_up_mooncake_encoder_pool(model, client, agg):
    """Two encoder pools (`epd encoder`, producers) and two decode instances over the TE
    (TCP), a deployment secret, started STARTS times in a row: more Mooncake processes than
    the default, and every start comes up (issue 40; `assert_came_up`). The last start also
    gets the pool's checks: keys, one encode, the release, a cache hit, overlap."""
    secret = secret_file("pool")
    conf = config(model, POOL_UP, POOL_MC, encoders=2, decoders=2, encoder_backend="pool",
                  cpu_cores=[0, 1, 0, 1], secret_file=str(secret),
                  pool={"max_wait_ms": 1, "cpu_budget_bytes": 64 << 20})
    for start in range(STARTS - 1):
        with deployment(f"pool-{start}", conf, agg) as d:
            assert_came_up(client, d, agg)
    with deployment("pool", conf, agg) as d:
        assert_came_up(client, d, agg)
        assert_keyed(client, d, secret, pool=True)

        def stats() -> list[dict]:
            return [client.get(u + "/v1/stats", headers=fleets.bearer(secret)).json()
                    for u in d["encs"]]

        image = sample_image_png(seed=702)
        ref = answer(client, agg.url, image)
        loads, encoded = total(client, d["decs"], LOADS), metric_at(client, d["gw"], ENCODED)
        made = sum(s["items_encoded"] for s in stats())
        assert answer(client, d["gw"], image) == ref
        assert metric_at(client, d["gw"], ENCODED) == encoded + 1
        assert metric_at(client, d["gw"], FALLBACK) == 0
        assert wait_for(lambda: total(client, d["decs"], LOADS) >= loads + 1, timeout=5,
                        interval=0.1), "the decode instance did not load the embedding"
        assert sum(s["items_encoded"] for s in stats()) == made + 1
        # released after the first token: the pool no longer holds the feature
        assert all(s["bytes"]["cpu"] > 0 or s["states"].get("encoded_cpu", 0) == 0
                   for s in stats())
        assert wait_for(lambda: all(s["bytes"]["cpu"] == 0 for s in stats()), timeout=5,
                        interval=0.1), "the gateway did not release the item"
        hits = metric_at(client, d["gw"], HIT)
        assert answer(client, d["gw"], image) == ref
        assert metric_at(client, d["gw"], HIT) == hits + 1
        assert sum(s["items_encoded"] for s in stats()) == made + 1
        # a new image: sent to the decode instance while the pool encodes it (overlap); it
        # waits for the pool's announcement, then pulls from the pool
        assert_overlapped(client, d, agg, seed=703)


def test_epd_up_tiered_vllm_encoder_starts_the_store_master_first_and_stops_it(
        tiered_fleet, client, agg):
    """The Transfer Engine in front of the store and the shared directory, a vLLM encoder,
    a deployment secret: the shared TIERED fleet (tests/e2e/fleets.py). The checks of `epd
    up` with a vLLM encoder over the Transfer Engine (keys, listeners, announcements: a
    gateway cache hit, overlap) and those of the tiered transport (store master first and
    last, every tier written). It ends by stopping the fleet's `epd up` (the master must go
    with it): the fleet starts it again for a later user."""
    fleet = tiered_fleet.ensure()
    secret = fleet.extra["secret"]
    master_metrics = f"http://127.0.0.1:{fleets.TIERED_MASTER + 2}"
    d = view(fleet.conf, fleet.work, fleet.log_path, fleet.up.pid)
    (master,) = [p for p in d["procs"] if b"mooncake_master" in _cmdline(p)]
    assert_keyed(client, d, secret)
    # four engines, the Store clients' (two per vLLM server: its scheduler's store probes
    # and its worker; the TE transport over TCP starts none); the
    # master's RPC and metrics ports on loopback, its HTTP metadata server on every
    # interface (mooncake_master ignores --http_metadata_server_host)
    loopback = assert_listeners(d, engines=4,
                                library=frozenset({fleets.TIERED_MASTER + 1}))
    assert {fleets.TIERED_MASTER, fleets.TIERED_MASTER + 2} <= {p for _, p in loopback}
    log = d["log"].read_text()
    assert log.index("mooncake-master healthy") < log.index("starting encoder-0")
    assert "requires the API key" in log
    key = api_key(read_secret(secret)).encode()  # never logged, by us or by vLLM
    assert not [f for f in (d["log"], *(d["work"] / "up" / "logs").glob("*.log"))
                if key in f.read_bytes()]
    image = sample_image_png(seed=701)
    ref = answer(client, agg.url, image)
    loads, encoded = metric_at(client, d["dec"], LOADS), metric_at(client, d["gw"], ENCODED)
    assert answer(client, d["gw"], image) == ref
    assert metric_at(client, d["gw"], ENCODED) == encoded + 1
    assert metric_at(client, d["gw"], FALLBACK) == 0
    assert wait_for(lambda: metric_at(client, d["dec"], LOADS) >= loads + 1, timeout=5,
                    interval=0.1), "the decode instance did not load the embedding"
    # saves write every tier: the store (a key on the master) and the shared directory
    assert wait_for(lambda: metric_at(client, master_metrics, "master_key_count") >= 1,
                    timeout=5, interval=0.1), "the item never reached the store"
    assert list((d["work"] / "up" / "ec-cache").rglob("*.safetensors"))
    # the same image again: the producer holds it (announced), no encoder call
    calls, hits = encoder_calls(client, d["enc"]), metric_at(client, d["gw"], HIT)
    assert answer(client, d["gw"], image) == ref
    assert metric_at(client, d["gw"], HIT) == hits + 1
    assert metric_at(client, d["gw"], ENCODED) == encoded + 1
    assert encoder_calls(client, d["enc"]) == calls
    assert "availability=mooncake" in d["log"].read_text()
    # a new image: sent to the decode instance while encoded (overlap; the encoder was
    # seen to publish no placeholder metadata); it waits for the announcement, then pulls
    assert_overlapped(client, d, agg, seed=702)
    assert metric_at(client, d["dec"], "vllm:epd_transport_down_total") == 0
    fleet.up.stop(90)
    assert fleet.up.proc.returncode == 0, d["log"].read_text()[-3000:]
    assert wait_for(lambda: not any(alive(p) for p in d["procs"]), timeout=10), "left behind"
    assert not alive(master), "the store master outlived epd up"
    assert "stopping mooncake-master" in d["log"].read_text()


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _environ(pid: int) -> dict[bytes, bytes]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(kv.partition(b"=")[::2] for kv in f.read().split(b"\0") if kv)
    except OSError:
        return {}
