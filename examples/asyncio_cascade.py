"""Store KV blocks through GPU → CPU → fs, evict them from the CPU tier, and load them back
byte-exact from the fs tier — the awaitable API an asyncio serving stack uses.

    python examples/asyncio_cascade.py [FS_DIR]

(On a machine without a GPU the "device" KV cache is a CPU tensor standing in for HBM.)
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
        kv[:8] = torch.randint(-128, 127, (8, kv.shape[1]), dtype=torch.int8)
        original = kv[:8].clone()

        writer = kc.ReqContext("prefill-1")
        for i in range(0, 8, 4):  # offload in two steps of 4 blocks
            stored = await cascade.store(keys[i : i + 4], writer, list(range(i, i + 4)))
            await cascade.wait_cascades()  # let the fs tier persist them
            print(f"stored {len(stored.stored)} blocks ({stored.bytes} bytes GPU→CPU)")
        cascade.finish_request(writer)

        reader = kc.ReqContext("prefill-2")
        cascade.touch(keys, reader)  # the request reads these blocks (recency, policy learning)
        done = 0  # each promotion needs a CPU slot: 4 slots bring the 8 blocks back in 2 parts
        while done < len(keys):
            found = await cascade.lookup_prefix(keys[done:], reader)
            if not found.num_hits:
                break
            gpu_ids = list(range(32 + done, 32 + done + found.num_hits))
            loaded = await cascade.load(found.keys, reader, gpu_ids)
            assert loaded.loaded == found.num_hits
            print(f"prefix hit: blocks {done}-{done + found.num_hits - 1} from {found.tiers}")
            done += loaded.loaded
        cascade.finish_request(reader)
        assert torch.equal(kv[32 : 32 + done], original[:done])
        print(f"loaded {done} of {len(keys)} blocks back, byte-exact")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        asyncio.run(main(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            asyncio.run(main(tmp))
