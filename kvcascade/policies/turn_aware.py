"""Turn-aware eviction: keep the blocks of conversations likely to come back soon (issue #9).

Idea (from a study of the Mooncake conversation trace): what separates an optimal cache from
LRU is knowing whether a conversation will continue, and the conversation's **turn number** —
visible in the chained block hashes — predicts it: a request whose leading blocks are the whole
prompt of an earlier request is that conversation's next turn, and later turns continue more
often. The policy therefore

1. keeps a bounded **directory** of recently seen keys (``directory_factor × capacity``
   entries, least recently seen dropped first) remembering, per key, the class and logical time
   of its last read and whether it ended a prompt (and at which turn);
2. on a request's first ``touch`` infers its turn (1 + turn of the deepest earlier prompt end
   among its keys) and its number of new blocks, and files all its blocks under the class
   ``(hint, priority, turn, log2 new blocks)``;
3. learns, per class, the distribution of the time until a block is read again: every read of
   a key still in the directory — hit or miss — is one sample for the class the key had;
4. evicts the block least likely to be read again within the cache's turnover time ``H``:
   for a class with survival function ``S`` and a block of age ``a`` (time since its last
   read), that probability is ``(S(a) − S(a + H)) / S(a)``. A class worth less than every
   resident block is evicted as soon as it is stored — in effect not admitted.

Time is logical: one tick per block inserted, so ``H = horizon_factor × capacity`` ticks is how
long an LRU cache of the same size keeps a block; sample times use the same clock. Wall time
(``clock``) is used only for the ``ttl_s`` of session hints.

Within a class blocks leave oldest first and, for one request, deepest first; in addition a
block with a resident child is passed over while any leaf can go (the "deepest-first" free rule:
no cached block is left without its parent unless only such blocks are evictable).

Cost: ``touch`` O(k log n) for k keys (heap pushes); ``evict(n)`` O(K + n log n) with K the
number of non-empty classes (at most ``3 × 7 × max_turn × 9``, a constant); memory per resident
block one entry (≈ 200 B) and per directory key one entry (≈ 150 B); class statistics
``O(K × 64)`` floats.
"""

from __future__ import annotations

import heapq
import json
import math
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from typing import Any

from .._types import ReqContext
from ..hints import MAX_PRIORITY, hint_of
from .base import BlockStatus, CachePolicy, as_sequence

#: Histogram buckets: bucket ``b`` holds times ``t`` with ``int(2 × log2(t + 1)) == b``.
_BUCKETS = 64
#: Pseudo-count pulling a sparse class towards the pooled distribution of all classes.
_PRIOR = 20.0
#: Value given to blocks past their hint's TTL: below every priority level.
_EXPIRED = -1.0 - 2 * MAX_PRIORITY
#: Format version of :meth:`TurnAwareCachePolicy.save_state` files.
_STATE_VERSION = 1


def _bucket(t: float) -> int:
    """Histogram bucket of a time ``t >= 0`` (ticks)."""
    return min(int(2.0 * math.log2(t + 1.0)), _BUCKETS - 1)


class _Entry:
    """A resident block: its status, class, last-read tick, depth and heap bookkeeping."""

    __slots__ = ("block", "children", "cls", "deadline", "depth", "parent", "tick", "token")

    def __init__(self, block: BlockStatus, parent: bytes | None) -> None:
        self.block = block
        self.cls = 0
        self.tick = 0
        self.depth = 0
        self.deadline: float | None = None
        self.parent = parent
        self.children = 0
        self.token = -1  # heap token; -1: not in any heap (pinned / not ready)


class _Request:
    """Per-request scratch (kept on the ReqContext): the class of the request's blocks."""

    __slots__ = ("cls", "deadline")

    def __init__(self, cls: int, deadline: float | None) -> None:
        self.cls = cls
        self.deadline = deadline


class _ClassStats:
    """Learned re-read time distribution of one class (counts are floats: loaded state)."""

    __slots__ = ("dirty", "heap", "key", "labels", "live", "p", "reads")

    def __init__(self, key: tuple[int, int, int, int]) -> None:
        self.key = key
        self.labels = 0.0  # blocks filed under the class
        self.reads = [0.0] * _BUCKETS  # re-reads by time-to-re-read bucket
        self.p = 0.0  # smoothed P(read again at all)
        self.dirty = True
        self.heap: list[tuple[int, int, int, bytes]] = []  # (tick, -depth, token, key)
        self.live = 0  # valid heap items


class TurnAwareCachePolicy(CachePolicy):
    """Turn-aware eviction; see the module docstring for the model.

    Args:
        cache_capacity: slots of the tier (blocks).
        directory_factor: directory size as a multiple of ``cache_capacity`` (≥ 1; default 4).
        horizon_factor: turnover time ``H`` as a multiple of ``cache_capacity`` ticks
            (> 0; default 1).
        max_turn: turns at or above this share one class (≥ 1; default 8).
        clock: wall clock in seconds for hint TTLs (default ``time.monotonic``).

    Hints (:class:`kvcascade.hints.SessionHint`, from the ``ctx`` of ``touch``): ``continues``
    and ``priority`` become part of the class, so the policy learns what a hint is worth (a
    wrong hint only dilutes its class); a higher ``priority`` outranks every lower one; blocks
    past their ``ttl_s`` are worth nothing.

    Raises:
        ValueError: a parameter out of range.
    """

    uses_hints = True

    def __init__(
        self,
        cache_capacity: int,
        directory_factor: float = 4.0,
        horizon_factor: float = 1.0,
        max_turn: int = 8,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(cache_capacity)
        if directory_factor < 1:
            raise ValueError(f"directory_factor must be >= 1, got {directory_factor}")
        if horizon_factor <= 0:
            raise ValueError(f"horizon_factor must be > 0, got {horizon_factor}")
        if max_turn < 1:
            raise ValueError(f"max_turn must be >= 1, got {max_turn}")
        self.directory_size = max(16, int(directory_factor * cache_capacity))
        self.horizon = max(1.0, horizon_factor * cache_capacity)
        self.max_turn = max_turn
        self.clock = clock
        self._blocks: dict[bytes, _Entry] = {}
        # key -> [class, tick of last read, prompt-end turn (0: none), parent key]
        self._directory: OrderedDict[bytes, list[Any]] = OrderedDict()
        self._classes: list[_ClassStats] = []
        self._class_index: dict[tuple[int, int, int, int], int] = {}
        self._pooled = _ClassStats((0, 0, 0, 0))
        self._shape = [0.0] * (_BUCKETS + 1)  # pooled P(re-read before bucket b | re-read)
        self._tick = 0
        self._token = 0
        self._evictable = 0  # resident blocks with ref_cnt == 0

    # -- classes and statistics --------------------------------------------------------------
    def _class(self, key: tuple[int, int, int, int]) -> int:
        idx = self._class_index.get(key)
        if idx is None:
            idx = len(self._classes)
            self._class_index[key] = idx
            self._classes.append(_ClassStats(key))
        return idx

    def _refresh_shape(self) -> None:
        """Recompute the pooled distribution of the time to a re-read (given one happens)."""
        reads = self._pooled.reads
        total = sum(reads)
        shape = self._shape
        acc = 0.0
        for b in range(_BUCKETS):
            acc += reads[b]
            shape[b + 1] = acc / total if total else 0.0
        self._pooled.dirty = False

    def _refresh(self, stats: _ClassStats) -> None:
        """Recompute the class's probability of being read again, smoothed towards the pool."""
        pooled = self._pooled
        pooled_p = sum(pooled.reads) / pooled.labels if pooled.labels else 0.0
        stats.p = min(1.0, (sum(stats.reads) + _PRIOR * pooled_p) / (stats.labels + _PRIOR))
        stats.dirty = False

    def reread_probability(self, cls: int, age: float) -> float:
        """P(a block of class ``cls`` idle for ``age`` ticks is read within the next ``H``).

        ``p (F(a + H) − F(a)) / (1 − p F(a))`` with ``p`` the class's chance of any re-read and
        ``F`` the pooled distribution of the time to it.
        """
        stats = self._classes[cls]
        if stats.dirty:
            self._refresh(stats)
        if self._pooled.dirty:
            self._refresh_shape()
        shape = self._shape
        p = stats.p
        before = p * shape[_bucket(age)]
        survive = 1.0 - before
        if survive <= 1e-9:
            return 0.0
        return (p * shape[_bucket(age + self.horizon) + 1] - before) / survive

    def _value(self, entry: _Entry, now_s: float | None) -> float:
        if entry.deadline is not None and now_s is not None and now_s > entry.deadline:
            return _EXPIRED
        stats = self._classes[entry.cls]
        return stats.key[1] + self.reread_probability(entry.cls, self._tick - entry.tick)

    def class_table(self) -> list[dict[str, Any]]:
        """Per class: key fields, blocks filed, re-reads, P(re-read within H) when fresh."""
        out = []
        for idx, stats in enumerate(self._classes):
            hint, prio, turn, nb = stats.key
            out.append(
                {
                    "continues": (None, True, False)[hint],
                    "priority": prio,
                    "turn": turn,
                    "new_blocks_log2": nb,
                    "labels": stats.labels,
                    "rereads": sum(stats.reads),
                    "p_reread_within_h": self.reread_probability(idx, 0.0),
                }
            )
        return out

    # -- request classification -------------------------------------------------------------
    def _classify(self, keys: list[bytes], ctx: ReqContext | None) -> _Request:
        """Infer turn and new blocks of the request reading ``keys``; learn from the reads."""
        directory = self._directory
        turn = 1
        known = 0
        matched = -1
        for i in range(len(keys) - 1, 0, -1):
            info = directory.get(keys[i])
            if info is not None and info[2]:
                turn = info[2] + 1
                matched = i
                break
        if matched < 0:
            while known < len(keys) and keys[known] in directory:
                known += 1
        else:
            known = matched + 1
        new_blocks = len(keys) - known
        hint = hint_of(ctx)
        hint_code = 0 if hint is None or hint.continues is None else (1 if hint.continues else 2)
        prio = 0 if hint is None else hint.priority
        cls = self._class(
            (hint_code, prio, min(turn, self.max_turn), min(new_blocks.bit_length(), 8))
        )
        deadline = None
        if hint is not None and hint.ttl_s is not None:
            deadline = self.clock() + hint.ttl_s
        # Learn: each key still in the directory was read again after (now - last tick).
        now = self._tick
        classes = self._classes
        pooled = self._pooled
        target = classes[cls]
        parent: bytes | None = None
        for key in keys:
            info = directory.get(key)
            if info is not None:
                b = _bucket(now - info[1])
                old = classes[info[0]]
                old.reads[b] += 1.0
                old.dirty = True
                pooled.reads[b] += 1.0
                info[0] = cls
                info[1] = now
                info[3] = parent
                directory.move_to_end(key)
            else:
                directory[key] = [cls, now, 0, parent]
            parent = key
        target.labels += len(keys)
        target.dirty = True
        pooled.labels += len(keys)
        pooled.dirty = True
        # Prompt ends: the last two keys (the last block of a prompt may be partial and so
        # absent from the next turn); the root never counts (it may be a shared system prompt).
        for key in keys[-2:] if len(keys) > 2 else keys[1:]:
            directory[key][2] = turn
        while len(directory) > self.directory_size:
            directory.popitem(last=False)
        return _Request(cls, deadline)

    # -- heaps ---------------------------------------------------------------------------------
    def _push(self, key: bytes, entry: _Entry) -> None:
        stats = self._classes[entry.cls]
        self._token += 1
        entry.token = self._token
        heapq.heappush(stats.heap, (entry.tick, -entry.depth, self._token, key))
        stats.live += 1
        if len(stats.heap) > 2 * stats.live + 64:
            blocks = self._blocks
            stats.heap = [
                item
                for item in stats.heap
                if (e := blocks.get(item[3])) is not None and e.token == item[2]
            ]
            heapq.heapify(stats.heap)

    def _unpush(self, entry: _Entry) -> None:
        if entry.token >= 0:
            self._classes[entry.cls].live -= 1
            entry.token = -1

    def _head(self, stats: _ClassStats) -> tuple[int, int, int, bytes] | None:
        """The class's valid oldest item (stale items are dropped), or None."""
        heap = stats.heap
        blocks = self._blocks
        while heap:
            item = heap[0]
            entry = blocks.get(item[3])
            if entry is not None and entry.token == item[2]:
                return item
            heapq.heappop(heap)
        return None

    # -- CachePolicy ---------------------------------------------------------------------------
    def get(self, key: bytes) -> BlockStatus | None:
        entry = self._blocks.get(key)
        return None if entry is None else entry.block

    def _offer(self, key: bytes, entry: _Entry) -> None:
        """Make ``entry`` a candidate if it is idle and a leaf (no resident child)."""
        if entry.token < 0 and not entry.children and entry.block.ref_cnt == 0:
            self._push(key, entry)

    def insert(self, key: bytes, block: BlockStatus) -> None:
        self._tick += 1
        info = self._directory.get(key)
        parent = None if info is None else info[3]
        entry = _Entry(block, None)
        entry.tick = self._tick
        entry.cls = info[0] if info is not None else self._class((0, 0, 1, 0))
        self._blocks[key] = entry
        if parent is not None and (p := self._blocks.get(parent)) is not None:
            entry.parent = parent
            p.children += 1
            self._unpush(p)
        if block.ref_cnt == 0:
            self._evictable += 1
            self._offer(key, entry)

    def _forget(self, key: bytes) -> _Entry:
        entry = self._blocks.pop(key)
        self._unpush(entry)
        if entry.block.ref_cnt == 0:
            self._evictable -= 1
        if entry.parent is not None and (p := self._blocks.get(entry.parent)) is not None:
            p.children -= 1
            self._offer(entry.parent, p)
        return entry

    def remove(self, key: bytes) -> None:
        if key not in self._blocks:
            raise KeyError(key)
        self._forget(key)

    def touch(self, keys: Collection[bytes], ctx: ReqContext | None = None) -> None:
        keys = list(as_sequence(keys))
        if not keys:
            return
        request = None if ctx is None else ctx.get_state(_Request)
        if request is None:
            request = self._classify(keys, ctx)
            if ctx is not None:
                ctx.set_state(request)
        blocks = self._blocks
        tick = self._tick
        for depth, key in enumerate(keys):
            entry = blocks.get(key)
            if entry is None:
                continue
            self._unpush(entry)
            entry.cls = request.cls
            entry.tick = tick
            entry.depth = depth
            entry.deadline = request.deadline
            self._offer(key, entry)

    def mark_evictable(self, key: bytes) -> None:
        self._evictable += 1
        self._offer(key, self._blocks[key])

    def mark_non_evictable(self, key: bytes) -> None:
        self._evictable -= 1
        self._unpush(self._blocks[key])

    def evict(self, n: int, protected: Collection[bytes]) -> list[tuple[bytes, BlockStatus]] | None:
        if n <= 0:
            return []
        blocks = self._blocks
        shielded = 0
        for key in protected:
            entry = blocks.get(key)
            if entry is not None and entry.block.ref_cnt == 0:
                shielded += 1
        if self._evictable - shielded < n:
            return None
        now_s = self.clock()
        classes = self._classes
        heads: list[tuple[float, int]] = []
        for idx, stats in enumerate(classes):
            if stats.live and (item := self._head(stats)) is not None:
                heads.append((self._value(blocks[item[3]], now_s), idx))
        heapq.heapify(heads)
        out: list[tuple[bytes, BlockStatus]] = []
        passed: list[tuple[int, tuple[int, int, int, bytes]]] = []  # protected heads
        while len(out) < n:
            if not heads:
                # Only blocks with a resident (pinned or protected) child are left.
                key = min(
                    (k for k, e in blocks.items() if e.block.ref_cnt == 0 and k not in protected),
                    key=lambda k: (blocks[k].tick, -blocks[k].depth),
                )
                out.append((key, self._forget(key).block))
                continue
            value, idx = heapq.heappop(heads)
            stats = classes[idx]
            item = self._head(stats)
            if item is None:
                continue
            key = item[3]
            current = self._value(blocks[key], now_s)
            if current > value and heads and current > heads[0][0]:
                heapq.heappush(heads, (current, idx))  # stale rank: re-rank the class
                continue
            offered = None
            if key in protected:
                heapq.heappop(stats.heap)
                passed.append((idx, item))
            else:
                entry = self._forget(key)  # may offer its parent to a class heap
                out.append((key, entry.block))
                parent = None if entry.parent is None else blocks.get(entry.parent)
                if parent is not None and parent.token >= 0:
                    offered = parent
            if (nxt := self._head(stats)) is not None:
                heapq.heappush(heads, (self._value(blocks[nxt[3]], now_s), idx))
            if offered is not None:
                heapq.heappush(heads, (self._value(offered, now_s), offered.cls))
        for idx, item in passed:
            heapq.heappush(classes[idx].heap, item)
        return out

    def clear(self) -> None:
        self._blocks.clear()
        self._directory.clear()
        for stats in self._classes:
            stats.heap.clear()
            stats.live = 0
        self._tick = 0
        self._evictable = 0

    def keys(self) -> Iterable[bytes]:
        return self._blocks.keys()

    # -- persistence ---------------------------------------------------------------------------
    def save_state(self, path: str | os.PathLike[str]) -> None:
        """Write the learned class statistics as JSON (atomically: temp file + rename).

        Only the statistics are saved — no keys, no resident blocks. Raises ``OSError``.
        """
        state = {
            "version": _STATE_VERSION,
            "classes": [
                {"key": list(s.key), "labels": s.labels, "reads": s.reads} for s in self._classes
            ],
            "pooled": {"labels": self._pooled.labels, "reads": self._pooled.reads},
        }
        tmp = f"{os.fspath(path)}.tmp"
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(state, handle)
        os.replace(tmp, path)

    def load_state(self, path: str | os.PathLike[str]) -> None:
        """Replace the class statistics with those saved by :meth:`save_state`.

        Resident blocks and the directory are kept. Raises ``OSError`` (unreadable file) or
        ``ValueError`` (not a state file of this version).
        """
        with open(path, encoding="utf-8") as handle:
            try:
                state = json.load(handle)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{os.fspath(path)}: not a policy state file ({exc})") from exc
        try:
            if state["version"] != _STATE_VERSION:
                raise ValueError(f"unsupported state version {state['version']!r}")
            loaded = [
                (
                    tuple(int(v) for v in c["key"]),
                    float(c["labels"]),
                    [float(r) for r in c["reads"]],
                )
                for c in state["classes"]
            ]
            pooled_labels = float(state["pooled"]["labels"])
            pooled_reads = [float(r) for r in state["pooled"]["reads"]]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{os.fspath(path)}: malformed policy state ({exc!r})") from exc
        if (
            any(len(k) != 4 or len(r) != _BUCKETS for k, _, r in loaded)
            or len(pooled_reads) != _BUCKETS
        ):
            raise ValueError(f"{os.fspath(path)}: policy state of another shape")
        for stats in self._classes:
            stats.labels = 0.0
            stats.reads = [0.0] * _BUCKETS
            stats.dirty = True
        for key, labels, reads in loaded:
            stats = self._classes[self._class(key)]  # type: ignore[arg-type]
            stats.labels = labels
            stats.reads = reads
            stats.dirty = True
        self._pooled.labels = pooled_labels
        self._pooled.reads = pooled_reads
