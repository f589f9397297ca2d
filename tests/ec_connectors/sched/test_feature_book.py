"""The consumer scheduler's feature books (FeatureBook): each vLLM signal moves an item one
step of the lifecycle, signals about items in another state change nothing, the budget
refuses what does not fit, and the bytes per state reach the stats as gauges."""

from __future__ import annotations

from ec_connectors.sched.feature_book import FeatureBook
from ec_connectors.stats import EPDStats, StatsRecorder
from scheduler_hooks.lifecycle import FeatureState
from scheduler_hooks.staging import StagingTable, Status

S = FeatureState
ZERO = dict.fromkeys([s.value for s in S], 0)


def _book(budget=1000):
    return FeatureBook(budget, StatsRecorder()), StagingTable(5.0, 120.0)


def _stage(book, staging, item_id, nbytes, now=0.0):
    assert book.reserve(item_id, nbytes, 4)
    staging.begin(item_id, now, 10.0, have_workers=True)
    assert staging.staged(item_id, 0, True, 4, "", {0}, now) is Status.READY
    book.staged(item_id, nbytes, 4)


def _gauges(book) -> dict:
    stats = book.stats.take()
    return stats.data["gauges"]["feature_bytes"] if stats else {}


def test_the_whole_path_and_the_gauges_at_each_state():
    book, staging = _book()
    assert book.reserve("a", 100, 4)
    assert _gauges(book) == {**ZERO, "loading": 100}
    staging.begin("a", 0.0, 10.0, have_workers=True)
    book.staged("a", 96, 4)  # the real size replaces the reservation
    assert _gauges(book) == {**ZERO, "staged": 96}
    book.merged("a", "r1")
    staging.forget("a")  # placed: the scheduler forgets its staging
    book.settle(staging)  # a MERGED item stays until vLLM frees it
    assert book.life.state("a") is S.MERGED and _gauges(book) == {**ZERO, "merged": 96}
    book.prefilled("a")
    assert _gauges(book) == {**ZERO, "prefilled": 96}
    book.settle(staging)  # the end of the step: vLLM's cache owns the entry now
    assert book.life.state("a") is S.DISCARDED and _gauges(book) == ZERO
    assert book.errors == 0 and book.peak_held == 100


def test_signals_about_items_in_another_state_change_nothing():
    book, staging = _book()
    book.prefilled("vllm-encoded")  # vLLM frees an entry it encoded itself
    book.staged("late", 10, 1)  # a report about an item already dropped
    book.merged("never-loaded", "r1")
    book.evicted(["x"])
    book.finished("r1")
    assert len(book.life) == 0 and book.errors == 0
    _stage(book, staging, "s", 10)
    book.prefilled("s")  # STAGED, not merged: not ours to prefill
    assert book.life.state("s") is S.STAGED


def test_failed_dropped_and_expired_stagings_are_discarded_at_the_end_of_the_step():
    book, staging = _book()
    _stage(book, staging, "dropped", 10)
    _stage(book, staging, "keeps", 10)
    book.reserve("fails", 10, 4)
    staging.begin("fails", 0.0, 1.0, have_workers=True)
    staging.fail(staging.get("fails"), "a worker failed", 0.5)
    staging.forget("dropped")
    book.settle(staging)
    assert book.life.items_in(*S) == ["keeps"] and book.held == 10


def test_an_aborted_request_and_an_eviction_discard_what_was_merged():
    book, staging = _book()
    for item_id, req in (("a", "r1"), ("b", "r2"), ("c", "r2")):
        _stage(book, staging, item_id, 10)
        book.merged(item_id, req)
    book.finished("r2")  # ended before its prefill
    assert book.life.items_in(S.MERGED) == ["a"]
    book.prefilled("a")
    book.evicted(["a"])
    assert len(book.life) == 0 and book.errors == 0


def test_a_placement_before_the_staged_report_is_read_still_counts():
    book, staging = _book()
    book.reserve("a", 50, 4)
    book.merged("a", "r1")  # the control thread has not told the book yet
    book.staged("a", 48, 4)  # ... and its late report changes nothing
    assert book.life.state("a") is S.MERGED and book.life.by_state()["merged"] == 50


def test_the_budget_refuses_what_does_not_fit_and_counts_only_held_bytes():
    book, staging = _book(budget=100)
    assert book.reserve("a", 60, 4) and not book.reserve("b", 60, 4)
    assert book.life.state("b") is S.DISCARDED
    staging.begin("a", 0.0, 10.0, True)
    book.staged("a", 60, 4)
    book.merged("a", "r1")  # in vLLM's encoder cache now: no longer the connector's
    assert book.held == 0 and book.reserve("b", 60, 4)
    assert book.reserve("c", 40, 4) and not book.reserve("d", 1, 4)


def test_an_unknown_size_is_estimated_from_what_was_staged():
    book, staging = _book(budget=1000)
    assert book.reserve("first", 0, 4)  # nothing known yet: nothing reserved
    staging.begin("first", 0.0, 10.0, True)
    book.staged("first", 400, 4)  # 100 bytes per embedding
    assert book.reserve("second", 0, 5) and book.life.get("second").nbytes == 500
    assert not book.reserve("third", 0, 2)  # 400 + 500 + 200 > 1000


def test_a_retry_ends_the_earlier_life():
    book, staging = _book()
    _stage(book, staging, "a", 10)
    assert book.reserve("a", 20, 4) and book.life.by_state()["loading"] == 20
    assert book.life.by_state()["staged"] == 0 and book.errors == 0


def test_an_illegal_move_is_logged_counted_and_dropped_never_raised(caplog):
    book, staging = _book()
    _stage(book, staging, "a", 10)
    book._move("a", S.PREFILLED)  # STAGED -> PREFILLED: a bug in a caller
    assert book.errors == 1 and book.life.state("a") is S.DISCARDED
    assert "STAGED -> PREFILLED" in caplog.text
    assert book.stats.totals["lifecycle_errors"] == 1


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

    assert [sample(s.value) for s in S] == [0.0] * len(S)  # exported before any report
    prom.observe({"gauges": {"feature_bytes": {"staged": 96, "bogus": 1}}}, 0)
    prom.observe({"gauges": {"feature_bytes": {"merged": 96}}}, 0)
    assert sample("staged") == 96 and sample("merged") == 96
    prom.observe({"gauges": {"feature_bytes": ZERO}}, 0)
    assert [sample(s.value) for s in S] == [0.0] * len(S)
    assert b'bogus' not in generate_latest(reg)
