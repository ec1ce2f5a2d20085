"""Throughput of the s3 tier against plain aiobotocore ``asyncio.gather`` of the same requests.

For each block size (default 256 KiB and 4 MiB) ``--blocks`` blocks are stored, then loaded
back, against the same S3 server in the same run:

* tier: :class:`kvcascade.tiers.s3.S3Tier` driven through its public API inside its actor
  (``submit_store`` / ``submit_load`` of every job of ``--blocks-per-job`` blocks at once, then
  awaiting the futures): header + xxh3-64 checksum written and verified, bodies streamed from
  the primary rows, ``--concurrency`` requests in flight.
* raw: one aiobotocore client with the same settings (pool of ``--concurrency`` connections,
  payload signing off, checksums only when required, same retries and timeouts) doing
  ``asyncio.gather`` of one ``put_object`` per block with a prepared ``bytes`` body of the same
  object size (built before the clock starts), then of one ``get_object`` + ``read()`` per block
  (no copy into the primary rows, no checksum).

Every pass uses fresh keys (the tier gets a new namespace through ``cache_salt``); objects are
deleted after each repeat (untimed). Loaded bytes are verified after each timed tier load
(untimed). Repeats alternate which side goes first; the table shows the best of the repeats and
the tier/raw ratio. MB/s = 1e6 payload bytes per second.

Without ``--endpoint`` a ``moto_server`` is started on a free loopback port for the run (moto is
slow, so absolute figures are low; the ratio is what counts). Credentials: ``--access-key`` /
``--secret-key`` or the AWS default chain.

Usage::

    python benchmarks/s3_tier.py                       # local moto_server
    python benchmarks/s3_tier.py --endpoint http://127.0.0.1:9000 --bucket kv   # MinIO

``--quick``: 32 blocks per size, 2 repeats; ``--json PATH``: the tier/raw rows (no goal: moto
is the bottleneck, docs/s3-tier.md) in ``benchmarks/_rows.py``'s format.

"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import subprocess
import time
import urllib.request
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import aiobotocore.session
import numpy as np
import torch
from _rows import Row, rows_path, write_rows
from aiobotocore.config import AioConfig

import kvcascade as kc
from kvcascade.tiers._block_format import file_size
from kvcascade.tiers._file_mapper import FileMapper, default_identity
from kvcascade.tiers.s3 import S3Tier, s3_tier_from_config


def parse_size(text: str) -> int:
    """``256K`` / ``4M`` / ``4096`` → bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


@contextlib.contextmanager
def local_moto() -> Iterator[str]:
    """A ``moto_server`` on a free loopback port for the duration of the block; its URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        ["moto_server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(url + "/moto-api/", timeout=1):
                    break
            except OSError:
                time.sleep(0.05)
        else:
            raise RuntimeError("moto_server did not start")
        yield url
    finally:
        proc.terminate()
        proc.wait()


def client_settings(args: argparse.Namespace) -> tuple[dict[str, Any], AioConfig]:
    """Client keyword arguments and config shared by both sides (the tier's own settings)."""
    kwargs: dict[str, Any] = {"endpoint_url": args.endpoint, "region_name": args.region}
    if args.access_key:
        kwargs.update(aws_access_key_id=args.access_key, aws_secret_access_key=args.secret_key)
    config = AioConfig(
        max_pool_connections=args.concurrency,
        retries={"total_max_attempts": 3, "mode": "standard"},
        s3={"addressing_style": "path", "payload_signing_enabled": False},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    return kwargs, config


def tier_config(args: argparse.Namespace, salt: str) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "bucket": args.bucket,
        "endpoint_url": args.endpoint,
        "region": args.region,
        "addressing_style": "path",
        "max_concurrency": args.concurrency,
        "cache_salt": salt,
        "io_timeout_s": 600.0,
    }
    if args.access_key:
        cfg.update(access_key=args.access_key, secret_key=args.secret_key)
    return cfg


async def tier_pass(tier: S3Tier, keys: list[bytes], per_job: int, store: bool) -> float:
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


async def raw_pass(client: Any, bucket: str, names: list[str], bodies: list[bytes]) -> float:
    """Seconds for a plain gather of put_object (``bodies`` given) or get_object + read."""
    start = time.perf_counter()
    if bodies:
        await asyncio.gather(
            *(client.put_object(Bucket=bucket, Key=n, Body=b) for n, b in zip(names, bodies))
        )
    else:

        async def get(name: str) -> int:
            answer = await client.get_object(Bucket=bucket, Key=name)
            async with answer["Body"] as body:
                return len(await body.read())

        await asyncio.gather(*(get(n) for n in names))
    return time.perf_counter() - start


async def bench_size(args: argparse.Namespace, client: Any, block: int) -> dict[str, float]:
    n = args.blocks or max(8, (64 << 20) // block)
    host = kc.HostBuffer(n, block)
    rng = np.random.default_rng(0)
    data = rng.integers(-128, 127, size=(n, block), dtype=np.int8)
    host.tensor().copy_(torch.from_numpy(data))
    keys = [kc.make_offload_key(uuid.uuid4().bytes, 0) for _ in range(n)]
    best: dict[str, float] = {}
    try:
        for repeat in range(args.repeats):
            salt = uuid.uuid4().hex
            tier = s3_tier_from_config(
                host, FileMapper(default_identity("bench-s3")), tier_config(args, salt)
            )
            prefix = f"raw-{salt}/"
            names = [f"{prefix}{i:06d}.bin" for i in range(n)]
            bodies = [os.urandom(file_size(block)) for _ in range(n)]
            started = asyncio.Event()
            actor = asyncio.create_task(tier.serve(started.set))
            await started.wait()
            times: dict[str, float] = {}
            try:
                sides = ["tier", "raw"] if repeat % 2 == 0 else ["raw", "tier"]
                for direction in ("store", "load"):
                    for side in sides:
                        if side == "tier":
                            store = direction == "store"
                            if not store:
                                host.tensor().zero_()
                            elapsed = await tier_pass(tier, keys, args.blocks_per_job, store)
                            if not store and not np.array_equal(host.tensor().numpy(), data):
                                raise RuntimeError("tier loaded wrong bytes")
                        else:
                            payload = bodies if direction == "store" else []
                            elapsed = await raw_pass(client, args.bucket, names, payload)
                        times[f"{side}_{direction}"] = elapsed
            finally:
                tier.close()
                await actor
                victims = [tier.object_key(k) for k in keys] + names
                for i in range(0, len(victims), 1000):
                    await client.delete_objects(
                        Bucket=args.bucket,
                        Delete={"Objects": [{"Key": v} for v in victims[i : i + 1000]]},
                    )
            for name, seconds in times.items():
                best[name] = max(best.get(name, 0.0), n * block / seconds / 1e6)
    finally:
        host.close()
    best["blocks"] = n
    return best


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", help="S3 endpoint URL (default: start a local moto_server)")
    parser.add_argument("--bucket", default="kvcascade-bench", help="bucket (created if missing)")
    parser.add_argument("--region", default="us-east-1")
    parser.add_argument("--access-key", help="default: the AWS credential chain")
    parser.add_argument("--secret-key")
    parser.add_argument("--sizes", default="256K,4M", help="block sizes (comma-separated)")
    parser.add_argument("--blocks", type=int, help="blocks per pass (default: 64 MiB worth)")
    parser.add_argument("--blocks-per-job", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="32 blocks per size, 2 repeats")
    parser.add_argument(
        "--json", type=rows_path, help="write the ratio rows here (benchmarks/_rows.py)"
    )
    args = parser.parse_args()
    if args.quick:
        args.blocks, args.repeats = 32, 2
    rows: list[Row] = []
    # aiohttp warns that a large bytes body may block the loop; the raw side sends bytes on
    # purpose (the cheapest plain usage), so the warning is noise here.
    warnings.filterwarnings("ignore", category=ResourceWarning, module="aiohttp")
    with contextlib.ExitStack() as stack:
        if args.endpoint is None:
            args.endpoint = stack.enter_context(local_moto())
            if not args.access_key:
                args.access_key, args.secret_key = "bench", "bench"
        kwargs, config = client_settings(args)
        session = aiobotocore.session.get_session()
        async with session.create_client("s3", config=config, **kwargs) as client:
            with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
                await client.create_bucket(Bucket=args.bucket)
            print(
                f"endpoint {args.endpoint}, concurrency {args.concurrency}, "
                f"{args.blocks_per_job} blocks per tier job, best of {args.repeats}; MB/s"
            )
            header = (
                f"{'block':>8} {'blocks':>6} {'tier store':>10} {'raw store':>10} {'ratio':>6} "
                f"{'tier load':>10} {'raw load':>10} {'ratio':>6}"
            )
            print(header)
            print("-" * len(header))
            for text in args.sizes.split(","):
                block = parse_size(text)
                r = await bench_size(args, client, block)
                print(
                    f"{text.strip():>8} {int(r['blocks']):>6} {r['tier_store']:>10.1f} "
                    f"{r['raw_store']:>10.1f} {r['tier_store'] / r['raw_store']:>6.2f} "
                    f"{r['tier_load']:>10.1f} {r['raw_load']:>10.1f} "
                    f"{r['tier_load'] / r['raw_load']:>6.2f}"
                )
                for d in ("store", "load"):
                    name = f"{d} {text.strip()} tier/raw"
                    rows.append(Row.of(name, r[f"tier_{d}"], r[f"raw_{d}"], None, "MB/s"))
    if args.json:
        write_rows(args.json, "s3_tier", rows)


if __name__ == "__main__":
    asyncio.run(main())
