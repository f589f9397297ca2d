"""The tiered transport end to end, on the shared TIERED fleet (tests/e2e/fleets.py): a real
`epd up` with tiers mooncake (Transfer Engine), mooncake_store and safetensors, a vLLM encoder
and a decode instance, a deployment secret, and beside it a vLLM encoder of its own on the
store and the shared directory alone (the store producer: the decode instance does not
subscribe to it); the session's aggregated vLLM server is the reference.

The connector over the Transfer Engine (the encoder's registered pool, TCP loopback), each load
counted as that tier's hit: with params, deferred before the item exists, found by
announcement with no params, and a forged location refused by the server guard.

`epd up`'s checks: its listeners (psutil: all on 127.0.0.1 but the Mooncake engines' own,
which Mooncake binds to every interface: docs/trust.md), its keys (every server answers 401
without the deployment's API key), the store master started first, every tier written, a
repeated image a gateway cache hit with no encoder call. The store's: cross-instance reuse
(an encoder instance does not encode what another stored), loads from the store with no
params, and last, a master killed mid-run: requests are still answered through the other
tiers, `epd up` restarts the master, and stopping `epd up` leaves nothing behind."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from ec_connectors.protocol import ports
from ec_connectors.protocol.api_keys import api_key
from ec_connectors.protocol.keys import content_item_id
from ec_connectors.protocol.secret_file import read_secret
from encoder_service.local.requests import chat_body, sample_image_png
from tests.e2e import fleets
from tests.e2e.client import (
    MODEL_NAME,
    PROMPT,
    answer,
    ask,
    ask_before_encoding,
    case,
    encode,
    encoder_calls,
    metric,
    metric_at,
    tokens,
    wait_metric,
)
from tests.e2e.up_checks import (
    ENCODED,
    FALLBACK,
    HIT,
    LOADS,
    assert_keyed,
    assert_listeners,
    assert_overlapped,
    cmdline,
    view,
)
from tests.helpers import ServerAt, alive, descendants, wait_for

pytest.importorskip("mooncake.store")
MASTER_METRICS = f"http://127.0.0.1:{fleets.TIERED_MASTER + 2}"
TE_HITS = "tier_mooncake_hits_total"  # loads the Transfer Engine tier delivered


@pytest.fixture(scope="module")
def cluster(tiered_fleet, aggregated):
    """The shared TIERED fleet; the last test kills its store master and stops it (the fleet
    starts it again for a later user)."""
    fleet = tiered_fleet.ensure()
    aggregated.wait()
    with httpx.Client(timeout=120, headers=fleets.bearer(fleet.extra["secret"])) as client:
        yield {"fleet": fleet, "client": client, "agg": aggregated,
               "d": view(fleet.conf, fleet.work, fleet.log_path, fleet.up.proc.pid),
               "a": ServerAt(fleet.url(1)), "prod": ServerAt(fleet.url(1)),
               "cons": ServerAt(fleet.url(2)), "b": fleet.extra["producer"],
               "secret": fleet.extra["secret"],
               "endpoint": f"127.0.0.1:{ports.encoder_base_port(fleets.TIERED_MC, 0)}"}


@pytest.fixture(scope="module")
def client(cluster):
    """A client without the deployment's key (cluster["client"] sends it with every call)."""
    with httpx.Client(timeout=120) as plain:
        yield plain


@pytest.fixture(scope="module")
def agg(cluster):
    return cluster["agg"]


def test_epd_up_tiered_vllm_encoder_starts_the_store_master_first(cluster, client, agg):
    """The checks of `epd up` with a vLLM encoder over the Transfer Engine (keys,
    listeners, announcements: a gateway cache hit, overlap) and those of the tiered
    transport (store master first, every tier written). Kills nothing."""
    fleet, d = cluster["fleet"], cluster["d"]
    secret = fleet.extra["secret"]
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
    keys = metric_at(client, MASTER_METRICS, "master_key_count")
    loads, encoded = metric_at(client, d["dec"], LOADS), metric_at(client, d["gw"], ENCODED)
    assert answer(client, d["gw"], image) == ref
    assert metric_at(client, d["gw"], ENCODED) == encoded + 1
    assert metric_at(client, d["gw"], FALLBACK) == 0
    assert wait_for(lambda: metric_at(client, d["dec"], LOADS) >= loads + 1, timeout=5,
                    interval=0.1), "the decode instance did not load the embedding"
    # saves write every tier: the store (a key on the master) and the shared directory
    assert wait_for(lambda: metric_at(client, MASTER_METRICS, "master_key_count") > keys,
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


# -- the Transfer Engine between the encoder and the decode instance (its first tier) --

def signed_case(c, seed: int):
    """`case` under the id the deployment's gateway would give the image (with a deployment
    secret its producers share only such ids)."""
    image = sample_image_png(seed=seed)
    return case(c, seed, fleets.vouched(c["secret"], content_item_id(image, MODEL_NAME)))


def test_consumer_pulls_over_mooncake_and_equals_aggregated(cluster):
    c = cluster
    image, item_id, reference = signed_case(c, 501)
    params = encode(c, image, item_id)
    body = params["epd"]
    assert body["transport"] == "tiered" and body["endpoint"] == c["endpoint"]
    loads, hits = metric(c, "loads_total"), metric(c, TE_HITS)
    assert tokens(ask(c, c["cons"], image, item_id, params)) == reference
    assert wait_metric(c, "loads_total", loads + 1) == loads + 1
    assert wait_metric(c, TE_HITS, hits + 1) == hits + 1  # over the Transfer Engine


def test_deferred_request_without_location_finds_item_by_announcement(cluster):
    """The consumer gets the request (ids only, no location) before the producer has made
    the item, with nothing else running: zero-token steps on vLLM's V1 runner must not lose
    the pull; the item is found through the producer's announcement."""
    c = cluster
    image, item_id, reference = signed_case(c, 502)
    loads, hits = metric(c, "loads_total"), metric(c, TE_HITS)
    assert tokens(ask_before_encoding(c, image, item_id, wait_s=1.5)) == reference
    assert wait_metric(c, "loads_total", loads + 1) == loads + 1
    assert wait_metric(c, TE_HITS, hits + 1) == hits + 1


def test_no_params_at_all_uses_the_availability_index(cluster):
    c = cluster
    image, item_id, reference = signed_case(c, 503)
    encode(c, image, item_id)
    time.sleep(0.5)  # the announcement reaches the consumer's scheduler
    loads, hits = metric(c, "loads_total"), metric(c, TE_HITS)
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
    loads = metric(c, "loads_total")
    r = c["client"].post(c["cons"].url + "/v1/chat/completions",
                         json=chat_body(MODEL_NAME, image, PROMPT, item_id=item_id,
                                        ec_transfer_params=forged))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "bad_ec_transfer_params" and "10.66.66.66:1" in err["message"]
    assert metric(c, "loads_total") == loads  # nothing was pulled
    assert tokens(ask(c, c["cons"], image, item_id, params)) == reference
    assert wait_metric(c, "loads_total", loads + 1) == loads + 1


# -- the store --------------------------------------------------------------------------------


def encode_and_store(c, server, image, item_id) -> None:
    """Ask encoder `server` for the item and wait until its save reached the store (saves
    run in the background: a request sent without params before that would just encode)."""
    keys = metric_at(c["client"], MASTER_METRICS, "master_key_count")
    ask(c, server, image, item_id, max_tokens=1)
    assert wait_for(lambda: metric_at(c["client"], MASTER_METRICS, "master_key_count") > keys,
                    10, interval=0.05), "the item never reached the store"


def vouched(c, image) -> str:
    """The image's id as the deployment's gateway gives it (its producers share only such)."""
    return fleets.vouched(c["fleet"].extra["secret"], content_item_id(image, MODEL_NAME))


def reference(c, image) -> list[int]:
    """The aggregated server's answer."""
    return answer(c["client"], c["agg"].url, image)


def test_consumer_loads_from_the_store_with_no_params(cluster):
    """An item the store producer made (no Transfer Engine holds it, nothing announced it):
    the decode instance, given no params, finds it by probing the store."""
    c = cluster
    image = sample_image_png(seed=611)
    item_id = vouched(c, image)
    expected = reference(c, image)
    encode_and_store(c, c["b"], image, item_id)
    hits = metric(c, "tier_mooncake_store_hits_total")
    assert tokens(ask(c, c["cons"], image, item_id)) == expected
    assert wait_metric(c, "tier_mooncake_store_hits_total", hits + 1) == hits + 1


def test_second_encoder_instance_does_not_encode_again(cluster):
    """`epd up`'s encoder made and stored the item: the store producer, asked for it,
    promises it without encoding or storing it again, and the decode instance answers."""
    c = cluster
    image = sample_image_png(seed=612)
    item_id = vouched(c, image)
    encode_and_store(c, c["a"], image, item_id)
    saves_b = metric(c, "saves_total", c["b"])
    skipped_b = metric(c, "skipped_saves_total", c["b"])
    params = ask(c, c["b"], image, item_id, max_tokens=1).get("ec_transfer_params")
    assert params and item_id in params["epd"]["items"]  # B still promises the item
    assert wait_metric(c, "skipped_saves_total", skipped_b + 1, server=c["b"]) >= skipped_b + 1
    assert metric(c, "saves_total", c["b"]) == saves_b  # B encoded and stored nothing
    assert tokens(ask(c, c["cons"], image, item_id, params)) == reference(c, image)


def test_master_killed_mid_run_requests_still_answered(cluster):
    """Last of the fleet's users: it kills the store master. Requests are still answered
    through the shared directory while it is down; `epd up` restarts it; stopping `epd up`
    then stops everything it started, the restarted master included (the fleet starts it
    again for a later user)."""
    c, fleet = cluster, cluster["fleet"]
    up = fleet.up
    (master,) = [p for p in descendants(up.proc.pid) if b"mooncake_master" in cmdline(p)]
    os.kill(master, signal.SIGKILL)
    # store_health_interval_s (1 s): every client has noticed by now (an idle server's
    # counts show it only after its next step, so this waits out three probes instead)
    time.sleep(3.0)
    image = sample_image_png(seed=613)
    item_id = vouched(c, image)
    expected = reference(c, image)
    params = ask(c, c["b"], image, item_id, max_tokens=1).get("ec_transfer_params")
    assert params and item_id in params["epd"]["items"]
    hits = metric(c, "tier_safetensors_hits_total")
    assert tokens(ask(c, c["cons"], image, item_id, params)) == expected
    assert wait_metric(c, "tier_safetensors_hits_total", hits + 1) == hits + 1
    assert metric(c, "tier_mooncake_store_skipped_total") >= 1
    assert metric(c, "transport_down_total") >= 1
    # An item no tier has: encoded locally, answered all the same.
    other = sample_image_png(seed=614)
    assert tokens(ask(c, c["cons"], other, vouched(c, other)))
    # vLLM publishes a server's connector stats on its next step: give the producer one.
    ask(c, c["b"], other, vouched(c, other), max_tokens=1)
    assert wait_metric(c, "tier_mooncake_store_put_failures_total", 1, server=c["b"]) >= 1
    # `epd up` restarts the master; stopped, it stops everything, the new master included
    assert wait_for(lambda: "restarted mooncake-master" in fleet.up_log(), timeout=60,
                    interval=0.5), fleet.log_tail()
    procs = descendants(up.proc.pid)
    (again,) = [p for p in procs if b"mooncake_master" in cmdline(p)]
    up.stop(90)
    assert up.proc.returncode == 0, fleet.log_tail()
    assert wait_for(lambda: not any(alive(p) for p in procs), timeout=10), "left behind"
    assert not alive(again), "the store master outlived epd up"
    assert "stopping mooncake-master" in fleet.up_log()
