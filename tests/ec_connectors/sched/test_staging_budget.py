"""The consumer scheduler's budget and gauges (StagingBudget) over its item table: each vLLM
signal moves an item one step, signals about items in another state change nothing, the
budget refuses what does not fit, the bytes per state reach the stats as gauges (once per
take, when they changed), and a scheduler step costs the same with 10,000 idle items."""

from __future__ import annotations

import time

from ec_connectors.sched.staging_budget import StagingBudget
from ec_connectors.stats import EPDStats, StatsRecorder
from scheduler_hooks import item_table as items_mod
from scheduler_hooks.item_table import LIFECYCLE, ItemState, ItemTable

S = ItemState
ZERO = dict.fromkeys([s.value for s in LIFECYCLE], 0)
LIVE = (S.LOADING, S.STAGED, S.MERGED, S.PREFILLED)


def _book(budget=1000):
    items = ItemTable(5.0, 120.0)
    return StagingBudget(items, budget, StatsRecorder()), items


def _stage(book, item_id, nbytes, now=0.0):
    assert book.reserve(item_id, nbytes, 4, now, 10.0) is not None
    assert book.staged(item_id, 0, True, 4, "", {0}, now, nbytes) is S.STAGED


def _gauges(book) -> dict:
    stats = book.stats.take()
    return stats.data["gauges"]["feature_bytes"] if stats else {}


def test_the_whole_path_and_the_gauges_at_each_state():
    book, items = _book()
    assert book.reserve("a", 100, 4, 0.0, 10.0) is not None
    assert _gauges(book) == {**ZERO, "loading": 100}
    book.staged("a", 0, True, 4, "", {0}, 0.1, nbytes=96)  # the real size replaces it
    assert _gauges(book) == {**ZERO, "staged": 96}
    items.merged("a", "r1", 0.2)
    items.end_step()  # a MERGED item stays until vLLM frees it
    assert items.state("a") is S.MERGED and _gauges(book) == {**ZERO, "merged": 96}
    items.prefilled("a")
    assert _gauges(book) == {**ZERO, "prefilled": 96}
    items.end_step()  # the end of the step: vLLM's cache owns the entry now
    assert items.state("a") is S.DISCARDED and _gauges(book) == ZERO
    assert items.errors == 0 and items.peak_held == 100


def test_gauges_are_published_once_per_take_and_only_when_they_changed():
    book, items = _book()
    for n in range(50):  # many moves between two takes
        _stage(book, f"i{n}", 10)
        items.merged(f"i{n}", "r1", 0.0)
    assert book.stats.pending  # vLLM is asked for one more step to carry them
    stats = book.stats.take()
    assert stats.data["gauges"] == {"feature_bytes": {**ZERO, "merged": 500}}
    assert book.stats.take() is None and not book.stats.pending  # nothing changed since
    items.finished("r1")
    assert _gauges(book) == ZERO


def test_signals_about_items_in_another_state_change_nothing():
    book, items = _book()
    items.prefilled("vllm-encoded")  # vLLM frees an entry it encoded itself
    assert book.staged("late", 0, True, 1, "", {0}, 0.0, 10) is None  # already dropped
    assert items.merged("never-loaded", "r1", 0.0) is None
    items.evicted(["x"])
    items.finished("r1")
    assert len(items) == 0 and items.errors == 0
    _stage(book, "s", 10)
    items.prefilled("s")  # STAGED, not merged: not ours to prefill
    assert items.state("s") is S.STAGED


def test_failed_and_dropped_loads_leave_the_held_bytes_at_once():
    book, items = _book()
    _stage(book, "dropped", 10)
    _stage(book, "keeps", 10)
    book.reserve("fails", 10, 4, 0.0, 1.0)
    items.fail(items.get("fails"), "a worker failed", 0.5)
    items.drop("dropped")
    assert [i for i in ("dropped", "keeps", "fails") if items.state(i) in LIVE] == ["keeps"]
    assert items.held == 10
    assert items.state("fails") is S.FAILED  # remembered (encode locally), holding nothing


def test_an_aborted_request_and_an_eviction_discard_what_was_merged():
    book, items = _book()
    for item_id, req in (("a", "r1"), ("b", "r2"), ("c", "r2")):
        _stage(book, item_id, 10)
        items.merged(item_id, req, 0.0)
    items.finished("r2")  # ended before its prefill
    assert [i for i in "abc" if items.state(i) is S.MERGED] == ["a"]
    items.prefilled("a")
    items.evicted(["a"])
    assert len(items) == 0 and items.errors == 0


def test_a_placement_needs_the_staged_item_and_a_late_report_changes_nothing():
    """One table answers has_cache_item and takes the placement, so an item cannot be
    placed before its Staged report is read (two tables once raced here)."""
    book, items = _book()
    book.reserve("a", 50, 4, 0.0, 10.0)
    assert items.merged("a", "r1", 0.0) is None and items.state("a") is S.LOADING
    book.staged("a", 0, True, 4, "", {0, 1}, 0.1, 48)
    book.staged("a", 1, True, 4, "", {0, 1}, 0.1, 48)
    assert items.merged("a", "r1", 0.2) is not None
    assert book.staged("a", 1, True, 4, "", {0, 1}, 0.3, 99) is None  # a late duplicate
    assert items.state("a") is S.MERGED and items.by_state()["merged"] == 48


def test_the_budget_refuses_what_does_not_fit_and_counts_only_held_bytes():
    book, items = _book(budget=100)
    assert book.reserve("a", 60, 4, 0.0, 10.0) and not book.reserve("b", 60, 4, 0.0, 10.0)
    assert items.state("b") is S.DISCARDED
    book.staged("a", 0, True, 4, "", {0}, 0.0, 60)
    items.merged("a", "r1", 0.0)  # in vLLM's encoder cache now: no longer the connector's
    assert items.held == 0 and book.reserve("b", 60, 4, 0.0, 10.0)
    assert book.reserve("c", 40, 4, 0.0, 10.0) and not book.reserve("d", 1, 4, 0.0, 10.0)


def test_an_unknown_size_is_estimated_from_what_was_staged():
    book, items = _book(budget=1000)
    assert book.reserve("first", 0, 4, 0.0, 10.0)  # nothing known yet: nothing reserved
    book.staged("first", 0, True, 4, "", {0}, 0.0, 400)  # 100 bytes per embedding
    assert book.reserve("second", 0, 5, 0.0, 10.0) and items.get("second").nbytes == 500
    assert not book.reserve("third", 0, 2, 0.0, 10.0)  # 400 + 500 + 200 > 1000


def test_a_retry_ends_the_earlier_life():
    book, items = _book()
    _stage(book, "a", 10)
    assert book.reserve("a", 20, 4, 0.0, 10.0) and items.by_state()["loading"] == 20
    assert items.by_state()["staged"] == 0 and items.errors == 0


def test_an_illegal_move_is_logged_counted_and_dropped_never_raised(caplog, monkeypatch):
    book, items = _book()
    _stage(book, "a", 10)
    monkeypatch.setitem(items_mod.TRANSITIONS, S.STAGED, frozenset({S.DISCARDED}))
    assert items.merged("a", "r1", 0.0) is None  # STAGED -> MERGED: refused (a bug)
    assert items.errors == 1 and items.state("a") is S.DISCARDED
    assert "STAGED -> MERGED" in caplog.text
    assert book.stats.totals["lifecycle_errors"] == 1


def test_a_scheduler_step_with_10000_idle_items_scans_nothing(ctl_dir, tmp_path):
    """A step of the scheduler side (asks for one request, placement, evictions, the
    sweep, the end of the step, the gauges, the request's end) while 10,000 STAGED items
    nobody asks for sit in the table: the table is never scanned, only the request's item
    is looked up."""
    from ec_connectors.config import EPDConfig
    from ec_connectors.control.endpoint import control_address
    from ec_connectors.sched.scheduler import EPDSchedulerSide
    from ec_connectors.transports import make_transport
    from tests.ec_connectors.fakes import NUM_EMBEDS, request
    from tests.scheduler_hooks.test_item_table import NoScan

    cfg = EPDConfig.from_dict({"storage_path": str(tmp_path), "control_dir": ctl_dir,
                               "namespace": "m", "inline_max_bytes": 0})
    side = EPDSchedulerSide(cfg, make_transport(cfg), is_producer=False, is_consumer=True,
                            address=control_address(ctl_dir, "idle", 0), engine_id="idle",
                            start_index=False)
    try:
        items, now = side.items, time.monotonic()  # (staged now: not due for the sweep)
        for i in range(10_000):
            items.begin(f"idle{i}", now, 60.0)
            items.staged(f"idle{i}", 0, True, NUM_EMBEDS, "", {0}, now, nbytes=64)
        items.begin("img", now, 60.0, nbytes=64)
        items.staged("img", 0, True, NUM_EMBEDS, "", {0}, now, nbytes=64)
        items._items = NoScan(items._items)
        side._last_sweep = -1e9  # this step sweeps (at most once a second otherwise)
        req = request("c1", "img")
        for _ in range(3):
            side.ensure_cache_available(req, 0)
            if side.has_cache_item("img"):
                side.update_state_after_alloc(req, 0)
            meta = side.build_connector_meta(evicted=["gone"])
            side.stats.take()
            side.update_state_after_free(req, 0)
        assert meta.place == {} and items.state("img") is S.DISCARDED
        side.request_finished(req)
        assert set(items._items.touched) <= {"img", "gone"}
        assert len(items) == 10_000 and items.by_state()["staged"] == 640_000
    finally:
        side.close()


def test_gauges_travel_with_the_stats_newest_wins_and_reduce_to_the_log_line():
    a = EPDStats(data={"gauges": {"feature_bytes": {"staged": 5}}})
    a.aggregate(EPDStats(data={"counters": {"loads": 1},
                               "gauges": {"feature_bytes": {"staged": 0, "merged": 7}}}))
    assert a.data["gauges"] == {"feature_bytes": {"staged": 0, "merged": 7}}
    assert a.reduce() == {"loads": 1, "feature_bytes_staged": 0, "feature_bytes_merged": 7}
    assert not EPDStats(data={"gauges": {"feature_bytes": {}}}).is_empty()
    rec = StatsRecorder()
    rec.gauge("feature_bytes", {"staged": 1})
    assert rec.pending  # a changed gauge asks vLLM for one more step (has_pending_push_work)
    assert rec.take().data["gauges"] == {"feature_bytes": {"staged": 1}}
    assert not rec.pending and rec.take() is None


def test_prometheus_exports_every_state_and_the_newest_values():
    from functools import partial
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from ec_connectors.stats import EPDPromMetrics

    reg = CollectorRegistry()
    types = {t: partial(t, registry=reg) for t in (Gauge, Counter, Histogram)}
    prom = EPDPromMetrics(SimpleNamespace(ec_transfer_config=None), types, ["engine"],
                          {0: ["0"]})

    def sample(state):
        return reg.get_sample_value("vllm:epd_feature_bytes", {"engine": "0", "state": state})

    assert [sample(s.value) for s in LIFECYCLE] == [0.0] * len(LIFECYCLE)  # from the start
    assert sample("failed") is None  # a failed load holds no bytes: no such label
    prom.observe({"gauges": {"feature_bytes": {"staged": 96, "bogus": 1}}}, 0)
    prom.observe({"gauges": {"feature_bytes": {"merged": 96}}}, 0)
    assert sample("staged") == 96 and sample("merged") == 96
    prom.observe({"gauges": {"feature_bytes": ZERO}}, 0)
    assert [sample(s.value) for s in LIFECYCLE] == [0.0] * len(LIFECYCLE)
    assert b'bogus' not in generate_latest(reg)
