"""Asynchronous existence probes behind a synchronous lookup (vLLM's ``tiering/async_lookup.py``).

A synchronous ``lookup`` never blocks: an unknown key answers ``RETRY`` and joins this step's
batch; :meth:`AsyncLookup.flush` (at schedule end) hands the batch to the tier's thread pool as one
task; the verdicts become visible at the first lookup after the next flush. A verdict is cached
while any interested request lives, so a key is probed at most once per interested request set.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from .._types import LookupResult, ReqContext

if TYPE_CHECKING:
    from .base import SecondaryTier

log = logging.getLogger(__name__)


class _Verdict:
    __slots__ = ("found", "req_ids")

    def __init__(self) -> None:
        self.found: bool | None = None
        self.req_ids: set[str] = set()


class AsyncLookup:
    """Verdict cache and probe batching of one secondary tier."""

    def __init__(self, tier: SecondaryTier) -> None:
        self._tier = tier
        self._verdicts: dict[bytes, _Verdict] = {}
        self._keys_of_req: dict[str, set[bytes]] = {}
        self._batch: list[bytes] = []
        self._posted: collections.deque[list[tuple[bytes, bool]]] = collections.deque()
        self._drain_needed = False
        self._probes: set[asyncio.Task[None]] = set()

    def lookup(self, key: bytes, ctx: ReqContext) -> LookupResult:
        """``RETRY`` until the key's probe result was drained, then ``HIT``/``MISS``."""
        if self._drain_needed:
            self._drain()
        verdict = self._verdicts.get(key)
        if verdict is None:
            verdict = self._verdicts[key] = _Verdict()
            self._batch.append(key)
        verdict.req_ids.add(ctx.req_id)
        self._keys_of_req.setdefault(ctx.req_id, set()).add(key)
        if verdict.found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if verdict.found else LookupResult.MISS

    def flush(self) -> None:
        """Send this step's batch to the tier's probe (one task); results drain on next lookup."""
        self._drain_needed = True
        if not self._batch:
            return
        batch, self._batch = self._batch, []
        loop = self._tier._jobs.loop
        if loop is None:  # the tier's actor is not running: nothing can be probed
            self.mark_miss(batch)
            return
        task = loop.create_task(self._probe(batch))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _probe(self, batch: Sequence[bytes]) -> None:
        """Post the batch's verdicts; MISS for all of them when the tier's probe raised an
        error that ``contains`` does not answer itself (a defect of an out-of-tree tier): the
        batch holds keys of every request of the step, whose lookups would otherwise answer
        ``RETRY`` for ever."""
        try:
            found = await self._tier.contains(batch)
        except Exception:
            log.exception(
                "tier %s: probe of %d keys raised; answering MISS", self._tier.name, len(batch)
            )
            found = [False] * len(batch)
        self._posted.append(list(zip(batch, found)))

    async def wait_probes(self) -> None:
        """Wait for every probe in flight (tests and shutdown)."""
        while self._probes:
            await asyncio.wait(list(self._probes))

    def _drain(self) -> None:
        self._drain_needed = False
        while self._posted:
            for key, found in self._posted.popleft():
                verdict = self._verdicts.get(key)
                if verdict is not None and verdict.found is None:
                    verdict.found = found

    def mark_miss(self, keys: Iterable[bytes]) -> None:
        """Force the cached verdict of known keys to MISS (a failed promotion; no re-probe)."""
        for key in keys:
            verdict = self._verdicts.get(key)
            if verdict is not None:
                verdict.found = False

    def cleanup(self, req_id: str) -> None:
        """Drop ``req_id`` from its keys; forget verdicts nobody is interested in any more."""
        for key in self._keys_of_req.pop(req_id, ()):
            verdict = self._verdicts.get(key)
            if verdict is None:
                continue
            verdict.req_ids.discard(req_id)
            if not verdict.req_ids:
                del self._verdicts[key]
