"""Writes into primary slots in flight, their deadline, and the slots kept out of use for late
writers (``docs/coordinator.md``, "Deadlines and failures").

A write into a primary slot is a GPU→CPU store (no job id: its request reports it through
``complete_store``) or a promotion (the job id of its load job). :class:`PendingWrites` knows,
per key, who writes it and since when, so that

* the awaitable front can wait for the writes a load depends on (:meth:`PendingWrites.waiters`
  for stores; the coordinator adds the promotion jobs' futures);
* a write still in flight ``timeout_s`` after it started is given up (:meth:`expire`): the key
  becomes a miss and its slot is **quarantined** (kept out of the free list) until the late
  writer reports, so late bytes never land in a slot reused by another key (vLLM #49829);
* a tier job failed at its deadline while its thread may still touch its rows
  (:meth:`abandon`) keeps its cascade pins, or its promoted slots quarantined, until the tier
  reports the thread returned (:meth:`release`).

Bookkeeping only: synchronous, on the event-loop thread, never awaits.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection, Sequence

from .index.cpu import CPUOffloadingManager
from .policies.base import BlockStatus


class PendingWrites:
    """The primary writes in flight and the quarantined slots of one coordinator.

    Args:
        primary: the primary tier whose slots are written.
        timeout_s: a write not reported after this many seconds is expired by :meth:`expire`
            (None: never).
    """

    def __init__(self, primary: CPUOffloadingManager, timeout_s: float | None) -> None:
        self.primary = primary
        self.timeout_s = timeout_s
        # key → (monotonic start, req_id, job_id or None) of the write in flight.
        self._writes: dict[bytes, tuple[float, str, int | None]] = {}
        # Expired writes whose writer has not reported yet: key → (req_id, job_id, block).
        # (A key may expire again while an older late writer of it is still out: a list.)
        self._expired: dict[bytes, list[tuple[str, int | None, BlockStatus]]] = {}
        # Jobs failed at their deadline whose thread has not returned:
        # job_id → (keys still pinned, quarantined blocks).
        self._abandoned: dict[int, tuple[list[bytes], list[BlockStatus]]] = {}
        # key → future resolved when its store (job id None) is reported, expired or reset.
        self._waiters: dict[bytes, asyncio.Future[None]] = {}

    def start(self, keys: Sequence[bytes], req_id: str, job_id: int | None) -> None:
        """``req_id``'s store (``job_id`` None) or promotion job ``job_id`` writes ``keys`` now."""
        now = time.monotonic()
        for key in keys:
            self._writes[key] = (now, req_id, job_id)

    def finish(self, key: bytes, job_id: int | None, req_id: str | None = None) -> bool:
        """A writer reports ``key``; False if its write had expired (the report is to be dropped;
        the quarantined slot is freed here)."""
        entries = self._expired.get(key, ())
        for i, (writer, expired_job, block) in enumerate(entries):
            if expired_job == job_id and (req_id is None or writer == req_id):
                del entries[i]
                if not entries:
                    del self._expired[key]
                self.primary.release_quarantined([block])
                return False
        self._writes.pop(key, None)
        self._wake(key)
        return True

    def writers(self, keys: Collection[bytes]) -> dict[int | None, list[bytes]]:
        """The writes in flight of ``keys``, by job id (None: GPU→CPU stores)."""
        out: dict[int | None, list[bytes]] = {}
        for key in keys:
            entry = self._writes.get(key)
            if entry is not None:
                out.setdefault(entry[2], []).append(key)
        return out

    def waiters(self, keys: Collection[bytes]) -> list[asyncio.Future[None]]:
        """Futures resolved once each store of ``keys`` in flight is reported (or expired, or
        dropped by :meth:`reset`); call on the running loop."""
        out = []
        for key in keys:
            if key not in self._writes or self._writes[key][2] is not None:
                continue
            fut = self._waiters.get(key)
            if fut is None:
                fut = self._waiters[key] = asyncio.get_running_loop().create_future()
            out.append(fut)
        return out

    def _wake(self, key: bytes) -> None:
        fut = self._waiters.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    def expire(self) -> tuple[list[bytes], int]:
        """Give up on the writes older than ``timeout_s``: their keys become misses and their
        slots are quarantined until the late writer reports. Returns the expired keys and how
        many slots were quarantined (a key whose block was already gone has none)."""
        if self.timeout_s is None:
            return [], 0
        limit = time.monotonic() - self.timeout_s
        late = [k for k, (start, _, _) in self._writes.items() if start < limit]
        quarantined = 0
        for key in late:
            _, req_id, job_id = self._writes.pop(key)
            self._wake(key)
            block = self.primary.quarantine_write(key)
            if block is not None:
                self._expired.setdefault(key, []).append((req_id, job_id, block))
                quarantined += 1
        return late, quarantined

    def abandon(self, job_id: int, pinned: Sequence[bytes], written: Sequence[bytes]) -> None:
        """Job ``job_id`` failed at its deadline while its thread may still touch its rows: the
        read pins of ``pinned`` (a cascade's keys) stay, the written slots of ``written`` (a
        promotion's keys whose write was still counted) are quarantined and their keys become
        misses, until :meth:`release`."""
        blocks = [b for key in written if (b := self.primary.quarantine_write(key)) is not None]
        self._abandoned[job_id] = (list(pinned), blocks)

    def release(self, job_id: int) -> None:
        """The thread of abandoned job ``job_id`` returned: unpin its keys, free its slots."""
        entry = self._abandoned.pop(job_id, None)
        if entry is not None:
            keys, blocks = entry
            if keys:
                self.primary.complete_load(keys)
            if blocks:
                self.primary.release_quarantined(blocks)

    def reset(self) -> list[BlockStatus]:
        """For the primary tier's reset: forget the writes in flight (their waiters are
        resolved) and return the slots that must stay out of use — those an abandoned thread or
        an expired writer may still touch (an abandoned cascade's pinned slots join them)."""
        self._writes.clear()
        for key in list(self._waiters):
            self._wake(key)
        for job_id, (keys, blocks) in list(self._abandoned.items()):
            pinned = [b for k in keys if (b := self.primary.get_block(k)) is not None]
            self._abandoned[job_id] = ([], [*blocks, *pinned])
        reserved = [b for _, blocks in self._abandoned.values() for b in blocks]
        reserved += [block for entries in self._expired.values() for _, _, block in entries]
        return reserved
