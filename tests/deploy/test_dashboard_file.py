"""The Grafana dashboard file, without Grafana or Prometheus (the fast lane's): the checked-in
deploy/grafana/epd-dashboard.json is what deploy/grafana/build_dashboard.py writes, every
panel reads the `${datasource}` variable (a Prometheus data source), and every metric a query
names is one the project documents (docs/metrics.md) or vLLM's own. Whether the queries return
series from a real deployment: test_dashboard.py (the deploy lane)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT

GENERATOR = ROOT / "deploy" / "grafana" / "build_dashboard.py"
DASHBOARD = ROOT / "deploy" / "grafana" / "epd-dashboard.json"
METRICS_DOC = (ROOT / "docs" / "metrics.md").read_text()
METRIC = re.compile(r"vllm:[a-z_]+|epd_[a-z_]+|master_[a-z_]+|\bup\b")


def _generator():
    spec = importlib.util.spec_from_file_location("epd_build_dashboard", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_the_checked_in_dashboard_is_what_the_generator_writes():
    assert DASHBOARD.read_text() == _generator().render(), \
        "stale: run `python deploy/grafana/build_dashboard.py`"
    run = subprocess.run([sys.executable, str(GENERATOR), "--check"], capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr


def test_every_panel_reads_the_datasource_variable():
    doc = _dashboard()
    (var,) = doc["templating"]["list"]
    assert (var["name"], var["type"], var["query"]) == ("datasource", "datasource",
                                                        "prometheus")
    ds = {"type": "prometheus", "uid": "${datasource}"}
    panels = [p for p in doc["panels"] if p["type"] != "row"]
    assert len(panels) >= 10
    for p in panels:
        assert p["datasource"] == ds, p["title"]
        assert p["targets"], p["title"]
        assert all(t["datasource"] == ds and t["expr"] for t in p["targets"]), p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
    assert len({p["id"] for p in doc["panels"]}) == len(doc["panels"])


def test_panels_do_not_overlap():
    taken: dict[tuple[int, int], str] = {}
    for p in _dashboard()["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in taken, (p["title"], taken.get((x, y)))
                taken[(x, y)] = p["title"]


def _vllm_metric_names() -> str:
    """The text of vLLM's own metric definitions (its V1 Prometheus logger)."""
    spec = importlib.util.find_spec("vllm")  # no import: the file is read
    return (Path(spec.origin).parent / "v1" / "metrics" / "loggers.py").read_text()


def test_every_metric_a_query_names_is_documented_or_vllms_own():
    vllm_own = _vllm_metric_names()
    unknown = []
    for p in _dashboard()["panels"]:
        for t in p.get("targets", []):
            names = METRIC.findall(t["expr"])
            assert names, (p["title"], t["expr"])
            for name in names:
                base = re.sub(r"_(bucket|count|sum)$", "", name)
                if name == "up" or f"`{name}`" in METRICS_DOC or f"`{base}`" in METRICS_DOC:
                    continue
                if name.startswith("vllm:") and not name.startswith("vllm:epd_") and \
                        f'"{base}"' in vllm_own:
                    continue
                unknown.append(f"{p['title']}: {name}")
    assert not unknown, unknown


def test_no_query_is_exempt_from_returning_series():
    """No query is marked as allowed to be empty: the counters that wait for an event
    (upstream errors, retries, failovers, restarts, pool refusals) export their known label
    sets at 0, so the deploy lane requires series of every query."""
    assert _generator().Q._fields == ("expr", "legend")
    waiting = [t["expr"] for p in _dashboard()["panels"] for t in p.get("targets", [])
               if re.search(r"epd_(gateway_(upstream_errors|retries|failovers)|restarts|"
                            r"pool_rejected)_total", t["expr"])]
    assert len(waiting) == 5, waiting
