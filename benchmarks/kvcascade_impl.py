"""Adapter for ``/work/shared/bench/bookkeeping.py --impl kvcascade_impl:make_manager``.

That script drives any object with vLLM's OffloadingManager method names; this factory returns
kvcascade's managers in its ``--impl`` format. Run it from the repository's ``benchmarks/``
directory (or with it on ``sys.path``), with a Python that has both vLLM and kvcascade::

    cd benchmarks && /tmp/kvcascade-vllm-venv/bin/python /work/shared/bench/bookkeeping.py \\
        --configs lru,arc,tiering --impl kvcascade_impl:make_manager

Run as a script, it drives that harness (``--harness PATH``) itself for the tiering
configuration only, vLLM's ``TieringOffloadingManager`` then kvcascade's coordinator on the
harness's key sequence at capacity n and n // 10, and prints µs per key (best of ``--runs``) and
kvcascade/vLLM (goal <= 0.5); ``--json PATH`` writes those rows in ``benchmarks/_rows.py``'s
format, ``--quick`` uses 5,000 keys and 2 runs::

    PYTHONPATH=. /tmp/kvcascade-vllm-venv/bin/python benchmarks/kvcascade_impl.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
from types import ModuleType
from typing import Any

from _rows import Row, rows_path, write_rows

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


def _load_harness(path: str) -> ModuleType:
    """Import the shared bookkeeping harness from ``path``.

    Raises:
        FileNotFoundError: no such file.
    """
    spec = importlib.util.spec_from_file_location("bookkeeping_harness", path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"no bookkeeping harness at {path!r}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description="Tiering bookkeeping: kvcascade vs vLLM")
    parser.add_argument("--harness", default="/work/shared/bench/bookkeeping.py")
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--quick", action="store_true", help="5,000 keys, 2 runs")
    parser.add_argument(
        "--json", type=rows_path, help="write the ratio rows here (benchmarks/_rows.py)"
    )
    args = parser.parse_args()
    if args.quick:
        args.n, args.runs = 5_000, 2
    harness = _load_harness(args.harness)
    keys = harness.make_keys(args.n)
    print(f"tiering (lru + in-memory tier), N={args.n}, best of {args.runs}, µs per key")
    print(f"{'capacity':>8} {'batch':>5} | {'vLLM':>7} {'ours':>7} {'ours/vLLM':>9} | same hits")
    rows = []
    for capacity in (args.n, args.n // 10):
        for batch in (int(b) for b in args.batches.split(",")):
            best = {}
            for name, factory in (("vllm", harness.vllm_impl), ("ours", make_manager)):
                runs = harness.run_config(
                    factory, "tiering", "lru", capacity, batch, keys, args.runs
                )
                best[name] = (min(r.us_per_key for r in runs), runs[0].hits, runs[0].evicted)
            (theirs, v_hits, v_ev), (ours, o_hits, o_ev) = best["vllm"], best["ours"]
            same = "yes" if (v_hits, v_ev) == (o_hits, o_ev) else f"NO ({o_hits}/{v_hits})"
            print(
                f"{capacity:>8} {batch:>5} | {theirs:7.2f} {ours:7.2f} {ours / theirs:9.2f} | "
                f"{same}",
                flush=True,
            )
            name = f"tiering cap {capacity} batch {batch} kvcascade/vLLM"
            rows.append(Row.of(name, ours, theirs, "<= 0.5", "us/key"))
    if args.json:
        write_rows(args.json, "kvcascade_impl", rows)


if __name__ == "__main__":
    main()
