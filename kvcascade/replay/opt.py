"""Belady's OPT for the prefix-level cache model of ``kvcascade replay --compare-policies``.

Model (see :mod:`.compare`): one cache of ``capacity`` blocks; request ``r`` reads its
blocks in order and hits the leading run that is cached; afterwards any of its storable blocks
may be cached, within capacity. OPT knows the future: it caches a block unless it is never read
again or every cached block is needed sooner, and evicts the block whose next read is furthest
away — the deepest one on ties. Since a block is read whenever any of its descendants is, its
next read is never later than theirs, so OPT's cache is always prefix-closed and its block
hits are prefix hits: no policy can do better (the tests check this against brute force).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

_NEVER = 1 << 62


def belady_hits(
    requests: Sequence[Sequence[int]],
    capacity: int,
    storable: Sequence[int] | None = None,
) -> int:
    """Prefix-level hit blocks of Belady's OPT.

    Args:
        requests: per request, its chained block ids in order.
        capacity: cache size in blocks (``>= 0``).
        storable: per request, how many leading blocks may be cached (default: all) — the
            free rule that never stores a prompt's partial last block.

    Returns:
        The number of block instances hit (sum over requests of the cached leading run).
    """
    n = len(requests)
    next_use: list[list[int]] = [[]] * n
    last: dict[int, int] = {}
    for r in range(n - 1, -1, -1):
        ids = requests[r]
        next_use[r] = [last.get(h, _NEVER) for h in ids]
        for h in ids:
            last[h] = r
    cached: dict[int, tuple[int, int]] = {}  # id -> (next read, depth)
    heap: list[tuple[int, int, int]] = []  # (-next read, -depth, id); stale items skipped
    hits = 0
    for r, ids in enumerate(requests):
        run = 0
        for h in ids:
            if h not in cached:
                break
            run += 1
        hits += run
        limit = len(ids) if storable is None else storable[r]
        for depth, h in enumerate(ids):
            nxt = next_use[r][depth]
            if h in cached:
                if nxt == _NEVER:
                    del cached[h]
                else:
                    cached[h] = (nxt, depth)
                    heapq.heappush(heap, (-nxt, -depth, h))
                continue
            if nxt == _NEVER or depth >= limit or capacity <= 0:
                continue
            if len(cached) >= capacity:
                while cached.get(heap[0][2]) != (-heap[0][0], -heap[0][1]):
                    heapq.heappop(heap)
                far, deep, victim = heap[0]
                if (nxt, depth) > (-far, -deep):
                    continue  # needed later than everything cached: bypass
                heapq.heappop(heap)
                del cached[victim]
            cached[h] = (nxt, depth)
            heapq.heappush(heap, (-nxt, -depth, h))
    return hits
