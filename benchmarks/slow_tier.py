"""p99 latency of ``Cascade.lookup_prefix`` with one tier hung against the healthy case, same run.

A cascade of two secondary tiers, s3 (``moto_server`` behind the fault proxy of
``tests/s3_fixtures.py``, 127.0.0.1) then fs (a temp directory), is filled with ``--stored``
blocks by a first cascade. Then, for each case, a fresh cascade (empty primary, an s3 tier that
knows no key, as a new process) runs ``--lookups`` lookups one after the other, each of a
4-key prefix: one stored key (cycling through the stored ones) followed by three keys nobody
stored, so every lookup probes both tiers (the stored key is found, the prefix ends at the
first new key). After each lookup the request is finished, its promotion awaited and the
primary emptied (``reset_cache``), all untimed.

* healthy: the proxy forwards at once;
* hung: the proxy holds every S3 answer back ``--delay`` seconds (5 by default), far beyond the
  probe deadline ``probe_timeout_s`` (default 0.25 s) and below ``io_timeout_s`` (30 s): the
  first lookups each wait one probe deadline, then the tier is degraded and its probes miss at
  once (docs/architecture.md, "Slow and hung tiers").

Reported: p50 / p99 / max of the lookups of each case, in milliseconds, the ratio of the p99s
(goal: hung ≤ 2× healthy, issue #21), and the s3 tier's counters of the hung case.

Usage::

    PYTHONPATH=. python benchmarks/slow_tier.py        # 1000 lookups per case
    PYTHONPATH=. python benchmarks/slow_tier.py --lookups 300 --delay 2

``--quick``: 200 lookups, 64 stored blocks, 2 s delay; ``--json PATH``: the p99 row (goal <= 2.0)
in ``benchmarks/_rows.py``'s format.

"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _rows import Row, rows_path, write_rows

_TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(_TESTS))  # the moto server and the fault proxy of the test suite

from s3_fixtures import ACCESS_KEY, SECRET_KEY, Fault, FaultProxy, MotoServer  # noqa: E402

import kvcascade as kc  # noqa: E402

BLOCK = 4096
PREFIX = 4


def config(endpoint: str, bucket: str, fs_dir: str, cpu_blocks: int) -> kc.CascadeConfig:
    return kc.CascadeConfig(
        block_bytes=BLOCK,
        gpu_blocks=64,
        cpu_blocks=cpu_blocks,
        secondary_tiers=[
            {
                "type": "s3",
                "bucket": bucket,
                "endpoint_url": endpoint,
                "region": "us-east-1",
                "access_key": ACCESS_KEY,
                "secret_key": SECRET_KEY,
                "addressing_style": "path",
            },
            {"type": "fs", "root_dir": fs_dir},
        ],
        model_name="bench-slow-tier",
    )


def new_key() -> bytes:
    return kc.make_offload_key(uuid.uuid4().bytes, 0)


async def fill(cfg: kc.CascadeConfig, keys: list[bytes]) -> None:
    """Store ``keys`` (random payloads) into both tiers through a cascade, in GPU-sized batches."""
    async with kc.open_cascade(cfg) as cascade:
        kv = cascade.device.kv
        batch = kv.shape[0]
        for start in range(0, len(keys), batch):
            part = keys[start : start + batch]
            kv[: len(part)] = torch.randint(-128, 127, (len(part), BLOCK), dtype=torch.int8)
            ctx = kc.ReqContext(f"fill{start}")
            cascade.coordinator.on_new_request(ctx)
            stored = await cascade.store(part, ctx, list(range(len(part))))
            cascade.finish_request(ctx)
            await cascade.wait_cascades()
            if stored.stored != part:
                raise RuntimeError("the fill was not stored whole")
            await cascade.coordinator.reset_cache()
        if any(t.counters["store_failures"] for t in cascade.tiers):
            raise RuntimeError("a tier failed to store the fill")


async def run_case(
    cfg: kc.CascadeConfig, stored: list[bytes], lookups: int
) -> tuple[list[float], dict[str, Any], dict[str, int]]:
    """Seconds of each lookup, the s3 tier's counters and the source tiers of the hits."""
    times: list[float] = []
    sources: dict[str, int] = {}
    async with kc.open_cascade(cfg) as cascade:
        for i in range(lookups):
            keys = [stored[i % len(stored)], *(new_key() for _ in range(PREFIX - 1))]
            ctx = kc.ReqContext(f"r{i}")
            cascade.coordinator.on_new_request(ctx)
            start = time.perf_counter()
            found = await cascade.lookup_prefix(keys, ctx)
            times.append(time.perf_counter() - start)
            if found.keys != keys[:1]:
                raise RuntimeError(f"lookup {i} found {len(found.keys)} keys, expected 1")
            for tier in found.tiers:
                sources[tier] = sources.get(tier, 0) + 1
            cascade.finish_request(ctx)
            promotions = cascade.coordinator.job_futures(promotions=True)
            if promotions:
                await asyncio.wait(promotions)
            await cascade.coordinator.reset_cache()
        counters = dict(cascade.tiers[0].counters)
    return times, counters, sources


def stats(times: list[float]) -> dict[str, float]:
    ms = np.array(times) * 1e3
    return {
        "p50": float(np.percentile(ms, 50)),
        "p99": float(np.percentile(ms, 99)),
        "max": float(ms.max()),
    }


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="kvcascade-slow-tier-") as tmp:
        moto = MotoServer(Path(tmp) / "moto.log")
        moto.start()
        try:
            bucket = f"kvc-slow-{uuid.uuid4().hex[:8]}"
            moto.client().create_bucket(Bucket=bucket)
            async with FaultProxy(moto.port) as proxy:
                cfg = config(proxy.endpoint, bucket, os.path.join(tmp, "fs"), args.cpu_blocks)
                stored = [new_key() for _ in range(args.stored)]
                await fill(cfg, stored)
                results = {}
                for case in ("healthy", "hung"):
                    proxy.faults[:] = [Fault("delay", seconds=args.delay)] if case == "hung" else []
                    results[case] = await run_case(cfg, stored, args.lookups)
                proxy.faults.clear()
        finally:
            moto.stop()
    print(
        f"lookup_prefix of {PREFIX} keys (1 stored + {PREFIX - 1} new), {args.lookups} lookups "
        f"per case, s3 answers delayed {args.delay:g} s when hung"
    )
    print(f"{'case':<8} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9}  hits by tier")
    for case, (times, _, sources) in results.items():
        s = stats(times)
        print(f"{case:<8} {s['p50']:9.2f} {s['p99']:9.2f} {s['max']:9.2f}  {sources}")
    ratio = stats(results["hung"][0])["p99"] / stats(results["healthy"][0])["p99"]
    print(f"p99 hung / healthy: {ratio:.2f} (goal <= 2)")
    if args.json:
        p99 = [stats(results[case][0])["p99"] for case in ("hung", "healthy")]
        write_rows(
            args.json, "slow_tier", [Row.of("lookup_prefix p99 hung/healthy", *p99, "<= 2.0", "ms")]
        )
    hung = results["hung"][1]
    print(
        "s3 tier, hung case: "
        + ", ".join(
            f"{k} {hung.get(k, 0)}"
            for k in ("probe_timeouts", "degradations", "degraded_probes", "timeouts")
        )
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lookups", type=int, default=1000, help="lookups per case")
    parser.add_argument("--stored", type=int, default=256, help="blocks stored beforehand")
    parser.add_argument("--delay", type=float, default=5.0, help="s3 delay when hung, seconds")
    parser.add_argument("--cpu-blocks", type=int, default=64, help="primary tier slots")
    parser.add_argument("--quick", action="store_true", help="200 lookups, 64 stored, 2 s delay")
    parser.add_argument(
        "--json", type=rows_path, help="write the ratio row here (benchmarks/_rows.py)"
    )
    args = parser.parse_args()
    if args.quick:
        args.lookups, args.stored, args.delay = 200, 64, 2.0
    return args


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
