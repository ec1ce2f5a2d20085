"""Round trip of one synchronous call onto the coordinator's loop: kvcascade's portal
(``LoopThread.call``, ``kvcascade/integrations/_loop.py``) against anyio's
``BlockingPortal.call``, in the same process and run, as µs per call and their ratio.

The vLLM scheduler makes one such call per hook (``lookup`` once per key), so this is the cost
the portal adds to every scheduler step. Workload: ``--calls`` calls of a function returning its
argument, repeated ``--runs`` times, each portal in turn.

    python benchmarks/loop_portal.py [--calls 20000] [--runs 3]
"""

from __future__ import annotations

import argparse
import time

from anyio.from_thread import start_blocking_portal

import kvcascade as kc
from kvcascade.integrations._loop import LoopThread


def _echo(value: int) -> int:
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
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
                print(
                    f"run {run}: LoopThread.call {ours * 1e6:.1f} µs, BlockingPortal.call "
                    f"{theirs * 1e6:.1f} µs, anyio / ours {theirs / ours:.2f}"
                )
    finally:
        loop.close()


if __name__ == "__main__":
    main()
