"""The serving benchmark's report (benchmarks/serving/serve_report.py), on made-up results:
no server is started (the benchmark itself starts vLLM and runs by hand)."""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks.serving.serve_report import (
    EPD,
    EXAMPLE,
    format_cpu,
    format_overhead,
    summary_medians,
)


def result(**summary):
    return SimpleNamespace(summary=summary)


def test_medians_take_every_number_over_the_repetitions_and_skip_the_rest():
    runs = [{EPD: result(req_per_s=10.0, errors=0, stages_ms={"x": 1}),
             EXAMPLE: result(req_per_s=8.0)},
            {EPD: result(req_per_s=30.0, errors=2), EXAMPLE: result(req_per_s=6.0)},
            {EPD: result(req_per_s=20.0), EXAMPLE: result(req_per_s=7.0)}]
    assert summary_medians(runs) == {EPD: {"req_per_s": 20.0, "errors": 1.0},
                             EXAMPLE: {"req_per_s": 7.0}}


def test_cpu_line_splits_api_server_and_engine_and_lists_core_shares():
    text = format_cpu({EPD: {"cpu_ms_decode": 5.0, "cpu_ms_decode_api": 2.0,
                             "cpu_ms_gateway": 1.5, "busy_core0": 0.9, "busy_core1": 0.5}})
    assert text.splitlines()[1] == (f"  {EPD}: decode 5.00 (2.00 + 3.00), gateway 1.50; "
                                    "cores busy 0.90 / 0.50")


def test_overhead_line_names_the_target():
    line = format_overhead({"samples": 40, "direct_p50_ms": 1.0, "gateway_p50_ms": 1.75,
                            "added_p50_ms": 0.75, "paired_median_added_ms": 0.7})
    assert "40 interleaved pairs" in line and "added 0.75 ms" in line and "< 1 ms" in line
