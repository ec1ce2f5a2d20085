"""Two engines, one pool: a prefix computed by one engine process is found in a shared Valkey /
Redis tier by another process and loaded byte-exact (docs/valkey-tier.md).

    python examples/shared_pool.py redis://127.0.0.1:6379 [PREFIX]

Each engine is an asyncio :class:`kvcascade.Cascade` in its own process (GPU → CPU → valkey;
on a machine without a GPU the "device" KV cache is a CPU tensor standing in for HBM). Engine A
prefills a prompt of 8 blocks and offloads it; engine B, started after A has exited, has empty
GPU and CPU tiers, looks the prompt up, finds every block in the valkey tier, loads them and
compares them with the bytes A computed (both derive them from the same seed). Both use the
same model name and block geometry, hence the same namespace on the server; ``PREFIX`` (default
``kvcascade-example``) is the key prefix on the server.
"""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing
import sys

import torch

import kvcascade as kc

BLOCKS = 8
TOKENS_PER_BLOCK = 16


def config(url: str, prefix: str) -> kc.CascadeConfig:
    return kc.CascadeConfig(
        block_bytes=16 * 1024,  # KV bytes per block
        gpu_blocks=32,
        cpu_blocks=BLOCKS,
        secondary_tiers=[{"type": "valkey", "url": url, "prefix": prefix}],
        model_name="shared-pool-example",  # one model: both engines share its namespace
    )


def prompt_keys() -> list[bytes]:
    """Chained block hashes of the shared prompt (what both engines' schedulers compute)."""
    tokens = list(range(BLOCKS * TOKENS_PER_BLOCK))
    hashes = [
        hashlib.sha256(repr(tokens[: (i + 1) * TOKENS_PER_BLOCK]).encode()).digest()[:16]
        for i in range(BLOCKS)
    ]
    return [kc.make_offload_key(h, 0) for h in hashes]


def prefill_kv(block_bytes: int) -> torch.Tensor:
    """The KV bytes of the prompt as engine A's prefill would compute them (seeded)."""
    gen = torch.Generator().manual_seed(20)
    return torch.randint(-128, 127, (BLOCKS, block_bytes), dtype=torch.int8, generator=gen)


async def engine_a(url: str, prefix: str) -> None:
    async with kc.open_cascade(config(url, prefix)) as cascade:
        kv = cascade.device.kv
        kv[:BLOCKS] = prefill_kv(kv.shape[1])
        ctx = kc.ReqContext("a-prefill")
        stored = await cascade.store(prompt_keys(), ctx, list(range(BLOCKS)))
        await cascade.wait_cascades()  # the valkey tier has them once this returns
        cascade.finish_request(ctx)
        print(f"engine A: prefilled and stored {len(stored.stored)} blocks", flush=True)


async def engine_b(url: str, prefix: str) -> None:
    async with kc.open_cascade(config(url, prefix)) as cascade:
        kv = cascade.device.kv
        ctx = kc.ReqContext("b-prefill")
        keys = prompt_keys()
        found = await cascade.lookup_prefix(keys, ctx)
        gpu_ids = list(range(16, 16 + found.num_hits))
        loaded = await cascade.load(found.keys, ctx, gpu_ids)
        cascade.finish_request(ctx)
        print(f"engine B: prefix of {found.num_hits} blocks from {sorted(set(found.tiers))}")
        same = torch.equal(kv[16 : 16 + loaded.loaded], prefill_kv(kv.shape[1])[: loaded.loaded])
        exact = "byte-exact" if same else "MISMATCH"
        print(f"engine B: loaded {loaded.loaded} of {len(keys)} blocks, {exact}", flush=True)
        if not same or loaded.loaded != len(keys):
            raise SystemExit(1)


def run_engine(name: str, url: str, prefix: str) -> None:
    asyncio.run((engine_a if name == "A" else engine_b)(url, prefix))


def main(url: str, prefix: str) -> int:
    spawn = multiprocessing.get_context("spawn")  # two fresh processes: nothing shared but Valkey
    for name in ("A", "B"):
        proc = spawn.Process(target=run_engine, args=(name, url, prefix))
        proc.start()
        proc.join()
        if proc.exitcode:
            print(f"engine {name} failed with exit code {proc.exitcode}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "kvcascade-example"))
