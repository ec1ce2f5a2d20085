"""TieringCoordinator's synchronous hooks over real tier actors (spec §3.4–3.9, §9.7)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import torch

import kvcascade as kc
from kvcascade import LookupResult as R


def key(i: int) -> bytes:
    return kc.make_offload_key(i.to_bytes(8, "big"), 0)


@asynccontextmanager
async def tiering(
    num_blocks: int = 5, num_tiers: int = 2
) -> AsyncIterator[tuple[kc.TieringCoordinator, kc.HostBuffer, list[kc.MemoryTier]]]:
    """Primary of ``num_blocks`` slots and ``num_tiers`` in-memory tiers, actors running."""
    host = kc.HostBuffer(num_blocks, 64)
    primary = kc.CPUOffloadingManager(num_blocks, enable_events=True)
    tiers = [kc.MemoryTier(host, name=f"mem{i}") for i in range(num_tiers)]
    async with asyncio.TaskGroup() as group:
        for tier in tiers:
            started = asyncio.Event()
            group.create_task(tier.run(started.set))
            await started.wait()
        try:
            yield kc.TieringCoordinator(primary, tiers), host, tiers
        finally:
            for tier in tiers:
                await tier.drain()
                tier.close()
    host.close()


async def settle(coord: kc.TieringCoordinator) -> None:
    """Let every in-flight job finish (without observing it)."""
    futures = coord.job_futures()
    if futures:
        await asyncio.wait(futures)


def store(
    coord: kc.TieringCoordinator, ctx: kc.ReqContext, keys: list[bytes], host: kc.HostBuffer
) -> list[bytes]:
    out = coord.prepare_store(keys, ctx)
    assert out is not None
    for k, slot in zip(out.keys_to_store, out.store_spec.block_ids):
        host.row(int(slot))[:] = bytes([k[7]]) * 64
    coord.complete_store(out.keys_to_store, ctx)
    return out.keys_to_store


async def test_cascade_pins_once_per_tier_until_next_step() -> None:
    """§9.7 136/137: complete_store cascades to every tier; ref_cnt = #tiers until the next
    step's poll, even if the jobs already finished."""
    async with tiering() as (coord, host, tiers):
        ctx = kc.ReqContext("a")
        coord.on_new_request(ctx)
        coord.on_schedule_end()
        keys = [key(1), key(2), key(3)]
        store(coord, ctx, keys, host)
        assert [coord.primary.get_block(k).ref_cnt for k in keys] == [2, 2, 2]
        await settle(coord)
        assert all(set(t.blocks) == set(keys) for t in tiers)
        assert coord.lookup(key(9), ctx) is R.RETRY  # gate already used this step: no poll
        assert coord.primary.get_block(key(1)).ref_cnt == 2
        coord.on_schedule_end()  # the gate was used this step: no poll, the gate resets
        assert coord.primary.get_block(key(1)).ref_cnt == 2
        coord.lookup(key(9), ctx)  # first poll point of the next step
        assert [coord.primary.get_block(k).ref_cnt for k in keys] == [0, 0, 0]


async def test_failed_store_never_cascades() -> None:
    """§9.7 147: complete_store(success=False) submits nothing to the tiers."""
    async with tiering() as (coord, _host, tiers):
        ctx = kc.ReqContext("a")
        out = coord.prepare_store([key(1)], ctx)
        coord.complete_store(out.keys_to_store, ctx, success=False)
        assert not coord.has_pending_work()
        assert coord.lookup(key(1), ctx) is not R.HIT
        assert all(not t.blocks for t in tiers)


async def test_promotion_from_secondary_is_byte_exact() -> None:
    """§9.7 139: a secondary-only key answers HIT_PENDING; the first schedule end submits the
    promotion, the poll after it completes makes it a primary HIT with the stored bytes."""
    async with tiering(num_blocks=2, num_tiers=1) as (coord, host, tiers):
        ctx = kc.ReqContext("a")
        store(coord, ctx, [key(1), key(2)], host)
        await settle(coord)
        coord.on_schedule_end()
        store(coord, ctx, [key(3), key(4)], host)  # evicts 1 and 2 from the primary
        await settle(coord)
        coord.on_schedule_end()
        assert coord.primary.get_block(key(1)) is None
        ctx2 = kc.ReqContext("b")
        assert coord.lookup(key(1), ctx2) is R.RETRY  # probe queued
        coord.on_schedule_end()  # flush the probe
        await tiers[0]._lookup.wait_probes()
        assert coord.lookup(key(1), ctx2) is R.HIT_PENDING  # slot reserved, promotion queued
        assert coord.lookup(key(1), ctx2) is R.HIT_PENDING  # no second promotion
        futures = coord.on_schedule_end()
        assert len(futures) == 1
        await asyncio.wait(futures)
        coord.on_schedule_end()
        assert coord.lookup(key(1), ctx2) is R.HIT
        slot = coord.prepare_load([key(1)], ctx2).block_ids[0]
        assert bytes(host.row(int(slot))) == bytes([1]) * 64
        coord.complete_load([key(1)], ctx2)


async def test_failed_promotion_keeps_only_successful_blocks() -> None:
    """§9.7 140: a promotion failing at its 2nd key completes the 1st and frees the rest."""
    async with tiering(num_blocks=4, num_tiers=1) as (coord, host, tiers):
        ctx = kc.ReqContext("a")
        tiers[0].blocks[key(1)] = b"\x01" * 64
        tiers[0].blocks[key(3)] = b"\x03" * 64
        verdicts = {0: True}
        for i in (1, 2, 3):
            assert coord.lookup(key(i), ctx, verdicts=verdicts) is R.HIT_PENDING
        futures = coord.on_schedule_end()
        (result,) = [f.result() for f in (await asyncio.wait(futures))[0]]
        assert not result.success
        assert result.successful_keys == [key(1)]
        coord.poll_now()
        assert coord.primary.lookup(key(1)) is R.HIT
        assert coord.primary.lookup(key(2)) is R.MISS
        assert coord.primary.lookup(key(3)) is R.MISS
        assert coord.primary.num_free == 3


async def test_request_finalized_only_after_pending_stores() -> None:
    """§9.7 151/153: tiers hear on_request_finished only when the request's stores are done."""
    async with tiering() as (coord, _host, _tiers):
        ctx = kc.ReqContext("a")
        coord.on_new_request(ctx)
        out = coord.prepare_store([key(1)], ctx)
        coord.on_request_finished(ctx)
        assert "a" in coord._req_state
        coord.complete_store(out.keys_to_store, ctx)
        assert "a" not in coord._req_state
        ctx2 = kc.ReqContext("b")
        coord.on_new_request(ctx2)
        coord.on_request_finished(ctx2)
        assert "b" not in coord._req_state


async def test_events_primary_then_tiers() -> None:
    """§9.7 134: take_events = the primary's events, then each tier's in tier order."""
    async with tiering(num_blocks=2, num_tiers=2) as (coord, host, _tiers):
        ctx = kc.ReqContext("a")
        store(coord, ctx, [key(1)], host)
        await settle(coord)
        events = list(coord.take_events())
        assert [(e.tier, e.removed, e.keys) for e in events] == [
            ("cpu", False, [key(1)]),
            ("mem0", False, [key(1)]),
            ("mem1", False, [key(1)]),
        ]


async def test_cascade_api_round_trip_through_memory_tier() -> None:
    """The awaitable API: what was stored comes back byte-exact after the primary evicted it."""
    config = kc.CascadeConfig(
        block_bytes=64, gpu_blocks=8, cpu_blocks=2, secondary_tiers=[{"type": "memory"}]
    )
    async with kc.open_cascade(config) as cascade:
        ctx = kc.ReqContext("w")
        cascade.device.kv[:4] = torch.arange(4, dtype=torch.int8)[:, None]  # block i: byte i
        keys = [key(10), key(11), key(12), key(13)]
        for i in range(0, 4, 2):
            result = await cascade.store(keys[i : i + 2], ctx, [i, i + 1])
            assert len(result.stored) == 2
            await cascade.wait_cascades()
        cascade.finish_request(ctx)
        assert cascade.primary.get_block(keys[0]) is None  # evicted from the primary
        reader = kc.ReqContext("r")
        found = await cascade.lookup_prefix(keys[:2], reader)
        assert found.tiers == ["memory", "memory"]
        loaded = await cascade.load(found.keys, reader, [6, 7])
        assert loaded.loaded == 2 and loaded.failed_keys == []
        assert cascade.device.kv[6].tolist() == [0] * 64
        assert cascade.device.kv[7].tolist() == [1] * 64
        cascade.finish_request(reader)
