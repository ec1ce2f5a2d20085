"""Turn-aware eviction that follows LRU while a shadow LRU beats it (issue #19).

``turn_aware``'s model (the turn number and the new blocks of a request predict re-reads) was
fitted on the Mooncake conversation trace; on a workload where it does not hold (memoryless
turns, say: ``benchmarks/policy_suite.py``'s ``turns_geometric``) its admission and ranking
lose hits to plain LRU. This policy runs the turn-aware policy and, beside it, a **shadow
LRU**: the keys an LRU cache of the same capacity would hold, fed the same requests (keys
only, no slots, no hints). On each request's first ``touch`` it counts the request's leading
hits in the real cache and in the shadow, and keeps, in an exponentially decaying window of
``window_factor`` × the cache's turnover time ``H`` (block reads), the lead ``L = Σ (real −
shadow)``, the spread ``S = Σ |real − shadow|`` and the reads ``R``. Two modes:

* **LRU mode** (the start — an untrained model has nothing to offer): every block is worth
  the same, so eviction goes oldest first (deepest first within a request, leaves first: the
  turn-aware order with all values equal) and everything is admitted; the real cache
  converges to the shadow's. The model keeps learning from every request. After ``probe``
  block reads in this mode — first ``probe_factor`` windows — it **probes** turn-aware mode.
* **turn-aware mode**: the policy of :class:`TurnAwareCachePolicy`. When the real cache trails
  the shadow, ``L < −switch_margin × R − 2 √S`` (beyond the margin by two standard deviations
  of a Poisson count), it switches to LRU mode; a probe that fails this way doubles the next
  ``probe``, one that lasts ``probe`` reads resets it to the base.

The counters restart at every switch. Cost per key: two dict operations of the shadow and one
of the real cache on a request's first touch; memory one ordered-dict entry (≈ 100 B) per
shadow key (at most ``cache_capacity``).
"""

from __future__ import annotations

import math
from collections import OrderedDict

from .._types import ReqContext
from .turn_aware import TurnAwareCachePolicy, _Entry, _Request

#: Standard deviations the real cache must trail the shadow by, beyond the margin, before it
#: switches (block hits taken as Poisson: the deviation of the lead is ``√Σ|real − shadow|``).
_Z = 2.0


class AdaptiveCachePolicy(TurnAwareCachePolicy):
    """:class:`TurnAwareCachePolicy` steered by a shadow LRU (module docstring).

    Args:
        cache_capacity: slots of the tier (blocks).
        window_factor: the comparison window in turnover times ``H`` (> 0; default 2).
        switch_margin: fraction of the window's block reads the real cache may trail the
            shadow LRU by before it switches to LRU mode (≥ 0; default 0.002).
        probe_factor: first probe of turn-aware mode after this many windows in LRU mode
            (> 0; default 2).
        **kwargs: the :class:`TurnAwareCachePolicy` parameters (``admission_margin``, …).

    Attributes:
        lru_mode: True while the policy evicts and admits like LRU.
        switches: mode changes so far.

    Raises:
        ValueError: a parameter out of range.
    """

    def __init__(
        self,
        cache_capacity: int,
        window_factor: float = 2.0,
        switch_margin: float = 0.002,
        probe_factor: float = 2.0,
        **kwargs: object,
    ) -> None:
        super().__init__(cache_capacity, **kwargs)  # type: ignore[arg-type]
        if not window_factor > 0:
            raise ValueError(f"window_factor must be > 0, got {window_factor}")
        if not switch_margin >= 0:
            raise ValueError(f"switch_margin must be >= 0, got {switch_margin}")
        if not probe_factor > 0:
            raise ValueError(f"probe_factor must be > 0, got {probe_factor}")
        self.window_factor = window_factor
        self.switch_margin = switch_margin
        self.probe_factor = probe_factor
        self.lru_mode = True
        self.switches = 0
        self._shadow: OrderedDict[bytes, None] = OrderedDict()
        self._lead = 0.0  # decayed (real − shadow) prefix hits
        self._spread = 0.0  # decayed |real − shadow|
        self._reads = 0.0  # decayed block reads
        self._since = 0.0  # block reads since the last mode change
        self._probe = 0.0  # block reads in LRU mode before the next probe
        self._probing = False  # turn-aware mode on probation

    def _compare(self, keys: list[bytes]) -> None:
        """Count the request's leading hits in the real cache and in the shadow LRU, update
        the shadow (``keys`` become its most recent, the first key last) and the mode."""
        blocks = self._blocks
        real = 0
        for key in keys:
            entry = blocks.get(key)
            if entry is None or not entry.block.is_ready:
                break
            real += 1
        shadow = self._shadow
        ghost = 0
        for key in keys:
            if key not in shadow:
                break
            ghost += 1
        move = shadow.move_to_end
        for key in reversed(keys):
            shadow[key] = None
            move(key)
        while len(shadow) > self.cache_capacity:
            shadow.popitem(last=False)
        n = len(keys)
        window = self.window_factor * self.turnover()
        decay = math.exp(-n / window)
        diff = real - ghost
        self._lead = self._lead * decay + diff
        self._spread = self._spread * decay + abs(diff)
        self._reads = self._reads * decay + n
        self._since += n
        if self.lru_mode:
            if not self._probe:
                self._probe = self.probe_factor * window  # the first probe
            if self._since >= self._probe:
                self._probing = True
                self._switch(False)
        elif self._lead < -self.switch_margin * self._reads - _Z * math.sqrt(self._spread):
            # Behind the shadow: a failed probe backs off, a first switch waits the base time.
            self._probe = 2.0 * self._probe if self._probing else self.probe_factor * window
            self._probing = False
            self._switch(True)
        elif self._probing and self._since >= self._probe:
            self._probing = False  # the probe held as long as LRU mode had lasted

    def _switch(self, lru_mode: bool) -> None:
        self.lru_mode = lru_mode
        self.switches += 1
        self._since = 0.0
        self._lead = self._spread = self._reads = 0.0

    def _classify(self, keys: list[bytes], ctx: ReqContext | None) -> _Request:
        self._compare(keys)
        return super()._classify(keys, ctx)

    def _value(self, entry: _Entry, now_s: float | None, horizon: float) -> float:
        return 0.0 if self.lru_mode else super()._value(entry, now_s, horizon)

    def admits(self, ctx: ReqContext | None, n: int = 1) -> bool:
        """Always in LRU mode; else :meth:`TurnAwareCachePolicy.admits`."""
        return self.lru_mode or super().admits(ctx, n)

    def clear(self) -> None:
        super().clear()
        self._shadow.clear()
        self._lead = self._spread = self._reads = self._since = self._probe = 0.0
        self.lru_mode = True
        self._probing = False
