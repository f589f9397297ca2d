"""End to end with real `vllm serve` processes and a real `mooncake_master`: two encoder-only
producers and one prefill/decode consumer, all on tiers ["mooncake_store", "safetensors"].
Cross-instance reuse through the store (the second producer does not encode again), loads from
the store, and a master killed mid-run: requests are still answered through the other tier."""

from __future__ import annotations

import time

import httpx
import pytest

from ec_connectors.protocol.keys import content_item_id
from encoder_service.local.mooncake_master import master_server
from encoder_service.local.processes import VllmServer, metric_value, start_all
from encoder_service.local.requests import sample_image_png
from encoder_service.local.testmodels import SPECS, build
from encoder_service.local.up import epd_config
from tests.e2e.client import MODEL_NAME, ask, metric, tokens, wait_metric
from tests.helpers import LOOPBACK, MASTER, WORK, Peers, port_block, stop_all, wait_for

pytest.importorskip("mooncake.store")
BASE_PORT = port_block(__name__)[0]
MASTER_PORT = port_block(__name__, MASTER)[0]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = build(WORK / "models" / "tiny-llava", SPECS["tiny"])
    storage = tmp_path_factory.mktemp("shared-ec")
    logs = WORK / "test-e2e-store"
    master = master_server(logs, MASTER_PORT).start()
    master.wait()
    extra = {"transport": ["mooncake_store", "safetensors"], "host": "127.0.0.1",
             "store_master": master.address, "store_metadata": master.metadata_url,
             "store_segment_bytes": 0, "store_buffer_bytes": 128 << 20,
             "store_health_interval_s": 0.5, "load_timeout_s": 10}
    # The store's memory: a segment in a process of its own. (A vLLM CPU worker pinned to a
    # core with OpenMP threads spinning on it serves reads of its segment slowly on 2 cores.)
    holder = Peers("e2e-store-holder")
    holder.start({"is_producer": True, "is_consumer": False},
                 **{**extra, "transport": "mooncake_store", "store_segment_bytes": 256 << 20})
    servers = [
        VllmServer("producer-a", model, BASE_PORT, logs,
                   epd_config("ec_producer", storage, extra), cpu_core=0, env=LOOPBACK),
        VllmServer("producer-b", model, BASE_PORT + 1, logs,
                   epd_config("ec_producer", storage, extra), cpu_core=1, env=LOOPBACK),
        VllmServer("consumer", model, BASE_PORT + 2, logs,
                   epd_config("ec_consumer", storage, extra),
                   cpu_core=1, env=LOOPBACK),
    ]
    try:
        start_all(servers, progress=lambda m: print(f"[e2e-store] {m}", flush=True))
        client = httpx.Client(timeout=120)
        yield {"a": servers[0], "b": servers[1], "cons": servers[2], "master": master,
               "client": client, "storage": storage}
        client.close()
    finally:
        stop_all(servers)
        # the last test kills the master: the holder's store client would then wait out its
        # RPC timeout (10 s) unmounting its segment; nothing is checked after this
        holder.close(timeout_s=1.0 if master.proc.poll() is not None else 10.0)
        master.stop()


def encode_and_store(c, image, item_id) -> None:
    """Ask producer A for the item and wait until its save reached the store (saves run in
    the background: a request sent without params before that would just encode locally)."""
    master = f"http://{c['master'].host}:{c['master'].metrics_port}/metrics"
    keys = metric_value(c["client"].get(master).text, "master_key_count")
    ask(c, c["a"], image, item_id, max_tokens=1)
    assert wait_for(lambda: metric_value(c["client"].get(master).text, "master_key_count")
                    > keys, 10, interval=0.05), "the item never reached the store"


def reference(c, image) -> list[int]:
    """The consumer's own answer when it encodes the image itself (an id no one stored)."""
    return tokens(ask(c, c["cons"], image, "local-" + content_item_id(image, MODEL_NAME)))


def test_consumer_loads_from_the_store_with_no_params(cluster):
    c = cluster
    image = sample_image_png(seed=601)
    item_id = content_item_id(image, MODEL_NAME)
    expected = reference(c, image)
    encode_and_store(c, image, item_id)
    hits = metric(c, "tier_mooncake_store_hits_total")
    # No ec_transfer_params: the consumer's scheduler finds the item by probing the store.
    assert tokens(ask(c, c["cons"], image, item_id)) == expected
    assert wait_metric(c, "tier_mooncake_store_hits_total", hits + 1) == hits + 1


def test_second_encoder_instance_does_not_encode_again(cluster):
    c = cluster
    image = sample_image_png(seed=602)
    item_id = content_item_id(image, MODEL_NAME)
    encode_and_store(c, image, item_id)
    saves_b = metric(c, "saves_total", c["b"])
    skipped_b = metric(c, "skipped_saves_total", c["b"])
    params = ask(c, c["b"], image, item_id, max_tokens=1).get("ec_transfer_params")
    assert params and item_id in params["epd"]["items"]  # B still promises the item
    assert wait_metric(c, "skipped_saves_total", skipped_b + 1, server=c["b"]) >= skipped_b + 1
    assert metric(c, "saves_total", c["b"]) == saves_b  # B encoded and stored nothing
    expected = reference(c, image)
    assert tokens(ask(c, c["cons"], image, item_id, params)) == expected


def test_master_killed_mid_run_requests_still_answered(cluster):
    """Last in this module: it kills the master."""
    c = cluster
    c["master"].proc.kill()
    c["master"].proc.wait()
    time.sleep(1.5)  # store_health_interval_s 0.5: every client has noticed by now
    image = sample_image_png(seed=603)
    item_id = content_item_id(image, MODEL_NAME)
    expected = reference(c, image)
    params = ask(c, c["a"], image, item_id, max_tokens=1).get("ec_transfer_params")
    assert params and item_id in params["epd"]["items"]
    hits = metric(c, "tier_safetensors_hits_total")
    assert tokens(ask(c, c["cons"], image, item_id, params)) == expected
    assert wait_metric(c, "tier_safetensors_hits_total", hits + 1) == hits + 1
    assert metric(c, "tier_mooncake_store_skipped_total") >= 1
    assert metric(c, "transport_down_total") >= 1
    # An item no tier has: encoded locally, answered all the same.
    other = sample_image_png(seed=604)
    assert tokens(ask(c, c["cons"], other, content_item_id(other, MODEL_NAME)))
    # vLLM publishes a server's connector stats on its next step: give producer A one.
    ask(c, c["a"], other, content_item_id(other, MODEL_NAME), max_tokens=1)
    assert wait_metric(c, "tier_mooncake_store_put_failures_total", 1, server=c["a"]) >= 1
