"""The jobs of one secondary tier: submission, deadlines, completion (docs/architecture.md).

A :class:`~kvcascade.tiers.base.SecondaryTier` composes one :class:`TierJobs`; the tier's
synchronous façade and its asyncio calls are thin delegations to it. vLLM splits a tier the
same way: ``kv_offload/tiering/base.py`` is the contract, ``fs/thread_pool.py`` runs the I/O
(:mod:`kvcascade.tiers._pool` here) and ``async_lookup.py`` batches the probes
(:mod:`kvcascade.tiers._lookup`). This module owns, for the tier:

* the worker pool: a :class:`~kvcascade.tiers._pool.ThreadPool` for blocking movers, a
  :class:`~kvcascade.tiers._pool.TaskPool` for coroutine movers (a native asyncio tier);
* submission with a priority (loads before stores) and a deadline (``io_timeout_s``; a probe's
  ``probe_timeout_s``), the queue bound of stores (``max_queued_jobs``) and the degraded state
  (:mod:`kvcascade.tiers._health`) that skips cascades and answers probes MISS;
* exactly-once completion: each job's future resolves once with its :class:`JobResult`, the
  same result is queued for :meth:`TierJobs.finished`, a job abandoned at its deadline is
  followed by a ``released`` result once its mover returned;
* the tier's :class:`OffloadingEvent` queue: successful stores, and the removals the tier
  announces (:meth:`TierJobs.announce_removed`).

Every method runs on the event-loop thread, except :meth:`TierJobs.close`,
:meth:`TierJobs.announce_removed` (any thread), :meth:`TierJobs.row_access` and
:meth:`TierJobs.abandoned` (a mover's I/O thread).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .._errors import (
    CorruptBlockError,
    DeadlineExceededError,
    KVCascadeError,
    TierUnavailableError,
    TransferError,
)
from .._event_queue import EventQueue
from .._keys import make_offload_key
from .._types import JobResult, OffloadingEvent, TransferJob
from ._backend import NotFoundError
from ._health import DeadlineHealth
from ._pool import Priority, Submitted, TaskPool, ThreadPool, WorkerPool

if TYPE_CHECKING:
    from .base import SecondaryTier

log = logging.getLogger(__name__)

_MOVERS = ("_store_blocks", "_load_blocks", "_probe")
_HEALTH_KEY = make_offload_key(b"kvcascade health probe", 0)
"""The key a degraded tier's background probe asks for (never stored: any answer will do)."""


class TierJobs:
    """The job machinery of ``tier`` (module docstring).

    It calls the tier's movers (``_store_blocks``, ``_load_blocks``, ``_probe``) and hooks
    (``_rows``, ``_stored_event_keys``; a failed promotion's keys go to the tier's lookup
    verdicts as MISS) and counts into ``tier.counters``.

    Raises:
        TypeError: the tier's movers mix blocking and coroutine functions.
    """

    def __init__(self, tier: SecondaryTier) -> None:
        native = [inspect.iscoroutinefunction(getattr(tier, m)) for m in _MOVERS]
        if any(native) and not all(native):
            raise TypeError(
                f"tier {tier.name!r}: {', '.join(_MOVERS)} must be all blocking or all coroutine "
                f"functions; coroutine: {[m for m, n in zip(_MOVERS, native) if n]}"
            )
        self._tier = tier
        self._native = all(native)
        self.loop: asyncio.AbstractEventLoop | None = None
        """The event loop the tier serves on (None until :meth:`start`)."""
        self._loop_thread: int | None = None
        self._pool: WorkerPool | None = None
        self._wake: asyncio.Event | None = None
        self._closed = False
        self._pending: set[asyncio.Future[JobResult]] = set()
        self._finished: collections.deque[JobResult] = collections.deque()
        self.events = EventQueue(f"tier {tier.name!r}")
        self._warned: set[str] = set()  # the kinds of failed job already logged as a warning
        self.health = DeadlineHealth(tier.name, tier.counters, self._answers_in_time)

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Bind to the running loop and start the pool (the tier's actor, before start-up)."""
        tier = self._tier
        self.loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._wake = asyncio.Event()
        pool_type = TaskPool if self._native else ThreadPool
        self._pool = pool_type(tier.name, tier.io_threads, tier.io_timeout_s, tier.counters)
        self._pool.start()

    async def wait_closed(self) -> None:
        """Return once :meth:`close` was called (at once if it already was)."""
        assert self._wake is not None
        while not self._closed:
            self._wake.clear()
            await self._wake.wait()

    def close(self) -> None:
        """Stop taking jobs (any thread): :meth:`wait_closed` returns, queued jobs stay queued
        until :meth:`shutdown` fails them."""
        self._closed = True
        if self._pool is not None:
            self._pool.close()
        loop, wake = self.loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            loop.call_soon_threadsafe(wake.set)

    async def shutdown(self) -> None:
        """Stop the background probe, fail the queued jobs, wait for the running ones (bounded
        by their deadlines) and stop the pool."""
        self._closed = True
        await self.health.stop()
        if self._pool is not None:
            await self._pool.shutdown()

    def has_pending_work(self) -> bool:
        """True while any job is queued or running."""
        return bool(self._pending)

    async def drain(self) -> None:
        """Wait until every submitted job completed or failed (bounded by their deadlines)."""
        while self._pending:
            await asyncio.wait(list(self._pending))

    # -- what a mover uses (its I/O thread) -------------------------------------------------
    def row_access(self) -> contextlib.AbstractContextManager[None]:
        """The pool's guard around a mover's reads and writes of primary rows
        (:meth:`~kvcascade.tiers._pool.WorkerPool.row_access`)."""
        pool = self._pool
        return pool.row_access() if pool is not None else contextlib.nullcontext()

    def abandoned(self) -> bool:
        """True once the calling mover's job passed its deadline."""
        pool = self._pool
        return pool is not None and pool.abandoned()

    # -- calls --------------------------------------------------------------------------------
    def _check_running(self) -> WorkerPool:
        if self._pool is None or self._closed:
            raise TierUnavailableError(f"tier {self._tier.name!r} is not running")
        if threading.get_ident() != self._loop_thread:
            raise RuntimeError(
                f"tier {self._tier.name!r}: submit from outside the event-loop thread"
            )
        return self._pool

    async def call(
        self,
        fn: Callable[..., Any],
        *args: Any,
        deadline: bool = True,
        timeout_s: float | None = None,
    ) -> Any:
        """Run ``fn(*args)`` on the pool (load priority); its exception propagates.

        Raises:
            TierUnavailableError: the tier is not running, or closed before the call ran.
            DeadlineExceededError: ``deadline`` and the call did not return within
                ``timeout_s`` (default ``io_timeout_s``).
        """
        pool = self._check_running()
        return await pool.submit(
            fn, args, Priority.LOAD, deadline=deadline, is_job=False, timeout_s=timeout_s
        )

    async def probe(self, keys: Sequence[bytes]) -> list[bool]:
        """The existence of ``keys`` by the tier's ``_probe``, MISS for all of them when the
        tier is degraded or the probe fails or passes ``probe_timeout_s``
        (:meth:`~kvcascade.tiers.base.SecondaryTier.contains`)."""
        if not keys:
            return []
        tier = self._tier
        counters = tier.counters
        if self.health.degraded:
            counters["degraded_probes"] += len(keys)
            return [False] * len(keys)
        try:
            found: list[bool] = await self.call(
                tier._probe, list(keys), timeout_s=tier.probe_timeout_s
            )
        except DeadlineExceededError:
            self.health.missed("probe", tier.probe_timeout_s)
            return [False] * len(keys)
        except (TimeoutError, OSError, TierUnavailableError) as exc:
            counters["probe_failures"] += 1
            log.log(
                logging.WARNING if counters["probe_failures"] == 1 else logging.DEBUG,
                "tier %s: probe failed (%s); answering MISS (probe_failures so far: %d)",
                tier.name,
                exc,
                counters["probe_failures"],
            )
            return [False] * len(keys)
        self.health.answered()
        return found

    async def _answers_in_time(self) -> bool:
        """The background probe of a degraded tier: whether a probe of a key nobody stores
        answered (HIT, MISS or an error) within ``probe_timeout_s``; False once the tier is
        closing (it is not probed any more)."""
        if self._closed:
            return False
        try:
            await self.call(self._tier._probe, [_HEALTH_KEY], timeout_s=self._tier.probe_timeout_s)
        except DeadlineExceededError:
            return False
        except (OSError, KVCascadeError):
            pass
        return True

    # -- jobs ---------------------------------------------------------------------------------
    def submit(self, job: TransferJob) -> asyncio.Future[JobResult]:
        """Queue ``job`` (a promotion at load priority, a cascade at store priority); returns
        its future. A store beyond ``max_queued_jobs`` waiting, a store to a degraded tier and
        a job naming a slot outside the primary answer at once with a failed result.

        Raises:
            TierUnavailableError: the tier is not running.
        """
        pool = self._check_running()
        assert self.loop is not None
        tier = self._tier
        fut: asyncio.Future[JobResult] = self.loop.create_future()
        if not job.is_promotion and pool.queued_jobs >= tier.max_queued_jobs:
            tier.counters["store_rejected"] += 1
            reason = f"queue full ({tier.max_queued_jobs} jobs waiting)"
            self._finish(job, fut, JobResult(job.job_id, False, error=reason))
            return fut
        if not job.is_promotion and self.health.degraded:
            tier.counters["degraded_skipped_blocks"] += len(job.keys)
            reason = "tier degraded (calls missed their deadlines); cascade skipped"
            self._finish(job, fut, JobResult(job.job_id, False, error=reason))
            return fut
        try:
            rows = tier._rows(job.block_ids)
        except IndexError as exc:
            tier.counters["errors"] += 1
            self._finish(job, fut, JobResult(job.job_id, False, error=str(exc)))
            return fut
        released = JobResult(job.job_id, False, released=True)  # once its rows are free
        pool.submit(
            tier._load_blocks if job.is_promotion else tier._store_blocks,
            (job.keys, rows),
            Priority.LOAD if job.is_promotion else Priority.STORE,
            on_done=lambda work: self._done(job, work, fut),
            on_released=lambda: self._finished.append(released),
        )
        self._pending.add(fut)
        fut.add_done_callback(self._pending.discard)
        return fut

    def finished(self) -> list[JobResult]:
        """Every job result finished since the last call (single consumer)."""
        out = list(self._finished)
        self._finished.clear()
        return out

    def take_events(self) -> list[OffloadingEvent]:
        """Stored/removed events since the last call (at most
        :data:`kvcascade._event_queue.MAX_QUEUED_EVENTS`, the oldest dropped beyond)."""
        return self.events.take()

    def announce_removed(self, keys: Sequence[bytes]) -> None:
        """Queue the removal event of ``keys`` (evicted or invalidated; any thread)."""
        tier = self._tier
        self.events.append(OffloadingEvent(list(keys), tier.medium, True, tier.name))

    def _done(self, job: TransferJob, work: Submitted, fut: asyncio.Future[JobResult]) -> None:
        """Turn a job's outcome on the pool into its :class:`JobResult`."""
        tier = self._tier
        counters = tier.counters
        error = work.future.exception()
        elapsed = time.perf_counter() - work.started_at
        if job.is_promotion:
            if isinstance(error, DeadlineExceededError):
                self.health.missed("load", tier.io_timeout_s)
            elif error is None or isinstance(error, TransferError):
                self.health.answered()
        if error is None:
            size = work.future.result()
            result = JobResult(job.job_id, True, transfer_size=size, transfer_time=elapsed)
        elif isinstance(error, DeadlineExceededError | TierUnavailableError):  # the pool's
            abandoned = isinstance(error, DeadlineExceededError) and error.rows_in_use
            result = JobResult(job.job_id, False, error=str(error), abandoned=abandoned)
        elif isinstance(error, TransferError):
            kind = "load_failures" if job.is_promotion else "store_failures"
            counters[kind] += 1
            # The first failure of each kind is a warning (a full disk fails every job: no
            # flood), the others debug lines. Not warnings: a failure whose cause the tier
            # warned about (``reported``: a full disk or server), a corrupt block (the tier's
            # _corrupt warned), and a load of a block the backend answered is not there (a
            # value a valkey server evicted between lookup and load: a miss under eviction,
            # counted by the tier, e.g. valkey's missing_blocks).
            cause = error.__cause__
            routine = (
                error.reported
                or isinstance(cause, CorruptBlockError)
                or (job.is_promotion and isinstance(cause, NotFoundError))
            )
            first = not routine and kind not in self._warned
            if first:
                self._warned.add(kind)
            log.log(
                logging.WARNING if first else logging.DEBUG,
                "tier %s: job %d: %s (%s so far: %d)",
                tier.name,
                job.job_id,
                error,
                kind,
                counters[kind],
            )
            moved = error.transferred_bytes
            result = JobResult(
                job.job_id,
                False,
                successful_keys=error.succeeded or None,
                error=str(error),
                transfer_size=len(error.succeeded) * tier.host.block_bytes
                if moved is None
                else moved,
                transfer_time=elapsed,
            )
        else:
            counters["errors"] += 1
            log.warning("tier %s: job %d failed: %r", tier.name, job.job_id, error)
            result = JobResult(job.job_id, False, error=f"{type(error).__name__}: {error}")
        self._finish(job, fut, result)

    def _finish(self, job: TransferJob, fut: asyncio.Future[JobResult], result: JobResult) -> None:
        tier = self._tier
        if job.is_promotion and not result.success:
            done = set(result.successful_keys or ())
            tier._lookup.mark_miss([k for k in job.keys if k not in done])
        if not job.is_promotion and result.success:
            stored = tier._stored_event_keys(job.keys)
            if stored:
                self.events.append(OffloadingEvent(stored, tier.medium, False, tier.name))
        kind = "load" if job.is_promotion else "store"
        tier.counters[f"{kind}_jobs"] += 1
        tier.counters[f"{kind}_bytes"] += result.transfer_size
        self._finished.append(result)
        if not fut.done():
            fut.set_result(result)
