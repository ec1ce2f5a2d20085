"""TieringCoordinator's synchronous hooks over real tier actors.

The scenarios of vLLM's ``tests/v1/kv_offload/tiering/test_tiering_offloading.py``, named per
test."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import pytest
import torch
from tier_helpers import running

import kvcascade as kc
from kvcascade import LookupResult as R


def key(i: int) -> bytes:
    return kc.make_offload_key(i.to_bytes(8, "big"), 0)


@asynccontextmanager
async def tiering(
    num_blocks: int = 5, num_tiers: int = 2, policy: str = "lru"
) -> AsyncIterator[tuple[kc.TieringCoordinator, kc.HostBuffer, list[kc.MemoryTier]]]:
    """Primary of ``num_blocks`` slots (eviction ``policy``) and ``num_tiers`` in-memory tiers,
    actors running."""
    host = kc.HostBuffer(num_blocks, 64)
    primary = kc.CPUOffloadingManager(num_blocks, policy, enable_events=True)
    tiers = [kc.MemoryTier(host, name=f"mem{i}") for i in range(num_tiers)]
    async with running(*tiers):
        yield kc.TieringCoordinator(primary, tiers), host, tiers
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
    """vLLM test_cascade_to_all_secondary_tiers / test_ref_cnt_protection_during_cascade:
    complete_store cascades to every tier; ref_cnt = #tiers until the next step's poll, even if the
    jobs already finished."""
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
    """vLLM test_failed_store_no_cascade: complete_store(success=False) submits nothing to the
    tiers."""
    async with tiering() as (coord, _host, tiers):
        ctx = kc.ReqContext("a")
        out = coord.prepare_store([key(1)], ctx)
        coord.complete_store(out.keys_to_store, ctx, success=False)
        assert not coord.has_pending_work()
        assert coord.lookup(key(1), ctx) is not R.HIT
        assert all(not t.blocks for t in tiers)


async def test_promotion_from_secondary_is_byte_exact() -> None:
    """vLLM test_promotion_from_secondary: a secondary-only key answers HIT_PENDING; the first
    schedule end submits the promotion, the poll after it completes makes it a primary HIT with the
    stored bytes."""
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
    """vLLM test_failed_promotion_keeps_only_successful_blocks: a promotion failing at its 2nd key
    completes the 1st and frees the rest."""
    async with tiering(num_blocks=4, num_tiers=1) as (coord, _host, tiers):
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
    """vLLM test_on_request_finished_delays_secondary_until_store_submitted /
    test_zero_store_request_finalizes_immediately: tiers hear on_request_finished only when the
    request's stores are done."""
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
    """vLLM test_take_events_aggregates_tier_owned_events: take_events = the primary's events, then
    each tier's in tier order."""
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


async def test_stalled_write_expires_and_late_report_cannot_land() -> None:
    """Issue #4 / vLLM issue #49829: a write still HIT_PENDING after pending_write_timeout_s is
    failed (its key becomes a miss); its slot stays quarantined until the late writer reports, and
    the late report neither revives the key nor disturbs a newer write of the same key."""
    async with tiering(num_blocks=2, num_tiers=0) as (coord, _host, _tiers):
        coord.pending_write_timeout_s = 0.05
        stalled, fresh = kc.ReqContext("stalled"), kc.ReqContext("fresh")
        out = coord.prepare_store([key(1)], stalled)
        assert coord.lookup(key(1), fresh) is R.HIT_PENDING
        await asyncio.sleep(0.1)
        coord.on_schedule_end()  # next step: the poll expires the write
        assert coord.lookup(key(1), fresh) is R.MISS
        assert coord.primary.num_free == 1  # the stalled slot is quarantined, not free
        retry = coord.prepare_store([key(1)], fresh)  # a new writer of the same key
        assert retry.store_spec.block_ids.tolist() != out.store_spec.block_ids.tolist()
        coord.complete_store([key(1)], stalled)  # the late report is dropped
        assert coord.lookup(key(1), fresh) is R.HIT_PENDING
        assert coord.primary.num_free == 1  # the quarantined slot came back
        coord.complete_store([key(1)], fresh)
        assert coord.lookup(key(1), fresh) is R.HIT
        assert coord.metrics.value("expired_writes") == 1


async def test_lookup_pin_protects_block_until_prepare_load() -> None:
    """Issue #4: a block found by lookup cannot be evicted by another request's store before
    prepare_load; prepare_load of a block that is gone raises BlockUnavailableError."""
    async with tiering(num_blocks=2, num_tiers=0) as (coord, host, _tiers):
        writer, reader = kc.ReqContext("w"), kc.ReqContext("r")
        store(coord, writer, [key(1), key(2)], host)
        assert coord.lookup(key(1), reader) is R.HIT  # pins key 1 for the reader
        out = coord.prepare_store([key(3)], writer)
        assert out.evicted_keys == [key(2)]  # key 1 is protected by the reader's pin
        spec = coord.prepare_load([key(1)], reader)
        assert coord.primary.get_block(key(1)).ref_cnt == 1  # the lookup pin was taken over
        assert bytes(host.row(int(spec.block_ids[0]))) == bytes([1]) * 64
        coord.complete_load([key(1)], reader)
        try:
            coord.prepare_load([key(2)], reader)
        except kc.BlockUnavailableError as exc:
            assert exc.keys == [key(2)]
        else:
            raise AssertionError("prepare_load of an evicted key must raise")
        coord.on_request_finished(reader)
        assert coord.primary.get_block(key(1)).ref_cnt == 0


async def test_finished_request_releases_lookup_pins() -> None:
    """Issue #4: lookup pins of a request that never loads are released when it finishes."""
    async with tiering(num_blocks=1, num_tiers=0) as (coord, host, _tiers):
        ctx = kc.ReqContext("a")
        store(coord, ctx, [key(1)], host)
        other = kc.ReqContext("b")
        assert coord.lookup(key(1), other) is R.HIT
        assert coord.prepare_store([key(2)], ctx) is None  # the only block is pinned
        coord.on_request_finished(other)
        assert coord.prepare_store([key(2)], ctx).evicted_keys == [key(1)]


class FinishRecordingTier(kc.MemoryTier):
    """A memory tier that records the contexts it is told finished."""

    def __init__(self, host: kc.HostBuffer) -> None:
        super().__init__(host)
        self.finished: list[kc.ReqContext] = []

    def on_request_finished(self, ctx: kc.ReqContext) -> None:
        self.finished.append(ctx)
        super().on_request_finished(ctx)


async def test_a_request_id_used_again_by_a_new_context_keeps_each_use_apart() -> None:
    """Found by a break-it run, with ``r`` finished while its store is in flight and used again
    by a new context: the new use's store landing was booked to the finished use, whose tiers
    heard of its end before its own store landed; and finishing the old context again
    released the new use's lookup pin (the block it had a HIT for was then evicted)."""
    host = kc.HostBuffer(2, 64)
    tier = FinishRecordingTier(host)
    coord = kc.TieringCoordinator(kc.CPUOffloadingManager(2), [tier])
    try:
        async with running(tier):
            old = kc.ReqContext("r")
            coord.on_new_request(old)
            in_flight = coord.prepare_store([key(1)], old)
            coord.on_request_finished(old)
            new = kc.ReqContext("r")
            coord.on_new_request(new)
            store(coord, new, [key(2)], host)
            assert tier.finished == []  # the old use's store is still in flight
            assert coord.lookup(key(2), new) is R.HIT
            coord.on_request_finished(old)  # an abort after the finish
            assert coord.prepare_store([key(3)], kc.ReqContext("o")) is None  # key 2 pinned
            coord.complete_store(in_flight.keys_to_store, old)
            assert tier.finished == [old]
            coord.on_request_finished(new)
            assert tier.finished == [old, new]
            await settle(coord)
    finally:
        host.close()


async def test_metrics_are_exported_per_tier() -> None:
    """Issue #4 item 7: vLLM-shaped tiering metrics under kvcascade_* names, per tier label."""
    async with tiering(num_blocks=4, num_tiers=1) as (coord, host, _tiers):
        ctx = kc.ReqContext("a")
        store(coord, ctx, [key(1), key(2)], host)
        await settle(coord)
        coord.poll_now()
        coord.lookup(key(1), ctx)
        m = coord.metrics
        assert m.value("write_bytes", 0) == 128
        assert m.value("block_hits", None) == 1
        assert m.value("active_cascade_jobs", 0) == 0
        stats = coord.get_stats()
        assert stats["kvcascade_write_bytes_total:1:mem0"] == 128


async def test_events_async_iterator_sees_stores_in_order() -> None:
    """Issue #4 item 7: the event stream as an async iterator."""
    config = kc.CascadeConfig(
        block_bytes=64, gpu_blocks=4, cpu_blocks=1, secondary_tiers=[{"type": "memory"}]
    )
    async with kc.open_cascade(config) as cascade:
        seen: list[tuple[str, bool]] = []

        async def consume() -> None:
            async for event in cascade.events():
                seen.append((event.tier, event.removed))
                if len(seen) == 4:
                    return

        consumer = asyncio.create_task(consume())
        await asyncio.sleep(0)
        ctx = kc.ReqContext("a")
        await cascade.store([key(1)], ctx, [0])
        await cascade.wait_cascades()
        await cascade.store([key(2)], ctx, [1])  # evicts key 1 from the primary
        await asyncio.wait_for(consumer, 5)
        assert seen == [("cpu", False), ("memory", False), ("cpu", True), ("cpu", False)]


async def test_cancelled_load_releases_its_pins() -> None:
    """Issue #4: cancelling a task awaiting a load releases its pins (after the copy ends)."""
    config = kc.CascadeConfig(block_bytes=64, gpu_blocks=4, cpu_blocks=2)
    async with kc.open_cascade(config) as cascade:
        ctx = kc.ReqContext("a")
        await cascade.store([key(1)], ctx, [0])
        found = await cascade.lookup_prefix([key(1)], ctx)
        task = asyncio.create_task(cascade.load(found.keys, ctx, [3]))
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        cascade.finish_request(ctx)
        assert cascade.primary.get_block(key(1)).ref_cnt == 0


class StuckTier(kc.MemoryTier):
    """A memory tier whose transfers block until the test lets them go: inside the access to
    the primary rows (a read in progress), or before it (e.g. an ``open`` that hangs)."""

    def __init__(self, host: kc.HostBuffer, inside_rows: bool = True) -> None:
        super().__init__(host, name="stuck")
        self.io_timeout_s = 0.05
        self.gate = threading.Event()
        self.inside_rows = inside_rows

    def _stall(self) -> None:
        if self.inside_rows:
            with self._row_access():
                self.gate.wait(10)
        else:
            self.gate.wait(10)

    def _load_blocks(self, keys, rows):  # type: ignore[no-untyped-def]
        self._stall()
        return super()._load_blocks(keys, rows)

    def _store_blocks(self, keys, rows):  # type: ignore[no-untyped-def]
        self._stall()
        return super()._store_blocks(keys, rows)


async def test_promotion_stuck_before_touching_rows_frees_its_slot_at_the_deadline() -> None:
    """A promotion whose thread hangs before it touches the primary rows (an ``open`` of a
    FIFO) fails at its deadline and its slot is free at once; when the thread wakes up it sees
    the deadline passed and leaves the rows alone."""
    host = kc.HostBuffer(1, 64)
    primary = kc.CPUOffloadingManager(1)
    tier = StuckTier(host, inside_rows=False)
    tier.blocks[key(1)] = b"\x01" * 64
    async with running(tier):
        coord = kc.TieringCoordinator(primary, [tier])
        ctx = kc.ReqContext("a")
        assert coord.lookup(key(1), ctx, verdicts={0: True}) is R.HIT_PENDING
        (future,) = coord.on_schedule_end()
        result = await asyncio.wait_for(future, 5)
        assert not result.success and not result.abandoned
        coord.poll_now()
        assert primary.num_free == 1
        out = coord.prepare_store([key(2)], ctx)  # the slot is reused at once …
        host.row(int(out.store_spec.block_ids[0]))[:] = b"\x02" * 64
        coord.complete_store(out.keys_to_store, ctx)
        tier.gate.set()  # … and the late thread does not write into it
        await asyncio.sleep(0.1)
        assert bytes(host.row(int(out.store_spec.block_ids[0]))) == b"\x02" * 64
    host.close()


async def test_abandoned_promotion_keeps_its_slot_until_the_thread_returns() -> None:
    """Issue #4/#5: a promotion failing at its tier deadline while its thread is still inside
    the read makes the key a miss, but its primary slot is not reused until the thread returns
    (a late read can never land in another key's slot)."""
    host = kc.HostBuffer(2, 64)
    primary = kc.CPUOffloadingManager(2)
    tier = StuckTier(host)
    tier.blocks[key(1)] = b"\x01" * 64
    async with running(tier):
        coord = kc.TieringCoordinator(primary, [tier])
        ctx = kc.ReqContext("a")
        assert coord.lookup(key(1), ctx, verdicts={0: True}) is R.HIT_PENDING
        (future,) = coord.on_schedule_end()
        result = await asyncio.wait_for(future, 5)
        assert result.abandoned and not result.success
        coord.poll_now()
        assert coord.lookup(key(1), ctx, verdicts={0: False}) is R.MISS
        assert primary.num_free == 1  # the slot the stuck read may still write stays out of use
        await coord.reset_cache()  # the reset keeps it reserved too
        assert primary.num_free == 1
        tier.gate.set()  # the read returns late
        for _ in range(100):
            await asyncio.sleep(0.01)
            coord.poll_now()
            if primary.num_free == 2:
                break
        assert primary.num_free == 2
    host.close()


async def test_abandoned_cascade_keeps_its_read_pin() -> None:
    """A cascade abandoned at its deadline keeps the primary block pinned (its thread may still
    read it) until the thread returns."""
    host = kc.HostBuffer(1, 64)
    primary = kc.CPUOffloadingManager(1)
    tier = StuckTier(host)
    async with running(tier):
        coord = kc.TieringCoordinator(primary, [tier])
        ctx = kc.ReqContext("a")
        out = coord.prepare_store([key(1)], ctx)
        coord.complete_store(out.keys_to_store, ctx)
        result = await asyncio.wait_for(coord.job_futures()[0], 5)
        assert result.abandoned
        coord.poll_now()
        assert primary.get_block(key(1)).ref_cnt == 1
        assert coord.prepare_store([key(2)], ctx) is None  # cannot evict the block being read
        tier.gate.set()
        for _ in range(100):
            await asyncio.sleep(0.01)
            coord.poll_now()
            if primary.get_block(key(1)).ref_cnt == 0:
                break
        assert primary.get_block(key(1)).ref_cnt == 0
    host.close()


async def test_a_key_expiring_twice_loses_no_slot() -> None:
    """A key whose write expires, is stored again by another request and expires again before
    the first late writer reports: both quarantined slots come back when the writers report."""
    async with tiering(num_blocks=3, num_tiers=0) as (coord, _host, _tiers):
        coord.pending_write_timeout_s = 0.02
        first, second = kc.ReqContext("first"), kc.ReqContext("second")
        coord.prepare_store([key(1)], first)
        await asyncio.sleep(0.05)
        coord.poll_now()
        coord.prepare_store([key(1)], second)
        await asyncio.sleep(0.05)
        coord.poll_now()
        assert coord.primary.num_free == 1  # two slots quarantined
        coord.complete_store([key(1)], first)
        coord.complete_store([key(1)], second)
        assert coord.primary.num_free == 3
        assert coord.lookup(key(1), first) is R.MISS


async def test_cascade_api_rejects_arguments_that_would_do_the_wrong_thing() -> None:
    """One key instead of a list, str keys, float GPU ids, one GPU id for two keys, no context:
    clear errors, nothing stored."""
    config = kc.CascadeConfig(block_bytes=64, gpu_blocks=4, cpu_blocks=4)
    async with kc.open_cascade(config) as cascade:
        ctx = kc.ReqContext("a")
        for keys, ids, error, text in [
            (key(1), [0], TypeError, "sequence of offload keys"),
            (["k"], [0], TypeError, "must be bytes, got str"),
            ([key(1)], [1.5], TypeError, "1.5"),
            ([key(1)], [0, 1], ValueError, "1 keys but 2"),
            ([b"x"], [0], ValueError, "offload key too short (1 bytes"),
            ([key(1)], [4], ValueError, "GPU block ids out of range [0, 4): [4]"),
            ([key(1), key(2)], [-1, 0], ValueError, "out of range [0, 4): [-1]"),
            ([key(1), key(2), key(3)], [2, 0, 2], ValueError, "more than one key: [2]"),
            ([key(1)], [2**70], ValueError, f"out of range [0, 4): [{2**70}]"),
            ([key(1), key(2)], {0, 1}, TypeError, "got set"),
            ([key(1)], (i for i in [0]), TypeError, "got generator"),
        ]:
            try:
                await cascade.store(keys, ctx, ids)
            except error as exc:
                assert text in str(exc)
            else:
                raise AssertionError(f"store({keys!r}, {ids!r}) must raise")
        try:
            await cascade.lookup_prefix([key(1)], None)  # type: ignore[arg-type]
        except TypeError as exc:
            assert "ReqContext" in str(exc)
        with pytest.raises(TypeError, match=r"ctx must be a kvcascade\.ReqContext, got str"):
            cascade.finish_request("a")  # type: ignore[arg-type]
        assert cascade.primary.num_free == 4
    for call in (
        cascade.store([key(1)], ctx, [0]),
        cascade.lookup_prefix([key(1)], ctx),
        cascade.load([key(1)], ctx, [0]),
    ):  # after the ``async with``: every call refuses the same way
        with pytest.raises(kc.TierUnavailableError, match="the cascade is closed"):
            await call


async def test_a_prefix_key_evicted_by_its_own_promotions_is_found_in_the_secondary() -> None:
    """lookup_prefix: a later key of the prefix that an earlier key's promotion evicted from
    the primary is looked up in the secondary tier instead of ending the prefix."""
    config = kc.CascadeConfig(
        block_bytes=64, gpu_blocks=8, cpu_blocks=3, secondary_tiers=[{"type": "memory"}]
    )
    async with kc.open_cascade(config) as cascade:
        keys = [key(i) for i in range(5)]
        cascade.device.kv[:5] = torch.arange(5, dtype=torch.int8)[:, None]  # block i: byte i
        for i in range(5):  # one writer each: key 2 is the least recent (no deepest-first)
            ctx = kc.ReqContext(f"w{i}")
            await cascade.store([keys[i]], ctx, [i])
            await cascade.wait_cascades()
            cascade.finish_request(ctx)
        # primary holds keys 2, 3, 4; memory holds all five
        reader = kc.ReqContext("r")
        cascade.device.kv.zero_()
        found = await cascade.lookup_prefix(keys, reader)
        assert found.num_hits == 3  # as many as the primary's 3 slots can hold at once
        assert found.tiers == ["memory"] * 3  # key 2 too: re-probed once the walk evicted it
        loaded = await cascade.load(found.keys, reader, [5, 6, 7])
        assert loaded.loaded == 3
        assert [int(cascade.device.kv[g, 0]) for g in (5, 6, 7)] == [0, 1, 2]
        cascade.finish_request(reader)


async def test_lru_admission_rule_for_sessions_that_will_not_continue() -> None:
    """Issue #9: with LRU/ARC, a request hinted ``continues=False`` stores no new blocks (they
    would only push out blocks that are read again); unhinted requests store as before."""
    async with tiering(num_blocks=4, num_tiers=0) as (coord, _host, _tiers):
        done = kc.ReqContext("last-turn")
        done.set_state(kc.SessionHint(continues=False))
        assert coord.prepare_store([key(1), key(2)], done).keys_to_store == []
        via_params = kc.ReqContext("p", {"kvcascade_hint": {"continues": False}})
        assert coord.prepare_store([key(3)], via_params).keys_to_store == []
        going_on = kc.ReqContext("next-turn")
        going_on.set_state(kc.SessionHint(continues=True))
        assert coord.prepare_store([key(1)], going_on).keys_to_store == [key(1)]
        assert coord.prepare_store([key(4)], kc.ReqContext("plain")).keys_to_store == [key(4)]


@pytest.mark.parametrize("num_tiers", [0, 1])
async def test_a_policy_refusal_keeps_new_blocks_out_only_without_secondary_tiers(
    num_tiers: int,
) -> None:
    """``turn_aware`` refuses the new blocks of a request of a lower hint priority than every
    resident block (its admission control). Without secondary tiers nothing is stored. With one
    the store goes on and reaches it: every store reaches a secondary tier through the primary,
    and the refusal judges only whether the CPU tier should keep the blocks
    (``TieringCoordinator._admits_new_blocks``; ``kvcascade replay``'s fs tier lost a tenth of
    its hits to such refusals). With one, ``continues=False`` still stores nothing."""
    async with tiering(2, num_tiers, "turn_aware") as (coord, host, tiers):
        vip = kc.ReqContext("vip")
        vip.set_state(kc.SessionHint(priority=1))
        coord.touch([key(1), key(2)], vip)
        assert store(coord, vip, [key(1), key(2)], host) == [key(1), key(2)]
        await settle(coord)
        coord.poll_now()  # the cascade's pins released: both blocks evictable
        low = kc.ReqContext("low")
        coord.touch([key(3)], low)
        assert coord.primary.policy.admits(low, 1) is False
        stored = store(coord, low, [key(3)], host)
        assert stored == ([key(3)] if num_tiers else [])
        await settle(coord)
        assert [set(t.blocks) for t in tiers] == [{key(1), key(2), key(3)}] * num_tiers
        if num_tiers:  # the hint rule stays (without tiers turn_aware learns what hints mean)
            done = kc.ReqContext("done")
            done.set_state(kc.SessionHint(continues=False, priority=1))
            coord.touch([key(4)], done)
            assert store(coord, done, [key(4)], host) == []


# -- issue #14: where the parts meet ----------------------------------------------------------
async def test_a_key_given_twice_is_pinned_once_per_use() -> None:
    """Defect 2 (LMCache #2954): lookup([K]) then prepare_load([K, K]) pins K once per use, so
    unpinning both uses leaves the cascade's pin in place."""
    async with tiering(num_blocks=2, num_tiers=1) as (coord, host, _tiers):
        writer, reader = kc.ReqContext("w"), kc.ReqContext("r")
        store(coord, writer, [key(1)], host)  # the cascade pins key 1 once
        assert coord.lookup(key(1), reader) is R.HIT
        coord.prepare_load([key(1), key(1)], reader)
        assert coord.primary.get_block(key(1)).ref_cnt == 3
        coord.complete_load([key(1), key(1)], reader)
        assert coord.primary.get_block(key(1)).ref_cnt == 1  # the cascade's pin
        await settle(coord)
        coord.poll_now()  # the cascade's result is applied without a KeyError
        assert coord.primary.get_block(key(1)).ref_cnt == 0


async def test_a_broken_job_result_never_surfaces_in_the_polling_caller(caplog) -> None:
    """Defect 2: if applying a finished job breaks an invariant (here: its pin was already
    released), the error is logged; the unrelated caller whose hook polled gets its answer."""
    async with tiering(num_blocks=2, num_tiers=1) as (coord, host, _tiers):
        writer = kc.ReqContext("w")
        store(coord, writer, [key(1)], host)
        coord.primary.complete_load([key(1)])  # someone unpinned the cascade's pin
        await settle(coord)
        coord.on_schedule_end()
        assert coord.lookup(key(2), kc.ReqContext("other"), verdicts={0: False}) is R.MISS
        assert "applying the result of job" in caplog.text


async def test_a_landed_promotion_is_kept_for_its_requester() -> None:
    """Defect 3 (vLLM #49902): A's promotion lands; next step B's promotions cannot evict A's
    landed, unread block; A then hits it."""
    async with tiering(num_blocks=2, num_tiers=1) as (coord, host, tiers):
        writer = kc.ReqContext("w")
        store(coord, writer, [key(1), key(2)], host)
        await settle(coord)
        coord.on_schedule_end()
        store(coord, writer, [key(3), key(4)], host)  # evicts keys 1 and 2 from the primary
        await settle(coord)
        coord.on_schedule_end()
        coord.on_request_finished(writer)
        a, b = kc.ReqContext("a"), kc.ReqContext("b")
        found = {0: True}  # the secondary tier's probe verdict
        assert coord.lookup(key(1), a, verdicts=found) is R.HIT_PENDING
        coord.on_schedule_end()
        await settle(coord)  # A's promotion landed
        coord.on_schedule_end()
        assert coord.lookup(key(2), b, verdicts=found) is R.HIT_PENDING  # the one other slot
        assert coord.lookup(key(3), b, verdicts=found) is R.MISS  # key 1 is A's: no room
        assert coord.lookup(key(1), a) is R.HIT
        spec = coord.prepare_load([key(1)], a)
        assert bytes(host.row(int(spec.block_ids[0]))) == bytes([1]) * 64
        coord.complete_load([key(1)], a)
        coord.on_request_finished(a)
        assert coord.primary.get_block(key(1)).ref_cnt == 0
        coord.on_request_finished(b)
        await settle(coord)
        coord.on_schedule_end()
        assert tiers[0].blocks[key(1)] == bytes([1]) * 64


class RequestLevelTier(kc.MemoryTier):
    """A memory tier that asks for request-level offloading and records which request each
    stored key was sent for."""

    def __init__(self, host: kc.HostBuffer) -> None:
        super().__init__(host, name="per-request")
        self.sent: list[tuple[str, bytes]] = []

    def on_new_request(self, ctx: kc.ReqContext) -> kc.RequestOffloadingContext:
        return kc.RequestOffloadingContext(kc.OffloadPolicy.REQUEST_LEVEL)

    def submit_store(self, job: kc.TransferJob):  # type: ignore[no-untyped-def]
        self.sent.extend((job.req_context.req_id, k) for k in job.keys)
        return super().submit_store(job)


async def test_request_level_tier_gets_keys_another_request_was_writing() -> None:
    """Defect 11: a key that another request was writing when this request offered it reaches
    this request's request-level tier once the write lands; the request is finalized after."""
    host = kc.HostBuffer(4, 64)
    tier = RequestLevelTier(host)
    async with running(tier):
        coord = kc.TieringCoordinator(kc.CPUOffloadingManager(4), [tier])
        writer, reader = kc.ReqContext("w"), kc.ReqContext("r")
        coord.on_new_request(writer)
        coord.on_new_request(reader)
        out = coord.prepare_store([key(1)], writer)
        assert coord.prepare_store([key(1)], reader).keys_to_store == []  # being written
        coord.on_request_finished(reader)
        assert "r" in coord._req_state  # still waits for key 1
        host.row(int(out.store_spec.block_ids[0]))[:] = b"\1" * 64
        coord.complete_store([key(1)], writer)
        assert ("r", key(1)) in tier.sent
        assert "r" not in coord._req_state
        await settle(coord)
        coord.on_schedule_end()
    host.close()


async def test_eviction_order_after_pins_are_released_follows_the_pin_order() -> None:
    """Defect 11: a finished request's lookup pins are released in the order they were taken
    (was: set order, which changes with PYTHONHASHSEED), so LRU evicts the same block every
    run."""
    async with tiering(num_blocks=8, num_tiers=0) as (coord, host, _tiers):
        writer, reader = kc.ReqContext("w"), kc.ReqContext("r")
        keys = [key(i) for i in range(8)]
        store(coord, writer, keys, host)
        for k in keys:
            assert coord.lookup(k, reader) is R.HIT
        coord.on_request_finished(reader)
        assert coord.primary.policy.evictable_keys() == keys


async def test_primary_usage_gauges_are_live_between_polls() -> None:
    """Defect 11: the primary usage gauges read the tier at scrape time, not at the last
    poll."""
    async with tiering(num_blocks=4, num_tiers=0) as (coord, _host, _tiers):
        ctx = kc.ReqContext("a")
        out = coord.prepare_store([key(1), key(2)], ctx)
        assert coord.metrics.value("primary_write_usage_perc") == 0.5
        coord.complete_store(out.keys_to_store, ctx)
        assert coord.metrics.value("primary_write_usage_perc") == 0.0
        assert coord.lookup(key(1), ctx) is R.HIT  # pinned for the request
        assert coord.metrics.value("primary_read_usage_perc") == 0.25


class _ProbeDefectTier(kc.MemoryTier):
    """A tier whose existence probe has a defect (an out-of-tree tier's ``KeyError``)."""

    def _probe(self, keys: Sequence[bytes]) -> list[bool]:
        raise KeyError("defect in the tier")


async def test_a_probe_that_raises_answers_miss_not_retry_for_ever(caplog) -> None:
    """A tier's probe raising an error ``contains`` does not answer itself killed the probe
    batch (a task nobody awaited), and every lookup it held answered ``RETRY`` for ever: each
    request's, since a batch holds the step's keys of all of them. Now the batch answers
    ``MISS`` and the error is logged with the tier's name."""
    host = kc.HostBuffer(2, 64)
    tier = _ProbeDefectTier(host, name="broken")
    async with running(tier):
        coord = kc.TieringCoordinator(kc.CPUOffloadingManager(2), [tier])
        a, b = kc.ReqContext("a"), kc.ReqContext("b")
        assert coord.lookup(key(1), a) is R.RETRY
        assert coord.lookup(key(2), b) is R.RETRY
        coord.on_schedule_end()  # flush the probe
        await tier._lookup.wait_probes()
        assert (coord.lookup(key(1), a), coord.lookup(key(2), b)) == (R.MISS, R.MISS)
        assert "tier broken: probe of 2 keys raised; answering MISS" in caplog.text
        coord.on_request_finished(a)
        coord.on_request_finished(b)
    host.close()


async def test_a_cascade_to_a_tier_that_is_not_running_releases_its_pins(caplog) -> None:
    """A tier whose actor does not run refuses the submission (``TierUnavailableError``); the
    cascade had pinned its keys first and nothing unpinned them, and the error escaped the
    GPU→CPU store that had succeeded (found by a break-it run). Now the pins are released, the
    failure is counted, logged once, and the store completes; the running tier gets its job."""
    host = kc.HostBuffer(4, 64)
    primary = kc.CPUOffloadingManager(4, "lru")
    up, down = kc.MemoryTier(host, name="up"), kc.MemoryTier(host, name="down")
    try:
        async with running(up):
            coord = kc.TieringCoordinator(primary, [up, down])
            ctx = kc.ReqContext("a")
            for i in range(2):
                with caplog.at_level(logging.WARNING, logger="kvcascade"):
                    assert store(coord, ctx, [key(i)], host) == [key(i)]
            await settle(coord)
            coord.poll_now()
            assert all(primary.get_block(key(i)).ref_cnt == 0 for i in range(2))
            assert set(up.blocks) == {key(0), key(1)} and not down.blocks
            stats = coord.get_stats()
            assert stats["kvcascade_cascade_job_failures_total:2:down"] == 2
            assert caplog.text.count("no cascade to a tier that is not running") == 1
            coord.on_request_finished(ctx)
    finally:
        host.close()
