"""Connector statistics: vLLM's ECConnectorStats (log lines) and Prometheus metrics."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm.distributed.ec_transfer.ec_connector.metrics import (
    ECConnectorPromMetrics,
    ECConnectorStats,
)

from ec_connectors.protocol.stored import TRANSPORT_NAMES
from scheduler_hooks.item_table import LIFECYCLE

COUNTERS = {
    # name: help
    "saves": "Embeddings written to the transport",
    "save_bytes": "Bytes of embeddings written",
    "save_failures": "Saves that failed or were dropped",
    "skipped_saves": "Encodes skipped because the item was already stored",
    "loads": "Embeddings loaded from the transport into vLLM's encoder cache",
    "load_bytes": "Bytes of embeddings loaded",
    "load_failures": "Loads that failed (missing, corrupt, timed out, staging full)",
    "corrupt": "Stored items rejected by integrity checks",
    "evictions": "Stored items evicted by the byte budget",
    "hits": "Scheduler lookups that found an item ready",
    "inline_loads": "Small items the scheduler read itself and handed to the workers in "
                    "the step's metadata (inline_max_bytes): no deferral, no worker round trip",
    "engine_cache_hits": "Items a request took from vLLM's encoder cache (held for another "
                         "request): no load, no wait",
    "prefix_cached": "Items whose tokens the prefix cache already holds (num_computed_tokens "
                     "covers them): neither waited for nor transferred",
    "unwanted_drops": "Staged items dropped because no request waits for them any more",
    "staged_bytes": "Bytes staged on workers (loaded, waiting to be placed)",
    "unstaged_bytes": "Bytes that left staging (placed, dropped or expired); staged minus "
                      "unstaged is what workers hold now",
    "deferrals": "Scheduler steps a request waited for its items",
    "timeouts": "Items that missed their load deadline",
    "pull_timeouts": "Pulls a producer did not answer in time (frozen or overloaded peer)",
    "peer_disconnects": "Pulls cut short because the producer's process went away",
    "transport_down": "Times a transport was found down (e.g. a dead store master); "
                      "its tier is skipped until it answers",
    "held_in_place": "Producer: items held where they lie (nixl: their own memory registered, "
                     "no copy into the pool)",
    "local_encode_fallbacks": "Items encoded locally because the transport could not deliver",
    "failed_requests": "Requests failed because an item was unavailable (policy: fail)",
    "budget_waits": "Scheduler steps an item waited for room in the staging budget "
                    "(max_staged_bytes)",
    "lifecycle_errors": "Feature lifecycle moves its transition table refused (a bug; the "
                        "item left the books)",
}
TIERS = TRANSPORT_NAMES  # every transport can be a tier (config.transport)
for _tier in TIERS:
    COUNTERS.update({
        f"tier_{_tier}_hits": f"Loads the {_tier} tier delivered",
        f"tier_{_tier}_misses": f"Loads the {_tier} tier was asked for and did not have",
        f"tier_{_tier}_bytes": f"Bytes the {_tier} tier delivered",
        f"tier_{_tier}_skipped": f"Loads that skipped the {_tier} tier because it was down",
        f"tier_{_tier}_put_failures": f"Saves the {_tier} tier did not take",
    })
# Gauges: name -> (help, label); the value is per label value, the newest report wins.
GAUGES = {
    "feature_bytes": ("Consumer: bytes of features per lifecycle state (loading and staged: "
                      "held by the connector, budget max_staged_bytes; merged and prefilled: "
                      "in vLLM's encoder cache)", "state"),
    "producer_feature_bytes": ("Producer: bytes of encoder outputs per lifecycle state "
                               "(encoded_cpu: host copies queued for or being written to the "
                               "transport, budget max_pending_save_bytes)", "state"),
}
GAUGE_LABELS = {"feature_bytes": [s.value for s in LIFECYCLE],
                "producer_feature_bytes": ["encoded_cpu"]}
# One request's path, stage by stage (producer: save_wait, save; consumer: loader_wait, get,
# load = prefetch -> staged on every rank, staged_to_scheduled, defer = the whole wait).
LATENCIES = {
    "save_wait_s": "Producer: seconds an encoder output waited for the writer thread",
    "save_s": "Producer: seconds to write one embedding into the transport",
    "loader_wait_s": "Consumer worker: seconds a prefetch waited for a loader thread",
    "get_s": "Consumer worker: seconds the transport took to deliver (and verify) one item",
    "load_s": "Consumer: seconds from prefetch sent to staged on every worker, per item",
    "staged_to_scheduled_s": "Consumer: seconds from an item staged to its request scheduled",
    "defer_s": "Consumer: seconds a request was deferred waiting for its items",
    "pending_s": "Consumer: seconds from a pending item's first request (sent while it was "
                 "encoded) to the item landing here",
    **{f"tier_{t}_get_s": f"Seconds the {t} tier took to deliver one item" for t in TIERS},
}


@dataclass
class EPDStats(ECConnectorStats):
    """The connector's stats for one interval: counters, latencies and gauges.

    `data` = {"counters": {name: number}, "latency": {name: [seconds, ...]},
    "gauges": {name: {label value: number}}} (gauges: the newest values)."""

    def __post_init__(self) -> None:
        self.data.setdefault("counters", {})
        self.data.setdefault("latency", {})
        self.data.setdefault("gauges", {})

    def reset(self) -> None:
        self.data = {"counters": {}, "latency": {}, "gauges": {}}

    def aggregate(self, other: ECConnectorStats) -> EPDStats:
        counters, latency = self.data["counters"], self.data["latency"]
        for k, v in other.data.get("counters", {}).items():
            counters[k] = counters.get(k, 0) + v
        for k, v in other.data.get("latency", {}).items():
            latency.setdefault(k, []).extend(v)
        self.data.setdefault("gauges", {}).update(other.data.get("gauges", {}))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.data["counters"])
        for k, values in self.data["latency"].items():
            if values:
                ordered = sorted(values)
                out[f"{k}_p50_ms"] = round(ordered[len(ordered) // 2] * 1e3, 3)
                out[f"{k}_max_ms"] = round(ordered[-1] * 1e3, 3)
        for k, values in self.data.get("gauges", {}).items():
            out.update({f"{k}_{label}": v for label, v in values.items()})
        return out

    def is_empty(self) -> bool:
        return (not self.data["counters"] and not any(self.data["latency"].values())
                and not self.data.get("gauges"))


class StatsRecorder:
    """Thread-safe accumulator; `take()` hands the interval's stats to vLLM and resets.

    Gauges kept elsewhere are published by their `on_take` flushers, called (outside this lock)
    before `take()` and `pending` look: once per look, only what changed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = EPDStats()
        self.totals: dict[str, float] = {}
        self._flushers: list[Callable[[], None]] = []

    def on_take(self, flush: Callable[[], None]) -> None:
        self._flushers.append(flush)

    def _flush(self) -> None:
        for flush in self._flushers:
            flush()

    def inc(self, name: str, value: float = 1) -> None:
        with self._lock:
            c = self._stats.data["counters"]
            c[name] = c.get(name, 0) + value
            self.totals[name] = self.totals.get(name, 0) + value

    def observe(self, name: str, seconds: float) -> None:
        with self._lock:
            self._stats.data["latency"].setdefault(name, []).append(seconds)

    def gauge(self, name: str, values: dict[str, float]) -> None:
        """The gauge's current values (the next `take()` carries the newest)."""
        with self._lock:
            self._stats.data["gauges"][name] = dict(values)

    def merge(self, data: dict[str, Any]) -> None:
        """Fold another recorder's `take().data` into this one."""
        with self._lock:
            self._stats.aggregate(EPDStats(data=data))
            for k, v in data.get("counters", {}).items():
                self.totals[k] = self.totals.get(k, 0) + v

    @property
    def pending(self) -> bool:
        """Stats recorded since the last `take()`."""
        self._flush()
        with self._lock:
            return not self._stats.is_empty()

    def take(self) -> EPDStats | None:
        self._flush()
        with self._lock:
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, EPDStats()
            return stats


class EPDPromMetrics(ECConnectorPromMetrics):
    """The connector's Prometheus metrics, per engine.

    Counters `vllm:epd_<name>_total`, histograms `vllm:epd_<name>_seconds` and gauges
    `vllm:epd_<name>{<label>=...}` per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        self._hists: dict[str, dict[int, Any]] = {}
        for name, doc in COUNTERS.items():
            metric = self._counter_cls(name=f"vllm:epd_{name}", documentation=doc,
                                       labelnames=labelnames)
            self._counters[name] = {
                idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()
            }
        buckets = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10]
        for name, doc in LATENCIES.items():
            metric = self._histogram_cls(name=f"vllm:epd_{name.removesuffix('_s')}_seconds",
                                         documentation=doc, labelnames=labelnames,
                                         buckets=buckets)
            self._hists[name] = {
                idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()
            }
        self._gauges: dict[str, dict[int, dict[str, Any]]] = {}
        for name, (doc, label) in GAUGES.items():
            metric = self._gauge_cls(name=f"vllm:epd_{name}", documentation=doc,
                                     multiprocess_mode="mostrecent",
                                     labelnames=[*labelnames, label])
            self._gauges[name] = {  # every label value exported from the start (0)
                idx: {v: metric.labels(*values, v) for v in GAUGE_LABELS[name]}
                for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.get("counters", {}).items():
            per_engine = self._counters.get(name)
            if per_engine and engine_idx in per_engine and value:
                per_engine[engine_idx].inc(value)
        for name, values in transfer_stats_data.get("latency", {}).items():
            per_engine = self._hists.get(name)
            if per_engine and engine_idx in per_engine:
                for v in values:
                    per_engine[engine_idx].observe(v)
        for name, values in transfer_stats_data.get("gauges", {}).items():
            children = self._gauges.get(name, {}).get(engine_idx, {})
            for label, v in values.items():
                if label in children:
                    children[label].set(v)
