"""Secondary tiers: the contract the coordinator relies on, and the actor machinery.

A secondary tier is an asyncio actor. The coordinator (on the scheduler side) talks to it through
non-blocking synchronous calls — ``lookup``, ``submit_store``, ``submit_load``,
``get_finished_jobs`` — that only enqueue work in the actor's mailbox or read what it finished
(vLLM's ``SecondaryTierManager`` contract, spec §3.2). The actor (:meth:`SecondaryTier.run`) owns
the tier's lifetime inside the cascade's task group: it starts the tier's I/O threads, runs the
tier's start-up work, then hands queued jobs to free threads and resolves each job's future.
Nobody polls: futures are awaited by asyncio callers; the synchronous façade collects finished
results at its poll points.

Scheduling (same rule as vLLM's ``DualQueueThreadPool``, spec §4.4): the mailbox has a load queue
(promotions and existence probes) and a store queue (cascades). Half of the ``io_threads`` slots
(rounded up) take loads first, the others take stores first, each falling back to the other
queue, so reads are preferred and neither queue starves; a single slot alternates. A thread
that finishes a job takes the next one for its slot itself (same rule, under the thread lock)
instead of waiting for the event loop to hand it over, so a busy loop, or a loop thread that
is waiting for a CPU, never leaves I/O threads idle; the loop still resolves every result.

Deadlines and back-pressure: every job has a deadline ``io_timeout_s`` seconds after it was
submitted, covering its time in the queue and on a thread. At the deadline its future is resolved
with a failed :class:`JobResult` (queued: dropped from the queue; running: its thread is
*abandoned*). A thread blocked in a system call cannot be killed, so an abandoned thread is
replaced by a fresh one (at most ``io_threads`` replacements outstanding; beyond that the slot
stays taken until the stuck call returns), counted in ``counters["stuck_threads"]``, and
exits when its call finally returns, discarding the outcome. Movers can ask
:meth:`SecondaryTier._job_abandoned` between blocks to stop early. At most ``max_queued_jobs``
jobs wait in the mailbox: a store submitted beyond that is refused at once with a failed result
(``counters["store_rejected"]``), never an exception, so the coordinator releases its pins.
Loads are always admitted (each holds a reserved primary slot, which bounds them).

Native asyncio tiers: a tier whose movers (:meth:`_store_blocks`, :meth:`_load_blocks`,
:meth:`_probe`) are all coroutine functions starts no threads; each job (or probe) runs as a task
on the event loop in one of the ``io_threads`` slots, with the same queues, deadlines, results,
counters and events. At the deadline a running task is cancelled and its job fails as
*abandoned*; the ``released`` result follows once the task has unwound (its clean-up included),
and the slot frees then. :meth:`_cleanup` runs after the last job ended (e.g. to close a client).

Thread rules: the synchronous façade runs on the event-loop thread (a scheduler on another thread
reaches it through the coordinator's portal); only :meth:`close` may be called from any thread.
I/O threads are daemon threads, so a thread stuck forever never blocks interpreter exit.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator, Sequence
from typing import Any, ClassVar

from .._errors import CorruptBlockError, KVCascadeError, TierUnavailableError, TransferError
from .._types import (
    JobResult,
    LookupResult,
    Medium,
    OffloadingEvent,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    TransferJob,
)
from ._lookup import AsyncLookup
from .cpu import HostBuffer

log = logging.getLogger(__name__)

_QUEUED, _RUNNING, _DONE = 0, 1, 2


class _Work:
    """One unit handed to an I/O thread: a transfer job, a probe, or a start-up task."""

    __slots__ = (
        "abandoned",
        "args",
        "deadline",
        "finished",
        "fn",
        "fut",
        "in_rows",
        "is_load",
        "job",
        "native",
        "replaced",
        "slot",
        "started_at",
        "state",
        "task",
    )

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        fut: asyncio.Future[Any],
        is_load: bool,
        job: TransferJob | None = None,
    ) -> None:
        self.fn = fn
        self.args = args
        self.fut = fut
        self.is_load = is_load
        self.job = job
        self.state = _QUEUED
        self.slot = -1
        self.deadline: asyncio.TimerHandle | None = None
        self.started_at = 0.0
        # Guarded by the tier's thread lock: the thread finished the call / the loop gave up.
        self.finished = False
        self.abandoned = False
        self.in_rows = False
        self.replaced = False
        self.task: asyncio.Task[None] | None = None  # a native (coroutine) work's task
        self.native = inspect.iscoroutinefunction(fn)  # runs as a task on the loop


class SecondaryTier(ABC):
    """Base class of secondary tiers (fs, s3, memory).

    Subclasses implement the data movers :meth:`_store_blocks`, :meth:`_load_blocks` and
    :meth:`_probe` — blocking functions run on the tier's I/O threads, or all three coroutine
    functions run as tasks on the event loop (a native asyncio tier, module docstring) — and may
    override the hooks (:meth:`_startup`, :meth:`_cleanup`, :meth:`touch`, ...).

    Args:
        name: the tier's name in metrics, events and replay output (e.g. ``"fs"``).
        host: the primary tier's buffer; jobs address its rows by slot id.
        io_threads: number of I/O threads (``>= 1``); for a native asyncio tier, the number of
            jobs running at once.
        io_timeout_s: deadline of one job in seconds from submission (``> 0``); a job past it
            fails (its pins are then released by the coordinator) instead of hanging.
        max_queued_jobs: jobs allowed to wait for a thread (``>= 1``); further stores are refused.

    Raises:
        ValueError: a bound is out of range.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        name: str,
        host: HostBuffer,
        io_threads: int = 4,
        io_timeout_s: float = 30.0,
        max_queued_jobs: int = 1024,
    ) -> None:
        if io_threads < 1 or max_queued_jobs < 1 or not io_timeout_s > 0:
            raise ValueError(
                f"tier {name!r}: need io_threads >= 1, io_timeout_s > 0, max_queued_jobs >= 1; "
                f"got {io_threads}, {io_timeout_s}, {max_queued_jobs}"
            )
        self.name = name
        self.host = host
        self.io_threads = io_threads
        self.io_timeout_s = io_timeout_s
        self.max_queued_jobs = max_queued_jobs
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._loads: collections.deque[_Work] = collections.deque()
        self._stores: collections.deque[_Work] = collections.deque()
        self._queued_jobs = 0
        self._free_slots = list(range(io_threads))
        self._single_slot_prefers_load = True
        self._running: set[_Work] = set()
        self._finished: collections.deque[JobResult] = collections.deque()
        self._events: collections.deque[OffloadingEvent] = collections.deque()
        self._wake: asyncio.Event | None = None
        self._pending: set[asyncio.Future[JobResult]] = set()
        self._closed = False
        self._inbox: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._threads: set[threading.Thread] = set()
        self._thread_lock = threading.Lock()
        self._done: collections.deque[tuple[_Work, Any, BaseException | None, bool]] = (
            collections.deque()
        )
        self._done_posted = False  # a _take_done callback is pending on the loop
        self._replacements = 0
        self._current = threading.local()
        self._tasks: set[asyncio.Task[None]] = set()
        self._lookup = AsyncLookup(self)
        self._native = all(
            inspect.iscoroutinefunction(m)
            for m in (self._store_blocks, self._load_blocks, self._probe)
        )
        self.counters: collections.Counter[str] = collections.Counter()

    # -- data movers (blocking, run on the I/O threads; or all three coroutine functions) ----
    @abstractmethod
    def _store_blocks(
        self, keys: Sequence[bytes], rows: Sequence[memoryview]
    ) -> int | Awaitable[int]:
        """Persist ``rows[i]`` under ``keys[i]``; return bytes written.

        Moves every block it can: a failing block does not stop the job (its later blocks are
        still worth storing). If any failed, raises :class:`TransferError` with exactly the
        keys stored (store hits included, in job order) and the bytes written.
        """

    @abstractmethod
    def _load_blocks(
        self, keys: Sequence[bytes], rows: Sequence[memoryview]
    ) -> int | Awaitable[int]:
        """Fill ``rows[i]`` with the bytes stored under ``keys[i]``; return bytes read.

        Stops at the first failing block, since a prefix is useless after its first gap
        (:class:`TransferError` with the keys before it); a block that fails its integrity
        check raises with a :class:`CorruptBlockError` cause.
        """

    @abstractmethod
    def _probe(self, keys: Sequence[bytes]) -> list[bool] | Awaitable[list[bool]]:
        """Existence of each key."""

    def _rows(self, block_ids: Iterable[int]) -> list[memoryview]:
        """The primary rows a job moves (default: the ``block_bytes`` KV bytes of each slot).

        Raises:
            IndexError: a slot id outside the primary tier (the job then fails at once).
        """
        return [self.host.row(int(b)) for b in block_ids]

    def _stored_event_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """Keys of a successful store job to announce as stored (default: all of them).

        A tier that evicts overrides this to leave out keys already removed again, so that
        stored/removed events replayed in order give the tier's real content.
        """
        return list(keys)

    async def _startup(self) -> None:  # noqa: B027 - optional hook
        """Start-up work run by :meth:`run` before it reports readiness (default: none)."""

    async def _cleanup(self) -> None:  # noqa: B027 - optional hook
        """Shutdown work run by :meth:`run` after every job ended, also when :meth:`_startup`
        failed (default: none)."""

    def _job_abandoned(self) -> bool:
        """On an I/O thread: True once the running job passed its deadline (stop early)."""
        work: _Work | None = getattr(self._current, "work", None)
        return work is not None and work.abandoned

    @contextlib.contextmanager
    def _row_access(self) -> Iterator[None]:
        """On an I/O thread, around every read or write of primary rows.

        Raises TimeoutError if the job already passed its deadline (its rows may belong to
        other keys by now). A job that passes its deadline while a thread is *inside* this block
        is reported ``abandoned`` (its rows stay out of use until the thread returns); outside
        it (e.g. stuck in ``open``) the job simply fails and its rows are released at once.
        """
        work: _Work | None = getattr(self._current, "work", None)
        if work is None:
            yield
            return
        with self._thread_lock:
            if work.abandoned:
                raise TimeoutError("job passed its deadline")
            work.in_rows = True
        try:
            yield
        finally:
            with self._thread_lock:
                work.in_rows = False

    # -- actor ---------------------------------------------------------------------------
    async def run(self, started: Callable[[], None] | None = None) -> None:
        """The actor: start threads, run :meth:`_startup`, dispatch jobs until :meth:`close`.

        On exit queued jobs fail, running ones finish or reach their deadline, and the idle
        threads are joined (abandoned ones are left to exit on their own).
        """
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._wake = asyncio.Event()
        for _ in range(0 if self._native else self.io_threads):
            self._spawn_thread()
        try:
            await self._startup()
            if started is not None:
                started()
            while not self._closed:
                self._wake.clear()
                await self._wake.wait()
        finally:
            self._closed = True
            with self._thread_lock:  # no thread takes queued work from here on
                queued = [w for w in (*self._loads, *self._stores) if w.state == _QUEUED]
                for work in queued:
                    work.state = _DONE
                self._loads.clear()
                self._stores.clear()
                running = [w.fut for w in self._running]
            for work in queued:
                self._fail(work, "tier closed")
            if running:
                await asyncio.wait(running)
            unwinding = [t for t in self._tasks if not t.done()]
            if unwinding:  # cancelled at their deadline, still cleaning up
                await asyncio.wait(unwinding)
            await asyncio.to_thread(self._stop_threads)
            await self._cleanup()

    def _spawn_thread(self) -> None:
        thread = threading.Thread(
            target=self._thread_main, name=f"kvcascade-{self.name}-io", daemon=True
        )
        self._threads.add(thread)
        thread.start()

    def _stop_threads(self) -> None:
        with self._thread_lock:
            threads = list(self._threads)
        for _ in threads:
            self._inbox.put(None)
        until = time.monotonic() + 1.0
        for thread in threads:  # a thread stuck in a system call is left behind (daemon)
            thread.join(timeout=max(0.0, until - time.monotonic()))

    def _thread_main(self) -> None:
        me = threading.current_thread()
        work = self._inbox.get()
        while work is not None:
            self._current.work = work
            outcome: Any = None
            error: BaseException | None = None
            try:
                outcome = work.fn(*work.args)
            except BaseException as exc:  # delivered to the loop, which classifies it
                error = exc
            self._current.work = None
            following: _Work | None = None
            with self._thread_lock:
                work.finished = True
                abandoned, replaced = work.abandoned, work.replaced
                if abandoned and replaced:
                    self._replacements -= 1
                    self._threads.discard(me)
                if not abandoned and not self._closed:
                    following = self._claim(work.slot, for_thread=True)
            if abandoned:
                log.warning("tier %s: a job abandoned at its deadline returned late", self.name)
                self._post(self._thread_returned, work)
                if replaced:
                    return
            else:
                self._post_done(work, outcome, error, following is not None)
            work = following if following is not None else self._inbox.get()

    def _post_done(
        self, work: _Work, outcome: Any, error: BaseException | None, slot_kept: bool
    ) -> None:
        """Hand a finished work to the loop. Results queue up and one loop callback takes all
        that arrived before it ran: one wake-up of the loop for a burst of finished jobs."""
        self._done.append((work, outcome, error, slot_kept))
        with self._thread_lock:
            if self._done_posted:
                return
            self._done_posted = True
        self._post(self._take_done)

    def _take_done(self) -> None:
        """Loop thread: process every finished work queued by :meth:`_post_done`."""
        with self._thread_lock:
            self._done_posted = False  # from here on a new result posts a new callback
        while self._done:
            self._work_done(*self._done.popleft())

    def _post(self, callback: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        try:
            if loop is not None:
                loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop closed while this thread was stuck
            pass

    def _dispatch(self) -> None:
        """Hand queued work to free slots (loads-first and stores-first slots, spec §4.4)."""
        while True:
            with self._thread_lock:
                if not (self._free_slots and (self._loads or self._stores)):
                    return
                slot = self._free_slots.pop()
                work = self._claim(slot, for_thread=False)
                if work is None:
                    self._free_slots.append(slot)
                    return
            if work.native:
                assert self._loop is not None
                work.task = self._loop.create_task(self._run_native(work))
                self._tasks.add(work.task)
                work.task.add_done_callback(self._tasks.discard)
            else:
                self._inbox.put(work)

    def _claim(self, slot: int, for_thread: bool) -> _Work | None:
        """The next queued work for ``slot``, marked running on it (caller holds the thread
        lock). Even slots take loads first, odd ones stores first; a single slot alternates.
        ``for_thread``: a thread asks for its next work; a native one is left to the loop."""
        if self.io_threads == 1:
            prefer_load = self._single_slot_prefers_load
            if self._loads or self._stores:  # a thread finding nothing to do is no turn
                self._single_slot_prefers_load = not prefer_load
        else:
            prefer_load = slot % 2 == 0
        first, second = (self._loads, self._stores) if prefer_load else (self._stores, self._loads)
        work = self._pop_live(first, for_thread) or self._pop_live(second, for_thread)
        if work is None:
            return None
        work.state = _RUNNING
        work.slot = slot
        work.started_at = time.perf_counter()
        self._running.add(work)
        return work

    async def _run_native(self, work: _Work) -> None:
        """Run a coroutine mover as a task: the loop-side twin of :meth:`_thread_main`."""
        outcome: Any = None
        error: BaseException | None = None
        try:
            outcome = await work.fn(*work.args)
        except asyncio.CancelledError:
            if not work.abandoned:
                raise  # not our deadline: the actor's task is being cancelled
        except Exception as exc:  # delivered like a thread's, classified by _work_done
            error = exc
        if work.abandoned:
            self._thread_returned(work)
        else:
            self._work_done(work, outcome, error)

    def _pop_live(self, q: collections.deque[_Work], for_thread: bool) -> _Work | None:
        """Pop the first queued work of ``q`` (dropping expired ones); caller holds the lock."""
        while q:
            if q[0].state != _QUEUED:
                q.popleft()
                continue
            if for_thread and q[0].native:
                return None
            work = q.popleft()
            if work.job is not None:
                self._queued_jobs -= 1
            return work
        return None

    def _enqueue(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        is_load: bool,
        job: TransferJob | None = None,
        deadline: bool = True,
    ) -> _Work:
        assert self._loop is not None and self._wake is not None
        work = _Work(fn, args, self._loop.create_future(), is_load, job)
        if deadline:
            work.deadline = self._loop.call_later(self.io_timeout_s, self._expire, work)
        with self._thread_lock:
            (self._loads if is_load else self._stores).append(work)
            if job is not None:
                self._queued_jobs += 1
        self._dispatch()
        return work

    def _expire(self, work: _Work) -> None:
        """Deadline timer (loop thread): fail the work; abandon its thread if it is running."""
        if work.state == _DONE:
            return
        self.counters["timeouts"] += 1
        rows_in_use = False  # may the running work still touch the job's primary rows?
        with self._thread_lock:  # a thread may take queued work meanwhile
            queued = work.state == _QUEUED
            if queued:
                work.state = _DONE
                if work.job is not None:
                    self._queued_jobs -= 1
            elif work.task is None:  # running on a thread
                if work.finished:
                    return  # its result is already on the way to the loop
                work.abandoned = True
                rows_in_use = work.in_rows
                work.replaced = self._replacements < self.io_threads
                if work.replaced:
                    self._replacements += 1
                self._running.discard(work)
        if not queued and work.task is not None:  # a native task
            work.abandoned = rows_in_use = True  # its slot frees once the task has unwound
            work.task.cancel()
            self.counters["stuck_threads"] += 1
            with self._thread_lock:
                self._running.discard(work)
        elif not queued:
            self.counters["stuck_threads"] += 1
            if work.replaced:
                self._spawn_thread()
                self._release_slot(work.slot)
        self._fail(work, f"deadline of {self.io_timeout_s:g} s passed", abandoned=rows_in_use)

    def _thread_returned(self, work: _Work) -> None:
        """An abandoned thread's call returned (loop thread): its job's primary rows are free
        to reuse now, which a ``released`` result tells the coordinator."""
        self.counters["stuck_threads"] -= 1
        if not work.replaced:
            self._release_slot(work.slot)
        if work.job is not None:
            self._finished.append(JobResult(work.job.job_id, False, released=True))

    def _release_slot(self, slot: int) -> None:
        with self._thread_lock:
            self._free_slots.append(slot)
        self._dispatch()

    def _work_done(
        self, work: _Work, outcome: Any, error: BaseException | None, slot_kept: bool = False
    ) -> None:
        """A thread (or task) finished ``work`` in time (loop thread); ``slot_kept``: the thread
        already runs the slot's next work."""
        with self._thread_lock:
            self._running.discard(work)
        if not slot_kept:
            self._release_slot(work.slot)
        if work.deadline is not None:
            work.deadline.cancel()
        work.state = _DONE
        job = work.job
        if job is None:
            if work.fut.done():  # the caller was cancelled meanwhile
                return
            if error is not None:
                work.fut.set_exception(error)
            else:
                work.fut.set_result(outcome)
            return
        elapsed = time.perf_counter() - work.started_at
        if error is None:
            result = JobResult(job.job_id, True, transfer_size=outcome, transfer_time=elapsed)
        elif isinstance(error, TransferError):
            kind = "load_failures" if job.is_promotion else "store_failures"
            self.counters[kind] += 1
            # the first of each kind is a warning (a full disk fails every job: no flood); a
            # corrupt block was already warned about by the tier that found it
            first = self.counters[kind] == 1 and not isinstance(error.__cause__, CorruptBlockError)
            level = logging.WARNING if first else logging.DEBUG
            log.log(
                level,
                "tier %s: job %d: %s (%s so far: %d)",
                self.name,
                job.job_id,
                error,
                kind,
                self.counters[kind],
            )
            result = JobResult(
                job.job_id,
                False,
                successful_keys=error.succeeded or None,
                error=str(error),
                transfer_size=(
                    error.transferred_bytes
                    if error.transferred_bytes is not None
                    else len(error.succeeded) * self.host.block_bytes
                ),
                transfer_time=elapsed,
            )
        else:
            self.counters["errors"] += 1
            log.warning("tier %s: job %d failed: %r", self.name, job.job_id, error)
            result = JobResult(job.job_id, False, error=f"{type(error).__name__}: {error}")
        self._finish_job(job, work.fut, result)

    def _fail(self, work: _Work, reason: str, abandoned: bool = False) -> None:
        work.state = _DONE
        if work.deadline is not None:
            work.deadline.cancel()
        if work.job is not None:
            result = JobResult(work.job.job_id, False, error=reason, abandoned=abandoned)
            self._finish_job(work.job, work.fut, result)
        elif not work.fut.done():
            work.fut.set_exception(TimeoutError(f"tier {self.name!r}: {reason}"))

    def _finish_job(
        self, job: TransferJob, fut: asyncio.Future[JobResult], result: JobResult
    ) -> None:
        if job.is_promotion and not result.success:
            done = set(result.successful_keys or ())
            self._lookup.mark_miss([k for k in job.keys if k not in done])
        if not job.is_promotion and result.success:
            stored = self._stored_event_keys(job.keys)
            if stored:
                self._events.append(OffloadingEvent(stored, self.medium, False, self.name))
        kind = "load" if job.is_promotion else "store"
        self.counters[f"{kind}_jobs"] += 1
        self.counters[f"{kind}_bytes"] += result.transfer_size
        self._finished.append(result)
        if not fut.done():
            fut.set_result(result)

    async def _call_blocking(
        self, fn: Callable[..., Any], *args: Any, deadline: bool = True
    ) -> Any:
        """Run ``fn(*args)`` on an I/O thread (load priority); its exception propagates.

        Raises:
            TierUnavailableError: the tier is not running.
            TimeoutError: ``deadline`` and the call did not return within ``io_timeout_s``.
        """
        self._check_running()
        return await self._enqueue(fn, args, is_load=True, deadline=deadline).fut

    def _check_running(self) -> None:
        if self._loop is None or self._wake is None or self._closed:
            raise TierUnavailableError(f"tier {self.name!r} is not running")
        if threading.get_ident() != self._loop_thread:
            raise RuntimeError(f"tier {self.name!r}: submit from outside the event-loop thread")

    def _submit(self, job: TransferJob) -> asyncio.Future[JobResult]:
        self._check_running()
        assert self._loop is not None
        fut: asyncio.Future[JobResult]
        if not job.is_promotion and self._queued_jobs >= self.max_queued_jobs:
            self.counters["store_rejected"] += 1
            fut = self._loop.create_future()
            self._finish_job(
                job,
                fut,
                JobResult(
                    job.job_id, False, error=f"queue full ({self.max_queued_jobs} jobs waiting)"
                ),
            )
            return fut
        try:
            rows = self._rows(job.block_ids)
        except IndexError as exc:
            self.counters["errors"] += 1
            fut = self._loop.create_future()
            self._finish_job(job, fut, JobResult(job.job_id, False, error=str(exc)))
            return fut
        mover = self._load_blocks if job.is_promotion else self._store_blocks
        work = self._enqueue(mover, (job.keys, rows), job.is_promotion, job)
        self._pending.add(work.fut)
        work.fut.add_done_callback(self._pending.discard)
        return work.fut

    # -- synchronous façade (spec §3.2) ----------------------------------------------------
    def submit_store(self, job: TransferJob) -> asyncio.Future[JobResult]:
        """Enqueue a cascade (primary rows ``job.block_ids`` → this tier); returns its future.

        The rows stay pinned by the coordinator until the job's result is collected. A full
        queue answers at once with a failed result.

        Raises:
            TierUnavailableError: the tier is not running.
        """
        return self._submit(job)

    def submit_load(self, job: TransferJob) -> asyncio.Future[JobResult]:
        """Enqueue a promotion (this tier → reserved primary rows); returns its future.

        Raises:
            TierUnavailableError: the tier is not running.
        """
        return self._submit(job)

    def get_finished_jobs(self) -> list[JobResult]:
        """Every job result finished since the last call (single consumer)."""
        out = []
        while self._finished:
            out.append(self._finished.popleft())
        return out

    def lookup(self, key: bytes, ctx: ReqContext) -> LookupResult:
        """``HIT``/``MISS`` from the cached probe verdict, ``RETRY`` while the probe is pending.

        Same contract as vLLM's async lookup (spec §3.12): probes are batched per step and run
        after :meth:`on_schedule_end`; verdicts are kept while an interested request lives.
        """
        return self._lookup.lookup(key, ctx)

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Probe the existence of ``keys`` now (for asyncio callers); runs on an I/O thread.

        A probe that fails or passes its deadline answers MISS for every key.
        """
        if not keys:
            return []
        try:
            return await self._call_blocking(self._probe, list(keys))
        except (TimeoutError, OSError, TierUnavailableError) as exc:
            log.warning("tier %s: probe failed (%s); answering MISS", self.name, exc)
            return [False] * len(keys)

    async def invalidate(self, keys: Sequence[bytes]) -> int:
        """Delete ``keys``' blocks from this tier now (an operator's or embedder's removal of
        blocks that must not be served again); runs on an I/O thread like a probe.

        Returns how many of them were present. Their cached lookup verdicts become MISS and a
        removal event is queued.

        Raises:
            NotImplementedError: the tier cannot remove blocks (:meth:`_remove`).
            TierUnavailableError: the tier is not running.
            TimeoutError: the removal did not finish within ``io_timeout_s``.
            OSError / TransferError: a block could not be deleted (the tier's own error).
        """
        keys = list(dict.fromkeys(keys))
        if not keys:
            return 0
        present = await self._call_blocking(self._remove, keys)
        self._lookup.mark_miss(keys)
        gone = [k for k, was in zip(keys, present) if was]
        if gone:
            self._events.append(OffloadingEvent(gone, self.medium, True, self.name))
        return len(gone)

    def _remove(self, keys: Sequence[bytes]) -> list[bool] | Awaitable[list[bool]]:
        """Delete the blocks of ``keys``; for each, whether it was present. Runs on an I/O
        thread (or on the loop, for a native tier). Tiers that can remove blocks override it.

        Raises:
            NotImplementedError: by default.
        """
        raise NotImplementedError(
            f"tier {self.name!r} ({type(self).__name__}) cannot remove blocks"
        )

    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        """Offload policy for a new request (BLOCK_LEVEL)."""
        return RequestOffloadingContext()

    def on_request_finished(self, ctx: ReqContext) -> None:
        """Forget the request's cached lookup verdicts."""
        self._lookup.cleanup(ctx.req_id)

    def on_schedule_end(self, ctx: ScheduleEndContext) -> None:
        """Flush the step's batch of lookup probes to the actor."""
        self._lookup.flush()

    def touch(self, keys: Collection[bytes]) -> None:  # noqa: B027 - optional hook
        """Recency hint (no-op unless the tier keeps its own eviction order)."""

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Stored/removed events of this tier since the last call."""
        out = []
        while self._events:
            out.append(self._events.popleft())
        return out

    def has_pending_work(self) -> bool:
        """True while any job is queued or running."""
        return bool(self._pending)

    async def drain(self) -> None:
        """Wait until every submitted job completed or failed (never aborts a copy mid-way).

        Bounded by the jobs' deadlines.
        """
        while self._pending:
            await asyncio.wait(list(self._pending))

    def close(self) -> None:
        """Stop the actor: queued jobs fail, running ones finish, then the loop exits."""
        self._closed = True
        if self._loop is not None and self._wake is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)


async def gather_blocks(
    mover: Callable[[bytes, memoryview], Awaitable[int]],
    what: str,
    keys: Sequence[bytes],
    rows: Sequence[memoryview],
) -> int:
    """Run a native tier's per-block ``mover`` on every block concurrently; bytes moved.

    Every block is tried; ``what`` (e.g. ``"s3 store"``) names the job in the error.

    Raises:
        TransferError: some block failed with a kvcascade error; carries the keys that
            succeeded (job order) and the first failure as its cause.
        the first failure itself when it is not a kvcascade error (a bug, not an I/O fault).
    """
    results = await asyncio.gather(
        *(mover(k, r) for k, r in zip(keys, rows, strict=True)), return_exceptions=True
    )
    failed = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
    if not failed:
        return sum(r for r in results if isinstance(r, int))
    i, first = failed[0]
    if not isinstance(first, KVCascadeError):
        raise first
    bad = {j for j, _ in failed}
    succeeded = [k for j, k in enumerate(keys) if j not in bad]
    raise TransferError(f"{what} of block {i} failed: {first}", succeeded) from first
