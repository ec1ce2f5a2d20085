"""Turn-aware or LRU eviction, whichever a miniature simulation says wins (issue #19).

``turn_aware``'s model (the turn number and the new blocks of a request predict re-reads) was
fitted on the Mooncake conversation trace; on a workload where it does not hold (memoryless
turns, say: ``benchmarks/policy_suite.py``'s ``turns_geometric``) its admission and ranking
lose hits to plain LRU. This policy runs the turn-aware policy in one of two modes and decides
between them with **miniature simulations** (as in Waldspurger et al., USENIX ATC 2017;
docs/policies.md has the design and its measurements): two shadow caches of ``capacity / k``
blocks fed the same hash-sampled ``1 / k`` of the conversations — a **shadow LRU** (keys only)
and a **shadow turn-aware cache** (its own residency, heaps and admission; the real policy's
directory, statistics and clock, so it costs no learning of its own).

* **Sampling.** A request that continues an earlier turn (``_Request.prev``) is sampled if
  that turn was; any other by ``crc32(last key) mod k == 0``. A conversation's turns are
  therefore all in the sample or all out, and a shadow sees whole conversations, as the real
  cache does. ``k = capacity // shadow_blocks`` clamped to ``1 … max_sampling``: the shadows
  hold at least ``shadow_blocks`` blocks (a tiny shadow misjudges long prompts) and cost about
  ``1 / k`` of a real cache per key.
* **What it measures.** Per sampled request the difference ``d`` of the leading hits of the
  two shadows (turn-aware − LRU). In an exponentially decaying window of ``window_factor × H``
  block reads (``H``: the turnover time of ``turn_aware``) it keeps the lead ``L = Σ d`` and
  ``Q = Σ d²`` (the variance of ``L`` were the two equal).
* **Modes.** LRU mode (the start: an untrained model has nothing to offer) — every block of a
  priority level is worth the same, so eviction goes oldest first (deepest first within a
  request, leaves first: the turn-aware order with all values equal) and everything is admitted.
  The model keeps learning from every request. It switches to turn-aware mode
  (:class:`TurnAwareCachePolicy`) when the turn-aware shadow leads by ``confidence`` standard
  deviations, ``L > confidence × √Q``, once a whole window of block reads has been seen —
  ``window_factor`` turnover times of the shadow LRU (before that, ``Q`` of a few small
  differences understates the variance of a heavy-tailed workload: one long conversation can
  turn a 2σ lead into a loss; ``benchmarks/policy_suite.py --seed 1``'s ``turns_decreasing``
  10 % fell 0.010 below LRU without this rule, before the suite had a context window) — and
  back when its lead falls below an eighth of that, ``L < confidence / 8 × √Q`` (the
  hysteresis keeps a lead near the threshold from flapping the mode: each switch costs the hits
  of a cache turning over to the other mode's contents). LRU is what the never-below rule of
  issue #19 compares with, hence the bias towards it (``confidence`` 2.5: docs/policies.md,
  *The context window*). No hit is spent on finding out: the real cache never tries a mode the
  shadows have not shown to win.

Hints: the shadow turn-aware cache and turn-aware mode use them as ``turn_aware`` does (the
class carries them); LRU mode admits as LRU does with hints (a request whose session will not
continue stores no new blocks, :func:`kvcascade.hints.admits_new_blocks`) and ranks by the
hint's ``priority`` first and its ``ttl_s`` (nothing is worth less than an expired block), so
explicit hints are honoured in either mode; the shadow LRU ignores them.

Cost per request on its first touch: one ``crc32`` and two ordered-dict operations (the sample
flags of its prompt ends, at most ``directory_size`` of them); for a sampled request the two
shadows' work — so per key about ``1 / k`` of an LRU and a turn-aware cache on top of the
turn-aware policy itself (with ``k = 1``, caches under ``2 × shadow_blocks``, twice that).
Memory: the shadows' entries (``1 / k`` of the real ones) and one entry per prompt end.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from types import FunctionType
from typing import Any

from .._types import ReqContext
from .._validate import check_int, check_number, finite_number
from ..hints import may_continue
from .base import BlockStatus
from .turn_aware import (
    _EXPIRED,
    TurnAwareCachePolicy,
    _ClassStats,
    _Counts,
    _Entry,
    _expired,
    _prompt_ends,
    _Request,
)

#: One idle status shared by every block of a shadow (shadow blocks are never pinned).
_IDLE = BlockStatus(-1, 0)
#: The status of a shadow block while its request's blocks are being inserted (not ready: no
#: heap item until the request's blocks are filed at their depths).
_PENDING = BlockStatus(-1, -1)
#: Back to LRU mode when the turn-aware shadow's lead falls below this share of the
#: ``confidence × √Q`` that switched to turn-aware mode (docs/policies.md: ``adaptive``).
_RELEASE = 0.125


class _ShadowLRU:
    """The keys an LRU cache of ``capacity`` blocks would hold under the free rules of
    ``kvcascade replay --compare-policies`` (a request's keys become the most recent, its
    first key last), each with the tick of its last read (for :meth:`turnover`)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[bytes, int] = OrderedDict()
        self._tick_sum = 0  # Σ last-read ticks of the keys held

    def step(self, keys: Sequence[bytes], tick: int) -> int:
        """Read ``keys`` at ``tick`` (the model's clock): return the leading hits, then store
        them."""
        shadow = self._keys
        hits = 0
        for key in keys:
            if key not in shadow:
                break
            hits += 1
        pop = shadow.pop
        total = self._tick_sum
        for key in reversed(keys):
            total += tick - pop(key, 0)
            shadow[key] = tick  # re-inserted: the most recent
        popitem = shadow.popitem
        for _ in range(len(shadow) - self.capacity):
            total -= popitem(last=False)[1]
        self._tick_sum = total
        return hits

    def turnover(self, tick: int) -> float:
        """Twice the mean age (ticks) of the keys held: the time an LRU cache of this size
        keeps a block (0 while empty)."""
        return 2.0 * (tick - self._tick_sum / len(self._keys)) if self._keys else 0.0

    def clear(self) -> None:
        self._keys.clear()
        self._tick_sum = 0


def _own_code(cls: type[TurnAwareCachePolicy]) -> type[TurnAwareCachePolicy]:
    """Class decorator: give ``cls`` its own copies of the :class:`TurnAwareCachePolicy`
    methods it inherits (same code, a new code object each).

    CPython (3.11+) specializes an attribute access or method call in place, per code object,
    for the one type it last saw; a method run alternately on the real policy and on its shadow
    (two types) keeps missing and runs generic lookups, 2–3× slower (docs/policies.md,
    ``adaptive``'s **Cost**). With copies each code object sees one type.
    """
    for name, value in vars(TurnAwareCachePolicy).items():
        if isinstance(value, FunctionType) and name not in vars(cls):
            code = value.__code__.replace()
            copy = FunctionType(
                code, value.__globals__, name, value.__defaults__, value.__closure__
            )
            setattr(cls, name, functools.update_wrapper(copy, value))
    return cls


@_own_code
class _ShadowTurnAware(TurnAwareCachePolicy):
    """A turn-aware cache of ``capacity`` blocks over the sampled requests: residency, heaps
    and admission of its own; directory, class statistics, re-read shape and clock of
    ``model`` (which has classified each request before the shadow reads it)."""

    def __init__(self, model: TurnAwareCachePolicy, capacity: int) -> None:
        super().__init__(
            capacity,
            min_directory=0,
            horizon_factor=model.horizon_factor,
            max_turn=model.max_turn,
            admission_margin=model.admission_margin,
            clock=lambda: model.clock(),
        )
        self._model = model
        self._directory = model._directory

    def reuse_probability(self, cls: int) -> float:
        return self._model.reuse_probability(cls)

    def _pooled_shape(self) -> list[float]:
        return self._model._pooled_shape()

    def _class(self, key: tuple[int, int, int, int]) -> int:
        idx = self._model._class(key)
        self._sync()
        return idx

    def _sync(self) -> None:
        """Take the model's clock and its classes (the shadow's hold only heaps)."""
        self._tick = self._model._tick
        classes = self._classes
        for stats in self._model._classes[len(classes) :]:
            classes.append(_ClassStats(stats.key, _Counts()))

    def step(self, keys: Sequence[bytes], request: _Request) -> int:
        """Read ``keys`` as the request ``request``: return the leading hits, then touch, admit
        and store as the replay does (``kvcascade.replay.compare.simulate``)."""
        self._sync()
        blocks = self._blocks
        hits = 0
        for key in keys:
            if key not in blocks:
                break
            hits += 1
        self._retouch(keys, request)
        # each new key once (a request may name one twice; the manager stores it once)
        new = list(dict.fromkeys([key for key in keys[hits:] if key not in blocks]))
        del new[self.cache_capacity :]
        if new and self._admits(request, len(new)):
            need = len(blocks) + len(new) - self.cache_capacity
            if need <= 0 or self.evict(need, ()) is not None:
                # Inserted not ready, then made idle and filed at their depths: one heap item
                # per leaf (an idle insert would queue each new block before its child
                # arrives, an item made stale at once). The blocks before ``keys[hits]`` were
                # filed above, at this tick.
                for key in new:
                    self.insert(key, _PENDING)
                for key in new:
                    blocks[key].block = _IDLE
                self._evictable += len(new)
                self._retouch(keys, request, hits)
        return hits


class AdaptiveCachePolicy(TurnAwareCachePolicy):
    """:class:`TurnAwareCachePolicy` or LRU, as miniature simulations say (module docstring).

    Args:
        cache_capacity: slots of the tier (blocks).
        shadow_blocks: the shadows hold at least this many blocks (≥ 1; default 4096).
        max_sampling: at most this sampling divisor ``k`` (≥ 1; default 32).
        window_factor: the comparison window in turnover times ``H`` (> 0; default 4).
        confidence: standard deviations the turn-aware shadow must lead by before the real
            cache follows it (≥ 0; default 2.5); it goes back to LRU below an eighth of that.
        **kwargs: the :class:`TurnAwareCachePolicy` parameters (``admission_margin``, …).

    Attributes:
        lru_mode: True while the policy evicts and admits like LRU.
        switches: mode changes so far.
        sampling: ``k``: the shadows see 1 in ``k`` conversations at ``capacity / k``.

    Raises:
        ConfigError (a ValueError): a parameter of another type or out of range (naming it and
            the value): a count not an int, a factor NaN, infinite or not a number.
    """

    def __init__(
        self,
        cache_capacity: int,
        shadow_blocks: int = 4096,
        max_sampling: int = 32,
        window_factor: float = 4.0,
        confidence: float = 2.5,
        **kwargs: object,
    ) -> None:
        check_int("shadow_blocks", shadow_blocks, 1)
        check_int("max_sampling", max_sampling, 1)
        window_factor = check_number("window_factor", window_factor, 0, above=True)
        confidence = check_number("confidence", confidence, 0)
        super().__init__(cache_capacity, **kwargs)  # type: ignore[arg-type]
        self.window_factor = window_factor
        self.confidence = confidence
        self.sampling = max(1, min(max_sampling, cache_capacity // shadow_blocks))
        shadow_capacity = max(1, round(cache_capacity / self.sampling))
        self._shadow_lru = _ShadowLRU(shadow_capacity)
        self._shadow_turn_aware = _ShadowTurnAware(self, shadow_capacity)
        # Prompt-end key -> whether its conversation is sampled (recent ends first dropped).
        self._sampled: OrderedDict[bytes, bool] = OrderedDict()
        self.lru_mode = True
        self.switches = 0
        self._lead = 0.0  # decayed Σ (turn-aware shadow − LRU shadow) leading hits
        self._square = 0.0  # decayed Σ of their squares
        self._seen = 0  # block reads so far

    def _classify(self, keys: Sequence[bytes], ctx: ReqContext | None) -> _Request:
        request = super()._classify(keys, ctx)
        ends = self._sampled
        sampled = None if request.prev is None else ends.get(request.prev)
        if sampled is None:
            sampled = zlib.crc32(keys[-1]) % self.sampling == 0
        for key in _prompt_ends(keys):
            ends[key] = sampled
            ends.move_to_end(key)
        while len(ends) > self.directory_size:
            ends.popitem(last=False)
        window = self.window_factor * self.turnover()
        self._seen += len(keys)
        decay = math.exp(-len(keys) / window)
        self._lead *= decay
        self._square *= decay
        if sampled:
            shadow_lru = self._shadow_lru
            diff = self._shadow_turn_aware.step(keys, request) - shadow_lru.step(keys, self._tick)
            self._lead += diff
            self._square += diff * diff
            if self.lru_mode:
                significant = self._lead > self.confidence * math.sqrt(self._square)
                if significant and self._seen >= self._first_window():
                    self._switch(False)
            elif self._lead < _RELEASE * self.confidence * math.sqrt(self._square):
                self._switch(True)
        return request

    def _first_window(self) -> float:
        """Block reads to see before the first switch: ``window_factor`` turnover times of an
        LRU cache of this size (the shadow LRU's, at least the capacity), not of the real
        cache, whose turnover stretches in LRU mode when hints refuse sessions."""
        turnover = self._shadow_lru.turnover(self._tick)
        return self.window_factor * max(float(self.cache_capacity), turnover)

    def _switch(self, lru_mode: bool) -> None:
        self.lru_mode = lru_mode
        self.switches += 1

    def _valuer(self, now_s: float | None, horizon: float) -> Callable[[_Entry], float]:
        """In LRU mode a block is worth its hint's priority (nothing past its ``ttl_s``): equal
        values make the turn-aware order LRU's, within a priority level, as
        :class:`kvcascade.hints.SessionHint` promises of every priority."""
        if not self.lru_mode:
            return super()._valuer(now_s, horizon)
        classes = self._classes

        def value(entry: _Entry) -> float:
            return _EXPIRED if _expired(entry, now_s) else classes[entry.cls].key[1]

        return value

    def admits(self, ctx: ReqContext | None, n: int = 1) -> bool:
        """In LRU mode LRU's hint rule (no new blocks for a session that will not continue);
        else :meth:`TurnAwareCachePolicy.admits`."""
        return may_continue(ctx) if self.lru_mode else super().admits(ctx, n)

    def state(self) -> dict[str, Any]:
        """:meth:`TurnAwareCachePolicy.state` and the mode with its evidence: ``"adaptive":
        {"lru_mode", "lead", "square"}`` (the decayed ``L`` and ``Q``). A cache restarted from
        it goes on in the mode it stopped in: in turn-aware mode judged on the same evidence,
        in LRU mode on fresh evidence (docs/policies.md, *State across restarts*)."""
        state = super().state()
        state["adaptive"] = {
            "lru_mode": self.lru_mode,
            "lead": self._lead,
            "square": self._square,
        }
        return state

    def set_state(self, state: Any) -> None:
        """:meth:`TurnAwareCachePolicy.set_state`, and the mode saved with it — with its evidence
        in turn-aware mode, without (``L = Q = 0``) in LRU mode; a state without a mode (saved
        by ``turn_aware``) leaves mode and evidence as they are.

        Raises:
            ValueError: as :meth:`TurnAwareCachePolicy.set_state`, or ``"adaptive"`` is not
                ``{"lru_mode": bool, "lead": number, "square": number >= 0}``; nothing changes
                then.
        """
        mode: tuple[bool, float, float] | None = None
        if isinstance(state, dict) and "adaptive" in state:
            saved = state["adaptive"]
            ok = isinstance(saved, dict) and type(saved.get("lru_mode")) is bool
            lead = finite_number(saved.get("lead")) if ok else None
            square = finite_number(saved.get("square")) if ok else None
            if lead is None or square is None or square < 0:
                raise ValueError(f"malformed policy state (adaptive {saved!r:.80})")
            mode = (saved["lru_mode"], lead, square)
        super().set_state(state)
        if mode is not None:
            # LRU mode starts its evidence afresh: yesterday's variance would hold back a
            # switch that today's traffic earns (docs/policies.md, *State across restarts*)
            self.lru_mode = mode[0]
            self._lead, self._square = (0.0, 0.0) if mode[0] else mode[1:]

    def clear(self) -> None:
        super().clear()
        self._shadow_turn_aware.clear()
        self._shadow_lru.clear()
        self._sampled.clear()
        self._lead = self._square = 0.0
        self._seen = 0
        self.lru_mode = True
