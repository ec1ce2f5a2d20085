"""A slow tier never stalls a lookup (issue #21, item 4; docs/architecture.md, "Slow and hung
tiers").

Real processes only: ``moto_server`` in its own process behind the fault proxy of
:mod:`s3_fixtures` (asyncio streams on 127.0.0.1), whose ``delay`` fault holds every answer
back for 5 s and is switched on and off at run time; the cascade's other tier is a real fs tier
on ``tmp_path``. The checks are on answers and states (which tier a key comes from, MISS, the
degraded flag and its gauge); the one bound on time is a liveness guard of ``io_timeout_s``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import s3_fixtures
import torch
from s3_fixtures import ACCESS_KEY, SECRET_KEY, Fault, FaultProxy, MotoServer
from tier_helpers import BLOCK, key, pattern

import kvcascade as kc
from kvcascade.tiers import _health
from kvcascade.tiers._file_mapper import FileMapper, default_identity
from kvcascade.tiers._jobs import _HEALTH_KEY
from kvcascade.tiers.fs import fs_tier_from_config
from kvcascade.tiers.s3 import S3Tier, s3_tier_from_config

moto = s3_fixtures.moto  # the session's moto_server process
bucket = s3_fixtures.bucket  # a fresh bucket on it

IO_TIMEOUT_S = 30.0
PROBE_TIMEOUT_S = 1.0  # above the default 0.5 s: an in-time answer of a loaded machine's moto
DELAY_S = 5.0
N = 4


def s3_entry(endpoint: str, bucket: str, **kw: Any) -> dict[str, Any]:
    return {
        "type": "s3",
        "bucket": bucket,
        "endpoint_url": endpoint,
        "region": "us-east-1",
        "access_key": ACCESS_KEY,
        "secret_key": SECRET_KEY,
        "addressing_style": "path",
        "io_timeout_s": IO_TIMEOUT_S,
        "probe_timeout_s": PROBE_TIMEOUT_S,
        **kw,
    }


def config(endpoint: str, bucket: str, fs_dir: Path) -> kc.CascadeConfig:
    """s3 first, fs second: a key both hold comes from s3 unless s3 answered MISS."""
    return kc.CascadeConfig(
        block_bytes=BLOCK,
        gpu_blocks=16,
        cpu_blocks=16,
        secondary_tiers=[
            s3_entry(endpoint, bucket),
            {"type": "fs", "root_dir": str(fs_dir), "io_timeout_s": IO_TIMEOUT_S},
        ],
        model_name="test-model",
    )


@pytest.fixture
def quick_recheck(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Background probes of a degraded tier every 0.2 s instead of every second."""
    monkeypatch.setattr(_health, "RECHECK_S", 0.2)
    yield


async def fill(cfg: kc.CascadeConfig, keys: list[bytes]) -> None:
    """Store ``keys`` (payload ``pattern(i)``) through a cascade into both tiers, then close it:
    the next cascade starts with an empty primary and an s3 tier that knows no key."""
    async with kc.open_cascade(cfg) as cascade:
        kv = cascade.device.kv
        for i in range(len(keys)):
            kv[i] = torch.frombuffer(bytearray(pattern(i)), dtype=torch.int8)
        ctx = kc.ReqContext("fill")
        cascade.coordinator.on_new_request(ctx)
        stored = await cascade.store(keys, ctx, list(range(len(keys))))
        cascade.finish_request(ctx)
        await cascade.wait_cascades()
        assert stored.stored == keys
        assert all(
            t.counters["store_jobs"] and not t.counters["store_failures"] for t in cascade.tiers
        )


async def look(cascade: kc.Cascade, keys: list[bytes], name: str) -> list[str]:
    """The source tier of each key of the prefix found; the request is finished and the
    promotions are left to land, then the primary is emptied (next lookup probes again)."""
    ctx = kc.ReqContext(name)
    cascade.coordinator.on_new_request(ctx)
    found = await cascade.lookup_prefix(keys, ctx)
    cascade.finish_request(ctx)
    promotions = cascade.coordinator.job_futures(promotions=True)
    if promotions:
        await asyncio.wait(promotions)
    await cascade.coordinator.reset_cache()
    return found.tiers


@pytest.mark.usefixtures("frozen_heap")  # full collections: tests/conftest.py
async def test_hung_endpoint_answers_miss_fast_then_recovers(
    moto: MotoServer, bucket: str, tmp_path: Path, quick_recheck: None, caplog: Any
) -> None:
    """With every S3 answer delayed 5 s, lookups answer MISS for s3 and HIT from fs within
    their probe deadline; after 3 such misses s3 is degraded (probes miss without a request,
    cascades to it are skipped, the gauge says 1), with one warning; once the delay is
    switched off a background probe sees it healthy and s3 serves hits again."""
    keys = [key(i) for i in range(N)]
    async with FaultProxy(moto.port) as proxy:
        cfg = config(proxy.endpoint, bucket, tmp_path / "fs")
        await fill(cfg, keys)
        async with kc.open_cascade(cfg) as cascade, asyncio.timeout(IO_TIMEOUT_S):
            s3, fs = cascade.tiers
            assert isinstance(s3, S3Tier) and s3.probe_timeout_s == PROBE_TIMEOUT_S
            assert await look(cascade, keys, "healthy") == ["s3"] * N
            s3._known.clear()  # as a fresh process: the next probes ask the endpoint

            proxy.faults.append(Fault("delay", seconds=DELAY_S))
            caplog.set_level(logging.WARNING, logger="kvcascade")
            for i in range(_health.DEGRADE_AFTER):
                assert not s3.degraded
                assert await look(cascade, keys, f"slow{i}") == ["fs"] * N
            assert s3.counters["probe_timeouts"] == _health.DEGRADE_AFTER
            assert s3.degraded and s3.counters["degradations"] == 1
            assert cascade.coordinator.metrics.value("tier_degraded", 0) == 1.0
            assert cascade.coordinator.metrics.value("tier_degraded", 1) == 0.0

            before = len(proxy.requests)
            assert await s3.contains(keys) == [False] * N
            assert await look(cascade, keys, "degraded") == ["fs"] * N
            assert s3.counters["degraded_probes"] == 2 * N
            # no request of a lookup reached the endpoint meanwhile (the background probe's
            # HEADs of its health key may have)
            health = s3.object_key(_HEALTH_KEY)
            probes = [t for m, t in proxy.requests[before:] if m == "HEAD"]
            assert all(health in t for t in probes)

            # a cascade to the degraded tier is skipped and counted; fs still stores
            ctx = kc.ReqContext("store-while-degraded")
            cascade.coordinator.on_new_request(ctx)
            new = key(100)
            assert (await cascade.store([new], ctx, [0])).stored == [new]
            cascade.finish_request(ctx)
            await cascade.wait_cascades()
            assert s3.counters["degraded_skipped_blocks"] == 1
            assert fs.counters["store_jobs"] == 1

            degraded_warnings = [r for r in caplog.records if "tier degraded" in r.getMessage()]
            timeouts = [r for r in caplog.records if "passed its deadline" in r.getMessage()]
            assert len(degraded_warnings) == 1 and len(timeouts) == 1

            proxy.faults.clear()
            while s3.degraded:  # bounded by the liveness guard
                await asyncio.sleep(0.05)
            assert cascade.coordinator.metrics.value("tier_degraded", 0) == 0.0
            recovered = [r for r in caplog.records if "no longer degraded" in r.getMessage()]
            assert len(recovered) == 1
            assert await look(cascade, keys, "recovered") == ["s3"] * N


async def test_misses_must_be_in_a_row(moto: MotoServer, bucket: str, tmp_path: Path) -> None:
    """Two probes past their deadline, then one in time, then two more: never degraded (the
    count restarts at an answer in time); the probes past it answered MISS."""
    host = kc.HostBuffer(8, BLOCK)
    try:
        async with FaultProxy(moto.port) as proxy:
            entry = s3_entry(proxy.endpoint, bucket)
            del entry["type"]
            tier = s3_tier_from_config(host, FileMapper(default_identity("test-model")), entry)
            started = asyncio.Event()
            actor = asyncio.create_task(tier.serve(started.set))
            await started.wait()
            try:
                for n in (1, 2, 3, 4):
                    delayed = n != 3
                    proxy.faults[:] = [Fault("delay", seconds=DELAY_S)] if delayed else []
                    assert await tier.contains([key(n)]) == [False]
                    assert not tier.degraded
                assert tier.counters["probe_timeouts"] == 4 - 1
            finally:
                tier.close()
                await actor
    finally:
        host.close()


@pytest.mark.parametrize("bad", [0, -1, "0.25", True, None])
def test_probe_timeout_is_validated_naming_the_value(bad: object, tmp_path: Path) -> None:
    """A ``probe_timeout_s`` that is not a number > 0 is refused, for s3 and fs alike, with a
    message naming the key and the value, before anything is built."""
    host = kc.HostBuffer(1, BLOCK)
    mapper = FileMapper(default_identity("test-model"))
    try:
        with pytest.raises(kc.ConfigError, match=rf"s3 tier probe_timeout_s .*{bad!r}"):
            entry = s3_entry("http://127.0.0.1:1", "kv-bucket", probe_timeout_s=bad)
            del entry["type"]
            s3_tier_from_config(host, mapper, entry)
        cfg = {"root_dir": str(tmp_path / "fs"), "probe_timeout_s": bad}
        with pytest.raises(kc.ConfigError, match=rf"fs tier probe_timeout_s .*{bad!r}"):
            fs_tier_from_config(host, mapper, cfg)
        assert not (tmp_path / "fs").exists()
    finally:
        host.close()
