"""An asyncio event loop on a background thread, and a portal onto it (no vLLM imports).

The coordinator's hooks and the tier actors must run on one event-loop thread
(``docs/coordinator.md``). A synchronous caller on another thread — vLLM's scheduler — reaches
them through :meth:`LoopThread.call` (a plain function run on the loop, result handed back
through a :class:`concurrent.futures.Future`; the caller waits only for that bookkeeping call)
or :meth:`LoopThread.run` (a coroutine, for rare operations such as ``reset_cache``).

Every portal call returns or raises within a bound once :meth:`LoopThread.close` begins
(``docs/vllm.md``): each call's future is tracked until its caller has it, calls made after
close begins raise at once, and the futures still unresolved when the loop stops — a callback
queued after the loop's last iteration (asyncio drops it), a coroutine that never finished —
are failed then.

Why not anyio's ``BlockingPortal``: it runs every call as a new task in its task group
(``BlockingPortal.call`` → ``start_task_soon``), 2.7–3.7× the round trip of
:meth:`LoopThread.call` for a plain function (``benchmarks/loop_portal.py``), paid once per
scheduler hook of the vLLM connector; and a call that passed its running check before the
portal stopped waits on ``run_sync_from_thread`` (``anyio/_backends/_asyncio.py``:
``call_soon_threadsafe``, then ``Future.result()`` with no bound), the window this portal
closes. The coordinator's lifecycle itself is anyio's
(:func:`kvcascade._lifecycle.serve_coordinator`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from .._errors import TierUnavailableError
from .._lifecycle import SHUTDOWN_TIMEOUT_S, serve_coordinator
from ..coordinator import TieringCoordinator

log = logging.getLogger(__name__)

_T = TypeVar("_T")
START_TIMEOUT_S = 60.0


class LoopThread:
    """A daemon thread running an event loop that owns a coordinator and its tier actors.

    Args:
        build: called on the loop thread; returns the coordinator, which then runs in
            :func:`kvcascade._lifecycle.serve_coordinator` (as in ``open_cascade``) until
            :meth:`close`.

    Raises:
        Exception: whatever ``build`` or a tier actor's start raised (re-raised here).
        TimeoutError: the loop did not become ready within ``START_TIMEOUT_S`` seconds.
    """

    def __init__(self, build: Callable[[], TieringCoordinator]):
        self._build = build
        self._loop = asyncio.new_event_loop()
        self._ready: concurrent.futures.Future[TieringCoordinator] = concurrent.futures.Future()
        self._stop = asyncio.Event()  # bound to the loop at its first wait, in _serve
        # Guards _closing, _stopped and _pending: the futures of the portal calls in flight.
        self._lock = threading.Lock()
        self._closing = False
        self._stopped = False
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._tasks: set[asyncio.Task[None]] = set()  # run()'s tasks (the loop keeps weak refs)
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
            self._fail_pending()
            self._loop.run_until_complete(_cancel_remaining_tasks())
            # asyncio.to_thread (a tier's thread shutdown) started the default executor.
            self._loop.run_until_complete(self._loop.shutdown_default_executor())
            self._loop.close()

    async def _serve(self) -> None:
        try:
            coordinator = self._build()
            async with serve_coordinator(coordinator):
                self._ready.set_result(coordinator)
                await self._stop.wait()
        except BaseException as exc:
            if self._ready.done():
                log.error("kvcascade: the loop's coordinator stopped with %r", exc)
            else:
                self._ready.set_exception(exc)

    def _fail_pending(self) -> None:
        """On the loop thread, once the loop has stopped: refuse new calls and fail every
        portal future still unresolved (nothing else can resolve one now: the loop's callbacks
        run on this thread)."""
        with self._lock:
            self._closing = self._stopped = True
            pending, self._pending = self._pending, set()
        for fut in pending:
            if not fut.done():
                fut.set_exception(
                    TierUnavailableError("the kvcascade loop stopped before this call finished")
                )

    def _submit(
        self, fut: concurrent.futures.Future[_T], start: Callable[[], object], timeout: float | None
    ) -> _T:
        """Queue ``start`` on the loop and wait (at most ``timeout`` seconds; None: no limit)
        for ``fut``, which ``start`` or :meth:`_fail_pending` resolves.

        Raises:
            TierUnavailableError: :meth:`close` has begun (nothing was queued), or the loop
                stopped before ``fut`` was resolved.
        """
        with self._lock:
            if self._closing:
                raise TierUnavailableError("the kvcascade loop is closing or closed")
            self._pending.add(fut)
            self._loop.call_soon_threadsafe(start)
        try:
            return fut.result(timeout)
        finally:
            with self._lock:
                self._pending.discard(fut)

    def call(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """Run ``fn(*args, **kwargs)`` on the loop thread and return its result (or raise its
        exception). Called on the loop thread itself, it runs inline.

        Raises:
            TierUnavailableError: called from another thread once :meth:`close` has begun, or
                the loop stopped before running ``fn`` (then ``fn`` never runs).
        """
        if threading.get_ident() == self._thread.ident:
            return fn(*args, **kwargs)
        fut: concurrent.futures.Future[_T] = concurrent.futures.Future()

        def run() -> None:
            if fut.done():  # failed by _fail_pending: its caller was told it did not run
                return
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as exc:
                fut.set_exception(exc)

        return self._submit(fut, run, None)

    def run(self, coro_fn: Callable[[], Awaitable[_T]], timeout: float | None = None) -> _T:
        """Run the coroutine ``coro_fn()`` on the loop and wait for its result (at most
        ``timeout`` seconds; None: until it finishes or the loop stops).

        Raises:
            TierUnavailableError: :meth:`close` has begun, or the loop stopped while the
                coroutine was queued or running (a running one is then cancelled).
            TimeoutError: ``timeout`` passed first (the coroutine keeps running).
        """
        fut: concurrent.futures.Future[_T] = concurrent.futures.Future()

        async def wrapper() -> None:
            if fut.done():  # failed by _fail_pending before it started
                return
            try:
                result = await coro_fn()
            except BaseException as exc:
                if not fut.done():
                    fut.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise
            else:
                if not fut.done():
                    fut.set_result(result)

        def start() -> None:
            task = self._loop.create_task(wrapper())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        return self._submit(fut, start, timeout)

    def close(self) -> None:
        """Refuse new calls, drain the tiers (bounded), stop the actors and the thread; the
        calls still unresolved when the loop stops are failed. Idempotent."""
        with self._lock:
            self._closing = True
            if not self._stopped:  # the loop is not closed yet: the callback can be queued
                self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread.is_alive():
            self._thread.join(timeout=3 * SHUTDOWN_TIMEOUT_S + 5)


async def _cancel_remaining_tasks() -> None:
    """Cancel the tasks still on the loop once ``_serve`` has returned (portal coroutines that
    never finished, actors the lifecycle cancelled) and wait for them, at most
    ``SHUTDOWN_TIMEOUT_S`` seconds — ``asyncio.run``'s teardown, bounded."""
    tasks = asyncio.all_tasks() - {asyncio.current_task()}
    for task in tasks:
        task.cancel()
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=SHUTDOWN_TIMEOUT_S)
        if pending:
            log.warning("kvcascade: %d loop tasks ignored cancellation at close", len(pending))
