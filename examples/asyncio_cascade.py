"""Store KV blocks through GPU → CPU → fs, evict them from the CPU tier, and load them back
byte-exact from the fs tier — the awaitable API an asyncio serving stack uses.

    python examples/asyncio_cascade.py [FS_DIR]

Run it twice on one FS_DIR: the second run finds the first run's blocks (a restart hit) and
loads them instead of storing them again. A block's KV bytes are a function of its key, as an
engine's KV is a function of the token prefix the key hashes, so every run can check every
loaded byte. (On a machine without a GPU the "device" KV cache is a CPU tensor standing in for
HBM.)
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
import tempfile

import torch

import kvcascade as kc


def block_hash(prefix: list[int]) -> bytes:
    """A chained block hash: the whole token prefix up to the end of the block."""
    return hashlib.sha256(repr(prefix).encode()).digest()[:16]


def block_kv(key: bytes, block_bytes: int) -> torch.Tensor:
    """The KV bytes of the block of ``key``: the same in every run."""
    gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "big"))
    return torch.randint(-128, 128, (block_bytes,), dtype=torch.int8, generator=gen)


async def load_prefix(
    cascade: kc.Cascade, keys: list[bytes], ctx: kc.ReqContext, first_gpu_id: int
) -> int:
    """Load the longest cached prefix of ``keys`` into GPU blocks from ``first_gpu_id`` on;
    each promotion needs a CPU slot, so 4 slots bring 8 blocks back in 2 parts."""
    done = 0
    while done < len(keys):
        found = await cascade.lookup_prefix(keys[done:], ctx)
        if not found.num_hits:
            break
        gpu_ids = list(range(first_gpu_id + done, first_gpu_id + done + found.num_hits))
        loaded = await cascade.load(found.keys, ctx, gpu_ids)
        assert loaded.loaded == found.num_hits
        last = done + found.num_hits - 1
        print(f"{ctx.req_id}: prefix hit: blocks {done}-{last} from {found.tiers}")
        done += loaded.loaded
    return done


async def main(fs_dir: str) -> None:
    config = kc.CascadeConfig(
        block_bytes=16 * 1024,  # KV bytes per block
        gpu_blocks=64,
        cpu_blocks=4,  # tiny on purpose: the CPU tier must evict to the fs tier
        secondary_tiers=[{"type": "fs", "root_dir": fs_dir}],
        model_name="asyncio-example",  # the fs tier's namespace: give your model's id
    )
    tokens = list(range(8 * 16))  # a prompt of 8 blocks of 16 tokens
    keys = [kc.make_offload_key(block_hash(tokens[: (i + 1) * 16]), 0) for i in range(8)]
    async with kc.open_cascade(config) as cascade:
        kv = cascade.device.kv  # int8 (gpu_blocks, block_bytes)
        expected = torch.stack([block_kv(key, config.block_bytes) for key in keys]).to(kv.device)

        writer = kc.ReqContext("prefill-1")
        cached = await load_prefix(cascade, keys, writer, 0)  # an earlier run's blocks
        print(f"prefill-1: {cached} of {len(keys)} blocks cached by an earlier run")
        kv[cached:8] = expected[cached:]  # "prefill" computes the KV of the rest
        for i in range(cached, 8, 4):  # offload in steps of 4 blocks
            stored = await cascade.store(keys[i : i + 4], writer, list(range(i, min(i + 4, 8))))
            await cascade.wait_cascades()  # let the fs tier persist them
            print(f"stored {len(stored.stored)} blocks ({stored.bytes} bytes GPU→CPU)")
        cascade.finish_request(writer)
        assert torch.equal(kv[:8], expected)

        reader = kc.ReqContext("prefill-2")
        cascade.touch(keys, reader)  # the request reads these blocks (recency, policy learning)
        done = await load_prefix(cascade, keys, reader, 32)
        cascade.finish_request(reader)
        assert torch.equal(kv[32 : 32 + done], expected[:done])
        print(f"loaded {done} of {len(keys)} blocks back, byte-exact")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        asyncio.run(main(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            asyncio.run(main(tmp))
