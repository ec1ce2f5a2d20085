"""The awaitable API of :class:`kvcascade.Cascade` where its parts meet (issue #14): a request's
lifecycle across the coordinator and the cascade, start-up and misuse. Each test is named after
the defect it keeps fixed."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
import threading
from collections.abc import Sequence

import pytest
import torch

import kvcascade as kc
from kvcascade.views import views_identity


def key(i: int) -> bytes:
    return kc.make_offload_key(i.to_bytes(8, "big"), 0)


class GatedTier(kc.MemoryTier):
    """A memory tier whose promotions wait until the test opens :attr:`gate`."""

    gate = threading.Event()

    def _load_blocks(self, keys: Sequence[bytes], rows: Sequence[memoryview]) -> int:
        self.gate.wait(10)
        return super()._load_blocks(keys, rows)


def config(cpu_blocks: int, tier: dict | None = None, gpu_blocks: int = 8) -> kc.CascadeConfig:
    return kc.CascadeConfig(
        block_bytes=64,
        gpu_blocks=gpu_blocks,
        cpu_blocks=cpu_blocks,
        secondary_tiers=[tier or {"type": "memory"}],
        model_name="test-model",
    )


async def offload(cascade: kc.Cascade, keys: list[bytes], gpu_ids: list[int]) -> None:
    """Store ``keys`` from ``gpu_ids`` (block i holds byte ``gpu_ids[i]``), wait for the cascade,
    then push them out of the primary by storing as many filler keys."""
    for k, g in zip(keys, gpu_ids):
        cascade.device.kv[g] = g
        ctx = kc.ReqContext(f"writer-{k.hex()}")
        assert (await cascade.store([k], ctx, [g])).stored == [k]
        await cascade.wait_cascades()
        cascade.finish_request(ctx)
    filler = kc.ReqContext("filler")
    for i in range(cascade.primary.num_blocks):
        await cascade.store([key(1000 + i)], filler, [7])
        await cascade.wait_cascades()
    cascade.finish_request(filler)
    assert all(cascade.primary.get_block(k) is None for k in keys)


def assert_idle(cascade: kc.Cascade) -> None:
    """No pin, no reservation, no quarantined slot is left in the primary tier."""
    primary = cascade.primary
    assert primary.num_write_pending == 0
    assert primary.num_free + primary.num_evictable == primary.num_blocks


async def test_aborted_request_releases_its_promotion_reservations() -> None:
    """Defect 1 (vLLM PR #52571): finish_request after lookup_prefix and before load submits
    the queued promotion, so the reserved slot is not held forever and a later store fits."""
    async with kc.open_cascade(config(cpu_blocks=1)) as cascade:
        await offload(cascade, [key(1)], [1])
        aborted = kc.ReqContext("aborted")
        found = await cascade.lookup_prefix([key(1)], aborted)
        assert found.tiers == ["memory"]  # a primary slot is reserved for its promotion
        cascade.finish_request(aborted)
        assert cascade.coordinator.has_pending_work()
        await asyncio.wait(cascade.coordinator.job_futures())
        cascade.coordinator.poll_now()
        assert_idle(cascade)
        assert bytes(cascade.host.row(cascade.primary.get_block(key(1)).block_id)) == b"\1" * 64
        later = kc.ReqContext("later")
        assert (await cascade.store([key(2)], later, [2])).stored == [key(2)]
        cascade.finish_request(later)


async def test_a_key_given_twice_in_one_call_is_refused() -> None:
    """Defect 2 (LMCache #2954): a key given twice would be pinned once and unpinned twice;
    every call refuses it with the key named, before any state changes."""
    async with kc.open_cascade(config(cpu_blocks=4)) as cascade:
        ctx = kc.ReqContext("a")
        cascade.device.kv[1] = 1
        assert (await cascade.store([key(1)], ctx, [1])).stored == [key(1)]
        pinned = cascade.primary.get_block(key(1)).ref_cnt  # the cascade's pin
        for call in (
            cascade.lookup_prefix([key(1), key(1)], ctx),
            cascade.load([key(1), key(1)], ctx, [2, 3]),
            cascade.store([key(2), key(2)], ctx, [2, 3]),
        ):
            with pytest.raises(ValueError, match="offload keys given more than once"):
                await call
        with pytest.raises(ValueError, match="given more than once"):
            cascade.touch([key(1), key(1)], ctx)
        assert cascade.primary.get_block(key(1)).ref_cnt == pinned
        assert cascade.primary.get_block(key(2)) is None
        await cascade.wait_cascades()
        cascade.finish_request(ctx)
        assert_idle(cascade)


async def test_store_from_a_block_a_load_is_filling_waits_for_the_load() -> None:
    """Defect 5 (vLLM #46951), awaitable API: a store from GPU block 3 while a load is filling
    it copies the loaded bytes, never the block's previous content."""
    gated = {"type": "GatedTier", "module_path": "test_cascade", "name": "gated"}
    async with kc.open_cascade(config(cpu_blocks=2, tier=gated)) as cascade:
        GatedTier.gate.set()
        await offload(cascade, [key(1)], [1])
        GatedTier.gate.clear()
        reader = kc.ReqContext("reader")
        found = await cascade.lookup_prefix([key(1)], reader)
        cascade.device.kv[3] = 99  # what block 3 held before the load
        load = asyncio.create_task(cascade.load(found.keys, reader, [3]))
        await asyncio.sleep(0.05)  # the promotion waits at the gate
        writer = kc.ReqContext("writer")
        store = asyncio.create_task(cascade.store([key(2)], writer, [3]))
        await asyncio.sleep(0.05)
        assert not store.done()  # waits for the load filling its source block
        GatedTier.gate.set()
        assert (await load).loaded == 1
        assert (await store).stored == [key(2)]
        row = cascade.host.row(cascade.primary.get_block(key(2)).block_id)
        assert bytes(row) == b"\1" * 64  # the loaded bytes, not 99
        await cascade.wait_cascades()
        cascade.finish_request(reader)
        cascade.finish_request(writer)
        assert_idle(cascade)


async def test_a_load_into_a_block_an_earlier_store_copies_from_waits_for_the_store() -> None:
    """The reverse of vLLM #46951, found by a break-it run: a load into GPU blocks that an
    unfinished store (called before it) still copies from overwrote them first, and the store
    published the loaded bytes under its own keys, served later as those keys (checksums match:
    undetectable). Calls on one block now take effect in call order; the store here waits for
    an earlier load into its block 0 (gated), so without the order the later load would win."""
    gated = {"type": "GatedTier", "module_path": "test_cascade", "name": "gated"}
    async with kc.open_cascade(config(cpu_blocks=8, tier=gated)) as cascade:
        GatedTier.gate.set()
        await offload(cascade, [key(1)], [1])
        other = kc.ReqContext("other")
        cascade.device.kv[5] = 77
        assert (await cascade.store([key(20)], other, [5])).stored == [key(20)]
        await cascade.wait_cascades()
        GatedTier.gate.clear()
        first, writer, second = (kc.ReqContext(n) for n in ("first", "writer", "second"))
        found = await cascade.lookup_prefix([key(1)], first)
        load_0 = asyncio.create_task(cascade.load(found.keys, first, [0]))
        for g in (1, 2, 3):
            cascade.device.kv[g] = 50 + g
        a_keys = [key(10 + i) for i in range(4)]
        store = asyncio.create_task(cascade.store(a_keys, writer, [0, 1, 2, 3]))
        await asyncio.sleep(0.05)
        found = await cascade.lookup_prefix([key(20)], second)
        load_1 = asyncio.create_task(cascade.load(found.keys, second, [1]))
        await asyncio.sleep(0.05)
        assert not store.done() and not load_1.done()  # in call order: load_0, store, load_1
        assert cascade.device.kv[1].tolist() == [51] * 64
        GatedTier.gate.set()
        assert (await load_0).loaded == 1
        assert (await store).stored == a_keys
        assert (await load_1).loaded == 1
        rows = [bytes(cascade.host.row(cascade.primary.get_block(k).block_id)) for k in a_keys]
        assert rows == [b"\1" * 64, b"\x33" * 64, b"\x34" * 64, b"\x35" * 64]
        assert cascade.device.kv[1].tolist() == [77] * 64
        await cascade.wait_cascades()
        for ctx in (other, first, writer, second):
            cascade.finish_request(ctx)
        assert_idle(cascade)


async def test_a_load_waits_for_another_requests_store_in_flight() -> None:
    """A key another request is still storing GPU→CPU counts as found, and the load waits for
    that store (the coordinator's write_futures) instead of calling the key unreadable: the
    reader gets the writer's bytes."""
    async with kc.open_cascade(config(cpu_blocks=4, gpu_blocks=4)) as cascade:
        writer, reader = kc.ReqContext("writer"), kc.ReqContext("reader")
        cascade.device.kv[0] = 7
        store = asyncio.ensure_future(cascade.store([key(1)], writer, [0]))
        while not cascade.coordinator.writes.writers([key(1)]):
            await asyncio.sleep(0)  # until the store has its slot and copies
        found = await cascade.lookup_prefix([key(1)], reader)  # no await inside: still copying
        assert (found.keys, found.tiers, store.done()) == ([key(1)], ["cpu"], False)
        loaded = await cascade.load(found.keys, reader, [2])
        assert (loaded.loaded, loaded.failed_keys) == (1, [])
        assert cascade.device.kv[2].tolist() == [7] * 64
        assert (await store).stored == [key(1)]
        await cascade.wait_cascades()
        cascade.finish_request(reader)
        cascade.finish_request(writer)
        assert_idle(cascade)


async def test_open_cascade_may_exit_in_another_task() -> None:
    """The lifecycle's task group lives in its own task: entered in one task and exited in
    another (a fixture, a state machine's steps), the cascade stops every actor."""
    stack = contextlib.AsyncExitStack()
    cascade = await asyncio.ensure_future(stack.enter_async_context(kc.open_cascade(config(2))))
    assert [t.get_name() for t in asyncio.all_tasks() if t.get_name() == "kvcascade-memory"]
    await asyncio.ensure_future(stack.aclose())
    assert [t for t in asyncio.all_tasks() if t.get_name().startswith("kvcascade-")] == []
    with pytest.raises(kc.TierUnavailableError, match="closed"):
        await cascade.lookup_prefix([key(1)], kc.ReqContext("late"))


class UnreachableTier(kc.MemoryTier):
    """A memory tier whose start-up fails, as an S3 tier's does when its endpoint is down."""

    async def _startup(self) -> None:
        raise kc.TierUnavailableError("endpoint not reachable")


async def test_failed_start_of_a_second_tier_stops_the_first() -> None:
    """Defect 10: when the second tier fails to start, serve_coordinator (and so open_cascade)
    raises with the first tier's actor already stopped and closed, not left running."""
    host = kc.HostBuffer(4, 64)
    try:
        first = kc.MemoryTier(host)
        coord = kc.TieringCoordinator(
            kc.CPUOffloadingManager(4), [first, UnreachableTier(host, name="down")]
        )
        with pytest.raises(kc.TierUnavailableError, match="not reachable"):
            async with kc.serve_coordinator(coord):
                raise AssertionError("must not start")
        assert [t for t in asyncio.all_tasks() if t.get_name().startswith("kvcascade-")] == []
        with pytest.raises(kc.TierUnavailableError):
            first.submit_store(kc.TransferJob(0, [key(1)], [0], False))
    finally:
        host.close()
    cfg = kc.CascadeConfig(
        block_bytes=64,
        gpu_blocks=4,
        cpu_blocks=4,
        secondary_tiers=[
            {"type": "memory"},
            {"type": "UnreachableTier", "module_path": "test_cascade", "name": "down"},
        ],
        model_name="test-model",
    )
    with pytest.raises(kc.TierUnavailableError, match="not reachable"):
        async with kc.open_cascade(cfg):
            raise AssertionError("must not start")
    assert [t for t in asyncio.all_tasks() if t.get_name().startswith("kvcascade-")] == []


async def test_a_deadline_on_open_cascade_cancels_a_tier_start_that_hangs(tmp_path) -> None:
    """Found by a break-it run: ``asyncio.wait_for(open_cascade, 1 s)`` against a valkey server
    that accepts connections and never answers returned only when the tier's own timeouts ran
    out (15 s with the defaults, here 120 s): the cancellation waited for the start. Now the
    start is cancelled with its caller, and the tier started before it (fs) is stopped."""
    hung = socket.socket()  # a hung server: the kernel accepts, nothing ever answers
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)
    url = f"redis://127.0.0.1:{hung.getsockname()[1]}"
    cfg = kc.CascadeConfig(
        block_bytes=64,
        gpu_blocks=4,
        cpu_blocks=4,
        secondary_tiers=[
            {"type": "fs", "root_dir": str(tmp_path)},
            {"type": "valkey", "url": url, "timeout_s": 120, "max_attempts": 1},
        ],
        model_name="test-model",
    )
    opened: list[kc.Cascade] = []

    async def serve() -> None:
        async with kc.open_cascade(cfg) as cascade:
            opened.append(cascade)

    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(serve(), 0.5)
        assert loop.time() - start < 60  # not the tier's own 120 s
    finally:
        hung.close()
    assert opened == []
    assert [t for t in asyncio.all_tasks() if t.get_name().startswith("kvcascade-")] == []


async def test_a_cascade_that_was_never_opened_refuses_every_call() -> None:
    """Defect 10: a Cascade built directly (its actors never ran) refuses store/load/lookup with
    a clear error at the entry, before anything is pinned or reserved."""
    cascade = kc.Cascade(config(cpu_blocks=2))
    try:
        ctx = kc.ReqContext("a")
        for call in (
            cascade.store([key(1)], ctx, [0]),
            cascade.lookup_prefix([key(1)], ctx),
            cascade.load([key(1)], ctx, [0]),
        ):
            with pytest.raises(RuntimeError, match="open_cascade"):
                await call
        assert cascade.primary.get_block(key(1)) is None
        assert cascade.primary.num_free == 2
    finally:
        cascade.coordinator.shutdown()
        cascade._release()


async def test_a_failed_device_load_is_counted() -> None:
    """Defect 11: a CPU→GPU copy that fails is reported as failed keys and counted."""
    async with kc.open_cascade(config(cpu_blocks=2, gpu_blocks=4)) as cascade:
        ctx = kc.ReqContext("a")
        cascade.device.kv[1] = 1
        await cascade.store([key(1)], ctx, [1])
        await cascade.wait_cascades()
        views = cascade.device.views
        cascade.device.views = [torch.zeros((4, 32), dtype=torch.int8)]  # too short: no plan
        try:
            found = await cascade.lookup_prefix([key(1)], ctx)
            result = await cascade.load(found.keys, ctx, [2])
        finally:
            cascade.device.views = views
        assert result.loaded == 0 and result.failed_keys == [key(1)]
        assert cascade.counters["load_failed_blocks"] == 1
        cascade.finish_request(ctx)
        assert_idle(cascade)


async def test_store_of_more_keys_than_the_cpu_tier_holds_stores_what_fits(caplog) -> None:
    """Issue #21 item 3: store() of 6 keys into a 4-slot CPU tier stores the leading 4 and
    drops 2 (counted, in the result, logged once as a warning), instead of dropping all 6."""
    caplog.set_level(logging.DEBUG, logger="kvcascade.cascade")
    async with kc.open_cascade(config(cpu_blocks=4)) as cascade:
        ctx = kc.ReqContext("a")
        keys = [key(i) for i in range(6)]
        for g in range(6):
            cascade.device.kv[g] = g
        result = await cascade.store(keys, ctx, list(range(6)))
        assert result.stored == keys[:4] and result.dropped == 2
        assert cascade.counters["store_dropped_blocks"] == 2
        for i, k in enumerate(keys[:4]):
            assert bytes(cascade.host.row(cascade.primary.get_block(k).block_id)) == bytes([i]) * 64
        await cascade.wait_cascades()
        again = await cascade.store([key(10 + i) for i in range(6)], ctx, list(range(6)))
        assert len(again.stored) == 4 and again.dropped == 2  # the first 4 were evicted
        assert cascade.counters["store_dropped_blocks"] == 4
        warnings = [r.levelname for r in caplog.records if "store dropped" in r.getMessage()]
        assert warnings == ["WARNING", "DEBUG"]
        await cascade.wait_cascades()
        cascade.finish_request(ctx)
        assert_idle(cascade)


async def test_invalidate_removes_keys_from_every_tier(tmp_path) -> None:
    """Issue #21 item 6: invalidated keys are gone from the primary, the memory tier and the
    fs tier's files; a key a request is reading stays in the primary and is reported."""
    tiers = [{"type": "memory"}, {"type": "fs", "root_dir": str(tmp_path)}]
    cfg = kc.CascadeConfig(
        block_bytes=64, gpu_blocks=8, cpu_blocks=8, secondary_tiers=tiers, model_name="m"
    )
    async with kc.open_cascade(cfg) as cascade:
        ctx = kc.ReqContext("w")
        keys = [key(i) for i in range(4)]
        await cascade.store(keys, ctx, [0, 1, 2, 3])
        await cascade.wait_cascades()
        cascade.finish_request(ctx)
        reader = kc.ReqContext("r")
        assert (await cascade.lookup_prefix(keys[3:], reader)).num_hits == 1  # pins key 3
        assert len(list(tmp_path.rglob("*.bin"))) == 4
        list(cascade.coordinator.take_events())
        result = await cascade.invalidate(keys)
        assert result.removed == {"cpu": 3, "memory": 4, "fs": 4}
        assert result.in_use == [keys[3]]
        assert list(tmp_path.rglob("*.bin")) == []
        removed = [e for e in cascade.coordinator.take_events() if e.removed]
        assert {e.tier for e in removed} >= {"memory", "fs"}
        cascade.finish_request(reader)
        probe = kc.ReqContext("p")
        assert (await cascade.lookup_prefix(keys[:3], probe)).num_hits == 0
        cascade.finish_request(probe)
        assert (await cascade.invalidate(keys)).removed == {"cpu": 1, "memory": 0, "fs": 0}
        assert_idle(cascade)


async def test_start_up_logs_one_line_with_tiers_capacities_and_paths(tmp_path, caplog) -> None:
    """Issue #21 item 10: once the tiers are ready, one INFO line gives the primary tier's
    capacity and each tier with its directory and bound (never a secret)."""
    caplog.set_level(logging.INFO, logger="kvcascade._lifecycle")
    tiers = [{"type": "memory"}, {"type": "fs", "root_dir": str(tmp_path), "max_bytes": 10**6}]
    cfg = kc.CascadeConfig(
        block_bytes=64, gpu_blocks=8, cpu_blocks=16, secondary_tiers=tiers, model_name="m"
    )
    async with kc.open_cascade(cfg):
        lines = [r.getMessage() for r in caplog.records if "tiers ready" in r.getMessage()]
    assert lines == [
        "kvcascade: tiers ready: cpu 16 blocks × 64 bytes = 1,024 bytes; memory (MemoryTier); "
        f"fs (FileSystemTier): root={tmp_path}, max_bytes=1000000"
    ]
    caplog.clear()
    cfg = kc.CascadeConfig(block_bytes=64, gpu_blocks=8, cpu_blocks=16, secondary_tiers=[])
    async with kc.open_cascade(cfg):
        pass
    assert "kvcascade: no secondary tiers (GPU and CPU only)" in caplog.messages


def engine_kv(blocks: int) -> dict[str, torch.Tensor]:
    """Two layers of an engine's KV cache: FlashAttention's layout ``(2, blocks, block_size,
    heads, head_dim)`` in float16 (256 bytes per layer and K or V per block) and vLLM's CPU
    backend's ``(blocks, heads, block_size, 2·head_dim)`` in bfloat16 (512 bytes)."""
    return {
        "layer0": torch.zeros((2, blocks, 4, 2, 16), dtype=torch.float16),
        "layer1": torch.zeros((blocks, 2, 4, 32), dtype=torch.bfloat16),
    }


async def test_the_engines_own_kv_tensors_are_copied_to_and_from(tmp_path) -> None:
    """Issue #21 item 1: a Cascade on the engine's KV tensors (two layouts, canonical views)
    stores from them and loads back into them — via the fs tier after the CPU tier evicted —
    byte-exact in every layer, and touches no other block; no stand-in tensor is allocated."""
    kv = engine_kv(16)
    views = kc.canonical_views({"layer0": kv["layer0"]}, "flash_attn")
    views += kc.canonical_views({"layer1": kv["layer1"]}, "cpu")
    assert [v.shape[1] for v in views] == [256, 256, 512]
    tiers = [{"type": "fs", "root_dir": str(tmp_path)}]
    cfg = kc.CascadeConfig(
        block_bytes=1024, gpu_blocks=16, cpu_blocks=2, secondary_tiers=tiers, model_name="m"
    )
    gen = torch.Generator().manual_seed(5)
    for t in kv.values():
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    before = {name: t.clone() for name, t in kv.items()}
    keys = [key(i) for i in range(4)]
    async with kc.open_cascade(cfg, kv_views=views) as cascade:
        assert cascade.device.kv is None and cascade.device.views == views
        writer = kc.ReqContext("w")
        assert (await cascade.store(keys, writer, [0, 1, 2, 3])).dropped == 2  # 2 CPU slots
        assert (await cascade.store(keys[2:], writer, [2, 3])).stored == keys[2:]
        await cascade.wait_cascades()
        cascade.finish_request(writer)
        filler = kc.ReqContext("filler")  # push them out of the CPU tier: only fs holds them
        for i in range(2):
            await cascade.store([key(100 + i)], filler, [7])
            await cascade.wait_cascades()
        cascade.finish_request(filler)
        ctx = kc.ReqContext("r")
        got = 0
        while got < 4:  # two CPU slots: the prefix comes back in parts
            found = await cascade.lookup_prefix(keys[got:], ctx)
            assert found.tiers == ["fs"] * found.num_hits and found.num_hits
            loaded = await cascade.load(
                found.keys, ctx, list(range(8 + got, 8 + got + found.num_hits))
            )
            got += loaded.loaded
        cascade.finish_request(ctx)
    k0, l1 = kv["layer0"], kv["layer1"]
    assert torch.equal(k0[:, 8:12], before["layer0"][:, 0:4])
    assert torch.equal(l1[8:12], before["layer1"][0:4])
    untouched = [b for b in range(16) if b not in range(8, 12)]
    assert torch.equal(k0[:, untouched], before["layer0"][:, untouched])
    assert torch.equal(l1[untouched], before["layer1"][untouched])


@pytest.mark.parametrize(
    ("views", "message"),
    [
        ([], "kv_views is empty"),
        ([torch.zeros((16, 1024), dtype=torch.float16)], r"kv_views\[0\] must be an int8"),
        (
            [torch.zeros((8, 1024), dtype=torch.int8)],
            r"kv_views\[0\] has 8 blocks, gpu_blocks is 16",
        ),
        (
            [torch.zeros((16, 512), dtype=torch.int8)],
            "hold 512 bytes per block, the GPU page is 1024",
        ),
        ([torch.zeros((1024, 16), dtype=torch.int8).t()], "not contiguous"),
        (
            torch.zeros((16, 1024), dtype=torch.int8),
            r"kv_views must be a list .* got one torch.int8 \(16, 1024\) tensor: pass \[view\]",
        ),
    ],
)
def test_kv_views_that_do_not_fit_are_refused_naming_the_view(views, message) -> None:
    cfg = kc.CascadeConfig(block_bytes=1024, gpu_blocks=16, cpu_blocks=2, secondary_tiers=[])
    with pytest.raises(kc.ConfigError, match=message):
        kc.Cascade(cfg, kv_views=views)


async def test_promotions_of_requests_finished_unread_free_their_primary_slots() -> None:
    """Lookups alone (no load, no store in between), each request finished right after its
    lookup: every lookup of a key held only by the secondary tier is a hit. The promotions of
    the finished requests landed; their slots must become evictable at the next lookup, not
    stay "being written" until some later load or store happens to poll."""
    cfg = kc.CascadeConfig(
        block_bytes=64, gpu_blocks=8, cpu_blocks=2, secondary_tiers=[{"type": "memory"}]
    )
    keys = [kc.make_offload_key(bytes([i]) * 8, 0) for i in range(6)]
    async with kc.open_cascade(cfg) as cascade:
        for i, key in enumerate(keys):
            ctx = kc.ReqContext(f"store-{i}")
            await cascade.store([key], ctx, [i])
            cascade.finish_request(ctx)
            await cascade.wait_cascades()
        hits = []
        for i in range(4):
            ctx = kc.ReqContext(f"lookup-{i}")
            found = await cascade.lookup_prefix([keys[i]], ctx)
            hits.append(found.num_hits)
            cascade.finish_request(ctx)
            await asyncio.wait(cascade.coordinator.job_futures())
        assert hits == [1, 1, 1, 1]
        cascade.coordinator.poll_now()
        assert cascade.primary.num_evictable == 2  # nothing left pinned or being written


async def test_models_sharing_an_fs_directory_see_only_their_own_blocks(tmp_path) -> None:
    """Tenant isolation: three cascades open at once on one fs directory with equal geometry.
    Model "a" stores four blocks; model "b" finds none of them (its namespace is another
    directory), a second cascade of model "a" finds all four in the fs tier and loads them
    byte-exact."""

    def make(model: str) -> kc.CascadeConfig:
        tiers = [{"type": "fs", "root_dir": str(tmp_path)}]
        return kc.CascadeConfig(
            block_bytes=64, gpu_blocks=8, cpu_blocks=8, secondary_tiers=tiers, model_name=model
        )

    keys = [key(i) for i in range(4)]
    async with contextlib.AsyncExitStack() as stack:
        writer, other, same = [
            await stack.enter_async_context(kc.open_cascade(make(m))) for m in ("a", "b", "a")
        ]
        writer.device.kv[:4] = torch.arange(1, 5, dtype=torch.int8)[:, None]  # block i: i + 1
        ctx = kc.ReqContext("w")
        assert len((await writer.store(keys, ctx, [0, 1, 2, 3])).stored) == 4
        await writer.wait_cascades()
        writer.finish_request(ctx)

        ctx = kc.ReqContext("b")
        assert (await other.lookup_prefix(keys, ctx)).num_hits == 0
        other.finish_request(ctx)
        assert other.tiers[0].counters["corrupt_blocks"] == 0

        ctx = kc.ReqContext("a2")
        found = await same.lookup_prefix(keys, ctx)
        assert found.num_hits == 4 and list(found.tiers) == ["fs"] * 4
        assert (await same.load(found.keys, ctx, [4, 5, 6, 7])).loaded == 4
        same.finish_request(ctx)
        assert torch.equal(same.device.kv[4:], writer.device.kv[:4])
        assert_idle(same)
    namespaces = sorted(p.name.split("_")[0] for p in tmp_path.iterdir())
    assert namespaces == ["a", "a", "b", "b"]  # <model>_<digest> (config.json) and its _r0


@pytest.mark.parametrize(
    "params",
    ["kvcascade_hint", ["kvcascade_hint"], 5, {"kvcascade_hint": {1: 1, "x": 2}}],
    ids=["str", "list", "int", "unsortable-fields"],
)
@pytest.mark.parametrize("policy", ["lru", "adaptive"])
async def test_malformed_kv_transfer_params_are_served_as_unhinted(
    params: object, policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``kv_transfer_params`` that is no dict, or a hint whose unknown fields do not sort: a
    warning and an unhinted request (a TypeError came out of ``store`` and ``touch``)."""
    cfg = config(cpu_blocks=4)
    cfg.eviction_policy = policy
    async with kc.open_cascade(cfg) as cascade:
        ctx = kc.ReqContext("r", params)  # type: ignore[arg-type]
        cascade.device.kv[1] = 1
        with caplog.at_level(logging.WARNING, logger="kvcascade.hints"):
            assert (await cascade.store([key(1)], ctx, [1])).stored == [key(1)]
            cascade.touch([key(1)], ctx)
        cascade.finish_request(ctx)
        assert "ignoring" in caplog.text
        reader = kc.ReqContext("reader")
        assert (await cascade.lookup_prefix([key(1)], reader)).tiers[0] == "cpu"
        await cascade.load([key(1)], reader, [2])
        assert int(cascade.device.kv[2][0]) == 1
        cascade.finish_request(reader)


@pytest.mark.parametrize("bad", ["not-bytes", 12345, None, b"ab", bytearray(12)])
async def test_a_bad_key_in_the_hooks_fails_its_caller_not_another_request(tmp_path, bad) -> None:
    """Through the synchronous hooks (``cascade.coordinator``, as a scheduler drives them) a
    lookup of a key that is no offload key was accepted: the fs tier's probe job, which
    batches the step's keys of every request, died on it (``TypeError`` in a task nobody
    awaited), and another request's lookups of a block in the fs tier answered ``RETRY`` for
    ever (found by a break-it run). Now the bad call raises, naming the key, and the other
    request is served."""
    tiers = [{"type": "fs", "root_dir": str(tmp_path)}]
    cfg = kc.CascadeConfig(
        block_bytes=64, gpu_blocks=8, cpu_blocks=2, secondary_tiers=tiers, model_name="m"
    )
    async with kc.open_cascade(cfg) as cascade:
        await offload(cascade, [key(1)], [0])
        assert cascade.coordinator.primary.get_block(key(1)) is None  # in the fs tier only
        coord = cascade.coordinator
        a, b = kc.ReqContext("a"), kc.ReqContext("b")
        with pytest.raises((TypeError, ValueError), match="offload key"):
            coord.lookup(bad, a)
        with pytest.raises((TypeError, ValueError), match="offload key"):
            coord.prepare_store([key(2), bad], a)
        assert coord.primary.get_block(key(2)) is None  # refused before any state changed
        seen = [coord.lookup(key(1), b)]
        while seen[-1] is not kc.LookupResult.HIT and len(seen) < 50:
            coord.on_schedule_end()
            await asyncio.sleep(0.02)
            seen.append(coord.lookup(key(1), b))
        assert seen[-1] is kc.LookupResult.HIT, seen
        coord.on_request_finished(a)
        coord.on_request_finished(b)


async def test_store_after_a_lookup_whose_request_finished_unread() -> None:
    """A request looked up a prefix held only in the secondary tier (its promotions reserved
    every primary slot) and finished without loading it, as a client that goes away. Its
    promotions landed, their slots evictable, but ``store`` saw them only after something
    polled: every later store was dropped ("the CPU tier has no evictable room"; found by a
    break-it run). Now a store that finds no room applies the finished jobs first."""
    async with kc.open_cascade(config(cpu_blocks=4)) as cascade:
        keys = [key(i) for i in range(4)]
        await offload(cascade, keys, [0, 1, 2, 3])  # in the memory tier only
        gone = kc.ReqContext("gone")
        assert (await cascade.lookup_prefix(keys, gone)).num_hits == 4  # 4 slots reserved
        cascade.finish_request(gone)  # submits the promotions, which land unread
        await asyncio.wait(cascade.coordinator.job_futures())
        writer = kc.ReqContext("next")
        new = [key(100 + i) for i in range(4)]
        result = await cascade.store(new, writer, [4, 5, 6, 7])
        assert (result.stored, result.dropped) == (new, 0)
        assert cascade.counters["store_dropped_blocks"] == 0
        cascade.finish_request(writer)
        await cascade.wait_cascades()
        assert_idle(cascade)


async def test_a_prompt_longer_than_the_cpu_tier_stored_in_chunks_reaches_the_tier() -> None:
    """One request stores a 64-block prompt in chunks of 8 through a 16-slot CPU tier, each
    chunk's cascade finished before the next chunk comes (the forward pass in between). The
    ``Cascade`` applied finished jobs only when a store found no room: the first cascade
    counted as queued for ever, back-pressure refused every later one and its pins stayed
    held — 8 of 64 blocks reached the idle secondary tier (found by a break-it run). Now each
    call applies the finished jobs first, and a later request reads every block back."""
    async with kc.open_cascade(config(cpu_blocks=16, gpu_blocks=80)) as cascade:
        keys = [key(i) for i in range(64)]
        writer = kc.ReqContext("prefill")
        assert (await cascade.lookup_prefix(keys, writer)).num_hits == 0
        for i in range(64):
            cascade.device.kv[i] = i
        for start in range(0, 64, 8):
            ids = list(range(start, start + 8))
            result = await cascade.store(keys[start : start + 8], writer, ids)
            assert (result.stored, result.dropped) == (keys[start : start + 8], 0)
            await asyncio.wait(cascade.coordinator.job_futures())  # finished, not yet applied
        cascade.finish_request(writer)
        await cascade.wait_cascades()
        stats = cascade.coordinator.get_stats()
        assert not any(v for k, v in stats.items() if "cascade_dropped" in k), stats
        reader = kc.ReqContext("reader")
        loaded = 0
        while loaded < 64:  # through 16 slots the prefix comes back in parts
            found = await cascade.lookup_prefix(keys[loaded:], reader)
            assert found.num_hits
            done = await cascade.load(found.keys, reader, [64 + j for j in range(found.num_hits)])
            for j in range(done.loaded):
                assert bool((cascade.device.kv[64 + j] == loaded + j).all())
            loaded += done.loaded
        cascade.finish_request(reader)
        assert_idle(cascade)


def _layer_kv(layout: str, dtype: torch.dtype, layers: int = 2, heads: int = 4):
    shape = (2, 8, 16, heads, 32) if layout == "flash_attn" else (8, 2, heads, 16, 32)
    return {f"layer{i}": torch.zeros(shape, dtype=dtype) for i in range(layers)}


@pytest.mark.parametrize(
    ("layout", "dtype", "layers", "heads", "hits"),
    [
        ("flash_attn", torch.bfloat16, 2, 4, 4),  # the same engine: its blocks, byte-exact
        ("flashinfer", torch.bfloat16, 2, 4, 0),  # HND: another byte order
        ("flash_attn", torch.float16, 2, 4, 0),
        ("flash_attn", torch.bfloat16, 1, 8, 0),  # one layer of twice the heads
    ],
)
async def test_an_engine_of_another_layout_dtype_or_geometry_never_reads_the_blocks(
    tmp_path, layout: str, dtype: torch.dtype, layers: int, heads: int, hits: int
) -> None:
    """Blocks an engine stored through its canonical views (FlashAttention, bf16, 2 layers of 4
    heads) were served to a restart over the same fs directory with another layout, dtype or
    layer geometry of the same block size, as valid KV (found by a break-it run): the
    namespace had only the model and the block size. Now it has the views' layout, dtype and
    block shapes; the same engine still reads its blocks back byte-exact."""

    def config(block_bytes: int) -> kc.CascadeConfig:
        tiers = [{"type": "fs", "root_dir": str(tmp_path)}]
        return kc.CascadeConfig(
            block_bytes=block_bytes,
            gpu_blocks=8,
            cpu_blocks=8,
            secondary_tiers=tiers,
            model_name="m",
        )

    keys = [key(i) for i in range(4)]
    kv = _layer_kv("flash_attn", torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    for t in kv.values():
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    views = kc.canonical_views(kv, "flash_attn")
    async with kc.open_cascade(config(sum(v.shape[1] for v in views)), kv_views=views) as c:
        writer = kc.ReqContext("w")
        assert (await c.store(keys, writer, [0, 1, 2, 3])).stored == keys
        await c.wait_cascades()
        c.finish_request(writer)
    other = _layer_kv(layout, dtype, layers, heads)
    views = kc.canonical_views(other, layout)
    assert sum(v.shape[1] for v in views) == 16384  # the same block size every time
    async with kc.open_cascade(config(16384), kv_views=views) as c:
        reader = kc.ReqContext("r")
        found = await c.lookup_prefix(keys, reader)
        assert found.num_hits == hits
        if hits:
            assert (await c.load(found.keys, reader, [4, 5, 6, 7])).loaded == 4
            for name, t in other.items():
                assert torch.equal(t[:, 4:8], kv[name][:, 0:4])
        c.finish_request(reader)


def test_the_namespace_of_views_survives_every_list_operation() -> None:
    """What the views' bytes mean is recorded on each view, not on the list: a copy, a slice,
    two layouts' views joined name every layer; another order is another namespace (K and V
    swapped), and a view made otherwise adds only its page size. A list-level record was lost
    by ``list(v)``, ``v[:]`` or ``v.copy()``, and a bf16 engine's blocks were read as fp16 KV
    (found by a review run)."""
    kv = engine_kv(16)
    views = kc.canonical_views({"layer0": kv["layer0"]}, "flash_attn")
    views += kc.canonical_views({"layer1": kv["layer1"]}, "cpu")
    expected = {
        "kv_views": [
            ["layer0", "flash_attn", "float16", [2, 4, 2, 16], 0, 256],
            ["layer0", "flash_attn", "float16", [2, 4, 2, 16], 1, 256],
            ["layer1", "cpu", "bfloat16", [2, 4, 32], 0, 512],
        ]
    }
    assert views_identity(views) == expected
    for same in (list(views), views[:], views.copy(), [*views], tuple(views)):
        assert views_identity(same) == expected
    swapped = [views[1], views[0], views[2]]
    assert views_identity(swapped) != expected
    raw = views_identity([*views, torch.zeros((16, 64), dtype=torch.int8)])
    assert raw["kv_views"][:3] == expected["kv_views"] and raw["kv_views"][3] == [64]
    other = {"layer0": kv["layer0"].to(torch.bfloat16)}
    assert views_identity(kc.canonical_views(other, "flash_attn")) != views_identity(views[:2])


async def test_a_call_from_another_event_loop_is_refused_before_anything_changes() -> None:
    """A ``store`` run from another thread's event loop copied the KV into the CPU tier, then
    failed at the cascade submission and left the slots pinned; a ``load`` from there was not
    refused at all (found by a break-it run). Every call from outside the loop that opened the
    cascade is now a ``RuntimeError`` before any state changes; its own loop works as before."""
    async with kc.open_cascade(config(cpu_blocks=4)) as cascade:
        keys = [key(i) for i in range(2)]
        ctx = kc.ReqContext("r")
        calls = {
            "store": lambda: asyncio.run(cascade.store(keys, ctx, [0, 1])),
            "lookup_prefix": lambda: asyncio.run(cascade.lookup_prefix(keys, ctx)),
            "load": lambda: asyncio.run(cascade.load(keys, ctx, [0, 1])),
            "touch": lambda: cascade.touch(keys, ctx),
            "finish_request": lambda: cascade.finish_request(ctx),
            "wait_cascades": lambda: asyncio.run(cascade.wait_cascades()),
        }
        for name, call in calls.items():
            errors: list[BaseException] = []

            def run(call=call, errors=errors) -> None:
                try:
                    call()
                except BaseException as exc:
                    errors.append(exc)

            thread = threading.Thread(target=run)
            thread.start()
            thread.join(10)
            assert len(errors) == 1 and isinstance(errors[0], RuntimeError), (name, errors)
            assert "outside the event loop that opened it" in str(errors[0])
        assert cascade.primary.num_free == 4
        cascade.device.kv[0] = 7
        assert (await cascade.store(keys, ctx, [0, 1])).stored == keys
        await cascade.wait_cascades()
        cascade.finish_request(ctx)
        assert_idle(cascade)


async def test_calls_made_while_the_cascade_closes_are_refused(caplog) -> None:
    """Once the ``async with`` body has ended the tiers drain; a task still calling
    ``lookup_prefix`` and ``store`` there was answered all-miss ("probe failed: tier is not
    running", counted as probe failures) and had its stores dropped, and tasks retrying without
    a pause starved the close (found by a break-it run). They now get ``TierUnavailableError``
    from the moment the body ends."""
    outcome: list[BaseException] = []
    started = asyncio.Event()

    async def client(cascade: kc.Cascade) -> None:
        ctx = kc.ReqContext("late")
        try:
            while True:
                await cascade.lookup_prefix([key(1)], ctx)
                started.set()
                await cascade.store([key(2)], ctx, [0])
                await asyncio.sleep(0)
        except BaseException as exc:
            outcome.append(exc)
            raise

    async with kc.open_cascade(config(cpu_blocks=4)) as cascade:
        task = asyncio.ensure_future(client(cascade))
        await started.wait()
    with contextlib.suppress(kc.TierUnavailableError):
        await task
    assert len(outcome) == 1 and isinstance(outcome[0], kc.TierUnavailableError), outcome
    assert "probe failed" not in caplog.text


@pytest.mark.parametrize("enable_events", [True, False])
async def test_kv_events_nobody_takes_stay_bounded(caplog, monkeypatch, enable_events) -> None:
    """With the default ``enable_events=True`` and nobody taking the events, every stored and
    evicted key of a long-running server stayed queued (linear growth), and with
    ``enable_events=False`` the secondary tiers queued theirs anyway (found by a break-it run).
    A queue now keeps at most ``MAX_QUEUED_EVENTS`` (here 8), dropping the oldest with one
    warning, and queues nothing when events are off; a consumer gets the newest in order."""
    from kvcascade import _event_queue

    monkeypatch.setattr(_event_queue, "MAX_QUEUED_EVENTS", 8)
    cfg = kc.CascadeConfig(
        block_bytes=64,
        gpu_blocks=8,
        cpu_blocks=4,
        secondary_tiers=[{"type": "memory"}],
        enable_events=enable_events,
    )
    async with kc.open_cascade(cfg) as cascade:
        ctx = kc.ReqContext("writer")
        for i in range(40):  # 40 stores, 36 evictions, 40 tier stores: > 8 events everywhere
            assert (await cascade.store([key(i)], ctx, [0])).stored == [key(i)]
            await cascade.wait_cascades()
        cascade.finish_request(ctx)
        queues = [cascade.primary.event_queue, *(t.event_queue for t in cascade.tiers)]
        assert [len(q) for q in queues] == ([8, 8] if enable_events else [0, 0])
        events = list(cascade.coordinator.take_events())
        if enable_events:
            stored = [e.keys[0] for e in events if e.tier == "memory"]
            assert stored == [key(i) for i in range(32, 40)]  # the newest, in order
            assert [q.dropped for q in queues] == [76 - 8, 40 - 8]
            assert caplog.text.count("KV events nobody took") == 2
        else:
            assert events == [] and "KV events nobody took" not in caplog.text


@pytest.mark.parametrize(("rows", "block_bytes"), [(4, 64), (8, 48)])
def test_build_coordinator_refuses_a_buffer_of_another_geometry(
    tmp_path, rows: int, block_bytes: int
) -> None:
    """A coordinator built over a buffer of another size than its config was accepted: slots
    past the buffer's rows had no memory behind them (their cascades failed unseen), and
    blocks of the buffer's size were written into the namespace of the config's block size,
    where the next engine found them corrupt (found by a break-it run). Refused, naming both,
    before any tier is built."""
    cfg = kc.CascadeConfig(
        block_bytes=64,
        gpu_blocks=8,
        cpu_blocks=8,
        secondary_tiers=[{"type": "fs", "root_dir": str(tmp_path / "fs")}],
        model_name="m",
    )
    host = kc.HostBuffer(rows, block_bytes)
    try:
        with pytest.raises(kc.ConfigError, match=f"has {rows} rows of {block_bytes} bytes"):
            kc.build_coordinator(cfg, host, {"model_name": "m"})
        assert not (tmp_path / "fs").exists()
    finally:
        host.close()


async def test_a_slow_event_consumer_gets_every_event_queued_at_the_close() -> None:
    """``Cascade.events()`` ended at the close after the batch it held, and the events still
    queued were never yielded: a consumer pausing 20 ms per event got 192 of 1 168 keys (found
    by a review run). It now yields everything queued at the close before it ends."""
    got: collections.Counter[tuple[str, bool]] = collections.Counter()
    async with kc.open_cascade(config(cpu_blocks=8)) as cascade:

        async def consume() -> None:
            async for event in cascade.events():
                got[event.tier, event.removed] += len(event.keys)
                await asyncio.sleep(0.005)

        task = asyncio.ensure_future(consume())
        for i in range(0, 64, 4):
            ctx = kc.ReqContext(f"r{i}")
            keys = [key(j) for j in range(i, i + 4)]
            assert (await cascade.store(keys, ctx, [0, 1, 2, 3])).stored == keys
            cascade.finish_request(ctx)
        await cascade.wait_cascades()
    await asyncio.wait_for(task, 30)
    assert list(cascade.coordinator.take_events()) == []
    # every key stored in the CPU tier, the 56 it evicted, every block the memory tier holds
    # (back-pressure drops some cascades into it: 8 CPU slots)
    memory = cascade.tiers[0]
    assert dict(got) == {
        ("cpu", False): 64,
        ("cpu", True): 56,
        ("memory", False): len(memory.blocks),
    }
