"""What a load run measures besides its requests: each server's CPU per request and each
core's busy share (`CpuMeter`), a warm-up (`warm`), and the mean time of every stage of a
request from the gateway's and the servers' /metrics (`stage_means`)."""

from __future__ import annotations

from collections.abc import Sequence

import httpx
import psutil

from encoder_service.local.processes import ManagedProcess, metric_value
from encoder_service.local.requests import chat_body, sample_image_png


class CpuMeter:
    """CPU time per request of each server (its process tree: for a vLLM server the API
    server, `api`, and EngineCore, the rest) and each core's busy share, over the measured
    run. Where a deployment's req/s comes from: a core at 1.00 is the bound, and the ms per
    request on it say whose work fills it."""

    def __init__(self, servers: dict[str, int]) -> None:
        self.servers = servers  # name -> root pid

    @staticmethod
    def _tree(pid: int) -> tuple[float, float]:
        """(root, children) CPU seconds of a process tree (children gone: not counted)."""
        root = psutil.Process(pid)
        kids = 0.0
        for ch in root.children(recursive=True):
            try:
                t = ch.cpu_times()
                kids += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        t = root.cpu_times()
        return t.user + t.system, kids

    def _snap(self) -> tuple[dict[str, tuple[float, float]], list]:
        return ({n: self._tree(p) for n, p in self.servers.items()},
                psutil.cpu_times(percpu=True))

    def start(self) -> None:
        self.t0 = self._snap()

    def stop(self, requests: int) -> dict[str, float]:
        """Flat numbers (medians are taken over repetitions): `cpu_ms_<server>` and
        `cpu_ms_<server>_api` per request, `busy_core<i>`."""
        (s0, c0), (s1, c1) = self.t0, self._snap()
        out: dict[str, float] = {}
        for name in self.servers:
            (r0, k0), (r1, k1) = s0[name], s1[name]
            out[f"cpu_ms_{name}"] = round(((r1 - r0) + (k1 - k0)) * 1e3 / requests, 2)
            if k1 - k0 > 0:
                out[f"cpu_ms_{name}_api"] = round((r1 - r0) * 1e3 / requests, 2)
        for i, (a, b) in enumerate(zip(c0, c1, strict=True)):
            total = sum(b) - sum(a)
            idle = (b.idle + getattr(b, "iowait", 0)) - (a.idle + getattr(a, "iowait", 0))
            out[f"busy_core{i}"] = round(1 - idle / total, 2) if total > 0 else 0.0
        return out


def warm(url: str, model: str, n: int = 4) -> None:
    """`n` image requests (images no measured run sends), one after another."""
    with httpx.Client(timeout=120) as c:
        for i in range(n):
            r = c.post(url + "/v1/chat/completions",
                       json=chat_body(model, sample_image_png(seed=90_000 + i), "warm up",
                                      max_tokens=4))
            r.raise_for_status()


CONNECTOR_STAGES = ("save_wait", "save", "loader_wait", "get", "load", "staged_to_scheduled",
                    "defer", "pending")
# vLLM's own view of a request on each server (queued, then prefill, end to end): the
# gateway's encode / first_token stage minus these is HTTP, the API server and the gateway.
VLLM_STAGES = ("request_queue_time", "request_prefill_time", "e2e_request_latency")
GATEWAY_STAGES = ("parse", "encode", "prefill", "first_token", "total")  # prefill: E/P/D


def stage_means(gw_url: str, servers: Sequence[ManagedProcess]) -> dict[str, dict[str, float]]:
    """Mean milliseconds per stage over the run, from /metrics: the gateway's
    `epd_gateway_stage_seconds{stage}`, each server's `vllm:epd_<stage>_seconds` and
    vLLM's own request stages (VLLM_STAGES)."""
    out: dict[str, dict[str, float]] = {}
    with httpx.Client(timeout=10) as c:
        text = c.get(gw_url + "/metrics").text
        out["gateway"] = {}
        for st in GATEWAY_STAGES:
            n = metric_value(text, f'epd_gateway_stage_seconds_count{{stage="{st}"}}')
            if n:
                total = metric_value(text, f'epd_gateway_stage_seconds_sum{{stage="{st}"}}')
                out["gateway"][st] = round(total / n * 1e3, 2)
        for s in servers:
            text = c.get(s.url + "/metrics").text
            out[s.name] = {}
            names = [(st, f"vllm:epd_{st}_seconds") for st in CONNECTOR_STAGES]
            names += [(st, f"vllm:{st}_seconds") for st in VLLM_STAGES]
            for st, metric in names:
                n = metric_value(text, f"{metric}_count")
                if n:
                    out[s.name][st] = round(metric_value(text, f"{metric}_sum") / n * 1e3, 2)
    return out
