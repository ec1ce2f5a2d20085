"""Round trip of one synchronous call onto the coordinator's loop: kvcascade's portal
(``LoopThread.call``, ``kvcascade/integrations/_loop.py``) against anyio's
``BlockingPortal.call``, in the same process and run, as µs per call and their ratio.

The vLLM scheduler makes one such call per hook (``lookup`` once per key), so this is the cost
the portal adds to every scheduler step. Workload: ``--calls`` calls of a function returning its
argument, repeated ``--runs`` times, each portal in turn.

    python benchmarks/loop_portal.py [--calls 20000] [--runs 3] [--quick] [--json PATH]

``--quick``: 5000 calls, 2 runs; ``--json PATH``: the best run's µs per call, ours/anyio (goal
<= 1.0), in ``benchmarks/_rows.py``'s format.
"""

from __future__ import annotations

import argparse
import time

from _rows import Row, rows_path, write_rows
from anyio.from_thread import start_blocking_portal

import kvcascade as kc
from kvcascade.integrations._loop import LoopThread


def _echo(value: int) -> int:
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="5000 calls, 2 runs")
    parser.add_argument(
        "--json", type=rows_path, help="write the ratio rows here (benchmarks/_rows.py)"
    )
    args = parser.parse_args()
    if args.quick:
        args.calls, args.runs = 5000, 2
    best_ours = best_theirs = float("inf")
    loop = LoopThread(lambda: kc.TieringCoordinator(kc.CPUOffloadingManager(8), []))
    try:
        with start_blocking_portal() as portal:
            for run in range(args.runs):
                start = time.perf_counter()
                for i in range(args.calls):
                    loop.call(_echo, i)
                ours = (time.perf_counter() - start) / args.calls
                start = time.perf_counter()
                for i in range(args.calls):
                    portal.call(_echo, i)
                theirs = (time.perf_counter() - start) / args.calls
                best_ours, best_theirs = min(best_ours, ours), min(best_theirs, theirs)
                print(
                    f"run {run}: LoopThread.call {ours * 1e6:.1f} µs, BlockingPortal.call "
                    f"{theirs * 1e6:.1f} µs, anyio / ours {theirs / ours:.2f}"
                )
    finally:
        loop.close()
    if args.json:
        row = Row.of(
            "call round trip LoopThread/anyio",
            best_ours * 1e6,
            best_theirs * 1e6,
            "<= 1.0",
            "us/call",
        )
        write_rows(args.json, "loop_portal", [row])


if __name__ == "__main__":
    main()
