"""Write deploy/grafana/epd-dashboard.json, the Grafana dashboard of an EPD deployment, from
the panel list below (python stdlib only).

    python deploy/grafana/build_dashboard.py           write it
    python deploy/grafana/build_dashboard.py --check   exit 1 if the checked-in file differs

Every query reads a metric the code exports (docs/metrics.md; vLLM's own are `vllm:*`) through
the `${datasource}` variable (any Prometheus data source). The gateway's per-instance
histograms carry a label `instance` (an instance's base URL), which Prometheus renames
`exported_instance` (its own `instance` is the scraped target; `honor_labels: false`, the
default). tests/deploy/test_manifests.py checks the file is current and every metric is
documented; tests/deploy/test_dashboard.py evaluates every query against a real Prometheus
scraping a real `epd up`. What each panel shows: docs/observability.md#dashboard.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NamedTuple

OUT = Path(__file__).resolve().with_name("epd-dashboard.json")
UID = "epd-overview"
RATE = "[$__rate_interval]"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


class Q(NamedTuple):
    """One query of a panel: every one has series in a healthy deployment (the labelled
    counters that wait for an event, upstream errors or restarts, export each known label
    set at 0)."""

    expr: str
    legend: str = ""


class Panel(NamedTuple):
    title: str
    description: str
    queries: list[Q]
    unit: str = "short"
    kind: str = "timeseries"  # or "stat"
    width: int = 12
    height: int = 8
    extra: dict | None = None  # more fieldConfig.defaults keys


def rate(metric: str, by: str = "", selector: str = "") -> str:
    """`sum by (by) (rate(metric{selector}[$__rate_interval]))` (plain sum without `by`)."""
    grouping = f" by ({by}) " if by else ""
    return f"sum{grouping}(rate({metric}{selector}{RATE}))"


def quantile(q: float, histogram: str, by: str = "", selector: str = "") -> str:
    """histogram_quantile over a histogram's buckets, per `by` (and le)."""
    keys = f"{by}, le" if by else "le"
    return (f"histogram_quantile({q}, sum by ({keys}) "
            f"(rate({histogram}_bucket{selector}{RATE})))")


STAGE = 'epd_gateway_stage_seconds'
FIRST_TOKEN = '{stage="first_token"}'

# (row title, its panels), top to bottom; panels fill each row left to right
ROWS: list[tuple[str, list[Panel]]] = [
    ("Traffic", [
        Panel("Requests by endpoint and status",
              "The gateway's answers per second (epd_gateway_requests_total).",
              [Q(rate("epd_gateway_requests_total", "endpoint, status"),
                 "{{endpoint}} {{status}}")], unit="reqps"),
        Panel("Refusals by reason",
              "Requests the gateway refused (4xx), by the code the client got "
              "(epd_gateway_rejected_total; docs/errors.md), and admissions an encoder pool "
              "refused (epd_pool_rejected_total).",
              [Q(rate("epd_gateway_rejected_total", "reason"), "{{reason}}"),
               Q(rate("epd_pool_rejected_total", "code"), "pool {{code}}")],
              unit="reqps"),
    ]),
    ("Latency", [
        Panel("TTFT (gateway, first_token stage)",
              "Decode request sent -> first byte back, the decode side's transfer wait and "
              "prefill included (epd_gateway_stage_seconds{stage=\"first_token\"}).",
              [Q(quantile(q, STAGE, selector=FIRST_TOKEN), f"p{round(q * 100)}")
               for q in (0.5, 0.9, 0.99)], unit="s"),
        Panel("Stage latency p50 / p99",
              "Per gateway stage: parse, encode, prefill (E/P/D), first_token, total "
              "(epd_gateway_stage_seconds).",
              [Q(quantile(0.5, STAGE, "stage"), "p50 {{stage}}"),
               Q(quantile(0.99, STAGE, "stage"), "p99 {{stage}}")], unit="s"),
        Panel("TTFT p99 per prefill/decode instance",
              "Request sent -> first byte back, per instance's base URL "
              "(epd_gateway_instance_first_token_seconds; label exported_instance).",
              [Q(quantile(0.99, "epd_gateway_instance_first_token_seconds",
                          "exported_instance"), "{{exported_instance}}")], unit="s"),
        Panel("Connector latency p99",
              "EPDConnector, per item: producer save, consumer get (transport delivery) and "
              "load (prefetch -> staged), a request's deferral (vllm:epd_*_seconds).",
              [Q(quantile(0.99, f"vllm:epd_{name}_seconds"), legend)
               for name, legend in (("save", "save (producer)"), ("get", "get"),
                                    ("load", "load"), ("defer", "request deferred"))],
              unit="s"),
    ]),
    ("Items and transfers", [
        Panel("Gateway items by outcome",
              "Media items: cache_hit (already stored), encoded, shared (another request's "
              "encode), overlapped, fallback, metadata_only (epd_gateway_items_total).",
              [Q(rate("epd_gateway_items_total", "outcome"), "{{outcome}}")], unit="ops"),
        Panel("Encoders and connectors: hits, loads, misses",
              "Encoder pools: items encoded, answered without encoding. Consumers: scheduler "
              "hits, loads, vLLM encoder-cache hits, load failures (misses) "
              "(epd_pool_*_total, vllm:epd_*_total).",
              [Q(rate("epd_pool_items_encoded_total"), "pool encoded"),
               Q(rate("epd_pool_reuse_hits_total"), "pool reuse hits"),
               Q(rate("vllm:epd_hits_total"), "scheduler hits"),
               Q(rate("vllm:epd_loads_total"), "loads"),
               Q(rate("vllm:epd_engine_cache_hits_total"), "vLLM encoder-cache hits"),
               Q(rate("vllm:epd_load_failures_total"), "load failures")], unit="ops"),
        Panel("Transfer throughput",
              "Embedding bytes written by producers (vLLM encoders, encoder pools) and loaded "
              "by consumers, per scraped instance (vllm:epd_save_bytes_total, "
              "epd_pool_published_bytes_total, vllm:epd_load_bytes_total).",
              [Q(rate("vllm:epd_save_bytes_total", "instance"), "written {{instance}}"),
               Q(rate("epd_pool_published_bytes_total", "instance"),
                 "pool written {{instance}}"),
               Q(rate("vllm:epd_load_bytes_total", "instance"), "loaded {{instance}}")],
              unit="Bps"),
        Panel("Feature bytes per lifecycle state",
              "Consumers: loading, staged, merged, prefilled, discarded "
              "(vllm:epd_feature_bytes); producers: encoded_cpu "
              "(vllm:epd_producer_feature_bytes); encoder pools (epd_pool_state_bytes); "
              "staged minus unstaged (counters). All return to 0 when idle.",
              [Q("sum by (instance, state) (vllm:epd_feature_bytes)",
                 "{{instance}} {{state}}"),
               Q("sum by (instance, state) (vllm:epd_producer_feature_bytes)",
                 "{{instance}} producer {{state}}"),
               Q("sum by (instance, state) (epd_pool_state_bytes)",
                 "{{instance}} pool {{state}}"),
               Q("sum by (instance) (vllm:epd_staged_bytes_total - "
                 "vllm:epd_unstaged_bytes_total)", "{{instance}} staged (counters)")],
              unit="bytes"),
    ]),
    ("Capacity and health", [
        Panel("Queue depths",
              "vLLM requests waiting and running per server (vllm:num_requests_waiting, "
              "vllm:num_requests_running), items queued per encoder pool and modality "
              "(epd_pool_queue_depth), the gateway's requests in flight.",
              [Q("sum by (instance) (vllm:num_requests_waiting)", "{{instance}} waiting"),
               Q("sum by (instance) (vllm:num_requests_running)", "{{instance}} running"),
               Q("sum by (instance, modality) (epd_pool_queue_depth)",
                 "{{instance}} pool {{modality}}"),
               Q("sum(epd_gateway_inflight_requests)", "gateway in flight")]),
        Panel("Targets up",
              "Prometheus' scrape of every target: 1 up, 0 down (up).",
              [Q("up", "{{job}} {{instance}}")], kind="stat", width=12,
              extra={"min": 0, "max": 1, "thresholds": {"mode": "absolute", "steps": [
                  {"color": "red", "value": None}, {"color": "green", "value": 1}]}}),
        Panel("Requests per prefill/decode instance",
              "Answers the gateway started per instance's base URL: an instance that stops "
              "getting requests is down, cooling or draining "
              "(epd_gateway_instance_first_token_seconds_count).",
              [Q(rate("epd_gateway_instance_first_token_seconds_count", "exported_instance"),
                 "{{exported_instance}}")], unit="reqps"),
        Panel("Errors, retries, failovers, restarts",
              "Upstream errors and retries by target, failovers by outcome, requests sent "
              "raw after an encoder failure, items a consumer encoded itself, servers `epd "
              "up` restarted (epd_gateway_upstream_errors_total, epd_gateway_retries_total, "
              "epd_gateway_failovers_total, epd_gateway_fallbacks_total, "
              "vllm:epd_local_encode_fallbacks_total, epd_restarts_total).",
              [Q(rate("epd_gateway_upstream_errors_total", "target"), "errors {{target}}"),
               Q(rate("epd_gateway_retries_total", "target"), "retries {{target}}"),
               Q(rate("epd_gateway_failovers_total", "outcome"), "failovers {{outcome}}"),
               Q(rate("epd_gateway_fallbacks_total"), "sent raw (encoder failed)"),
               Q(rate("vllm:epd_local_encode_fallbacks_total"), "encoded by the consumer"),
               Q(rate("epd_restarts_total", "exported_instance"),
                 "restarts {{exported_instance}}")], unit="ops"),
    ]),
    ("Elastic roles", [
        Panel("Elastic roles: instances and load",
              "`epd up --encoders MIN:MAX` / `--decoders MIN:MAX`: instances per role and "
              "state (wanted, starting, serving, draining; epd_instances) and the gateway's "
              "load per role (encode calls in flight + images waiting; decode requests in "
              "flight; epd_gateway_load), what the scaler and a Kubernetes HPA compare with "
              "the target per instance.",
              [Q("sum by (role, state) (epd_instances)", "{{role}} {{state}}"),
               Q("sum by (role) (epd_gateway_load)", "load {{role}}")]),
        Panel("Elastic roles: scale events",
              "Instances added (up, load_above_target) or drained and stopped (down, idle) "
              "per role (epd_scale_events_total); each has a log line with its reason.",
              [Q(rate("epd_scale_events_total", "role, direction, reason"),
                 "{{role}} {{direction}} ({{reason}})")], unit="ops"),
    ]),
]


def panel_json(p: Panel, pid: int, x: int, y: int) -> dict:
    targets = [{"datasource": DATASOURCE, "refId": chr(ord("A") + i), "expr": q.expr,
                "legendFormat": q.legend or "__auto", "range": True}
               for i, q in enumerate(p.queries)]
    options: dict = {"legend": {"displayMode": "list", "placement": "bottom",
                                "showLegend": True},
                     "tooltip": {"mode": "multi", "sort": "desc"}}
    if p.kind == "stat":
        options = {"colorMode": "background", "graphMode": "none", "justifyMode": "auto",
                   "orientation": "auto", "textMode": "auto",
                   "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}
    return {"id": pid, "type": p.kind, "title": p.title, "description": p.description,
            "datasource": DATASOURCE, "gridPos": {"h": p.height, "w": p.width, "x": x, "y": y},
            "fieldConfig": {"defaults": {"unit": p.unit, **(p.extra or {})}, "overrides": []},
            "options": options, "targets": targets}


def dashboard() -> dict:
    panels: list[dict] = []
    y = 0
    for row, members in ROWS:
        panels.append({"id": len(panels) + 1, "type": "row", "title": row, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        y += 1
        x = height = 0
        for p in members:
            if x + p.width > 24:
                x, y = 0, y + height
            panels.append(panel_json(p, len(panels) + 1, x, y))
            x, height = x + p.width, max(height, p.height)
        y += height
    variable = {"name": "datasource", "label": "Prometheus", "type": "datasource",
                "query": "prometheus", "current": {}, "hide": 0, "refresh": 1, "regex": "",
                "options": []}
    return {"uid": UID, "title": "EPD: encoder-cache disaggregation",
            "description": "An EPD deployment (gateway, encoders, prefill/decode instances): "
                           "docs/observability.md#dashboard",
            "tags": ["epd", "vllm"], "editable": True, "graphTooltip": 1,
            "schemaVersion": 39, "version": 1, "refresh": "10s",
            "time": {"from": "now-30m", "to": "now"}, "timepicker": {},
            "timezone": "browser", "annotations": {"list": []}, "links": [],
            "templating": {"list": [variable]}, "panels": panels}


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def queries() -> list[tuple[str, Q]]:
    """(panel title, query) of every panel, in order."""
    return [(p.title, q) for _, members in ROWS for p in members for q in p.queries]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare, write nothing")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"stale: {OUT.name}: run `python deploy/grafana/build_dashboard.py`",
                  file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
