"""The gateway's counters that wait for an event (upstream errors, retries, failovers, `epd
up`'s restarts) export every known label set at 0 from the start, so `rate()` and the
dashboard (deploy/grafana) have a series before the first event; and every label value the
code counts with is one of those initialised (gateway/metrics.py's tuples), so the two cannot
drift. In process: the app's /metrics over ASGI, no port, no upstream."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path
from types import SimpleNamespace

import httpx

from encoder_service.gateway.app import create_app
from encoder_service.gateway.config import GatewayConfig
from encoder_service.gateway.telemetry import metrics
from encoder_service.local.supervise import RestartPolicy, supervise
from tests.helpers import ROOT

# counter attribute on GatewayMetrics -> (exported name, label, the values it starts with)
WAITING = {
    "retries": ("epd_gateway_retries_total", "target", metrics.UPSTREAM_TARGETS),
    "upstream_errors": ("epd_gateway_upstream_errors_total", "target",
                        metrics.UPSTREAM_TARGETS),
    "failovers": ("epd_gateway_failovers_total", "outcome", metrics.FAILOVER_OUTCOMES),
}


def fresh_app():
    cfg = GatewayConfig.build({"port": 1, "model": "m", "encoders": ["http://127.0.0.1:9"],
                               "decoders": ["http://127.0.0.1:9"]})
    return create_app(cfg)


def scrape(app) -> set[str]:
    """The sample lines of the app's GET /metrics (no lifespan: nothing started)."""
    async def get() -> str:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gw") as c:
            r = await c.get("/metrics")
            assert r.status_code == 200
            return r.text

    return {line for line in asyncio.run(get()).splitlines() if not line.startswith("#")}


def test_a_fresh_gateway_exports_every_known_label_set_at_0():
    lines = scrape(fresh_app())
    for name, label, values in WAITING.values():
        assert values
        for v in values:
            assert f'{name}{{{label}="{v}"}} 0.0' in lines, (name, v)
    assert not [x for x in lines if x.startswith("epd_restarts_total")]  # none registered


def test_each_server_epd_up_supervises_starts_at_0_restarts():
    app = fresh_app()
    names = ["encoder-0", "decode-0", "decode-1"]
    dep = SimpleNamespace(
        gateway=SimpleNamespace(gateway=app.gateway, call_soon=lambda fn: None),
        servers=[SimpleNamespace(name=n, url=f"http://127.0.0.1:{9 + i}")
                 for i, n in enumerate(names)],
        master=SimpleNamespace(name="mooncake-master"))
    supervise(dep, RestartPolicy(), 60, say=lambda line: None)
    restarts = {x for x in scrape(app) if x.startswith("epd_restarts_total")}
    assert restarts == {f'epd_restarts_total{{instance="{n}"}} 0.0'
                        for n in ["mooncake-master", *names]}


def _label_calls() -> list[tuple[str, str, ast.expr]]:
    """(file:line, counter attribute, first argument) of every `<x>.<counter>.labels(arg)`
    in encoder_service/ for the counters of WAITING."""
    found = []
    for path in sorted((ROOT / "encoder_service").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "labels"
                    and isinstance(node.func.value, ast.Attribute)
                    and node.func.value.attr in WAITING):
                where = f"{Path(path).relative_to(ROOT)}:{node.lineno}"
                found.append((where, node.func.value.attr, node.args[0]))
    return found


def test_every_label_value_counted_is_one_initialised():
    """Call sites name the metrics module's constants (or a literal of its tuples); a
    variable is allowed only in metrics.py's own initialising loops."""
    calls = _label_calls()
    own = "encoder_service/gateway/telemetry/metrics.py"
    outside = [c for c in calls if not c[0].startswith(own)]
    assert len(outside) >= 8, calls  # encoder and decode retries/errors, both failovers
    bad = []
    for where, counter, arg in outside:
        allowed = WAITING[counter][2]
        if isinstance(arg, ast.Name):
            value = getattr(metrics, arg.id, None)
        elif isinstance(arg, ast.Constant):
            value = arg.value
        else:
            value = None
        if value not in allowed:
            bad.append(f"{where}: {counter}.labels({ast.unparse(arg)}) not in {allowed}")
    assert not bad, bad
