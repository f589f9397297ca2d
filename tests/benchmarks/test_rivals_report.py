"""The rival benchmark's logic on made-up rounds and events (benchmarks/rivals/): handoff
pairing, per-round summaries, answers against aggregated vLLM's, medians, what fails the run,
the JSON and chart, the ECMooncakeConnector front's requests, `vllm bench serve`'s result. No
server is started (the benchmark runs by hand)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.harness.report import medians
from benchmarks.rivals.mooncake_front import (
    consumer_body,
    encoder_body,
    media_parts,
    metadata_by_uuid,
)
from benchmarks.rivals.probe import Event, handoffs, parse_events, wrap_connector
from benchmarks.rivals.report import (
    KEYS,
    answers_equal,
    combine,
    failed,
    format_table,
    json_view,
    summarize,
    write,
)
from benchmarks.rivals.stacks import ProbedServer, mooncake_config
from benchmarks.rivals.workloads import Run, read_vllm_bench


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
    assert "benchmarks.rivals.probe" in cmd and "--middleware" not in cmd
    assert "--middleware" in ProbedServer("y", tmp_path, 1, tmp_path, None).command()


def test_vllm_bench_serve_results_become_a_run():
    result = {"duration": 4.0, "ttfts": [0.1, 0.0, 0.3], "errors": ["", "boom", ""],
              "generated_texts": ["a b", "", "c"]}
    r = read_vllm_bench(result, 1.0, 5.0)
    assert r.answers == ["a b", None, "c"] and r.ttft == [0.1, None, 0.3]
    assert r.errors == ["boom"] and r.duration_s == 4.0
    assert summarize(r, None)["req_per_s"] == 0.5


def test_epd_hops_come_from_the_log_lines_of_requests_that_ended_in_the_window():
    from datetime import datetime

    from benchmarks.rivals.report import hop_times

    def stamp(t: float) -> str:
        return datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]

    t0 = datetime(2026, 11, 28, 9, 0, 0).timestamp()
    lines = [  # a warm-up request, then the gateway's and the E/P/D front's formats
        f"{stamp(t0 - 5)} INFO epd.gateway request rid=w prefill_ms=900.0 first_token_ms=9.0",
        f"{stamp(t0 + 1)} INFO epd.gateway request rid=a endpoint=chat status=200 "
        "stream=True decoder=http://d dec_retries=0 encode_ms=20.0 prefill=http://p "
        "prefill_ms=100.0 kv_handoff=ok first_token_ms=50.0 total_ms=180.0",
        f"{stamp(t0 + 2)} INFO epd.rival_front request rid=b encode_ms=30.0 "
        "prefill_ms=300.0 first_token_ms=70.0 total_ms=400.0",
        f"{stamp(t0 + 3)} INFO epd.rival_front request rid=c prefill_ms=200.0 "
        "first_token_ms=- total_ms=5.0",
        "a torn line prefill_ms=1",
    ]
    got = hop_times(lines, t0, t0 + 10)
    assert got == {"encode_ms": 25.0, "prefill_ms": 200.0, "kv_first_token_ms": 60.0}
    assert hop_times(lines, t0 + 20, t0 + 30) == {}


def test_the_epd_front_sends_vllms_proxy_requests():
    from benchmarks.rivals.epd_front import (
        decode_body,
        encoder_body,
        has_mm_input,
        prefill_body,
    )

    img = {"type": "image_url", "image_url": {"url": "data:x"}}
    body = {"model": "m", "stream": True, "stream_options": {"include_usage": True},
            "max_completion_tokens": 16, "ignore_eos": True,
            "messages": [{"role": "user", "content": [img, {"type": "text", "text": "hi"}]}]}
    text = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert has_mm_input(body) and not has_mm_input(text)
    enc = encoder_body(body)
    assert enc["max_tokens"] == 1 and enc["max_completion_tokens"] == 1
    assert not enc["stream"] and "stream_options" not in enc
    assert enc["messages"] == body["messages"] and "kv_transfer_params" not in enc
    pre = prefill_body(body)
    assert pre["kv_transfer_params"]["do_remote_decode"] is True and pre["max_tokens"] == 1
    params = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1]}
    dec = decode_body(body, {"choices": [], "kv_transfer_params": params})
    assert dec["kv_transfer_params"] == params and dec["stream"] is True
    assert dec["max_completion_tokens"] == 16 and "kv_transfer_params" not in body
    assert "kv_transfer_params" not in decode_body(body, {"choices": []})


def test_text_only_deployments_run_the_text_cases_and_aggregated_both():
    from benchmarks.rivals.run import parse_args, runners

    a = parse_args(["--epd", "--workloads", "light", "distinct", "video"])
    assert a.deployments == ["aggregated", "vllm_epd", "ours_epd", "vllm_pd_text",
                             "vllm_pd_router"]
    cases = {d: [c for wl in ("light", "video") for _, cs in runners(d, wl, a) for c in cs]
             for d in a.deployments}
    assert cases["vllm_pd_text"] == cases["vllm_pd_router"] == ["light_text"]
    assert cases["aggregated"][:2] == ["light", "light_text"]
    assert cases["vllm_epd"][0] == "light" and "light_text" not in cases["ours_epd"]
    b = parse_args(["--deployments", "aggregated", "ours_epd"])
    assert [cs for _, cs in runners("aggregated", "light", b)] == [["light"]]


def test_ours_epd_is_set_beside_vllms_epd_with_its_hops():
    from benchmarks.rivals.report import OURS, ratio_lines

    assert "ours_epd" in OURS
    row = {"req_per_s": 10.0, "ttft_p99_ms": 100.0, "handoff_ms": None,
           "decode_cpu_ms_per_req": 5.0, "prefill_ms": 50.0, "kv_first_token_ms": 20.0}
    lines = ratio_lines({"ours_epd": row, "vllm_epd": {**row, "req_per_s": 5.0,
                                                        "prefill_ms": 100.0}})
    assert lines == ["  ours_epd / vllm_epd: req/s 2.00, TTFT p99 1.00, handoff -, decode "
                     "CPU 1.00, prefill_ms 0.50, kv_first_token_ms 1.00"]
    assert ratio_lines({"ours_epd": row, "ec_example": row}) == []


def test_vllms_router_fronts_vllms_p_d_or_is_left_out_with_its_reason(tmp_path, monkeypatch):
    """vllm_pd_router puts vLLM's Rust router in its P/D mode (NIXL) before the P/D
    instances; where the router cannot be installed the deployment is left out, said why,
    before any server starts."""
    from benchmarks.harness.router import RouterProcess
    from benchmarks.rivals import stacks

    cmd = RouterProcess("r", 9000, tmp_path, Path("/x/vllm-router"), [
        "--vllm-pd-disaggregation", "--prefill", "http://p", "--decode", "http://d"]).command()
    assert cmd[:5] == ["/x/vllm-router", "--host", "127.0.0.1", "--port", "9000"]
    assert cmd[cmd.index("--prefill") + 1] == "http://p" and "--vllm-pd-disaggregation" in cmd
    monkeypatch.setattr(stacks, "router_binary", lambda env: None)
    started = []
    monkeypatch.setattr(stacks, "_vllm", lambda *a, **k: started.append(a))
    with pytest.raises(stacks.Unsupported, match="vllm-router could not be installed"):
        stacks.start_vllm_epd("vllm_pd_router", stacks.GROUPS["llava"], tmp_path, tmp_path,
                              tmp_path, print)
    assert not started
