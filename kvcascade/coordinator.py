"""The tiering coordinator: scheduler hooks → store cascades and promotions (spec §3.4–3.9).

:class:`TieringCoordinator` keeps vLLM's ``TieringOffloadingManager`` semantics for a synchronous
caller: lookups consult the primary tier, then each secondary tier in order, and start a
promotion (a primary slot reserved at once, ``HIT_PENDING``); promotions are flushed as one load
job per (tier, request) at schedule end; ``complete_store`` fans the stored keys out to every
secondary tier with one read pin per tier; finished jobs are observed only at poll points, once
per step. Tier actors resolve each job's future; the synchronous façade collects what is done.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

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
from .index.cpu import CPUOffloadingManager
from .tiers.base import SecondaryTier

log = logging.getLogger(__name__)


@dataclass
class _RequestState:
    ctx: ReqContext
    pending_primary_stores: int = 0
    is_finished: bool = False
    request_level_tiers: set[int] = field(default_factory=set)


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

    All methods run on the event-loop thread that runs the tiers' actors and never block.
    """

    def __init__(self, primary: CPUOffloadingManager, tiers: Sequence[SecondaryTier]) -> None:
        self.primary = primary
        self.tiers = list(tiers)
        self._job_counter = 0
        self._jobs: dict[int, tuple[TransferJob, int, asyncio.Future[JobResult]]] = {}
        self._pending_promotions: list[dict[str, _PendingPromotion]] = [{} for _ in self.tiers]
        self._polled_this_step = False
        self._req_state: dict[str, _RequestState] = {}
        self.counters: collections.Counter[str] = collections.Counter()

    # -- polling -----------------------------------------------------------------------------
    def _poll(self, force: bool = False) -> None:
        """Apply finished tier jobs (gated: once per step unless ``force``), spec §3.5."""
        if self._polled_this_step and not force:
            return
        self._polled_this_step = True
        for tier in self.tiers:
            for result in tier.get_finished_jobs():
                self._apply(result)

    def _apply(self, result: JobResult) -> None:
        entry = self._jobs.pop(result.job_id, None)
        if entry is None:
            return  # a job from before reset_cache
        job, tier_idx, _ = entry
        name = self.tiers[tier_idx].name
        if not job.is_promotion:
            self.primary.complete_load(job.keys)
            if result.success:
                self.counters[f"cascade_bytes:{name}"] += result.transfer_size
            else:
                self.counters[f"cascade_failures:{name}"] += 1
            return
        ok = job.keys if result.success else list(result.successful_keys or ())
        if ok:
            self.primary.complete_store(ok, job.req_context, success=True)
        if not result.success:
            self.counters[f"promotion_failures:{name}"] += 1
            done = set(ok)
            self.primary.complete_store(
                [k for k in job.keys if k not in done], job.req_context, success=False
            )
        self.counters[f"promotion_bytes:{name}"] += result.transfer_size
        self.counters[f"promoted_blocks:{name}"] += len(ok)

    # -- lookups and promotion ------------------------------------------------------------
    def lookup(
        self,
        key: bytes,
        ctx: ReqContext,
        *,
        verdicts: dict[int, bool] | None = None,
    ) -> LookupResult:
        """Where ``key`` is readable from (spec §3.6).

        Primary ``HIT``/``HIT_PENDING`` first; then each secondary tier in order: a ``HIT``
        reserves a primary slot and queues a promotion (``HIT_PENDING``), or answers ``MISS``
        when the primary is full; a ``RETRY`` anywhere (probe pending) answers ``RETRY``.
        ``verdicts`` (tier index → found) replaces the tiers' cached probes for asyncio callers.
        """
        self._poll()
        result = self.primary.lookup(key, ctx)
        if result is not LookupResult.MISS:
            return result
        retry = False
        for idx, tier in enumerate(self.tiers):
            if verdicts is not None:
                found = verdicts.get(idx)
                tier_result = (
                    LookupResult.RETRY
                    if found is None
                    else LookupResult.HIT
                    if found
                    else LookupResult.MISS
                )
            else:
                tier_result = tier.lookup(key, ctx)
            if tier_result is LookupResult.HIT:
                return (
                    LookupResult.HIT_PENDING
                    if self._initiate_promotion(idx, key, ctx)
                    else LookupResult.MISS
                )
            retry |= tier_result is LookupResult.RETRY
        return LookupResult.RETRY if retry else LookupResult.MISS

    def _initiate_promotion(self, tier_idx: int, key: bytes, ctx: ReqContext) -> bool:
        out = self.primary.prepare_store([key], ctx)
        if out is None:
            self.counters["promotion_allocation_failures"] += 1
            return False
        pending = self._pending_promotions[tier_idx].setdefault(ctx.req_id, _PendingPromotion(ctx))
        pending.keys.extend(out.keys_to_store)
        pending.slots.extend(int(s) for s in out.store_spec.block_ids)  # type: ignore[attr-defined]
        return True

    def _flush_pending_promotions(self) -> list[asyncio.Future[JobResult]]:
        futures = []
        for idx, per_req in enumerate(self._pending_promotions):
            for pending in per_req.values():
                job = TransferJob(
                    self._next_job_id(),
                    pending.keys,
                    np.asarray(pending.slots, dtype=np.int64),
                    is_promotion=True,
                    req_context=pending.ctx,
                )
                futures.append(self._submit(idx, job))
            per_req.clear()
        return futures

    def _next_job_id(self) -> int:
        job_id = self._job_counter
        self._job_counter += 1
        return job_id

    def _submit(self, tier_idx: int, job: TransferJob) -> asyncio.Future[JobResult]:
        tier = self.tiers[tier_idx]
        fut = tier.submit_load(job) if job.is_promotion else tier.submit_store(job)
        self._jobs[job.job_id] = (job, tier_idx, fut)
        return fut

    # -- loads ---------------------------------------------------------------------------
    def prepare_load(self, keys: Collection[bytes], ctx: ReqContext) -> CPULoadStoreSpec:
        """Pin ``keys`` in the primary tier (each was ``HIT`` this step); their slots in order."""
        return self.primary.prepare_load(keys, ctx)

    def complete_load(self, keys: Collection[bytes], ctx: ReqContext) -> None:
        """Unpin ``keys`` after the primary→GPU copy."""
        self.primary.complete_load(keys, ctx)

    def touch(self, keys: Collection[bytes], ctx: ReqContext | None = None) -> None:
        """Recency: the primary tier, then every secondary tier (spec §3.8)."""
        self.primary.touch(keys, ctx)
        for tier in self.tiers:
            tier.touch(keys)

    # -- stores and cascade ------------------------------------------------------------------
    def prepare_store(self, keys: Collection[bytes], ctx: ReqContext) -> PrepareStoreOutput | None:
        """Allocate primary slots for a GPU→CPU store (spec §3.7); None when full."""
        self._poll()
        out = self.primary.prepare_store(keys, ctx)
        if out is None:
            return None
        if out.keys_to_store:
            self._state(ctx).pending_primary_stores += 1
        return out

    def complete_store(
        self, keys: Collection[bytes], ctx: ReqContext, success: bool = True
    ) -> None:
        """Finish a GPU→CPU store; on success cascade ``keys`` to every secondary tier.

        Each tier's store job pins the keys once (ref count = number of tiers) until the job is
        observed finished. A failed store never cascades.
        """
        self.primary.complete_store(keys, ctx, success=success)
        if success and keys:
            for idx in range(len(self.tiers)):
                self.cascade(keys, ctx, idx)
        state = self._req_state.get(ctx.req_id)
        if state is not None and state.pending_primary_stores > 0:
            state.pending_primary_stores -= 1
            self._maybe_finalize(state)

    def cascade(
        self, keys: Collection[bytes], ctx: ReqContext, tier_idx: int
    ) -> asyncio.Future[JobResult]:
        """Pin ``keys`` (present and ready in the primary tier) and store them to one tier."""
        keys = list(keys)
        spec = self.primary.prepare_load(keys, ctx)
        job = TransferJob(self._next_job_id(), keys, spec.block_ids, False, ctx)
        return self._submit(tier_idx, job)

    # -- request lifecycle ---------------------------------------------------------------
    def _state(self, ctx: ReqContext) -> _RequestState:
        state = self._req_state.get(ctx.req_id)
        if state is None:
            state = self._req_state[ctx.req_id] = _RequestState(ctx)
        return state

    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        """First sight of a request; REQUEST_LEVEL if any tier asks for it (spec §3.9)."""
        state = self._state(ctx)
        for idx, tier in enumerate(self.tiers):
            if tier.on_new_request(ctx).policy is OffloadPolicy.REQUEST_LEVEL:
                state.request_level_tiers.add(idx)
        policy = (
            OffloadPolicy.REQUEST_LEVEL if state.request_level_tiers else OffloadPolicy.BLOCK_LEVEL
        )
        return RequestOffloadingContext(policy)

    def on_request_finished(self, ctx: ReqContext) -> None:
        """No more submits for this request; tiers hear of it once its stores are done."""
        self.primary.on_request_finished(ctx)
        state = self._state(ctx)
        state.is_finished = True
        self._maybe_finalize(state)

    def _maybe_finalize(self, state: _RequestState) -> None:
        if state.is_finished and state.pending_primary_stores == 0:
            for tier in self.tiers:
                tier.on_request_finished(state.ctx)
            del self._req_state[state.ctx.req_id]

    # -- step ------------------------------------------------------------------------------
    def on_schedule_end(
        self, ctx: ScheduleEndContext | None = None
    ) -> list[asyncio.Future[JobResult]]:
        """Once per step (spec §3.8): poll, reset the gate, flush promotions, flush probes.

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
        """True while any primary↔secondary job is in flight or a tier reports work."""
        return bool(self._jobs) or any(t.has_pending_work() for t in self.tiers)

    def job_futures(
        self, *, promotions: bool | None = None, keys: Collection[bytes] | None = None
    ) -> list[asyncio.Future[JobResult]]:
        """Futures of the jobs in flight: all, only promotions or only cascades (``promotions``),
        optionally only those touching one of ``keys``."""
        wanted = None if keys is None else set(keys)
        return [
            fut
            for job, _, fut in self._jobs.values()
            if (promotions is None or job.is_promotion == promotions)
            and (wanted is None or not wanted.isdisjoint(job.keys))
        ]

    def poll_now(self) -> None:
        """Apply every finished job now, outside the once-per-step gate (asyncio callers)."""
        self._poll(force=True)

    def take_events(self) -> Iterator[OffloadingEvent]:
        """Primary events, then each tier's, in tier order (spec §3.8)."""
        events: list[OffloadingEvent] = list(self.primary.take_events())
        for tier in self.tiers:
            events.extend(tier.take_events())
        return iter(events)

    async def reset_cache(self) -> None:
        """Drain every tier, apply results, drop unsubmitted promotions, reset the primary.

        Order of spec §3.9. Secondary tiers keep their data.
        """
        for tier in self.tiers:
            await tier.drain()
        self._poll(force=True)
        for per_req in self._pending_promotions:
            per_req.clear()
        for state in list(self._req_state.values()):
            state.pending_primary_stores = 0
            self._maybe_finalize(state)
        self.primary.reset_cache()
        self._polled_this_step = False

    def tier_names(self) -> Iterable[str]:
        """Names of the secondary tiers in cascade order."""
        return (t.name for t in self.tiers)
