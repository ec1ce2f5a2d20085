"""Back-pressure: admission of cascade stores per secondary tier (issue #20, docs/coordinator.md).

A cascade job pins its blocks in the primary tier until the tier reports it finished. When a
tier slows down (a loaded S3 endpoint, a throttled shared Valkey server), its jobs pile up and
their pins fill the primary tier; stores from the GPU then find no slot and are dropped, and the
faster tiers starve with it. :class:`CascadeAdmission` keeps each tier's pile bounded by what the
tier has recently shown it can write, and drops (and counts) the cascades beyond it instead:
the blocks stay in the primary tier and in every tier that keeps up; only the slow tier misses
them.

Rule, per tier: ``queued`` = blocks of its cascade jobs admitted and not finished (each holds a
primary pin). A cascade of ``n`` blocks is admitted iff ``queued == 0`` (one job always goes, so
every tier keeps being measured and a job larger than the budget is never starved) or
``queued + n <= budget`` with::

    budget = min(cap, max(floor_blocks, rate × max_lag_s))   once a rate is known
    budget = cap                                              before
    cap    = max(1, int(max_pinned_fraction × primary blocks))

``rate`` is the tier's recent finishing rate in blocks per second: blocks finished over a
*window* that opens when the tier gets work and closes after ``window_s`` seconds (or when its
queue empties), folded into an exponential average (weight ``alpha`` for the new window). A
window open for ``window_s`` or longer also caps the estimate with its own rate so far, so a tier
that stalls (nothing finishes) falls to ``floor_blocks`` within one window, and one that speeds
up again finishes its jobs faster, which raises the rate and the budget: recovery needs no
timer. Failed jobs count as finished (their pins are released too): the rate measures how fast a
tier gives primary slots back, which is what the primary tier cares about.

Everything runs on the event-loop thread, called by :class:`~kvcascade.coordinator.
TieringCoordinator` where a cascade is submitted (:meth:`CascadeAdmission.admit`) and where its
result is applied (:meth:`CascadeAdmission.finished`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .metrics import TieringMetrics
from .tiers.base import SecondaryTier


@dataclass
class _TierPressure:
    """What admission knows of one tier (blocks; seconds from ``time.monotonic``)."""

    block_bytes: int
    queued: int = 0
    rate: float | None = None
    window_start: float | None = None
    window_blocks: int = 0


class CascadeAdmission:
    """Per-tier admission of cascade stores (module docstring).

    Args:
        tiers: the secondary tiers, in cascade order (their ``host.block_bytes`` scales the
            throughput metric).
        primary_blocks: slots of the primary tier (``>= 0``).
        metrics: where the per-tier gauges (``cascade_queued_blocks``,
            ``cascade_throughput_bytes``) and the ``cascade_dropped_blocks`` counter live.
        max_lag_s: seconds of a tier's measured rate it may have queued (``> 0``).
        window_s: length of one rate window, seconds (``> 0``).
        alpha: weight of a new window in the average, ``0 < alpha <= 1``.
        floor_blocks: the budget of a tier that stalls (``>= 1``).
        max_pinned_fraction: bound on the primary slots one tier's queued cascades may pin,
            ``0 < f <= 1``.
        clock: seconds, monotonic (tests pass their own).

    Raises:
        ValueError: a setting out of range (named, with its value).
    """

    def __init__(
        self,
        tiers: Sequence[SecondaryTier],
        primary_blocks: int,
        metrics: TieringMetrics,
        *,
        max_lag_s: float = 1.0,
        window_s: float = 0.25,
        alpha: float = 0.5,
        floor_blocks: int = 8,
        max_pinned_fraction: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for name, value, ok in (
            ("max_lag_s", max_lag_s, max_lag_s > 0),
            ("window_s", window_s, window_s > 0),
            ("alpha", alpha, 0 < alpha <= 1),
            ("floor_blocks", floor_blocks, floor_blocks >= 1),
            ("max_pinned_fraction", max_pinned_fraction, 0 < max_pinned_fraction <= 1),
            ("primary_blocks", primary_blocks, primary_blocks >= 0),
        ):
            if not ok:
                raise ValueError(f"back-pressure setting {name} out of range: {value!r}")
        self.max_lag_s = max_lag_s
        self.window_s = window_s
        self.alpha = alpha
        self.floor_blocks = floor_blocks
        self.cap = max(1, int(max_pinned_fraction * primary_blocks))
        self._clock = clock
        self._metrics = metrics
        self._tiers = [_TierPressure(t.host.block_bytes) for t in tiers]
        for idx, state in enumerate(self._tiers):
            label = metrics.tier_label(idx)
            metrics.cascade_queued_blocks.labels(label).set_function(lambda s=state: s.queued)
            metrics.cascade_throughput_bytes.labels(label).set_function(
                lambda s=state: (s.rate or 0.0) * s.block_bytes
            )

    def budget(self, tier_idx: int) -> int:
        """Blocks tier ``tier_idx`` may have queued now (see the module docstring)."""
        state = self._tiers[tier_idx]
        rate = state.rate
        if state.window_start is not None:
            elapsed = self._clock() - state.window_start
            if elapsed >= self.window_s:
                live = state.window_blocks / elapsed
                rate = live if rate is None else min(rate, live)
        if rate is None:
            return self.cap
        return min(self.cap, max(self.floor_blocks, int(rate * self.max_lag_s)))

    def admit(self, tier_idx: int, blocks: int) -> bool:
        """Whether a cascade of ``blocks`` blocks to tier ``tier_idx`` may be submitted now; if
        so it is counted as queued until :meth:`finished`, else it is counted as dropped."""
        state = self._tiers[tier_idx]
        if state.queued and state.queued + blocks > self.budget(tier_idx):
            self._metrics.cascade_dropped_blocks.labels(self._metrics.tier_label(tier_idx)).inc(
                blocks
            )
            return False
        if state.window_start is None:
            state.window_start = self._clock()
        state.queued += blocks
        return True

    def finished(self, tier_idx: int, blocks: int) -> None:
        """A cascade of ``blocks`` blocks admitted to tier ``tier_idx`` finished (succeeded,
        failed or was abandoned at its deadline)."""
        state = self._tiers[tier_idx]
        state.queued = max(0, state.queued - blocks)
        state.window_blocks += blocks
        if state.window_start is None:
            return
        now = self._clock()
        elapsed = now - state.window_start
        if elapsed < self.window_s and state.queued:
            return
        if elapsed > 0:
            sample = state.window_blocks / elapsed
            old = sample if state.rate is None else state.rate
            state.rate = self.alpha * sample + (1 - self.alpha) * old
        state.window_blocks = 0
        state.window_start = now if state.queued else None
