"""The Grafana dashboard (deploy/grafana/epd-dashboard.json) against a real Prometheus scraping
a real deployment: Debian's `prometheus` (installed with apt as root when missing, as
engine.py installs podman) scrapes every /metrics of an `epd up` (a batching encoder pool, a
vLLM prefill/decode instance, the gateway; safetensors, a deployment secret) every second;
a few image requests go through the gateway (a repeated one: a cache hit; one refused:
`not_an_image`); once every target has been scraped twice after them, every query of every
panel is evaluated through Prometheus' HTTP API (`$__rate_interval` as 30s) and must return
at least one series, every label it groups by on each (the counters that wait for an event,
upstream errors, retries, failovers, restarts, pool refusals, export their known label sets at
0). Prometheus and `epd up` are stopped whatever happens.

Its own `epd up`, not test_compose_stack's reference: that one runs a vLLM encoder (no pool,
so the pool's panels would have nothing), on a model the image builds (podman), and is stopped
before the compose stack starts. Starts vLLM: run it under the machine-wide lock."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time

import httpx
import pytest
import yaml

from encoder_service.local.requests import image_part, parts_body, sample_image_png
from encoder_service.local.testmodels import SPECS, build
from tests.deploy import engine
from tests.helpers import ROOT, WORK, epd_up, port_block, wait_for

BLOCK = port_block(__name__)
# epd up: gateway, the pool +1, decode +2 (and +3: an elastic decode role's second, never
# started); Prometheus
UP_PORT, PROM_PORT = BLOCK[0], BLOCK[4]
PROM = f"http://127.0.0.1:{PROM_PORT}"
DASHBOARD = ROOT / "deploy" / "grafana" / "epd-dashboard.json"
WORK_DIR = WORK / "test-dashboard"
SCRAPE_S = 1
# what Grafana puts in place of its variables (the rate windows hold 30 scrapes here)
GRAFANA_VARS = {"$__rate_interval": "30s", "$__interval": "15s", "$__range": "5m"}
GROUPING = re.compile(r"\bby \(([^)]*)\)")


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, expr) of every query of the checked-in dashboard."""
    doc = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in doc["panels"] for t in p.get("targets", [])]


def concrete(expr: str) -> str:
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    return expr


def prometheus_binary() -> str:
    """`prometheus` on PATH, else Debian's package installed (root; idempotent)."""
    found = shutil.which("prometheus")
    if found:
        return found
    if not engine.can_apt():
        pytest.skip("prometheus is not on PATH and this is not root with apt-get: "
                    "`apt-get install -y --no-install-recommends prometheus` first")
    engine.log("installing prometheus with apt-get")
    engine.apt_install(["prometheus"])
    found = shutil.which("prometheus")
    assert found, "apt-get installed prometheus but it is not on PATH"
    return found


@pytest.fixture(scope="module")
def client():
    with httpx.Client(timeout=120) as c:
        yield c


def healthy(client: httpx.Client, url: str) -> bool:
    """The gateway sees its encoder pool and its decode instance healthy."""
    try:
        r = client.get(url + "/health", timeout=5)
        body = r.json() if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return False
    return all(body.get("encoders", {"": False}).values()) and \
        all(body.get("decoders", {"": False}).values())


@pytest.fixture(scope="module")
def binary():
    return prometheus_binary()  # before vLLM starts: a skip costs nothing


@pytest.fixture(scope="module")
def deployment(binary, client, tmp_path_factory):
    """`epd up`: an encoder pool, a vLLM prefill/decode instance, the gateway; its /metrics
    by Prometheus job."""
    model = build(WORK / "models" / "tiny-llava", SPECS["tiny"])
    secret = tmp_path_factory.mktemp("dashboard-secret") / "secret"
    secret.write_bytes(os.urandom(32).hex().encode())
    secret.chmod(0o600)
    conf = {"model": str(model), "base_port": UP_PORT, "encoder_backend": "pool",
            "transport": "safetensors", "cpu_cores": [0, 1, 0], "secret_file": str(secret),
            "pool": {"max_wait_ms": 1},
            # an elastic decode role (1 to 2; this light traffic keeps it at 1): the scaler's
            # series (epd_instances, epd_scale_events_total) for the "Elastic roles" panels
            "scaling": {"decoders_max": 2}}
    url = f"http://127.0.0.1:{UP_PORT}"
    t0 = time.monotonic()
    with epd_up(conf, WORK_DIR / "epd-up", also_ready=lambda: healthy(client, url),
                interval=1.0, stop_timeout=120) as (_, gateway, _log):
        print(f"\n[dashboard] epd up ready in {time.monotonic() - t0:.0f} s")
        yield {"gateway": gateway, "encoder": f"127.0.0.1:{UP_PORT + 1}",
               "prefill-decode": f"127.0.0.1:{UP_PORT + 2}"}


def query(client: httpx.Client, expr: str) -> dict:
    r = client.get(PROM + "/api/v1/query", params={"query": expr}, timeout=30)
    return r.json()


@pytest.fixture(scope="module")
def prometheus(binary, deployment, client, tmp_path_factory):
    """Prometheus scraping the gateway, the pool and the decode instance every second, every
    target up; stopped (by pid) after."""
    tmp = tmp_path_factory.mktemp("prometheus")
    targets = {"gateway": deployment["gateway"].removeprefix("http://"),
               "encoder": deployment["encoder"], "prefill-decode": deployment["prefill-decode"]}
    config = {"global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": "1s"},
              "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [t]}]}
                                 for job, t in targets.items()]}
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    log_path = WORK_DIR / "prometheus.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([binary, f"--config.file={tmp / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{PROM_PORT}"],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        def all_up() -> bool:
            assert proc.poll() is None, f"prometheus exited: {log_path.read_text()[-3000:]}"
            try:
                got = query(client, "up")["data"]["result"]
            except (httpx.HTTPError, ValueError, KeyError):
                return False
            return {r["metric"]["job"] for r in got if r["value"][1] == "1"} == set(targets)

        assert wait_for(all_up, timeout=60, interval=0.5), \
            f"targets not all up in 60 s: {query(client, 'up')}"
        yield {"targets": targets}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def ask(client: httpx.Client, url: str, part: dict) -> httpx.Response:
    return client.post(url + "/v1/chat/completions",
                       json=parts_body(SPECS["tiny"].model_name, [part], "describe this",
                                       max_tokens=4))


@pytest.fixture(scope="module")
def scraped(deployment, prometheus, client):
    """Image requests (three new, one repeated) and one refused request through the gateway,
    then every target scraped at least twice after them."""
    gw = deployment["gateway"]
    for seed in (31, 32, 33, 31):
        r = ask(client, gw, image_part(sample_image_png(seed=seed)))
        assert r.status_code == 200, r.text[:500]
    refused = ask(client, gw, image_part(b"these bytes are no image"))
    assert refused.status_code == 400, refused.text[:500]
    assert refused.json()["error"]["code"] == "not_an_image"
    after = time.time()

    def twice() -> bool:  # a sample taken more than one interval after the traffic
        got = query(client, "timestamp(up)")["data"]["result"]
        return len(got) == len(prometheus["targets"]) and \
            all(float(r["value"][1]) > after + SCRAPE_S for r in got)

    assert wait_for(twice, timeout=30, interval=0.5), query(client, "timestamp(up)")
    return after


def test_every_target_is_up(prometheus, scraped, client):
    got = query(client, "up")["data"]["result"]
    assert {r["metric"]["job"]: r["value"][1] for r in got} == \
        dict.fromkeys(prometheus["targets"], "1")


def test_every_panel_query_returns_series(scraped, client):
    failed, checked = [], 0
    for title, expr in panel_queries():
        got = query(client, concrete(expr))
        checked += 1
        if got.get("status") != "success" or not got["data"]["result"]:
            failed.append(f"{title}: {expr} -> {got.get('error') or 'no series'}")
            continue
        # every label the query groups by is on every series (a misnamed label would
        # still give one series, with no labels)
        labels = {x.strip() for g in GROUPING.findall(expr) for x in g.split(",")} - {"le"}
        bare = [r["metric"] for r in got["data"]["result"]
                if not all(r["metric"].get(x) for x in labels)]
        if bare:
            failed.append(f"{title}: {expr} -> series without {sorted(labels)}: {bare[:3]}")
    print(f"\n[dashboard] {checked} queries evaluated, {len(failed)} without series")
    assert checked == len(panel_queries()) >= 20
    assert not failed, "panels whose query returned no (labelled) series:\n" + \
        "\n".join(failed)
