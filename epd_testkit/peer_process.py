"""A standalone transport peer driven by JSON lines on stdin (tests, benchmarks, debugging).

    python -m epd_testkit.peer_process
    {"op": "init", "config": {"transport": "mooncake", "host": "127.0.0.1"},
     "placement": {"is_producer": true, "is_consumer": false}}
    {"op": "put", "id": "img-1", "seed": 1, "shape": [4096, 4096], "dtype": "bfloat16"}
        (+ "device": "cuda", "pinned": bool: the item starts on the GPU, host copy timed)
    {"op": "get", "id": "img-1", "timeout_s": 5, "location": "127.0.0.1:15500"}
        (+ "to_device": "cuda": then copied to the GPU, timed apart as to_device_s)
    {"op": "get_many", "ids": ["img-1", "img-2"], "timeout_s": 5}
    {"op": "get_small", "id": "img-1", "max_bytes": 262144}   (a consumer scheduler's read)
    {"op": "memcpy", "seed": 1, "shape": [4096, 4096], "dtype": "bfloat16"}   (the put's
        tensor, made the same way, copied into warm memory: a put's yardstick)
    {"op": "probe", "id": "img-1"}          (scheduler-style lookup, polled until it answers)
    {"op": "tamper", "id": "img-1"}         (mooncake_store: flip one stored payload byte)
    {"op": "save_failed", "id": "img-1"}    (announce a failed save, as the worker does)
    {"op": "expect", "id": "img-1"}         (a save is queued, as the worker's save() says)
    {"op": "health"}
    {"op": "quit"}

Each command gets one JSON line back ({"ok": true, ...} or {"ok": false, "error": ...}).
Tensors are generated from a seed, so two processes agree on the expected bytes without
shipping them; answers carry the xxh3 checksum of what was stored or received.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from typing import Any

import torch

from ec_connectors.config import EPDConfig
from ec_connectors.transports import Placement, Transport, make_transport
from ec_connectors.transports.base import (
    Want,
    checksum,
    dtype_from_name,
    host_copy,
    tensor_bytes,
)
from epd_common import child_process

# This package is not installed (a clone's test support): the peer finds it through the
# repository root on its path, wherever the caller's working directory is.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ROOT_ON_PATH = {"PYTHONPATH": os.pathsep.join(
    p for p in (_ROOT, os.environ.get("PYTHONPATH", "")) if p)}


def seeded_tensor(seed: int, shape: list[int], dtype: str) -> torch.Tensor:
    """Deterministic content for `seed` (same bytes in every process)."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * torch.empty((), dtype=dtype_from_name(dtype))
                                 .element_size(),), dtype=torch.uint8, generator=g)
    return raw.view(dtype_from_name(dtype)).view(shape)


def _put(transport: Transport, cmd: dict[str, Any]) -> dict[str, Any]:
    tensor = seeded_tensor(cmd["seed"], cmd["shape"], cmd["dtype"])
    if cmd.get("device"):  # an encoder output on a GPU: the worker's host copy is timed
        tensor = tensor.to(cmd["device"])
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    if cmd.get("device"):
        tensor = host_copy(tensor, pinned=cmd.get("pinned", True))
    t1 = time.perf_counter()
    info = transport.put(cmd["id"], tensor)
    t2 = time.perf_counter()
    # "checksum": xxh3 of the bytes, as get's (what a test compares); "digest": the
    # transport's own (its format is the transport's)
    return {"put_s": t2 - t0, "host_copy_s": t1 - t0, "nbytes": info.nbytes,
            "checksum": checksum(tensor_bytes(host_copy(tensor).cpu())),
            "digest": info.checksum, "location": info.location}


def _get(transport: Transport, cmd: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    out = transport.get(cmd["id"], time.monotonic() + cmd.get("timeout_s", 5.0),
                        location=cmd.get("location", ""), nbytes=cmd.get("nbytes", 0))
    elapsed = time.perf_counter() - t0
    if out is None:
        return {"found": False, "get_s": elapsed}
    to_device_s = 0.0
    if cmd.get("to_device"):  # what the worker's staging does on a GPU consumer
        t1 = time.perf_counter()
        out = out.to(cmd["to_device"])
        torch.cuda.synchronize()
        to_device_s = time.perf_counter() - t1
    return {"found": True, "get_s": elapsed, "to_device_s": to_device_s,
            "shape": list(out.shape),
            "dtype": str(out.dtype).removeprefix("torch."), "device": str(out.device),
            "checksum": checksum(tensor_bytes(out.cpu()))}


def handle(state: dict[str, Any], cmd: dict[str, Any]) -> dict[str, Any]:
    op = cmd.get("op")
    transport: Transport | None = state.get("transport")
    if op == "init":
        config = EPDConfig.from_dict(cmd.get("config"))
        transport = make_transport(config, Placement(**cmd.get("placement", {})))
        state["transport"] = transport
        return {"endpoint": transport.endpoint,
                "session": getattr(transport, "session", "")}
    if op == "memcpy":  # a put's yardstick: the same fresh tensor, copied into warm memory
        tensor = seeded_tensor(cmd["seed"], cmd["shape"], cmd["dtype"]).reshape(-1)
        raw = tensor.view(torch.uint8)
        dst = state.setdefault("memcpy_dst", {}).get(raw.numel())
        if dst is None:
            dst = state["memcpy_dst"][raw.numel()] = torch.ones_like(raw)
        t0 = time.perf_counter()
        dst.copy_(raw)
        return {"memcpy_s": time.perf_counter() - t0}
    if transport is None:
        raise RuntimeError("send init first")
    if op == "put":
        return _put(transport, cmd)
    if op == "get":
        return _get(transport, cmd)
    if op == "get_many":
        t0 = time.perf_counter()
        outs = transport.get_many([Want(i) for i in cmd["ids"]],
                                  time.monotonic() + cmd.get("timeout_s", 5.0),
                                  wait=cmd.get("wait", True))
        return {"get_s": time.perf_counter() - t0,
                "checksums": [None if t is None else checksum(tensor_bytes(t.cpu()))
                              for t in outs]}
    if op == "get_small":
        out = transport.get_small(cmd["id"], cmd.get("max_bytes", 1 << 18))
        return {"found": out is not None,
                "checksum": None if out is None else checksum(tensor_bytes(out))}
    if op == "probe":
        deadline = time.monotonic() + cmd.get("timeout_s", 5.0)
        while (found := transport.probe(cmd["id"])) is None and time.monotonic() < deadline:
            time.sleep(0.005)
        return {"found": found, "exists": transport.exists(cmd["id"])}
    if op == "save_failed":
        transport.save_failed(cmd["id"], cmd.get("reason", "test"))
        return {}
    if op == "expect":
        transport.expect(cmd["id"])
        return {}
    if op == "tamper":
        return {"tampered": _tamper(transport, cmd["id"])}
    if op == "health":
        return {"health": transport.health(), "events": transport.events.counters()}
    raise ValueError(f"unknown op {op!r}")


def _tamper(transport: Transport, item_id: str) -> bool:
    """Flip the last byte of a stored store object (what a bad disk or a bug would do)."""
    store = transport.client.store  # type: ignore[attr-defined]
    key = transport.key(item_id)  # type: ignore[attr-defined]
    size = store.get_size(key)
    if size <= 0:
        return False
    buf = transport.pool.allocate(size, time.monotonic() + 5)  # type: ignore[attr-defined]
    try:
        if store.get_into(key, buf.addr, size) != size:
            return False
        buf.as_bytes()[size - 1] ^= 0xFF
        return store.upsert_from(key, buf.addr, size) == 0
    finally:
        buf.release()


class PeerClient:
    """Drive a transport peer process over its stdin.

    Drives a peer process: `call({"op": ...}, timeout_s)` -> its answer (raises on error
    or when no answer comes in time). `prefix` runs it elsewhere, e.g. ["ip", "netns",
    "exec", "ns1"]."""

    def __init__(self, prefix: list[str] | None = None, env: dict[str, str] | None = None,
                 log_path: str | None = None, ready_timeout_s: float = 60.0) -> None:
        self._log = open(log_path or os.devnull, "ab")  # noqa: SIM115 - closed in close()
        # dies with this thread even if this process is SIGKILLed (create clients from a
        # long-lived thread: epd_common.child_process)
        self.proc = child_process.popen(
            [*(prefix or []), sys.executable, "-m", "epd_testkit.peer_process"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            env={**os.environ, **_ROOT_ON_PATH, **(env or {})}, text=True, bufsize=1,
            start_new_session=True)
        self._lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        threading.Thread(target=self._read, daemon=True).start()
        self._next(ready_timeout_s)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self._lines.put(line)
        self._lines.put(None)

    def _next(self, timeout_s: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"peer gave no answer in {timeout_s} s") from None
        if line is None:
            raise RuntimeError(f"peer exited (rc={self.proc.poll()})")
        return json.loads(line)

    def send(self, cmd: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def call(self, cmd: dict[str, Any], timeout_s: float = 60.0) -> dict[str, Any]:
        self.send(cmd)
        return self.result(timeout_s)

    def result(self, timeout_s: float = 60.0) -> dict[str, Any]:
        reply = self._next(timeout_s)
        if not reply.get("ok"):
            raise RuntimeError(f"peer error: {reply.get('error')}")
        return reply

    def close(self, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"op": "quit"})
                self.proc.wait(timeout_s)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


def main() -> int:
    state: dict[str, Any] = {}
    print(json.dumps({"ok": True, "ready": True}), flush=True)
    for line in sys.stdin:
        try:
            cmd = json.loads(line)
            if cmd.get("op") == "quit":
                break
            reply = {"ok": True, **handle(state, cmd)}
        except Exception as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)
    transport = state.get("transport")
    if transport is not None:
        transport.close()
    print(json.dumps({"ok": True, "closed": True}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
