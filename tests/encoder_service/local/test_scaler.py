"""`epd up`'s scaler (scaler.py) on a hand-driven clock, with stand-in processes and the
gateway's real pools on a real event loop: a load above the target starts the next planned
instance, which joins the gateway's pool and the supervisor once healthy; an idle role drains
the newest through the pool (its call in flight finishes first), then stops its process;
each decision is logged, counted and listed; a start that fails leaves the role as it was."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from encoder_service.gateway.server import ScalingPort
from encoder_service.gateway.telemetry.metrics import GatewayMetrics
from encoder_service.gateway.upstreams.encoder_clients import EncoderRouter
from encoder_service.local.scaler import Scaler
from encoder_service.local.supervise import RestartPolicy, Supervisor
from encoder_service.local.up_config import load_up_config
from tests.helpers import wait_for

ROLE = {"up_window_s": 2, "idle_window_s": 2, "up_cooldown_s": 0, "down_cooldown_s": 0}


class Proc:
    """A stand-in server: started, healthy once `ready`, stopped."""

    def __init__(self, name: str, port: int, ready: bool = True) -> None:
        self.name, self.port, self.ready = name, port, ready
        self.running = False
        self.starts = self.stops = 0
        self.log_path = Path(f"/tmp/{name}.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self):
        self.running, self.starts = True, self.starts + 1
        return self

    def healthy(self) -> bool:
        return self.running and self.ready

    def stop(self, timeout_s: float = 20.0) -> None:
        self.running, self.stops = False, self.stops + 1


class Client:
    def __init__(self, name: str) -> None:
        self.name = name


class Loop:
    """The gateway's event loop on a thread, as GatewayThread runs it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call_soon(self, fn, *args) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(5)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def world():
    loop = Loop()
    cfg = load_up_config(None, {"encoders": 1, "transport": "safetensors", "scaling": {
        "encoders_max": 2, "interval_s": 0.5, "encoder": {**ROLE, "target": 1.0}}})
    clock = SimpleNamespace(t=100.0)
    enc0, enc1 = Proc("encoder-0", 1001), Proc("encoder-1", 1002)
    enc0.start()
    router = EncoderRouter([Client(enc0.url)])
    load = {"encoder": 0.0, "decode": 0.0}
    gateway = SimpleNamespace(
        metrics=GatewayMetrics(), router=router, encoder_client=Client,
        fleet=SimpleNamespace(load=lambda: dict(load)), admin=SimpleNamespace(scaling=None))
    gateway.admin.show_scaling = lambda view: setattr(gateway.admin, "scaling", view)
    loop.gateway = gateway
    encoders = {"encoder": [enc0], "decode": []}
    said: list[str] = []
    sup = Supervisor([enc0], RestartPolicy(), say=said.append, clock=lambda: clock.t)
    scaler = Scaler.of(cfg, encoders, [enc1], ScalingPort(loop), sup, said.append, {},
                       clock=lambda: clock.t)
    role = scaler.roles["encoder"]
    yield SimpleNamespace(loop=loop, scaler=scaler, clock=clock, load=load, role=role,
                          router=router, sup=sup, said=said, enc1=enc1, gateway=gateway)
    scaler.close()
    loop.close()


def step(w, seconds: float, until=None) -> None:
    """Poll every 0.5 s of the fake clock for `seconds` (or until `until()`)."""
    for _ in range(int(seconds / 0.5)):
        w.clock.t += 0.5
        w.scaler.poll()
        for t in list(w.scaler.roles["encoder"].stopping.values()):
            t.join(5)
        if until is not None and until():
            return


def test_grows_joins_then_drains_and_stops_the_newest(world):
    w = world
    w.load["encoder"] = 3.0
    step(w, 4, until=lambda: w.enc1.running)
    assert w.enc1.starts == 1 and any("scale encoder up: encoder-1 starting on :1002" in s
                                      for s in w.said)
    step(w, 1, until=lambda: w.enc1 in w.role.serving)
    w.loop.run(asyncio.sleep(0))  # the join ran on the gateway's loop
    assert w.enc1.url in w.router.clients and "encoder-1" in w.sup.watches
    assert w.enc1 not in w.role.spare
    view = w.gateway.admin.scaling()
    assert view["roles"]["encoder"]["serving"] == 2
    assert [d["direction"] for d in view["decisions"]] == ["up"]

    w.router.inflight[w.enc1.url] = 1  # a call in flight on the newest
    w.load["encoder"] = 0.0
    step(w, 3, until=lambda: w.scaler.roles["encoder"].draining)
    assert "encoder-1" not in w.sup.watches and w.enc1.running
    assert any("encoder-1 draining: nothing new from the gateway, 1 request(s) in flight"
               in s for s in w.said)
    step(w, 2)
    assert w.enc1.running  # its call is not done: it waits
    w.router.inflight[w.enc1.url] = 0
    draining = w.scaler.roles["encoder"].draining  # the drain polls in real time
    assert wait_for(lambda: all(f.done() for _, f in draining.values()), timeout=5)
    step(w, 3, until=lambda: not w.enc1.running
         and not w.scaler.roles["encoder"].stopping)
    step(w, 0.5)
    assert not w.enc1.running and w.enc1 in w.role.spare
    assert w.enc1.url not in w.router.clients
    assert any("encoder-1 stopped, nothing of it left" in s for s in w.said)
    text = w.gateway.metrics.registry.get_sample_value
    assert text("epd_scale_events_total", {"role": "encoder", "direction": "up",
                                           "reason": "load_above_target"}) == 1
    assert text("epd_scale_events_total", {"role": "encoder", "direction": "down",
                                           "reason": "idle"}) == 1
    assert text("epd_instances", {"role": "encoder", "state": "serving"}) == 1
    assert text("epd_instances", {"role": "encoder", "state": "draining"}) == 0


def test_a_start_that_fails_leaves_the_role_as_it_was(world):
    w = world
    w.load["encoder"] = 3.0
    step(w, 4, until=lambda: w.enc1.running)
    w.enc1.running = False  # it died while starting
    step(w, 0.5)
    assert any("encoder-1 exited while starting" in s for s in w.said)
    assert w.enc1 in w.role.spare and w.role.serving == [w.role.serving[0]]
    assert w.gateway.admin.scaling()["roles"]["encoder"] == {
        "starting": 0, "serving": 1, "draining": 0, "wanted": 1, "min": 1, "max": 2,
        "load": 3.0}


def test_queues_are_read_from_every_instance_at_once(world):
    """What the instances queue themselves comes from their /metrics, asked all at once: two
    hung instances cost one poll one timeout (1 s), not one each; an answering one counts."""
    import http.server
    import time

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            if self.server.hang:
                time.sleep(2.5)
            body = b'vllm:num_requests_waiting{engine="0"} 2.0\n'
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    servers = []
    for hang in (True, False, True):
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
        srv.hang, srv.daemon_threads = hang, True
        srv.handle_error = lambda *_: None  # a hung answer's client has gone: expected
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
    try:
        role = SimpleNamespace(name="decode", queue_metric="vllm:num_requests_waiting", serving=[
            SimpleNamespace(url=f"http://127.0.0.1:{srv.server_address[1]}") for srv in servers])
        t0 = time.monotonic()
        assert world.scaler._queued(role) == 2.0
        assert time.monotonic() - t0 < 1.8
    finally:
        for srv in servers:
            srv.shutdown()
            srv.server_close()
