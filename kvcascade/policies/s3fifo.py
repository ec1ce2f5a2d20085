"""S3-FIFO eviction: a small probation FIFO, a main FIFO and a ghost FIFO (issue #19's suite).

A baseline of ``benchmarks/policy_suite.py`` (docs/policies.md): three FIFO queues instead of
recency lists, after the S3-FIFO design (small queue ``S`` of 10 % of the slots, main queue
``M``, ghost queue ``G`` of evicted keys; a 2-bit access counter per block).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable

from .._types import ReqContext
from .base import BlockStatus, CachePolicy, as_sequence

#: Cap of a block's access counter (2 bits).
_MAX_FREQ = 3


class _Entry:
    __slots__ = ("block", "freq", "req")

    def __init__(self, block: BlockStatus, req: str | None) -> None:
        self.block = block
        self.freq = 0
        self.req = req  # the request that stored the block (its own touches are no reuse)


class S3FIFOCachePolicy(CachePolicy):
    """S3-FIFO over the primary tier's blocks.

    * ``insert`` puts a block at the tail of ``M`` when its key is in the ghost queue ``G``
      (it was evicted from ``S`` recently and came back), else at the tail of ``S``.
    * ``touch(keys, ctx)``: each resident key of another request than the one that stored it
      (the first request to touch it after the store) counts one access (counter capped at 3;
      the several touches of one request are one access; without ``ctx`` every touch counts).
      A block in ``S`` touched by the request that stored it moves to the tail, walking
      ``keys`` in reverse, so within a request the head is evicted last (deepest first).
    * ``evict(n, protected)``: while ``|S| ≥ 10 %`` of the slots (or ``M`` has nothing to give),
      the head of ``S`` goes to ``M``'s tail if it was accessed, else it is evicted and its key
      enters ``G`` (capped at the slot count, oldest dropped); otherwise the head of ``M`` is
      evicted if its counter is 0, else it goes back to ``M``'s tail with the counter minus one.
      Pinned, not-ready and protected blocks are rotated to their queue's tail unchanged.

    ``evict`` returns None and changes nothing when fewer than ``n`` idle, unprotected blocks
    exist. Cost: ``touch`` O(k); ``evict(n)`` O(n + blocks passed over), amortised O(1) per
    victim since each pass over ``M`` lowers counters. Memory: one ordered-dict entry and one
    small object per block (≈ 200 B), one entry per ghost.
    """

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._small: OrderedDict[bytes, _Entry] = OrderedDict()
        self._main: OrderedDict[bytes, _Entry] = OrderedDict()
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self._evictable = 0
        self._small_target = max(1, cache_capacity // 10)

    def _entry(self, key: bytes) -> _Entry | None:
        entry = self._small.get(key)
        return entry if entry is not None else self._main.get(key)

    def get(self, key: bytes) -> BlockStatus | None:
        entry = self._entry(key)
        return None if entry is None else entry.block

    def insert(self, key: bytes, block: BlockStatus) -> None:
        entry = _Entry(block, None)
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = entry
        else:
            self._small[key] = entry
        if block.ref_cnt == 0:
            self._evictable += 1

    def _forget(self, key: bytes) -> _Entry:
        entry = self._small.pop(key, None)
        if entry is None:
            entry = self._main.pop(key)
        if entry.block.ref_cnt == 0:
            self._evictable -= 1
        return entry

    def remove(self, key: bytes) -> None:
        if self._entry(key) is None:
            raise KeyError(key)
        self._forget(key)

    def touch(self, keys: Collection[bytes], ctx: ReqContext | None = None) -> None:
        req = None if ctx is None else ctx.req_id
        small, main = self._small, self._main
        for key in reversed(as_sequence(keys)):
            entry = small.get(key)
            in_small = entry is not None
            if entry is None:
                entry = main.get(key)
                if entry is None:
                    continue
            if req is not None and (entry.req is None or entry.req == req):
                entry.req = req  # the storing request (its first touch after the store)
                if in_small and entry.freq == 0:
                    small.move_to_end(key)
            else:
                entry.freq = min(entry.freq + 1, _MAX_FREQ)
                entry.req = req

    def evict(self, n: int, protected: Collection[bytes]) -> list[tuple[bytes, BlockStatus]] | None:
        if n <= 0:
            return []
        shielded = 0
        for key in protected:
            entry = self._entry(key)
            if entry is not None and entry.block.ref_cnt == 0:
                shielded += 1
        if self._evictable - shielded < n:
            return None
        small, main, ghost = self._small, self._main, self._ghost
        out: list[tuple[bytes, BlockStatus]] = []
        passed_small = passed_main = 0  # ineligible blocks rotated since the last progress
        while len(out) < n:
            use_small = small and passed_small < len(small)
            if use_small and len(small) < self._small_target and passed_main < len(main):
                use_small = False
            if use_small:
                key, entry = small.popitem(last=False)
                if entry.block.ref_cnt != 0 or key in protected:
                    small[key] = entry
                    passed_small += 1
                elif entry.freq:
                    entry.freq -= 1
                    main[key] = entry
                    passed_small = 0
                else:
                    self._evictable -= 1
                    ghost[key] = None
                    out.append((key, entry.block))
                    passed_small = 0
            else:
                key, entry = main.popitem(last=False)
                if entry.block.ref_cnt != 0 or key in protected:
                    main[key] = entry
                    passed_main += 1
                elif entry.freq:
                    entry.freq -= 1
                    main[key] = entry
                else:
                    self._evictable -= 1
                    out.append((key, entry.block))
                    passed_main = 0
        while len(ghost) > self.cache_capacity:
            ghost.popitem(last=False)
        return out

    def mark_evictable(self, key: bytes) -> None:
        self._evictable += 1

    def mark_non_evictable(self, key: bytes) -> None:
        self._evictable -= 1

    def clear(self) -> None:
        self._small.clear()
        self._main.clear()
        self._ghost.clear()
        self._evictable = 0

    def keys(self) -> Iterable[bytes]:
        return [*self._small.keys(), *self._main.keys()]
