"""Secondary tiers: the contract the coordinator relies on, and the actor machinery.

A secondary tier is an asyncio actor. The coordinator (on the scheduler side) talks to it through
non-blocking synchronous calls — ``lookup``, ``submit_store``, ``submit_load``,
``get_finished_jobs`` — that only enqueue work in the actor's mailbox or read what it finished
(vLLM's ``SecondaryTierManager`` contract, spec §3.2). The actor loop (:meth:`SecondaryTier.run`)
runs inside the cascade's task group, takes jobs from its mailbox (loads before stores), runs the
blocking part in a bounded thread pool, and resolves each job's future. Nobody polls: futures
are awaited by asyncio callers; the synchronous façade collects finished results at its poll
points.

Thread rules: the synchronous façade runs on the event-loop thread (a scheduler on another thread
reaches it through the coordinator's portal); only :meth:`close` may be called from any thread.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import ClassVar

from .._errors import TierUnavailableError, TransferError
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


class SecondaryTier(ABC):
    """Base class of secondary tiers (fs, s3, memory).

    Subclasses implement the blocking data movers :meth:`_store_blocks`, :meth:`_load_blocks`
    and :meth:`_probe` (run on the tier's thread pool) and may override the hooks.

    Args:
        name: the tier's name in metrics, events and replay output (e.g. ``"fs"``).
        host: the primary tier's buffer; jobs address its rows by slot id.
        io_threads: size of the thread pool for blocking I/O (``>= 1``).
        io_timeout_s: deadline of one job in seconds; a job past it fails (its pins are then
            released by the coordinator) instead of hanging.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self, name: str, host: HostBuffer, io_threads: int = 4, io_timeout_s: float = 30.0
    ) -> None:
        self.name = name
        self.host = host
        self.io_threads = io_threads
        self.io_timeout_s = io_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._loads: collections.deque[tuple[TransferJob, asyncio.Future[JobResult]]] = (
            collections.deque()
        )
        self._stores: collections.deque[tuple[TransferJob, asyncio.Future[JobResult]]] = (
            collections.deque()
        )
        self._finished: collections.deque[JobResult] = collections.deque()
        self._events: collections.deque[OffloadingEvent] = collections.deque()
        self._wake: asyncio.Event | None = None
        self._pending: set[asyncio.Future[JobResult]] = set()
        self._closed = False
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=io_threads, thread_name_prefix=f"kvcascade-{name}"
        )
        self._lookup = AsyncLookup(self)
        self.counters: collections.Counter[str] = collections.Counter()

    # -- data movers (blocking; run on the thread pool) --------------------------------------
    @abstractmethod
    def _store_blocks(self, keys: Sequence[bytes], rows: Sequence[memoryview]) -> int:
        """Persist ``rows[i]`` under ``keys[i]``; return bytes written.

        Raises on the first failing block (:class:`TransferError` with the keys that succeeded).
        """

    @abstractmethod
    def _load_blocks(self, keys: Sequence[bytes], rows: Sequence[memoryview]) -> int:
        """Fill ``rows[i]`` with the bytes stored under ``keys[i]``; return bytes read.

        Raises on the first failing block (:class:`TransferError` with the keys that succeeded);
        a block that fails its integrity check raises with a :class:`CorruptBlockError` cause.
        """

    @abstractmethod
    def _probe(self, keys: Sequence[bytes]) -> list[bool]:
        """Existence of each key (blocking)."""

    # -- actor ---------------------------------------------------------------------------
    async def run(self, started: Callable[[], None] | None = None) -> None:
        """The actor loop; runs until :meth:`close`. Loads are taken before stores."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._wake = asyncio.Event()
        slots = asyncio.Semaphore(self.io_threads)
        running: set[asyncio.Task[None]] = set()
        if started is not None:
            started()
        try:
            while True:
                if not self._loads and not self._stores:
                    if self._closed:
                        break
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                await slots.acquire()
                job, fut = self._loads.popleft() if self._loads else self._stores.popleft()
                task = asyncio.create_task(self._execute(job, fut, slots))
                running.add(task)
                task.add_done_callback(running.discard)
        finally:
            for job, fut in [*self._loads, *self._stores]:
                self._complete(job, fut, JobResult(job.job_id, False, error="tier closed"))
            self._loads.clear()
            self._stores.clear()
            if running:
                await asyncio.gather(*running, return_exceptions=True)
            self._executor.shutdown(wait=True, cancel_futures=True)

    async def _execute(
        self, job: TransferJob, fut: asyncio.Future[JobResult], slots: asyncio.Semaphore
    ) -> None:
        loop = asyncio.get_running_loop()
        rows = [self.host.row(int(b)) for b in job.block_ids]
        mover = self._load_blocks if job.is_promotion else self._store_blocks
        start = time.perf_counter()
        try:
            nbytes = await asyncio.wait_for(
                loop.run_in_executor(self._executor, mover, job.keys, rows), self.io_timeout_s
            )
            result = JobResult(
                job.job_id, True, transfer_size=nbytes, transfer_time=time.perf_counter() - start
            )
        except TransferError as exc:
            self.counters["load_failures" if job.is_promotion else "store_failures"] += 1
            ok = exc.succeeded or None
            result = JobResult(
                job.job_id, False, successful_keys=ok, error=str(exc),
                transfer_size=len(exc.succeeded) * self.host.block_bytes,
                transfer_time=time.perf_counter() - start,
            )
        except (asyncio.TimeoutError, OSError, TierUnavailableError) as exc:
            self.counters["timeouts" if isinstance(exc, asyncio.TimeoutError) else "errors"] += 1
            result = JobResult(job.job_id, False, error=f"{type(exc).__name__}: {exc}")
        finally:
            slots.release()
        if job.is_promotion and not result.success:
            done = set(result.successful_keys or ())
            self._lookup.mark_miss([k for k in job.keys if k not in done])
        if not job.is_promotion and result.success:
            self._events.append(OffloadingEvent(list(job.keys), self.medium, False, self.name))
        self._complete(job, fut, result)

    def _complete(
        self, job: TransferJob, fut: asyncio.Future[JobResult], result: JobResult
    ) -> None:
        kind = "load" if job.is_promotion else "store"
        self.counters[f"{kind}_jobs"] += 1
        self.counters[f"{kind}_bytes"] += result.transfer_size
        self._finished.append(result)
        if not fut.done():
            fut.set_result(result)

    def _submit(self, job: TransferJob) -> asyncio.Future[JobResult]:
        if self._loop is None or self._wake is None or self._closed:
            raise TierUnavailableError(f"tier {self.name!r} is not running")
        if threading.get_ident() != self._loop_thread:
            raise RuntimeError(f"tier {self.name!r}: submit from outside the event-loop thread")
        fut: asyncio.Future[JobResult] = self._loop.create_future()
        self._pending.add(fut)
        fut.add_done_callback(self._pending.discard)
        (self._loads if job.is_promotion else self._stores).append((job, fut))
        self._wake.set()
        return fut

    # -- synchronous façade (spec §3.2) ----------------------------------------------------
    def submit_store(self, job: TransferJob) -> asyncio.Future[JobResult]:
        """Enqueue a cascade (primary rows ``job.block_ids`` → this tier); returns its future.

        The rows stay pinned by the coordinator until the job's result is collected.
        """
        return self._submit(job)

    def submit_load(self, job: TransferJob) -> asyncio.Future[JobResult]:
        """Enqueue a promotion (this tier → reserved primary rows); returns its future."""
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
        """Probe the existence of ``keys`` now (for asyncio callers); runs on the thread pool."""
        if not keys:
            return []
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(
                loop.run_in_executor(self._executor, self._probe, list(keys)), self.io_timeout_s
            )
        except (asyncio.TimeoutError, OSError, TierUnavailableError) as exc:
            log.warning("tier %s: probe failed (%s); answering MISS", self.name, exc)
            return [False] * len(keys)

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
        """Wait until every submitted job completed or failed (never aborts a copy mid-way)."""
        while self._pending:
            await asyncio.wait(list(self._pending))

    def close(self) -> None:
        """Stop the actor: queued jobs fail, running ones finish, then the loop exits."""
        self._closed = True
        if self._loop is not None and self._wake is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)
