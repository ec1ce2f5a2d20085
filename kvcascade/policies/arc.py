"""Adaptive replacement (ARC) with vLLM 0.32's rules (``vllm/v1/kv_offload/cpu/policies/arc.py``;
docs/cpu-tier.md)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, KeysView, Sequence
from itertools import chain

from .._types import ReqContext
from .base import BlockStatus, CachePolicy, as_sequence, tail_to_head


class ARCCachePolicy(CachePolicy):
    """ARC over the primary tier's blocks; vLLM 0.32's ARC.

    State (capacity ``c = cache_capacity``):

    * ``t1`` — blocks seen once, ``t2`` — blocks used again; both ordered least → most recent
      and mapping key → :class:`BlockStatus`.
    * ``b1`` / ``b2`` — ghost keys recently evicted from ``t1`` / ``t2`` (no slot), each capped
      at ``c`` entries (trimmed from the least-recent end after every eviction).
    * ``target_t1_size`` (``p``, float, starts 0) — the size ARC aims to give ``t1``; always
      within ``[0, c]``.

    Rules (as vLLM): ``insert`` adds to the ``t1`` recent end and drops the key from the ghost
    lists. ``touch(keys)`` walks the keys in reverse: a ``t1`` block moves to the ``t2`` recent
    end when ready, or to the ``t1`` recent end while its write is still in flight; a ``t2``
    block moves to the ``t2`` recent end; a ``b1`` ghost raises ``p`` by ``max(1, |b2|/|b1|)``
    and a ``b2`` ghost lowers it by ``max(1, |b1|/|b2|)`` (clamped to ``[0, c]``), each ghost
    moving to its list's recent end; ``on_store_miss`` applies the same ghost rule to a request's
    store misses. ``on_request_finished``: see the method. ``mark_evictable`` /
    ``mark_non_evictable`` are no-ops: eviction reads ``ref_cnt`` directly, so finishing a load
    does not change recency.

    ``evict(n, protected)`` is one pass over ``t1`` and one over ``t2`` for the whole batch
    (forward-only iterators, never restarted), with a virtual ``|t1|`` that drops by one per
    ``t1`` pick. Per pick: when virtual ``|t1| >= int(p)`` the next ``t1`` block with
    ``ref_cnt == 0`` that is not protected is taken; otherwise, or when ``t1`` has none left,
    the next such ``t2`` block. Victims then move to the recent end of ``b1`` / ``b2`` in pick
    order, and each ghost list is trimmed to ``c``.

    Fallback (vLLM 0.32's too; earlier vLLM failed the eviction): when ``|t1| < int(p)`` and
    ``t2`` has no eligible block left, the pick continues the same ``t1`` iterator, so ``evict``
    returns None only when fewer than ``n`` unpinned, ready, unprotected blocks exist in total.

    Memory: one ordered-dict entry per tracked block (about 100 B) plus, per ghost, one entry
    and the key it keeps alive; ghosts are at most ``2c``.
    """

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._t1: OrderedDict[bytes, BlockStatus] = OrderedDict()
        self._t2: OrderedDict[bytes, BlockStatus] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        self.target_t1_size = 0.0

    # -- inspection (read-only views, least recent first) ------------------------------------
    @property
    def t1(self) -> KeysView[bytes]:
        """Keys seen once, least recent first."""
        return self._t1.keys()

    @property
    def t2(self) -> KeysView[bytes]:
        """Keys used more than once, least recent first."""
        return self._t2.keys()

    @property
    def b1(self) -> KeysView[bytes]:
        """Ghosts of keys evicted from ``t1``, least recent first."""
        return self._b1.keys()

    @property
    def b2(self) -> KeysView[bytes]:
        """Ghosts of keys evicted from ``t2``, least recent first."""
        return self._b2.keys()

    # -- CachePolicy ---------------------------------------------------------------------------
    def get(self, key: bytes) -> BlockStatus | None:
        block = self._t1.get(key)
        return block if block is not None else self._t2.get(key)

    def insert(self, key: bytes, block: BlockStatus) -> None:
        self._t1[key] = block
        if self._b1:
            self._b1.pop(key, None)
        if self._b2:
            self._b2.pop(key, None)

    def remove(self, key: bytes) -> None:
        if self._t1.pop(key, None) is None:
            del self._t2[key]

    def touch(self, keys: Collection[bytes], ctx: ReqContext | None = None) -> None:
        t1, t2 = self._t1, self._t2
        for key in reversed(as_sequence(keys)):
            block = t1.get(key)
            if block is not None:
                if not block.is_ready:
                    t1.move_to_end(key)
                else:
                    del t1[key]
                    t2[key] = block
            elif key in t2:
                t2.move_to_end(key)
            else:
                self._ghost_hit(key)

    def _ghost_hit(self, key: bytes) -> None:
        """A ``b1`` ghost raises ``p`` by ``max(1, |b2|/|b1|)``, a ``b2`` ghost lowers it by
        ``max(1, |b1|/|b2|)`` (clamped to ``[0, c]``); the ghost moves to its list's recent end."""
        b1, b2 = self._b1, self._b2
        if key in b1:
            step = max(1.0, len(b2) / len(b1))
            self.target_t1_size = min(self.target_t1_size + step, self.cache_capacity)
            b1.move_to_end(key)
        elif key in b2:
            step = max(1.0, len(b1) / len(b2))
            self.target_t1_size = max(self.target_t1_size - step, 0.0)
            b2.move_to_end(key)

    def on_store_miss(self, keys: Sequence[bytes], ctx: ReqContext) -> None:
        """vLLM's rule (``kv_offload/cpu/policies/arc.py``): each ghost among the keys, walked in
        reverse, adapts ``p`` as in ``touch``, before ``insert`` drops it."""
        if self._b1 or self._b2:
            for key in reversed(keys):
                self._ghost_hit(key)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[bytes]],
        insertion_only_keys: set[bytes],
        reused_keys: set[bytes],
        ctx: ReqContext,
    ) -> None:
        """vLLM's rule (``kv_offload/cpu/policies/arc.py``), walking the request's keys tail to
        head (groups one after the other): a key it only inserted moves to the recent end of the
        list it is in (a store is no frequency hit: ``t1`` stays ``t1``); a key it reused counts
        as one access (``t1`` → ``t2`` recent end, or ``t2`` recent end); other keys (written by
        another request while this one saw them) do not move."""
        t1, t2 = self._t1, self._t2
        for key in tail_to_head(key_groups):
            if key in insertion_only_keys:
                if key in t1:
                    t1.move_to_end(key)
                elif key in t2:
                    t2.move_to_end(key)
            elif key in reused_keys:
                block = t1.pop(key, None)
                if block is not None:
                    t2[key] = block
                elif key in t2:
                    t2.move_to_end(key)

    def evict(self, n: int, protected: Collection[bytes]) -> list[tuple[bytes, BlockStatus]] | None:
        if n <= 0:
            return []
        t1, t2 = self._t1, self._t2
        it1 = iter(t1.items())
        it2 = iter(t2.items())
        virtual_t1 = len(t1)
        target = int(self.target_t1_size)
        picks: list[tuple[bytes, BlockStatus]] = []
        from_t1: list[bool] = []
        for _ in range(n):
            pick = None
            if virtual_t1 >= target:
                pick = _next_eligible(it1, protected)
            if pick is not None:
                virtual_t1 -= 1
                from_t1.append(True)
            else:
                pick = _next_eligible(it2, protected)
                if pick is not None:
                    from_t1.append(False)
                else:
                    # The fallback (class docstring); a no-op if t1 was already exhausted.
                    pick = _next_eligible(it1, protected)
                    if pick is None:
                        return None
                    virtual_t1 -= 1
                    from_t1.append(True)
            picks.append(pick)
        b1, b2 = self._b1, self._b2
        for (key, _), in_t1 in zip(picks, from_t1):
            if in_t1:
                del t1[key]
                b1[key] = None
            else:
                del t2[key]
                b2[key] = None
        capacity = self.cache_capacity
        while len(b1) > capacity:
            b1.popitem(last=False)
        while len(b2) > capacity:
            b2.popitem(last=False)
        return picks

    def clear(self) -> None:
        self._t1.clear()
        self._t2.clear()
        self._b1.clear()
        self._b2.clear()
        self.target_t1_size = 0.0

    def keys(self) -> Iterable[bytes]:
        return chain(self._t1.keys(), self._t2.keys())


def _next_eligible(
    items: Iterable[tuple[bytes, BlockStatus]], protected: Collection[bytes]
) -> tuple[bytes, BlockStatus] | None:
    """Advance ``items`` to its next idle (``ref_cnt == 0``), unprotected entry, or None."""
    for item in items:
        if item[1].ref_cnt == 0 and item[0] not in protected:
            return item
    return None
