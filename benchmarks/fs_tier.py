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
* vllm (when ``vllm`` is importable, e.g. ``/tmp/kvcascade-vllm-venv/bin/python``): vLLM 0.32's
  ``FileSystemTierManager`` (``vllm/v1/kv_offload/tiering/fs/manager.py``) over the same host
  buffer, with its compiled ``fs_io_C`` helpers when built and O_DIRECT when its
  ``probe_o_direct`` accepts the root; ``--threads`` split into its read and write threads
  (``threads // 2`` each, at least 1). One ``submit_store`` / ``submit_load`` per job, then
  ``drain_jobs`` and ``get_finished_jobs`` (every job must succeed). vLLM writes no header and
  no checksum: the ratio kvcascade/vLLM prices kvcascade's checksums and header in.

Every pass writes a fresh tree; trees are deleted after each repeat (untimed). Loaded bytes are
verified after each timed load (untimed). Repeats rotate which side goes first; the table shows
the best of the repeats and the ratios tier/raw and tier/vLLM (goal >= 1.0). GB/s = 1e9 payload
bytes per second. ``--json PATH`` writes the kvcascade/vLLM rows (kvcascade/raw without vLLM) in
``benchmarks/_rows.py``'s format; ``--quick`` moves 32 MiB per pass, 2 repeats.

Usage::

    python benchmarks/fs_tier.py                           # /tmp (disk) and /dev/shm (tmpfs)
    python benchmarks/fs_tier.py --root /dev/shm           # tmpfs only: the software cost
    PYTHONPATH=. /tmp/kvcascade-vllm-venv/bin/python benchmarks/fs_tier.py   # + vLLM's side

"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from _rows import Row, rows_path, write_rows

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


def vllm_available() -> bool:
    """Whether vLLM's fs tier can be imported here (it is never a kvcascade dependency)."""
    return importlib.util.find_spec("vllm") is not None


class Vllm:
    """vLLM 0.32's ``FileSystemTierManager`` over ``host``'s rows (module docstring).

    Imports vLLM when built. ``host.block_bytes`` must be a multiple of the page size (vLLM
    addresses chunk ``c`` at byte ``c * strides[0]`` of a contiguous view).

    Raises:
        ValueError: ``host.block_bytes`` is not a multiple of the page size.
    """

    def __init__(self, host: kc.HostBuffer, root: Path, threads: int) -> None:
        if host.row_bytes != host.block_bytes:
            raise ValueError(
                f"vLLM's side needs page-multiple blocks, got block_bytes={host.block_bytes}"
            )
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm.v1.kv_offload.base import ReqContext
        from vllm.v1.kv_offload.tiering.base import TransferJob
        from vllm.v1.kv_offload.tiering.fs import io as fs_io
        from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

        self._job, self._ctx = TransferJob, ReqContext("fs-bench")
        self.compiled = fs_io._HAS_FSIO_C
        rows = host.tensor().numpy().view(np.uint8)
        self._view = memoryview(rows)
        half = max(1, threads // 2)
        self.tier = FileSystemTierManager(
            _vllm_spec(host.block_bytes), self._view, "fs", str(root), half, half
        )
        self.o_direct = self.tier._use_o_direct
        self._next_id = 0

    def run(self, store: bool, jobs: list[tuple[list[bytes], list[int]]]) -> float:
        """Submit every job, drain the pool; seconds.

        Raises:
            RuntimeError: a job failed.
        """
        start = time.perf_counter()
        submit = self.tier.submit_store if store else self.tier.submit_load
        for keys, slots in jobs:
            self._next_id += 1
            chunks = np.asarray(slots, dtype=np.int64)
            submit(self._job(self._next_id, keys, chunks, not store, self._ctx))
        self.tier.drain_jobs()
        results = list(self.tier.get_finished_jobs())
        elapsed = time.perf_counter() - start
        bad = [r for r in results if not r.success]
        if bad or len(results) != len(jobs):
            raise RuntimeError(f"vLLM: {len(bad)} of {len(results)}/{len(jobs)} jobs failed")
        return elapsed

    def close(self) -> None:
        self.tier.shutdown()
        self._view.release()


def _vllm_spec(block: int) -> object:
    """The smallest ``OffloadingSpec`` vLLM's fs tier reads (``.config``, blocks per chunk 1)."""
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    class _Spec(OffloadingSpec):
        def get_manager(self) -> None:
            raise NotImplementedError

        def get_worker(self, kv_caches: object) -> None:
            raise NotImplementedError

    parallel = OffloadingParallelConfig(
        rank=0,
        world_size=1,
        tp_size=1,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        data_parallel_index=0,
        data_parallel_size=1,
        data_parallel_rank_local=None,
        is_parallelism_agnostic=True,
    )
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=32, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=block,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="kvcascade-fs-bench",
        model=OffloadingModelConfig(name="bench/fs-tier", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=1),
        parallel=parallel,
    )
    return _Spec(config)


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


async def bench_size(args: argparse.Namespace, root: str, block: int) -> dict[str, float]:
    """Best seconds per ``"<side> <phase>"`` at one block size under ``root``, plus ``bytes``
    and ``o_direct`` (the tier's choice)."""
    n = max(args.blocks_per_job, (args.total_mib << 20) // block)
    # Slots 0..n-1 hold the source pattern; loads go to slots n..2n-1.
    host = kc.HostBuffer(2 * n, block)
    fill(host)
    src = host.tensor().numpy()[:n].copy()
    keys = [kc.make_offload_key(i.to_bytes(16, "big"), 0) for i in range(n)]
    per = args.blocks_per_job
    best: dict[str, float] = {}
    use_vllm = args.vllm and host.row_bytes == block
    parent = Path(tempfile.mkdtemp(prefix="kvcascade-fsbench-", dir=root))
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
            vllm = Vllm(host, parent / "vllm", args.threads) if use_vllm else None
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
            sides = ["tier", "raw", "vllm"] if vllm is not None else ["tier", "raw"]
            sides = sides[rep % len(sides) :] + sides[: rep % len(sides)]
            async with asyncio.TaskGroup() as group:
                started = asyncio.Event()
                group.create_task(tier.serve(started.set))
                await started.wait()
                for side in sides:
                    for phase in ("store", "load"):
                        host.tensor().numpy()[n:] = 0
                        store = phase == "store"
                        if side == "tier":
                            seconds = await tier_pass(
                                tier, store, store_jobs if store else load_jobs
                            )
                        elif side == "raw":
                            jobs = raw_store if store else raw_load
                            seconds = await asyncio.to_thread(raw.run, store, jobs)
                        else:
                            assert vllm is not None
                            jobs = store_jobs if store else load_jobs
                            seconds = await asyncio.to_thread(vllm.run, store, jobs)
                        if not store:
                            verify(host, src, np.arange(n, 2 * n))
                        name = f"{side} {phase}"
                        best[name] = min(best.get(name, float("inf")), seconds)
                tier.close()
            raw.pool.shutdown()
            if vllm is not None:
                best["vllm o_direct"] = float(vllm.o_direct)
                best["vllm compiled"] = float(vllm.compiled)
                vllm.close()
            best["o_direct"] = float(tier.o_direct)
            for side in ("tier", "raw", "vllm"):
                shutil.rmtree(parent / side, ignore_errors=True)
    finally:
        shutil.rmtree(parent, ignore_errors=True)
        host.close()
    best["bytes"] = float(n * block)
    return best


def size_text(block: int) -> str:
    """``64K`` / ``1M`` / ``4096``."""
    if block % (1 << 20) == 0:
        return f"{block >> 20}M"
    return f"{block >> 10}K" if block % 1024 == 0 else str(block)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--root",
        action="append",
        help="directory to write under (repeatable; default: /tmp and /dev/shm)",
    )
    parser.add_argument(
        "--sizes", type=sizes, default="64K,1M,4M", help="block sizes (comma-separated)"
    )
    parser.add_argument("--total-mib", type=positive, default=512, help="MiB moved per pass")
    parser.add_argument("--blocks-per-job", type=positive, default=16)
    parser.add_argument("--threads", type=positive, default=8, help="I/O threads of every side")
    parser.add_argument("--repeats", type=positive, default=3)
    parser.add_argument("--buffered", action="store_true", help="no O_DIRECT on either side")
    parser.add_argument(
        "--python-mover", action="store_true", help="the tier's pure-Python mover (no extension)"
    )
    parser.add_argument(
        "--authenticated", action="store_true", help="authenticated blocks (HMAC-SHA256)"
    )
    parser.add_argument("--no-vllm", dest="vllm", action="store_false", help="skip vLLM's side")
    parser.add_argument("--quick", action="store_true", help="32 MiB per pass, 2 repeats")
    parser.add_argument(
        "--json", type=rows_path, help="write the ratio rows here (benchmarks/_rows.py)"
    )
    args = parser.parse_args()
    if args.quick:
        args.total_mib, args.repeats = 32, 2
    roots = args.root or [r for r in ("/tmp", "/dev/shm") if os.path.isdir(r)]
    for root in roots:
        if not os.path.isdir(root):
            parser.error(f"--root {root!r} is not a directory")
    args.vllm = args.vllm and vllm_available()
    if args.authenticated:
        mover = "python, authenticated (HMAC-SHA256)"
    elif args.python_mover:
        mover = "python"
    elif _build.load_extension() is not None:
        mover = "compiled"
    else:
        mover = f"python (extension unavailable: {_build.extension_error()})"
    print(
        f"threads={args.threads} blocks/job={args.blocks_per_job} total={args.total_mib} MiB/pass "
        f"repeats={args.repeats} (best of) tier mover={mover} vLLM side={args.vllm}"
    )
    header = (
        f"{'root':>8} {'block':>5} {'io':>8} | {'tier st':>7} {'raw st':>7} {'vllm st':>7} "
        f"{'t/raw':>5} {'t/vllm':>6} | {'tier ld':>7} {'raw ld':>7} {'vllm ld':>7} "
        f"{'t/raw':>5} {'t/vllm':>6}   (GB/s)"
    )
    print(header)
    rows: list[Row] = []
    for root in roots:
        for block in args.sizes:
            r = await bench_size(args, root, block)
            gbps = {k: r["bytes"] / v / 1e9 for k, v in r.items() if k.endswith(("store", "load"))}
            cells = []
            for phase in ("store", "load"):
                tier_, raw_, vllm_ = (
                    gbps.get(f"{side} {phase}") for side in ("tier", "raw", "vllm")
                )
                assert tier_ is not None and raw_ is not None
                v_text = f"{vllm_:7.2f}" if vllm_ else f"{'-':>7}"
                ratio = f"{tier_ / vllm_:6.2f}" if vllm_ else f"{'-':>6}"
                cells.append(f"{tier_:7.2f} {raw_:7.2f} {v_text} {tier_ / raw_:5.2f} {ratio}")
                label = f"{phase} {size_text(block)} {root}"
                if vllm_:
                    rows.append(Row.of(f"{label} kvcascade/vLLM", tier_, vllm_, ">= 1.0", "GB/s"))
                rows.append(Row.of(f"{label} kvcascade/raw", tier_, raw_, None, "GB/s"))
            io = "O_DIRECT" if r["o_direct"] else "buffered"
            print(f"{root:>8} {size_text(block):>5} {io:>8} | {cells[0]} | {cells[1]}", flush=True)
    if args.json:
        write_rows(args.json, "fs_tier", rows)


if __name__ == "__main__":
    asyncio.run(main())
