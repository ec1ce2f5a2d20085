"""The tiering coordinator: scheduler hooks → store cascades and promotions.

After vLLM's ``vllm/v1/kv_offload/tiering/manager.py``; see docs/coordinator.md.

:class:`TieringCoordinator` keeps vLLM's ``TieringOffloadingManager`` semantics for a synchronous
caller: lookups consult the primary tier, then each secondary tier in order, and start a
promotion (a primary slot reserved at once, ``HIT_PENDING``); promotions are flushed as one load
job per (tier, request) at schedule end; ``complete_store`` fans the stored keys out to every
secondary tier with one read pin per tier; finished jobs are observed only at poll points, once
per step, so eviction decisions stay deterministic. Tier actors resolve each job's future; the
synchronous façade only collects what is done — nothing polls in a loop.

Divergences from vLLM, each closing a known fault (docs/coordinator.md):

* A primary ``HIT`` pins the block for the asking request (once per request and key) until
  ``prepare_load`` takes the pin over or the request finishes, so a block found by ``lookup``
  cannot be evicted by another request before ``prepare_load``; ``prepare_load`` of a key that is
  not readable raises :class:`BlockUnavailableError` (typed, nothing pinned) instead of asserting.
* A primary write (GPU→CPU store or promotion) still not ready ``pending_write_timeout_s`` after
  it started is failed at the next poll point: its key becomes a miss (no request waits forever
  on ``HIT_PENDING``, vLLM #49829) and its slot is quarantined until the late writer reports, so
  a late write can never land in a slot reused by another key.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from ._errors import BlockUnavailableError, TierUnavailableError
from ._keys import check_offload_key
from ._pending_writes import PendingWrites
from ._prefix_walk import walk_prefix
from ._types import (
    CPULoadStoreSpec,
    JobResult,
    LookupResult,
    OffloadingEvent,
    OffloadPolicy,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    TransferJob,
)
from .backpressure import CascadeAdmission
from .hints import admits_new_blocks, may_continue
from .index.cpu import CPUOffloadingManager
from .metrics import TieringMetrics
from .tiers.base import SecondaryTier

log = logging.getLogger(__name__)

_HIT = LookupResult.HIT
_MISS = LookupResult.MISS
_PENDING = LookupResult.HIT_PENDING
_RETRY = LookupResult.RETRY


@dataclass
class _RequestState:
    ctx: ReqContext
    pending_primary_stores: int = 0
    is_finished: bool = False
    request_level_tiers: set[int] = field(default_factory=set)
    # Keys this request holds one read pin on (taken by ``lookup`` or by a landed promotion),
    # in the order taken: released in that order, so eviction order never depends on hashing.
    lookup_pins: dict[bytes, None] = field(default_factory=dict)
    # Keys offered for the request-level tiers while another writer still wrote them: sent
    # once that write lands (dropped if it fails).
    awaiting_writes: dict[bytes, None] = field(default_factory=dict)


@dataclass
class PrefixLookup:
    """The leading keys available in some tier, and where each one comes from.

    ``tiers[i]`` is ``"cpu"`` for a primary-tier hit or the secondary tier's name for a block
    being promoted from it.
    """

    keys: list[bytes] = field(default_factory=list)
    tiers: list[str] = field(default_factory=list)

    @property
    def num_hits(self) -> int:
        """Number of leading keys available."""
        return len(self.keys)


@dataclass
class _PendingPromotion:
    ctx: ReqContext
    keys: list[bytes] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)


class TieringCoordinator:
    """Synchronous hooks over a primary tier and ordered secondary tiers.

    Args:
        primary: bookkeeping of the CPU primary tier.
        tiers: secondary tiers in cascade order (may be empty: then it behaves like the primary).
        pending_write_timeout_s: a primary write not ready after this many seconds is failed
            (None: never).
        registry: Prometheus registry for :attr:`metrics` (default: a private one).

    Attributes:
        writes: the primary writes in flight and the quarantined slots
            (:class:`~kvcascade._pending_writes.PendingWrites`).

    All methods run on the event-loop thread that runs the tiers' actors and never block; the
    awaitable front's :meth:`lookup_prefix` and :meth:`reset_cache` are coroutines. The
    coordinator alone says which keys are readable (:meth:`readable_prefix`) and which writes
    are in flight (:attr:`writes`, :meth:`write_futures`).
    """

    def __init__(
        self,
        primary: CPUOffloadingManager,
        tiers: Sequence[SecondaryTier],
        *,
        pending_write_timeout_s: float | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.primary = primary
        self.tiers = list(tiers)
        self.metrics = TieringMetrics([t.name for t in self.tiers], registry)
        self.metrics.primary_write_usage.set_function(lambda: self._primary_usage(False))
        self.metrics.primary_read_usage.set_function(lambda: self._primary_usage(True))
        for idx, tier in enumerate(self.tiers):
            gauge = self.metrics.tier_degraded.labels(self.metrics.tier_label(idx))
            gauge.set_function(lambda tier=tier: float(tier.degraded))
        self.admission = CascadeAdmission(self.tiers, primary.num_blocks, self.metrics)
        self._job_counter = 0
        self._jobs: dict[int, tuple[TransferJob, int, asyncio.Future[JobResult]]] = {}
        self._pending_promotions: list[dict[str, _PendingPromotion]] = [{} for _ in self.tiers]
        self._polled_this_step = False
        # The latest use of each request id; a finished one stays until its stores are done.
        self._req_state: dict[str, _RequestState] = {}
        # Finished uses of an id that a new use replaced while their stores were in flight
        # (oldest first): a completing store is theirs first (_storing_state).
        self._finishing: dict[str, list[_RequestState]] = {}
        self.writes = PendingWrites(primary, pending_write_timeout_s)
        # Keys still being written → the requests waiting to send them to request-level tiers.
        self._awaiting: dict[bytes, list[_RequestState]] = {}
        self._event_signal: asyncio.Event | None = None
        self._closed = False
        self._stopped_tiers: set[int] = set()  # tiers found not running (logged once each)

    @property
    def pending_write_timeout_s(self) -> float | None:
        """Seconds after which a primary write still in flight is failed (None: never)."""
        return self.writes.timeout_s

    @pending_write_timeout_s.setter
    def pending_write_timeout_s(self, value: float | None) -> None:
        self.writes.timeout_s = value

    # -- polling -----------------------------------------------------------------------------
    def _poll(self, force: bool = False) -> None:
        """Apply finished tier jobs (gated: once per step unless ``force``), as vLLM's
        ``_maybe_process_finished_jobs``."""
        if self._polled_this_step and not force:
            return
        self._polled_this_step = True
        for tier in self.tiers:
            for result in tier.get_finished_jobs():
                try:
                    self._apply(result)
                except Exception:  # a broken invariant must not surface in the polling caller
                    log.exception("kvcascade: applying the result of job %d failed", result.job_id)
        self._expire_writes()

    def _primary_usage(self, reading: bool) -> float:
        """Fraction of primary slots being written (``reading=False``) or pinned by reads, read
        live at every scrape."""
        primary = self.primary
        n = primary.num_blocks
        if not n:
            return 0.0
        writing = primary.num_write_pending
        if not reading:
            return writing / n
        return max(n - primary.num_free - primary.num_evictable - writing, 0) / n

    def poll_now(self) -> None:
        """Apply every finished job now, outside the once-per-step gate (asyncio callers)."""
        self._poll(force=True)

    def _apply(self, result: JobResult) -> None:
        if result.released:
            self.writes.release(result.job_id)
            return
        entry = self._jobs.pop(result.job_id, None)
        if entry is None:
            return  # a job from before reset_cache
        job, tier_idx, _ = entry
        metrics = self.metrics
        label = metrics.tier_label(tier_idx)
        if not job.is_promotion:
            self.admission.finished(tier_idx, len(job.keys))
        if result.abandoned:
            self._abandon(job, label)
            return
        if not job.is_promotion:
            metrics.series(metrics.active_cascade_jobs, label).dec()
            self.primary.complete_load(job.keys)
            if result.success:
                metrics.series(metrics.write_bytes, label).inc(result.transfer_size)
                metrics.series(metrics.write_seconds, label).observe(result.transfer_time)
            else:
                metrics.series(metrics.cascade_job_failures, label).inc()
            return
        metrics.series(metrics.active_promotion_jobs, label).dec()
        ok = list(job.keys) if result.success else list(result.successful_keys or ())
        ok = [k for k in ok if self.writes.finish(k, job.job_id)]
        failed = [k for k in job.keys if k not in set(ok) and self.writes.finish(k, job.job_id)]
        if ok:
            self.primary.complete_store(ok, job.req_context, success=True)
            self._hold_for_reader(ok, job.req_context)
        if failed:
            self.primary.complete_store(failed, job.req_context, success=False)
        self._send_awaited_writes([*ok, *failed])
        if not result.success:
            metrics.series(metrics.promotion_job_failures, label).inc()
        metrics.series(metrics.read_bytes, label).inc(result.transfer_size)
        metrics.series(metrics.read_seconds, label).observe(result.transfer_time)

    def _hold_for_reader(self, keys: Sequence[bytes], ctx: ReqContext | None) -> None:
        """A promotion landed: pin its blocks for the request that asked for them until it reads
        them (``prepare_load`` takes the pin over) or finishes, so another request's promotions
        cannot evict them first (vLLM #49902)."""
        state = self._req_state.get(ctx.req_id) if ctx is not None else None
        if state is None or state.is_finished:
            return
        fresh = [k for k in dict.fromkeys(keys) if k not in state.lookup_pins]
        fresh = [k for k in fresh if (b := self.primary.get_block(k)) is not None and b.is_ready]
        if fresh:
            self.primary.prepare_read(fresh, ctx)
            state.lookup_pins.update(dict.fromkeys(fresh))

    def _abandon(self, job: TransferJob, label: str) -> None:
        """A job failed at its deadline while its thread may still touch its primary rows: a
        cascade keeps its read pins, a promotion's keys become misses with their slots
        quarantined, until the tier reports that the thread returned."""
        metrics = self.metrics
        if job.is_promotion:
            metrics.series(metrics.active_promotion_jobs, label).dec()
            metrics.series(metrics.promotion_job_failures, label).inc()
            written = [k for k in job.keys if self.writes.finish(k, job.job_id)]
            self.writes.abandon(job.job_id, [], written)
        else:
            metrics.series(metrics.active_cascade_jobs, label).dec()
            metrics.series(metrics.cascade_job_failures, label).inc()
            self.writes.abandon(job.job_id, job.keys, [])

    def _expire_writes(self) -> None:
        """Fail the primary writes past ``pending_write_timeout_s`` (their keys become misses)."""
        late, quarantined = self.writes.expire()
        if quarantined:
            self.metrics.expired_writes.inc(quarantined)
            log.warning(
                "%d write(s) into the primary tier passed their deadline; the keys are now misses",
                quarantined,
            )
        self._send_awaited_writes(late)

    # -- lookups and promotion ------------------------------------------------------------
    def lookup(
        self,
        key: bytes,
        ctx: ReqContext,
        *,
        verdicts: dict[int, bool] | None = None,
    ) -> LookupResult:
        """Where ``key`` is readable from (vLLM's ``lookup`` in ``kv_offload/tiering/manager.py``).

        Primary ``HIT`` (pinned for ``ctx``'s request, see the module docstring) or
        ``HIT_PENDING`` first; then each secondary tier allowed, in order: a ``HIT`` reserves a
        primary slot and queues a promotion (``HIT_PENDING``), or answers ``MISS`` when the
        primary is full; a ``RETRY`` anywhere (probe pending) answers ``RETRY``.
        ``verdicts`` (tier index → found) replaces the tiers' cached probes for asyncio callers.

        Raises:
            TypeError, ValueError: ``key`` is not an offload key
                (:func:`kvcascade._keys.check_offload_key`), before anything changes; it would
                fail the probe job it shares with other requests' keys.
        """
        check_offload_key(key)
        self._poll()
        metrics = self.metrics
        metrics.series(metrics.block_queries, "0:primary").inc()
        result = self.primary.lookup(key, ctx)
        if result is _HIT:
            metrics.series(metrics.block_hits, "0:primary").inc()
            state = self._state(ctx)
            if key not in state.lookup_pins:
                self.primary.prepare_read([key], ctx)
                state.lookup_pins[key] = None
            return _HIT
        if result is _PENDING:
            return _PENDING
        retry = False
        for idx, tier in enumerate(self.tiers):
            if verdicts is not None:
                found = verdicts.get(idx)
                tier_result = _RETRY if found is None else _HIT if found else _MISS
            else:
                tier_result = tier.lookup(key, ctx)
            label = metrics.labels[idx + 1]
            if tier_result is not _RETRY:
                metrics.series(metrics.block_queries, label).inc()
            if tier_result is _HIT:
                metrics.series(metrics.block_hits, label).inc()
                return _PENDING if self._initiate_promotion(idx, key, ctx) else _MISS
            retry |= tier_result is _RETRY
        return _RETRY if retry else _MISS

    async def lookup_prefix(self, keys: Sequence[bytes], ctx: ReqContext) -> PrefixLookup:
        """The longest prefix of ``keys`` readable from some tier, awaiting the secondary
        tiers' probes instead of answering ``RETRY`` (the walk of ``Cascade.lookup_prefix``).

        Keys absent from the primary are probed in one batch per tier
        (:meth:`SecondaryTier.contains`); then the prefix walk of both fronts
        (:func:`~kvcascade._prefix_walk.walk_prefix`) takes each key in order through
        :meth:`lookup` with those verdicts (primary hits pinned, secondary hits promoted), and
        the first miss ends the prefix. A key evicted from the primary since the batch probe
        (an earlier key's promotion took its slot) stops the walk: it is probed on its own and
        the walk goes on from it, instead of calling it a miss. A key's source is ``"cpu"``, or
        the tier its promotion reads from (:meth:`_promotion_source`). An asyncio caller has no
        steps: the finished jobs are applied first (:meth:`poll_now`), so the slots of
        promotions that landed for requests finished unread are evictable again.
        """
        self.poll_now()
        found = await self._probe_tiers([k for k in keys if self.primary.get_block(k) is None])
        out = PrefixLookup()
        rest = list(keys)
        while True:
            walk = walk_prefix(
                rest,
                lambda key: self.lookup(key, ctx, verdicts=found.get(key, {})),
                lambda key: (
                    len(found.get(key, ())) < len(self.tiers)
                    and self.primary.get_block(key) is None
                ),
            )
            for key, result in zip(rest, walk.results):
                out.keys.append(key)
                pending = result is _PENDING
                out.tiers.append((self._promotion_source(key) if pending else None) or "cpu")
            if walk.probe is None:
                return out
            rest = rest[len(walk.results) :]
            found.update(await self._probe_tiers([walk.probe]))

    async def _probe_tiers(self, keys: list[bytes]) -> dict[bytes, dict[int, bool]]:
        """Each key's existence in each secondary tier (tier index → found), one
        :meth:`SecondaryTier.contains` per tier."""
        found: dict[bytes, dict[int, bool]] = {key: {} for key in keys}
        if keys:
            for idx, tier in enumerate(self.tiers):
                for key, answer in zip(keys, await tier.contains(keys)):
                    found[key][idx] = answer
        return found

    def _initiate_promotion(self, tier_idx: int, key: bytes, ctx: ReqContext) -> bool:
        out = self.primary.prepare_store([key], ctx)
        if out is None:
            self.metrics.promotion_allocation_failures.inc()
            return False
        self._state(ctx)  # the landed promotion is held for this request (_hold_for_reader)
        pending = self._pending_promotions[tier_idx].setdefault(ctx.req_id, _PendingPromotion(ctx))
        pending.keys.extend(out.keys_to_store)
        pending.slots.extend(int(s) for s in out.store_spec.block_ids)  # type: ignore[attr-defined]
        return True

    def _flush_pending_promotions(
        self, req_id: str | None = None
    ) -> list[asyncio.Future[JobResult]]:
        """Submit the queued promotions (of every request, or of ``req_id`` only)."""
        futures = []
        for idx, per_req in enumerate(self._pending_promotions):
            if req_id is not None:
                own = per_req.pop(req_id, None)
                queued = [own] if own is not None else []
            else:
                queued = list(per_req.values())
                per_req.clear()
            for pending in queued:
                job = TransferJob(
                    self._next_job_id(),
                    pending.keys,
                    np.asarray(pending.slots, dtype=np.int64),
                    is_promotion=True,
                    req_context=pending.ctx,
                )
                self.writes.start(job.keys, pending.ctx.req_id, job.job_id)
                futures.append(self._submit(idx, job))
        return futures

    def _next_job_id(self) -> int:
        job_id = self._job_counter
        self._job_counter += 1
        return job_id

    def _submit(self, tier_idx: int, job: TransferJob) -> asyncio.Future[JobResult]:
        tier = self.tiers[tier_idx]
        metrics = self.metrics
        label = metrics.tier_label(tier_idx)
        if job.is_promotion:
            fut = tier.submit_load(job)
            metrics.series(metrics.active_promotion_jobs, label).inc()
        else:
            fut = tier.submit_store(job)
            metrics.series(metrics.active_cascade_jobs, label).inc()
        self._jobs[job.job_id] = (job, tier_idx, fut)
        fut.add_done_callback(self._signal_events)
        return fut

    # -- loads ---------------------------------------------------------------------------
    def prepare_load(self, keys: Collection[bytes], ctx: ReqContext) -> CPULoadStoreSpec:
        """Pin ``keys`` for a primary→GPU copy; their slots in order. The keys count as the
        request's reads (:meth:`CPUOffloadingManager.prepare_load`), pinned by its ``lookup`` or
        not.

        A pin taken by this request's ``lookup`` is taken over, not doubled.

        Raises:
            BlockUnavailableError: a key is not readable now; nothing was pinned.
        """
        state = self._req_state.get(ctx.req_id)
        pins = state.lookup_pins if state is not None else {}
        missing = [
            k
            for k in keys
            if k not in pins and ((b := self.primary.get_block(k)) is None or not b.is_ready)
        ]
        if missing:
            raise BlockUnavailableError(missing)
        spec = self.primary.prepare_load(keys, ctx)
        # One pin per use: a key given twice takes the lookup's pin over once.
        taken = [key for key in dict.fromkeys(keys) if key in pins]
        for key in taken:
            del pins[key]
        if taken:
            self.primary.complete_load(taken, ctx)
        return spec

    def complete_load(self, keys: Collection[bytes], ctx: ReqContext) -> None:
        """Unpin ``keys`` after the primary→GPU copy."""
        self.primary.complete_load(keys, ctx)

    def readable_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are present and written in the primary tier now."""
        for i, key in enumerate(keys):
            block = self.primary.get_block(key)
            if block is None or not block.is_ready:
                return i
        return len(keys)

    def write_futures(self, keys: Collection[bytes]) -> list[asyncio.Future[Any]]:
        """Futures of every write into the primary tier that ``keys`` wait for — promotion jobs
        and GPU→CPU stores, of any request — done once each write was reported (apply the
        promotions' results with :meth:`poll_now`). Call on the running loop."""
        writers = self.writes.writers(keys)
        stores = writers.pop(None, [])
        futures: list[asyncio.Future[Any]] = [
            entry[2] for job_id in writers if (entry := self._jobs.get(job_id)) is not None
        ]
        return futures + self.writes.waiters(stores)

    def touch(self, keys: Collection[bytes], ctx: ReqContext | None = None) -> None:
        """Recency: the primary tier, then every secondary tier (as vLLM's ``touch``)."""
        self.primary.touch(keys, ctx)
        for tier in self.tiers:
            tier.touch(keys)

    # -- stores and cascade ------------------------------------------------------------------
    def _admits_new_blocks(self, ctx: ReqContext, n: int) -> bool:
        """Whether the request of ``ctx`` may store ``n`` new blocks.

        Without secondary tiers the primary's policy decides
        (:func:`kvcascade.hints.admits_new_blocks`: ``turn_aware``'s admission control, or the
        hint rule ``continues=False`` of LRU and ARC). With secondary tiers only the hint rule
        (:func:`kvcascade.hints.may_continue`): every store reaches them through the primary,
        so a refusal by the primary's policy, which judges only whether the CPU tier should
        keep the blocks, would keep them from every tier (``kvcascade replay``'s fs tier: prefix
        hit ratio 0.3282 instead of the trace's 0.3664 once ``adaptive`` used it).
        """
        if self.tiers:
            return may_continue(ctx)
        return admits_new_blocks(ctx, self.primary.policy, n)

    def prepare_store(self, keys: Collection[bytes], ctx: ReqContext) -> PrepareStoreOutput | None:
        """Allocate primary slots for a GPU→CPU store (vLLM's ``prepare_store``); None when full.

        For a request with request-level tiers, keys already readable in the primary are sent
        to those tiers now (one store job per tier); keys another writer is still writing are
        sent once that write lands, and the request is finalized only after. Nothing new
        is stored when the request is refused (:meth:`_admits_new_blocks`).

        Raises:
            TypeError, ValueError: a key is not an offload key
                (:func:`kvcascade._keys.check_offload_key`), before anything changes.
        """
        for key in keys:
            check_offload_key(key)
        self._poll()
        new = sum(1 for k in keys if self.primary.get_block(k) is None)
        if not self._admits_new_blocks(ctx, new):
            return PrepareStoreOutput([], CPULoadStoreSpec([]), [])
        out = self.primary.prepare_store(keys, ctx)
        if out is None:
            return None
        state = self._state(ctx)
        if out.keys_to_store:
            state.pending_primary_stores += 1
            self.writes.start(out.keys_to_store, ctx.req_id, None)
        if state.request_level_tiers:
            new = set(out.keys_to_store)
            ready = []
            for k in dict.fromkeys(keys):
                block = self.primary.get_block(k)
                if k in new or block is None:
                    continue
                if block.is_ready:
                    ready.append(k)
                elif k not in state.awaiting_writes:
                    state.awaiting_writes[k] = None
                    self._awaiting.setdefault(k, []).append(state)
            if ready:
                self._send_to_request_level_tiers(state, ready)
        self._signal_events()
        return out

    def storable_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` :meth:`prepare_store` can take now: their new keys fit in
        the primary's free slots plus the idle blocks that are not among them (those the store
        protects)."""
        primary = self.primary
        room = primary.num_free + primary.num_evictable
        for i, key in enumerate(keys):
            block = primary.get_block(key)
            if block is None or block.ref_cnt == 0:  # a new slot, or a protected idle block
                room -= 1
                if room < 0:
                    return i
        return len(keys)

    def _send_to_request_level_tiers(self, state: _RequestState, keys: list[bytes]) -> None:
        for idx in sorted(state.request_level_tiers):
            self.cascade(keys, state.ctx, idx)

    def _send_awaited_writes(self, keys: Collection[bytes]) -> None:
        """Writes of ``keys`` landed, failed or expired: send the ready ones to the
        request-level tiers of every request that offered them meanwhile; forget the others."""
        if not self._awaiting:
            return
        affected: dict[int, tuple[_RequestState, list[bytes]]] = {}
        for key in keys:
            for state in self._awaiting.pop(key, ()):
                del state.awaiting_writes[key]
                ready = affected.setdefault(id(state), (state, []))[1]
                block = self.primary.get_block(key)
                if block is not None and block.is_ready:
                    ready.append(key)
        for state, ready in affected.values():
            if ready:
                self._send_to_request_level_tiers(state, ready)
            self._maybe_finalize(state)

    def complete_store(
        self, keys: Collection[bytes], ctx: ReqContext, success: bool = True
    ) -> None:
        """Finish a GPU→CPU store; on success cascade ``keys`` to every secondary tier.

        Each tier's store job pins the keys once (ref count = number of tiers) until the job is
        observed finished. A failed store never cascades. A report for a write that passed
        ``pending_write_timeout_s`` is dropped (the key was already made a miss).
        """
        keys = [k for k in keys if self.writes.finish(k, None, ctx.req_id)]
        self.primary.complete_store(keys, ctx, success=success)
        if success and keys:
            ready = [k for k in keys if (b := self.primary.get_block(k)) is not None and b.is_ready]
            for idx in range(len(self.tiers)):
                self.cascade(ready, ctx, idx)
        self._send_awaited_writes(keys)
        state = self._storing_state(ctx)
        if state is not None and state.pending_primary_stores > 0:
            state.pending_primary_stores -= 1
            self._maybe_finalize(state)
        self._signal_events()

    def cascade(
        self, keys: Collection[bytes], ctx: ReqContext, tier_idx: int
    ) -> asyncio.Future[JobResult] | None:
        """Pin ``keys`` (present and ready in the primary tier) and store them to one tier;
        None when back-pressure refuses the store (:mod:`kvcascade.backpressure`: nothing is
        pinned, the drop is counted) or the tier is not running (its actor stopped: the pins
        are released, the failure is counted and logged once per tier).

        Raises:
            RuntimeError: the tier refused the submission from outside its event-loop thread
                (the pins are released first).
        """
        keys = list(keys)
        if not self.admission.admit(tier_idx, len(keys)):
            return None
        spec = self.primary.prepare_read(keys, ctx)
        job = TransferJob(self._next_job_id(), keys, spec.block_ids, False, ctx)
        try:
            return self._submit(tier_idx, job)
        except BaseException as exc:  # the pins were taken for a job that does not exist
            self.primary.complete_load(keys)
            self.admission.finished(tier_idx, len(keys))
            if not isinstance(exc, TierUnavailableError):
                raise
            metrics = self.metrics
            metrics.series(metrics.cascade_job_failures, metrics.tier_label(tier_idx)).inc()
            if tier_idx not in self._stopped_tiers:
                self._stopped_tiers.add(tier_idx)
                log.warning("kvcascade: no cascade to a tier that is not running: %s", exc)
            return None

    # -- request lifecycle ---------------------------------------------------------------
    def _state(self, ctx: ReqContext) -> _RequestState:
        """The open state of ``ctx``'s request; a new one for a new use of a finished request's
        id (or context), as the primary tier starts a new record (docs/cpu-tier.md). The
        finished use keeps its own state until its stores are done: a new use that took it
        over lost its lookup pins when the old store landed, and its slots stayed pinned."""
        state = self._req_state.get(ctx.req_id)
        if state is None or state.is_finished:
            if state is not None:
                self._finishing.setdefault(ctx.req_id, []).append(state)
            state = self._req_state[ctx.req_id] = _RequestState(ctx)
            ctx.set_state(state)  # the use this context began (on_request_finished)
        return state

    def _storing_state(self, ctx: ReqContext) -> _RequestState | None:
        """The use of ``ctx``'s request id a completing primary store belongs to: the oldest
        use begun by ``ctx`` itself that waits for a store (a new context's store was booked to
        the finished use of another, whose tiers then heard of its end before its own store
        landed; found by a break-it run); else the oldest finished use still waiting for a
        store (a context rebuilt from the id); else the latest use."""
        uses = [*self._finishing.get(ctx.req_id, ()), self._req_state.get(ctx.req_id)]
        waiting = [u for u in uses if u is not None and u.pending_primary_stores > 0]
        mine = [u for u in waiting if u.ctx is ctx]
        return (mine or waiting or [self._req_state.get(ctx.req_id)])[0]

    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        """First sight of a request; REQUEST_LEVEL if any tier asks for it (vLLM's
        ``on_new_request``)."""
        state = self._state(ctx)
        for idx, tier in enumerate(self.tiers):
            if tier.on_new_request(ctx).policy is OffloadPolicy.REQUEST_LEVEL:
                state.request_level_tiers.add(idx)
        if state.request_level_tiers:
            return RequestOffloadingContext(OffloadPolicy.REQUEST_LEVEL)
        return RequestOffloadingContext()

    def on_request_finished(self, ctx: ReqContext) -> None:
        """No more submits for this request: release its read pins and submit its queued
        promotions now (their slots are reserved; landed, they serve later requests, and a
        reservation never outlives its request — vLLM PR #52571); tiers hear of it once its
        pending stores are done. Also right for an aborted or cancelled request.
        """
        self.primary.on_request_finished(ctx)
        state = self._req_state.get(ctx.req_id)
        began = ctx.get_state(_RequestState)
        if (state is not None and state.is_finished) or (began is not None and began.is_finished):
            # Finished again (an abort after the finish): nothing is left to release, also
            # when the id has a new use by now, whose pins are not this context's to drop.
            return
        state = self._state(ctx)
        state.is_finished = True
        self.release_lookup_pins(ctx)
        self._flush_pending_promotions(ctx.req_id)
        self._maybe_finalize(state)

    def release_lookup_pins(self, ctx: ReqContext, keys: Collection[bytes] | None = None) -> None:
        """Drop the pins ``lookup`` took for ``ctx``'s request (all, or those of ``keys``)."""
        state = self._req_state.get(ctx.req_id)
        if state is None or not state.lookup_pins:
            return
        pinned = state.lookup_pins
        drop = [k for k in (pinned if keys is None else dict.fromkeys(keys)) if k in pinned]
        if drop:
            for key in drop:
                del pinned[key]
            self.primary.complete_load(drop, ctx)

    def _promotion_source(self, key: bytes) -> str | None:
        """Name of the tier a queued or in-flight promotion of ``key`` reads from, or None."""
        for idx, per_req in enumerate(self._pending_promotions):
            if any(key in p.keys for p in per_req.values()):
                return self.tiers[idx].name
        for job, idx, _ in self._jobs.values():
            if job.is_promotion and key in job.keys:
                return self.tiers[idx].name
        return None

    def _maybe_finalize(self, state: _RequestState) -> None:
        if state.is_finished and state.pending_primary_stores == 0 and not state.awaiting_writes:
            for tier in self.tiers:
                tier.on_request_finished(state.ctx)
            req_id = state.ctx.req_id
            if self._req_state.get(req_id) is state:
                del self._req_state[req_id]
            elif state in (older := self._finishing.get(req_id, [])):
                older.remove(state)
                if not older:
                    del self._finishing[req_id]

    # -- step ------------------------------------------------------------------------------
    def on_schedule_end(
        self, ctx: ScheduleEndContext | None = None
    ) -> list[asyncio.Future[JobResult]]:
        """Once per step (vLLM's ``on_schedule_end``): poll, reset the gate, flush promotions, flush
        probes.

        Returns the futures of the promotion jobs submitted now.
        """
        ctx = ctx or ScheduleEndContext()
        self._poll()
        self._polled_this_step = False
        futures = self._flush_pending_promotions()
        for tier in self.tiers:
            tier.on_schedule_end(ctx)
        return futures

    def has_pending_work(self) -> bool:
        """True while any primary↔secondary job is queued or in flight, or a tier reports work."""
        return (
            bool(self._jobs)
            or any(self._pending_promotions)
            or any(t.has_pending_work() for t in self.tiers)
        )

    def job_futures(self, *, promotions: bool | None = None) -> list[asyncio.Future[JobResult]]:
        """Futures of the jobs in flight: all, only promotions or only cascades
        (``promotions``)."""
        return [
            fut
            for job, _, fut in self._jobs.values()
            if promotions is None or job.is_promotion == promotions
        ]

    # -- events and stats ---------------------------------------------------------------------
    def take_events(self) -> Iterator[OffloadingEvent]:
        """Primary events, then each tier's, in tier order (vLLM's ``take_events``)."""
        events: list[OffloadingEvent] = list(self.primary.take_events())
        for tier in self.tiers:
            events.extend(tier.take_events())
        return iter(events)

    def _signal_events(self, _fut: Any = None) -> None:
        if self._event_signal is not None:
            self._event_signal.set()

    async def events(self) -> AsyncIterator[OffloadingEvent]:
        """The same event stream as :meth:`take_events`, as an async iterator that waits for
        new events; ends after :meth:`shutdown`, once it has yielded every event queued by
        then (a slow consumer lost those still queued at the close). Use one of the two, not
        both."""
        self._event_signal = signal = asyncio.Event()
        while True:
            signal.clear()
            closed = self._closed  # before the last take: what was queued at the close is yielded
            for event in self.take_events():
                yield event
            if closed:
                return
            await signal.wait()

    def get_stats(self) -> dict[str, float]:
        """Flat metric values: ``"<metric>:<tier label>"`` → value (:mod:`kvcascade.metrics`)."""
        out: dict[str, float] = {}
        for metric in self.metrics.registry.collect():
            for sample in metric.samples:
                tier = sample.labels.get("tier")
                out[sample.name + (f":{tier}" if tier else "")] = sample.value
        return out

    # -- reset and shutdown -----------------------------------------------------------------
    async def reset_cache(self) -> None:
        """Drain every tier, apply results, drop unsubmitted promotions, reset the primary.

        The order of vLLM's ``reset_cache`` (``kv_offload/tiering/manager.py``). Secondary tiers
        keep their data; active requests stay known with no pending stores and no pins.
        """
        for tier in self.tiers:
            await tier.drain()
        self._poll(force=True)
        for per_req in self._pending_promotions:
            per_req.clear()
        self._awaiting.clear()
        finishing = [s for states in self._finishing.values() for s in states]
        for state in [*finishing, *self._req_state.values()]:
            state.pending_primary_stores = 0
            state.lookup_pins.clear()
            state.awaiting_writes.clear()
            self._maybe_finalize(state)
        # Rows an abandoned thread or an expired writer may still touch stay out of use.
        self.primary.reset_cache(reserved=self.writes.reset())
        self._polled_this_step = False

    def shutdown(self) -> None:
        """Stop every tier actor (queued jobs fail, running ones finish); idempotent."""
        self._closed = True
        for tier in self.tiers:
            tier.close()
        self._signal_events()
