"""The prefix walk of both lookup fronts: keys in order, each through a per-key lookup.

One walk, two fronts. The synchronous scheduler
(:meth:`kvcascade.scheduler.OffloadScheduler._maximal_prefix`, vLLM's
``_maximal_prefix_lookup`` in ``offloading/scheduler.py``) walks over its manager's ``lookup``,
which answers ``RETRY`` while a tier's probe is pending: the walk goes on past it, so that every
unknown key joins this step's probe batch, and the scheduler asks again at a later step. The
asyncio front (:meth:`kvcascade.coordinator.TieringCoordinator.lookup_prefix`) can probe at
once: it walks over :meth:`~kvcascade.coordinator.TieringCoordinator.lookup` with the verdicts
it has, the walk stops before the first key without one (``needs_probe``), and the front awaits
the tiers' probes for it and walks on from there. Sans-I/O: the walk itself never waits.

The scheduler's windowed (sliding-window) walk is another walk — from the end, for the last run
of ``window`` consecutive hits, a gap restarting the run rather than ending the walk (vLLM's
``_sliding_window_lookup``) — and stays in :mod:`kvcascade.scheduler`; the asyncio front has no
windowed groups.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ._types import LookupResult


@dataclass
class PrefixWalk:
    """Where a walk of ``keys`` ended.

    Attributes:
        results: the answers of the keys walked, in order (``HIT``, ``HIT_PENDING``, and for
            the synchronous front ``RETRY``); the walk ended before ``keys[len(results)]``.
        probe: the key the walk stopped before because it ``needs_probe`` (None: it ended at
            a miss or at the last key).
    """

    results: list[LookupResult] = field(default_factory=list)
    probe: bytes | None = None

    @property
    def num_hits(self) -> int:
        """Keys walked that are readable or being written (``HIT`` or ``HIT_PENDING``)."""
        return sum(r is not LookupResult.RETRY for r in self.results)

    @property
    def deferred(self) -> bool:
        """True if some key walked is not readable yet (``HIT_PENDING``) or unknown (``RETRY``):
        a synchronous caller asks again later (vLLM's ``_maximal_prefix_lookup``)."""
        return any(r is not LookupResult.HIT for r in self.results)


def walk_prefix(
    keys: Iterable[bytes],
    lookup: Callable[[bytes], LookupResult],
    needs_probe: Callable[[bytes], bool] | None = None,
) -> PrefixWalk:
    """Walk ``keys`` in order through ``lookup`` until the first ``MISS`` (module docstring).

    Without ``needs_probe`` (the synchronous front) a ``RETRY`` is recorded and the walk goes
    on. With it (the asyncio front, which probes instead of deferring) a key for which it is
    true ends the walk before ``lookup`` is asked (:attr:`PrefixWalk.probe`), and a ``RETRY``
    ends the walk as a ``MISS`` does.
    """
    walk = PrefixWalk()
    for key in keys:
        if needs_probe is not None and needs_probe(key):
            walk.probe = key
            break
        result = lookup(key)
        if result is LookupResult.MISS or (
            result is LookupResult.RETRY and needs_probe is not None
        ):
            break
        walk.results.append(result)
    return walk
