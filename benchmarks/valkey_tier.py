"""Throughput of the valkey tier against the plain redis-py client doing the same SET/GET gather.

For each block size (default 64 KiB, 1 MiB, 4 MiB) ``--mib`` MiB of blocks are stored, then
loaded back, against the same server in the same run:

* tier: :class:`kvcascade.tiers.valkey.ValkeyTier` driven through its public API inside its
  actor (``submit_store`` / ``submit_load`` of every job of ``--blocks-per-job`` blocks at once,
  then awaiting the futures): header + xxh3-64 checksum written and verified, values sent
  from (single server: header, row and padding as separate buffers; cluster: assembled) and
  copied into the primary rows, ``--concurrency`` commands in flight.
* raw: one ``redis.asyncio`` client with a pool of the same size (``BlockingConnectionPool`` of
  ``--concurrency`` connections, redis-py's defaults otherwise: in 8.1 a socket timeout of 5 s,
  the tier's ``timeout_s``, and its default parser) doing ``asyncio.gather`` of one ``SET`` per
  block with a prepared ``bytes`` value of the same size (built before the clock starts) under
  a semaphore of ``--concurrency``, then of one ``GET`` per block (no verification, no copy).

The tier and the raw client are each started once per block size, so both pools are cold in the
first repeat only. Every repeat uses fresh keys; keys are deleted after each repeat (untimed).
Loaded bytes are verified after each timed tier load (untimed, as is zeroing the rows before).
Repeats alternate which side goes first; the table shows the best of the repeats, GB/s of
payload (1e9 bytes per second) for store, load and store+load (total bytes / total seconds),
tier/raw ratios, and the CPU seconds this process spent per GB on each side
(``time.process_time``; the server is another process).

Without ``--url`` a ``redis-server`` (or ``valkey-server``) is started on a free loopback port
for the run, persistence off.

Usage::

    python benchmarks/valkey_tier.py                                  # local redis-server
    python benchmarks/valkey_tier.py --url redis://10.0.0.5:6379      # a server of yours

``--quick``: 16 MiB per size, 2 repeats; ``--json PATH``: the tier/raw rows (no goal,
docs/valkey-tier.md) in ``benchmarks/_rows.py``'s format.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator

import numpy as np
import redis.asyncio as aioredis
import torch
from _rows import Row, rows_path, write_rows

import kvcascade as kc
from kvcascade.tiers._block_format import file_size
from kvcascade.tiers._file_mapper import FileMapper, default_identity
from kvcascade.tiers.valkey import ValkeyTier, valkey_tier_from_config


def parse_size(text: str) -> int:
    """``64K`` / ``4M`` / ``4096`` → bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


@contextlib.contextmanager
def local_server() -> Iterator[str]:
    """A ``redis-server`` on a free loopback port for the duration of the block; its URL."""
    binary = shutil.which("valkey-server") or shutil.which("redis-server")
    if binary is None:
        raise SystemExit("no redis-server / valkey-server: apt-get install redis-server")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        args = ["--port", str(port), "--bind", "127.0.0.1", "--dir", tmp, "--save", ""]
        proc = subprocess.Popen(
            [binary, *args, "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            for _ in range(300):
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)):
                    break
                time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}"
        finally:
            proc.terminate()
            proc.wait()


async def tier_pass(tier: ValkeyTier, keys: list[bytes], per_job: int, store: bool) -> float:
    """Seconds to store (or load) every key through the tier, in jobs of ``per_job`` blocks."""
    slots = np.arange(len(keys), dtype=np.int64)
    start = time.perf_counter()
    futures = []
    for j in range(0, len(keys), per_job):
        job = kc.TransferJob(j, keys[j : j + per_job], slots[j : j + per_job], not store)
        futures.append(tier.submit_store(job) if store else tier.submit_load(job))
    results = await asyncio.gather(*futures)
    elapsed = time.perf_counter() - start
    if not all(r.success for r in results):
        raise RuntimeError(f"tier pass failed: {next(r.error for r in results if not r.success)}")
    return elapsed


async def raw_pass(
    client: aioredis.Redis, names: list[str], values: list[bytes], concurrency: int
) -> float:
    """Seconds for a plain gather of SET (``values`` given) or GET, ``concurrency`` at once."""
    sem = asyncio.Semaphore(concurrency)

    async def one(name: str, value: bytes | None) -> None:
        async with sem:
            if value is None:
                await client.get(name)
            else:
                await client.set(name, value)

    start = time.perf_counter()
    await asyncio.gather(*(one(n, v) for n, v in zip(names, values or [None] * len(names))))
    return time.perf_counter() - start


async def bench_size(args: argparse.Namespace, block: int) -> dict[str, float]:
    n = max(4, (args.mib << 20) // block)
    host = kc.HostBuffer(n, block)
    data = np.random.default_rng(0).integers(-128, 127, size=(n, block), dtype=np.int8)
    host.tensor().copy_(torch.from_numpy(data))
    pool = aioredis.BlockingConnectionPool.from_url(args.url, max_connections=args.concurrency)
    client = aioredis.Redis.from_pool(pool)
    cfg = {"url": args.url, "max_concurrency": args.concurrency, "prefix": uuid.uuid4().hex}
    tier = valkey_tier_from_config(host, FileMapper(default_identity("bench-valkey")), cfg)
    started = asyncio.Event()
    actor = asyncio.create_task(tier.serve(started.set))
    await started.wait()
    best: dict[str, float] = {}
    try:
        for repeat in range(args.repeats):
            keys = [kc.make_offload_key(uuid.uuid4().bytes, 0) for _ in range(n)]
            names = [f"raw-{uuid.uuid4().hex}/{i:06d}.bin" for i in range(n)]
            values = [os.urandom(file_size(block)) for _ in range(n)]
            times: dict[str, float] = {}
            cpu_times: dict[str, float] = {}
            try:
                sides = ["tier", "raw"] if repeat % 2 == 0 else ["raw", "tier"]
                for direction in ("store", "load"):
                    for side in sides:
                        store = direction == "store"
                        if side == "tier" and not store:
                            host.tensor().zero_()
                        cpu = time.process_time()
                        if side == "tier":
                            elapsed = await tier_pass(tier, keys, args.blocks_per_job, store)
                        else:
                            elapsed = await raw_pass(
                                client, names, values if store else [], args.concurrency
                            )
                        cpu_times[f"{side}_{direction}"] = time.process_time() - cpu
                        times[f"{side}_{direction}"] = elapsed
                        loaded = side == "tier" and not store
                        if loaded and not np.array_equal(host.tensor().numpy(), data):
                            raise RuntimeError("tier loaded wrong bytes")
            finally:
                await client.delete(*[tier.object_key(k) for k in keys], *names)
            for side in ("tier", "raw"):
                times[f"{side}_both"] = times[f"{side}_store"] + times[f"{side}_load"]
            for name, seconds in times.items():
                gbps = (2 if name.endswith("both") else 1) * n * block / seconds / 1e9
                best[name] = max(best.get(name, 0.0), gbps)
            for name, seconds in cpu_times.items():  # this process's CPU seconds per GB
                per_gb = seconds / (n * block / 1e9)
                best[f"cpu_{name}"] = min(best.get(f"cpu_{name}", math.inf), per_gb)
    finally:
        tier.close()
        await actor
        await client.aclose()
        host.close()
    best["blocks"] = n
    return best


async def main(args: argparse.Namespace) -> None:
    print(f"server {args.url}, concurrency {args.concurrency}, best of {args.repeats}, GB/s")
    print(
        "| block | blocks | tier store | raw store | ratio | tier load | raw load | ratio "
        "| tier store+load | raw store+load | ratio | CPU-s/GB store tier / raw "
        "| CPU-s/GB load tier / raw |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows: list[Row] = []
    for size in args.sizes.split(","):
        block = parse_size(size)
        r = await bench_size(args, block)
        cells = [f"{size}", f"{int(r['blocks'])}"]
        for d in ("store", "load", "both"):
            tier, raw = r[f"tier_{d}"], r[f"raw_{d}"]
            cells += [f"{tier:.3f}", f"{raw:.3f}", f"{tier / raw:.2f}"]
        for d in ("store", "load"):
            cells.append(f"{r[f'cpu_tier_{d}']:.2f} / {r[f'cpu_raw_{d}']:.2f}")
        print("| " + " | ".join(cells) + " |", flush=True)
        for d in ("store", "load"):
            rows.append(Row.of(f"{d} {size} tier/raw", r[f"tier_{d}"], r[f"raw_{d}"], None, "GB/s"))
    if args.json:
        write_rows(args.json, "valkey_tier", rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="server URL (default: start a local redis-server)")
    parser.add_argument("--sizes", default="64K,1M,4M", help="block sizes, comma-separated")
    parser.add_argument("--mib", type=int, default=64, help="MiB of blocks per size")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--blocks-per-job", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="16 MiB per size, 2 repeats")
    parser.add_argument(
        "--json", type=rows_path, help="write the ratio rows here (benchmarks/_rows.py)"
    )
    arguments = parser.parse_args()
    if arguments.quick:
        arguments.mib, arguments.repeats = 16, 2
    if arguments.url:
        asyncio.run(main(arguments))
    else:
        with local_server() as url:
            arguments.url = url
            asyncio.run(main(arguments))
