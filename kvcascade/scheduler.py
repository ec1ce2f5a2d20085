"""Scheduler-side offload rules: lookup, load jobs, store jobs, fences, touch.

The rules of vLLM's ``OffloadingConnectorScheduler``
(``vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``), method names kept.

:class:`OffloadScheduler` decides, once per engine step, which chunks a request loads from the
offload cache and which of its computed chunks are stored, and keeps the bookkeeping that makes
that safe (one load job *or* store jobs per request, store cursors, the fence index). It drives a
*manager* with the synchronous hook names of :class:`~kvcascade.coordinator.TieringCoordinator`
(:class:`OffloadManager`), so it runs over a real coordinator (on the coordinator's loop
thread, see ``kvcascade.integrations.vllm``) or over a plain fake in tests. It imports neither
vLLM nor asyncio: the engine adapter translates its own request and step objects into
:class:`RequestView` and :class:`StepInput`, and executes the :class:`StepPlan` it gets back.

Vocabulary (vLLM's ``kv_offload/base.py`` and ``offloading/scheduler.py``): a GPU *block* holds
``tokens_per_block`` tokens of one KV-cache group; a *chunk* is ``blocks_per_chunk`` (k) consecutive
blocks, the unit of the offload cache, identified by an offload key built from the request's block
hash at the chunk's last hash block. Token counts are tokens; block ids are GPU block ids (0 =
vLLM's null block).

Supported: full-attention groups and windowed groups (sliding window / chunked local attention,
window ``W`` in chunks, optional alignment count). Not supported (documented in ``docs/vllm.md``):
EAGLE/MTP draft groups, Mamba partial tails, per-request tier filters (``kv_load_tiers``) and
self-describing KV events (events are translated as placeholders).

Divergences from vLLM, each for safety:

* A finished request stores at most ``max(num_prompt_tokens, num_tokens - 1)`` tokens: the last
  sampled token never had its KV computed (vLLM 0.32 clamps the same way).
* ``prepare_load`` raising (a block became unavailable, e.g. a typed
  :class:`~kvcascade.BlockUnavailableError`) does not escape: the load job is emitted without a
  source (``cpu is None``) so the worker reports it failed and the engine recomputes.
* Transfers may fail: :meth:`OffloadScheduler.on_jobs_finished` takes the failed job ids and
  completes failed stores with ``success=False`` (vLLM's ``offloading/worker.py``
  ``get_finished`` asserts every transfer succeeded).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Protocol

from ._keys import make_offload_key, split_offload_key
from ._prefix_walk import walk_prefix
from ._types import (
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadPolicy,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)

log = logging.getLogger(__name__)

_HIT = LookupResult.HIT
_PENDING = LookupResult.HIT_PENDING
_RETRY = LookupResult.RETRY


class OffloadManager(Protocol):
    """The synchronous hooks the scheduler drives (those of ``TieringCoordinator``, vLLM's
    ``OffloadingManager`` in ``kv_offload/base.py``).

    ``reset_cache`` may return an awaitable (the coordinator's is async); the scheduler hands
    it back from :meth:`OffloadScheduler.reset_cache`, so a caller that needs the reset finished
    awaits it (the vLLM adapter runs it to completion on its loop).
    """

    def lookup(self, key: bytes, ctx: ReqContext) -> LookupResult: ...
    def prepare_load(self, keys: Collection[bytes], ctx: ReqContext) -> CPULoadStoreSpec: ...
    def touch(self, keys: Collection[bytes], ctx: ReqContext | None = None) -> None: ...
    def complete_load(self, keys: Collection[bytes], ctx: ReqContext) -> None: ...
    def prepare_store(
        self, keys: Collection[bytes], ctx: ReqContext
    ) -> PrepareStoreOutput | None: ...
    def complete_store(
        self, keys: Collection[bytes], ctx: ReqContext, success: bool = True
    ) -> None: ...
    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext: ...
    def on_request_finished(self, ctx: ReqContext) -> None: ...
    def on_schedule_end(self, ctx: ScheduleEndContext) -> Any: ...
    def has_pending_work(self) -> bool: ...
    def take_events(self) -> Iterable[OffloadingEvent]: ...
    def reset_cache(self) -> Any: ...


class RequestView(Protocol):
    """What the scheduler reads from an engine request (live values, read when needed).

    ``block_hashes`` are the request's chained hashes, one per ``tokens_per_hash`` tokens of
    complete hash blocks (raw bytes). ``finished``/``aborted`` describe the request's status.
    """

    request_id: str
    num_tokens: int
    num_prompt_tokens: int
    num_computed_tokens: int
    block_hashes: Sequence[bytes]
    kv_transfer_params: dict[str, Any] | None
    skip_reading_prefix_cache: bool
    finished: bool
    aborted: bool


@dataclass(frozen=True)
class GroupSpec:
    """One KV-cache group that is offloaded (vLLM's ``GroupOffloadConfig``).

    Attributes:
        tokens_per_block: tokens of one GPU block of this group (``> 0``).
        window_chunks: W, the chunks a windowed group needs to hit (sliding window or chunked
            local attention); None for full attention.
        alignment_chunks: A, how many of this group's chunks fit in one full-attention chunk
            (windowed groups with smaller chunks only); None when not aligned.
    """

    tokens_per_block: int
    window_chunks: int | None = None
    alignment_chunks: int | None = None


@dataclass(frozen=True)
class SchedulerConfig:
    """Static configuration of :class:`OffloadScheduler` (vLLM's ``SchedulerOffloadConfig``).

    Attributes:
        groups: offloaded groups, in KV-cache group order (index = group index in keys).
        tokens_per_hash: tokens per block hash; divides every group's ``tokens_per_block``.
        blocks_per_chunk: k, GPU blocks per chunk (``>= 1``).
        num_workers: acknowledgements needed per job (the engine's world size).
        offload_prompt_only: clamp offloadable tokens to the prompt (vLLM's default True).
        track_loading_chunks: defer a lookup whose hit range is being loaded by another request
            (only meaningful with GPU prefix caching, where the second request would then hit
            on GPU).

    Raises:
        ValueError: an inconsistent size.
    """

    groups: tuple[GroupSpec, ...]
    tokens_per_hash: int
    blocks_per_chunk: int = 1
    num_workers: int = 1
    offload_prompt_only: bool = True
    track_loading_chunks: bool = True

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("at least one KV-cache group is needed")
        if self.blocks_per_chunk < 1:
            raise ValueError(
                f"'blocks_per_chunk' must be greater than 0, got {self.blocks_per_chunk}"
            )
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        for g in self.groups:
            if g.tokens_per_block < 1 or g.tokens_per_block % self.tokens_per_hash:
                raise ValueError(
                    f"tokens_per_block={g.tokens_per_block} is not a positive multiple of "
                    f"tokens_per_hash={self.tokens_per_hash}"
                )
            if g.window_chunks is not None and g.window_chunks < 1:
                raise ValueError(f"window_chunks must be >= 1, got {g.window_chunks}")

    def tokens_per_chunk(self, group: int) -> int:
        """T, tokens of one chunk of ``group``."""
        return self.groups[group].tokens_per_block * self.blocks_per_chunk

    def hashes_per_chunk(self, group: int) -> int:
        """Block hashes spanned by one chunk of ``group``."""
        return self.tokens_per_chunk(group) // self.tokens_per_hash


@dataclass
class TransferSpec:
    """One GPU↔CPU transfer for the workers.

    ``cpu`` holds primary-tier slots (one per chunk, in key order); ``gpu`` the GPU blocks by
    group (the chunk mapping of docs/device.md). ``cpu is None`` marks a load that could not be
    prepared: the worker reports it failed without copying.
    """

    req_id: str
    cpu: CPULoadStoreSpec | None
    gpu: GPULoadStoreSpec


@dataclass
class StepPlan:
    """The scheduler's output for one step (the metadata of vLLM's ``build_connector_meta``)."""

    load_jobs: dict[int, TransferSpec] = field(default_factory=dict)
    store_jobs: dict[int, TransferSpec] = field(default_factory=dict)
    jobs_to_flush: set[int] = field(default_factory=set)


@dataclass
class ScheduledRequest:
    """One scheduled request of a step: new GPU block ids per group (None: none), and whether
    the ids replace the request's list (resumed after preemption) instead of extending it."""

    req_id: str
    new_block_ids: Sequence[Sequence[int]] | None = None
    resumed: bool = False


@dataclass
class StepInput:
    """What the scheduler needs from one engine step's output (what vLLM's ``build_connector_meta``
    reads)."""

    scheduled: Sequence[ScheduledRequest] = ()
    num_scheduled_tokens: Mapping[str, int] = field(default_factory=dict)
    finished_req_ids: Collection[str] = ()
    preempted_req_ids: Collection[str] = ()
    new_req_ids: Collection[str] = ()
    copied_block_ids: Collection[int] = ()


@dataclass
class BlockEvent:
    """A manager event translated per group (vLLM's ``offloading/events.py``, placeholder form):
    ``block_hashes`` are the raw hashes of the chunks' keys; ``medium`` is ``"CPU"`` or
    ``"STORAGE"``."""

    block_hashes: list[bytes]
    group_idx: int
    medium: str
    removed: bool
    tier: str


@dataclass
class SchedulerStats:
    """Counters since construction (plain ints; the adapter exports them).

    ``allocation_failures``: ``prepare_store`` returned None (vLLM's
    ``kv_offload_allocation_failure``). ``load_prepare_failures``: ``prepare_load`` raised.
    ``lookup_sync_seconds``: time spent in lookups; ``lookup_async_delays``: seconds from a
    deferred lookup to its resolution, one sample per resolved request.
    """

    allocation_failures: int = 0
    load_prepare_failures: int = 0
    loads: int = 0
    stores: int = 0
    loaded_chunks: int = 0
    stored_chunks: int = 0
    failed_loads: int = 0
    failed_stores: int = 0
    lookup_sync_seconds: float = 0.0
    lookup_async_delays: list[float] = field(default_factory=list)


@dataclass
class _GroupState:
    keys: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    cursor: int = 0  # next chunk to store
    num_hit_chunks: int = 0


@dataclass
class _ReqState:
    req: RequestView
    ctx: ReqContext
    policy: OffloadPolicy
    groups: list[_GroupState]
    max_offload_tokens: int | None
    num_computed: int = 0
    jobs: set[int] = field(default_factory=set)
    deferred_since: float | None = None
    finished_signaled: bool = False
    load_failed: bool = False  # a load failed: the engine recomputes; never offer hits again


@dataclass
class _Job:
    req_id: str
    keys: list[bytes]
    is_store: bool
    pending: int
    fenced: list[int] = field(default_factory=list)  # block ids registered in the fence index
    deferred_fence: list[int] = field(default_factory=list)
    failed: bool = False
    pinned: bool = True  # a load whose keys the manager pinned (prepare_load succeeded)


def parse_max_offload_tokens(params: Mapping[str, Any] | None) -> int | None:
    """``max_offload_tokens`` from ``kv_transfer_params`` (vLLM's key): an exact non-negative
    ``int``; anything else (bool, str, float, negative) logs a warning and means no cap."""
    if not params or "max_offload_tokens" not in params:
        return None
    value = params["max_offload_tokens"]
    if type(value) is int and value >= 0:
        return value
    log.warning("ignoring invalid max_offload_tokens %r (need an int >= 0)", value)
    return None


def is_store_reachable(chunk: int, storable: int, window: int, alignment: int | None) -> bool:
    """Segment-tail rule of vLLM's ``_build_store_jobs`` for a windowed chunk.

    With alignment count A, chunk ``c`` lies in the segment starting at ``c - c mod A`` of length
    ``min(A, storable - start)``; only its last ``window`` chunks can ever be loaded (a lookup
    ends on a full-attention chunk boundary), so only those are stored.
    """
    if alignment is None:
        return True
    start = chunk - chunk % alignment
    length = min(alignment, storable - start)
    return chunk % alignment >= length - window


class OffloadScheduler:
    """Per-request offload state and the hook sequence of vLLM's
    ``OffloadingConnectorScheduler``.

    Args:
        config: the static configuration.
        manager: the hooks it drives (:class:`OffloadManager`).

    Hook order per step, as the engine adapter calls them: :meth:`on_new_request` (arrival),
    :meth:`get_num_new_matched_tokens` and :meth:`update_state_after_alloc` (scheduling),
    :meth:`build_step` (once, end of scheduling), :meth:`on_jobs_finished` (worker output),
    :meth:`request_finished` (before a finished request's GPU blocks are freed). Not
    thread-safe: one caller thread.
    """

    def __init__(self, config: SchedulerConfig, manager: OffloadManager) -> None:
        self.config = config
        self.manager = manager
        self.stats = SchedulerStats()
        self._reqs: dict[str, _ReqState] = {}
        self._jobs: dict[int, _Job] = {}
        self._job_counter = 0
        self._stale_job_threshold = 0
        self._fence: dict[int, set[int]] = {}  # GPU block id → store jobs still reading it
        self._being_loaded: set[bytes] = set()
        self._being_stored: dict[bytes, int] = {}  # key → in-flight store jobs writing it
        self._step_loads: dict[int, TransferSpec] = {}
        self._step_flush: set[int] = set()
        self._step_allocated: set[int] = set()
        windowed = [i for i, g in enumerate(config.groups) if g.window_chunks is not None]
        full = [i for i, g in enumerate(config.groups) if g.window_chunks is None]
        windowed.sort(key=lambda i: -(config.groups[i].window_chunks or 0))
        self._lookup_order = full + windowed
        self._has_windowed = bool(windowed)

    # -- introspection (tests, metrics) -------------------------------------------------------
    def num_tracked_requests(self) -> int:
        """Requests with state."""
        return len(self._reqs)

    def is_tracked(self, req_id: str) -> bool:
        """True if the request has state (seen by :meth:`on_new_request`, not yet dropped)."""
        return req_id in self._reqs

    def request_jobs(self, req_id: str) -> set[int]:
        """Ids of the request's jobs in flight (empty if unknown)."""
        st = self._reqs.get(req_id)
        return set(st.jobs) if st else set()

    def store_cursor(self, req_id: str, group: int = 0) -> int:
        """Next chunk index of ``group`` the request will offer for storing."""
        return self._reqs[req_id].groups[group].cursor

    def fenced_block_ids(self) -> set[int]:
        """GPU block ids that in-flight stores still read."""
        return set(self._fence)

    @property
    def stale_job_threshold(self) -> int:
        """Acknowledgements of job ids below this are ignored (jobs from before a reset)."""
        return self._stale_job_threshold

    # -- per-request state ---------------------------------------------------------------------
    def _update_keys(self, st: _ReqState) -> None:
        hashes = st.req.block_hashes
        for g, gs in enumerate(st.groups):
            hpc = self.config.hashes_per_chunk(g)
            for i in range((len(gs.keys) + 1) * hpc - 1, len(hashes), hpc):
                gs.keys.append(make_offload_key(hashes[i], g))

    def on_new_request(self, req: RequestView) -> None:
        """First sight of a request (vLLM's ``on_new_request``)."""
        ctx = ReqContext(req.request_id, req.kv_transfer_params)
        policy = self.manager.on_new_request(ctx).policy
        self._reqs[req.request_id] = _ReqState(
            req,
            ctx,
            policy,
            [_GroupState() for _ in self.config.groups],
            parse_max_offload_tokens(req.kv_transfer_params),
        )

    # -- lookup (vLLM's _lookup_complete_chunks) -------------------------------------------
    def _maximal_prefix(self, keys: Sequence[bytes], ctx: ReqContext) -> int | None:
        """Chunks of ``keys`` readable from the start, or None to ask again later
        (:func:`~kvcascade._prefix_walk.walk_prefix`, vLLM's ``_maximal_prefix_lookup``)."""
        walk = walk_prefix(keys, lambda key: self.manager.lookup(key, ctx))
        return None if walk.deferred else walk.num_hits

    def _suffix_window(self, keys: Sequence[bytes], window: int, ctx: ReqContext) -> int | None:
        """End index in ``keys`` of the last run of ``window`` consecutive hits, scanning from
        the end (a gap restarts the run, it does not end the walk), or None to ask again later
        (vLLM's ``_sliding_window_lookup``; not the walk of :mod:`kvcascade._prefix_walk`)."""
        run = 0
        deferred = False
        for i in range(len(keys) - 1, -1, -1):
            result = self.manager.lookup(keys[i], ctx)
            if result is _HIT or result is _PENDING:
                run += 1
                deferred |= result is _PENDING
                if run == window:
                    return None if deferred else i + window
            else:
                run = 0
                deferred |= result is _RETRY
        return None if deferred else run

    def _lookup(self, st: _ReqState) -> int | None:
        """Tokens loadable beyond ``st.num_computed`` (a multiple of chunks), or None to ask
        again later (as vLLM's ``_lookup_complete_chunks``)."""
        cfg = self.config
        computed = st.num_computed
        max_hit = st.req.num_tokens - (1 if self._has_windowed else 0)
        while True:
            start_max = max_hit
            deferred = False
            for g in self._lookup_order:
                keys = st.groups[g].keys
                T = cfg.tokens_per_chunk(g)
                max_hit = min(max_hit, len(keys) * T)
                if max_hit - computed < T:
                    return 0
                start = computed // T
                query = keys[start : math.ceil(max_hit / T)]
                window = cfg.groups[g].window_chunks
                if window is None:
                    hits = self._maximal_prefix(query, st.ctx)
                else:
                    hits = self._suffix_window(query, window, st.ctx)
                if hits is None:
                    deferred = True
                    continue
                if hits == 0:
                    return 0
                max_hit = min(max_hit, T * (start + hits))
                if max_hit - computed < T:
                    return 0
            shrunk = max_hit < start_max
            if not (shrunk and (deferred or self._has_windowed)):
                break
        if deferred:
            return None
        if cfg.track_loading_chunks and self._being_loaded:
            for g in self._lookup_order:
                T = cfg.tokens_per_chunk(g)
                hit_range = st.groups[g].keys[computed // T : max_hit // T]
                window = cfg.groups[g].window_chunks
                if window is not None:
                    hit_range = hit_range[-window:]
                if not self._being_loaded.isdisjoint(hit_range):
                    return None
        return max_hit - computed

    def _touch(self, st: _ReqState) -> None:
        keys: list[bytes] = []
        for g, gs in enumerate(st.groups):
            window = self.config.groups[g].window_chunks
            skip = 0 if window is None else max(0, gs.num_hit_chunks - window)
            keys.extend(gs.keys[skip:])
        if keys:
            self.manager.touch(keys, st.ctx)

    def get_num_new_matched_tokens(self, req_id: str, num_computed: int) -> tuple[int | None, bool]:
        """Tokens the request can load beyond ``num_computed`` (GPU-cached tokens), and whether
        the load is asynchronous (vLLM's ``get_num_new_matched_tokens``). ``(None, False)``: ask
        again next step (a lookup is pending, or the request still has transfers in flight)."""
        st = self._reqs[req_id]
        for gs in st.groups:
            gs.block_ids.clear()
        if st.jobs:
            return None, False
        self._update_keys(st)
        st.num_computed = num_computed
        if st.req.skip_reading_prefix_cache or st.load_failed:
            hits: int | None = 0
        else:
            t0 = time.perf_counter()
            hits = self._lookup(st)
            self.stats.lookup_sync_seconds += time.perf_counter() - t0
        if hits is None:
            if st.deferred_since is None:
                st.deferred_since = time.monotonic()
            return None, False
        if st.deferred_since is not None:
            self.stats.lookup_async_delays.append(time.monotonic() - st.deferred_since)
            st.deferred_since = None
        for g, gs in enumerate(st.groups):
            gs.num_hit_chunks = (num_computed + hits) // self.config.tokens_per_chunk(g)
        self._touch(st)
        return hits, hits > 0

    # -- load job (vLLM's update_state_after_alloc) ----------------------------------------
    def _new_job(self, st: _ReqState, keys: list[bytes], is_store: bool) -> tuple[int, _Job]:
        job_id = self._job_counter
        self._job_counter += 1
        job = _Job(st.req.request_id, keys, is_store, self.config.num_workers)
        self._jobs[job_id] = job
        st.jobs.add(job_id)
        return job_id, job

    def update_state_after_alloc(
        self,
        req_id: str,
        group_blocks: Sequence[Sequence[tuple[int, bool]]],
        num_external_tokens: int,
    ) -> None:
        """Build the request's load job after its GPU blocks were allocated (vLLM's
        ``update_state_after_alloc``).

        Args:
            req_id: the request.
            group_blocks: per group, the request's blocks as ``(block_id, has_hash)``; the null
                block has id 0; ``has_hash`` is True for blocks already computed on the GPU.
            num_external_tokens: tokens to load (0: nothing to load; the blocks are still
                recorded as re-allocated, so stores reading them are flushed this step).

        Raises:
            RuntimeError: the request already has transfers in flight (broken invariant: the
                lookup defers such requests).
        """
        if num_external_tokens == 0:
            # Blocks handed to this request (by another connector in front, or as fresh
            # blocks) may be the sources of stores still in flight: flush those (vLLM #46951).
            for blocks in group_blocks:
                self._step_allocated.update(bid for bid, _ in blocks if bid)
            return
        st = self._reqs[req_id]
        if st.jobs:
            raise RuntimeError(f"request {req_id} has jobs in flight; cannot add a load job")
        cfg = self.config
        k = cfg.blocks_per_chunk
        cached = st.num_computed + num_external_tokens
        keys: list[bytes] = []
        gpu_ids: list[int] = []
        sizes: list[int] = []
        indices: list[int] = []
        for g, (gs, blocks) in enumerate(zip(st.groups, group_blocks)):
            T_blk = cfg.groups[g].tokens_per_block
            T = cfg.tokens_per_chunk(g)
            num_gpu = math.ceil(cached / T_blk)
            local = next(
                (i for i, (bid, hashed) in enumerate(blocks[:num_gpu]) if bid and not hashed),
                num_gpu,
            )
            pending = num_gpu - local
            self._step_allocated.update(bid for bid, _ in blocks if bid)
            if pending > 0:
                keys.extend(gs.keys[local // k : math.ceil(cached / T)])
                gpu_ids.extend(bid for bid, _ in blocks[local:num_gpu])
            sizes.append(max(pending, 0))
            indices.append(local if pending > 0 else 0)
            if st.policy is OffloadPolicy.BLOCK_LEVEL:
                gs.cursor = max(gs.cursor, math.ceil(cached / T))
        if not keys:
            return
        try:
            src: CPULoadStoreSpec | None = self.manager.prepare_load(keys, st.ctx)
        except Exception as exc:  # a typed miss or a failing manager: never escape a hook
            log.warning("prepare_load failed for %s (%r); the engine will recompute", req_id, exc)
            self.stats.load_prepare_failures += 1
            src = None
        job_id, job = self._new_job(st, keys, is_store=False)
        job.pinned = src is not None
        job.failed = src is None
        self._step_loads[job_id] = TransferSpec(
            req_id, src, GPULoadStoreSpec(gpu_ids, sizes, indices)
        )
        if src is not None:
            self._being_loaded.update(keys)
        self.stats.loads += 1

    # -- step (vLLM's build_connector_meta) ------------------------------------------------
    def _update_req_states(self, step: StepInput) -> None:
        windowed = [g for g, spec in enumerate(self.config.groups) if spec.window_chunks]
        ends: dict[str, list[int]] = {}
        for sched in step.scheduled:
            st = self._reqs.get(sched.req_id)
            if st is None:  # not ours, but its new blocks may be the sources of our stores
                for new in sched.new_block_ids or ():
                    self._step_allocated.update(b for b in new if b)
                continue
            self._update_keys(st)
            if sched.resumed:
                for gs in st.groups:
                    gs.block_ids.clear()
            if sched.new_block_ids:
                ends[sched.req_id] = [len(st.groups[g].block_ids) for g in windowed]
                for gs, new in zip(st.groups, sched.new_block_ids):
                    gs.block_ids.extend(new)
                    self._step_allocated.update(b for b in new if b)
        self._step_allocated.update(step.copied_block_ids)
        if not (windowed and self._step_allocated):
            return
        k = self.config.blocks_per_chunk
        for req_id, st in self._reqs.items():
            req_ends = ends.get(req_id)
            for i, g in enumerate(windowed):
                gs = st.groups[g]
                end = req_ends[i] if req_ends is not None else len(gs.block_ids)
                for j in range(gs.cursor * k, end):
                    if gs.block_ids[j] in self._step_allocated:
                        gs.block_ids[j] = 0  # stale: freed and re-allocated elsewhere

    def _register_fence(self, job_id: int, job: _Job, block_ids: Iterable[int]) -> None:
        for bid in block_ids:
            self._fence.setdefault(bid, set()).add(job_id)
            job.fenced.append(bid)

    def _offloadable_tokens(self, st: _ReqState, num_scheduled: int) -> int:
        req = st.req
        if req.aborted:
            n = req.num_computed_tokens
        elif req.finished:
            n = max(req.num_prompt_tokens, req.num_tokens - 1)
        else:
            n = req.num_computed_tokens + num_scheduled
        n = min(n, req.num_tokens)
        if st.max_offload_tokens is not None:
            n = min(n, st.max_offload_tokens)
        if self.config.offload_prompt_only:
            n = min(n, req.num_prompt_tokens)
        return n

    def _build_store_jobs(self, step: StepInput) -> dict[int, TransferSpec]:
        cfg = self.config
        k = cfg.blocks_per_chunk
        out: dict[int, TransferSpec] = {}
        seen: set[str] = set()
        for req_id in chain(step.num_scheduled_tokens, step.finished_req_ids):
            st = self._reqs.get(req_id)
            if st is None or req_id in seen:
                continue
            seen.add(req_id)
            offloadable = self._offloadable_tokens(st, step.num_scheduled_tokens.get(req_id, 0))
            storable: list[int] = []
            candidates: list[list[int]] = []
            for g, gs in enumerate(st.groups):
                spec = cfg.groups[g]
                n = min(offloadable // cfg.tokens_per_chunk(g), len(gs.block_ids) // k)
                storable.append(n)
                chunks = [
                    c
                    for c in range(gs.cursor, n)
                    if gs.block_ids[(c + 1) * k - 1] != 0
                    and (
                        spec.window_chunks is None
                        or is_store_reachable(c, n, spec.window_chunks, spec.alignment_chunks)
                    )
                ]
                candidates.append(chunks)
            keys = [st.groups[g].keys[c] for g, chunks in enumerate(candidates) for c in chunks]
            if not keys:
                self._advance(st, storable)
                continue
            result = self.manager.prepare_store(keys, st.ctx)
            if result is None:
                self.stats.allocation_failures += 1
                log.warning("no room in the offload cache for %d chunks of %s", len(keys), req_id)
                continue
            accepted = set(result.keys_to_store)
            reached = self._store_reach(st, candidates, storable, accepted)
            if not result.keys_to_store:
                self._advance(st, reached)
                continue
            self._touch(st)
            gpu_ids: list[int] = []
            sizes: list[int] = []
            indices: list[int] = []
            fenced: list[int] = []
            deferred: list[int] = []
            for g, chunks in enumerate(candidates):
                gs = st.groups[g]
                group_ids: list[int] = []
                first_index = 0
                for c in chunks:
                    if gs.keys[c] not in accepted:
                        continue
                    for j in range(c * k, (c + 1) * k):
                        if gs.block_ids[j]:
                            if not group_ids:
                                first_index = j
                            group_ids.append(gs.block_ids[j])
                gpu_ids.extend(group_ids)
                sizes.append(len(group_ids))
                indices.append(first_index)
                (deferred if cfg.groups[g].window_chunks is None else fenced).extend(group_ids)
            self._advance(st, reached)
            job_id, job = self._new_job(st, list(result.keys_to_store), is_store=True)
            for key in job.keys:
                self._being_stored[key] = self._being_stored.get(key, 0) + 1
            job.deferred_fence = deferred
            self._register_fence(job_id, job, fenced)
            if st.finished_signaled or st.req.finished:
                self._register_fence(job_id, job, deferred)
                job.deferred_fence = []
                if not self._step_allocated.isdisjoint(deferred):
                    self._step_flush.add(job_id)
            dst = GPULoadStoreSpec(gpu_ids, sizes, indices)
            out[job_id] = TransferSpec(req_id, result.store_spec, dst)  # type: ignore[arg-type]
            self.stats.stores += 1
            self.stats.stored_chunks += len(result.keys_to_store)
        return out

    def _store_reach(
        self,
        st: _ReqState,
        candidates: Sequence[Sequence[int]],
        storable: Sequence[int],
        accepted: Collection[bytes],
    ) -> list[int]:
        """Per group, how far the store cursor may advance: up to ``storable``, but never past
        a chunk skipped because another request's store of it is still in flight — if that
        write fails, this request stores the chunk itself next step (vLLM #54415)."""
        reach = list(storable)
        for g, chunks in enumerate(candidates):
            keys = st.groups[g].keys
            for c in chunks:
                if keys[c] not in accepted and keys[c] in self._being_stored:
                    reach[g] = c
                    break
        return reach

    @staticmethod
    def _advance(st: _ReqState, storable: Sequence[int]) -> None:
        for gs, n in zip(st.groups, storable):
            gs.cursor = max(gs.cursor, n)

    def build_step(self, step: StepInput) -> StepPlan:
        """End of scheduling: the transfers of this step (vLLM's ``build_connector_meta``).

        Updates the requests' GPU blocks, calls the manager's ``on_schedule_end``, flushes the
        stores of preempted requests and stores still reading re-allocated blocks, builds the
        store jobs, and signals ``on_request_finished`` for finished requests.
        """
        # Preempted requests lose their blocks first: one preempted and scheduled again in the
        # same step keeps the blocks it was given again (they were cleared after them, and its
        # next store read another block's KV for its first chunk; found by a break-it run).
        for req_id in step.preempted_req_ids:
            st = self._reqs.get(req_id)
            if st is not None:
                for gs in st.groups:
                    gs.block_ids.clear()
                self._step_flush.update(j for j in st.jobs if self._jobs[j].is_store)
        self._update_req_states(step)
        self.manager.on_schedule_end(
            ScheduleEndContext(tuple(step.new_req_ids), tuple(step.preempted_req_ids))
        )
        for bid in self._step_allocated:
            self._step_flush.update(self._fence.get(bid, ()))
        plan = StepPlan(self._step_loads, self._build_store_jobs(step), self._step_flush)
        for req_id in step.finished_req_ids:
            st = self._reqs.get(req_id)
            if st is None:
                continue
            if not st.finished_signaled:
                st.finished_signaled = True
                self.manager.on_request_finished(st.ctx)
            if not st.jobs:
                del self._reqs[req_id]
        self._step_loads = {}
        self._step_flush = set()
        self._step_allocated = set()
        return plan

    # -- worker results (vLLM's update_connector_output) -----------------------------------
    def on_jobs_finished(
        self, completed: Mapping[int, int], failed: Collection[int] = ()
    ) -> list[str]:
        """Apply worker acknowledgements: ``completed[job_id]`` = workers that finished it this
        step; ``failed`` = ids some worker failed. A job completes once every worker acked.

        Returns:
            ids of requests whose load job completed (in any outcome).
        """
        done_loads: list[str] = []
        for job_id, count in completed.items():
            job = self._jobs.get(job_id)
            if job_id < self._stale_job_threshold or job is None:
                continue
            job.failed |= job_id in failed
            job.pending -= count
            if job.pending > 0:
                continue
            del self._jobs[job_id]
            st = self._reqs.get(job.req_id)
            ctx = st.ctx if st is not None else ReqContext(job.req_id)
            if job.is_store:
                for key in job.keys:
                    if self._being_stored[key] == 1:
                        del self._being_stored[key]
                    else:
                        self._being_stored[key] -= 1
                self.manager.complete_store(job.keys, ctx, success=not job.failed)
                self.stats.failed_stores += job.failed
            else:
                self._being_loaded.difference_update(job.keys)
                if job.pinned:
                    self.manager.complete_load(job.keys, ctx)
                self.stats.failed_loads += job.failed
                if job.failed and st is not None:
                    st.load_failed = True
                self.stats.loaded_chunks += 0 if job.failed else len(job.keys)
                done_loads.append(job.req_id)
            for bid in job.fenced:
                jobs = self._fence.get(bid)
                if jobs is not None:
                    jobs.discard(job_id)
                    if not jobs:
                        del self._fence[bid]
            if st is not None:
                st.jobs.discard(job_id)
                if st.finished_signaled and not st.jobs:
                    del self._reqs[job.req_id]
        return done_loads

    # -- request end, pending work, events, reset ------------------------------------------------
    def request_finished(self, req_id: str) -> None:
        """The request finished; its GPU blocks are freed after this call (vLLM's
        ``request_finished``).

        Final hashes become keys (so the next step can store the last full block), and the
        source blocks of its in-flight stores enter the fence index, so a store is flushed
        before its blocks are written by another request.
        """
        st = self._reqs.get(req_id)
        if st is None:
            ctx = ReqContext(req_id)
            self.manager.on_new_request(ctx)
            self.manager.on_request_finished(ctx)
            return
        if st.deferred_since is not None:
            self.stats.lookup_async_delays.append(time.monotonic() - st.deferred_since)
            st.deferred_since = None
        self._update_keys(st)
        for job_id in st.jobs:
            job = self._jobs[job_id]
            if job.is_store and job.deferred_fence:
                self._register_fence(job_id, job, job.deferred_fence)
                job.deferred_fence = []

    def has_pending_work(self) -> bool:
        """True while a transfer is tracked or the manager has work (keeps the engine stepping)."""
        return bool(self._jobs) or self.manager.has_pending_work()

    def take_events(self) -> list[BlockEvent]:
        """Manager events since the last call, one :class:`BlockEvent` per group and event."""
        out: list[BlockEvent] = []
        for event in self.manager.take_events():
            by_group: dict[int, list[bytes]] = {}
            for key in event.keys:
                block_hash, group = split_offload_key(key)
                by_group.setdefault(group, []).append(block_hash)
            medium = "CPU" if event.medium is Medium.CPU else "STORAGE"
            for group, hashes in by_group.items():
                out.append(BlockEvent(hashes, group, medium, event.removed, event.tier))
        return out

    def reset_cache(self) -> Any:
        """Forget all offload state between steps (vLLM's ``reset_cache``).

        Every tracked job is flushed with the next step's plan (in-flight loads finish before
        slots are reused); finished requests are signalled and dropped; the manager is reset;
        active requests re-offload from chunk 0; acknowledgements of older jobs are ignored.

        Returns:
            what the manager's ``reset_cache`` returned (the coordinator's: a coroutine, which
            the caller awaits before the next step).
        """
        self._step_flush.update(self._jobs)
        for req_id, st in list(self._reqs.items()):
            if st.finished_signaled or st.req.finished:
                if not st.finished_signaled:
                    self.manager.on_request_finished(st.ctx)
                del self._reqs[req_id]
                continue
            st.jobs.clear()
            for gs in st.groups:
                gs.cursor = 0
        reset = self.manager.reset_cache()
        self._stale_job_threshold = self._job_counter
        self._jobs.clear()
        self._fence.clear()
        self._being_loaded.clear()
        self._being_stored.clear()
        return reset
