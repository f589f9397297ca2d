"""The pulling side of the Mooncake Transfer Engine transport (mooncake_te/consumer.py: the
Puller, its deadlines, quarantine and pool) against real producers that miss, refuse, die or
freeze, over TCP loopback: each peer a `peer_process` running a real TransferEngine."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tests.ec_connectors.transports import forked_peers
from tests.ec_connectors.transports.mooncake_te_helpers import (
    CONSUMER,
    PRODUCER,
    MiB,
    base_ports,
    health,
    mc_config,
)
from tests.helpers import expected, wait_for

pytest.importorskip("mooncake.engine")
peers = forked_peers.fixture()  # peers forked warm, killed after the test
_ports = base_ports(1)


def test_small_items_ride_inline_and_unknown_items_miss_at_once(peers):
    base = next(_ports)
    prod = peers.start(PRODUCER, **mc_config(base))
    cons = peers.start(CONSUMER, **mc_config(base))
    endpoint = prod.info["endpoint"]
    put = prod.call({"op": "put", "id": "tiny", "seed": 1, "shape": [64, 128],
                     "dtype": "bfloat16"})
    got = cons.call({"op": "get", "id": "tiny", "timeout_s": 5, "location": endpoint})
    assert got["found"] and got["checksum"] == put["checksum"]
    assert health(cons)["inline"] == 1
    t0 = time.monotonic()
    miss = cons.call({"op": "get", "id": "never-stored", "timeout_s": 5.0,
                      "location": endpoint})
    assert not miss["found"]
    assert time.monotonic() - t0 < 1.0  # no save of it queued there: a miss now
    asks_all = peers.start(CONSUMER, **mc_config(base, producers=[endpoint]))
    t0 = time.monotonic()  # asked with no location, it may not be made yet: waited for
    miss = asks_all.call({"op": "get", "id": "never-stored", "timeout_s": 1.0})
    assert not miss["found"] and 0.9 < time.monotonic() - t0 < 5
    h = health(cons)
    assert h["unknown"] >= 1 and h["pool_used_bytes"] == 0


def test_items_of_another_model_are_refused(peers):
    base = next(_ports)
    prod = peers.start(PRODUCER, **mc_config(base, namespace="model-a"))
    other = peers.start(CONSUMER, **mc_config(base, namespace="model-b"))
    same = peers.start(CONSUMER, **mc_config(base, namespace="model-a"))
    endpoint = prod.info["endpoint"]
    put = prod.call({"op": "put", "id": "shared-uuid", "seed": 8, "shape": [1024, 1024],
                     "dtype": "bfloat16"})
    t0 = time.monotonic()
    refused = other.call({"op": "get", "id": "shared-uuid", "timeout_s": 5,
                          "location": endpoint})
    assert not refused["found"] and time.monotonic() - t0 < 2  # refused at once, not retried
    got = same.call({"op": "get", "id": "shared-uuid", "timeout_s": 5, "location": endpoint})
    assert got["found"] and got["checksum"] == put["checksum"]
    # the same served name on other weights (another model fingerprint) is another model
    retrained = peers.start(CONSUMER, **mc_config(base, namespace="model-a",
                                                  model_fingerprint="0123456789abcdef"))
    refused = retrained.call({"op": "get", "id": "shared-uuid", "timeout_s": 5,
                              "location": endpoint})
    assert not refused["found"]


def test_consumer_finds_items_through_configured_producers(peers):
    base = next(_ports)
    prod = peers.start(PRODUCER, **mc_config(base))
    cons = peers.start(CONSUMER, **mc_config(base, producers=[f"127.0.0.1:{base}"]))
    put = prod.call({"op": "put", "id": "p1", "seed": 2, "shape": [512, 1024],
                     "dtype": "float16"})
    got = cons.call({"op": "get", "id": "p1", "timeout_s": 5})  # no location given
    assert got["found"] and got["checksum"] == put["checksum"]


def test_consumer_pool_exhaustion_fails_the_pull_in_time(peers):
    base = next(_ports)
    prod = peers.start(PRODUCER, **mc_config(base))
    cons = peers.start(CONSUMER, **mc_config(base, memory_pool_bytes=4 * MiB))
    endpoint = prod.info["endpoint"]
    prod.call({"op": "put", "id": "big", "seed": 1, "shape": [4096, 1024],
               "dtype": "bfloat16"})  # 8 MiB: larger than the consumer's whole pool
    t0 = time.monotonic()
    got = cons.call({"op": "get", "id": "big", "timeout_s": 5, "location": endpoint})
    assert not got["found"] and time.monotonic() - t0 < 2
    assert health(cons)["pool_used_bytes"] == 0


def test_producer_killed_mid_transfer(peers):
    base = next(_ports)
    prod = peers.start(PRODUCER, **mc_config(base))
    cons = peers.start(CONSUMER, **mc_config(base))
    shape = [16000, 4096]  # 125 MB
    prod.call({"op": "put", "id": "k", "seed": 9, "shape": shape, "dtype": "bfloat16"})
    deadline_s = 4.0
    t0 = time.monotonic()
    cons.send({"op": "get", "id": "k", "timeout_s": deadline_s, "location": prod.info["endpoint"],
               "nbytes": 16000 * 4096 * 2})
    threading.Timer(0.01, os.killpg, (prod.proc.pid, signal.SIGKILL)).start()
    got = cons.result(30)
    assert time.monotonic() - t0 < deadline_s + 2  # deadline honoured, no hang
    if got["found"]:  # the transfer won the race: then it must be the right bytes
        assert got["checksum"] == expected(9, shape)
    h = health(cons)
    assert h["pool_used_bytes"] == 0 and h["quarantined"] == 0


def test_producer_frozen_with_sigstop(peers):
    base = next(_ports)
    prod = peers.start(PRODUCER, **mc_config(base))
    cons = peers.start(CONSUMER, **mc_config(base))
    shape = [6144, 4096]
    prod.call({"op": "put", "id": "f", "seed": 4, "shape": shape, "dtype": "bfloat16"})
    endpoint = prod.info["endpoint"]
    warm = cons.call({"op": "get", "id": "f", "timeout_s": 5, "location": endpoint})
    assert warm["found"]
    os.killpg(prod.proc.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    got = cons.call({"op": "get", "id": "f", "timeout_s": 1.5, "location": endpoint,
                     "nbytes": 48 * MiB}, timeout_s=30)
    elapsed = time.monotonic() - t0
    assert not got["found"] and 1.4 < elapsed < 4  # deadline honoured, no hang
    h = health(cons)
    # The frozen producer may still write into that block: it is held, not reused.
    assert h["quarantined"] == 1 and h["pool_used_bytes"] == 48 * MiB
    os.killpg(prod.proc.pid, signal.SIGCONT)  # it wakes, finishes, answers late: block freed
    assert wait_for(lambda: health(cons)["pool_used_bytes"] == 0, timeout=10, interval=0.1)
    assert health(cons)["quarantined"] == 0
    again = cons.call({"op": "get", "id": "f", "timeout_s": 5, "location": endpoint})
    assert again["found"] and again["checksum"] == expected(4, shape)


def test_frozen_then_killed_producer_releases_quarantine(peers):
    base = next(_ports)
    prod = peers.start(PRODUCER, **mc_config(base))
    cons = peers.start(CONSUMER, **mc_config(base))
    prod.call({"op": "put", "id": "z", "seed": 4, "shape": [2048, 4096], "dtype": "bfloat16"})
    endpoint = prod.info["endpoint"]
    warm = cons.call({"op": "get", "id": "z", "timeout_s": 10, "location": endpoint})
    assert warm["found"], warm
    os.killpg(prod.proc.pid, signal.SIGSTOP)
    got = cons.call({"op": "get", "id": "z", "timeout_s": 1.0, "location": endpoint,
                     "nbytes": 2048 * 4096 * 2})
    h = health(cons)
    assert not got["found"] and h["quarantined"] == 1, (got, h)
    os.killpg(prod.proc.pid, signal.SIGKILL)
    assert wait_for(lambda: health(cons)["pool_used_bytes"] == 0, timeout=15, interval=0.1), \
        health(cons)


def test_a_dead_producer_costs_a_pull_milliseconds_not_its_deadline(peers):
    base = next(_ports)
    prod = peers.start(PRODUCER, **mc_config(base))
    cons = peers.start(CONSUMER, **mc_config(base))
    put = prod.call({"op": "put", "id": "d", "seed": 9, "shape": [256, 2048],
                     "dtype": "bfloat16"})
    endpoint = put["location"]
    assert cons.call({"op": "get", "id": "d", "timeout_s": 5, "location": endpoint})["found"]
    prod.proc.kill()
    prod.proc.wait(10)
    time.sleep(0.3)  # the consumer's link sees the disconnect
    for _ in range(2):  # nobody listens there now: refused at once, not 5 s of waiting
        t0 = time.monotonic()
        got = cons.call({"op": "get", "id": "d", "timeout_s": 5, "location": endpoint,
                         "nbytes": put["nbytes"]})
        assert not got["found"] and time.monotonic() - t0 < 1.5
    assert health(cons)["pool_used_bytes"] == 0
