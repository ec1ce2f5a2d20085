"""LoopThread, the portal from vLLM's scheduler thread onto the coordinator's event loop: real
threads, a real loop and a real (primary-only) coordinator."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import kvcascade as kc
from kvcascade.integrations._loop import LoopThread

LIVENESS_S = 10.0  # a join bound that detects a caller blocked forever, not a speed limit


def _build() -> kc.TieringCoordinator:
    return kc.TieringCoordinator(kc.CPUOffloadingManager(8), [])


def _echo(value: int) -> int:
    return value


async def _echo_later(value: int) -> int:
    await asyncio.sleep(0)
    return value


def test_calls_racing_close_never_block_forever() -> None:
    """Eight threads hammer ``call`` / ``run`` while another thread closes the LoopThread, 50
    times over: every thread finishes (each call returned its value or raised
    TierUnavailableError). Before the fix a callback queued after the loop's last iteration was
    dropped and its caller waited forever (the first rounds already hung)."""
    rounds: list[list[list[object]]] = []
    for _ in range(50):
        loop = LoopThread(_build)
        go = threading.Event()
        outcomes: list[list[object]] = [[] for _ in range(8)]
        rounds.append(outcomes)
        threads = [
            threading.Thread(target=_hammer, args=(loop, go, n, got), daemon=True)
            for n, got in enumerate(outcomes)
        ]
        for t in threads:
            t.start()
        closer = threading.Thread(target=loop.close, daemon=True)
        go.set()
        closer.start()
        deadline = time.monotonic() + LIVENESS_S
        for t in [closer, *threads]:
            t.join(max(0.0, deadline - time.monotonic()))
        assert [t.name for t in [closer, *threads] if t.is_alive()] == []
    for outcomes in rounds:
        for got in outcomes:
            *values, last = got
            assert all(v is True for v in values)
            assert isinstance(last, kc.TierUnavailableError), last


def _hammer(loop: LoopThread, go: threading.Event, n: int, outcomes: list[object]) -> None:
    """Call the loop (``run`` on odd ``n``, ``call`` on even) until a call raises; append True
    for each call that returned its argument (False otherwise), then the exception."""
    go.wait()
    i = 0
    while True:
        i += 1
        try:
            got = loop.run(lambda i=i: _echo_later(i)) if n % 2 else loop.call(_echo, i)
        except BaseException as exc:  # the last outcome: its type is asserted by the test
            outcomes.append(exc)
            return
        outcomes.append(got == i)


def test_call_after_close_raises_tier_unavailable() -> None:
    """``call`` and ``run`` after ``close`` raise TierUnavailableError naming the closed loop at
    once, and run nothing (was asyncio's bare RuntimeError 'Event loop is closed')."""
    loop = LoopThread(_build)
    loop.close()
    ran: list[int] = []
    with pytest.raises(kc.TierUnavailableError, match="loop is closing or closed"):
        loop.call(ran.append, 1)
    with pytest.raises(kc.TierUnavailableError, match="loop is closing or closed"):
        loop.run(lambda: _echo_later(1))
    loop.close()  # idempotent
    assert ran == []


def test_call_on_never_finishing_coroutine_released_by_close() -> None:
    """A thread waiting in ``run`` on a coroutine that never finishes is released by ``close``
    with TierUnavailableError, and the coroutine is cancelled (its ``finally`` runs). Before the
    fix the loop closed under the pending task and the caller waited forever."""
    loop = LoopThread(_build)
    started = threading.Event()
    cancelled = threading.Event()
    outcome: list[BaseException] = []

    async def forever() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    def waiter() -> None:
        try:
            loop.run(forever)
        except BaseException as exc:
            outcome.append(exc)

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    assert started.wait(LIVENESS_S)
    loop.close()
    t.join(LIVENESS_S)
    assert not t.is_alive()
    [exc] = outcome
    assert isinstance(exc, kc.TierUnavailableError)
    assert "stopped before this call finished" in str(exc)
    assert cancelled.is_set()


class _UnreachableTier(kc.MemoryTier):
    """A memory tier whose start-up fails, as an S3 tier's does when its endpoint is down."""

    async def _startup(self) -> None:
        raise kc.TierUnavailableError("endpoint not reachable")


def test_a_failed_tier_start_is_raised_with_nothing_left_running() -> None:
    """The loop thread runs the same lifecycle as ``open_cascade``: a tier whose start fails
    makes the constructor raise that error, after the tier started before it was stopped and
    closed and the loop thread ended."""
    host = kc.HostBuffer(4, 64)
    first = kc.MemoryTier(host)
    before = set(threading.enumerate())
    try:
        with pytest.raises(kc.TierUnavailableError, match="not reachable"):
            LoopThread(
                lambda: kc.TieringCoordinator(
                    kc.CPUOffloadingManager(4), [first, _UnreachableTier(host, name="down")]
                )
            )
        assert [t.name for t in set(threading.enumerate()) - before] == []
        with pytest.raises(kc.TierUnavailableError):
            first.submit_store(kc.TransferJob(0, [kc.make_offload_key(b"k" * 8, 0)], [0], False))
    finally:
        host.close()
