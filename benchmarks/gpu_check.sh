#!/usr/bin/env bash
# GPU check of the copy kernels (issue #6). Target: < 5 minutes on one H200.
#
#   bash benchmarks/gpu_check.sh
#
# 1. builds the extension (C++ + CUDA) and loads the Triton kernel, printing what is available;
# 2. compiles kernels/swap_blocks_cuda.cu standalone with nvcc (if nvcc is on PATH);
# 3. runs tests/ops/test_kernels.py and tests/tiers/test_device_tier.py (CPU cases plus the same cases with
#    CUDA tensors);
# 4. prints H2D (load) and D2H (store) GB/s for pages 4 KiB … 2 MiB: swap_blocks with the C++ op
#    and with the Triton kernel, on a side stream, against one contiguous torch copy_ from/to
#    pinned memory of the same bytes (plain cudaMemcpyAsync);
# 5. times the CUDA event → asyncio future bridge per direction (an awaited DeviceTier load /
#    store against the same copy waited with event.synchronize); plain torch copies from/to a
#    pinned vs a pageable host tensor; then, through the asyncio API's DeviceTier (issue #15):
#    H2D/D2H GB/s from a pinned vs a pageable host buffer, event-loop lag while device copies
#    run, and a load's latency while a long store runs (one bridge per direction);
# 6. runs `kvcascade calibrate` (both directions) into $KVCASCADE_BUILD_DIR/kernel_settings.json
#    (not the user's settings file) and prints the crossover it found;
# 7. replays the first 2,000 requests of the bundled trace with the KV cache on the GPU, every
#    loaded block compared byte for byte (corrupt blocks must read 0);
# 8. prints the ratio rows of steps 4-5 (benchmarks/_rows.py, in $KVCASCADE_BUILD_DIR/gpu_rows)
#    as one table, with benchmarks/run_all.py's table code.
# Environment: KVCASCADE_BUILD_DIR (default build/kvcascade_ext), GPU_CHECK_TOTAL_MIB (256).
# Exit status: non-zero if the build, nvcc or the tests failed (the benchmark still runs).
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
export PYTHONPATH="$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export KVCASCADE_BUILD_DIR="${KVCASCADE_BUILD_DIR:-$PWD/build/kvcascade_ext}"
export GPU_ROWS="$KVCASCADE_BUILD_DIR/gpu_rows"
mkdir -p "$GPU_ROWS" && rm -f "$GPU_ROWS"/*.json
PY="${PYTHON:-$(command -v python || command -v python3)}"
status=0

echo "== environment"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
command -v nvcc >/dev/null && nvcc --version | tail -1
"$PY" - <<'EOF' || exit 2
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, available {torch.cuda.is_available()}")
try:
    import triton
    print(f"triton {triton.__version__}")
except ImportError:
    print("triton not installed")
if not torch.cuda.is_available():
    raise SystemExit("no CUDA device visible to torch")
EOF
if ! command -v ninja >/dev/null; then
    "$PY" -m pip install -q ninja >/dev/null 2>&1 || echo "warning: ninja missing (torch may fall back)"
fi

echo "== build (cached in $KVCASCADE_BUILD_DIR)"
SECONDS=0
timeout 300 "$PY" - <<'EOF' || status=1
import logging
logging.basicConfig(level=logging.INFO)
from kvcascade.ops import _build, extension_available, triton_available
ok = extension_available()
ext = _build.load_extension()
print(f"extension: {ok}, has_cuda: {ext.has_cuda() if ext else None}, "
      f"error: {_build.extension_error()}")
print(f"triton kernel: {triton_available()}")
if not (ok and ext.has_cuda()):
    raise SystemExit("CUDA extension not built")
EOF
echo "build: ${SECONDS}s"

echo "== nvcc standalone compile"
if command -v nvcc >/dev/null; then
    bash kernels/check_nvcc.sh "$KVCASCADE_BUILD_DIR/nvcc_check" || status=1
else
    echo "nvcc not on PATH, skipped"
fi

echo "== tests"
# -W default: a deprecation warning of the GPU machine's torch build must not hide the results.
timeout 300 "$PY" -m pytest tests/ops/test_kernels.py tests/tiers/test_device_tier.py -q -p no:cacheprovider \
    -rs -W default || status=1

echo "== bandwidth (GB/s = 1e9 bytes/s, median of 5, side stream)"
timeout 240 "$PY" - <<'EOF' || status=1
import os
import statistics
import time

import numpy as np
import torch
from _rows import Row, write_rows

from kvcascade.ops import swap_blocks, triton_available

total = int(os.environ.get("GPU_CHECK_TOTAL_MIB", "256")) << 20
pages = [4 << 10, 16 << 10, 28 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20]
kernels = ["cpp"] + (["triton"] if triton_available() else [])
stream = torch.cuda.Stream()


def median_s(fn, reps=5):
    with torch.cuda.stream(stream):
        fn()
        stream.synchronize()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            stream.synchronize()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


print(f"{'page':>8} {'dir':>4} {'blocks':>6} " + "".join(f"{k:>9}" for k in kernels)
      + f" {'memcpy':>9} " + "".join(f"{k + '/mc':>10}" for k in kernels))
rows = []
for page in pages:
    n = max(1, total // page)
    gpu = torch.empty(2 * n, page, dtype=torch.int8, device="cuda").random_(-128, 127)
    host = torch.empty(2 * n, page, dtype=torch.int8).pin_memory()
    host.random_(-128, 127)
    rng = np.random.default_rng(page)
    g_ids = rng.permutation(2 * n)[:n].astype(np.int64)
    h_ids = rng.permutation(2 * n)[:n].astype(np.int64)
    torch.cuda.synchronize()
    for name, src, dst, s_ids, d_ids in (("h2d", host, gpu, h_ids, g_ids),
                                         ("d2h", gpu, host, g_ids, h_ids)):
        row = []
        for k in kernels:
            t = median_s(lambda k=k: swap_blocks(src, dst, s_ids, d_ids, kernel=k))
            row.append(n * page / t / 1e9)
            ok = torch.equal(dst.index_select(0, torch.from_numpy(d_ids).to(dst.device)).cpu(),
                             src.index_select(0, torch.from_numpy(s_ids).to(src.device)).cpu())
            if not ok:
                raise SystemExit(f"mismatch: kernel {k} page {page} {name}")
        t_mc = median_s(lambda: dst[:n].copy_(src[n:], non_blocking=True))
        mc = n * page / t_mc / 1e9
        print(f"{page:>8} {name:>4} {n:>6} " + "".join(f"{v:>9.2f}" for v in row)
              + f" {mc:>9.2f} " + "".join(f"{v / mc:>10.2f}" for v in row))
        for k, v in zip(kernels, row):
            rows.append(Row.of(f"{name} page {page} {k}/memcpy", v, mc, ">= 0.9", "GB/s"))
    del gpu, host
    torch.cuda.empty_cache()
write_rows(os.path.join(os.environ["GPU_ROWS"], "gpu_bandwidth.json"), "gpu_bandwidth", rows)
EOF

echo "== event bridge per direction (µs), pinned vs pageable torch copies (GB/s)"
timeout 90 "$PY" - <<'EOF' || status=1
import asyncio, os, statistics, time
import numpy as np, torch
from _rows import Row, write_rows
import kvcascade as kc
from kvcascade.tiers.device import DeviceTier


def pct(xs, q):
    return float(np.percentile(np.array(xs) * 1e6, q))


async def bridge(rows):
    """200 awaited 16-page copies per direction (launch + copy + event -> future bridge) against
    the same copy on a side stream waited with event.synchronize (no bridge)."""
    host = kc.HostBuffer(64, 4096)
    device = DeviceTier(64, host)
    ids = np.arange(16)
    stream = torch.cuda.Stream()
    for name, op in (("h2d", device.load), ("d2h", device.store)):
        lat, direct = [], []
        for _ in range(200):
            t0 = time.perf_counter()
            assert (await op(ids, ids)).success
            lat.append(time.perf_counter() - t0)
            with torch.cuda.stream(stream):
                if name == "h2d":
                    device.kv[:16].copy_(host.tensor()[:16], non_blocking=True)
                else:
                    host.tensor()[:16].copy_(device.kv[:16], non_blocking=True)
            event = torch.cuda.Event(blocking=True)
            event.record(stream)
            t0 = time.perf_counter()
            event.synchronize()
            direct.append(time.perf_counter() - t0)
        print(f"{name}: awaited p50/p99 {pct(lat, 50):.1f}/{pct(lat, 99):.1f} µs; "
              f"copy + event.synchronize p50/p99 {pct(direct, 50):.1f}/{pct(direct, 99):.1f} µs")
        rows.append(Row.of(f"{name} 16x4KiB awaited/event.synchronize p50", pct(lat, 50),
                           pct(direct, 50), None, "us"))
    device.close()
    host.close()


def host_copies(rows, page=1 << 20, n=128):
    """One contiguous 128 MiB copy_ between the GPU and a pinned / a pageable host tensor."""
    gpu = torch.empty(n, page, dtype=torch.int8, device="cuda")
    got = {}
    for pinned in (True, False):
        host = torch.empty(n, page, dtype=torch.int8)
        host = host.pin_memory() if pinned else host
        for name, dst, src in (("h2d", gpu, host), ("d2h", host, gpu)):
            dst.copy_(src)
            torch.cuda.synchronize()
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                dst.copy_(src, non_blocking=pinned)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            got[(name, pinned)] = n * page / statistics.median(times) / 1e9
    for name in ("h2d", "d2h"):
        pinned, pageable = got[(name, True)], got[(name, False)]
        print(f"torch copy_ {name}: pinned {pinned:.2f} GB/s, pageable {pageable:.2f} GB/s")
        rows.append(Row.of(f"{name} torch copy_ 128 MiB pinned/pageable", pinned, pageable,
                           ">= 1.0", "GB/s"))


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    rows = []
    asyncio.run(bridge(rows))
    host_copies(rows)
    write_rows(os.path.join(os.environ["GPU_ROWS"], "gpu_bridge.json"), "gpu_bridge", rows)
EOF

echo "== DeviceTier (issue #15): pinned vs pageable GB/s, loop lag, bridge latency per direction"
timeout 180 "$PY" - <<'EOF' || status=1
import asyncio, os, statistics, time
import numpy as np, torch
from _rows import Row, write_rows
import kvcascade as kc
from kvcascade.tiers.device import DeviceTier

PAGE, N = 256 << 10, 512  # one transfer: 512 pages of 256 KiB = 128 MiB


async def ticker(lags, stop):
    """Event-loop lag: how late a 1 ms sleep wakes up while transfers run."""
    while not stop.is_set():
        t0 = time.perf_counter()
        await asyncio.sleep(0.001)
        lags.append(time.perf_counter() - t0 - 0.001)


async def bandwidth(pinned):
    host = kc.HostBuffer(N, PAGE)
    if not pinned:
        host.pin = lambda: False  # keep this buffer pageable, for the comparison only
    device = DeviceTier(N, host)
    assert host.pinned == pinned, (host.pinned, pinned)
    ids = np.arange(N)
    gbs, lags, stop = {}, [], asyncio.Event()
    tick = asyncio.ensure_future(ticker(lags, stop))
    for name, op in (("h2d", device.load), ("d2h", device.store)):
        assert (await op(ids, ids)).success  # warm-up
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            assert (await op(ids, ids)).success
            times.append(time.perf_counter() - t0)
        gbs[name] = N * PAGE / statistics.median(times) / 1e9
    stop.set()
    await tick
    device.close()
    host.close()
    return gbs, np.percentile(np.array(lags) * 1e3, [50, 99, 100])


async def per_direction():
    """A 4-page load submitted while a 128 MiB store runs: its latency, and whether it had to
    wait for the store (one bridge per direction: it never should)."""
    host = kc.HostBuffer(N, PAGE)
    device = DeviceTier(N, host)
    small, ids = np.arange(4), np.arange(N)
    for _ in range(3):
        assert (await device.load(small, small)).success
    lat, behind = [], 0
    for _ in range(20):
        store = asyncio.ensure_future(device.store(ids, ids))
        await asyncio.sleep(0.001)  # the store is launched first
        t0 = time.perf_counter()
        assert (await device.load(small, small + N // 2)).success
        lat.append(time.perf_counter() - t0)
        behind += store.done()
        assert (await store).success
    device.close()
    host.close()
    return np.array(lat) * 1e6, behind


async def main():
    ext = kc.ops.extension_available()  # the build is cached by the build step above
    print(f"extension built: {ext}")
    got = {}
    for pinned in (True, False):
        gbs, lag = await bandwidth(pinned)
        got[pinned] = gbs, lag
        label = "pinned  " if pinned else "pageable"
        print(f"{label} h2d {gbs['h2d']:6.2f} GB/s  d2h {gbs['d2h']:6.2f} GB/s  "
              f"loop lag p50/p99/max {lag[0]:.2f}/{lag[1]:.2f}/{lag[2]:.2f} ms")
    us, behind = await per_direction()
    print(f"4-page load during a 128 MiB store: p50/p99 {np.percentile(us, 50):.0f}/"
          f"{np.percentile(us, 99):.0f} µs; waited for the store in {behind}/{len(us)} runs")
    rows = [
        Row.of(f"{d} DeviceTier 128 MiB pinned/pageable", got[True][0][d], got[False][0][d],
               ">= 1.0", "GB/s")
        for d in ("h2d", "d2h")
    ]
    rows.append(Row.of("loop lag p99 during pinned copies", float(got[True][1][1]), None,
                       "<= 2.0", "ms"))
    rows.append(Row.of("4-page loads that waited for a 128 MiB store", float(behind), None,
                       "<= 0", "loads"))
    write_rows(os.path.join(os.environ["GPU_ROWS"], "gpu_device_tier.json"), "gpu_device_tier",
               rows)

asyncio.run(main())
EOF

echo "== kvcascade calibrate (written to $KVCASCADE_BUILD_DIR/kernel_settings.json)"
timeout 120 "$PY" -c 'import sys; from kvcascade.replay.cli import main; sys.exit(main(sys.argv[1:]))' \
    calibrate --output "$KVCASCADE_BUILD_DIR/kernel_settings.json" --reps 10 \
    && cat "$KVCASCADE_BUILD_DIR/kernel_settings.json" || status=1

echo "== replay on the GPU: 2,000 requests, byte-exact check of every loaded block"
timeout 120 "$PY" - <<'EOF' || status=1
import sys, torch
from kvcascade.replay.cli import main
print(f"KV cache device: cuda ({torch.cuda.get_device_name()})")
sys.exit(main(["replay", "--requests", "2000", "--quiet"]))
EOF

echo "== ratio table"
rows=("$GPU_ROWS"/*.json)
if [ -e "${rows[0]}" ]; then
    "$PY" benchmarks/run_all.py --table "${rows[@]}" || status=1
else
    echo "no ratio rows were written"; status=1
fi

echo "== done in ${SECONDS}s total since build start, status $status"
exit $status
