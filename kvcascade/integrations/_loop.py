"""An asyncio event loop on a background thread, and a portal onto it (no vLLM imports).

The coordinator's hooks and the tier actors must run on one event-loop thread
(``docs/coordinator.md``). A synchronous caller on another thread — vLLM's scheduler — reaches
them through :meth:`LoopThread.call` (a plain function run on the loop, result handed back
through a :class:`concurrent.futures.Future`; the caller waits only for that bookkeeping call)
or :meth:`LoopThread.run` (a coroutine, for rare operations such as ``reset_cache``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ..cascade import SHUTDOWN_TIMEOUT_S, start_tier_actors, stop_tier_actors
from ..coordinator import TieringCoordinator
from ..tiers.base import SecondaryTier

log = logging.getLogger(__name__)

_T = TypeVar("_T")
START_TIMEOUT_S = 60.0


class LoopThread:
    """A daemon thread running an event loop that owns a coordinator and its tier actors.

    Args:
        build: called on the loop thread; returns the coordinator and its secondary tiers
            (whose actors are then started, as ``open_cascade`` does).

    Raises:
        Exception: whatever ``build`` or a tier actor's start raised (re-raised here).
        TimeoutError: the loop did not become ready within ``START_TIMEOUT_S`` seconds.
    """

    def __init__(self, build: Callable[[], tuple[TieringCoordinator, list[SecondaryTier]]]):
        self._build = build
        self._loop = asyncio.new_event_loop()
        self._ready: concurrent.futures.Future[TieringCoordinator] = concurrent.futures.Future()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="kvcascade-loop", daemon=True)
        self._thread.start()
        try:
            self.coordinator = self._ready.result(timeout=START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    def _main(self) -> None:
        try:
            self._loop.run_until_complete(self._serve())
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        actors: list[asyncio.Task[None]] = []
        coordinator: TieringCoordinator | None = None
        try:
            coordinator, tiers = self._build()
            actors = await start_tier_actors(tiers)
        except BaseException as exc:
            self._ready.set_exception(exc)
            await stop_tier_actors(coordinator, actors)
            return
        self._ready.set_result(coordinator)
        await self._stop.wait()
        await stop_tier_actors(coordinator, actors)

    def call(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """Run ``fn(*args, **kwargs)`` on the loop thread and return its result (or raise its
        exception). Called on the loop thread itself, it runs inline."""
        if threading.get_ident() == self._thread.ident:
            return fn(*args, **kwargs)
        fut: concurrent.futures.Future[_T] = concurrent.futures.Future()

        def run() -> None:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args, **kwargs))
                except BaseException as exc:
                    fut.set_exception(exc)

        self._loop.call_soon_threadsafe(run)
        return fut.result()

    def run(self, coro_fn: Callable[[], Awaitable[_T]], timeout: float | None = None) -> _T:
        """Run the coroutine ``coro_fn()`` on the loop and wait for its result."""

        async def wrapper() -> _T:
            return await coro_fn()

        return asyncio.run_coroutine_threadsafe(wrapper(), self._loop).result(timeout)

    def close(self) -> None:
        """Drain the tiers (bounded), stop the actors and the thread; idempotent."""
        if self._thread.is_alive() and not self._loop.is_closed():
            stop = self._stop
            if stop is not None:
                self._loop.call_soon_threadsafe(stop.set)
            self._thread.join(timeout=2 * SHUTDOWN_TIMEOUT_S + 5)
