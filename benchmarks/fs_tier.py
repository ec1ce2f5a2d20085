"""Throughput of the fs tier against a plain thread-pool baseline doing the same file I/O.

For each block size (default 64 KiB, 1 MiB, 4 MiB) N blocks (``--total-mib`` per pass) are
stored, then loaded back, in jobs of ``--blocks-per-job`` blocks:

* tier: :class:`kvcascade.tiers.fs.FileSystemTier` driven through its public API inside its
  actor (``submit_store`` / ``submit_load`` of every job at once, then awaiting the futures):
  header + xxh3-64 checksums written and verified, atomic temp + rename, capacity off. The
  kernel extension is loaded (built if needed) before timing, so the tier runs its compiled
  batch helpers (``kernels/fs_io.cpp``); ``--python-mover`` measures the pure-Python fallback,
  ``--authenticated`` a tier with authenticated blocks (HMAC-SHA256, which runs the pure-Python
  mover: docs/fs-tier.md "Authenticated blocks"), to compare with ``--python-mover``.
* raw: a ``concurrent.futures.ThreadPoolExecutor`` with the same number of threads, one task
  per job, doing per block ``os.mkdir`` of missing parents + ``open(tmp, O_CREAT|O_EXCL|
  O_WRONLY[|O_DIRECT])`` + one ``os.write`` + close + ``os.replace``; loads ``open`` +
  ``os.readv`` into the same host buffer + close. It uses O_DIRECT iff the tier's probe chose it,
  and the same file paths re-rooted to a sibling directory (no header, no checksum).

Every pass writes a fresh tree; trees are deleted after each repeat (untimed). Loaded bytes are
verified after each timed load (untimed). Repeats alternate which side goes first; the table
shows the best of the repeats and the tier/raw ratio. GB/s = 1e9 payload bytes per second.

Usage::

    python benchmarks/fs_tier.py --root /dev/shm   # tmpfs: the software cost
    python benchmarks/fs_tier.py --root /tmp       # the disk (noisier)

"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

import kvcascade as kc
from kvcascade.ops import _build
from kvcascade.tiers._block_format import BlockAuth
from kvcascade.tiers._file_mapper import FileMapper, default_identity
from kvcascade.tiers.fs import FileSystemTier

O_DIRECT = getattr(os, "O_DIRECT", 0)


def parse_size(text: str) -> int:
    """``64K`` / ``1M`` / ``4M`` / ``4096`` → bytes.

    Raises:
        argparse.ArgumentTypeError: not a positive size.
    """
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    clean = text.strip().upper()
    try:
        size = int(clean[:-1]) * units[clean[-1]] if clean[-1:] in units else int(clean)
    except (ValueError, IndexError):
        size = 0
    if size <= 0:
        raise argparse.ArgumentTypeError(f"bad block size {text!r} (e.g. 64K, 1M, 4096)")
    return size


def positive(text: str) -> int:
    """An int >= 1 (argparse type)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def sizes(text: str) -> list[int]:
    """Comma-separated block sizes (argparse type)."""
    return [parse_size(part) for part in text.split(",")]


def fill(host: kc.HostBuffer) -> None:
    """A distinct pseudo-random pattern in every slot."""
    rng = np.random.default_rng(0)
    data = rng.integers(-128, 127, size=(host.num_blocks, host.block_bytes), dtype=np.int8)
    host.tensor().copy_(torch.from_numpy(data))


class Raw:
    """The baseline: a thread pool doing the same writes (temp + rename) and reads."""

    def __init__(self, host: kc.HostBuffer, threads: int, o_direct: bool) -> None:
        self.host = host
        self.pool = ThreadPoolExecutor(threads)
        self.flags = O_DIRECT if o_direct else 0

    def _store_job(self, paths: list[str], slots: list[int]) -> None:
        for path, slot in zip(paths, slots, strict=True):
            tmp = f"{path}_{os.getpid()}_{slot}.tmp"
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | self.flags
            try:
                fd = os.open(tmp, flags, 0o600)
            except FileNotFoundError:
                os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
                fd = os.open(tmp, flags, 0o600)
            try:
                os.write(fd, self.host.row(slot))
            finally:
                os.close(fd)
            os.replace(tmp, path)

    def _load_job(self, paths: list[str], slots: list[int]) -> None:
        for path, slot in zip(paths, slots, strict=True):
            fd = os.open(path, os.O_RDONLY | self.flags)
            try:
                os.readv(fd, [self.host.row(slot)])
            finally:
                os.close(fd)

    def run(self, store: bool, jobs: list[tuple[list[str], list[int]]]) -> float:
        start = time.perf_counter()
        fn = self._store_job if store else self._load_job
        for fut in [self.pool.submit(fn, paths, slots) for paths, slots in jobs]:
            fut.result()
        return time.perf_counter() - start


async def tier_pass(
    tier: FileSystemTier, store: bool, jobs: list[tuple[list[bytes], list[int]]]
) -> float:
    """Submit every job at once and await them; seconds."""
    start = time.perf_counter()
    futures = [
        (tier.submit_load if not store else tier.submit_store)(
            kc.TransferJob(n, keys, np.asarray(slots, dtype=np.int64), not store)
        )
        for n, (keys, slots) in enumerate(jobs)
    ]
    results = await asyncio.gather(*futures)
    elapsed = time.perf_counter() - start
    tier.get_finished_jobs()
    tier.take_events()
    bad = [r for r in results if not r.success]
    if bad:
        raise RuntimeError(f"{len(bad)} tier jobs failed, first: {bad[0].error}")
    return elapsed


def verify(host: kc.HostBuffer, expected: np.ndarray, slots: np.ndarray) -> None:
    got = host.tensor().numpy()[slots]
    if not np.array_equal(got, expected):
        raise RuntimeError("loaded bytes differ from the stored ones")


async def bench_size(args: argparse.Namespace, block: int) -> dict[str, float]:
    n = max(args.blocks_per_job, (args.total_mib << 20) // block)
    # Slots 0..n-1 hold the source pattern; loads go to slots n..2n-1.
    host = kc.HostBuffer(2 * n, block)
    fill(host)
    src = host.tensor().numpy()[:n].copy()
    keys = [kc.make_offload_key(i.to_bytes(16, "big"), 0) for i in range(n)]
    per = args.blocks_per_job
    best: dict[str, float] = {}
    parent = Path(tempfile.mkdtemp(prefix="kvcascade-fsbench-", dir=args.root))
    try:
        for rep in range(args.repeats):
            mapper = FileMapper(default_identity(model_name=f"bench-{rep}", block_bytes=block))
            tier = FileSystemTier(
                host,
                parent / "tier",
                mapper,
                io_threads=args.threads,
                max_queued_jobs=n // per + 1,
                o_direct=not args.buffered,
                compiled_io=not args.python_mover,
                auth=BlockAuth(os.urandom(32), mapper.namespace) if args.authenticated else None,
            )
            raw = Raw(host, args.threads, tier.o_direct)
            raw_paths = [str(parent / "raw" / mapper.relative_path(k)) for k in keys]
            store_jobs = [
                (keys[i : i + per], list(range(i, min(i + per, n)))) for i in range(0, n, per)
            ]
            load_jobs = [(k, [s + n for s in slots]) for k, slots in store_jobs]
            raw_store = [
                (raw_paths[i : i + per], s) for i, (_, s) in zip(range(0, n, per), store_jobs)
            ]
            raw_load = [
                (raw_paths[i : i + per], s) for i, (_, s) in zip(range(0, n, per), load_jobs)
            ]
            async with asyncio.TaskGroup() as group:
                started = asyncio.Event()
                group.create_task(tier.serve(started.set))
                await started.wait()
                sides = ["tier", "raw"] if rep % 2 == 0 else ["raw", "tier"]
                for side in sides:
                    for phase in ("store", "load"):
                        host.tensor().numpy()[n:] = 0
                        if side == "tier":
                            jobs = store_jobs if phase == "store" else load_jobs
                            seconds = await tier_pass(tier, phase == "store", jobs)
                        else:
                            jobs = raw_store if phase == "store" else raw_load
                            seconds = await asyncio.to_thread(raw.run, phase == "store", jobs)
                        if phase == "load":
                            verify(host, src, np.arange(n, 2 * n))
                        name = f"{side} {phase}"
                        best[name] = min(best.get(name, float("inf")), seconds)
                tier.close()
            raw.pool.shutdown()
            best["o_direct"] = float(tier.o_direct)
            shutil.rmtree(parent / "tier")
            shutil.rmtree(parent / "raw")
    finally:
        shutil.rmtree(parent, ignore_errors=True)
        host.close()
    best["bytes"] = float(n * block)
    return best


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=tempfile.gettempdir(), help="directory to write under")
    parser.add_argument(
        "--sizes", type=sizes, default="64K,1M,4M", help="block sizes (comma-separated)"
    )
    parser.add_argument("--total-mib", type=positive, default=512, help="MiB moved per pass")
    parser.add_argument("--blocks-per-job", type=positive, default=16)
    parser.add_argument("--threads", type=positive, default=8, help="I/O threads of both sides")
    parser.add_argument("--repeats", type=positive, default=3)
    parser.add_argument("--buffered", action="store_true", help="no O_DIRECT on either side")
    parser.add_argument(
        "--python-mover", action="store_true", help="the tier's pure-Python mover (no extension)"
    )
    parser.add_argument(
        "--authenticated", action="store_true", help="authenticated blocks (HMAC-SHA256)"
    )
    args = parser.parse_args()
    if not os.path.isdir(args.root):
        parser.error(f"--root {args.root!r} is not a directory")
    if args.authenticated:
        mover = "python, authenticated (HMAC-SHA256)"
    elif args.python_mover:
        mover = "python"
    elif _build.load_extension() is not None:
        mover = "compiled"
    else:
        mover = f"python (extension unavailable: {_build.extension_error()})"
    print(
        f"root={args.root} threads={args.threads} blocks/job={args.blocks_per_job} "
        f"total={args.total_mib} MiB/pass repeats={args.repeats} (best of) tier mover={mover}"
    )
    header = (
        f"{'block':>6} {'io':>8} | {'tier st':>8} {'raw st':>8} {'ratio':>6} | "
        f"{'tier ld':>8} {'raw ld':>8} {'ratio':>6}   (GB/s)"
    )
    print(header)
    for block in args.sizes:
        text = f"{block >> 20}M" if block % (1 << 20) == 0 else f"{block >> 10}K"
        text = text if block % 1024 == 0 else str(block)
        r = await bench_size(args, block)
        gbps = {k: r["bytes"] / v / 1e9 for k, v in r.items() if " " in k}
        print(
            f"{text:>6} {'O_DIRECT' if r['o_direct'] else 'buffered':>8} | "
            f"{gbps['tier store']:8.2f} {gbps['raw store']:8.2f} "
            f"{gbps['tier store'] / gbps['raw store']:6.2f} | "
            f"{gbps['tier load']:8.2f} {gbps['raw load']:8.2f} "
            f"{gbps['tier load'] / gbps['raw load']:6.2f}",
            flush=True,
        )


if __name__ == "__main__":
    asyncio.run(main())
