"""The contract of a secondary tier (vLLM's ``tiering/base.py``; docs/architecture.md).

A secondary tier is an asyncio actor behind a synchronous façade. The coordinator talks to it
through non-blocking calls — :meth:`~SecondaryTier.lookup`, :meth:`~SecondaryTier.submit_store`,
:meth:`~SecondaryTier.submit_load`, :meth:`~SecondaryTier.get_finished_jobs` — that only queue
work or read what finished (vLLM's ``SecondaryTierManager``); asyncio callers await the futures
instead. The façade delegates to the job machinery the tier composes (submission, deadlines,
exactly-once completion, events: :mod:`kvcascade.tiers._jobs`). vLLM splits the rest the same
way: the worker pool is ``fs/thread_pool.py`` (:mod:`kvcascade.tiers._pool` here), the batched
probes ``async_lookup.py`` (:mod:`kvcascade.tiers._lookup`).

What the framework guarantees a tier:

* a mover (:meth:`~SecondaryTier._store_blocks`, :meth:`~SecondaryTier._load_blocks`,
  :meth:`~SecondaryTier._probe`, :meth:`~SecondaryTier._remove`) is given the job's keys and the
  primary rows to read or fill (:meth:`~SecondaryTier._rows`), pinned or reserved by the
  coordinator until the job's result is collected; at most ``io_threads`` movers run at once,
  loads preferred over stores (:class:`~kvcascade.tiers._pool.WorkerPool`);
* a job passing its deadline (``io_timeout_s`` from submission; an existence probe's is the
  shorter ``probe_timeout_s``, after which it answers MISS) fails without waiting for its
  mover, whose late outcome is then discarded; a mover that was inside
  :meth:`~SecondaryTier._row_access` keeps its rows out of use until it returns;
* blocking movers run on the tier's daemon I/O threads; coroutine movers (all of them, a native
  asyncio tier) run as tasks on the event loop, and are cancelled at their deadline; everything
  else a tier implements (:meth:`~SecondaryTier._rows`, :meth:`~SecondaryTier._stored_event_keys`,
  :meth:`~SecondaryTier.touch`, :meth:`~SecondaryTier._startup`,
  :meth:`~SecondaryTier._cleanup`) runs on the event-loop thread;
* a tier whose probes or loads keep missing their deadlines is *degraded*: probes answer MISS
  at once and cascades to it are skipped until a background probe answers in time
  (:mod:`kvcascade.tiers._health`);
* :meth:`~SecondaryTier._startup` runs before the tier reports ready,
  :meth:`~SecondaryTier._cleanup` after its last job ended (also when the start-up failed);
* every job completes exactly once: its future resolves with a :class:`JobResult`, the same
  result comes out of :meth:`~SecondaryTier.get_finished_jobs` (a job abandoned at its deadline
  is followed by a ``released`` result once its mover returned), and a successful store is
  announced as an :class:`OffloadingEvent`.

What a tier owes the framework:

* a store skips keys it knows to be present (a store hit moves no bytes) and stays within the
  tier's capacity (evicting first, announcing the evicted keys as removed:
  :meth:`~SecondaryTier._announce_removed`);
* a store moves every block it can and, if any failed, raises :class:`TransferError` with
  exactly the keys stored; a load stops at its first failing block (a prefix is useless after
  its first gap) and raises :class:`TransferError` with the keys before it; a block that fails
  its integrity check is deleted and counted, never served (:meth:`~SecondaryTier._corrupt`);
* every read or write of primary rows by a blocking mover happens inside
  :meth:`~SecondaryTier._row_access`, and a long mover may stop early once
  :meth:`~SecondaryTier._job_abandoned`;
* the synchronous façade is called on the event-loop thread only (an engine on another thread
  reaches the coordinator through a portal, ``kvcascade.integrations._loop``); only
  :meth:`~SecondaryTier.close` may be called from any thread.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar, TypeVar

from .._errors import CorruptBlockError, KVCascadeError, TransferError
from .._event_queue import EventQueue
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
from ._backend import NotFoundError
from ._jobs import TierJobs
from ._lookup import AsyncLookup
from .cpu import HostBuffer

log = logging.getLogger(__name__)

_T = TypeVar("_T")
PROBE_TIMEOUT_S = 0.5
"""Default deadline of one existence probe, seconds (``probe_timeout_s`` of every tier)."""
CORRUPT_WARNING_INTERVAL_S = 60.0
"""Seconds between two warnings of one kind about one tier's blocks (corrupt blocks, stores
a full filesystem refused: :meth:`SecondaryTier._limited_warning`): the first block is warned
about at once, the later ones in one summary at most this often (a damaged or full disk fails
many blocks: no flood), each one a debug line; the kind's counter counts every one."""


class SecondaryTier(ABC):
    """Base class of secondary tiers (fs, s3, valkey, memory); the contract is the module's.

    Subclasses implement :meth:`_store_blocks`, :meth:`_load_blocks` and :meth:`_probe` — all
    blocking functions, or all coroutine functions (a native asyncio tier) — and may override
    :meth:`_remove`, :meth:`_rows`, :meth:`_stored_event_keys`, :meth:`_startup`,
    :meth:`_cleanup` and :meth:`touch`. The job machinery is composed, not inherited
    (:class:`~kvcascade.tiers._jobs.TierJobs`).

    Args:
        name: the tier's name in metrics, events and replay output (e.g. ``"fs"``).
        host: the primary tier's buffer; jobs address its rows by slot id.
        io_threads: I/O threads (``>= 1``); for a native asyncio tier, jobs running at once.
        io_timeout_s: deadline of one job in seconds from submission (``> 0``).
        probe_timeout_s: deadline of one existence probe (a batch of keys) in seconds from
            submission (``> 0``); a probe past it answers MISS and counts towards degradation
            (:mod:`kvcascade.tiers._health`).
        max_queued_jobs: jobs allowed to wait for a thread (``>= 1``); a store beyond it is
            refused at once with a failed result (``counters["store_rejected"]``). Loads are
            always admitted (each holds a reserved primary slot, which bounds them).

    Raises:
        ValueError: a bound is out of range.
        TypeError: the movers mix blocking and coroutine functions.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        name: str,
        host: HostBuffer,
        io_threads: int = 4,
        io_timeout_s: float = 30.0,
        max_queued_jobs: int = 1024,
        probe_timeout_s: float = PROBE_TIMEOUT_S,
    ) -> None:
        if io_threads < 1 or max_queued_jobs < 1 or not io_timeout_s > 0 or not probe_timeout_s > 0:
            raise ValueError(
                f"tier {name!r}: need io_threads >= 1, io_timeout_s > 0, max_queued_jobs >= 1, "
                f"probe_timeout_s > 0; got {io_threads}, {io_timeout_s}, {max_queued_jobs}, "
                f"{probe_timeout_s}"
            )
        self.name = name
        self.host = host
        self.io_threads = io_threads
        self.io_timeout_s = io_timeout_s
        self.probe_timeout_s = probe_timeout_s
        self.max_queued_jobs = max_queued_jobs
        self.counters: collections.Counter[str] = collections.Counter()
        self._counters_lock = threading.Lock()  # counts made on I/O threads
        # _limited_warning's state per counter (under _counters_lock): when it last warned,
        # blocks since then.
        self._warned_at: dict[str, float] = {}
        self._unwarned: collections.Counter[str] = collections.Counter()
        self._lookup = AsyncLookup(self)
        self._jobs = TierJobs(self)

    # -- what a tier implements -------------------------------------------------------------
    @abstractmethod
    def _store_blocks(
        self, keys: Sequence[bytes], rows: Sequence[memoryview]
    ) -> int | Awaitable[int]:
        """Persist ``rows[i]`` under ``keys[i]``, skipping present keys; return bytes written.

        Raises:
            TransferError: some blocks failed; ``succeeded``: exactly the keys stored (store
                hits included, job order); ``transferred_bytes``: the bytes written.
        """

    @abstractmethod
    def _load_blocks(
        self, keys: Sequence[bytes], rows: Sequence[memoryview]
    ) -> int | Awaitable[int]:
        """Fill ``rows[i]`` with the bytes stored under ``keys[i]``; return bytes read.

        Raises:
            TransferError: at the first failing block, with the keys before it; with a
                :class:`CorruptBlockError` cause when the block failed its integrity check.
        """

    @abstractmethod
    def _probe(self, keys: Sequence[bytes]) -> list[bool] | Awaitable[list[bool]]:
        """Existence of each key."""

    def _remove(self, keys: Sequence[bytes]) -> list[bool] | Awaitable[list[bool]]:
        """Delete the blocks of ``keys``; for each, whether it was present (a mover).

        Raises:
            NotImplementedError: by default (the tier cannot remove blocks).
        """
        raise NotImplementedError(
            f"tier {self.name!r} ({type(self).__name__}) cannot remove blocks"
        )

    def _rows(self, block_ids: Iterable[int]) -> list[memoryview]:
        """The primary rows a job moves (default: the ``block_bytes`` KV bytes of each slot).

        Raises:
            IndexError: a slot id outside the primary tier (the job then fails at once).
        """
        return [self.host.row(int(b)) for b in block_ids]

    def _stored_event_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """Keys of a successful store job to announce as stored (default: all of them); a tier
        that evicts leaves out keys already removed again, so that events replay in order."""
        return list(keys)

    async def _startup(self) -> None:  # noqa: B027 - optional hook
        """Start-up work run by :meth:`serve` before it reports readiness (default: none)."""

    async def _cleanup(self) -> None:  # noqa: B027 - optional hook
        """Shutdown work run by :meth:`serve` after every job ended, also when
        :meth:`_startup` failed (default: none)."""

    def touch(self, keys: Collection[bytes]) -> None:  # noqa: B027 - optional hook
        """Recency hint (no-op unless the tier keeps its own eviction order)."""

    # -- what a tier's movers may use ---------------------------------------------------------
    def _row_access(self) -> AbstractContextManager[None]:
        """Around every read or write of primary rows by a blocking mover (its I/O thread).

        Raises:
            DeadlineExceededError: the job already passed its deadline.
        """
        return self._jobs.row_access()

    def _job_abandoned(self) -> bool:
        """On an I/O thread: True once the running job passed its deadline (stop early)."""
        return self._jobs.abandoned()

    def _corrupt(self, exc: CorruptBlockError, delete: Callable[[], _T]) -> _T:
        """A block failed its integrity check: count it (``counters["corrupt_blocks"]``), log
        it, and delete it with ``delete`` (the tier's deletion, which also drops the block
        from its index; a native tier's returns an awaitable, which this returns for the caller
        to await); the caller then fails the block, so that it is recomputed, never served.

        Logged by :meth:`_limited_warning`. Safe on any thread."""
        self._limited_warning(
            "corrupt_blocks",
            1,
            f"tier {self.name}: {exc}; deleted, block treated as a miss",
            "corrupt blocks",
        )
        return delete()

    def _limited_warning(self, counter: str, n: int, message: str, what: str) -> None:
        """Count ``n`` blocks in ``counters[counter]`` and log ``message`` about them: the
        tier's first time a warning (saying that later ones are rate-limited); after it, one
        warning at most every :data:`CORRUPT_WARNING_INTERVAL_S` seconds, with the blocks
        (``what``) since the previous warning and in all, and a debug line each other time.
        Safe on any thread."""
        now = time.monotonic()
        with self._counters_lock:
            self.counters[counter] += n
            total = self.counters[counter]
            last = self._warned_at.get(counter)
            warn = last is None or now - last >= CORRUPT_WARNING_INTERVAL_S
            self._unwarned[counter] += n
            since = self._unwarned[counter]
            if warn:
                self._warned_at[counter] = now
                self._unwarned[counter] = 0
        if last is None:
            log.warning(
                "%s (later %s of this tier: one warning per %.0f s at most)",
                message,
                what,
                CORRUPT_WARNING_INTERVAL_S,
            )
        else:
            log.log(
                logging.WARNING if warn else logging.DEBUG,
                "%s (%d %s since the last warning, %d in all)",
                message,
                since,
                what,
                total,
            )

    def _announce_removed(self, keys: Sequence[bytes]) -> None:
        """Announce ``keys`` as removed (the tier evicted them); safe on any thread."""
        self._jobs.announce_removed(keys)

    async def _call_blocking(
        self, fn: Callable[..., Any], *args: Any, deadline: bool = True
    ) -> Any:
        """Run ``fn(*args)`` on the tier's pool (load priority, deadline ``io_timeout_s`` unless
        not ``deadline``; :meth:`TierJobs.call <kvcascade.tiers._jobs.TierJobs.call>`)."""
        return await self._jobs.call(fn, *args, deadline=deadline)

    @property
    def degraded(self) -> bool:
        """True while the tier is degraded: its probes or loads kept missing their deadlines
        and no background probe has answered in time since (:mod:`kvcascade.tiers._health`)."""
        return self._jobs.health.degraded

    # -- lifecycle ------------------------------------------------------------------------
    async def serve(self, started: Callable[[], None] | None = None) -> None:
        """The actor: start the pool, run :meth:`_startup`, call ``started``, serve jobs until
        :meth:`close`; then fail the queued jobs, wait for the running ones (bounded by their
        deadlines), stop the pool and run :meth:`_cleanup`."""
        try:
            self._jobs.start()  # a failed start stops the threads it started
            await self._startup()
            if started is not None:
                started()
            await self._jobs.wait_closed()
        finally:
            await self._jobs.shutdown()
            await self._cleanup()

    def close(self) -> None:
        """Stop the actor (any thread): queued jobs fail, running ones finish, then
        :meth:`serve` returns."""
        self._jobs.close()

    def has_pending_work(self) -> bool:
        """True while any job is queued or running."""
        return self._jobs.has_pending_work()

    async def drain(self) -> None:
        """Wait until every submitted job completed or failed (bounded by their deadlines)."""
        await self._jobs.drain()

    # -- synchronous façade (vLLM's SecondaryTierManager) ---------------------------------
    def submit_store(self, job: TransferJob) -> asyncio.Future[JobResult]:
        """Queue a cascade (primary rows ``job.block_ids`` → this tier); returns its future.

        The rows stay pinned by the coordinator until the job's result is collected. A full
        queue, or a degraded tier (:attr:`degraded`: the cascade is skipped,
        ``counters["degraded_skipped_blocks"]``), answers at once with a failed result.

        Raises:
            TierUnavailableError: the tier is not running.
        """
        return self._jobs.submit(job)

    def submit_load(self, job: TransferJob) -> asyncio.Future[JobResult]:
        """Queue a promotion (this tier → reserved primary rows); returns its future.

        Raises:
            TierUnavailableError: the tier is not running.
        """
        return self._jobs.submit(job)

    def get_finished_jobs(self) -> list[JobResult]:
        """Every job result finished since the last call (single consumer)."""
        return self._jobs.finished()

    def lookup(self, key: bytes, ctx: ReqContext) -> LookupResult:
        """``HIT``/``MISS`` from the cached probe verdict, ``RETRY`` while the probe is pending
        (vLLM's ``async_lookup.py``): probes are batched per step and run after
        :meth:`on_schedule_end`; verdicts are kept while an interested request lives."""
        return self._lookup.lookup(key, ctx)

    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        """Offload policy for a new request (BLOCK_LEVEL)."""
        return RequestOffloadingContext()

    def on_request_finished(self, ctx: ReqContext) -> None:
        """Forget the request's cached lookup verdicts."""
        self._lookup.cleanup(ctx.req_id)

    def on_schedule_end(self, ctx: ScheduleEndContext) -> None:
        """Flush the step's batch of lookup probes to the actor."""
        self._lookup.flush()

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Stored/removed events of this tier since the last call (:attr:`event_queue`)."""
        return self._jobs.take_events()

    @property
    def event_queue(self) -> EventQueue:
        """The tier's queue of stored/removed events: bounded; off (``enabled`` False) in a
        cascade built from a config with ``enable_events=False``
        (:func:`kvcascade.build_coordinator`, :mod:`kvcascade._event_queue`)."""
        return self._jobs.events

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Probe the existence of ``keys`` now (for asyncio callers), as a load-priority call
        with the deadline ``probe_timeout_s``.

        A probe that fails or passes its deadline answers MISS for every key (failures
        counted in ``counters["probe_failures"]``, the first warned, later ones logged at debug
        level); a degraded tier (:attr:`degraded`) answers MISS without a request
        (``counters["degraded_probes"]``).
        """
        return await self._jobs.probe(keys)

    async def invalidate(self, keys: Sequence[bytes]) -> int:
        """Delete ``keys``' blocks from this tier now (an operator's or embedder's removal of
        blocks that must not be served again), as a load-priority call.

        Returns how many of them were present. Their cached lookup verdicts become MISS and a
        removal event is queued.

        Raises:
            NotImplementedError: the tier cannot remove blocks (:meth:`_remove`).
            TierUnavailableError: the tier is not running.
            DeadlineExceededError: the removal did not finish within ``io_timeout_s``.
            OSError / TransferError: a block could not be deleted (the tier's own error).
        """
        keys = list(dict.fromkeys(keys))
        if not keys:
            return 0
        present = await self._call_blocking(self._remove, keys)
        self._lookup.mark_miss(keys)
        gone = [k for k, was in zip(keys, present) if was]
        if gone:
            self._announce_removed(gone)
        return len(gone)


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
            succeeded (job order), ``reported`` when every failure was, and as its cause the
            first failure that is not a block found missing
            (:class:`~kvcascade.tiers._backend.NotFoundError`), else the first one, so that a
            fault is not logged as the miss of a block beside it.
        the first failure itself when it is not a kvcascade error (a bug, not an I/O fault).
    """
    results = await asyncio.gather(
        *(mover(k, r) for k, r in zip(keys, rows, strict=True)), return_exceptions=True
    )
    failed = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
    if not failed:
        return sum(r for r in results if isinstance(r, int))
    i, first = next(((j, r) for j, r in failed if not isinstance(r, NotFoundError)), failed[0])
    if not isinstance(first, KVCascadeError):
        raise first
    bad = {j for j, _ in failed}
    succeeded = [k for j, k in enumerate(keys) if j not in bad]
    reported = all(isinstance(r, TransferError) and r.reported for _, r in failed)
    raise TransferError(
        f"{what} of block {i} failed: {first}", succeeded, reported=reported
    ) from first
