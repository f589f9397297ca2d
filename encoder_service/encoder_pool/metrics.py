"""Prometheus metrics of the encoder pool, read at scrape time.

Prometheus metrics of the encoder pool, read from the pool and its FeatureStore at scrape
time (so gauges can never drift from the real state)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from encoder_service.encoder_pool.batching import EncoderPool
from encoder_service.encoder_pool.lifecycle import PoolItemState

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class PoolCollector(Collector):
    def __init__(self, pool: EncoderPool, publisher=None) -> None:
        self.pool = pool
        self.publisher = publisher

    def collect(self) -> Iterator[Metric]:
        store, stats = self.pool.store, self.pool.stats
        g = GaugeMetricFamily("epd_pool_features", "Features per lifecycle state",
                              labels=["state"])
        for state, n in store.counts().items():
            g.add_metric([state.value], n)
        yield g
        g = GaugeMetricFamily("epd_pool_state_bytes", "Feature bytes per lifecycle state",
                              labels=["state"])
        for state, n in store.bytes_by_state().items():
            g.add_metric([state.value], n)
        yield g
        for name, doc, value in (  # one tier, "cpu": features live in host memory
            ("epd_pool_feature_bytes", "Feature bytes held per tier", store.used),
            ("epd_pool_feature_budget_bytes", "Feature byte budget per tier", store.budget),
            ("epd_pool_feature_peak_bytes", "Peak feature bytes per tier", store.peak),
        ):
            g = GaugeMetricFamily(name, doc, labels=["tier"])
            g.add_metric(["cpu"], value)
            yield g
        g = GaugeMetricFamily("epd_pool_queue_depth", "Queued items per modality",
                              labels=["modality"])
        for m in self.pool.modalities:
            g.add_metric([m], self.pool.queue_depth(m))
        yield g
        g = GaugeMetricFamily("epd_pool_worker_outstanding_tokens",
                              "Tokens dispatched to a worker and not finished", labels=["worker"])
        for w in self.pool.workers:
            g.add_metric([w.name], w.outstanding_tokens)
        yield g
        for name, doc, value in (
            ("epd_pool_batches", "Encoder batches run", stats.batches),
            ("epd_pool_items_encoded", "Items encoded", stats.items_encoded),
            ("epd_pool_oom_failures", "Items out of memory even when encoded alone",
             stats.oom_failures),
            ("epd_pool_reuse_hits", "Items answered without encoding (in memory, or "
             "published and still stored)",
             stats.reuse_hits),
            ("epd_pool_chunked_items", "Videos encoded in chunks of temporal groups",
             stats.chunked_items),
            ("epd_pool_chunks", "Chunks those videos were encoded in", stats.chunks),
            ("epd_pool_evictions", "ENCODED_CPU features evicted for budget", store.evictions),
            ("epd_pool_discarded", "Features discarded", store.discarded),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        for name, doc, values in (
            ("epd_pool_items_failed", "Items that failed, by code", stats.items_failed),
            ("epd_pool_rejected", "Admissions refused, by reason", stats.rejected),
        ):
            c = CounterMetricFamily(name, doc, labels=["code"])
            for code, v in values.items():
                c.add_metric([code], v)
            yield c
        if self.publisher is not None:
            yield CounterMetricFamily("epd_pool_published", "Items written to the transport",
                                      value=self.publisher.published)
            yield CounterMetricFamily("epd_pool_published_bytes", "Bytes written to the "
                                      "transport", value=self.publisher.published_bytes)


def make_registry(pool: EncoderPool, publisher=None) -> tuple[CollectorRegistry, Histogram]:
    """Make a pool's own metrics registry and its batch-size histogram.

    A registry of its own (several pools may live in one process, e.g. tests) with the
    pool collector and a batch-size histogram the pool feeds through `on_batch`."""
    registry = CollectorRegistry()
    registry.register(PoolCollector(pool, publisher))
    hist = Histogram("epd_pool_batch_size", "Items per encoder batch", buckets=BATCH_BUCKETS,
                     registry=registry)
    return registry, hist


__all__ = ["PoolItemState", "PoolCollector", "make_registry"]
