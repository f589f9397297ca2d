"""The gateway's Prometheus metrics (own registry per app: several apps can share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

STAGE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10,
                 30, 60, 120)

# label values of the counters that wait for an event (errors, retries, failovers): every
# one starts at 0, so rate() and the dashboard have a series before the first event; call
# sites use these names (tests/encoder_service/gateway/test_metrics.py)
ENCODER, DECODE = "encoder", "decode"  # `target`; decode: a (prefill/)decode instance
UPSTREAM_TARGETS = (ENCODER, DECODE)
RESUMED, REFUSED = "resumed", "refused"  # `outcome` of a failover
FAILOVER_OUTCOMES = (RESUMED, REFUSED)
START, RESUME = "start", "resume"  # `stage` of a prefill instance's whole answer (E/P/D)
PREFILL_ANSWER_STAGES = (START, RESUME)


class GatewayMetrics:
    """The gateway's Prometheus metrics: stage latencies and item outcomes.

    Stages: parse (read + validate + hash), encode (encoder calls), prefill (E/P/D: the
    prefill instance's answer, KV cache ready to hand on), first_token (decode
    request sent -> first byte back; includes the decode side's transfer wait and prefill),
    total. Item outcomes: cache_hit (already available, not encoded), encoded, fallback
    (sent as raw media after encoder failure: the decode instance encodes it), metadata_only
    (the decode instance got the item's placeholder metadata, no media bytes).
    raw_retries: metadata-only requests a decode instance failed before its first token,
    sent again with their raw media."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("epd_gateway_requests", "Requests by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.stage = Histogram("epd_gateway_stage_seconds", "Per-stage latency", ["stage"],
                               buckets=STAGE_BUCKETS, registry=r)
        # per instance (its base URL): a decode instance's first_token, a prefill instance's
        # one-token answer (E/P/D); what `epd top` shows per instance
        self.instance_first_token = Histogram(
            "epd_gateway_instance_first_token_seconds", "Seconds from a request sent to a "
            "prefill/decode instance to its first byte back (a prefill instance: its "
            "one-token answer), per instance", ["instance"], buckets=STAGE_BUCKETS,
            registry=r)
        self.items = Counter("epd_gateway_items", "Media items by outcome", ["outcome"],
                             registry=r)
        self.retries = Counter("epd_gateway_retries", "Upstream retries", ["target"],
                               registry=r)
        self.fallbacks = Counter("epd_gateway_fallbacks",
                                 "Requests sent with raw media after encoder failure",
                                 registry=r)
        self.rejected = Counter("epd_gateway_rejected", "Requests refused (4xx) by reason",
                                ["reason"], registry=r)
        self.upstream_errors = Counter("epd_gateway_upstream_errors",
                                       "Failed upstream calls", ["target"], registry=r)
        self.raw_retries = Counter("epd_gateway_raw_retries",
                                   "Metadata-only requests retried with raw media",
                                   registry=r)
        self.disconnects = Counter("epd_gateway_client_disconnects",
                                   "Client disconnects that aborted upstream requests",
                                   registry=r)
        self.failovers = Counter("epd_gateway_failovers", "Answers a decode instance broke "
                                 "off after the first byte: resumed on another, or not "
                                 "(refused: it could not be continued exactly)", ["outcome"],
                                 registry=r)
        # E/P/D (kv_handoff.py): prefill answers whose KV cache a decode instance loads
        self.kv_handoffs = Counter("epd_kv_handoffs", "Prefills whose KV cache was handed to "
                                   "a decode instance (E/P/D)", registry=r)
        self.kv_handoff_failures = Counter(
            "epd_kv_handoff_failures", "Prefills that handed no KV cache on: the decode "
            "instance computed the prompt itself", ["reason"], registry=r)
        # E/P/D: answers a prefill instance gave in full because no decode instance could
        # (at the request's start, or to continue a stream whose decode instance died)
        self.prefill_answers = Counter(
            "epd_prefill_answers", "Requests (or continued streams) a prefill instance "
            "answered in full because no decode instance was usable (E/P/D)", ["stage"],
            registry=r)
        for stage in PREFILL_ANSWER_STAGES:
            self.prefill_answers.labels(stage)
        for target in UPSTREAM_TARGETS:  # every known label set at 0
            self.retries.labels(target)
            self.upstream_errors.labels(target)
        for outcome in FAILOVER_OUTCOMES:
            self.failovers.labels(outcome)
        # children bound once: labels() is a dict lookup under a lock on every call
        self.stage_parse = self.stage.labels("parse")
        self.stage_encode = self.stage.labels("encode")
        self.stage_prefill = self.stage.labels("prefill")  # E/P/D: the prefill hop
        self.stage_first_token = self.stage.labels("first_token")
        self.stage_total = self.stage.labels("total")
        self.items_hit = self.items.labels("cache_hit")
        self.items_encoded = self.items.labels("encoded")
        self.items_metadata_only = self.items.labels("metadata_only")
        self.items_shared = self.items.labels("shared")  # another request's encode, shared
        # sent to the decode instance while being encoded (routing.overlap)
        self.items_overlapped = self.items.labels("overlapped")
        self.encoder_call_items = Histogram(
            "epd_gateway_encoder_call_items", "Items per call sent to an encoder (vLLM "
            "encoders: concurrent requests' images share calls, routing.coalesce_items)",
            buckets=(1, 2, 4, 8, 16, 32), registry=r)
        self.inflight = Gauge("epd_gateway_inflight_requests", "Requests in flight",
                              registry=r)
        # traces (tracing.py, when on): spans exported, dropped (the export queue was full)
        # or failed (the collector refused or did not answer)
        self.trace_spans = Counter("epd_gateway_trace_spans", "Spans of the gateway's traces "
                                   "by outcome: exported, dropped, failed", ["outcome"],
                                   registry=r)
        # counted by `epd up`'s supervisor (local/supervise.py), which runs the gateway;
        # each instance at 0 once registered (`instance_registered`)
        self.restarts = Counter("epd_restarts", "Servers restarted after they exited unasked "
                                "(epd up)", ["instance"], registry=r)

        # each role's load (upstreams/fleet.py `load`): what a Kubernetes HPA scales on
        self.load = Gauge("epd_gateway_load", "Each role's load: encoder calls in flight + "
                          "images waiting for a shared call; decode requests in flight",
                          ["role"], registry=r)
        # `epd up`'s scaler (local/scaler.py), which runs the gateway; each elastic role's
        # label sets at 0 once registered (`scaling_registered`)
        self.scale_events = Counter("epd_scale_events", "Instances added (up) or drained "
                                    "and stopped (down) by epd up's scaler, by role and "
                                    "reason", ["role", "direction", "reason"], registry=r)
        self.instances = Gauge("epd_instances", "Instances of an elastic role by state: "
                               "wanted, starting, serving, draining (epd up's scaler)",
                               ["role", "state"], registry=r)

    def watch_load(self, load) -> None:
        """Export `load()` (role -> load) as epd_gateway_load, read at scrape time."""
        for role in load():
            self.load.labels(role).set_function(lambda role=role: load().get(role, 0.0))

    def scaling_registered(self, role: str) -> None:
        """An elastic role's scale events exported at 0 before its first."""
        for direction, reason in (("up", "load_above_target"), ("down", "idle")):
            self.scale_events.labels(role, direction, reason)

    def instance_registered(self, name: str) -> None:
        """Export a supervised server's restart count, at 0 until it restarts.

        A server `epd up` supervises (encoder-0, decode-1, mooncake-master, ...): its
        restart count exported at 0 before its first restart."""
        self.restarts.labels(name)
