"""End to end with real `vllm serve` processes, EPDConnector over NIXL (UCX on loopback): the
session's aggregated server (the reference), an encoder-only producer whose NIXL agent
registers its items, and a consumer that READs embeddings out of it (the shared E_P_D fleet's
encoder and prefill instance: tests/e2e/fleets.py); a producer killed while the consumer's
pull is in flight costs a local encode, never an error or another answer."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tests.e2e import fleets
from tests.e2e.client import ask, case, encode, tokens, wait_metric
from tests.e2e.client import metric as cons_metric
from tests.helpers import ServerAt, server_pid

pytest.importorskip("nixl._api", reason="transport 'nixl' needs NIXL (nixl + nixl-cu12)")


@pytest.fixture(scope="module")
def cluster(e_p_d_fleet, aggregated):
    """The shared E_P_D fleet (tests/e2e/fleets.py): its encoder is the producer (every item
    held where it lies), its prefill instance the consumer. The test kills the encoder;
    `epd up` restarts it, and the fleet's next user waits until it is back."""
    fleet = e_p_d_fleet.ensure()
    aggregated.wait()
    with httpx.Client(timeout=120) as client:
        yield {"agg": aggregated, "prod": ServerAt(fleet.url(1)),
               "cons": ServerAt(fleet.url(3)), "client": client,
               "endpoint": fleets.e_p_d_endpoint(), "up": fleet.up.proc}


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
