"""The worker pool of a secondary tier: two queues, slots, deadlines, abandoned workers.

vLLM splits a tier the same way: ``tiering/base.py`` is the contract a tier implements,
``fs/thread_pool.py`` (``DualQueueThreadPool``) runs its blocking I/O and ``async_lookup.py``
batches its probes. Here: :mod:`kvcascade.tiers.base`, this module (driven by the tier's job
machinery, :mod:`kvcascade.tiers._jobs`), :mod:`kvcascade.tiers._lookup`.

Interface (:class:`WorkerPool`): :meth:`~WorkerPool.submit` a call with a :class:`Priority` and
a deadline; it returns a :class:`Submitted`, awaitable for the call's result (or its exception).
A mover guards its reads and writes of primary rows with :meth:`~WorkerPool.row_access`. Two
implementations: :class:`ThreadPool` runs blocking calls on daemon threads, :class:`TaskPool`
runs coroutine calls as tasks on the event loop. Every method but :meth:`~WorkerPool.close`,
:meth:`~WorkerPool.row_access` and :meth:`~WorkerPool.abandoned` runs on the event-loop thread.

Scheduling (vLLM's ``DualQueueThreadPool`` rule): a LOAD queue (promotions and probes) and a
STORE queue (cascades). Of the pool's ``slots``, the even ones take loads first and the odd
ones stores first, each falling back to the other queue, so reads are preferred and neither
queue starves; a single slot alternates. A thread that finishes a call takes the next one for
its slot itself (under the pool's lock) instead of waiting for the loop to hand it over, and
finding none frees the slot itself, so a call submitted meanwhile goes straight to it: a busy
loop never leaves threads idle; the loop still resolves every result, and the results that
arrive while it is busy are taken by one loop callback (one wake-up for a burst).

Deadlines: a call submitted with a deadline fails with :class:`DeadlineExceededError` ``timeout_s``
seconds (the pool's, or the call's own) after submission, covering its time in the queue and on a
worker. A queued call is dropped. A running thread cannot be killed: it is *abandoned* (its outcome
is discarded when it returns) and replaced by a fresh thread, at most ``slots`` replacements
outstanding (beyond that the slot stays taken until the stuck call returns);
``counters["stuck_threads"]`` counts the abandoned calls still running. A running task is cancelled
and its slot frees once it has unwound. Either way the call's ``on_released`` callback runs when the
abandoned call has returned: from then on it no longer touches the rows it was given.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import inspect
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Iterator
from typing import Any

from .._errors import DeadlineExceededError, TierUnavailableError

log = logging.getLogger(__name__)

_QUEUED, _RUNNING, _DONE = 0, 1, 2


class Priority(enum.Enum):
    """The queue of a call: LOAD (promotions, probes, start-up work) or STORE (cascades)."""

    LOAD = "load"
    STORE = "store"


class Submitted:
    """One submitted call; ``await`` it for the call's result.

    Attributes:
        future: resolved with the call's return value or exception; failed with
            :class:`DeadlineExceededError` at the deadline and :class:`TierUnavailableError`
            when the pool shuts down before the call ran.
        started_at: ``time.perf_counter()`` when a worker took the call (0 while queued).
    """

    __slots__ = (
        "abandoned",
        "args",
        "deadline",
        "finished",
        "fn",
        "future",
        "in_rows",
        "is_job",
        "on_done",
        "on_released",
        "priority",
        "replaced",
        "slot",
        "started_at",
        "state",
        "task",
        "timeout_s",
    )

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        future: asyncio.Future[Any],
        priority: Priority,
        is_job: bool,
        on_done: Callable[[Submitted], None] | None,
        on_released: Callable[[], None] | None,
    ) -> None:
        self.fn = fn
        self.args = args
        self.future = future
        self.priority = priority
        self.is_job = is_job
        self.on_done = on_done
        self.on_released = on_released
        self.state = _QUEUED
        self.slot = -1
        self.deadline: asyncio.TimerHandle | None = None
        self.started_at = 0.0
        # Guarded by the pool's lock: the thread finished the call / the loop gave up on it.
        self.finished = False
        self.abandoned = False
        self.in_rows = False
        self.replaced = False
        self.task: asyncio.Task[None] | None = None
        self.timeout_s = 0.0

    def __await__(self) -> Generator[Any, None, Any]:
        return self.future.__await__()


class WorkerPool(ABC):
    """The queues, slots and deadlines shared by both pools (module docstring).

    Args:
        name: the tier's name (thread names, log lines).
        slots: calls running at once (``>= 1``).
        timeout_s: deadline of a call in seconds from submission.
        counters: the tier's counters; the pool counts ``timeouts`` and ``stuck_threads``.
    """

    def __init__(
        self, name: str, slots: int, timeout_s: float, counters: collections.Counter[str]
    ) -> None:
        self.name = name
        self.slots = slots
        self.timeout_s = timeout_s
        self.counters = counters
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loads: collections.deque[Submitted] = collections.deque()
        self._stores: collections.deque[Submitted] = collections.deque()
        self._queued_jobs = 0
        self._free_slots = list(range(slots))
        self._single_slot_prefers_load = True
        self._running: set[Submitted] = set()
        self._lock = threading.Lock()
        self._closed = False

    @property
    def queued_jobs(self) -> int:
        """Calls submitted with ``is_job`` that wait for a worker."""
        return self._queued_jobs

    def start(self) -> None:
        """Bind the pool to the running loop and start its workers (loop thread)."""
        self._loop = asyncio.get_running_loop()

    def close(self) -> None:
        """Stop handing out queued calls (any thread); :meth:`shutdown` then fails them."""
        self._closed = True

    def submit(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        priority: Priority,
        deadline: bool = True,
        is_job: bool = True,
        on_done: Callable[[Submitted], None] | None = None,
        on_released: Callable[[], None] | None = None,
        timeout_s: float | None = None,
    ) -> Submitted:
        """Queue ``fn(*args)``; returns its :class:`Submitted` (loop thread, after :meth:`start`).

        ``deadline``: fail the call ``timeout_s`` seconds after now (default: the pool's
        ``timeout_s``; a tier's existence probes pass their shorter ``probe_timeout_s``).
        ``is_job``: count it in :attr:`queued_jobs` while it waits. ``on_done``: called on
        the loop right after the call's future is resolved (no extra loop callback: a burst
        of results costs one loop wake-up). ``on_released``: called on the loop once a call
        abandoned at its deadline has returned, in a later loop callback than ``on_done``
        and the future's callbacks.
        """
        assert self._loop is not None
        future = self._loop.create_future()
        work = Submitted(fn, args, future, priority, is_job, on_done, on_released)
        work.timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if deadline:
            work.deadline = self._loop.call_later(work.timeout_s, self._expire, work)
        with self._lock:
            (self._loads if priority is Priority.LOAD else self._stores).append(work)
            if is_job:
                self._queued_jobs += 1
        self._dispatch()
        return work

    @contextlib.contextmanager
    def row_access(self) -> Iterator[None]:
        """Around every read or write of primary rows by a call (its worker's thread).

        Raises:
            DeadlineExceededError: the call already passed its deadline (its rows may belong
                to other keys by now).
        """
        yield

    def abandoned(self) -> bool:
        """On a worker: True once the running call passed its deadline (it may stop early)."""
        return False

    async def shutdown(self) -> None:
        """Fail the queued calls, wait for the running ones (each bounded by its deadline),
        then stop the workers (abandoned threads are left to exit on their own)."""
        self._closed = True
        with self._lock:  # no worker takes queued calls from here on
            queued = [w for w in (*self._loads, *self._stores) if w.state == _QUEUED]
            for work in queued:
                work.state = _DONE
            self._loads.clear()
            self._stores.clear()
            running = [w.future for w in self._running]
        for work in queued:
            self._fail(work, TierUnavailableError("tier closed"))
        if running:
            await asyncio.wait(running)
        await self._stop()

    # -- shared machinery (loop thread unless said otherwise) --------------------------------
    @abstractmethod
    def _launch(self, work: Submitted) -> None:
        """Start ``work``, just claimed for ``work.slot``, on a worker."""

    @abstractmethod
    def _abandon(self, work: Submitted) -> bool | None:
        """Give up running ``work`` at its deadline; whether its rows may still be in use, or
        None when it finished meanwhile (its result is on the way)."""

    @abstractmethod
    async def _stop(self) -> None:
        """Stop the workers once no call runs any more."""

    def _dispatch(self) -> None:
        """Hand queued calls to free slots."""
        while True:
            with self._lock:
                if not (self._free_slots and (self._loads or self._stores)):
                    return
                slot = self._free_slots.pop()
                work = self._claim(slot)
                if work is None:
                    self._free_slots.append(slot)
                    return
            self._launch(work)

    def _claim(self, slot: int) -> Submitted | None:
        """The next queued call for ``slot``, marked running on it (caller holds the lock).
        Even slots take loads first, odd ones stores first; a single slot alternates."""
        if self.slots == 1:
            prefer_load = self._single_slot_prefers_load
            if self._loads or self._stores:  # a worker finding nothing to do is no turn
                self._single_slot_prefers_load = not prefer_load
        else:
            prefer_load = slot % 2 == 0
        first, second = (self._loads, self._stores) if prefer_load else (self._stores, self._loads)
        work = self._pop_live(first) or self._pop_live(second)
        if work is None:
            return None
        work.state = _RUNNING
        work.slot = slot
        work.started_at = time.perf_counter()
        self._running.add(work)
        return work

    def _pop_live(self, q: collections.deque[Submitted]) -> Submitted | None:
        """Pop the first queued call of ``q``, dropping expired ones (caller holds the lock)."""
        while q:
            work = q.popleft()
            if work.state == _QUEUED:
                if work.is_job:
                    self._queued_jobs -= 1
                return work
        return None

    def _release_slot(self, slot: int) -> None:
        with self._lock:
            self._free_slots.append(slot)
        self._dispatch()

    def _done(
        self, work: Submitted, outcome: Any, error: BaseException | None, slot_kept: bool = False
    ) -> None:
        """A worker finished ``work`` in time; ``slot_kept``: its thread already handed the slot
        on (to the slot's next call, or back to the free slots)."""
        with self._lock:
            self._running.discard(work)
        if not slot_kept:
            self._release_slot(work.slot)
        if work.deadline is not None:
            work.deadline.cancel()
        work.state = _DONE
        if not work.future.done():  # else the caller was cancelled meanwhile
            if error is not None:
                work.future.set_exception(error)
            else:
                work.future.set_result(outcome)
        if work.on_done is not None:
            work.on_done(work)

    def _fail(self, work: Submitted, error: BaseException) -> None:
        work.state = _DONE
        if work.deadline is not None:
            work.deadline.cancel()
        if not work.future.done():
            work.future.set_exception(error)
        if work.on_done is not None:
            work.on_done(work)

    def _expire(self, work: Submitted) -> None:
        """Deadline timer: fail ``work``; abandon its worker if it is running."""
        if work.state == _DONE:
            return
        self.counters["timeouts"] += 1
        with self._lock:  # a thread may take queued calls meanwhile
            queued = work.state == _QUEUED
            if queued:
                work.state = _DONE
                if work.is_job:
                    self._queued_jobs -= 1
        rows_in_use = False if queued else self._abandon(work)
        if rows_in_use is None:
            return
        message = f"deadline of {work.timeout_s:g} s passed"
        self._fail(work, DeadlineExceededError(message, rows_in_use=rows_in_use))

    def _returned(self, work: Submitted) -> None:
        """An abandoned call returned: its slot (unless a replacement took it) and its rows are
        free again. ``on_released`` runs in a later loop callback than the future's own
        callbacks (scheduled when it failed, before this), so whoever reads the failure first
        sees it before the release."""
        self.counters["stuck_threads"] -= 1
        if not work.replaced:
            self._release_slot(work.slot)
        if work.on_released is not None:
            assert self._loop is not None
            self._loop.call_soon(work.on_released)


class ThreadPool(WorkerPool):
    """Blocking calls on ``slots`` daemon threads (a thread stuck forever never blocks
    interpreter exit)."""

    def __init__(
        self, name: str, slots: int, timeout_s: float, counters: collections.Counter[str]
    ) -> None:
        super().__init__(name, slots, timeout_s, counters)
        self._inbox: queue.SimpleQueue[Submitted | None] = queue.SimpleQueue()
        self._threads: set[threading.Thread] = set()
        self._current = threading.local()
        self._replacements = 0
        self._done_queue: collections.deque[tuple[Submitted, Any, BaseException | None]] = (
            collections.deque()
        )
        self._done_posted = False  # a _take_done callback is pending on the loop

    def start(self) -> None:
        super().start()
        for _ in range(self.slots):
            self._spawn_thread()

    def submit(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        priority: Priority,
        deadline: bool = True,
        is_job: bool = True,
        on_done: Callable[[Submitted], None] | None = None,
        on_released: Callable[[], None] | None = None,
        timeout_s: float | None = None,
    ) -> Submitted:
        """As :meth:`WorkerPool.submit`.

        Raises:
            TypeError: ``fn`` is a coroutine function (it belongs on a :class:`TaskPool`).
        """
        if inspect.iscoroutinefunction(fn):
            raise TypeError(f"tier {self.name!r}: {fn!r} is a coroutine function, not blocking")
        return super().submit(fn, args, priority, deadline, is_job, on_done, on_released, timeout_s)

    @contextlib.contextmanager
    def row_access(self) -> Iterator[None]:
        """As :meth:`WorkerPool.row_access`. A call that passes its deadline while its thread is
        *inside* this block is reported with ``rows_in_use`` (its rows stay out of use until it
        returns); outside it (e.g. stuck in ``open``) its rows are released at once."""
        work: Submitted | None = getattr(self._current, "work", None)
        if work is None:
            yield
            return
        with self._lock:
            if work.abandoned:
                raise DeadlineExceededError("job passed its deadline", rows_in_use=False)
            work.in_rows = True
        try:
            yield
        finally:
            with self._lock:
                work.in_rows = False

    def abandoned(self) -> bool:
        work: Submitted | None = getattr(self._current, "work", None)
        return work is not None and work.abandoned

    def _launch(self, work: Submitted) -> None:
        self._inbox.put(work)

    def _abandon(self, work: Submitted) -> bool | None:
        with self._lock:
            if work.finished:
                return None
            work.abandoned = True
            rows_in_use = work.in_rows
            work.replaced = self._replacements < self.slots
            if work.replaced:
                self._replacements += 1
            self._running.discard(work)
        self.counters["stuck_threads"] += 1
        if work.replaced:
            self._spawn_thread()
            self._release_slot(work.slot)
        return rows_in_use

    async def _stop(self) -> None:
        """Ask every worker to exit and wait up to 1 s on the loop (a thread stuck in a system
        call is left behind, daemon). No helper thread joins them: a process at its pids limit,
        whose start just failed to spawn a worker, could start none."""
        with self._lock:
            threads = list(self._threads)
        for _ in threads:
            self._inbox.put(None)
        until = time.monotonic() + 1.0
        while any(t.is_alive() for t in threads) and time.monotonic() < until:
            await asyncio.sleep(0.002)

    def _spawn_thread(self) -> None:
        thread = threading.Thread(
            target=self._thread_main, name=f"kvcascade-{self.name}-io", daemon=True
        )
        thread.start()  # RuntimeError when the process may start no more (a pids limit)
        with self._lock:
            self._threads.add(thread)

    def _thread_main(self) -> None:
        me = threading.current_thread()
        work = self._inbox.get()
        while work is not None:
            self._current.work = work
            outcome: Any = None
            error: BaseException | None = None
            try:
                outcome = work.fn(*work.args)
            except BaseException as exc:  # delivered to the loop with the call's future
                error = exc
            self._current.work = None
            following: Submitted | None = None
            with self._lock:
                work.finished = True
                abandoned, replaced = work.abandoned, work.replaced
                if abandoned and replaced:
                    self._replacements -= 1
                    self._threads.discard(me)
                if not abandoned:
                    following = None if self._closed else self._claim(work.slot)
                    if following is None:  # idle: a call submitted from here on may take it
                        self._free_slots.append(work.slot)
            if abandoned:
                log.warning("tier %s: a job abandoned at its deadline returned late", self.name)
                self._post(self._returned, work)
                if replaced:
                    return
            else:
                self._post_done(work, outcome, error)
            work = following if following is not None else self._inbox.get()

    def _post_done(self, work: Submitted, outcome: Any, error: BaseException | None) -> None:
        """(I/O thread, its slot already handed on) Hand a finished call to the loop. Results
        queue up and one loop callback takes all that arrived before it ran: one wake-up for a
        burst of results."""
        self._done_queue.append((work, outcome, error))
        with self._lock:
            if self._done_posted:
                return
            self._done_posted = True
        self._post(self._take_done)

    def _take_done(self) -> None:
        with self._lock:
            self._done_posted = False  # from here on a new result posts a new callback
        while self._done_queue:
            self._done(*self._done_queue.popleft(), slot_kept=True)

    def _post(self, callback: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        try:
            if loop is not None:
                loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop closed while this thread was stuck
            pass


class TaskPool(WorkerPool):
    """Coroutine calls as tasks on the event loop, ``slots`` at once. At its deadline a running
    task is cancelled and its call fails with ``rows_in_use`` until the task has unwound (its
    clean-up included); its slot frees then. A plain function given to it is called in the
    task (e.g. a tier's default ``_remove``, which raises at once)."""

    def __init__(
        self, name: str, slots: int, timeout_s: float, counters: collections.Counter[str]
    ) -> None:
        super().__init__(name, slots, timeout_s, counters)
        self._tasks: set[asyncio.Task[None]] = set()

    def _launch(self, work: Submitted) -> None:
        assert self._loop is not None
        work.task = self._loop.create_task(self._run(work))
        self._tasks.add(work.task)
        work.task.add_done_callback(self._tasks.discard)

    async def _run(self, work: Submitted) -> None:
        outcome: Any = None
        error: BaseException | None = None
        try:
            outcome = work.fn(*work.args)
            if inspect.isawaitable(outcome):
                outcome = await outcome
        except asyncio.CancelledError:
            if not work.abandoned:
                raise  # not our deadline: the actor's task is being cancelled
        except Exception as exc:  # delivered with the call's future
            error = exc
        if work.abandoned:
            self._returned(work)
        else:
            self._done(work, outcome, error)

    def _abandon(self, work: Submitted) -> bool | None:
        assert work.task is not None
        work.abandoned = True
        work.task.cancel()
        self.counters["stuck_threads"] += 1
        with self._lock:
            self._running.discard(work)
        return True

    async def _stop(self) -> None:
        unwinding = [t for t in self._tasks if not t.done()]
        if unwinding:  # cancelled at their deadline, still cleaning up
            await asyncio.wait(unwinding)
