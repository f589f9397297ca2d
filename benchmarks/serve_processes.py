"""The serving benchmark's processes besides vLLM's (benchmarks/serve_bench.py): the gateway
as its own process, as deployed, and a stand-in decode instance that answers every chat
request at once or after a delay, to measure the gateway alone. Run as a script, this file is
that stand-in: `serve_processes.py --port PORT [--delay-ms MS]`."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from encoder_service.local.processes import ManagedProcess  # noqa: E402
from epd_common.child_process import popen  # noqa: E402


class GatewayProcess:
    """`epd gateway` as its own process (as deployed), stopped with SIGTERM."""

    def __init__(self, port: int, encoders: list[str], decoders: list[str],
                 storage: Path | None, log: Path, config: dict | None = None, *,
                 model: str) -> None:
        cmd = [sys.executable, "-m", "encoder_service.cli", "gateway", "--port", str(port),
               "--model", model]
        if config:
            path = log.with_suffix(".json")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(config))
            cmd += ["--config", str(path)]
        cmd += [x for u in encoders for x in ("--encoder", u)]
        cmd += [x for u in decoders for x in ("--decoder", u)]
        if storage is not None:
            cmd += ["--storage-path", str(storage)]
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"gateway did not become healthy; log {log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


_STAND_IN_ANSWER = msgspec.json.encode({
    "id": "stand-in", "object": "chat.completion", "model": "stand-in",
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "ok"}}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


def serve_stand_in(port: int, delay_s: float = 0.0) -> None:
    """A decode instance that answers every chat request after `delay_s`."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    async def chat(request):
        await request.body()
        if delay_s:
            await asyncio.sleep(delay_s)
        return Response(_STAND_IN_ANSWER, media_type="application/json")

    async def ok(request):
        return Response(b"{}", media_type="application/json")

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                            Route("/health", ok)])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error")


@dataclass
class StandIn(ManagedProcess):
    """This file as a stand-in decode instance (`serve_stand_in`) in a process of its own."""

    name: str
    port: int
    work_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    delay_ms: float = 0.0

    def command(self) -> list[str]:
        return [sys.executable, __file__, "--port", str(self.port),
                "--delay-ms", str(self.delay_ms)]


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="a stand-in decode instance")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--delay-ms", type=float, default=0.0)
    args = p.parse_args()
    serve_stand_in(args.port, args.delay_ms / 1e3)
