"""End to end with real `vllm serve` processes, EPDConnector over NIXL (UCX on loopback): the
session's aggregated server (the reference), an encoder-only producer whose NIXL agent
registers its pool, and a prefill/decode consumer that READs embeddings out of it; a producer
killed while the consumer's pull is in flight costs a local encode, never an error or another
answer."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from encoder_service.local.processes import VllmServer, start_all
from encoder_service.local.testmodels import SPECS, build
from encoder_service.local.up import epd_config
from tests.e2e.client import ask, case, encode, tokens, wait_metric
from tests.e2e.client import metric as cons_metric
from tests.helpers import LOOPBACK, MOONCAKE, WORK, port_block, stop_all

pytest.importorskip("nixl._api", reason="transport 'nixl' needs NIXL (nixl + nixl-cu12)")
BASE_PORT = port_block(__name__)[0]
NX_BASE_PORT = port_block(__name__, MOONCAKE)[0]
ENV = {**LOOPBACK, "UCX_NET_DEVICES": "lo"}


def nixl_extra(**more) -> dict:
    return {"transport": "nixl", "host": "127.0.0.1", "base_port": NX_BASE_PORT,
            "memory_pool_bytes": 128 << 20, "load_timeout_s": 10,
            "inline_max_bytes": 0,  # tiny items too are NIXL reads
            **more}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, aggregated):
    model = build(WORK / "models" / "tiny-llava", SPECS["tiny"])
    unused = tmp_path_factory.mktemp("unused")
    logs = WORK / "test-e2e-nixl"
    # every item held where it lies: vLLM's own encoder output, registered, read from there
    prod = VllmServer("producer", model, BASE_PORT + 1, logs,
                      epd_config("ec_producer", unused, nixl_extra(
                          producer_put="in_place", in_place_min_bytes=0)),
                      cpu_core=0, env=ENV)
    endpoint = f"127.0.0.1:{NX_BASE_PORT}"
    cons = VllmServer("consumer", model, BASE_PORT + 2, logs,
                      epd_config("ec_consumer", unused, nixl_extra(producers=[endpoint])),
                      cpu_core=1, env=ENV)
    try:
        start_all([prod, cons], progress=lambda m: print(f"[e2e-nixl] {m}", flush=True))
        aggregated.wait()
        client = httpx.Client(timeout=120)
        yield {"agg": aggregated, "prod": prod, "cons": cons, "client": client,
               "endpoint": endpoint}
        client.close()
    finally:
        stop_all((prod, cons))


def test_nixl_reads_equal_aggregated_and_a_killed_producer_costs_a_recompute(cluster):
    c = cluster
    image, item_id, reference = case(c, seed=601)
    params = encode(c, image, item_id)
    assert params["epd"]["transport"] == "nixl" and params["epd"]["endpoint"] == c["endpoint"]
    loads = cons_metric(c, "loads_total")
    assert tokens(ask(c, c["cons"], image, item_id, params)) == reference
    assert wait_metric(c, "loads_total", loads + 1) == loads + 1
    assert cons_metric(c, "held_in_place_total", server=c["prod"]) >= 1
    # Killed mid-transfer: the next item is encoded, then its producer (API server,
    # EngineCore, the worker holding the NIXL agent) is frozen, so the consumer's pull is
    # surely in flight when the kill lands.
    image, item_id, reference = case(c, seed=602)
    params = encode(c, image, item_id)
    fallbacks = cons_metric(c, "local_encode_fallbacks_total")
    os.killpg(c["prod"].proc.pid, signal.SIGSTOP)
    answer: dict = {}
    asking = threading.Thread(target=lambda: answer.update(
        ask(c, c["cons"], image, item_id, params)))
    t0 = time.monotonic()
    asking.start()
    time.sleep(1.0)
    assert asking.is_alive()  # waiting on the frozen producer
    os.killpg(c["prod"].proc.pid, signal.SIGKILL)
    asking.join(60)
    assert tokens(answer) == reference  # encoded locally: the same answer, no error
    assert time.monotonic() - t0 < 12  # within the load deadline, not a hang
    assert wait_metric(c, "local_encode_fallbacks_total", fallbacks + 1) >= fallbacks + 1
