"""Event-loop lag while ~1 GiB of fs-tier traffic is in flight (issue #4).

Lag = how late a callback scheduled with ``call_later(1 ms)`` runs. A sampler measures it
continuously while the cascade stores N blocks GPU → CPU → fs and then promotes them back
fs → CPU → GPU. Prints p50 / p99 / max lag (ms) for each phase and the traffic's GB/s.

Baseline, measured in the same run: the same sampler on a bare asyncio loop while N threads
that hold no GIL copy memory (64 MiB ``numpy.copyto`` in a loop), N = the run's fs I/O threads
+ the device copy thread. It is what the machine's scheduler alone gives a loop thread competing
with that many busy threads that never yield (on 2 cores: 2 busy threads p99 ≈ 0.5 ms, 3 ≈ 3
ms, 4 ≈ 6 ms). The cascade's copies yield the CPU every MiB (``kernels/kvc_yield.h``), so its
lag can be lower than this baseline's.

    python benchmarks/loop_lag.py [--root /dev/shm] [--block-mib 1] [--blocks 1024]
                                  [--io-threads 4] [--rounds 8]

Each round stores and loads ``--blocks`` fresh blocks in a new cascade on a fresh directory; the
percentiles are over every round's samples (one round of 1 GiB lasts < 1 s here: ~400 samples,
too few for a stable p99). ``--quick``: 256 blocks, 2 rounds, a 2 s baseline; ``--json PATH``: the
p99 lag of each phase against the baseline's p99 (goal <= 1.0: no worse than a bare loop next to
as many busy threads), in ``benchmarks/_rows.py``'s format.

Like a serving process after start-up (vLLM does the same), it calls ``gc.freeze()`` once the
heavy modules are imported: a full garbage collection walking torch's objects otherwise stalls
every thread, the loop included, for ~75 ms now and then — the lag this measures would be the
collector's, not the cascade's.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import tempfile
import threading
import time

import numpy as np
from _rows import Row, rows_path, write_rows

import kvcascade as kc


async def sample_lag(samples: list[float], stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        due = loop.time() + 0.001
        fired = loop.create_future()
        loop.call_at(due, fired.set_result, None)
        await fired
        samples.append(loop.time() - due)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values) * 1e3, q)) if values else float("nan")


async def baseline(busy_threads: int, seconds: float = 2.0) -> list[float]:
    """Lag samples of a bare loop while ``busy_threads`` GIL-free threads copy memory."""
    stop = threading.Event()

    def burn() -> None:
        # numpy copies with the GIL released and, unlike the cascade's copies, never yield.
        a = np.ones(64 << 20, dtype=np.int8)
        b = np.empty_like(a)
        while not stop.is_set():
            np.copyto(b, a)

    threads = [threading.Thread(target=burn) for _ in range(busy_threads)]
    for t in threads:
        t.start()
    samples: list[float] = []
    done = asyncio.Event()
    sampler = asyncio.create_task(sample_lag(samples, done))
    await asyncio.sleep(seconds)
    done.set()
    await sampler
    stop.set()
    for t in threads:
        t.join()
    return samples


async def one_round(
    root: str, block_bytes: int, blocks: int, batch: int, io_threads: int
) -> dict[str, tuple[list[float], float]]:
    """Store ``blocks`` fresh blocks GPU → CPU → fs, then load them back fs → CPU → GPU, in a
    new cascade on ``root``; per phase: (lag samples, seconds)."""
    tiers = [{"type": "fs", "root_dir": root, "io_threads": io_threads}]
    config = kc.CascadeConfig(
        block_bytes=block_bytes,
        gpu_blocks=batch,
        cpu_blocks=batch * 2,
        secondary_tiers=tiers,
        model_name="bench-loop-lag",
    )
    keys = [kc.make_offload_key(i.to_bytes(8, "big"), 0) for i in range(blocks)]
    out: dict[str, tuple[list[float], float]] = {}
    async with kc.open_cascade(config) as cascade:
        await cascade.store(keys[:1], kc.ReqContext("warm"), [0])  # builds/loads the kernels
        await cascade.wait_cascades()
        for phase in ("store", "load"):
            samples: list[float] = []
            stop = asyncio.Event()
            sampler = asyncio.create_task(sample_lag(samples, stop))
            start = time.perf_counter()
            for i in range(1 if phase == "store" else 0, blocks, batch):
                ctx = kc.ReqContext(f"{phase}-{i}")
                part = keys[i : i + batch]
                gpu = list(range(len(part)))
                if phase == "store":
                    await cascade.store(part, ctx, gpu)
                else:
                    found = await cascade.lookup_prefix(part, ctx)
                    await cascade.load(found.keys, ctx, gpu[: found.num_hits])
                cascade.finish_request(ctx)
            await cascade.wait_cascades()
            seconds = time.perf_counter() - start
            stop.set()
            await sampler
            out[phase] = (samples, seconds)
    return out


async def main(args: argparse.Namespace) -> None:
    block_bytes = int(args.block_mib * (1 << 20))
    busy = args.io_threads + 1
    ref = await baseline(busy, seconds=args.baseline_s)
    print(
        f"baseline: bare loop, {busy} busy memcpy threads; loop lag ms p50 {pct(ref, 50):.3f}  "
        f"p99 {pct(ref, 99):.3f}  max {pct(ref, 100):.3f}  ({len(ref)} samples)"
    )
    phases: dict[str, tuple[list[float], list[float]]] = {"store": ([], []), "load": ([], [])}
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(dir=args.root) as tmp:
            result = await one_round(tmp, block_bytes, args.blocks, args.batch, args.io_threads)
        for phase, (samples, seconds) in result.items():
            phases[phase][0].extend(samples)
            phases[phase][1].append(seconds)
    gb = args.blocks * block_bytes / 1e9
    rows = []
    for phase, (samples, seconds) in phases.items():
        print(
            f"{phase:>5}: {args.rounds} x {gb:.2f} GB, {gb * len(seconds) / sum(seconds):.2f} GB/s "
            f"through the fs tier; loop lag ms p50 {pct(samples, 50):.3f}  "
            f"p99 {pct(samples, 99):.3f}  max {pct(samples, 100):.3f}  ({len(samples)} samples)"
        )
        name = f"{phase} loop-lag p99 cascade/busy-threads"
        rows.append(Row.of(name, pct(samples, 99), pct(ref, 99), "<= 1.0", "ms"))
    if args.json:
        write_rows(args.json, "loop_lag", rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=None, help="fs tier directory (default: a temp dir)")
    parser.add_argument("--block-mib", type=float, default=1.0)
    parser.add_argument("--blocks", type=int, default=1024, help="blocks moved per phase")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--io-threads", type=int, default=4, help="fs tier I/O threads")
    parser.add_argument(
        "--rounds", type=int, default=8, help="store + load rounds, each in a fresh cascade"
    )
    parser.add_argument("--baseline-s", type=float, default=4.0, help="baseline seconds")
    parser.add_argument("--quick", action="store_true", help="256 blocks, 2 rounds, 2 s baseline")
    parser.add_argument(
        "--json", type=rows_path, help="write the ratio rows here (benchmarks/_rows.py)"
    )
    cli = parser.parse_args()
    if cli.quick:
        cli.blocks, cli.rounds, cli.baseline_s = 256, 2, 2.0
    for name in ("blocks", "batch", "io_threads", "rounds"):
        if getattr(cli, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cli, name)}")
    if cli.root is not None and not os.path.isdir(cli.root):
        parser.error(f"--root {cli.root!r} is not a directory")
    gc.collect()
    gc.freeze()
    asyncio.run(main(cli))
