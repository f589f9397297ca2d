"""What tracing costs the gateway (encoder_service/gateway/telemetry/tracing.py), two ways:

1. In process: the work one traced request adds on the event loop (its trace started, the
   spans of a request with one image recorded, traceparent formatted for three upstream
   calls, the trace handed to the exporter), and what the export thread then spends on it
   (ReadableSpans, OTLP protobuf, one POST per batch to a receiver in another process).
2. One gateway in this process, its tracer switched on and off between interleaved rounds of
   the same requests: the CPU time of its event loop thread and of the export thread.
3. End to end: two gateway processes in front of the same stand-in encoder and decode
   instance (benchmarks/harness/processes.py), one with tracing off, one exporting every span
   to an OTLP/HTTP receiver (epd_testkit/trace_sink.py) in a process of its own; the same
   one-image requests sent to each in interleaved rounds. Per request: client-side latency
   (median of the rounds' medians) and each gateway's own CPU time (its process, export thread
   included).

    .venv/bin/python -m benchmarks.gateway.tracing [--requests 200] [--rounds 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import psutil

from benchmarks.harness.env import ROOT, pythonpath_env
from benchmarks.harness.processes import GatewayProcess, StandIn, start_gateway
from encoder_service.gateway.config import GatewayConfig, TracingConfig
from encoder_service.gateway.server import GatewayThread
from encoder_service.gateway.telemetry import tracing
from encoder_service.gateway.telemetry.tracing import Tracer, inject
from encoder_service.local.processes import default_work_dir
from encoder_service.local.requests import chat_body, sample_image_png

PORT = 20960  # sink 20960, encoder 20961, decode 20962, gateways 20963 (off), 20964 (on),
# 20965 (toggled, in this process)
MODEL = "tiny-llava"


def _one_traced_request(tracer: Tracer) -> None:
    """What chat.py records for a request with one encoded image (tracing on)."""
    item = SimpleNamespace(item_id="item-0", modality="image")
    outcome = SimpleNamespace(landed={}, shared_ids=[], hints={"item-0": None})
    scope = {"path": "/v1/chat/completions", "headers": [(b"host", b"x"),
                                                         (b"content-type", b"json")]}
    trace = tracer.start(scope)
    trace.attrs["epd.request_id"] = "r"
    t = time.perf_counter()
    trace.add("epd.parse", t, t)
    span = trace.begin_items()
    headers: dict[str, str] = {}
    call = tracing.call("epd.encoder_call", headers, {"server.address": "e"})
    assert call is not None
    call.done(**{"http.response.status_code": 200})
    trace.items(span, t, [item], set(), outcome, lambda _: "e")
    decode = trace.open_decode()
    inject(headers)
    decode.attrs.update({"server.address": "d", "epd.retries": 0,
                         "http.response.status_code": 200})
    trace.decoding()
    trace.relayed(t, time.perf_counter(), "d", {"items": 1, "hits": 0})
    trace.status = 200
    trace.finish()


def in_process(sink_url: str, n: int) -> dict[str, float]:
    """CPU us per request (median of 5 runs of `n`): on the event loop (recording), on the
    export thread (encoding and POSTing)."""
    tracer = Tracer(TracingConfig(otlp_traces_endpoint=sink_url, max_queued_spans=10 ** 7),
                    thread=False)  # exported by flush() only: the two costs apart
    try:
        for _ in range(200):  # warm up
            _one_traced_request(tracer)
        tracer.flush()
        record, export = [], []  # this thread's CPU time (the sink runs elsewhere)
        for _ in range(5):
            t = time.thread_time()
            for _ in range(n):
                _one_traced_request(tracer)
            record.append((time.thread_time() - t) / n)
            t = time.thread_time()
            tracer.flush()  # OTLP batches of 512 spans, one POST each
            export.append((time.thread_time() - t) / n)
        return {"record_us": statistics.median(record) * 1e6,
                "export_us": statistics.median(export) * 1e6,
                "failed_spans": float(tracer.failed)}
    finally:
        tracer.close()


def _threads(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of `pid`."""
    return {t.id: t.user_time + t.system_time for t in psutil.Process(pid).threads()}


def end_to_end(gws: dict[str, GatewayProcess], requests: int, rounds: int
               ) -> dict[str, dict[str, float]]:
    body = chat_body(MODEL, sample_image_png(seed=7), "x")
    lat: dict[str, list[float]] = {k: [] for k in gws}
    cpu: dict[str, dict[int, float]] = {k: {} for k in gws}  # thread -> CPU seconds
    with httpx.Client(timeout=30) as client:
        for gw in gws.values():  # warm up both
            for _ in range(50):
                client.post(gw.url + "/v1/chat/completions", json=body).raise_for_status()
        for r in range(rounds):
            order = list(gws) if r % 2 == 0 else list(reversed(gws))
            for name in order:
                gw = gws[name]
                times = []
                c0 = _threads(gw.proc.pid)
                for _ in range(requests):
                    t = time.perf_counter()
                    client.post(gw.url + "/v1/chat/completions",
                                json=body).raise_for_status()
                    times.append(time.perf_counter() - t)
                time.sleep(1.2)  # the traced gateway's export of this round lands in it
                for tid, c in _threads(gw.proc.pid).items():
                    cpu[name][tid] = cpu[name].get(tid, 0.0) + c - c0.get(tid, 0.0)
                lat[name].append(statistics.median(times))
    n = requests * rounds
    out = {}
    for k in gws:  # the event loop: the busiest thread; the rest: the export thread (on)
        loop = max(cpu[k].values())
        out[k] = {"p50_ms": statistics.median(lat[k]) * 1e3, "loop_ms": loop / n * 1e3,
                  "other_ms": (sum(cpu[k].values()) - loop) / n * 1e3}
    return out


def toggled(enc_url: str, dec_url: str, sink_url: str, requests: int, rounds: int
            ) -> dict[str, dict[str, float]]:
    """One gateway on a thread of this process, its tracer switched on and off between
    interleaved rounds (the same process, memory and cores for both): CPU per request of its
    event loop thread (time.thread_time() read on that thread) and of the export thread."""
    cfg = GatewayConfig.build({
        "port": PORT + 5, "model": MODEL, "encoders": [enc_url], "decoders": [dec_url],
        "routing": {"probe_interval_s": 0}, "log_level": "warning",
        "tracing": {"otlp_traces_endpoint": sink_url}})
    g = GatewayThread(cfg).start()
    flow, tracer = g.gateway.flow, g.gateway.tracer
    body = chat_body(MODEL, sample_image_png(seed=7), "x")
    loop_cpu = {"off": 0.0, "on": 0.0}
    export0 = 0.0

    def loop_time() -> float:
        done = threading.Event()
        out: list[float] = []
        g.call_soon(lambda: (out.append(time.thread_time()), done.set()))
        done.wait()
        return out[0]

    def export_time() -> float:
        tid = tracer._thread.native_id
        return next((t.user_time + t.system_time for t in psutil.Process().threads()
                     if t.id == tid), 0.0)
    try:
        with httpx.Client(timeout=30) as client:
            for _ in range(100):
                client.post(g.url + "/v1/chat/completions", json=body).raise_for_status()
            time.sleep(1.5)
            export0 = export_time()
            for r in range(rounds):
                for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                    flow.tracer = tracer if mode == "on" else None
                    t0 = loop_time()
                    for _ in range(requests):
                        client.post(g.url + "/v1/chat/completions",
                                    json=body).raise_for_status()
                    loop_cpu[mode] += loop_time() - t0
            time.sleep(1.5)  # the last spans go out
            export = export_time() - export0
    finally:
        g.stop()
    n = requests * rounds
    return {m: {"loop_ms": loop_cpu[m] / n * 1e3,
                "export_ms": (export if m == "on" else 0.0) / n * 1e3} for m in loop_cpu}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=200, help="per gateway and round")
    p.add_argument("--rounds", type=int, default=10)
    a = p.parse_args()
    work = default_work_dir(ROOT) / "trace-bench"
    sink = subprocess.Popen([sys.executable, "-m", "epd_testkit.trace_sink", "--port",
                             str(PORT), "--quiet"], env={**os.environ, **pythonpath_env()})
    url = f"http://127.0.0.1:{PORT}/v1/traces"
    enc = StandIn("encoder", PORT + 1, work).start()
    dec = StandIn("decode", PORT + 2, work).start()
    gws: dict[str, GatewayProcess] = {}
    try:
        enc.wait(30)
        dec.wait(30)
        time.sleep(0.5)
        micro = in_process(url, 2000)
        print(f"in process: {micro['record_us']:.1f} us per request on the event loop, "
              f"{micro['export_us']:.1f} us on the export thread "
              f"(failed spans: {micro['failed_spans']:.0f})", flush=True)
        base = {"routing": {"probe_interval_s": 0}}
        for name, port, extra in (("off", PORT + 3, {}),
                                  ("on", PORT + 4, {"tracing": {
                                      "otlp_traces_endpoint": url}})):
            gws[name] = start_gateway(f"gateway-{name}", port, work, model=MODEL,
                                      encoders=[enc.url], decoders=[dec.url],
                                      config={**base, **extra})
        one = toggled(enc.url, dec.url, url, a.requests, a.rounds)
        print(f"one gateway, tracing toggled ({a.rounds} interleaved rounds of {a.requests}): "
              f"event loop CPU {one['off']['loop_ms']:.3f} ms off, {one['on']['loop_ms']:.3f} "
              f"ms on ({one['on']['loop_ms'] - one['off']['loop_ms']:+.3f}); export thread "
              f"{one['on']['export_ms']:.3f} ms per traced request", flush=True)
        res = end_to_end(gws, a.requests, a.rounds)
        for name, r in res.items():
            print(f"tracing {name:>3}: p50 {r['p50_ms']:.3f} ms per request; gateway CPU per "
                  f"request: event loop {r['loop_ms']:.3f} ms, other threads "
                  f"{r['other_ms']:.3f} ms", flush=True)
        on, off = res["on"], res["off"]
        print(f"tracing on - off ({a.rounds} interleaved rounds of {a.requests}): latency "
              f"{on['p50_ms'] - off['p50_ms']:+.3f} ms, event loop CPU "
              f"{on['loop_ms'] - off['loop_ms']:+.3f} ms, other threads (export) "
              f"{on['other_ms'] - off['other_ms']:+.3f} ms per request", flush=True)
    finally:
        for gw in gws.values():
            gw.stop()
        enc.stop()
        dec.stop()
        sink.terminate()
        sink.wait(10)


if __name__ == "__main__":
    main()
