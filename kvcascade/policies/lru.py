"""Least-recently-used eviction with vLLM's LRU semantics (``kv_offload/cpu/policies/lru.py``)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence

from .._types import ReqContext
from .base import BlockStatus, CachePolicy, as_sequence, tail_to_head


class LRUCachePolicy(CachePolicy):
    """LRU over the evictable (``ref_cnt == 0``) blocks; same eviction order as vLLM 0.32's policy
    (recency independent of transfer pinning).

    * ``insert`` (``prepare_store``) makes a key the most recent; completing its store or its
      last load does not move it (vLLM ranks a key at insert, re-ranks it only on a use).
    * ``touch(keys)`` walks ``keys`` in reverse and moves each tracked one — pinned and not-ready
      ones too — to the most-recent end: after ``touch([a, b, c])`` the order ends
      ``…, c, b, a`` (prefix heads outlive tails).
    * ``on_request_finished`` does the same for every key the request presented
      (:meth:`CachePolicy.on_request_finished`): its deepest block is evicted first.
    * ``evict(n, protected)`` scans from the least-recent end, skipping protected keys and blocks
      whose ``ref_cnt != 0``.

    Representation (differs from vLLM, same observable order): one ``OrderedDict`` holds every
    tracked block in rank order, where vLLM keeps ranks and a lazy min-heap of the evictable
    keys; the evictable keys come out in increasing rank in both. A pinned block keeps its place
    and is skipped by ``evict``, so an eviction costs O(n + pinned blocks older than the
    victims). Memory: one ordered-dict entry (about 100 B) per tracked block.
    """

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._blocks: OrderedDict[bytes, BlockStatus] = OrderedDict()

    def get(self, key: bytes) -> BlockStatus | None:
        return self._blocks.get(key)

    def insert(self, key: bytes, block: BlockStatus) -> None:
        self._blocks[key] = block

    def remove(self, key: bytes) -> None:
        del self._blocks[key]

    def touch(self, keys: Collection[bytes], ctx: ReqContext | None = None) -> None:
        blocks = self._blocks
        move = blocks.move_to_end
        for key in reversed(as_sequence(keys)):
            if key in blocks:
                move(key)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[bytes]],
        insertion_only_keys: set[bytes],
        reused_keys: set[bytes],
        ctx: ReqContext,
    ) -> None:
        """vLLM's rule (``kv_offload/cpu/policies/lru.py``): the request's keys, groups one
        after the other, become the most recent, tail to head — its head block most recent, its
        deepest block the least recent of them (evicted first). Pinned and not-ready keys move
        too, as in ``touch``."""
        blocks = self._blocks
        move = blocks.move_to_end
        for key in tail_to_head(key_groups):
            if key in blocks:
                move(key)

    def evict(self, n: int, protected: Collection[bytes]) -> list[tuple[bytes, BlockStatus]] | None:
        if n <= 0:
            return []
        victims: list[tuple[bytes, BlockStatus]] = []
        for item in self._blocks.items():
            if item[1].ref_cnt == 0 and item[0] not in protected:
                victims.append(item)
                if len(victims) == n:
                    break
        else:
            return None
        blocks = self._blocks
        for key, _ in victims:
            del blocks[key]
        return victims

    def clear(self) -> None:
        self._blocks.clear()

    def keys(self) -> Iterable[bytes]:
        return self._blocks.keys()

    def evictable_keys(self) -> list[bytes]:
        """The evictable keys, least recent first (the order ``evict`` takes them in)."""
        return [key for key, block in self._blocks.items() if block.ref_cnt == 0]
