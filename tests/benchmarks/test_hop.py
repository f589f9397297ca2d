"""benchmarks/gateway/hop.py without a run: the rows compare the gateway with vLLM's router,
and a router that cannot be installed is said and left out, not an error."""

from __future__ import annotations

from benchmarks.gateway import hop
from benchmarks.harness import router


def test_the_gateway_is_judged_against_the_router_and_missing_fronts_are_dashes():
    rounds = {"direct": [0.001, 0.001], "router": [0.0013, 0.0015],
              "gateway": [0.0012, 0.0013], "bare": [0.0011, 0.0011],
              "gw:base": [0.0016, 0.0017]}
    row = hop.summarize(20.0, rounds)
    assert round(row["router_added_ms"], 3) == 0.4
    assert round(row["gateway_added_ms"], 3) == 0.25
    assert round(row["ratio"], 3) == 0.625 and "nginx_added_ms" not in row
    assert round(row["gw:base_added_ms"], 3) == 0.65
    text = hop.format_rows([row], 2, 10)
    assert "at or below the router" in text and "gw:base +0.650" in text
    slower = hop.summarize(0.0, {**rounds, "gateway": [0.0016, 0.0016]})
    assert "above the router" in hop.format_rows([slower], 2, 10)
    alone = hop.summarize(0.0, {"direct": [0.001], "gateway": [0.0012]})
    assert "no router to compare" in hop.format_rows([alone], 1, 10)


def test_a_router_that_cannot_be_installed_is_skipped_with_a_reason(tmp_path, capsys):
    env = tmp_path / "not-a-directory"
    env.write_text("")  # no environment can be made here
    assert router.router_binary(env) is None
    assert "could not be installed" in capsys.readouterr().err
    exe = tmp_path / "made" / "bin" / "vllm-router"
    exe.parent.mkdir(parents=True)
    exe.write_text("")
    assert router.router_binary(tmp_path / "made") == exe  # made once, reused
