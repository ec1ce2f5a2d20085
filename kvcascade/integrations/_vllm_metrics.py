"""kvcascade's transfer and tier statistics in vLLM's ``/metrics`` (vLLM's connector stats).

vLLM's connector-stats path (``vllm/distributed/kv_transfer/kv_connector/v1/metrics.py``): each
engine step the scheduler calls the scheduler-side connector's ``get_kv_connector_stats()`` and
ships the payload (``KVConnectorStats.to_dict()``) to the API server, which rebuilds it with the
connector class's ``build_kv_connector_stats`` and records it through the metrics object of
``build_prom_metrics`` into its Prometheus registry (served at ``/metrics``).

The payload is vLLM's own ``OffloadingConnectorStats`` (``.../offloading/metrics.py``):
``{"types": {name: "counter" | "gauge"}, "data": {name: {labelvalues: value}}}``, counters as
increments since the previous call, gauges as the latest value. Names are in the shape of vLLM's
OffloadingConnector and tiering manager (``vllm:kv_offload_*``, ``vllm:kv_offload_tiering_*``);
per-tier metrics carry vLLM's ``tier`` label (``"0:primary"``, ``"1:fs"``, ...). The table is
:data:`METRICS`; ``docs/vllm.md`` (*Metrics*) lists it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    PromMetric,
    PromMetricT,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)

log = logging.getLogger(__name__)

_COUNTER = "counter"
_GAUGE = "gauge"


@dataclass(frozen=True)
class _Metric:
    kind: str  # _COUNTER or _GAUGE
    documentation: str
    tiered: bool  # labelled by ``tier``


#: vLLM metric name → kind, help text, per-tier.
METRICS: dict[str, _Metric] = {
    "vllm:kv_offload_load_bytes": _Metric(
        _COUNTER, "Bytes loaded from the CPU tier to GPU.", False
    ),
    "vllm:kv_offload_load_time": _Metric(
        _COUNTER, "Copy time of loads from the CPU tier to GPU, in seconds.", False
    ),
    "vllm:kv_offload_store_bytes": _Metric(
        _COUNTER, "Bytes stored from GPU to the CPU tier.", False
    ),
    "vllm:kv_offload_store_time": _Metric(
        _COUNTER, "Copy time of stores from GPU to the CPU tier, in seconds.", False
    ),
    "vllm:kv_offload_loaded_chunks": _Metric(_COUNTER, "Chunks of successful loads.", False),
    "vllm:kv_offload_stored_chunks": _Metric(_COUNTER, "Chunks accepted for storing.", False),
    "vllm:kv_offload_failed_loads": _Metric(_COUNTER, "Load jobs that failed (recomputed).", False),
    "vllm:kv_offload_failed_stores": _Metric(_COUNTER, "Store jobs that failed.", False),
    "vllm:kv_offload_allocation_failure": _Metric(
        _COUNTER, "Store allocations refused: the CPU tier had no room.", False
    ),
    "vllm:kv_offload_tiering_chunk_queries": _Metric(
        _COUNTER, "Chunk lookups answered by the tier.", True
    ),
    "vllm:kv_offload_tiering_chunk_hits": _Metric(_COUNTER, "Chunk lookups that hit.", True),
    "vllm:kv_offload_tiering_read_bytes": _Metric(
        _COUNTER, "Bytes promoted from the tier into the CPU tier.", True
    ),
    "vllm:kv_offload_tiering_read_time": _Metric(
        _COUNTER, "Time of promotion jobs from the tier, in seconds.", True
    ),
    "vllm:kv_offload_tiering_write_bytes": _Metric(
        _COUNTER, "Bytes cascaded from the CPU tier into the tier.", True
    ),
    "vllm:kv_offload_tiering_write_time": _Metric(
        _COUNTER, "Time of cascade jobs into the tier, in seconds.", True
    ),
    "vllm:kv_offload_tiering_promotion_job_failures": _Metric(
        _COUNTER, "Failed promotion jobs.", True
    ),
    "vllm:kv_offload_tiering_cascade_job_failures": _Metric(_COUNTER, "Failed cascade jobs.", True),
    "vllm:kv_offload_tiering_backpressure_blocks_dropped": _Metric(
        _COUNTER, "Cascade blocks dropped by back-pressure.", True
    ),
    "vllm:kv_offload_tiering_promotion_allocation_failures": _Metric(
        _COUNTER, "Promotions refused: the CPU tier was full.", False
    ),
    "vllm:kv_offload_tiering_expired_writes": _Metric(
        _COUNTER, "CPU-tier writes failed at their deadline (pending_write_timeout_s).", False
    ),
    "vllm:kv_offload_tiering_active_promotion_jobs": _Metric(
        _GAUGE, "Promotion jobs in flight.", True
    ),
    "vllm:kv_offload_tiering_active_cascade_jobs": _Metric(_GAUGE, "Cascade jobs in flight.", True),
    "vllm:kv_offload_tiering_cascade_queued_blocks": _Metric(
        _GAUGE, "Cascade blocks admitted and not finished (pinned in the CPU tier).", True
    ),
    "vllm:kv_offload_tiering_primary_write_usage_perc": _Metric(
        _GAUGE, "Fraction of CPU-tier slots being written.", False
    ),
    "vllm:kv_offload_tiering_primary_read_usage_perc": _Metric(
        _GAUGE, "Fraction of CPU-tier slots pinned by reads.", False
    ),
}

#: The connector's flat ``transfer_stats()`` keys → metric names.
_CONNECTOR = {
    "load_bytes": "vllm:kv_offload_load_bytes",
    "load_seconds": "vllm:kv_offload_load_time",
    "store_bytes": "vllm:kv_offload_store_bytes",
    "store_seconds": "vllm:kv_offload_store_time",
    "loaded_chunks": "vllm:kv_offload_loaded_chunks",
    "stored_chunks": "vllm:kv_offload_stored_chunks",
    "failed_loads": "vllm:kv_offload_failed_loads",
    "failed_stores": "vllm:kv_offload_failed_stores",
    "allocation_failures": "vllm:kv_offload_allocation_failure",
}

#: The coordinator's samples (``TieringCoordinator.get_stats`` keys before the tier) → names.
_TIERS = {
    "kvcascade_block_queries_total": "vllm:kv_offload_tiering_chunk_queries",
    "kvcascade_block_hits_total": "vllm:kv_offload_tiering_chunk_hits",
    "kvcascade_read_bytes_total": "vllm:kv_offload_tiering_read_bytes",
    "kvcascade_read_seconds_sum": "vllm:kv_offload_tiering_read_time",
    "kvcascade_write_bytes_total": "vllm:kv_offload_tiering_write_bytes",
    "kvcascade_write_seconds_sum": "vllm:kv_offload_tiering_write_time",
    "kvcascade_promotion_job_failures_total": "vllm:kv_offload_tiering_promotion_job_failures",
    "kvcascade_cascade_job_failures_total": "vllm:kv_offload_tiering_cascade_job_failures",
    "kvcascade_cascade_dropped_blocks_total": "vllm:kv_offload_tiering_backpressure_blocks_dropped",
    "kvcascade_promotion_allocation_failures_total": (
        "vllm:kv_offload_tiering_promotion_allocation_failures"
    ),
    "kvcascade_expired_writes_total": "vllm:kv_offload_tiering_expired_writes",
    "kvcascade_active_promotion_jobs": "vllm:kv_offload_tiering_active_promotion_jobs",
    "kvcascade_active_cascade_jobs": "vllm:kv_offload_tiering_active_cascade_jobs",
    "kvcascade_cascade_queued_blocks": "vllm:kv_offload_tiering_cascade_queued_blocks",
    "kvcascade_primary_write_usage_perc": "vllm:kv_offload_tiering_primary_write_usage_perc",
    "kvcascade_primary_read_usage_perc": "vllm:kv_offload_tiering_primary_read_usage_perc",
}


class StatsDeltas:
    """Turns cumulative values into one step's ``OffloadingConnectorStats`` (scheduler side).

    Counters are reported as the increase since the previous :meth:`take`, gauges when their
    value changed; a step with nothing new gives None (vLLM then sends no connector stats).
    """

    def __init__(self) -> None:
        self._last: dict[tuple[str, tuple[str, ...]], float] = {}

    def take(
        self, connector: dict[str, float], tiers: dict[str, float]
    ) -> OffloadingConnectorStats | None:
        """One step's payload.

        Args:
            connector: cumulative ``KVCascadeConnector.transfer_stats()`` (bytes, seconds,
                counts).
            tiers: ``TieringCoordinator.get_stats()`` (``"<sample>[:<tier label>]"`` → value).
        """
        values: dict[tuple[str, tuple[str, ...]], float] = {}
        for key, name in _CONNECTOR.items():
            values[(name, ())] = float(connector.get(key, 0.0))
        for key, value in tiers.items():
            sample, _, tier = key.partition(":")
            name = _TIERS.get(sample)
            if name is not None:
                values[(name, (tier,) if METRICS[name].tiered else ())] = value
        stats = OffloadingConnectorStats()
        for (name, labels), value in values.items():
            last = self._last.get((name, labels))
            if METRICS[name].kind == _COUNTER:
                if value > (last or 0.0):
                    stats.increase_counter(name, value - (last or 0.0), labels)
            elif value != last:
                stats.set_gauge(name, value, labels)
        self._last = values
        return None if stats.is_empty() else stats


class KVCascadePromMetrics(KVConnectorPromMetrics):
    """The :data:`METRICS` in the API server's Prometheus registry (``build_prom_metrics``).

    Label names: vLLM's per-engine labels (``model_name``, ``engine``), then ``tier`` for the
    per-tier metrics. The series without ``tier`` exist (at 0) from the start; a per-tier series
    appears with its tier's first report. A payload name this version does not know is logged
    once and skipped.
    """

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, Any] = {}
        for name, metric in METRICS.items():
            names = [*labelnames, "tier"] if metric.tiered else list(labelnames)
            if metric.kind == _COUNTER:
                self._metrics[name] = self._counter_cls(
                    name=name, documentation=metric.documentation, labelnames=names
                )
            else:  # one engine reports each gauge; the freshest value is the right one
                self._metrics[name] = self._gauge_cls(
                    name=name,
                    documentation=metric.documentation,
                    labelnames=names,
                    multiprocess_mode="mostrecent",
                )
        self._unknown: set[str] = set()
        for labels in per_engine_labelvalues.values():  # zero until the first report
            for name, metric in METRICS.items():
                if not metric.tiered:
                    self._metrics[name].labels(*labels)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one payload (``OffloadingConnectorStats.data``) for engine ``engine_idx``."""
        engine_labels = self.per_engine_labelvalues[engine_idx]
        for name, by_labels in transfer_stats_data.get("data", {}).items():
            metric = self._metrics.get(name)
            if metric is None:
                if name not in self._unknown:
                    self._unknown.add(name)
                    log.warning("kvcascade: unknown connector metric %r skipped", name)
                continue
            for labels, value in by_labels.items():
                child = metric.labels(*engine_labels, *labels)
                if METRICS[name].kind == _COUNTER:
                    child.inc(value)
                else:
                    child.set(value)
