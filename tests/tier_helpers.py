"""Helpers shared by the tier tests: keys and payloads, jobs, and running tier actors."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import random
from collections.abc import AsyncIterator

import numpy as np

import kvcascade as kc
from kvcascade import LookupResult as R

BLOCK = 5000  # not a multiple of 4096: exercises the padded payload
_job_ids = itertools.count()


def kvcascade_warnings(records: list[logging.LogRecord]) -> list[str]:
    """The messages of kvcascade's own WARNING-or-worse records (``caplog.records``): asyncio's
    debug-mode reports of a slow loop step (``Executing ... took 0.147 seconds`` on a loaded
    machine) are left out, since the loop guard of tests/conftest.py judges those."""
    return [
        r.getMessage()
        for r in records
        if r.levelno >= logging.WARNING and r.name.startswith("kvcascade")
    ]


def key(i: int, group: int = 0) -> bytes:
    """A 16-byte block hash derived from ``i``, in KV-cache group ``group``."""
    return kc.make_offload_key(hashlib.sha256(str(i).encode()).digest()[:16], group)


def pattern(i: int, n: int = BLOCK) -> bytes:
    """The ``n`` payload bytes of block ``i`` (pseudo-random, reproducible)."""
    return random.Random(i).randbytes(n)


def job(keys: list[bytes], slots: list[int], promotion: bool) -> kc.TransferJob:
    """A transfer job with a fresh id."""
    return kc.TransferJob(next(_job_ids), keys, np.asarray(slots, dtype=np.int64), promotion)


async def store(
    tier: kc.SecondaryTier, host: kc.HostBuffer, ids: list[int], slots: list[int] | None = None
) -> kc.JobResult:
    """Write blocks ``ids`` into primary rows ``slots`` and store them to ``tier``."""
    slots = slots if slots is not None else list(range(len(ids)))
    for i, slot in zip(ids, slots, strict=True):
        host.row(slot)[:] = pattern(i, host.block_bytes)
    return await tier.submit_store(job([key(i) for i in ids], slots, False))


async def load(tier: kc.SecondaryTier, ids: list[int], slots: list[int]) -> kc.JobResult:
    """Promote blocks ``ids`` from ``tier`` into primary rows ``slots``."""
    return await tier.submit_load(job([key(i) for i in ids], slots, True))


async def lookups(tier: kc.SecondaryTier, keys: list[bytes], ctx: kc.ReqContext) -> list[R]:
    """The async-lookup cycle (vLLM's ``tiering/async_lookup.py``): RETRY, flush at schedule end,
    then the verdicts."""
    first = [tier.lookup(k, ctx) for k in keys]
    if R.RETRY in first:
        tier.on_schedule_end(kc.ScheduleEndContext())
        await tier._lookup.wait_probes()
    return [tier.lookup(k, ctx) for k in keys]


@contextlib.asynccontextmanager
async def running(*tiers: kc.SecondaryTier) -> AsyncIterator[None]:
    """Run the tiers' actors (the lifecycle ``open_cascade`` uses); drain and stop them on
    exit."""
    async with kc.serve_coordinator(kc.TieringCoordinator(kc.CPUOffloadingManager(1), tiers)):
        yield
