"""Bookkeeping of the CPU primary tier: slots, ref counts, eviction (spec §2.1–2.3).

Synchronous, no I/O, no asyncio: every method returns at once. Data never passes through here;
the slots it hands out are rows of the primary tier's host buffer (:mod:`kvcascade.tiers.cpu`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass, field

from .._errors import ConfigError
from .._types import (
    CPULoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from ..policies.base import BlockStatus, CachePolicy
from ..policies.registry import resolve_cache_policy


@dataclass
class CPUTierStats:
    """Counters of the primary tier since the last :meth:`CPUOffloadingManager.get_stats` call.

    Gauges are fractions of ``num_blocks``: ``usage`` = pinned by in-flight transfers,
    ``write_usage`` = not-ready (writes in flight), ``read_usage`` = max(usage − write, 0).
    """

    usage: float = 0.0
    write_usage: float = 0.0
    read_usage: float = 0.0
    allocation_sizes: list[int] = field(default_factory=list)
    evictions: int = 0
    lookups: int = 0
    hits: int = 0


class CPUOffloadingManager:
    """Scheduler-side manager of the CPU primary tier; vLLM's ``CPUOffloadingManager`` contract.

    Args:
        num_blocks: number of primary-tier slots (chunks), ``>= 0``.
        eviction_policy: a registered policy name (``"lru"``, ``"arc"``, …) or
            ``"module.path:ClassName"``.
        enable_events: queue :class:`OffloadingEvent` s for :meth:`take_events`.

    Slots: fresh slots are handed out in increasing order first, then released ones from a LIFO
    free list (spec §2.2). ``prepare_store`` evicts atomically and protects every key of the call
    (spec §2.3). Removal events always precede the store event that reuses the space.

    Raises:
        ConfigError: ``num_blocks`` negative or not an int; unknown ``eviction_policy``.
    """

    medium = Medium.CPU

    def __init__(
        self, num_blocks: int, eviction_policy: str = "lru", enable_events: bool = False
    ) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int):
            raise ConfigError(f"num_blocks must be an int, got {num_blocks!r}")
        if num_blocks < 0:
            raise ConfigError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.eviction_policy = eviction_policy
        self._policy: CachePolicy = resolve_cache_policy(eviction_policy)(
            cache_capacity=num_blocks
        )
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        self._free_list: list[int] = []
        self._high_water = 0
        self.num_evictable = 0
        self.num_write_pending = 0
        self._stats = CPUTierStats()
        self.total_evictions = 0

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
        """The :class:`BlockStatus` tracked under ``key`` (no recency change), or None."""
        return self._policy.get(key)

    def lookup(self, key: bytes, ctx: ReqContext | None = None) -> LookupResult:
        """``HIT`` if present and ready, ``HIT_PENDING`` if a write is in flight, else ``MISS``.

        No recency change (spec §2.3).
        """
        self._stats.lookups += 1
        block = self._policy.get(key)
        if block is None:
            return LookupResult.MISS
        self._stats.hits += 1
        return LookupResult.HIT if block.ref_cnt >= 0 else LookupResult.HIT_PENDING

    # -- loads -----------------------------------------------------------------------------
    def prepare_load(self, keys: Collection[bytes], ctx: ReqContext | None = None) -> CPULoadStoreSpec:
        """Pin every key (ref count +1) and return their slots in the given order.

        Raises:
            KeyError: a key is absent or not ready (the caller must have seen ``HIT`` this step).
        """
        blocks = []
        for key in keys:
            block = self._policy.get(key)
            if block is None or block.ref_cnt < 0:
                raise KeyError(f"prepare_load of a key that is not readable: {key!r}")
            blocks.append(block)
        slots = []
        for key, block in zip(keys, blocks):
            if block.ref_cnt == 0:
                self._policy.mark_non_evictable(key)
                self.num_evictable -= 1
            block.ref_cnt += 1
            slots.append(block.block_id)
        return CPULoadStoreSpec(slots)

    def touch(self, keys: Collection[bytes], ctx: ReqContext | None = None) -> None:
        """Mark ``keys`` recently used; delegated to the policy (first key most recent)."""
        self._policy.touch(keys, ctx)

    def complete_load(self, keys: Collection[bytes], ctx: ReqContext | None = None) -> None:
        """Unpin every key (ref count −1); at 0 the block becomes evictable again.

        Raises:
            KeyError: a key is absent or not pinned.
        """
        for key in keys:
            block = self._policy.get(key)
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

        Returns None (and changes nothing but the allocation histogram) when fewer than the
        needed number of unpinned, unprotected blocks can be evicted (spec §2.3 steps 1–7).
        """
        policy = self._policy
        keys = list(keys)
        to_store = [k for k in dict.fromkeys(keys) if policy.get(k) is None]
        if not to_store:
            return PrepareStoreOutput([], CPULoadStoreSpec([]), [])
        self._stats.allocation_sizes.append(len(to_store))
        need = len(to_store) - self.num_free
        victims: list[bytes] = []
        if need > 0:
            if need > self.num_evictable:
                return None
            evicted = policy.evict(need, protected=set(keys))
            if evicted is None:
                return None
            for key, block in evicted:
                self._free_list.append(block.block_id)
                victims.append(key)
            self.num_evictable -= need
            self._stats.evictions += need
            self.total_evictions += need
            if self._events is not None:
                self._events.append(OffloadingEvent(victims, Medium.CPU, removed=True))
        slots = self._allocate(len(to_store))
        for key, slot in zip(to_store, slots):
            policy.insert(key, BlockStatus(slot))
        self.num_write_pending += len(to_store)
        return PrepareStoreOutput(to_store, CPULoadStoreSpec(slots), victims)

    def _allocate(self, n: int) -> list[int]:
        fresh = min(n, self.num_blocks - self._high_water)
        slots = list(range(self._high_water, self._high_water + fresh))
        self._high_water += fresh
        for _ in range(n - fresh):
            slots.append(self._free_list.pop())
        return slots

    def complete_store(
        self, keys: Collection[bytes], ctx: ReqContext | None = None, success: bool = True
    ) -> None:
        """Finish the writes of ``prepare_store`` (spec §2.3).

        ``success``: not-ready keys become readable (one store event). Failure: not-ready keys
        are dropped and their slots freed. Absent or already-ready keys are ignored either way.
        """
        policy = self._policy
        stored = []
        for key in keys:
            block = policy.get(key)
            if block is None or block.ref_cnt != -1:
                continue
            self.num_write_pending -= 1
            if success:
                block.ref_cnt = 0
                self.num_evictable += 1
                policy.mark_evictable(key)
                stored.append(key)
            else:
                policy.remove(key)
                self._free_list.append(block.block_id)
        if stored and self._events is not None:
            self._events.append(OffloadingEvent(stored, Medium.CPU, removed=False))

    # -- lifecycle -------------------------------------------------------------------------
    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        """First sight of a request: the primary tier always answers BLOCK_LEVEL."""
        return RequestOffloadingContext()

    def on_request_finished(self, ctx: ReqContext) -> None:
        """No per-request state is kept by the primary tier."""

    def take_events(self) -> Iterator[OffloadingEvent]:
        """Drain the queued events in order (nothing when events are disabled)."""
        if not self._events:
            return iter(())
        events, self._events = self._events, []
        return iter(events)

    def get_stats(self) -> CPUTierStats:
        """Gauges now, counters since the last call (spec §2.3 ``get_stats``)."""
        stats, self._stats = self._stats, CPUTierStats()
        n = self.num_blocks
        if n:
            allocated = self._high_water - len(self._free_list)
            stats.usage = (allocated - self.num_evictable) / n
            stats.write_usage = self.num_write_pending / n
            stats.read_usage = max(stats.usage - stats.write_usage, 0.0)
        return stats

    def reset_cache(self) -> None:
        """Forget every block unconditionally (spec §2.3); the caller drains transfers first."""
        self._policy.clear()
        self._free_list.clear()
        self._high_water = 0
        self.num_evictable = 0
        self.num_write_pending = 0
