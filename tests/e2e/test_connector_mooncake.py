"""End to end with real `vllm serve` processes, EPDConnector over the Mooncake Transfer Engine
(TCP loopback): the session's aggregated server (the reference), an encoder-only producer and a
prefill/decode consumer that pulls embeddings from the producer's registered pool."""

from __future__ import annotations

import time

import httpx
import pytest

from encoder_service.local.processes import VllmServer, start_all
from encoder_service.local.requests import chat_body
from encoder_service.local.testmodels import SPECS, build
from encoder_service.local.up import epd_config
from tests.e2e.client import (
    MODEL_NAME,
    PROMPT,
    ask,
    ask_before_encoding,
    case,
    encode,
    tokens,
    wait_metric,
)
from tests.e2e.client import metric as cons_metric
from tests.helpers import LOOPBACK, MOONCAKE, WORK, port_block, stop_all

pytest.importorskip("mooncake.engine")
BASE_PORT = port_block(__name__)[0]
MC_BASE_PORT = port_block(__name__, MOONCAKE)[0]


def mooncake_extra(**more) -> dict:
    return {"transport": "mooncake", "protocol": "tcp", "host": "127.0.0.1",
            "base_port": MC_BASE_PORT, "memory_pool_bytes": 256 << 20, "load_timeout_s": 10,
            "inline_max_bytes": 0,  # tiny items too go through the transfer engine
            **more}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, aggregated):
    model = build(WORK / "models" / "tiny-llava", SPECS["tiny"])
    unused = tmp_path_factory.mktemp("unused")
    logs = WORK / "test-e2e-mooncake"
    prod = VllmServer("producer", model, BASE_PORT + 1, logs,
                      epd_config("ec_producer", unused, mooncake_extra()), cpu_core=0,
                      env=LOOPBACK)
    producer_endpoint = f"127.0.0.1:{MC_BASE_PORT}"  # rank 0 of dp 0, stage 0
    cons = VllmServer("consumer", model, BASE_PORT + 2, logs,
                      epd_config("ec_consumer", unused,
                                 mooncake_extra(producers=[producer_endpoint])), cpu_core=1,
                      env=LOOPBACK)
    try:
        start_all([prod, cons], progress=lambda m: print(f"[e2e-mc] {m}", flush=True))
        aggregated.wait()
        client = httpx.Client(timeout=120)
        yield {"agg": aggregated, "prod": prod, "cons": cons, "client": client,
               "endpoint": producer_endpoint}
        client.close()
    finally:
        stop_all((prod, cons))


def test_consumer_pulls_over_mooncake_and_equals_aggregated(cluster):
    c = cluster
    image, item_id, reference = case(c, seed=501)
    params = encode(c, image, item_id)
    body = params["epd"]
    assert body["transport"] == "mooncake" and body["endpoint"] == c["endpoint"]
    loads = cons_metric(c, "loads_total")
    assert tokens(ask(c, c["cons"], image, item_id, params)) == reference
    assert wait_metric(c, "loads_total", loads + 1) == loads + 1


def test_deferred_request_without_location_finds_item_by_announcement(cluster):
    """The consumer gets the request (ids only, no location) before the producer has made
    the item, with nothing else running: zero-token steps on vLLM's V1 runner must not lose
    the pull; the item is found through the producer's announcement."""
    c = cluster
    image, item_id, reference = case(c, seed=502)
    loads = cons_metric(c, "loads_total")
    assert tokens(ask_before_encoding(c, image, item_id, wait_s=1.5)) == reference
    assert wait_metric(c, "loads_total", loads + 1) == loads + 1


def test_no_params_at_all_uses_the_availability_index(cluster):
    c = cluster
    image, item_id, reference = case(c, seed=503)
    encode(c, image, item_id)
    time.sleep(0.5)  # the announcement reaches the consumer's scheduler
    loads = cons_metric(c, "loads_total")
    assert tokens(ask(c, c["cons"], image, item_id, None)) == reference
    assert wait_metric(c, "loads_total", loads + 1) == loads + 1


def test_params_naming_a_foreign_producer_are_not_followed(cluster):
    """Params are client-controlled: a location outside the configured producers is refused
    by the consumer's server guard with a reason, never connected to (behind the guard, the
    scheduler would ignore it too: scheduler_hooks.decisions.pull_location)."""
    c = cluster
    image, item_id, reference = case(c, seed=504)
    params = encode(c, image, item_id)
    forged = {"epd": {**params["epd"], "endpoint": "10.66.66.66:1"}}
    forged["epd"]["items"] = {k: {**v, "location": "10.66.66.66:1"}
                              for k, v in params["epd"]["items"].items()}
    loads = cons_metric(c, "loads_total")
    r = c["client"].post(c["cons"].url + "/v1/chat/completions",
                         json=chat_body(MODEL_NAME, image, PROMPT, item_id=item_id,
                                        ec_transfer_params=forged))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "bad_ec_transfer_params" and "10.66.66.66:1" in err["message"]
    assert cons_metric(c, "loads_total") == loads  # nothing was pulled
    assert tokens(ask(c, c["cons"], image, item_id, params)) == reference
    assert wait_metric(c, "loads_total", loads + 1) == loads + 1
