"""kvcascade's events and statistics in vLLM's own types, without a server (issue #16).

``tests/integrations/test_vllm_serve.py`` checks both end to end (a ZMQ subscriber, ``/metrics``);
here the cases a short serving run does not reach: secondary-tier removals, gauges that do not
change, counters that do not grow, a payload name this version does not know, and the msgpack round
trip vLLM's engine core → API server hop makes of a payload.
"""

from __future__ import annotations

import logging
import warnings
from types import SimpleNamespace
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm", reason="vLLM is not installed in this environment")
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from kvcascade.integrations._vllm_events import vllm_kv_events
    from kvcascade.integrations._vllm_metrics import METRICS, StatsDeltas
    from kvcascade.integrations.vllm import KVCascadeConnector
    from kvcascade.scheduler import BlockEvent

H1, H2 = bytes(range(32)), bytes(range(1, 33))


def test_events_keep_order_medium_tier_and_vllm_hashes() -> None:
    events = vllm_kv_events(
        [
            BlockEvent([H1, H2], 0, "CPU", False, "cpu"),
            BlockEvent([H1], 1, "STORAGE", False, "s3"),
            BlockEvent([H2], 0, "CPU", True, "cpu"),
            BlockEvent([H1], 1, "STORAGE", True, "s3"),
        ]
    )
    assert [type(e) for e in events] == [BlockStored, BlockStored, BlockRemoved, BlockRemoved]
    assert [(e.medium, e.ownership, e.group_idx) for e in events] == [
        ("CPU", None, 0),
        ("STORAGE", "s3", 1),
        ("CPU", None, 0),
        ("STORAGE", "s3", 1),
    ]
    assert events[0].block_hashes == [maybe_convert_block_hash(H1), maybe_convert_block_hash(H2)]
    assert (events[0].token_ids, events[0].block_size, events[0].parent_block_hash) == ([], 0, None)


def test_stats_deltas_report_increments_and_changed_gauges() -> None:
    deltas = StatsDeltas()
    tiers = {
        "kvcascade_block_hits_total:1:fs": 3.0,
        "kvcascade_active_cascade_jobs:1:fs": 1.0,
        "kvcascade_primary_write_usage_perc": 0.5,
        "kvcascade_read_seconds_bucket:1:fs": 7.0,  # not exported: a histogram bucket
    }
    first = deltas.take({"load_bytes": 100.0, "stores": 4}, tiers)
    assert first is not None
    data = first.data["data"]
    assert data["vllm:kv_offload_load_bytes"] == {(): 100.0}
    assert data["vllm:kv_offload_tiering_chunk_hits"] == {("1:fs",): 3.0}
    assert data["vllm:kv_offload_tiering_active_cascade_jobs"] == {("1:fs",): 1.0}
    assert data["vllm:kv_offload_tiering_primary_write_usage_perc"] == {(): 0.5}
    assert "vllm:kv_offload_store_bytes" not in data  # 0: nothing to add
    assert deltas.take({"load_bytes": 100.0}, tiers) is None  # nothing new
    third = deltas.take({"load_bytes": 150.0}, {**tiers, "kvcascade_active_cascade_jobs:1:fs": 0})
    assert third is not None
    assert third.data["data"] == {
        "vllm:kv_offload_load_bytes": {(): 50.0},
        "vllm:kv_offload_tiering_active_cascade_jobs": {("1:fs",): 0},
    }


def registry_types(reg: CollectorRegistry) -> dict[type, type]:
    def bound(cls: type) -> type:
        return type(cls.__name__, (cls,), {"__init__": _init_with(cls, reg)})

    return {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)}


def _init_with(cls: type, reg: CollectorRegistry) -> Any:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        cls.__init__(self, *args, registry=reg, **kwargs)

    return __init__


def test_prometheus_side_records_a_payload_after_the_msgpack_hop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The payload crosses vLLM's msgpack serializer (engine core → API server) and is recorded
    under vLLM's labels plus ``tier``; counters add up, gauges take the last value; an unknown
    name is skipped with one warning."""
    reg = CollectorRegistry()
    prom = KVCascadeConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None),  # type: ignore[arg-type]  # only this is read
        registry_types(reg),  # type: ignore[arg-type]
        ["model_name", "engine"],
        {0: ["m", "0"]},
    )
    deltas = StatsDeltas()
    tiers = {"kvcascade_block_hits_total:1:fs": 3.0, "kvcascade_cascade_queued_blocks:1:fs": 2.0}
    for step in (1, 2):
        payload = deltas.take({"store_bytes": 10.0 * step}, tiers)
        assert payload is not None
        hop = MsgpackDecoder(dict).decode(MsgpackEncoder().encode(payload.to_dict()))
        stats = KVCascadeConnector.build_kv_connector_stats(hop)
        assert stats is not None and not stats.is_empty()
        prom.observe(stats.data, engine_idx=0)
        tiers["kvcascade_block_hits_total:1:fs"] += 1
        tiers["kvcascade_cascade_queued_blocks:1:fs"] = 0.0
    labels = {"model_name": "m", "engine": "0"}
    assert reg.get_sample_value("vllm:kv_offload_store_bytes_total", labels) == 20.0
    fs = {**labels, "tier": "1:fs"}
    assert reg.get_sample_value("vllm:kv_offload_tiering_chunk_hits_total", fs) == 4.0
    assert reg.get_sample_value("vllm:kv_offload_tiering_cascade_queued_blocks", fs) == 0.0
    with caplog.at_level(logging.WARNING, logger="kvcascade.integrations._vllm_metrics"):
        prom.observe({"types": {"vllm:new": "counter"}, "data": {"vllm:new": {(): 1}}})
        prom.observe({"types": {"vllm:new": "counter"}, "data": {"vllm:new": {(): 1}}})
    assert caplog.text.count("unknown connector metric 'vllm:new'") == 1
    assert {m.name for m in reg.collect()} >= {n.removesuffix("_total") for n in METRICS}
