"""Copy throughput: kvcascade's swap path vs plain torch indexed copies, on the host.

A CPU tensor stands in for the device KV cache; the primary tier is a page-aligned anonymous
``mmap`` host buffer (like the shared offload region). For each page size the same random blocks
are copied both ways:

* ``store``: device → host (``swap_blocks`` with ``kernel=--kernel``, default ``auto``)
* ``load``:  host → device

and compared with ``dst.index_copy_(0, dst_ids, src.index_select(0, src_ids))`` on the same
blocks in the same run. Prints GB/s (10^9 bytes/s, median of ``--reps`` runs) and the ratio
swap / torch (target ≥ 0.9). Because torch's int8 ``index_copy_`` is slow on the CPU, a
``ceiling`` column also gives one contiguous ``copy_`` of the same number of bytes between the
two buffers, and ``/ceil`` the swap path's share of it.

    python benchmarks/copy_blocks.py [--total-mib 64] [--reps 7] [--pages 4096,65536]
        [--quick] [--json PATH]

``--quick``: 16 MiB batches, 3 reps; ``--json PATH``: the swap/torch rows (goal >= 0.9) in
``benchmarks/_rows.py``'s format.
"""

from __future__ import annotations

import argparse
import functools
import mmap
import os
import statistics
import time

import numpy as np
import torch
from _rows import Row, rows_path, write_rows

from kvcascade.ops import select_kernel, swap_blocks

DEFAULT_PAGES = [4096, 16384, 65536, 262144, 1 << 20, 2 << 20]


def _median_seconds(fn, reps: int) -> float:
    fn()  # warm-up (page faults, caches, lazy build)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _torch_copy(src: torch.Tensor, dst: torch.Tensor, s: torch.Tensor, d: torch.Tensor) -> None:
    dst.index_copy_(0, d, src.index_select(0, s))


def bench_page(page: int, total: int, reps: int, kernel: str) -> list[tuple]:
    n = max(1, total // page)
    slots = 2 * n  # each side twice the batch, so ids are a random subset
    device = torch.empty(slots, page, dtype=torch.int8)
    device.random_(-128, 127)
    region = mmap.mmap(-1, slots * page)  # page-aligned, like the shared offload region
    host = torch.frombuffer(region, dtype=torch.int8).view(slots, page)
    host.fill_(0)  # pre-fault
    rng = np.random.default_rng(page)
    dev_ids = rng.permutation(slots)[:n].astype(np.int64)
    host_ids = rng.permutation(slots)[:n].astype(np.int64)
    dev_t, host_t = torch.from_numpy(dev_ids), torch.from_numpy(host_ids)
    rows = []
    for name, src, dst, s_ids, d_ids, s_t, d_t in (
        ("store", device, host, dev_ids, host_ids, dev_t, host_t),
        ("load", host, device, host_ids, dev_ids, host_t, dev_t),
    ):
        used = select_kernel(src, dst, n) if kernel == "auto" else kernel
        swap = functools.partial(swap_blocks, src, dst, s_ids, d_ids, kernel=kernel)
        t_swap = _median_seconds(swap, reps)
        expect = src.index_select(0, s_t)
        assert torch.equal(dst.index_select(0, d_t), expect), "copy mismatch"
        t_ref = _median_seconds(functools.partial(_torch_copy, src, dst, s_t, d_t), reps)
        t_ceil = _median_seconds(functools.partial(dst[n:].copy_, src[:n]), reps)
        nbytes = n * page
        rows.append((page, name, n, used, *(nbytes / t / 1e9 for t in (t_swap, t_ref, t_ceil))))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-mib", type=int, default=64, help="bytes per copy batch (MiB)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--pages", default=",".join(map(str, DEFAULT_PAGES)))
    ap.add_argument("--kernel", default="auto", choices=["auto", "cpp", "torch"])
    ap.add_argument("--quick", action="store_true", help="16 MiB batches, 3 reps")
    ap.add_argument(
        "--json", type=rows_path, help="write the ratio rows here (benchmarks/_rows.py)"
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.total_mib, args.reps = 16, 3
    pages = [int(p) for p in args.pages.split(",")]
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, torch threads "
        f"{torch.get_num_threads()}, batch {args.total_mib} MiB, median of {args.reps}"
    )
    print(
        f"{'page':>8} {'dir':>5} {'blocks':>6} {'kernel':>6} {'swap GB/s':>10} "
        f"{'torch GB/s':>10} {'ratio':>6} {'ceiling':>8} {'/ceil':>6}"
    )
    out: list[Row] = []
    for page in pages:
        for page_, name, n, used, swap_gbs, ref_gbs, ceil_gbs in bench_page(
            page, args.total_mib << 20, args.reps, args.kernel
        ):
            print(
                f"{page_:>8} {name:>5} {n:>6} {used:>6} {swap_gbs:>10.2f} {ref_gbs:>10.2f} "
                f"{swap_gbs / ref_gbs:>6.2f} {ceil_gbs:>8.2f} {swap_gbs / ceil_gbs:>6.2f}"
            )
            label = f"{name} page {page_} ({used})"
            out.append(Row.of(f"{label} swap/torch", swap_gbs, ref_gbs, ">= 0.9", "GB/s"))
    if args.json:
        write_rows(args.json, "copy_blocks", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
