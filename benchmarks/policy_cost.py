"""Per-key bookkeeping cost of each eviction policy (µs per key, Python bytes per block).

Same workload shape as ``benchmarks/bookkeeping.py`` (which stays lru/arc-only): ``--n``
distinct keys ``sha256(i) + group 0``, fed in order ``--batch`` keys per call through
``touch`` → ``prepare_store`` → ``complete_store`` → ``lookup`` on one request context per
batch, at capacity ``n`` (no eviction) and ``n // 10`` (90 % of the keys evict one). Time: the
process's CPU time of the loop (``time.process_time``; wall time on a shared machine also counts
the time other processes hold the cores) / n, best and median of ``--runs`` fresh managers.
Memory: ``tracemalloc`` bytes of a manager filled to ``--n`` ready blocks / n (keys allocated
before tracing; for the turn-aware and adaptive policies the directory and the shadow LRU are
included, for ARC and S3-FIFO their ghosts are not yet filled).

    python benchmarks/policy_cost.py [--n 100000] [--runs 3] [--batch 16]
        [--policies lru,arc,s3fifo,turn_aware,adaptive] [--quick] [--json PATH]

``--json PATH``: each policy's best µs per key against ``lru``'s at the same capacity (goal
<= 2.0, the bound docs/policies.md measures against) in ``benchmarks/_rows.py``'s format;
``--quick``: 20,000 keys, 2 runs, where ``--n`` / ``--runs`` are not given.
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

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.append(_HERE)

from _rows import Row, rows_path, write_rows  # noqa: E402

from kvcascade import CPUOffloadingManager, ReqContext  # noqa: E402
from kvcascade.policies import resolve_cache_policy  # noqa: E402


def _keys(n: int) -> list[bytes]:
    return [hashlib.sha256(i.to_bytes(8, "little")).digest() + b"\0\0\0\0" for i in range(n)]


def _run(policy: str, keys: list[bytes], capacity: int, batch: int) -> float:
    """CPU seconds of this process for the whole key sequence on a fresh manager."""
    mgr = CPUOffloadingManager(capacity, policy)
    gc.collect()
    start = time.process_time()
    for i in range(0, len(keys), batch):
        chunk = keys[i : i + batch]
        ctx = ReqContext(f"r{i}")
        mgr.touch(chunk, ctx)
        out = mgr.prepare_store(chunk, ctx)
        if out is not None:
            mgr.complete_store(out.keys_to_store, ctx)
        for key in chunk:
            mgr.lookup(key)
    return time.process_time() - start


def _memory(policy: str, keys: list[bytes], batch: int) -> float:
    """Traced bytes per block of a manager holding every key."""
    gc.collect()
    tracemalloc.start()
    mgr = CPUOffloadingManager(len(keys), policy)
    for i in range(0, len(keys), batch):
        chunk = keys[i : i + batch]
        ctx = ReqContext(f"r{i}")
        mgr.touch(chunk, ctx)
        out = mgr.prepare_store(chunk, ctx)
        assert out is not None
        mgr.complete_store(out.keys_to_store, ctx)
    used = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del mgr
    return used / len(keys)


def main(argv: list[str] | None = None) -> None:
    """Print one row per policy and capacity."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, help="distinct keys (default 100,000)")
    parser.add_argument("--runs", type=int, help="fresh managers per row (default 3)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--policies", default="lru,arc,s3fifo,turn_aware,adaptive")
    parser.add_argument("--quick", action="store_true", help="20,000 keys, 2 runs (unless given)")
    parser.add_argument(
        "--json", type=rows_path, help="write the ratio rows here (benchmarks/_rows.py)"
    )
    args = parser.parse_args(argv)
    for name, quick, full in (("n", 20_000, 100_000), ("runs", 2, 3)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    for name, least in (("n", 10), ("runs", 1), ("batch", 1)):
        if getattr(args, name) < least:
            parser.error(f"--{name} must be >= {least}, got {getattr(args, name)}")
    # lru first: every other policy's row is a ratio to it
    policies = ["lru", *(p for p in args.policies.split(",") if p != "lru")]
    if len(set(policies)) < len(policies):
        parser.error(f"--policies names a policy twice: {args.policies!r}")
    try:
        for name in policies:
            resolve_cache_policy(name)
    except ValueError as exc:  # ConfigError
        parser.error(str(exc))
    keys = _keys(args.n)
    lru_best: dict[int, float] = {}
    rows = []
    print(f"{'policy':<12}{'capacity':>10}{'best µs/key':>13}{'median µs/key':>15}{'B/block':>9}")
    for policy in policies:
        mem = _memory(policy, keys, args.batch)
        for capacity in (args.n, args.n // 10):
            times = [_run(policy, keys, capacity, args.batch) for _ in range(args.runs)]
            per_key = [t / args.n * 1e6 for t in times]
            print(
                f"{policy:<12}{capacity:>10,}{min(per_key):>13.2f}"
                f"{statistics.median(per_key):>15.2f}{mem:>9.0f}"
            )
            if policy == "lru":
                lru_best[capacity] = min(per_key)
            else:
                name = f"{policy} capacity {capacity} {policy}/lru"
                rows.append(Row.of(name, min(per_key), lru_best[capacity], "<= 2.0", "us/key"))
    if args.json:
        write_rows(args.json, "policy_cost", rows)


if __name__ == "__main__":
    main()
