"""Whether a secondary tier answers in time: degraded after missed deadlines, rechecked in the
background (docs/architecture.md, "Slow and hung tiers").

A tier that accepts requests but answers slowly (an S3 endpoint behind a stalled link, a hung
NFS mount) is never *down* for its backend (:mod:`kvcascade.tiers._backend`: nothing failed,
nothing answered yet); this module notices it by the deadlines its calls miss instead:

* the rule: :data:`DEGRADE_AFTER` existence probes or loads *in a row* past their deadline
  (``probe_timeout_s`` for a probe, ``io_timeout_s`` for a load) mark the tier degraded; one
  call answered in time resets the count. Consecutive misses rather than a share over a window:
  a hung tier is degraded after exactly three calls however little traffic there is, and a
  healthy tier with an occasional slow answer never is;
* while degraded, probes answer MISS without a request (``counters["degraded_probes"]``) and
  cascades to the tier are skipped (``counters["degraded_skipped_blocks"]``); loads already
  promised by an earlier HIT still run;
* a background task probes the tier every :data:`RECHECK_S` seconds (a key nobody stores, with
  the probe deadline); the first answer in time, HIT or MISS, marks it healthy again;
* one warning when the tier degrades, one when it recovers (``counters["degradations"]``
  counts the former); the missed deadlines themselves are counted
  (``counters["probe_timeouts"]``), the first one warned, later ones logged at debug level.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

DEGRADE_AFTER = 3
"""Probes or loads past their deadline in a row that mark a tier degraded."""
RECHECK_S = 1.0
"""Seconds between the background probes of a degraded tier."""


class DeadlineHealth:
    """The degraded state of one tier (module docstring); every method runs on its event loop.

    Args:
        tier: the tier's name (log lines).
        counters: the tier's counters.
        recheck: one background probe of the tier; True when it answered within its deadline.
    """

    def __init__(
        self,
        tier: str,
        counters: collections.Counter[str],
        recheck: Callable[[], Awaitable[bool]],
    ) -> None:
        self.tier = tier
        self.counters = counters
        self._recheck = recheck
        self._missed = 0
        self._task: asyncio.Task[None] | None = None

    @property
    def degraded(self) -> bool:
        """True from the :data:`DEGRADE_AFTER`-th missed deadline in a row until a background
        probe answered in time."""
        return self._task is not None

    def answered(self) -> None:
        """A probe or load answered within its deadline."""
        self._missed = 0

    def missed(self, what: str, timeout_s: float) -> None:
        """A ``what`` (``"probe"``, ``"load"``) passed its deadline of ``timeout_s`` seconds."""
        self._missed += 1
        if what == "probe":
            self.counters["probe_timeouts"] += 1
            first = self.counters["probe_timeouts"] == 1
            log.log(
                logging.WARNING if first else logging.DEBUG,
                "tier %s: an existence probe passed its deadline of %g s; answering MISS "
                "(probe_timeouts so far: %d)",
                self.tier,
                timeout_s,
                self.counters["probe_timeouts"],
            )
        if self._missed >= DEGRADE_AFTER and self._task is None:
            self.counters["degradations"] += 1
            log.warning(
                "tier %s: %d calls in a row passed their deadline (the last a %s of %g s); "
                "tier degraded: lookups miss and cascades to it are skipped until a background "
                "probe answers in time",
                self.tier,
                self._missed,
                what,
                timeout_s,
            )
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(RECHECK_S)
            if await self._recheck():
                break
        self._task = None
        self._missed = 0
        log.warning("tier %s: answers in time again; tier no longer degraded", self.tier)

    async def stop(self) -> None:
        """Cancel the background probe (the tier shuts down)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
