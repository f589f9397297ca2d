"""`epd member join|leave` (gateway/member_cli.py), a pod's own lifecycle hooks, over real
HTTP against a stub gateway and a stub instance: join waits for the instance's health, then
adds it with the admin token; leave removes it with a drain and waits, within its deadline,
until the instance's own /metrics say nothing runs or waits there (what came through a
Service); neither waits without a deadline, and an unreachable gateway does not stop a leave."""

from __future__ import annotations

import time

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from ec_connectors.protocol.api_keys import admin_token, api_key
from encoder_service.gateway import member_cli
from tests.helpers import Served, port_block

GW_PORT, INSTANCE_PORT, NOBODY = port_block(__name__)[:3]
SECRET = b"member-test-secret-0123456789abcdef"


class Stubs:
    def __init__(self) -> None:
        self.admin: list[tuple[dict, str]] = []
        self.health_fails = 0
        self.busy_polls = 0
        self.keys: set[str] = set()

        async def admin(request: Request) -> JSONResponse:
            self.admin.append((await request.json(), request.headers.get("authorization")))
            return JSONResponse({"state": "ok", "drained": True})

        async def health(request: Request) -> PlainTextResponse:
            if self.health_fails > 0:
                self.health_fails -= 1
                return PlainTextResponse("starting", 503)
            return PlainTextResponse("ok")

        async def metrics(request: Request) -> PlainTextResponse:
            self.keys.add(request.headers.get("authorization", ""))
            busy = self.busy_polls > 0
            self.busy_polls -= 1
            return PlainTextResponse(
                f'vllm:num_requests_running{{engine="0"}} {1.0 if busy else 0.0}\n'
                'vllm:num_requests_waiting{engine="0"} 0.0\n')

        self.gateway = Starlette(routes=[Route("/admin/instances", admin, methods=["POST"])])
        self.instance = Starlette(routes=[Route("/health", health), Route("/metrics", metrics)])


@pytest.fixture(scope="module")
def stubs():
    s = Stubs()
    with Served(s.gateway, GW_PORT), Served(s.instance, INSTANCE_PORT):
        yield s


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(SECRET)
    path.chmod(0o600)
    return str(path)


def member(action: str, secret_file: str, gateway_port: int = GW_PORT, timeout: float = 10):
    return member_cli.main([action, "--gateway", f"http://127.0.0.1:{gateway_port}",
                            "--role", "encoder", "--url", f"http://127.0.0.1:{INSTANCE_PORT}",
                            "--timeout-s", str(timeout), "--secret-file", secret_file])


def test_join_waits_for_health_then_adds_itself_with_the_admin_token(stubs, secret_file):
    stubs.admin.clear()
    stubs.health_fails = 2
    assert member("join", secret_file) == 0
    assert stubs.health_fails == 0
    assert stubs.admin == [({"role": "encoder", "url": f"http://127.0.0.1:{INSTANCE_PORT}",
                             "action": "add"}, f"Bearer {admin_token(SECRET)}")]


def test_leave_drains_through_the_gateway_then_waits_until_the_instance_is_idle(
        stubs, secret_file):
    stubs.admin.clear()
    stubs.busy_polls = 3
    assert member("leave", secret_file) == 0
    assert stubs.busy_polls < 0  # it asked until the instance had nothing running
    ((body, auth),) = stubs.admin
    assert body == {"role": "encoder", "url": f"http://127.0.0.1:{INSTANCE_PORT}",
                    "action": "remove", "drain_timeout_s": 10.0}
    assert auth == f"Bearer {admin_token(SECRET)}"
    assert stubs.keys == {f"Bearer {api_key(SECRET)}"}  # the servers' key, for /metrics


def test_leave_without_a_gateway_still_waits_and_every_wait_ends(stubs, secret_file):
    stubs.busy_polls = 1
    assert member("leave", secret_file, gateway_port=NOBODY) == 0
    stubs.busy_polls = 10**6  # busy for good
    t0 = time.monotonic()
    assert member("leave", secret_file, timeout=1.5) == 1
    assert time.monotonic() - t0 < 5
    stubs.health_fails = 10**6
    t0 = time.monotonic()
    assert member("join", secret_file, timeout=1.5) == 0  # never fails the pod's start
    assert time.monotonic() - t0 < 5
    stubs.health_fails = stubs.busy_polls = 0
