"""What a worker does per step and per save costs O(what changed): the safety-net reap of
unplaced copies (every `place` and prefetch) visits the expired copies and one more, never
every staged one; the producer's ENCODED_CPU gauge is published when the stats are taken and
only when it changed, not on every move of the save queue. No scheduler side: a worker's
control messages wait in its outbox."""

from __future__ import annotations

import pytest
import torch

from ec_connectors.config import EPDConfig
from ec_connectors.control.endpoint import control_address
from ec_connectors.transports import make_transport
from ec_connectors.workers.worker import EPDWorker


@pytest.fixture
def make_worker(tmp_path, ctl_dir):
    made: list[EPDWorker] = []

    def make(role: str, **extra) -> EPDWorker:
        cfg = EPDConfig.from_dict({"storage_path": str(tmp_path / "store"), "namespace": "m",
                                   "control_dir": ctl_dir, **extra})
        w = EPDWorker(cfg, make_transport(cfg), is_producer=role == "producer",
                      is_consumer=role == "consumer",
                      address=control_address(ctl_dir, f"engine-{role}", 0), rank=0,
                      device=torch.device("cpu"))
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


class Visits(dict):
    """Counts the entries `items()` hands out."""

    visited = 0

    def items(self):
        for kv in super().items():
            self.visited += 1
            yield kv


def test_the_reap_visits_the_expired_copies_and_one_more(make_worker):
    w = make_worker("consumer", staged_ttl_s=1.0)
    x = torch.zeros(4, 8)
    for k in range(500):  # (under the channel's high-water mark: no scheduler takes them)
        w._stage(f"i{k}", x.clone(), "")
    with w._lock:  # the oldest ten were staged long ago (the order of staging kept)
        for k in range(10):
            tensor, ts = w._staged[f"i{k}"]
            w._staged[f"i{k}"] = (tensor, ts - 100.0)
        w._staged = Visits(w._staged)
    w._reap()
    assert w._staged.visited == 11
    assert list(w._staged) == [f"i{k}" for k in range(10, 500)]
    assert w.staged_bytes == 490 * x.nbytes
    cache: dict[str, torch.Tensor] = {}
    w._staged.visited = 0
    w.place(cache, {"i10": 4})  # a step's placement reaps too: one visit, nothing expired
    assert w._staged.visited == 1 and torch.equal(cache["i10"], x)
    assert w.stats.totals["unstaged_bytes"] == 11 * x.nbytes


def test_the_held_bytes_gauge_is_published_on_take_when_changed(make_worker):
    w = make_worker("producer")
    w.transport.writes_fast = True  # small saves written on the caller's thread: no race
    published: list[dict] = []
    gauge = w.stats.gauge
    w.stats.gauge = lambda name, values: (published.append({name: dict(values)}),
                                          gauge(name, values))[1]
    x = torch.randn(16, 32)
    for k in range(20):  # small items are written at once: held, then given to the store
        w.save(f"s{k}", x)
    assert w.flush() and published == []  # every take saw 0 held: nothing changed
    assert w._saves.enter(x.nbytes, 1.0)  # an item waits for the writer
    assert published == []  # a move publishes nothing by itself
    assert w.stats.take().data["gauges"] == {"producer_feature_bytes": {"encoded_cpu":
                                                                        x.nbytes}}
    assert w.stats.take() is None  # unchanged: nothing to publish
    w._saves.leave(x.nbytes)
    assert w.stats.take().data["gauges"] == {"producer_feature_bytes": {"encoded_cpu": 0}}
    assert len(published) == 2
