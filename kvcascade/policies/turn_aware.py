"""Turn-aware eviction: keep the blocks of conversations likely to come back soon (issue #9).

Idea (from a study of the Mooncake conversation trace): what separates an optimal cache from
LRU is knowing whether a conversation will continue, and the conversation's **turn number** —
visible in the chained block hashes — predicts it: a request whose leading blocks are the whole
prompt of an earlier request is that conversation's next turn, and later turns continue more
often. The policy therefore

1. keeps a bounded **directory** of recently read keys (``max(min_directory,
   directory_factor × capacity)`` entries, least recently read dropped first) remembering, per
   key, the class and logical time of its last read, whether it ended a prompt (and at which
   turn) and its reader's hint deadline (``ttl_s``: a block the reader stores gets it);
2. on a request's first ``touch`` infers its turn (1 + turn of the deepest earlier prompt end
   among its keys) and its number of new blocks, and files all its blocks under the class
   ``(hint, priority, turn, log2 new blocks)`` — except the blocks a request hinted
   ``continues=False`` read again, filed by whether another conversation read them last (a
   session that ends says nothing of the prefix it shares);
3. learns from every read of a key still in the directory — hit or miss — one sample of "time
   until read again" for the class the key had. Per class it keeps ``p``, the chance that a
   block is read again at all (re-reads / blocks filed), smoothed towards its turn's ``p`` and
   that towards the pool's with ``_PRIOR`` pseudo-blocks; the *shape* ``F`` of the time to a
   re-read is pooled over all classes (per-class shapes are too noisy in their tails). The root
   block is left out of the learning: every conversation shares it, so its re-reads say
   nothing about its class;
4. evicts the block least likely to be read again within the cache's turnover time ``H``: for
   a block of age ``a`` (time since its last read) that probability is
   ``p (F(a + H) − F(a)) / (1 − p F(a))``;
5. **admission**: a request's new blocks are stored only when a fresh block of its class is
   worth at least ``admission_margin`` times the cheapest evictable block (see :meth:`admits`;
   the caller — :meth:`kvcascade.coordinator.TieringCoordinator.prepare_store` when the
   cascade has no secondary tier, and the ``--compare-policies`` replay — asks through
   :func:`kvcascade.hints.admits_new_blocks`).

Time is logical: one tick per block a request reads (hit or miss, counted when the request is
classified), a clock that does not depend on the cache's own decisions. The turnover time is
measured, not assumed: ``H = horizon_factor × max(capacity, 2 × mean age of the resident
blocks)`` ticks (a cache whose blocks leave at age ``T`` holds blocks of mean age ``T / 2``).
A small cache that admits little keeps what it admits for many times its capacity in ticks, and
``H`` follows. Wall time (``clock``) is used only for the ``ttl_s`` of session hints.

Within a class blocks leave oldest first and, for one request, deepest first; in addition a
block with a resident child is passed over while any leaf can go (the "deepest-first" free rule:
no cached block is left without its parent unless only such blocks are evictable). Classes that
nothing distinguishes yet (cold start) tie, and ties go oldest first: an untrained policy is LRU.

Cost: ``touch`` O(k log n) for k keys (heap pushes); ``evict(n)`` and :meth:`admits` O(K + n
log n) with K the number of non-empty classes (at most ``4 × 7 × max_turn × 9 + 7``, a
constant);
the pooled shape is recomputed (O(64)) at most once per such call after it learned something.
Memory: one entry per slot, made when the policy is built and reused (≈ 100 B; none is
allocated per insert, so the garbage collector has nothing new to scan), per resident block a
dict item and its heap item, per directory key a tuple (≈ 88 B) and its ordered-dict item; a
request hinted ``continues=False`` keeps a list item (8 B) per block of its known prefix on its
context.
"""

from __future__ import annotations

import heapq
import json
import math
import os
import stat
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

from .._atomic import replace_file
from .._errors import ConfigError
from .._types import ReqContext
from .._validate import check_int, check_number, finite_number
from ..hints import MAX_PRIORITY, hint_of
from .base import BlockStatus, CachePolicy, as_sequence

#: Histogram buckets: bucket ``b`` holds times ``t`` with ``int(2 × log2(t + 1)) == b``.
_BUCKETS = 64
#: Pseudo-count (blocks) pulling a sparse class towards its turn, and a turn towards the pool.
_PRIOR = 20.0
#: Value given to blocks past their hint's TTL: below every priority level.
_EXPIRED = -1.0 - 2 * MAX_PRIORITY
#: Format version of :meth:`TurnAwareCachePolicy.save_state` files.
_STATE_VERSION = 2
#: Largest state file :func:`read_state_file` reads (bytes); a state of every class is 41 KiB.
MAX_STATE_BYTES = 1 << 20

#: A heap item's order is ``tick << _ORDER_SHIFT`` minus the depth: (tick, -depth) in one int, for
#: depths below 2**32.
_ORDER_SHIFT = 32

#: The hint field of a class key: no ``continues`` hint; ``continues=True``; a block new to a
#: request hinted ``continues=False`` (every block of one that read at most its root again); a
#: block such a request read again that its own conversation read last ("own prefix"); one
#: that another conversation read last ("shared prefix", one class per priority: turn 1, new
#: blocks 0).
_NO_HINT, _CONTINUES, _ENDS, _ENDS_OWN, _ENDS_SHARED = range(5)

ClassKey = tuple[int, int, int, int]


def _bucket(t: float) -> int:
    """Histogram bucket of a time ``t >= 0`` (ticks)."""
    return min(int(2.0 * math.log2(t + 1.0)), _BUCKETS - 1)


def _cdf(cum: list[float], t: float) -> float:
    """The cumulative histogram ``cum`` at time ``t`` (ticks), interpolated within its bucket
    (linear in ``log2(t + 1)``)."""
    x = 2.0 * math.log2(t + 1.0)
    b = int(x)
    if b >= _BUCKETS:
        return cum[_BUCKETS]
    return cum[b] + (x - b) * (cum[b + 1] - cum[b])


def _first_prompt_end(n: int) -> int:
    """Index of the first of the keys a next turn of an ``n``-key prompt is recognised by: the
    last two (the last block of a prompt may be partial and so absent from the next turn);
    never the root (it may be a shared system prompt)."""
    return n - 2 if n > 2 else 1


def _prompt_ends(keys: Sequence[bytes]) -> Sequence[bytes]:
    """The keys a next turn of the prompt ``keys`` is recognised by (:func:`_first_prompt_end`)."""
    return keys[_first_prompt_end(len(keys)) :]


class _Entry:
    """A resident block: ``block`` (its status), ``cls``, ``tick`` (of its last read),
    ``depth``, ``deadline`` (hint TTL, wall seconds, or None), ``parent`` (the parent's key
    when it was resident at the insert), ``up`` (the parent's entry that counted this block
    among its ``children``: a parent removed and stored again is another entry, which never
    counted it) and ``token`` (heap token; -1: in no heap — pinned or not ready).

    Entries are made once, when the policy is built (one per slot, fields unset until
    :meth:`TurnAwareCachePolicy.insert`), and reused: a policy that allocated one per insert
    kept the garbage collector's full collections busy scanning them (docs/policies.md,
    ``turn_aware``'s **Cost**)."""

    __slots__ = ("block", "children", "cls", "deadline", "depth", "parent", "tick", "token", "up")


def read_state_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON object of a policy state file (:meth:`TurnAwareCachePolicy.save_state`); its
    contents are checked by :meth:`TurnAwareCachePolicy.set_state`.

    The file is opened non-blocking and checked on the open descriptor to be a regular file
    (a FIFO or a device would block the read), then at most :data:`MAX_STATE_BYTES` are read.

    Raises:
        OSError: the file cannot be opened or read.
        ValueError: not a regular file, larger than :data:`MAX_STATE_BYTES`, not JSON (also an
            integer of more than 4 300 digits) or not a JSON object.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        with open(fd, "rb", closefd=False) as handle:
            raw = handle.read(MAX_STATE_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > MAX_STATE_BYTES:
        raise ValueError(f"not a policy state file (larger than {MAX_STATE_BYTES:,} bytes)")
    try:
        state = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"not a policy state file ({exc})") from None
    if not isinstance(state, dict):
        raise ValueError(f"not a policy state file (a JSON object, not {type(state).__name__})")
    return state


def _expired(entry: _Entry, now_s: float | None) -> bool:
    """Whether ``entry`` is past its hint's ``ttl_s`` at wall time ``now_s`` (seconds)."""
    return entry.deadline is not None and now_s is not None and now_s > entry.deadline


class _Request:
    """Per-request scratch (kept on the ReqContext): the class of the request's blocks,
    ``prefix`` (the classes of its first ``len(prefix)`` blocks where they differ from ``cls``:
    the known prefix of a request hinted ``continues=False``; else empty) and ``prev``, the
    prompt-end key of the earlier turn it continues (None: a first turn), for the policy
    ``owner`` (a context read by another policy is classified there afresh: ``cls`` indexes the
    owner's classes)."""

    __slots__ = ("cls", "deadline", "owner", "prefix", "prev")

    def __init__(
        self,
        cls: int,
        deadline: float | None,
        prev: bytes | None = None,
        owner: object = None,
        prefix: Sequence[int] = (),
    ) -> None:
        self.cls = cls
        self.deadline = deadline
        self.prev = prev
        self.owner = owner
        self.prefix = prefix


class _Counts:
    """Blocks filed under a class or a turn (``labels``) and how many were read again."""

    __slots__ = ("labels", "reads")

    def __init__(self) -> None:
        self.labels = 0.0  # floats: loaded state
        self.reads = 0.0


class _ClassStats(_Counts):
    """A class: its counts, its turn's counts and the heap of its evictable leaf blocks."""

    __slots__ = ("group", "heap", "key", "live")

    def __init__(self, key: ClassKey, group: _Counts) -> None:
        super().__init__()
        self.key = key
        self.group = group
        # (tick << 32 - depth, token, key): oldest first, then deepest first, in one int (a
        # tuple compare then stops at the first item: _ORDER_SHIFT)
        self.heap: list[tuple[int, int, bytes]] = []
        self.live = 0  # valid heap items


class TurnAwareCachePolicy(CachePolicy):
    """Turn-aware eviction with admission control; see the module docstring for the model.

    Args:
        cache_capacity: slots of the tier (blocks).
        directory_factor: directory size as a multiple of ``cache_capacity`` (≥ 1; default 4).
        min_directory: the directory holds at least this many keys (≥ 0; default 65 536, about
            10 MB): a small cache that admits little keeps blocks far longer than
            ``cache_capacity`` ticks, and the directory must reach back further than that to
            see conversations come back and infer their turns.
        horizon_factor: turnover time ``H`` as a multiple of the measured one (> 0; default 1).
        max_turn: turns at or above this share one class (≥ 1; default 5).
        admission_margin: store a request's new blocks only if a fresh block of its class is
            worth at least this multiple of the cheapest evictable block (≥ 0; default 1.5;
            None: store everything and let eviction sort it out).
        clock: wall clock in seconds for hint TTLs (default ``time.monotonic``).

    Hints (:class:`kvcascade.hints.SessionHint`, from the ``ctx`` of ``touch``): ``continues``
    and ``priority`` become part of the class, so the policy learns what a hint is worth (a
    wrong hint only dilutes its class); a higher ``priority`` outranks every lower one; blocks
    past their ``ttl_s`` are worth nothing. Of a request hinted ``continues=False`` only the new
    blocks are filed under its class; the blocks it read again (its known prefix) go to an
    *own-prefix* class (of its turn and new blocks) where its own conversation read them last,
    to the *shared-prefix* class of its priority where another conversation did (a
    conversation: a first turn and the turns that continue it; docs/policies.md, **Hints**).

    Raises:
        ConfigError (a ValueError): a parameter of another type or out of range (naming it and
            the value): a count not an int, a factor NaN, infinite or not a number.
    """

    uses_hints = True
    #: File name of the saved state beside the fs tier's ``config.json``
    #: (:mod:`kvcascade._policy_state`).
    state_file_name = "turn_aware_state.json"

    def __init__(
        self,
        cache_capacity: int,
        directory_factor: float = 4.0,
        min_directory: int = 1 << 16,
        horizon_factor: float = 1.0,
        max_turn: int = 5,
        admission_margin: float | None = 1.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(cache_capacity)
        directory_factor = check_number("directory_factor", directory_factor, 1)
        check_int("min_directory", min_directory, 0)
        horizon_factor = check_number("horizon_factor", horizon_factor, 0, above=True)
        check_int("max_turn", max_turn, 1)
        if admission_margin is not None:
            admission_margin = check_number("admission_margin", admission_margin, 0)
        if not callable(clock):
            raise ConfigError(f"clock must be a callable returning seconds, got {clock!r:.40}")
        self.directory_size = max(16, min_directory, int(directory_factor * cache_capacity))
        self.horizon_factor = horizon_factor
        self.max_turn = max_turn
        self.admission_margin = admission_margin
        self.clock = clock
        self._blocks: dict[bytes, _Entry] = {}
        # Entries not in use (_Entry): one per slot, so that inserts allocate nothing.
        self._spare = [_Entry() for _ in range(cache_capacity)]
        # key -> (class, tick of last read, prompt-end turn (0: none), parent key, conversation
        # of the last read: the tick of its first turn's classification + 1, the hint deadline
        # of the last reader: what ``insert`` gives a block its reader stores)
        self._directory: OrderedDict[
            bytes, tuple[int, int, int, bytes | None, int, float | None]
        ] = OrderedDict()
        self._classes: list[_ClassStats] = []
        self._class_index: dict[ClassKey, int] = {}
        self._groups: dict[tuple[int, int, int], _Counts] = {}
        self._pooled = _Counts()
        self._pooled_reads = [0.0] * _BUCKETS  # re-reads by time-to-re-read bucket
        self._shape = [0.0] * (_BUCKETS + 1)  # pooled P(re-read before bucket b | re-read)
        self._shape_dirty = True
        self._tick = 0  # blocks read so far
        # (class, tick) -> value, valid at (tick, horizon) ``_values_at`` (_valuer)
        self._values: dict[tuple[int, int], float] = {}
        self._values_at: tuple[int, float] | None = None
        self._token = 0
        self._evictable = 0  # resident blocks with ref_cnt == 0
        self._tick_sum = 0  # sum of the resident blocks' last-read ticks

    # -- classes and statistics --------------------------------------------------------------
    def _class(self, key: ClassKey) -> int:
        idx = self._class_index.get(key)
        if idx is None:
            group = self._groups.get(key[:3])  # type: ignore[call-overload]
            if group is None:
                group = self._groups[key[:3]] = _Counts()  # type: ignore[index]
            idx = len(self._classes)
            self._class_index[key] = idx
            self._classes.append(_ClassStats(key, group))
        return idx

    def _pooled_shape(self) -> list[float]:
        """The pooled distribution of the time to a re-read, given one happens (cumulative by
        bucket; recomputed when it learned something)."""
        if self._shape_dirty:
            reads = self._pooled_reads
            total = sum(reads)
            shape = self._shape
            acc = 0.0
            for b in range(_BUCKETS):
                acc += reads[b]
                shape[b + 1] = acc / total if total else 0.0
            self._shape_dirty = False
        return self._shape

    def reuse_probability(self, cls: int) -> float:
        """Smoothed P(a block of class ``cls`` is read again at all, within the directory)."""
        pooled = self._pooled
        p = min(1.0, pooled.reads / pooled.labels) if pooled.labels else 0.0
        stats = self._classes[cls]
        group = stats.group
        p = (group.reads + _PRIOR * p) / (group.labels + _PRIOR)
        return min(1.0, (stats.reads + _PRIOR * p) / (stats.labels + _PRIOR))

    def turnover(self) -> float:
        """The cache's turnover time ``H`` (ticks): ``horizon_factor × max(capacity, twice the
        mean age of the resident blocks)``, at least 1."""
        horizon = float(self.cache_capacity)
        if self._blocks:
            horizon = max(horizon, 2.0 * (self._tick - self._tick_sum / len(self._blocks)))
        return max(1.0, self.horizon_factor * horizon)

    def reread_probability(self, cls: int, age: float, horizon: float | None = None) -> float:
        """P(a block of class ``cls`` idle for ``age`` ticks is read within the next
        ``horizon`` ticks (default: the turnover time ``H``)).

        ``p (F(a + H) − F(a)) / (1 − p F(a))`` with ``p`` the class's chance of any re-read and
        ``F`` the pooled distribution of the time to it.
        """
        if horizon is None:
            horizon = self.turnover()
        shape = self._pooled_shape()
        p = self.reuse_probability(cls)
        before = p * _cdf(shape, age)
        survive = 1.0 - before
        if survive <= 1e-9:
            return 0.0
        return (p * _cdf(shape, age + horizon) - before) / survive

    def _value(self, entry: _Entry, now_s: float | None, horizon: float) -> float:
        if _expired(entry, now_s):
            return _EXPIRED
        stats = self._classes[entry.cls]
        return stats.key[1] + self.reread_probability(entry.cls, self._tick - entry.tick, horizon)

    def class_table(self) -> list[dict[str, Any]]:
        """Per class: key fields, blocks filed, re-reads, P(re-read within H) when fresh."""
        out = []
        horizon = self.turnover()
        for idx, stats in enumerate(self._classes):
            hint, prio, turn, nb = stats.key
            out.append(
                {
                    "continues": (None, True, False, False, False)[hint],
                    "prefix": (None, None, None, "own", "shared")[hint],
                    "priority": prio,
                    "turn": turn,
                    "new_blocks_log2": nb,
                    "labels": stats.labels,
                    "rereads": stats.reads,
                    "p_reread_within_h": self.reread_probability(idx, 0.0, horizon),
                }
            )
        return out

    # -- request classification -------------------------------------------------------------
    def _classify(self, keys: Sequence[bytes], ctx: ReqContext | None) -> _Request:
        """Infer turn and new blocks of the request reading ``keys``; learn from the reads;
        advance the clock by ``len(keys)`` ticks."""
        directory = self._directory
        now = self._tick
        turn = 1
        known = 0
        matched = -1
        conv = now + 1  # a first turn starts a conversation
        # The deepest earlier prompt end (never the root); a C-level check first, since most
        # keys of a request are new.
        search = len(keys) - 1 if not directory.keys().isdisjoint(keys[1:]) else 0
        for i in range(search, 0, -1):
            info = directory.get(keys[i])
            if info is not None and info[2]:
                turn = info[2] + 1
                matched = i
                conv = info[4]
                break
        if matched < 0:
            while known < len(keys) and keys[known] in directory:
                known += 1
        else:
            known = matched + 1
        new_blocks = len(keys) - known
        hint = hint_of(ctx)
        hint_code = (
            _NO_HINT
            if hint is None or hint.continues is None
            else (_CONTINUES if hint.continues else _ENDS)
        )
        prio = 0 if hint is None else hint.priority
        shape = (prio, min(turn, self.max_turn), min(new_blocks.bit_length(), 8))
        cls = self._class((hint_code, *shape))
        # A session that ends says nothing of the blocks it read again: its known prefix is
        # filed by who read each block last, its own conversation or another one (a shared
        # prefix; docs/policies.md, turn_aware's **Hints**).
        prefix: list[int] = []
        if hint_code == _ENDS and known > 1:
            own = self._class((_ENDS_OWN, *shape))
            shared = self._class((_ENDS_SHARED, prio, 1, 0))
            for key in keys[:known]:
                info = directory.get(key)
                prefix.append(own if info is None or info[4] == conv else shared)
        deadline = None
        if hint is not None and hint.ttl_s is not None:
            deadline = self.clock() + hint.ttl_s
        # Learn: each key still in the directory was read again after (now - last tick). The
        # root (shared by every conversation) is neither a sample nor a label.
        # Directory entries are tuples of ints, floats and bytes, which the garbage collector stops
        # tracking (a list per key was one more object for each full collection to scan:
        # docs/policies.md, turn_aware's **Cost**).
        classes = self._classes
        pooled_reads = self._pooled_reads
        reads = 0
        parent: bytes | None = None
        ends = _first_prompt_end(len(keys))  # keys[ends:] are the prompt ends
        split = len(prefix)
        for depth, key in enumerate(keys):
            c = prefix[depth] if depth < split else cls
            info = directory.get(key)
            if info is None:
                directory[key] = (c, now, turn if depth >= ends else 0, parent, conv, deadline)
            else:
                if depth or len(keys) == 1:
                    old = classes[info[0]]
                    old.reads += 1.0
                    old.group.reads += 1.0
                    pooled_reads[_bucket(now - info[1])] += 1.0
                    reads += 1
                end_turn = turn if depth >= ends else info[2]
                directory[key] = (c, now, end_turn, parent, conv, deadline)
                directory.move_to_end(key)
            parent = key
        labels = float(len(keys) - 1 if len(keys) > 1 else 1)
        self._pooled.labels += labels
        for c in prefix[1:]:  # the root is no label
            classes[c].labels += 1.0
            classes[c].group.labels += 1.0
            labels -= 1.0
        target = classes[cls]
        target.labels += labels
        target.group.labels += labels
        self._pooled.reads += reads
        if reads:
            self._shape_dirty = True
        while len(directory) > self.directory_size:
            directory.popitem(last=False)
        self._tick = now + len(keys)
        return _Request(cls, deadline, keys[matched] if matched >= 0 else None, self, prefix)

    # -- heaps ---------------------------------------------------------------------------------
    def _offer(self, key: bytes, entry: _Entry) -> None:
        """Make ``entry`` a candidate if it is idle and a leaf (no resident child): queue it in
        its class's heap (compacted when stale items exceed twice the live ones + 64)."""
        if entry.token >= 0 or entry.children or entry.block.ref_cnt:
            return
        stats = self._classes[entry.cls]
        self._token = token = self._token + 1
        entry.token = token
        heap = stats.heap
        heapq.heappush(heap, ((entry.tick << _ORDER_SHIFT) - entry.depth, token, key))
        stats.live += 1
        if len(heap) > 2 * stats.live + 64:
            blocks = self._blocks
            heap[:] = [  # in place: ``evict`` holds the list
                item
                for item in heap
                if (e := blocks.get(item[2])) is not None and e.token == item[1]
            ]
            heapq.heapify(heap)

    def _unpush(self, entry: _Entry) -> None:
        if entry.token >= 0:
            self._classes[entry.cls].live -= 1
            entry.token = -1

    def _head(self, stats: _ClassStats) -> _Entry | None:
        """The entry of the class's valid oldest item, which is then ``stats.heap[0]`` (stale
        items are dropped), or None."""
        heap = stats.heap
        blocks = self._blocks
        while heap:
            item = heap[0]
            entry = blocks.get(item[2])
            if entry is not None and entry.token == item[1]:
                return entry
            heapq.heappop(heap)
        return None

    def _valuer(self, now_s: float | None, horizon: float) -> Callable[[_Entry], float]:
        """``entry -> value`` for an ``evict`` / ``admits`` call: blocks of one class read at
        one tick (a request's blocks) share a value, so it is computed once per pair — and
        kept for the next call while the clock and ``horizon`` are the same (the statistics
        change only with the clock, in ``_classify``, or in :meth:`set_state`, which drops
        them): a request's admission check and its eviction value the same class heads."""
        at = (self._tick, horizon)
        if at != self._values_at:
            self._values_at = at
            self._values = {}
        memo = self._values
        compute = self._value

        def value(entry: _Entry) -> float:
            if entry.deadline is not None:
                return compute(entry, now_s, horizon)
            pair = (entry.cls, entry.tick)
            found = memo.get(pair)
            if found is None:
                found = memo[pair] = compute(entry, now_s, horizon)
            return found

        return value

    def _heads(self, value: Callable[[_Entry], float]) -> list[tuple[float, int, int]]:
        """Per non-empty class: (value of its head, its heap order, class index)."""
        heads = []
        for idx, stats in enumerate(self._classes):
            if stats.live and (entry := self._head(stats)) is not None:
                item = stats.heap[0]
                heads.append((value(entry), item[0], idx))
        return heads

    # -- CachePolicy ---------------------------------------------------------------------------
    def get(self, key: bytes) -> BlockStatus | None:
        entry = self._blocks.get(key)
        return entry and entry.block  # an _Entry is always true

    def insert(self, key: bytes, block: BlockStatus) -> None:
        info = self._directory.get(key)
        tick = self._tick
        self._tick_sum += tick
        blocks = self._blocks
        spare = self._spare
        entry = spare.pop() if spare else _Entry()
        entry.block = block
        entry.tick = tick
        entry.depth = 0
        # the reader's hint deadline: a block its request stores after its touch expires too
        entry.deadline = None if info is None else info[5]
        entry.children = 0
        entry.token = -1
        if info is None:
            entry.cls = self._class((0, 0, 1, 0))
            entry.parent = entry.up = None
        elif (parent := info[3]) is not None and (p := blocks.get(parent)) is not None:
            entry.cls = info[0]
            entry.parent = parent
            entry.up = p
            p.children += 1
            if p.token >= 0:
                self._unpush(p)
        else:
            entry.cls = info[0]
            entry.parent = entry.up = None
        blocks[key] = entry
        if block.ref_cnt == 0:
            self._evictable += 1
            self._offer(key, entry)

    def _forget(self, key: bytes, offer: bool = True) -> _Entry:
        """Drop ``key``'s entry and return it; it goes back to the spares unless a resident
        block counts it as its parent, so read it before the next :meth:`insert`. A parent
        left a leaf is offered (:meth:`_offer`) unless ``offer`` is False: then the caller
        evicts or offers it (:meth:`evict`'s chains)."""
        blocks = self._blocks
        entry = blocks.pop(key)
        self._tick_sum -= entry.tick
        if entry.token >= 0:  # _unpush, inline: once per victim
            self._classes[entry.cls].live -= 1
            entry.token = -1
        if entry.block.ref_cnt == 0:
            self._evictable -= 1
        p = entry.up  # set with entry.parent
        if p is not None and blocks.get(entry.parent) is p:  # type: ignore[arg-type]
            p.children -= 1
            if not p.children and offer:
                self._offer(entry.parent, p)  # type: ignore[arg-type]
        if not entry.children:  # no resident block names it as ``up``: reusable
            entry.up = None
            self._spare.append(entry)
        return entry

    def remove(self, key: bytes) -> None:
        if key not in self._blocks:
            raise KeyError(key)
        self._forget(key)

    def touch(self, keys: Collection[bytes], ctx: ReqContext | None = None) -> None:
        keys = as_sequence(keys)  # not kept: no copy
        if not keys:
            return
        request = None if ctx is None else ctx.get_state(_Request)
        if request is None or request.owner is not self:
            request = self._classify(keys, ctx)
            if ctx is not None:
                ctx.set_state(request)
        elif request.deadline is not None:  # a hint's ttl_s counts from the last use
            hint = hint_of(ctx)
            if hint is not None and hint.ttl_s is not None:
                request.deadline = self.clock() + hint.ttl_s
        self._retouch(keys, request)

    def _retouch(self, keys: Sequence[bytes], request: _Request, start: int = 0) -> None:
        """File the resident ``keys[start:]`` of ``request`` under its class at the current
        tick (a key's depth is its index in ``keys``)."""
        blocks = self._blocks
        if blocks.keys().isdisjoint(keys):  # a first read of new blocks: nothing to file
            return
        tick = self._tick
        cls = request.cls
        prefix = request.prefix
        split = len(prefix)
        deadline = request.deadline
        moved = 0
        classes = self._classes
        offer = self._offer
        for depth, key in enumerate(keys[start:] if start else keys, start):
            entry = blocks.get(key)
            if entry is None:
                continue
            if entry.token >= 0:  # _unpush, inline: this loop runs for every key read
                classes[entry.cls].live -= 1
                entry.token = -1
            entry.cls = prefix[depth] if depth < split else cls
            moved += tick - entry.tick
            entry.tick = tick
            entry.depth = depth
            entry.deadline = deadline
            if not entry.children:  # only leaves are candidates (_offer checks the rest)
                offer(key, entry)
        self._tick_sum += moved

    def admits(self, ctx: ReqContext | None, n: int = 1) -> bool:
        """Whether to store ``n`` new blocks of the request of ``ctx`` at all.

        True when admission is off (``admission_margin`` None), the request is unknown (not
        touched yet, or only by another policy), the ``n`` blocks fit in free slots, or nothing
        is evictable; otherwise when a fresh block of the request's class outranks the cheapest
        evictable block: a higher priority, or the same priority and ``admission_margin`` times
        its P(read within ``H``). A refused request's blocks are not stored; the coordinator
        asks only when the cascade has no secondary tier
        (``TieringCoordinator._admits_new_blocks``).
        """
        if self.admission_margin is None or ctx is None:
            return True
        request = ctx.get_state(_Request)
        return request is None or request.owner is not self or self._admits(request, n)

    def _admits(self, request: _Request, n: int) -> bool:
        """:meth:`admits` for a classified request."""
        margin = self.admission_margin
        if margin is None or len(self._blocks) + n <= self.cache_capacity:
            return True
        horizon = self.turnover()
        heads = self._heads(self._valuer(self.clock(), horizon))
        if not heads:
            return True
        low, _, idx = min(heads)
        if low == _EXPIRED:
            return True
        prio = self._classes[request.cls].key[1]
        low_prio = self._classes[idx].key[1]
        if prio != low_prio:
            return prio > low_prio
        value = self.reread_probability(request.cls, 0.0, horizon)
        return value >= margin * (low - low_prio)

    def mark_evictable(self, key: bytes) -> None:
        self._evictable += 1
        entry = self._blocks[key]
        if not entry.children:  # only leaves are candidates (_offer checks the rest)
            self._offer(key, entry)

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
        value_of = self._valuer(self.clock(), self.turnover())
        classes = self._classes
        heappop, heappush, heappushpop = heapq.heappop, heapq.heappush, heapq.heappushpop
        head = self._head
        # (value, heap order, class) of every non-empty class's head, cheapest first; equal
        # values (an untrained policy) go oldest first, i.e. LRU. ``top`` is the cheapest,
        # popped; a class whose head changed is pushed back with heappushpop (one sift instead
        # of a push and a pop per victim).
        heads = self._heads(value_of)
        heapq.heapify(heads)
        top = heappop(heads) if heads else None
        entry: _Entry | None = None  # the valid head of ``top``'s class, when known
        # The key of ``entry`` when it is the parent of the block just evicted, taken next
        # without a heap item (a request's blocks leave as a chain: one push and pop saved
        # per victim); None: ``entry`` is its class's heap[0].
        chain: bytes | None = None
        out: list[tuple[bytes, BlockStatus]] = []
        passed: list[tuple[int, tuple[int, int, bytes]]] = []  # protected heads
        spare = self._spare
        inline = ticks = 0  # victims forgotten inline, Σ of their last-read ticks
        while len(out) < n:
            if top is None:
                # Only blocks with a resident (pinned or protected) child are left.
                key = min(
                    (k for k, e in blocks.items() if e.block.ref_cnt == 0 and k not in protected),
                    key=lambda k: (blocks[k].tick, -blocks[k].depth),
                )
                out.append((key, self._forget(key).block))
                continue
            value, _, idx = top
            stats = classes[idx]
            if entry is None and (entry := head(stats)) is None:
                top = heappop(heads) if heads else None
                continue
            heap = stats.heap
            offered = None
            if chain is not None:  # valued when chained: never stale
                key = chain
                chain = None
            else:
                item = heap[0]
                # A lone class needs no values: its head goes first whatever it is worth.
                if heads and (current := value_of(entry)) > value and current > heads[0][0]:
                    pushed = (current, item[0], idx)  # stale: re-rank
                    top = heappushpop(heads, pushed)
                    if top is not pushed:
                        entry = None
                    continue
                heappop(heap)  # ``item``: evicted (stale from now on) or passed over
                key = item[2]
                if key in protected:
                    passed.append((idx, item))
                    key = None
            if key is not None:
                # _forget(key, offer=False), inline (once per victim): a victim is idle and
                # of class ``idx``; its parent is chained or offered below
                del blocks[key]
                inline += 1
                ticks += entry.tick
                if entry.token >= 0:
                    stats.live -= 1
                    entry.token = -1
                out.append((key, entry.block))
                up = entry.parent
                parent = None if up is None else blocks.get(up)
                if parent is not None and parent is entry.up:
                    parent.children -= 1
                if not entry.children:  # no resident block names it as ``up``: reusable
                    entry.up = None
                    spare.append(entry)
                # left a leaf by this eviction: idle, childless and in no heap (every other
                # idle leaf is in one)
                if (
                    parent is not None
                    and parent.token < 0
                    and not parent.children
                    and not parent.block.ref_cnt
                ):
                    if len(out) < n and parent.cls == idx and up not in protected:
                        # The next victim if it is the class's head and the cheapest head:
                        # what pushing it and popping it again would find (a stale heap[0]
                        # ahead of it: pushed, to be safe).
                        order = (parent.tick << _ORDER_SHIFT) - parent.depth
                        if not heap or order < heap[0][0]:
                            pushed = (value_of(parent) if heads else value, order, idx)
                            if not heads or not heads[0] < pushed:
                                entry, chain, top = parent, up, pushed
                                continue
                    self._offer(up, parent)  # type: ignore[arg-type]
                if len(out) == n:
                    break
                if parent is not None and parent.token >= 0 and parent.cls != idx:
                    offered = parent  # a parent of this class is among its heads below
            if offered is not None:
                order = (offered.tick << _ORDER_SHIFT) - offered.depth
                heappush(heads, (value_of(offered), order, offered.cls))
            if (entry := head(stats)) is not None:
                nxt = heap[0]
                if heads:
                    pushed = (value_of(entry), nxt[0], idx)
                    top = heappushpop(heads, pushed)
                    if top is not pushed:
                        entry = None
                else:
                    top = (value, nxt[0], idx)  # a lone class: its value is not read
            else:
                top = heappop(heads) if heads else None
        for idx, item in passed:
            heappush(classes[idx].heap, item)
        self._evictable -= inline
        self._tick_sum -= ticks
        return out

    def clear(self) -> None:
        for entry in self._blocks.values():
            entry.up = None
        self._spare.extend(self._blocks.values())
        self._blocks.clear()
        self._directory.clear()
        for stats in self._classes:
            stats.heap.clear()
            stats.live = 0
        self._tick = 0
        self._tick_sum = 0
        self._evictable = 0
        self._values_at = None

    def keys(self) -> Iterable[bytes]:
        return self._blocks.keys()

    # -- persistence ---------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The learned statistics as a JSON-serialisable dict: per class and per turn the
        blocks filed and re-read, the pooled re-read time histogram. No keys, no blocks."""
        return {
            "version": _STATE_VERSION,
            "max_turn": self.max_turn,
            "classes": [[*s.key, s.labels, s.reads] for s in self._classes],
            "groups": [[*k, g.labels, g.reads] for k, g in self._groups.items()],
            "pooled": {
                "labels": self._pooled.labels,
                "reads": self._pooled.reads,
                "histogram": list(self._pooled_reads),
            },
        }

    def set_state(self, state: Any) -> None:
        """Replace the learned statistics with ``state`` (as returned by :meth:`state`).

        Resident blocks and the directory are kept.

        Raises:
            ValueError: ``state`` is malformed, of another version or saved with another
                ``max_turn``; nothing changes then.
        """

        def counts(value: Any) -> float:
            # JSON numbers only: not a bool, a numeric string, NaN, a negative count or an
            # integer beyond a float (10**400: OverflowError)
            number = finite_number(value)
            if number is None or number < 0:
                raise ValueError(f"bad count {value!r:.40}")
            return number

        def rows(items: Any, width: int) -> list[tuple[tuple[int, ...], float, float]]:
            out = []
            seen = set()
            for item in items:
                if not isinstance(item, list) or len(item) != width + 2:
                    raise ValueError(f"bad row {item!r:.80}")
                key = tuple(item[:width])
                if any(type(v) is not int for v in key):  # not 1.5 (truncated), not true
                    raise ValueError(f"bad row {item!r:.80}: its key must be integers")
                hint, prio, turn = key[:3]
                hint_ok = 0 <= hint <= _ENDS_SHARED
                if not (hint_ok and abs(prio) <= MAX_PRIORITY and 1 <= turn <= max_turn):
                    raise ValueError(f"row {item!r:.80} out of range")
                if width == 4 and not 0 <= key[3] <= 8:
                    raise ValueError(f"row {item!r:.80} out of range")
                if key in seen:
                    raise ValueError(f"row {item!r:.80} repeats its key")
                seen.add(key)
                out.append((key, counts(item[width]), counts(item[width + 1])))
            return out

        max_turn = self.max_turn
        try:
            if not isinstance(state, dict):
                raise ValueError("not an object")
            if type(state.get("version")) is not int or state["version"] != _STATE_VERSION:
                raise ValueError(f"unsupported state version {state.get('version')!r}")
            if type(state.get("max_turn")) is not int or state["max_turn"] != self.max_turn:
                raise ValueError(
                    f"saved with max_turn={state.get('max_turn')!r}, this policy has "
                    f"{self.max_turn}"
                )
            classes = rows(state["classes"], 4)
            groups = rows(state["groups"], 3)
            pooled = state["pooled"]
            pooled_labels = counts(pooled["labels"])
            pooled_total = counts(pooled["reads"])
            histogram = [counts(r) for r in pooled["histogram"]]
            if len(histogram) != _BUCKETS:
                raise ValueError(f"histogram of {len(histogram)} buckets, expected {_BUCKETS}")
            if not math.isfinite(sum(histogram)):  # each finite, their total not: NaN shapes
                raise ValueError("histogram total overflows")
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed policy state ({exc})") from exc
        for stats in self._classes:
            stats.labels = stats.reads = 0.0
        for group in self._groups.values():
            group.labels = group.reads = 0.0
        for key, labels, reads in classes:
            stats = self._classes[self._class(key)]  # type: ignore[arg-type]
            stats.labels = labels
            stats.reads = reads
        for key, labels, reads in groups:
            group = self._groups.get(key)  # type: ignore[call-overload]
            if group is None:
                group = self._groups[key] = _Counts()  # type: ignore[index]
            group.labels = labels
            group.reads = reads
        self._pooled.labels = pooled_labels
        self._pooled.reads = pooled_total
        self._pooled_reads = histogram
        self._shape_dirty = True
        self._values_at = None

    def save_state(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`state` as JSON to ``path``, atomically (a temp file beside it, fsync,
        ``os.replace``) and readable by the owner only (mode 0600).

        Raises:
            OSError: the file cannot be written (the temp file is removed).
        """
        replace_file(path, json.dumps(self.state()).encode(), fsync=True)

    def load_state(self, path: str | os.PathLike[str]) -> None:
        """Replace the learned statistics with those saved by :meth:`save_state`
        (:func:`read_state_file`, then :meth:`set_state`).

        Raises:
            OSError: the file cannot be read.
            ValueError: not a state file of this version and ``max_turn``, naming ``path``
                (nothing changes).
        """
        try:
            self.set_state(read_state_file(path))
        except ValueError as exc:
            raise ValueError(f"{os.fspath(path)}: {exc}") from None
