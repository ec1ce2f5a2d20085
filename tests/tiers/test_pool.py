"""The worker pool of a secondary tier (``kvcascade/tiers/_pool.py``) through its interface:
submit with a priority and a deadline → an awaitable; the row-access guard; shutdown. Real
threads and real tasks; after vLLM's ``DualQueueThreadPool`` (``fs/thread_pool.py``)."""

from __future__ import annotations

import asyncio
import collections
import threading

import pytest

import kvcascade as kc
from kvcascade.tiers._pool import Priority, TaskPool, ThreadPool

LOAD, STORE = Priority.LOAD, Priority.STORE


async def test_single_slot_alternates_loads_and_stores_in_queue_order() -> None:
    """One slot: while a call runs, two loads and two stores queue; then they run load, store,
    load, store (a single slot alternates), each queue in its submission order."""
    pool = ThreadPool("t", 1, 10.0, collections.Counter())
    pool.start()
    gate = threading.Event()
    order: list[str] = []
    first = pool.submit(gate.wait, (10,), LOAD)
    calls = [
        pool.submit(order.append, (name,), prio)
        for name, prio in [("s1", STORE), ("s2", STORE), ("l1", LOAD), ("l2", LOAD)]
    ]
    assert pool.queued_jobs == 4
    gate.set()
    assert await first is True
    await asyncio.gather(*calls)
    assert order == ["s1", "l1", "s2", "l2"]
    await pool.shutdown()


async def test_result_and_exception_reach_the_awaitable() -> None:
    pool = ThreadPool("t", 2, 10.0, collections.Counter())
    pool.start()
    assert await pool.submit(sum, ([1, 2, 3],), STORE) == 6
    with pytest.raises(ZeroDivisionError):
        await pool.submit(divmod, (1, 0), LOAD)
    await pool.shutdown()


async def test_deadline_abandons_a_stuck_thread_and_replaces_it() -> None:
    """A call stuck inside the row-access guard passes its deadline: DeadlineExceededError with
    rows_in_use, counted; a fresh thread serves the next call meanwhile; when the stuck call
    returns, on_released runs and the count goes back to 0."""
    counters: collections.Counter[str] = collections.Counter()
    pool = ThreadPool("t", 1, 0.05, counters)
    pool.start()
    gate = threading.Event()
    released = asyncio.Event()

    def stuck() -> None:
        with pool.row_access():
            gate.wait(10)

    call = pool.submit(stuck, (), LOAD, on_released=released.set)
    with pytest.raises(kc.DeadlineExceededError) as info:
        await call
    assert info.value.rows_in_use and isinstance(info.value, TimeoutError)
    assert counters["timeouts"] == 1 and counters["stuck_threads"] == 1
    assert await pool.submit(len, ("abc",), LOAD) == 3  # served by the replacement thread
    gate.set()
    await asyncio.wait_for(released.wait(), 5)
    assert counters["stuck_threads"] == 0
    await pool.shutdown()


async def test_row_access_after_the_deadline_refuses() -> None:
    """A call stuck before its rows (``rows_in_use`` False) then reaching them is refused."""
    pool = ThreadPool("t", 1, 0.05, collections.Counter())
    pool.start()
    gate = threading.Event()
    refused: list[BaseException] = []
    released = asyncio.Event()

    def late() -> None:
        gate.wait(10)
        try:
            with pool.row_access():
                pass
        except kc.DeadlineExceededError as exc:
            refused.append(exc)

    with pytest.raises(kc.DeadlineExceededError) as info:
        await pool.submit(late, (), STORE, on_released=released.set)
    assert not info.value.rows_in_use
    gate.set()
    await asyncio.wait_for(released.wait(), 5)
    assert len(refused) == 1
    await pool.shutdown()


async def test_shutdown_fails_queued_calls_and_waits_for_running_ones() -> None:
    pool = ThreadPool("t", 1, 10.0, collections.Counter())
    pool.start()
    gate = threading.Event()
    running = pool.submit(gate.wait, (10,), LOAD)
    queued = pool.submit(len, ("x",), STORE)
    threading.Timer(0.05, gate.set).start()
    await pool.shutdown()
    assert running.future.result() is True
    with pytest.raises(kc.TierUnavailableError, match="tier closed"):
        await queued


async def test_thread_pool_refuses_a_coroutine_function() -> None:
    pool = ThreadPool("t", 1, 10.0, collections.Counter())
    pool.start()
    with pytest.raises(TypeError, match="coroutine function"):
        pool.submit(asyncio.sleep, (0,), LOAD)
    await pool.shutdown()


async def test_task_pool_cancels_at_the_deadline_and_frees_the_slot_after_unwinding() -> None:
    """A coroutine past its deadline is cancelled: the call fails with rows_in_use, its clean-up
    runs, then on_released, and the slot serves the next call."""
    counters: collections.Counter[str] = collections.Counter()
    pool = TaskPool("t", 1, 0.05, counters)
    pool.start()
    unwound = asyncio.Event()
    released = asyncio.Event()

    async def slow() -> None:
        try:
            await asyncio.sleep(10)
        finally:
            unwound.set()

    with pytest.raises(kc.DeadlineExceededError) as info:
        await pool.submit(slow, (), STORE, on_released=released.set)
    assert info.value.rows_in_use
    await asyncio.wait_for(released.wait(), 5)
    assert unwound.is_set() and counters["stuck_threads"] == 0

    async def double(x: int) -> int:
        return 2 * x

    assert await pool.submit(double, (21,), LOAD) == 42
    assert await pool.submit(len, ("ab",), LOAD) == 2  # a plain function runs in the task
    await pool.shutdown()


@pytest.mark.parametrize("pool_type", [ThreadPool, TaskPool])
async def test_release_of_an_abandoned_call_follows_its_failure(pool_type: type) -> None:
    """Whoever reads a call's failure (``on_done``, which makes the tier's job result, or a
    callback on its future) sees it before the call's release, even when the call unwinds at
    once (a task cancelled at its deadline) or returns just after being abandoned."""
    pool = pool_type("t", 1, 0.05, collections.Counter())
    pool.start()
    events: list[str] = []
    gate = threading.Event()

    async def wait_cancelled() -> None:
        await asyncio.sleep(10)

    fn, args = (wait_cancelled, ()) if pool_type is TaskPool else (gate.wait, (10,))
    call = pool.submit(
        fn,
        args,
        LOAD,
        on_done=lambda _: events.append("done"),
        on_released=lambda: events.append("released"),
    )
    call.future.add_done_callback(lambda _: events.append("failed"))
    with pytest.raises(kc.DeadlineExceededError):
        await call
    gate.set()
    for _ in range(500):
        if "released" in events:
            break
        await asyncio.sleep(0.01)
    assert events == ["done", "failed", "released"]
    await pool.shutdown()
