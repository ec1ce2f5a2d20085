"""Bookkeeping of the CPU primary tier: slots, ref counts, eviction.

After vLLM's ``vllm/v1/kv_offload/cpu/manager.py``; see docs/cpu-tier.md.

Synchronous, no I/O, no asyncio: every method returns at once. Data never passes through here;
the slots it hands out are rows of the primary tier's host buffer (:mod:`kvcascade.tiers.cpu`,
:mod:`kvcascade.tiers.shm`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from .._errors import ConfigError
from .._event_queue import EventQueue
from .._types import (
    CPULoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from .._validate import is_int
from ..policies.base import BlockStatus, CachePolicy
from ..policies.registry import resolve_cache_policy

#: Upper bounds of the allocation-size histogram buckets (vLLM's ``kv_offload_cpu_allocation_size``
#: buckets: powers of 4 from 1 to 262144); a last, unbounded bucket follows.
ALLOCATION_SIZE_BUCKETS: tuple[int, ...] = tuple(4**i for i in range(10))

_MISS = LookupResult.MISS
_HIT = LookupResult.HIT
_HIT_PENDING = LookupResult.HIT_PENDING


def _bucket(n: int) -> int:
    """Index of the first bucket whose bound is ``>= n`` (``n >= 1``); 10 = above 262144."""
    return min(((n - 1).bit_length() + 1) >> 1, len(ALLOCATION_SIZE_BUCKETS))


_SMALL = 257
_BUCKET_OF = (0, *(_bucket(n) for n in range(1, _SMALL)))  # precomputed for the common sizes


def _cpu_spec(slots: list[int]) -> CPULoadStoreSpec:
    """A :class:`CPULoadStoreSpec` over ``slots`` (int64), built without re-validating the list."""
    spec = CPULoadStoreSpec.__new__(CPULoadStoreSpec)
    spec.block_ids = np.array(slots, dtype=np.int64)
    return spec


class _RequestCacheAccess:
    """The keys one request presented to one manager (vLLM's ``_RequestCacheAccess`` in
    ``kv_offload/cpu/manager.py``), kept on its :class:`ReqContext` until its
    ``on_request_finished``.

    ``seen``: every key the request stored, offered while readable, or loaded, in first-seen
    order (a dict used as an ordered set; grouped per KV-cache group at finish). ``inserted``:
    keys this request's ``prepare_store`` allocated. ``reused``: ready keys it loaded or offered
    again that it did not insert itself. ``store_misses``: absent keys it offered, already shown
    to the policy's ``on_store_miss``. ``generation``: the manager's ``reset_cache`` count
    when recorded (a state from before a reset is ignored and started over).
    """

    __slots__ = ("finished", "generation", "inserted", "owner", "reused", "seen", "store_misses")

    def __init__(self, owner: object, generation: int) -> None:
        self.owner = owner
        self.generation = generation
        self.seen: dict[bytes, None] = {}
        self.inserted: set[bytes] = set()
        self.reused: set[bytes] = set()
        self.store_misses: set[bytes] = set()
        self.finished = False

    def record(self, keys: Iterable[bytes], reused: Collection[bytes] = ()) -> None:
        """Add ``keys`` to ``seen`` (first sight keeps its place) and ``reused`` minus
        ``inserted`` to ``reused``."""
        self.seen.update(dict.fromkeys(keys))
        if reused:
            inserted = self.inserted
            self.reused.update(reused if not inserted else [k for k in reused if k not in inserted])


def _key_groups(keys: Collection[bytes]) -> tuple[tuple[bytes, ...], ...]:
    """``keys`` (not empty) split by KV-cache group (the 4-byte big-endian suffix of
    :mod:`kvcascade._keys`), groups in increasing index, each in the order given."""
    suffix = next(iter(keys))[-4:]
    if all(key.endswith(suffix) for key in keys):  # one group: the common case
        return (tuple(keys),)
    groups: dict[bytes, list[bytes]] = {}
    for key in keys:
        suffix = key[-4:]
        group = groups.get(suffix)
        if group is None:
            groups[suffix] = [key]
        else:
            group.append(key)
    return tuple(tuple(groups[g]) for g in sorted(groups))


@dataclass
class CPUTierStats:
    """Primary-tier metrics returned by :meth:`CPUOffloadingManager.get_stats`.

    Gauges (fractions of ``num_blocks``, 0 when ``num_blocks == 0``), measured at the call:
        usage: blocks pinned by in-flight transfers (not ready or being read) — vLLM's
            ``kv_offload_cpu_cache_usage_perc``.
        write_usage: blocks not ready (writes in flight) — ``…_cpu_cache_write_usage_perc``.
        read_usage: ``max(usage − write_usage, 0)`` — ``…_cpu_cache_read_usage_perc``.

    Counters since the previous call:
        allocation_counts: per bucket of :data:`ALLOCATION_SIZE_BUCKETS` (plus one unbounded
            bucket), how many ``prepare_store`` calls allocated that many new keys; recorded
            even when the call then fails (vLLM's ``kv_offload_cpu_allocation_size``).
        allocation_count / allocation_sum: number of those calls / keys they asked for.
        evictions: blocks evicted.
        lookups / hits / pending_hits: ``lookup`` calls, ``HIT`` answers, ``HIT_PENDING`` answers.
    """

    usage: float = 0.0
    write_usage: float = 0.0
    read_usage: float = 0.0
    allocation_counts: list[int] = field(
        default_factory=lambda: [0] * (len(ALLOCATION_SIZE_BUCKETS) + 1)
    )
    allocation_count: int = 0
    allocation_sum: int = 0
    evictions: int = 0
    lookups: int = 0
    hits: int = 0
    pending_hits: int = 0


class CPUOffloadingManager:
    """Scheduler-side manager of the CPU primary tier; vLLM's ``CPUOffloadingManager`` contract.

    Args:
        num_blocks: number of primary-tier slots (chunks), ``>= 0``.
        eviction_policy: a registered policy name (``"lru"``, ``"arc"``, …) or
            ``"module.path:ClassName"``.
        enable_events: queue :class:`OffloadingEvent` s for :meth:`take_events` (at most
            :data:`kvcascade._event_queue.MAX_QUEUED_EVENTS`: the oldest are dropped, counted
            in ``event_queue.dropped``, when nobody takes them).
        cache_policy_module_path: module to import an unregistered ``eviction_policy`` class
            name from (vLLM's ``cache_policy_module_path``).

    Slots: fresh slots are handed out in increasing order first, then released ones from a LIFO
    free list. ``prepare_store`` evicts atomically and protects every key of the call
    (as vLLM's). Removal events always precede the store event that reuses the space. Not
    implemented from vLLM: the reuse filter (``store_threshold``, docs/cpu-tier.md).

    Cost: O(1) per key plus the policy's eviction scan; about 130–190 B of Python memory per
    tracked block (a recycled :class:`BlockStatus` per slot and the policy's ordered-dict entry).

    Raises:
        ConfigError: ``num_blocks`` negative or not an int; unknown ``eviction_policy``.
    """

    medium = Medium.CPU

    def __init__(
        self,
        num_blocks: int,
        eviction_policy: str = "lru",
        enable_events: bool = False,
        cache_policy_module_path: str | None = None,
    ) -> None:
        if not is_int(num_blocks):
            raise ConfigError(f"num_blocks must be an int, got {num_blocks!r}")
        if num_blocks < 0:
            raise ConfigError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.eviction_policy = eviction_policy
        self._policy: CachePolicy = resolve_cache_policy(eviction_policy, cache_policy_module_path)(
            cache_capacity=num_blocks
        )
        self._get = self._policy.get
        # Only policies that override the hook pay for the per-request miss set.
        overridden = type(self._policy).on_store_miss is not CachePolicy.on_store_miss
        self._on_store_miss = self._policy.on_store_miss if overridden else None
        self.event_queue = EventQueue("the cpu tier", enabled=enable_events)
        # One BlockStatus per slot, made up front so the hot path allocates no tracked objects
        # (fewer garbage-collector passes); never-used slots are taken in increasing order.
        self._slots = [BlockStatus(i) for i in range(num_blocks)]
        # Released slots as their BlockStatus objects (recycled on reuse), LIFO.
        self._free_list: list[BlockStatus] = []
        self._high_water = 0
        self.num_evictable = 0
        self.num_write_pending = 0
        self.total_evictions = 0
        self._generation = 0  # reset_cache count: request states of older generations are void
        self._reset_counters()

    def _reset_counters(self) -> None:
        self._alloc_counts = [0] * (len(ALLOCATION_SIZE_BUCKETS) + 1)
        self._alloc_sum = 0
        self._evictions = 0
        self._lookups = 0
        self._hits = 0
        self._pending_hits = 0

    # -- queries ---------------------------------------------------------------------------
    @property
    def policy(self) -> CachePolicy:
        """The eviction policy instance (read-only use: inspection and tests)."""
        return self._policy

    @property
    def num_free(self) -> int:
        """Slots not tracked by any key."""
        return len(self._free_list) + self.num_blocks - self._high_water

    def get_block(self, key: bytes) -> BlockStatus | None:
        """The live :class:`BlockStatus` tracked under ``key`` (no recency change), or None."""
        return self._get(key)

    def lookup(self, key: bytes, ctx: ReqContext | None = None) -> LookupResult:
        """``HIT`` if present and ready, ``HIT_PENDING`` if a write is in flight, else ``MISS``.

        No recency change (as vLLM's).
        """
        self._lookups += 1
        block = self._get(key)
        if block is None:
            return _MISS
        if not block.is_ready:
            self._pending_hits += 1
            return _HIT_PENDING
        self._hits += 1
        return _HIT

    # -- per-request access (vLLM's _RequestCacheAccess) ----------------------------------
    def _access(self, ctx: ReqContext) -> _RequestCacheAccess:
        """``ctx``'s open access record for this manager and generation; a new one if there is
        none or it was finished (a context used again after its request finished starts over,
        where vLLM asserts)."""
        state = self._open_access(ctx)
        if state is None:
            state = _RequestCacheAccess(self, self._generation)
            ctx.set_state(state)
        return state

    def _open_access(self, ctx: ReqContext) -> _RequestCacheAccess | None:
        """``ctx``'s record for this manager and generation if it is not finished, else None."""
        state = ctx.get_state(_RequestCacheAccess)
        if (
            state is None
            or state.owner is not self
            or state.generation != self._generation
            or state.finished
        ):
            return None
        return state

    # -- loads -----------------------------------------------------------------------------
    def prepare_load(
        self, keys: Collection[bytes], ctx: ReqContext | None = None
    ) -> CPULoadStoreSpec:
        """Pin every key (ref count +1) and return their slots, co-indexed with ``keys``; with a
        ``ctx``, the keys count as reused by its request (see :meth:`on_request_finished`).

        Duplicates are allowed (each pins once more). Atomic: nothing is pinned or recorded on
        error.

        Raises:
            KeyError: a key is absent or not ready (the caller must have seen ``HIT`` this step).
        """
        return self._pin(keys, self._access(ctx) if ctx is not None else None)

    def prepare_read(
        self, keys: Collection[bytes], ctx: ReqContext | None = None
    ) -> CPULoadStoreSpec:
        """:meth:`prepare_load` without the access record: pins for transfers that are not the
        request's own reads (cascades to secondary tiers, pins held for a reader) — vLLM's
        ``TieringPrimaryManager.prepare_read`` in ``kv_offload/tiering/manager.py``.

        Raises:
            KeyError: as :meth:`prepare_load`.
        """
        return self._pin(keys, None)

    def _pin(self, keys: Collection[bytes], access: _RequestCacheAccess | None) -> CPULoadStoreSpec:
        """Check, record in ``access`` (if any), then pin ``keys``; see :meth:`prepare_load`."""
        get = self._get
        blocks = [get(key) for key in keys]
        for key, block in zip(keys, blocks):
            if block is None or not block.is_ready:
                raise KeyError(f"prepare_load of a key that is not readable: {key!r}")
        if access is not None:
            access.record(keys, keys)
        mark = self._policy.mark_non_evictable
        for key, block in zip(keys, blocks):
            if block.ref_cnt == 0:  # type: ignore[union-attr]
                mark(key)
                self.num_evictable -= 1
            block.ref_cnt += 1  # type: ignore[union-attr]
        return _cpu_spec([block.block_id for block in blocks])  # type: ignore[union-attr]

    def touch(self, keys: Collection[bytes], ctx: ReqContext | None = None) -> None:
        """Mark ``keys`` recently used; delegated to the policy with ``ctx`` (first key most
        recent)."""
        self._policy.touch(keys, ctx)

    def complete_load(self, keys: Collection[bytes], ctx: ReqContext | None = None) -> None:
        """Unpin every key (ref count −1); at 0 the block becomes evictable again.

        Raises:
            KeyError: a key is absent or not pinned (keys before it are already unpinned).
        """
        get = self._get
        for key in keys:
            block = get(key)
            if block is None or block.ref_cnt <= 0:
                raise KeyError(f"complete_load of a key that is not pinned: {key!r}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.num_evictable += 1
                self._policy.mark_evictable(key)

    # -- stores ----------------------------------------------------------------------------
    def prepare_store(
        self, keys: Collection[bytes], ctx: ReqContext | None = None
    ) -> PrepareStoreOutput | None:
        """Allocate not-ready slots for the keys not yet tracked, evicting idle blocks if needed.

        Keys already tracked (ready or not) are skipped; duplicates count once. The
        allocation size is recorded in the histogram before anything can fail. Eviction
        protects every key of the call and queues one removal event for the batch.

        Returns:
            ``PrepareStoreOutput(keys_to_store, CPULoadStoreSpec(slots), evicted_keys)`` —
            empty lists when nothing is new — or None when fewer than the needed number of
            idle, unprotected blocks can be evicted (then nothing changed but the histogram).
        """
        get = self._get
        to_store = []
        ready: list[bytes] = []
        pending = 0
        for key in keys:
            block = get(key)
            if block is None:
                to_store.append(key)
            elif block.ref_cnt >= 0:
                ready.append(key)
            else:
                pending += 1
        access = self._access(ctx) if ctx is not None else None
        if access is not None:
            if to_store and self._on_store_miss is not None:
                # Once per key and request, before insert() drops a ghost (vLLM's order).
                seen_misses = access.store_misses
                misses = [key for key in to_store if key not in seen_misses]
                if misses:
                    self._on_store_miss(misses, ctx)
                    seen_misses.update(misses)
            # Before any early return, as vLLM's; keys another writer is still writing are not
            # the request's (yet).
            if pending:
                new_or_ready = set(to_store).union(ready)
                access.record([k for k in keys if k in new_or_ready], ready)
            else:
                access.record(keys, ready)
        n = len(to_store)
        if not n:
            return PrepareStoreOutput(to_store, _cpu_spec(to_store), [])
        if n > 1 and len(set(to_store)) != n:
            to_store = list(dict.fromkeys(to_store))
            n = len(to_store)
        self._alloc_counts[_BUCKET_OF[n] if n < _SMALL else _bucket(n)] += 1
        self._alloc_sum += n
        need = n - len(self._free_list) - self.num_blocks + self._high_water
        evicted_keys: list[bytes] = []
        if need > 0:
            if need > self.num_evictable:
                return None
            victims = self._policy.evict(need, keys if isinstance(keys, set) else set(keys))
            if victims is None:
                return None
            if len(victims) != need:
                raise RuntimeError(
                    f"cache policy {type(self._policy).__name__} evicted {len(victims)} blocks "
                    f"when asked for {need}"
                )
            free = self._free_list
            for key, block in victims:
                evicted_keys.append(key)
                free.append(block)
            self.num_evictable -= need
            self._evictions += need
            self.total_evictions += need
            if self.event_queue.enabled:
                self.event_queue.append(
                    OffloadingEvent(evicted_keys.copy(), Medium.CPU, removed=True)
                )
        blocks = self._allocate(n)
        insert = self._policy.insert
        for key, block in zip(to_store, blocks):
            insert(key, block)
        self.num_write_pending += n
        if access is not None:
            access.inserted.update(to_store)
        return PrepareStoreOutput(
            to_store, _cpu_spec([block.block_id for block in blocks]), evicted_keys
        )

    def _allocate(self, n: int) -> list[BlockStatus]:
        """``n`` not-ready blocks: fresh slots in increasing order, then the free list's end."""
        start = self._high_water
        fresh = self.num_blocks - start
        if fresh >= n:
            self._high_water = start + n
            blocks = self._slots[start : start + n]
            for block in blocks:
                block.ref_cnt = -1
            return blocks
        blocks = self._slots[start:]
        for block in blocks:
            block.ref_cnt = -1
        self._high_water = self.num_blocks
        pop = self._free_list.pop
        for _ in range(n - fresh):
            block = pop()
            block.ref_cnt = -1
            blocks.append(block)
        return blocks

    def complete_store(
        self, keys: Collection[bytes], ctx: ReqContext | None = None, success: bool = True
    ) -> None:
        """Finish the writes of ``prepare_store`` (vLLM's ``complete_store``).

        ``success``: not-ready keys become readable and evictable (one store event). Failure:
        not-ready keys are dropped and their slots freed. Absent or already-ready keys are
        ignored either way.
        """
        get = self._get
        policy = self._policy
        stored: list[bytes] = []
        for key in keys:
            block = get(key)
            if block is None or block.is_ready:
                continue
            self.num_write_pending -= 1
            if success:
                block.ref_cnt = 0
                self.num_evictable += 1
                policy.mark_evictable(key)
                stored.append(key)
            else:
                policy.remove(key)
                self._free_list.append(block)
        if stored:
            self.event_queue.append(OffloadingEvent(stored, Medium.CPU, removed=False))

    def remove(self, keys: Collection[bytes]) -> tuple[list[bytes], list[bytes]]:
        """Forget idle ``keys`` now (invalidation) and free their slots; one removal event.

        Returns:
            ``(removed, in_use)``: keys dropped, and keys left because they are pinned or being
            written (absent keys are in neither).
        """
        removed: list[bytes] = []
        in_use: list[bytes] = []
        for key in dict.fromkeys(keys):
            block = self._get(key)
            if block is None:
                continue
            if block.ref_cnt != 0:
                in_use.append(key)
                continue
            self._policy.remove(key)
            self._free_list.append(block)
            self.num_evictable -= 1
            removed.append(key)
        if removed:
            self.event_queue.append(OffloadingEvent(removed, Medium.CPU, removed=True))
        return removed, in_use

    def quarantine_write(self, key: bytes) -> BlockStatus | None:
        """Give up on the in-flight write of ``key``: the key is forgotten (a miss from now on)
        but its slot is *not* freed, because the late writer may still write into it.

        Returns the quarantined block (hand it to :meth:`release_quarantined` once the writer
        reported), or None when ``key`` has no write in flight.
        """
        block = self._get(key)
        if block is None or block.is_ready:
            return None
        self._policy.remove(key)
        self.num_write_pending -= 1
        return block

    def release_quarantined(self, blocks: Collection[BlockStatus]) -> None:
        """Return slots of :meth:`quarantine_write` to the free list (their writers are done)."""
        self._free_list.extend(blocks)

    # -- lifecycle -------------------------------------------------------------------------
    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        """First sight of a request: the primary tier always answers BLOCK_LEVEL."""
        return RequestOffloadingContext()

    def on_request_finished(self, ctx: ReqContext) -> None:
        """Hand the request's accesses to the policy, once: :meth:`CachePolicy.on_request_finished`
        with the keys it presented per KV-cache group (groups by index, keys in first-seen
        order), the keys it only inserted and the ready keys it reused (vLLM's
        ``CPUOffloadingManager.on_request_finished``, ``kv_offload/cpu/manager.py``).

        A second call, a request this manager never saw, or one seen only before the last
        :meth:`reset_cache` does nothing. vLLM sorts each group by the keys' token positions
        (``ReqContext.get_offload_key_position``); our contexts carry none, so first-seen
        order stands (the same whenever a request presents its keys head first).
        """
        state = self._open_access(ctx)
        if state is None:
            return
        state.finished = True
        if state.seen:
            self._policy.on_request_finished(
                _key_groups(state.seen), state.inserted - state.reused, state.reused, ctx
            )

    def take_events(self) -> Iterator[OffloadingEvent]:
        """Drain the queued events in order (nothing when events are disabled; at most
        :data:`kvcascade._event_queue.MAX_QUEUED_EVENTS`, the oldest dropped beyond)."""
        return iter(self.event_queue.take())

    def get_stats(self) -> CPUTierStats:
        """Gauges now and counters since the last call (vLLM's ``get_stats``); never None."""
        stats = CPUTierStats(
            allocation_counts=self._alloc_counts,
            allocation_count=sum(self._alloc_counts),
            allocation_sum=self._alloc_sum,
            evictions=self._evictions,
            lookups=self._lookups,
            hits=self._hits,
            pending_hits=self._pending_hits,
        )
        self._reset_counters()
        n = self.num_blocks
        if n:
            allocated = self._high_water - len(self._free_list)
            stats.usage = (allocated - self.num_evictable) / n
            stats.write_usage = self.num_write_pending / n
            stats.read_usage = max(stats.usage - stats.write_usage, 0.0)
        return stats

    def reset_cache(self, reserved: Collection[BlockStatus] = ()) -> None:
        """Forget every block and the policy's state, unconditionally (vLLM's ``reset``).

        The caller guarantees that no completion of a job prepared before the reset is applied
        afterwards. As in vLLM, queued events stay queued and no removal events are emitted for
        the dropped blocks; ``total_evictions`` keeps counting. ``reserved`` blocks (slots a
        stalled writer may still touch) stay out of use until :meth:`release_quarantined`;
        with none, slots are handed out from 0 again.
        """
        self._policy.clear()
        self._generation += 1
        self._free_list.clear()
        self._high_water = 0
        self.num_evictable = 0
        self.num_write_pending = 0
        if reserved:
            taken = {b.block_id for b in reserved}
            self._high_water = self.num_blocks
            self._free_list.extend(
                self._slots[i] for i in range(self.num_blocks - 1, -1, -1) if i not in taken
            )
