"""End to end with real `vllm serve` processes, EPDConnector over the Mooncake Transfer Engine
(TCP loopback): the session's aggregated server (the reference), an encoder-only producer and a
prefill/decode consumer that pulls embeddings from the producer's registered pool: the shared
TIERED fleet's encoder and decode instance (tests/e2e/fleets.py), the Transfer Engine their
first tier (each load below is counted as its hit)."""

from __future__ import annotations

import time

import httpx
import pytest

from ec_connectors.protocol import ports
from ec_connectors.protocol.keys import content_item_id
from encoder_service.local.requests import chat_body, sample_image_png
from tests.e2e import fleets
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
from tests.helpers import ServerAt

pytest.importorskip("mooncake.engine")
TE_HITS = "tier_mooncake_hits_total"  # loads the Transfer Engine tier delivered


def signed_case(c, seed: int):
    """`case` under the id the deployment's gateway would give the image (with a deployment
    secret its producers share only such ids)."""
    image = sample_image_png(seed=seed)
    return case(c, seed, fleets.vouched(c["secret"], content_item_id(image, MODEL_NAME)))


@pytest.fixture(scope="module")
def cluster(tiered_fleet, aggregated):
    """The shared TIERED fleet (tests/e2e/fleets.py): its encoder is the producer, its decode
    instance the consumer, the Transfer Engine their first tier; every call carries the
    deployment's key. These tests kill nothing."""
    fleet = tiered_fleet.ensure()
    aggregated.wait()
    with httpx.Client(timeout=120, headers=fleets.bearer(fleet.extra["secret"])) as client:
        yield {"agg": aggregated, "prod": ServerAt(fleet.url(1)),
               "cons": ServerAt(fleet.url(2)), "client": client,
               "secret": fleet.extra["secret"],
               "endpoint": f"127.0.0.1:{ports.encoder_base_port(fleets.TIERED_MC, 0)}"}


def test_consumer_pulls_over_mooncake_and_equals_aggregated(cluster):
    c = cluster
    image, item_id, reference = signed_case(c, 501)
    params = encode(c, image, item_id)
    body = params["epd"]
    assert body["transport"] == "tiered" and body["endpoint"] == c["endpoint"]
    loads, hits = cons_metric(c, "loads_total"), cons_metric(c, TE_HITS)
    assert tokens(ask(c, c["cons"], image, item_id, params)) == reference
    assert wait_metric(c, "loads_total", loads + 1) == loads + 1
    assert wait_metric(c, TE_HITS, hits + 1) == hits + 1  # over the Transfer Engine


def test_deferred_request_without_location_finds_item_by_announcement(cluster):
    """The consumer gets the request (ids only, no location) before the producer has made
    the item, with nothing else running: zero-token steps on vLLM's V1 runner must not lose
    the pull; the item is found through the producer's announcement."""
    c = cluster
    image, item_id, reference = signed_case(c, 502)
    loads, hits = cons_metric(c, "loads_total"), cons_metric(c, TE_HITS)
    assert tokens(ask_before_encoding(c, image, item_id, wait_s=1.5)) == reference
    assert wait_metric(c, "loads_total", loads + 1) == loads + 1
    assert wait_metric(c, TE_HITS, hits + 1) == hits + 1


def test_no_params_at_all_uses_the_availability_index(cluster):
    c = cluster
    image, item_id, reference = signed_case(c, 503)
    encode(c, image, item_id)
    time.sleep(0.5)  # the announcement reaches the consumer's scheduler
    loads, hits = cons_metric(c, "loads_total"), cons_metric(c, TE_HITS)
    assert tokens(ask(c, c["cons"], image, item_id, None)) == reference
    assert wait_metric(c, "loads_total", loads + 1) == loads + 1
    assert wait_metric(c, TE_HITS, hits + 1) == hits + 1


def test_params_naming_a_foreign_producer_are_not_followed(cluster):
    """Params are client-controlled: a location outside the configured producers is refused
    by the consumer's server guard with a reason, never connected to (behind the guard, the
    scheduler would ignore it too: scheduler_hooks.decisions.pull_location)."""
    c = cluster
    image, item_id, reference = signed_case(c, 504)
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
