"""`epd top`: a live terminal view of a deployment, from its gateway.

`epd top`: a live terminal view of a deployment, read from its gateway alone: `GET
/metrics` (Prometheus text: totals, refusals, the first-token histograms) and `GET /instances`
(each encoder, prefill and decode instance: state, in flight, what it was given, its last
probe; with `epd up`'s elastic roles, each role and a line per recent scale decision). One
frame per `--interval` seconds, redrawn in place; `--once` prints one frame
without escape codes (scripts), `--json` the same data as JSON.

Quantiles come from the histograms' buckets as Prometheus' `histogram_quantile` computes
them (linear inside a bucket): over the whole life of the gateway for the first frame and
`--once`, over the last interval (bucket deltas between two frames) after that. Neither a
queue depth nor bytes staged is known to the gateway per instance: those columns stay blank
(each instance's own /metrics has them: `vllm:num_requests_waiting`, `vllm:epd_feature_bytes`,
`epd_pool_queue_depth`).

`/instances` names internal addresses: a gateway with client keys answers it only with a
key (`--api-key`, `$EPD_GATEWAY_API_KEY`) or the admin token (derived from the deployment
secret: `--secret-file`, `$EPD_SECRET_FILE`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, TextIO

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ec_connectors.protocol.api_keys import admin_token
from ec_connectors.protocol.ports import GATEWAY_PORT
from ec_connectors.protocol.secret_file import SecretError, read_secret
from encoder_service.gateway.auth import CLIENT_KEY_ENV

ROLES = (("encoder", "encoders"), ("prefill", "prefills"), ("decode", "decoders"))
TTFT = "epd_gateway_instance_first_token_seconds"
STAGE = "epd_gateway_stage_seconds"
HOME, CLEAR_LINE, CLEAR_BELOW = "\x1b[H", "\x1b[K", "\x1b[J"
COLUMNS = (("ROLE", 7), ("URL", 28), ("STATE", 8), ("INFL", 5), ("QUEUE", 5), ("REQS", 7),
           ("ITEMS", 7), ("HITS", 7), ("TTFT50", 8), ("TTFT99", 8), ("STAGED", 7),
           ("PROBE", 0))

Labels = tuple[tuple[str, str], ...]


class TopError(Exception):
    """The gateway cannot be read: `fatal` when asking again will not help (a 401)."""

    def __init__(self, message: str, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal


@dataclass
class Snapshot:
    """One reading of the gateway: its samples by name (labels -> value) and /instances."""

    at: float
    samples: dict[str, dict[Labels, float]]
    instances: dict[str, Any]

    def total(self, name: str, **match: str) -> float:
        return sum(v for labels, v in self.samples.get(name, {}).items()
                   if _matches(labels, match))

    def by(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for labels, v in self.samples.get(name, {}).items():
            out[dict(labels).get(label, "")] += v
        return dict(out)

    def buckets(self, name: str, **match: str) -> dict[float, float]:
        """A histogram's cumulative buckets, summed over matching series.

        A histogram's cumulative buckets {upper bound: count} (series matching `match`
        summed)."""
        out: dict[float, float] = defaultdict(float)
        for labels, v in self.samples.get(name + "_bucket", {}).items():
            d = dict(labels)
            if _matches(labels, match):
                out[float(d["le"])] += v
        return dict(out)


def _matches(labels: Labels, match: dict[str, str]) -> bool:
    d = dict(labels)
    return all(d.get(k) == v for k, v in match.items())


def parse_metrics(text: str) -> dict[str, dict[Labels, float]]:
    """Prometheus text -> {sample name: {sorted labels: value}}."""
    out: dict[str, dict[Labels, float]] = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name][tuple(sorted(s.labels.items()))] = s.value
    return dict(out)


def auth_headers(api_key: str | None, secret_file: str | None) -> dict[str, str]:
    """The auth header `epd top` presents to the gateway.

    The bearer key `epd top` presents: a client key, else the admin token of the
    deployment secret (`secret_file`, else $EPD_SECRET_FILE), else none."""
    if api_key:
        return {"authorization": f"Bearer {api_key}"}
    secret = read_secret(secret_file)
    return {} if secret is None else {"authorization": f"Bearer {admin_token(secret)}"}


def scrape(client: httpx.Client, url: str) -> Snapshot:
    """Read the gateway once (TopError when it cannot be read)."""
    try:
        metrics = client.get(url + "/metrics")
        listed = client.get(url + "/instances")
    except httpx.HTTPError as exc:
        raise TopError(f"gateway {url} unreachable ({type(exc).__name__}: {exc})") from None
    if listed.status_code == 401:
        raise TopError(f"gateway {url} refused GET /instances (401): it has client API keys; "
                       f"give one (--api-key or ${CLIENT_KEY_ENV}) or the deployment secret "
                       "for the admin token (--secret-file or $EPD_SECRET_FILE)", fatal=True)
    for r in (metrics, listed):
        if r.status_code != 200:
            raise TopError(f"gateway {url}: GET {r.url.path} answered HTTP {r.status_code}")
    try:
        return Snapshot(time.monotonic(), parse_metrics(metrics.text), listed.json())
    except ValueError as exc:
        raise TopError(f"gateway {url}: unreadable answer ({exc})") from None


# -- quantiles ------------------------------------------------------------------------------
def quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus' histogram_quantile over cumulative `buckets` (None: no observation)."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for i, le in enumerate(bounds):
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):  # past the last finite bound: that bound
                return bounds[i - 1] if i else None
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return bounds[-1]


def delta(cur: dict[float, float], prev: dict[float, float] | None) -> dict[float, float]:
    """The observations between two readings (a reset counter, a restarted gateway: `cur`)."""
    if not prev:
        return cur
    out = {le: cur[le] - prev.get(le, 0.0) for le in cur}
    return cur if any(v < 0 for v in out.values()) else out


# -- one frame ------------------------------------------------------------------------------
@dataclass
class Frame:
    """What one screen shows (also the --json output)."""

    url: str
    window: str  # what the quantiles cover: "all time" or "last N s"
    totals: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    scaling: dict[str, Any] = field(default_factory=dict)  # `epd up`'s elastic roles


def state_of(entry: dict[str, Any]) -> str:
    """The state an instance is shown in.

    draining, down (reported down, or its last probe failed), cooling (a failure: tried
    last for a while), up."""
    state = entry.get("state", "?")
    if state in ("draining", "down"):
        return state
    if entry.get("probe", {}).get("ok") is False:
        return "down"
    return "cooling" if state == "cooling_down" else state


def make_frame(cur: Snapshot, prev: Snapshot | None, url: str) -> Frame:
    dt = cur.at - prev.at if prev is not None else 0.0
    frame = Frame(url, f"last {dt:.1f} s" if prev is not None else "all time")

    def ttft(q: float, name: str, **match: str) -> float | None:
        before = None if prev is None else prev.buckets(name, **match)
        return quantile(q, delta(cur.buckets(name, **match), before))

    requests = cur.total("epd_gateway_requests_total")
    by_status: dict[str, float] = defaultdict(float)
    for status, n in cur.by("epd_gateway_requests_total", "status").items():
        by_status[f"{status[:1]}xx"] += n
    rate = None
    if prev is not None and dt > 0:
        rate = max(0.0, requests - prev.total("epd_gateway_requests_total")) / dt
    frame.totals = {
        "requests": int(requests), "by_status": {k: int(v) for k, v in sorted(
            by_status.items())},
        "req_per_s": None if rate is None else round(rate, 2),
        "inflight": int(cur.total("epd_gateway_inflight_requests")),
        "refused": {k: int(v) for k, v in sorted(cur.by("epd_gateway_rejected_total",
                                                        "reason").items()) if v},
        "items": {k: int(v) for k, v in sorted(cur.by("epd_gateway_items_total",
                                                      "outcome").items()) if v},
        "failovers": int(cur.total("epd_gateway_failovers_total")),
        "upstream_errors": int(cur.total("epd_gateway_upstream_errors_total")),
        "ttft_p50_s": ttft(0.5, STAGE, stage="first_token"),
        "ttft_p99_s": ttft(0.99, STAGE, stage="first_token"),
    }
    for role, key in ROLES:
        for entry in cur.instances.get(key, []):
            u = entry["url"]
            probe = entry.get("probe")
            timed = role != "encoder"  # the per-instance histogram: prefill/decode
            frame.rows.append({
                "role": role, "url": u, "state": state_of(entry),
                "inflight": entry.get("inflight", 0), "queue": None,
                "requests": entry.get("requests", entry.get("calls", 0)),
                "items": entry.get("items"), "hits": entry.get("affinity"),
                "ttft_p50_s": ttft(0.5, TTFT, instance=u) if timed else None,
                "ttft_p99_s": ttft(0.99, TTFT, instance=u) if timed else None,
                "staged_bytes": None,
                "probe": probe})
    frame.scaling = cur.instances.get("scaling", {})
    return frame


def scaling_lines(scaling: dict[str, Any], decisions: int = 5) -> list[str]:
    """The elastic roles (`epd up`'s scaler), then a line per recent decision."""
    lines = [f"elastic {role}: {r['serving']} serving ({r['min']}..{r['max']}), "
             f"{r['starting']} starting, {r['draining']} draining, load {r['load']:.1f}"
             for role, r in scaling.get("roles", {}).items()]
    for d in scaling.get("decisions", [])[-decisions:]:
        when = time.strftime("%H:%M:%S", time.localtime(d["at"]))
        lines.append(f"scale {d['role']} {d['direction']} {when} {d['instance']} "
                     f"({d['reason']}): {d['detail']}")
    return lines


# -- text -----------------------------------------------------------------------------------
def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    ms = seconds * 1e3
    return f"{ms:.1f}ms" if ms < 10 else f"{ms:.0f}ms"


def _n(value: Any) -> str:
    return "-" if value is None else str(value)


def _probe(probe: dict[str, Any] | None) -> str:
    if not probe:
        return "-"
    text = f"{'ok' if probe.get('ok') else 'FAIL'} {probe.get('ms', 0):.0f}ms " \
           f"{probe.get('age_s', 0):.0f}s ago"
    return text + (f" ({probe['error'][:60]})" if probe.get("error") else "")


def render(frame: Frame, clock: str | None = None) -> str:
    """The frame as plain text lines (no escape codes)."""
    t = frame.totals
    status = " ".join(f"{k} {v}" for k, v in t["by_status"].items())
    rate = "-" if t["req_per_s"] is None else f"{t['req_per_s']:.1f}"
    refused = " ".join(f"{k}={v}" for k, v in t["refused"].items()) or "none"
    items = " ".join(f"{k}={v}" for k, v in t["items"].items()) or "none"
    lines = [
        f"epd top  {frame.url}  {clock or time.strftime('%H:%M:%S')}  "
        f"(quantiles: {frame.window})",
        f"requests {t['requests']} ({status or 'none'})  {rate} req/s  "
        f"in flight {t['inflight']}  refused: {refused}",
        f"items: {items}  TTFT p50 {_ms(t['ttft_p50_s'])} p99 {_ms(t['ttft_p99_s'])}  "
        f"failovers {t['failovers']}  upstream errors {t['upstream_errors']}",
        "",
        " ".join(name.ljust(width) if width else name for name, width in COLUMNS)]
    for r in frame.rows:
        cells = (r["role"], r["url"], r["state"], _n(r["inflight"]), _n(r["queue"]),
                 _n(r["requests"]), _n(r["items"]), _n(r["hits"]), _ms(r["ttft_p50_s"]),
                 _ms(r["ttft_p99_s"]), _n(r["staged_bytes"]), _probe(r["probe"]))
        lines.append(" ".join(c.ljust(w) if w else c for c, (_, w) in zip(
            cells, COLUMNS, strict=True)).rstrip())
    if not frame.rows:
        lines.append("(no instances)")
    if frame.scaling:
        lines += ["", *scaling_lines(frame.scaling)]
    return "\n".join(lines) + "\n"


def as_json(frame: Frame) -> str:
    return json.dumps({"gateway": frame.url, "window": frame.window, "totals": frame.totals,
                       "instances": frame.rows, "scaling": frame.scaling}, sort_keys=True)


# -- the command ----------------------------------------------------------------------------
def run_once(client: httpx.Client, url: str, out: TextIO, as_json_: bool) -> int:
    try:
        snap = scrape(client, url)
    except TopError as exc:
        print(f"epd top: {exc}", file=sys.stderr)
        return 1
    frame = make_frame(snap, None, url)
    out.write(as_json(frame) + "\n" if as_json_ else render(frame))
    return 0


def run_live(client: httpx.Client, url: str, interval: float, out: TextIO,
             as_json_: bool) -> int:
    """Redraw the view every `interval` seconds until Ctrl-C.

    Redraw every `interval` s until Ctrl-C (exit 0); an unreachable gateway is said and
    asked again; a refusal (401) ends it (exit 1)."""
    prev: Snapshot | None = None
    # Ctrl-C ends it even when started with SIGINT ignored (inherited: a background job of a
    # non-interactive shell, a test runner's worker)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        while True:
            try:
                snap = scrape(client, url)
            except TopError as exc:
                if exc.fatal:
                    print(f"epd top: {exc}", file=sys.stderr)
                    return 1
                text = f"epd top: {exc}; retrying every {interval:g} s (Ctrl-C quits)\n"
                out.write(text if as_json_ else HOME + text.rstrip("\n") + CLEAR_LINE + "\n"
                          + CLEAR_BELOW)
                prev = None
            else:
                frame = make_frame(snap, prev, url)
                prev = snap
                if as_json_:
                    out.write(as_json(frame) + "\n")
                else:
                    body = render(frame).rstrip("\n").replace("\n", CLEAR_LINE + "\n")
                    out.write(HOME + body + CLEAR_LINE + "\n" + CLEAR_BELOW)
            out.flush()
            time.sleep(interval)
    except KeyboardInterrupt:
        if not as_json_:
            out.write("\n")
        return 0


def main(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    p = argparse.ArgumentParser(prog="epd top", description="live view of a deployment from "
                                "its gateway's /metrics and /instances")
    p.add_argument("gateway", nargs="?", default=f"http://127.0.0.1:{GATEWAY_PORT}",
                   help=f"the gateway's base URL (default http://127.0.0.1:{GATEWAY_PORT})")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between frames "
                   "(default 2)")
    p.add_argument("--once", action="store_true", help="print one frame, no escape codes")
    p.add_argument("--json", action="store_true", help="frames as JSON, one per line")
    p.add_argument("--api-key", default=os.environ.get(CLIENT_KEY_ENV),
                   help=f"a client API key (default ${CLIENT_KEY_ENV}): a gateway with "
                   "client keys lists its instances only to a key or the admin token")
    p.add_argument("--secret-file", help="the deployment secret (default $EPD_SECRET_FILE): "
                   "without an API key, present its admin token")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per HTTP call")
    args = p.parse_args(argv)
    if args.interval <= 0:
        p.error("--interval must be > 0")
    try:
        headers = auth_headers(args.api_key, args.secret_file)
    except SecretError as exc:
        p.error(str(exc))
    url = args.gateway.rstrip("/")
    out = out or sys.stdout
    with httpx.Client(headers=headers, timeout=args.timeout, trust_env=False) as client:
        if args.once:
            return run_once(client, url, out, args.json)
        return run_live(client, url, args.interval, out, args.json)


if __name__ == "__main__":
    sys.exit(main())
