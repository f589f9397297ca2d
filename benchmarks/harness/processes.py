"""The processes benchmarks start besides vLLM's and `epd up`'s: the gateway as its own
process (as deployed), and a stand-in decode instance that answers every chat request at
once or after a delay, to measure the gateway alone. Run as a module, this is that stand-in:
`python -m benchmarks.harness.processes --port PORT [--delay-ms MS]`."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import msgspec

from benchmarks.harness.env import pythonpath_env
from encoder_service.local.processes import ManagedProcess


@dataclass
class GatewayProcess(ManagedProcess):
    """`epd gateway` as its own process (as deployed): its config keys (written beside its
    log), encoders, decode and prefill instances, the shared directory it looks items up in
    (None: none). `start_gateway` starts one and waits for it."""

    name: str
    port: int
    work_dir: Path
    model: str
    encoders: list[str] = field(default_factory=list)
    decoders: list[str] = field(default_factory=list)
    prefills: list[str] = field(default_factory=list)
    storage: Path | None = None
    config: dict = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    startup_timeout_s: ClassVar[float] = 30.0

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "encoder_service.cli", "gateway", "--port",
               str(self.port), "--model", self.model]
        if self.config:
            path = self.log_path.with_suffix(".json")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(self.config))
            cmd += ["--config", str(path)]
        for flag, urls in (("--encoder", self.encoders), ("--decoder", self.decoders),
                           ("--prefill", self.prefills)):
            cmd += [x for u in urls for x in (flag, u)]
        if self.storage is not None:
            cmd += ["--storage-path", str(self.storage)]
        return cmd


def start_gateway(name: str, port: int, work_dir: Path, *, model: str, **kw) -> GatewayProcess:
    """A `GatewayProcess` (`kw`: its other fields), started and healthy; stopped again when
    it does not come up."""
    gw = GatewayProcess(name, port, work_dir, model, **kw).start()
    try:
        gw.wait()
    except BaseException:
        gw.stop()
        raise
    return gw


def example_config(role: str, storage: Path) -> dict:
    """The `--ec-transfer-config` of a vLLM server with vLLM's ECExampleConnector
    (`role`: ec_producer or ec_consumer) on the shared directory `storage`."""
    return {"ec_connector": "ECExampleConnector", "ec_role": role, "ec_buffer_device": "cpu",
            "ec_connector_extra_config": {"shared_storage_path": str(storage)}}


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
    """A stand-in decode instance (`serve_stand_in`) in a process of its own."""

    name: str
    port: int
    work_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    delay_ms: float = 0.0

    def command(self) -> list[str]:
        return [sys.executable, "-m", "benchmarks.harness.processes", "--port",
                str(self.port), "--delay-ms", str(self.delay_ms)]

    def child_env(self) -> dict[str, str]:
        return {**os.environ, **pythonpath_env()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="a stand-in decode instance")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--delay-ms", type=float, default=0.0)
    args = p.parse_args(argv)
    serve_stand_in(args.port, args.delay_ms / 1e3)


if __name__ == "__main__":
    main()
