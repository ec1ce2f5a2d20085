"""Least-recently-used eviction, exactly as vLLM's LRU policy (spec §2.4)."""

from __future__ import annotations

from collections.abc import Collection, Iterable

from .._types import ReqContext
from .base import BlockStatus, CachePolicy


class LRUCachePolicy(CachePolicy):
    """LRU over the evictable (``ref_cnt == 0``) blocks.

    * ``mark_evictable`` appends to the most-recent end, so completing a store or the last load
      counts as a use; ``mark_non_evictable`` takes the block out of the order.
    * ``touch(keys)`` walks ``keys`` in reverse and moves each evictable one to the most-recent
      end: after ``touch([a, b, c])`` the order ends ``…, c, b, a`` (prefix heads outlive tails).
    * ``evict(n, protected)`` scans from the least-recent end, skipping protected keys.

    Memory: one dict entry per tracked block plus one per evictable block.
    """

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._blocks: dict[bytes, BlockStatus] = {}
        # Insertion-ordered dict used as an ordered set: oldest first.
        self._evictable: dict[bytes, None] = {}

    def get(self, key: bytes) -> BlockStatus | None:
        return self._blocks.get(key)

    def insert(self, key: bytes, block: BlockStatus) -> None:
        self._blocks[key] = block
        if block.ref_cnt == 0:
            self._evictable[key] = None

    def remove(self, key: bytes) -> None:
        del self._blocks[key]
        self._evictable.pop(key, None)

    def touch(self, keys: Collection[bytes], ctx: ReqContext | None = None) -> None:
        evictable = self._evictable
        for key in reversed(list(keys)):
            if key in evictable:
                del evictable[key]
                evictable[key] = None

    def evict(
        self, n: int, protected: Collection[bytes]
    ) -> list[tuple[bytes, BlockStatus]] | None:
        if n == 0:
            return []
        victims: list[bytes] = []
        for key in self._evictable:
            if key in protected:
                continue
            victims.append(key)
            if len(victims) == n:
                break
        else:
            return None
        out = []
        for key in victims:
            del self._evictable[key]
            out.append((key, self._blocks.pop(key)))
        return out

    def clear(self) -> None:
        self._blocks.clear()
        self._evictable.clear()

    def mark_evictable(self, key: bytes) -> None:
        self._evictable[key] = None

    def mark_non_evictable(self, key: bytes) -> None:
        self._evictable.pop(key, None)

    def keys(self) -> Iterable[bytes]:
        return self._blocks.keys()
