"""The rival benchmark's logic on made-up rounds and events (benchmarks/rivals.py and its
rival_*.py modules): handoff pairing, per-round summaries, answers against aggregated vLLM's,
medians, what fails the run, the JSON and chart, the ECMooncakeConnector front's requests,
`vllm bench serve`'s result. No server is started (the benchmark runs by hand)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from benchmarks.rival_front import consumer_body, encoder_body, media_parts, metadata_by_uuid
from benchmarks.rival_probe import Event, handoffs, parse_events, wrap_connector
from benchmarks.rival_report import (
    KEYS,
    answers_equal,
    combine,
    failed,
    format_table,
    json_view,
    medians,
    summarize,
    write,
)
from benchmarks.rival_stacks import ProbedServer, mooncake_config
from benchmarks.rival_workloads import Run, read_vllm_bench


def test_each_encode_pairs_with_the_first_placement_after_it_and_before_its_next_encode():
    events = [Event("done", 10.0, 100, "a"), Event("placed", 10.5, 100, "a"),
              Event("placed", 12.0, 100, "a"),  # a second placement: not a new handoff
              Event("done", 20.0, 100, "a"), Event("placed", 20.25, 100, "a"),
              Event("done", 11.0, 50, "b"),  # never placed (a prefix-cache hit)
              Event("placed", 11.5, 70, "c")]  # placed without an encode we saw
    h = handoffs(events)
    assert h.seconds == [0.25, 0.5] and h.encodes == 3 and h.placements == 4
    assert h.bytes_placed == 370
    window = handoffs(events, since=15.0, until=30.0)
    assert window.seconds == [0.25] and window.bytes_placed == 100 and window.encodes == 1


def test_a_placement_after_the_next_encode_belongs_to_that_encode():
    events = [Event("done", 1.0, 1, "k"), Event("done", 2.0, 1, "k"),
              Event("placed", 2.5, 1, "k")]
    assert handoffs(events).seconds == [0.5]


def test_probe_lines_parse_and_torn_lines_are_skipped():
    lines = ["done\t1.5\t64\tab cd", "placed\t2.0\t64\tab cd", "placed\t2.", "junk", ""]
    assert parse_events(lines) == [Event("done", 1.5, 64, "ab cd"),
                                   Event("placed", 2.0, 64, "ab cd")]


def test_the_probe_wraps_a_connector_without_changing_what_it_does(tmp_path, monkeypatch):
    monkeypatch.setenv("EPD_RIVAL_PROBE_DIR", str(tmp_path))
    calls = []

    class Connector:
        def save_caches(self, encoder_cache, mm_hash, **kw):
            calls.append(("save", mm_hash))

        def start_load_caches(self, encoder_cache, **kw):
            encoder_cache["new"] = SimpleNamespace(nbytes=8)
            calls.append(("load", None))
            return "ok"

    wrap_connector(Connector)
    wrap_connector(Connector)  # idempotent
    c, cache = Connector(), {"old": SimpleNamespace(nbytes=4)}
    c.save_caches(cache, "old")
    assert c.start_load_caches(cache) == "ok"
    assert calls == [("save", "old"), ("load", None)]
    lines = "".join(f.read_text() for f in tmp_path.glob("*.events")).splitlines()
    assert [(e.kind, e.key, e.nbytes) for e in parse_events(lines)] == [
        ("done", "old", 4), ("placed", "new", 8)]


def run(ttft, answers, errors=(), duration=2.0, cpu=None):
    return Run(list(ttft), list(answers), list(errors), duration, 0.0, 1.0,
               cpu=cpu or {"cpu_ms_decode": 12.5})


def test_a_round_summary_counts_answered_requests_and_the_handoff():
    r = run([0.1, 0.2, None], [[1], [2], None], errors=["HTTP 500"])
    h = handoffs([Event("done", 0.0, 10, "a"), Event("placed", 0.004, 10, "a")])
    s = summarize(r, h)
    assert s["req_per_s"] == 1.0 and s["errors"] == 1 and s["decode_cpu_ms_per_req"] == 12.5
    assert s["ttft_p50_ms"] == pytest.approx(150.0) and s["handoff_ms"] == pytest.approx(4.0)
    assert s["bytes_moved_per_req"] == pytest.approx(10 / 3)
    assert summarize(r, None)["handoff_ms"] is None  # aggregated: no connector


def test_answers_must_all_be_there_and_equal():
    assert answers_equal([[1, 2], [3]], [[1, 2], [3]]) is True
    assert answers_equal([[1, 2], [4]], [[1, 2], [3]]) is False
    assert answers_equal([[1, 2], None], [[1, 2], [3]]) is False
    assert answers_equal([[1, 2]], [[1, 2], [3]]) is False
    assert answers_equal([[1]], None) is None


def rnd(req_per_s, answers, p99=100.0, handoff=5.0):
    return {"summary": {"req_per_s": req_per_s, "ttft_p50_ms": 50.0, "ttft_p99_ms": p99,
                        "decode_cpu_ms_per_req": 10.0, "handoff_ms": handoff,
                        "bytes_moved_per_req": 1e6, "errors": 0},
            "answers": answers}


def test_medians_over_rounds_and_answers_against_aggregated():
    ref = [[1, 2], [3, 4]]
    results = {"light": {
        "aggregated": [rnd(10, [None, [3, 4]], handoff=None), rnd(12, ref, handoff=None)],
        "ec_example": [rnd(20, ref), rnd(30, ref), rnd(25, ref)],
        "ours_shm": [rnd(40, ref, p99=80.0), rnd(50, [[1, 2], [9, 9]], p99=70.0)],
    }}
    table = combine(results)
    assert table["light"]["ec_example"]["req_per_s"] == 25
    assert table["light"]["ec_example"]["answers_equal"] is True
    assert table["light"]["ec_example"]["rounds"] == 3
    assert table["light"]["ours_shm"]["answers_equal"] is False  # one round differs
    assert table["light"]["ours_shm"]["ttft_p99_ms"] == 75.0
    # aggregated's first round lost an answer: its complete second round is the reference,
    # and the incomplete one counts against it
    assert table["light"]["aggregated"]["answers_equal"] is False
    assert table["light"]["aggregated"].get("handoff_ms") is None
    assert failed(table, {}) == ["light/aggregated: answers differ from aggregated vLLM's",
                                 "light/ours_shm: answers differ from aggregated vLLM's"]


def test_no_reference_means_no_verdict_and_a_rival_left_out_does_not_fail_the_run():
    table = combine({"distinct": {"ec_example": [rnd(20, ["a"])]}})
    assert table["distinct"]["ec_example"]["answers_equal"] is None
    left_out = {"distinct": {"ec_mooncake": "HTTP 500: push never came",
                             "ours_te": "ServerFailed: decode exited",
                             "ours_pool_shm": "round 1: Unsupported: no Qwen3-VL encoder"}}
    assert failed(table, left_out) == [
        "distinct/ours_te: did not run (ServerFailed: decode exited)"]
    text = format_table(table, left_out)
    assert "ec_mooncake    left out: HTTP 500: push never came" in text


def test_medians_skip_missing_and_none():
    assert medians([{"a": 1, "b": None}, {"a": 3}, {"a": 2, "b": 4, "s": "x"}]) == {
        "a": 2, "b": 4}


def test_json_has_the_promised_keys_and_the_chart_and_details_sit_beside_it(tmp_path):
    ref = [[1]]
    table = combine({"light": {"aggregated": [rnd(10, ref, handoff=None)],
                               "ours_shm": [rnd(20, ref)], "ec_mooncake": [rnd(15, ref)]},
                     "video_120x1": {"aggregated": [rnd(0.2, ref, handoff=None)],
                                     "ours_te": [rnd(0.3, ref, handoff=100.0)]}})
    view = json_view(table)
    assert set(view) == {"light", "video_120x1"}
    assert all(set(KEYS) <= set(row) for per in view.values() for row in per.values())
    assert view["light"]["ours_shm"]["answers_equal"] is True
    written = write(tmp_path / "r.json", table, {"left_out": {}})
    assert [p.name for p in written] == ["r.json", "r.details.json", "r.png"]
    assert json.loads((tmp_path / "r.json").read_text()) == json.loads(json.dumps(view))
    assert (tmp_path / "r.png").stat().st_size > 1000
    assert "ours_shm / ec_mooncake: req/s 1.33, TTFT p99 1.00" in format_table(table, {})


def test_the_mooncake_front_names_every_item_by_position_in_both_requests():
    img = {"type": "image_url", "image_url": {"url": "data:x"}, "uuid": "A"}
    vid = {"type": "video_url", "video_url": {"url": "data:y"}, "uuid": "B"}
    body = {"model": "m", "stream": True, "media_io_kwargs": {"video": {"num_frames": 8}},
            "messages": [{"role": "user", "content": [img, {"type": "text", "text": "hi"},
                                                       vid, dict(img)]}]}
    assert [p["uuid"] for p in media_parts(body)] == ["A", "B", "A"]
    items = [{"transfer_id": f"t-{i}"} for i in range(3)]
    enc = encoder_body(body, "m", "tcp://127.0.0.1:18960", items)
    assert enc["max_tokens"] == 1 and enc["media_io_kwargs"] == body["media_io_kwargs"]
    assert enc["ec_transfer_params"] == {"consumer_zmq": "tcp://127.0.0.1:18960",
                                         "ec_items": items}
    assert [p.get("uuid") for p in enc["messages"][0]["content"]] == ["A", "B", "A", None]
    answer = {"ec_transfer_params": {
        "h-img": {"item_indices": [0, 2], "metadata": {}, "transfer_id": "t-0"},
        "h-vid": {"item_indices": [1], "metadata": {"video_grid_thw": [[2, 4, 4]]},
                  "transfer_id": "t-1"}}}
    assert metadata_by_uuid(answer["ec_transfer_params"], ["A", "B", "A"]) == {
        "B": {"video_grid_thw": [[2, 4, 4]]}}
    dec = consumer_body(body, ["A", "B", "A"], answer, items)
    assert dec["ec_transfer_params"] == {"ec_items": items}
    content = dec["messages"][0]["content"]
    assert content[2] == {"type": "video_embeds", "video_embeds": {"video_grid_thw": [[2, 4, 4]]},
                          "uuid": "B"}
    assert content[0] == img and "ec_transfer_params" not in body  # the original untouched


def test_vllm_servers_of_the_rivals_run_without_our_middleware_through_the_probe(tmp_path):
    cfg = mooncake_config("ec_consumer", 18960, 1 << 28)
    assert cfg["ec_connector_extra_config"] == {"mooncake_protocol": "tcp"}
    assert cfg["ec_buffer_device"] == "cpu" and cfg["ec_port"] == 18960
    s = ProbedServer("x", tmp_path, 1, tmp_path, cfg, guard=False)
    cmd = s.command()
    assert "benchmarks.rival_probe" in cmd and "--middleware" not in cmd
    assert "--middleware" in ProbedServer("y", tmp_path, 1, tmp_path, None).command()


def test_vllm_bench_serve_results_become_a_run():
    result = {"duration": 4.0, "ttfts": [0.1, 0.0, 0.3], "errors": ["", "boom", ""],
              "generated_texts": ["a b", "", "c"]}
    r = read_vllm_bench(result, 1.0, 5.0)
    assert r.answers == ["a b", None, "c"] and r.ttft == [0.1, None, 0.3]
    assert r.errors == ["boom"] and r.duration_s == 4.0
    assert summarize(r, None)["req_per_s"] == 0.5
