"""Adapter for ``/work/shared/bench/bookkeeping.py --impl kvcascade_impl:make_manager``.

That script drives any object with vLLM's OffloadingManager method names; this factory returns
kvcascade's managers in its ``--impl`` format. Run it from the repository's ``benchmarks/``
directory (or with it on ``sys.path``), with a Python that has both vLLM and kvcascade::

    cd benchmarks && /tmp/kvcascade-vllm-venv/bin/python /work/shared/bench/bookkeeping.py \\
        --configs lru,arc,tiering --impl kvcascade_impl:make_manager
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from kvcascade import (
    CPUOffloadingManager,
    HostBuffer,
    LookupResult,
    MemoryTier,
    ReqContext,
    ScheduleEndContext,
    TieringCoordinator,
    serve_coordinator,
)

_HIT = LookupResult.HIT
_TIER_BLOCK_BYTES = 4096  # vLLM's side uses 4 KiB chunks, the smallest it allows


def is_hit(result: LookupResult) -> bool:
    """True for a ``HIT`` answer."""
    return result is _HIT


def _tiering(policy: str, capacity: int) -> dict[str, Any]:
    """The coordinator over a ``capacity``-slot primary and a :class:`~kvcascade.MemoryTier`.

    The hooks are synchronous and run on the thread that owns the loop, as in an engine's
    scheduler (docs/coordinator.md, "Step timeline"); the tier's actor runs on a loop of the
    harness's thread that is not running while the harness calls the hooks. ``schedule_end``
    ends an engine step: it runs the loop until every cascade job submitted so far finished
    (vLLM's ``ExampleSecondaryTierManager`` completes its jobs inside ``submit_store``, so
    its blocks are unpinned at the next poll too), then calls ``on_schedule_end``. That wait
    is timed, and it includes the tier's real work: a thread-pool hop and a 4 KiB copy per
    block, which vLLM's example tier does not do.
    """
    loop = asyncio.new_event_loop()
    host = HostBuffer(capacity, _TIER_BLOCK_BYTES)
    coordinator = TieringCoordinator(CPUOffloadingManager(capacity, policy), [MemoryTier(host)])
    stack = contextlib.AsyncExitStack()
    loop.run_until_complete(stack.enter_async_context(serve_coordinator(coordinator)))
    step_end = ScheduleEndContext()

    async def _jobs_done() -> None:
        futures = coordinator.job_futures()
        if futures:
            await asyncio.wait(futures)

    def schedule_end(mgr: TieringCoordinator, _ctx: ReqContext | None) -> None:
        if mgr.job_futures():
            loop.run_until_complete(_jobs_done())
        mgr.on_schedule_end(step_end)

    def close() -> None:
        try:
            loop.run_until_complete(stack.aclose())
        finally:
            loop.close()
            host.close()

    return {
        "manager": coordinator,
        "make_ctx": ReqContext,
        "is_hit": is_hit,
        "schedule_end": schedule_end,
        "close": close,
    }


def make_manager(kind: str, policy: str, capacity: int) -> dict[str, Any] | None:
    """``--impl`` factory: kvcascade's CPU manager (``kind == "single"``) or the tiering
    coordinator with an in-memory secondary tier (``kind == "tiering"``); None otherwise."""
    if kind == "single":
        return {
            "manager": CPUOffloadingManager(capacity, policy),
            "make_ctx": ReqContext,
            "is_hit": is_hit,
        }
    if kind == "tiering":
        return _tiering(policy, capacity)
    return None
