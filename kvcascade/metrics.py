"""Prometheus metrics of the tiering coordinator, in the shape of vLLM's
``vllm:kv_offload_tiering_*`` (``kv_offload/tiering/metrics.py``), exported under ``kvcascade_*``
names.

Tier label values follow vLLM: ``"0:primary"`` for the CPU primary tier and ``"<i+1>:<name>"`` for
secondary tier ``i``. Each :class:`TieringMetrics` registers into its own
:class:`prometheus_client.CollectorRegistry` unless one is given, so several cascades in one
process never collide; expose it with ``prometheus_client.generate_latest(metrics.registry)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_Metric = TypeVar("_Metric", Counter, Gauge, Histogram)

#: Histogram buckets of transfer times, seconds.
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class TieringMetrics:
    """Counters, histograms and gauges of one coordinator.

    Args:
        tier_names: names of the secondary tiers in cascade order.
        registry: where to register (default: a fresh registry).

    Attributes (all labelled by ``tier`` unless noted):
        block_queries / block_hits: lookups answered by a tier / of them HIT (counted per
            lookup call that reached the tier).
        read_bytes / read_seconds: promotions (secondary → primary), bytes of successful keys.
        write_bytes / write_seconds: cascades (primary → secondary).
        promotion_job_failures / cascade_job_failures: failed jobs.
        promotion_allocation_failures: promotions refused because the primary was full
            (unlabelled).
        expired_writes: primary writes failed by ``pending_write_timeout_s`` (unlabelled).
        active_promotion_jobs / active_cascade_jobs: jobs in flight (gauges).
        primary_write_usage / primary_read_usage: fraction of primary slots being written /
            pinned by reads (gauges, unlabelled).
        cascade_queued_blocks: blocks of cascades admitted and not finished, each pinned in the
            primary (gauge; :mod:`kvcascade.backpressure`).
        cascade_dropped_blocks: blocks of cascades dropped by back-pressure (never submitted).
        cascade_throughput_bytes: the tier's recent cascade finishing rate, bytes per second
            (gauge; 0 until measured).
        tier_degraded: 1 while the tier is degraded (its probes or loads kept missing their
            deadlines: probes miss and cascades to it are skipped; kvcascade/tiers/_health.py),
            else 0 (gauge).
    """

    def __init__(
        self, tier_names: Sequence[str], registry: CollectorRegistry | None = None
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._series: dict[tuple[int, str], Counter | Gauge | Histogram] = {}
        r = self.registry
        self.labels = ["0:primary", *(f"{i + 1}:{name}" for i, name in enumerate(tier_names))]
        self.block_queries = Counter("kvcascade_block_queries", "Lookups", ["tier"], registry=r)
        self.block_hits = Counter("kvcascade_block_hits", "Lookup hits", ["tier"], registry=r)
        self.read_bytes = Counter("kvcascade_read_bytes", "Promoted bytes", ["tier"], registry=r)
        self.read_seconds = Histogram(
            "kvcascade_read_seconds",
            "Promotion job time",
            ["tier"],
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.write_bytes = Counter("kvcascade_write_bytes", "Cascaded bytes", ["tier"], registry=r)
        self.write_seconds = Histogram(
            "kvcascade_write_seconds",
            "Cascade job time",
            ["tier"],
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.promotion_job_failures = Counter(
            "kvcascade_promotion_job_failures", "Failed promotion jobs", ["tier"], registry=r
        )
        self.cascade_job_failures = Counter(
            "kvcascade_cascade_job_failures", "Failed cascade jobs", ["tier"], registry=r
        )
        self.promotion_allocation_failures = Counter(
            "kvcascade_promotion_allocation_failures",
            "Promotions refused: primary full",
            registry=r,
        )
        self.expired_writes = Counter(
            "kvcascade_expired_writes", "Primary writes failed at their deadline", registry=r
        )
        self.active_promotion_jobs = Gauge(
            "kvcascade_active_promotion_jobs", "Promotion jobs in flight", ["tier"], registry=r
        )
        self.active_cascade_jobs = Gauge(
            "kvcascade_active_cascade_jobs", "Cascade jobs in flight", ["tier"], registry=r
        )
        self.primary_write_usage = Gauge(
            "kvcascade_primary_write_usage_perc", "Primary slots being written", registry=r
        )
        self.primary_read_usage = Gauge(
            "kvcascade_primary_read_usage_perc", "Primary slots pinned by reads", registry=r
        )

        self.cascade_queued_blocks = Gauge(
            "kvcascade_cascade_queued_blocks",
            "Cascade blocks admitted, not finished (pinned)",
            ["tier"],
            registry=r,
        )
        self.cascade_dropped_blocks = Counter(
            "kvcascade_cascade_dropped_blocks",
            "Cascade blocks dropped by back-pressure",
            ["tier"],
            registry=r,
        )
        self.cascade_throughput_bytes = Gauge(
            "kvcascade_cascade_throughput_bytes",
            "Recent cascade finishing rate, bytes/s",
            ["tier"],
            registry=r,
        )
        self.tier_degraded = Gauge(
            "kvcascade_tier_degraded",
            "1 while the tier is degraded (missed deadlines), else 0",
            ["tier"],
            registry=r,
        )

    def series(self, metric: _Metric, label: str) -> _Metric:
        """``metric.labels(label)``, created on first use and cached (nothing here ever removes
        a labelled child). ``prometheus_client``'s ``labels`` validates the values and takes
        the metric's lock on every call; uncached it was a fifth of the coordinator's µs per key
        in ``benchmarks/kvcascade_impl.py``."""
        key = (id(metric), label)
        child = self._series.get(key)
        if child is None:
            child = self._series[key] = metric.labels(label)
        return child  # type: ignore[return-value]

    def tier_label(self, tier_idx: int | None) -> str:
        """Label of secondary tier ``tier_idx`` (None: the primary)."""
        return self.labels[0 if tier_idx is None else tier_idx + 1]

    def value(self, name: str, tier_idx: int | None = None) -> float:
        """Current value of a counter or gauge (``name`` without ``kvcascade_`` or ``_total``)."""
        labels = {} if name in _UNLABELLED else {"tier": self.tier_label(tier_idx)}
        sample = "_total" if name not in _GAUGES else ""
        got = self.registry.get_sample_value(f"kvcascade_{name}{sample}", labels)
        return got or 0.0


_UNLABELLED = {
    "promotion_allocation_failures",
    "expired_writes",
    "primary_write_usage_perc",
    "primary_read_usage_perc",
}
_GAUGES = {
    "cascade_queued_blocks",
    "cascade_throughput_bytes",
    "tier_degraded",
    "active_promotion_jobs",
    "active_cascade_jobs",
    "primary_write_usage_perc",
    "primary_read_usage_perc",
}
