"""The device tier: chunked GPU↔CPU transfers (docs/device.md) and the CUDA event bridge (issue #6),
on CPU tensors standing in for device memory, and on a real CUDA device where one is present
(``benchmarks/gpu_check.sh``)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch
from build_fixtures import build_in_progress, still_building  # noqa: F401 (fixture)

import kvcascade as kc
from kvcascade.tiers.device import DeviceTier, EventBridge

PAGE = 64
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    ),
]


def fill(kv: torch.Tensor) -> None:
    """GPU block b holds byte b+1 everywhere."""
    kv[:] = (torch.arange(kv.shape[0], dtype=torch.int8, device=kv.device) + 1)[:, None]


@pytest.mark.parametrize("dev", DEVICES)
async def test_chunked_load_follows_the_spec_example(dev: str) -> None:
    """The docs/device.md worked example: k=3, load, group block index 4, n=4, CPU chunks [7, 2] →
    GPU blocks 0..3 receive (chunk 7, pos 1), (7, 2), (2, 0), (2, 1)."""
    host = kc.HostBuffer(8, 3 * PAGE)
    device = DeviceTier(8, host, blocks_per_chunk=3, device=dev)
    rows = host.tensor()
    for chunk in range(8):
        for pos in range(3):
            rows[chunk, pos * PAGE : (pos + 1) * PAGE] = chunk * 10 + pos
    result = await device.transfer("load", [4], [4], [0, 1, 2, 3], [7, 2])
    assert result.success and result.bytes == 4 * PAGE
    assert [int(device.kv[b, 0]) for b in range(4)] == [71, 72, 20, 21]
    assert int(device.kv[4].abs().sum()) == 0  # untouched
    device.close()
    host.close()


@pytest.mark.parametrize("dev", DEVICES)
async def test_chunked_store_round_trip_multi_group(dev: str) -> None:
    """Two groups (one empty), k=2, first block mid-chunk: store then load back byte-exact."""
    host = kc.HostBuffer(6, 2 * PAGE)
    device = DeviceTier(10, host, blocks_per_chunk=2, device=dev)
    fill(device.kv)
    stored = await device.transfer("store", [3, 0, 2], [1, 0, 0], [4, 5, 6, 8, 9], [3, 0, 5])
    assert stored.success and stored.bytes == 5 * PAGE
    rows = host.tensor()
    assert rows[3, PAGE:].unique().tolist() == [5]  # block 4 at chunk 3, pos 1
    assert rows[0, :PAGE].unique().tolist() == [6]
    assert rows[0, PAGE:].unique().tolist() == [7]
    assert rows[5, :PAGE].unique().tolist() == [9] and rows[5, PAGE:].unique().tolist() == [10]
    device.kv.zero_()
    loaded = await device.transfer("load", [3, 0, 2], [1, 0, 0], [4, 5, 6, 8, 9], [3, 0, 5])
    assert loaded.success
    assert [int(device.kv[b, 0]) for b in (4, 5, 6, 8, 9)] == [5, 6, 7, 9, 10]
    device.close()
    host.close()


async def test_bad_plan_fails_the_transfer_without_raising() -> None:
    """Issue #6 item 7: a failed transfer resolves with a failure; nothing asserts."""
    host = kc.HostBuffer(2, PAGE)
    device = DeviceTier(2, host, device="cpu")
    result = await device.store([0, 5], [0, 1])
    assert not result.success and "ValueError" in (result.error or "")
    assert device.bytes_stored == 0
    device.close()
    with pytest.raises(kc.TierUnavailableError):
        await device.store([0], [0])
    host.close()


def test_blocks_per_chunk_must_divide_the_block() -> None:
    host = kc.HostBuffer(1, 100)
    with pytest.raises(kc.ConfigError, match="blocks_per_chunk=3"):
        DeviceTier(1, host, blocks_per_chunk=3, device="cpu")
    host.close()


class ManualEvent:
    """Stands in for a CUDA event: ``synchronize`` blocks until the test fires it."""

    def __init__(self, fail: bool = False) -> None:
        self._done = threading.Event()
        self.fail = fail

    def fire(self) -> None:
        self._done.set()

    def synchronize(self) -> None:
        assert self._done.wait(10)
        if self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


async def test_event_bridge_resolves_in_order_without_blocking_the_loop() -> None:
    """One waiter thread turns events into futures in submission order; the loop stays free
    while events are pending, and a failed synchronise reaches the awaiting task."""
    bridge = EventBridge()
    events = [ManualEvent(), ManualEvent(), ManualEvent(fail=True)]
    futures = [bridge.wait(e) for e in events]
    await asyncio.sleep(0.01)  # the loop runs while nothing has completed
    assert not any(f.done() for f in futures)
    events[1].fire()
    events[0].fire()
    await asyncio.wait_for(futures[1], 5)
    assert futures[0].done()
    events[2].fire()
    with pytest.raises(RuntimeError, match="illegal memory access"):
        await asyncio.wait_for(futures[2], 5)
    bridge.close()


@pytest.mark.parametrize("dev", DEVICES)
def test_device_store_matches_index_copy(dev: str) -> None:
    """The device path moves exactly what a plain indexed copy moves."""
    host = kc.HostBuffer(16, PAGE)
    device = DeviceTier(16, host, device=dev)
    device.kv[:] = torch.randint(-128, 127, device.kv.shape, dtype=torch.int8, device=dev)
    gpu, cpu = np.array([3, 9, 0, 15]), np.array([7, 1, 12, 4])
    result = asyncio.run(device.store(gpu, cpu))
    assert result.success
    assert torch.equal(host.tensor()[cpu], device.kv[gpu].cpu())
    device.close()
    host.close()


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize("dev", DEVICES)
async def test_first_copies_do_not_wait_for_the_kernel_build(
    dev: str,
    build_in_progress,  # noqa: F811
) -> None:
    """Issue #15 defect 3: while the extension compiles, transfers complete on the fallback path
    (CUDA: the torch stream fallback) with the right bytes; the build is still running."""
    host = kc.HostBuffer(4, PAGE)
    device = DeviceTier(4, host, device=dev)
    fill(device.kv)
    stored = await device.store([2, 0], [1, 3])
    assert stored.success, stored.error
    assert host.tensor()[1].unique().tolist() == [3] and host.tensor()[3].unique().tolist() == [1]
    device.kv.zero_()
    loaded = await device.load([1, 3], [0, 1])
    assert loaded.success, loaded.error
    assert [int(device.kv[b, 0]) for b in range(3)] == [3, 1, 0]
    assert still_building()
    device.close()
    host.close()


def test_host_buffer_pin_without_cuda_stays_pageable() -> None:
    """The fallback of :meth:`HostBuffer.pin`: no CUDA → not pinned, rows still usable."""
    if torch.cuda.is_available():
        pytest.skip("CUDA present: pinning is tested by test_cuda_host_buffer_is_pinned")
    host = kc.HostBuffer(2, PAGE)
    assert host.pin() is False and not host.pinned
    host.tensor()[1] = 7
    assert bytes(host.row(1)) == bytes([7]) * PAGE
    host.close()


@needs_cuda
def test_cuda_host_buffer_is_pinned() -> None:
    """Issue #15 defect 5: on CUDA the device tier registers the host buffer (DMA, async copies
    and the Triton path); closing the buffer unregisters it."""
    host = kc.HostBuffer(8, 4096)
    assert not host.tensor().is_pinned()
    device = DeviceTier(8, host, device="cuda")
    assert host.pinned and host.tensor().is_pinned()
    assert host.pin() is True  # idempotent
    device.close()
    host.close()
    assert not host.pinned


@needs_cuda
async def test_cuda_copies_run_off_the_loop_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #15 defect 5: the copy (synchronous in CUDA from pageable memory) is issued on the
    direction's worker thread, never on the event-loop thread."""
    from kvcascade.tiers import device as device_mod

    threads: list[int] = []
    real = device_mod.batch_copy

    def spy(*args, **kwargs):  # records the thread, then copies for real
        threads.append(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(device_mod, "batch_copy", spy)
    host = kc.HostBuffer(4, 64 << 10)  # 64 KiB pages: the C++ op, not Triton
    device = DeviceTier(4, host, device="cuda")
    fill(device.kv)
    assert (await device.store([0, 1], [0, 1])).success
    assert (await device.load([0, 1], [2, 3])).success
    assert len(threads) == 2 and threading.get_ident() not in threads
    assert torch.equal(device.kv[2:].cpu(), device.kv[:2].cpu())
    device.close()
    host.close()


@needs_cuda
async def test_finished_load_does_not_wait_behind_a_slow_store() -> None:
    """Issue #15 defect 5: one event bridge per direction. The store stream is held by a GPU
    sleep; a load submitted after it resolves while the store is still running."""
    host = kc.HostBuffer(4, 4096)
    device = DeviceTier(4, host, device="cuda")
    torch.cuda._sleep(1)  # warm-up: compile the sleep kernel
    with torch.cuda.stream(device._copier._streams["store"]):
        torch.cuda._sleep(int(1e10))  # ~5 s of GPU cycles, only on the store stream
    store = asyncio.ensure_future(device.store([0], [0]))
    await asyncio.sleep(0.2)  # the store's end event reaches its bridge first
    assert (await device.load([1], [1])).success
    assert not store.done()
    assert (await store).success
    device.close()
    host.close()
