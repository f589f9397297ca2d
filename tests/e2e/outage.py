"""Helpers of the end-to-end tests that kill servers under `epd up` (its supervision: a killed
server is restarted, the gateway drops it meanwhile): the session of a server (its API
server leads it; vLLM's EngineCore and workers are in it), traffic through the gateway during
an outage with every answer checked, the wait for an instance to be back."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

import httpx

from encoder_service.local.requests import chat_body, sample_image_png
from epd_common.child_process import session_members
from tests.e2e.client import MODEL_NAME, PROMPT, answer
from tests.helpers import descendants, wait_for

BACK_WITHIN_S = 120.0  # a killed instance serves again within this (supervise.py)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def server_session(up_pid: int, port: int) -> int:
    """The session of the `epd up` server listening on `port`: its API server's pid (it
    leads its own session)."""
    for pid in descendants(up_pid):
        with contextlib.suppress(OSError):
            if f"--port\0{port}\0".encode() in _cmdline(pid) and os.getsid(pid) == pid:
                return pid
    raise AssertionError(f"no server of epd up on :{port}")


def engine_core(sid: int) -> int:
    """vLLM's EngineCore process of the server whose session is `sid`."""
    (pid,) = [p for p in session_members(sid) if _cmdline(p).startswith(b"VLLM::EngineCore")]
    return pid


def sessions_of(pids) -> set[int]:
    out = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            out.add(os.getsid(pid))
    return out


class Traffic:
    """Requests through the gateway one after another on a thread, each with a new image
    (so each needs an encode), until `stop()`; every answer must be 200 and equal the
    aggregated server's greedy tokens. `failures` lists the ones that were not."""

    def __init__(self, c, gateway: str, first_seed: int) -> None:
        self.c, self.gateway, self.seed = c, gateway, first_seed
        self.sent = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=120) as client:
            while not self._stop.is_set():
                image = sample_image_png(seed=self.seed)
                self.seed += 1
                try:
                    ref = answer(client, self.c["agg"], image)
                    r = client.post(self.gateway + "/v1/chat/completions",
                                    json=chat_body(MODEL_NAME, image, PROMPT, max_tokens=8))
                    ok = r.status_code == 200 and r.json()["choices"][0]["token_ids"] == ref
                    why = "" if ok else f"HTTP {r.status_code}: {r.text[:300]}"
                except (httpx.HTTPError, AssertionError) as exc:
                    why = f"{type(exc).__name__}: {exc}"
                self.sent += 1
                if why:
                    self.failures.append(f"request {self.sent}: {why}")

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=150)


def instance_states(client: httpx.Client, gateway: str) -> dict[str, str]:
    listed = client.get(gateway + "/instances").json()
    return {e["url"]: e["state"] for e in (*listed["encoders"], *listed["decoders"])}


def wait_back(client: httpx.Client, gateway: str, urls: list[str], since: float) -> float:
    """Wait until the gateway takes every one of `urls` again (state up: restarted, healthy,
    a forward probe passed), within BACK_WITHIN_S of `since`; the seconds it took."""
    def back() -> bool:
        states = instance_states(client, gateway)
        return all(states.get(u) == "up" for u in urls)

    assert wait_for(back, timeout=BACK_WITHIN_S - (time.monotonic() - since), interval=0.5), \
        f"not back within {BACK_WITHIN_S:.0f} s: {instance_states(client, gateway)}"
    return time.monotonic() - since
