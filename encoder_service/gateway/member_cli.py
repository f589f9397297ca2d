"""`epd member join|leave`: an instance joins a gateway, or drains out of it, by itself.

What a Kubernetes pod's lifecycle hooks run (deploy/templates/epd.yaml): `join` (postStart)
waits, bounded, for the instance's own /health, then asks the gateway's admin API to add it
(POST /admin/instances, action add); `leave` (preStop) asks the gateway to remove it with a
drain (action remove, `drain_timeout_s`: nothing new from the gateway, its requests in flight
finish), then waits, within the same deadline, until the instance's own /metrics say it is
idle: nothing running or waiting in vLLM (`vllm:num_requests_running`, `_waiting`), nothing
queued in an encoder pool (`epd_pool_queue_depth`), so what reached it through a Service
finishes too. Only then does the hook return and the kubelet send SIGTERM. Every wait has a
deadline; a gateway that cannot be reached is said and the pod goes on (its own idle wait
still runs on leave). `join` exits 0 whatever happened (a failed postStart hook kills the
container: a pod that could not join is still reached through its Service); `leave` exits 1
when the instance was still busy at the deadline. The admin token and the servers' API key
come from the deployment secret ($EPD_SECRET_FILE), which never travels.
"""

from __future__ import annotations

import argparse
import sys
import time

import httpx

from ec_connectors.protocol.api_keys import admin_token, api_key
from ec_connectors.protocol.secret_file import SecretError, read_secret

BUSY = ("vllm:num_requests_running", "vllm:num_requests_waiting", "epd_pool_queue_depth")


def _total(text: str, name: str) -> float:
    """Sum of a metric's samples (every label set) in a Prometheus text."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"))


def _say(msg: str) -> None:
    print(f"[epd member] {msg}", file=sys.stderr, flush=True)


def busy(client: httpx.Client, url: str) -> float | None:
    """Requests running or waiting on the instance at `url` (None: its /metrics unreadable)."""
    try:
        text = client.get(url + "/metrics").text
    except httpx.HTTPError:
        return None
    return sum(_total(text, name) for name in BUSY)


def join(client: httpx.Client, admin: dict, gateway: str, role: str, url: str,
         timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if client.get(url + "/health").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    else:
        _say(f"{url} not healthy within {timeout_s:g} s: not joining {gateway}")
        return 0
    try:
        r = client.post(gateway + "/admin/instances", headers=admin,
                        json={"role": role, "url": url, "action": "add"})
    except httpx.HTTPError as exc:
        _say(f"{gateway} unreachable ({exc}): {url} not joined")
        return 0
    _say(f"joined {gateway} as {role} {url}: HTTP {r.status_code} {r.text[:200]}")
    return 0


def leave(client: httpx.Client, admin: dict, gateway: str, role: str, url: str,
          timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    try:
        r = client.post(gateway + "/admin/instances", headers=admin, timeout=timeout_s + 10,
                        json={"role": role, "url": url, "action": "remove",
                              "drain_timeout_s": timeout_s})
        _say(f"left {gateway}: HTTP {r.status_code} {r.text[:200]}")
    except httpx.HTTPError as exc:
        _say(f"{gateway} unreachable ({exc}); waiting for {url} to be idle anyway")
    while time.monotonic() < deadline:
        n = busy(client, url)
        if n is not None and n <= 0:
            _say(f"{url} idle: stopping")
            return 0
        time.sleep(0.5)
    _say(f"{url} still busy after {timeout_s:g} s: stopping anyway")
    return 1


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="epd member", description="join a gateway, or drain "
                                "out of it (Kubernetes postStart / preStop hooks)")
    p.add_argument("action", choices=["join", "leave"])
    p.add_argument("--gateway", required=True, help="the gateway's base URL")
    p.add_argument("--role", choices=["encoder", "decoder"], required=True)
    p.add_argument("--url", required=True, help="this instance's base URL (its pod IP)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="join: wait this long for "
                   "the instance's health; leave: the drain's deadline (default 120)")
    p.add_argument("--secret-file", help="the deployment secret (default $EPD_SECRET_FILE)")
    return p


def main(argv: list[str]) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        secret = read_secret(args.secret_file)
    except SecretError as exc:
        p.error(str(exc))
    admin = {} if secret is None else {"authorization": f"Bearer {admin_token(secret)}"}
    key = {} if secret is None else {"authorization": f"Bearer {api_key(secret)}"}
    with httpx.Client(timeout=10.0, trust_env=False, headers=key) as client:
        act = join if args.action == "join" else leave
        return act(client, admin, args.gateway.rstrip("/"), args.role,
                   args.url.rstrip("/"), args.timeout_s)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
