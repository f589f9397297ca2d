"""`epd bench serve`: workload shape and the figures it reports, against a small streaming
stand-in server over real HTTP (the benchmark itself drives real vLLM servers)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import sys
import threading
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from encoder_service.bench import (
    BenchResult,
    BenchSpec,
    Record,
    _Progress,
    format_table,
    image_sequence,
    item_part,
    main,
    parse_mix,
    plot,
    run_bench,
    summarize,
)
from tests.helpers import free_port, port_block


def test_zipf_sequences_favour_the_first_images():
    seq = image_sequence(BenchSpec(url="x", num_requests=2000, distinct_images=50, zipf=1.1))
    counts = [seq.count(k) for k in range(50)]
    assert set(seq) <= set(range(50)) and counts[0] > 5 * counts[20] > 0
    assert seq == image_sequence(BenchSpec(url="x", num_requests=2000, distinct_images=50,
                                           zipf=1.1))  # seeded


@pytest.mark.parametrize("n,reuse", [(200, 0.5), (10, 0.0), (50, 0.9)])
def test_image_sequence_has_the_requested_reuse(n, reuse):
    seq = image_sequence(BenchSpec(url="x", num_requests=n, reuse=reuse))
    distinct = max(1, round(n * (1 - reuse)))
    assert len(seq) == n and len(set(seq)) == distinct
    seen: set[int] = set()
    for i in seq:  # new images appear in order; reuses only point back
        assert i in seen or i == len(seen)
        seen.add(i)
    assert seq == image_sequence(BenchSpec(url="x", num_requests=n, reuse=reuse))


def test_summary_percentiles_and_tpot():
    recs = [Record(image=0, ok=True, start=0, ttft=t / 1e3, e2e=(t + 30) / 1e3, tokens=4)
            for t in range(1, 101)] + [Record(image=0, ok=False, start=0, error="x")]
    s = summarize(recs, duration_s=10.0)
    assert s["ok"] == 100 and s["errors"] == 1 and s["req_per_s"] == 10.0
    assert s["ttft_ms_p50"] == pytest.approx(50.5)
    assert s["tpot_ms_p50"] == pytest.approx(10.0)  # 30 ms over 3 inter-token gaps
    assert "errors" in format_table({"a": s})


@contextlib.contextmanager
def _stub_server(seen: list[str]):
    """A streaming chat server on a free port that answers max_tokens "x" tokens."""

    async def chat(request: Request):
        body = await request.json()
        seen.append(body["messages"][0]["content"][0]["image_url"]["url"][-40:])

        async def gen():
            yield 'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n'
            for _ in range(body["max_tokens"]):
                await asyncio.sleep(0.002)
                yield 'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
            usage = {"completion_tokens": body["max_tokens"]}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(gen(), media_type="text/event-stream")

    port = free_port(iter(port_block(__name__)))
    server = uvicorn.Server(uvicorn.Config(Starlette(routes=[
        Route("/v1/chat/completions", chat, methods=["POST"])]), port=port, log_level="error"))
    server.install_signal_handlers = lambda: None
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "stub server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True


def test_run_bench_measures_a_streaming_server(tmp_path):
    seen: list[str] = []
    with _stub_server(seen) as url:
        spec = BenchSpec(url=url, num_requests=20, concurrency=4, reuse=0.5, max_tokens=5)
        res = asyncio.run(run_bench(spec, progress=False))
    s = res.summary
    assert s["ok"] == 20 and s["errors"] == 0
    assert len(set(seen)) == 10  # 50% reuse: 10 distinct images sent
    assert 2 <= s["tpot_ms_p50"] < 50 and s["ttft_ms_p50"] < s["e2e_ms_p50"]
    if plot({"stub": res}, tmp_path / "p.png"):
        assert (tmp_path / "p.png").stat().st_size > 5000
    else:  # without the [bench] extra
        assert importlib.util.find_spec("matplotlib") is None


def test_without_the_bench_extra_progress_is_plain_lines_and_no_plot(monkeypatch, capsys,
                                                                     tmp_path):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm -> ImportError
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    bar = _Progress(20, "run")
    for _ in range(20):
        bar.update(1)
    bar.close()
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "run: 20 requests (install epd-serve[bench] for a progress bar)"
    assert err[1].startswith("run: 1/20 requests") and err[-1].startswith("run: 20/20 requests")
    assert len(err) == 12  # the header, then one line per tenth (and the first)
    res = BenchResult(spec={}, duration_s=1.0, summary={"req_per_s": 1.0})
    assert plot({"run": res}, tmp_path / "p.png") is False
    assert not (tmp_path / "p.png").exists()
    assert "install epd-serve[bench] for the plot" in capsys.readouterr().err


def test_mix_gives_each_item_a_seeded_modality():
    mix = parse_mix("image=2,video=1,audio=1")
    assert mix == {"image": 2.0, "video": 1.0, "audio": 1.0}
    spec = BenchSpec(url="x", mix=mix)
    kinds = [item_part(spec, i)[0] for i in range(60)]
    assert set(kinds) == {"image", "video", "audio"}
    assert kinds.count("image") > kinds.count("audio")
    assert [item_part(spec, i) for i in range(5)] == [item_part(spec, i) for i in range(5)]
    assert item_part(spec, 0) != item_part(spec, 1)
    for bad in ("image=x", "smell=1", "image=0", "image=-1,video=2"):
        with pytest.raises(ValueError, match="--mix"):
            parse_mix(bad)


def test_serve_writes_its_output_under_the_work_directory_not_the_working_one(
        tmp_path, monkeypatch):
    """A run from a checkout's root must not leave bench-serve.* there (they were committed
    once): by default they go to $EPD_WORK_DIR (else ./.work)/bench/."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("EPD_WORK_DIR", raising=False)
    with _stub_server([]) as url:
        rc = main(["serve", "--url", url, "--num-requests", "4", "--concurrency", "2",
                   "--max-tokens", "2", "--no-progress"])
    assert rc == 0
    assert not list(tmp_path.glob("bench-serve*"))
    runs = json.loads((tmp_path / ".work" / "bench" / "bench-serve.json").read_text())["runs"]
    assert runs["run"]["summary"]["ok"] == 4
    monkeypatch.setenv("EPD_WORK_DIR", str(tmp_path / "w"))
    with _stub_server([]) as url:
        assert main(["serve", "--url", url, "--num-requests", "2", "--max-tokens", "2",
                     "--no-progress"]) == 0
    assert (tmp_path / "w" / "bench" / "bench-serve.json").is_file()
