"""An aiohttp server embedding the cascade on its own KV cache: handlers await ``lookup_prefix``
/ ``load`` / ``store`` while other requests run.

    pip install aiohttp   # (in the dev extras)
    python examples/aiohttp_server.py [--port PORT] [--fs-dir DIR]

The "engine" owns a KV tensor in FlashAttention's layout ``(2, gpu_blocks, block_size, heads,
head_dim)`` (float16; on the CPU when no GPU is there) and hands the cascade its canonical views
(:func:`kvcascade.canonical_views`), so loads land in the engine's tensor and stores read from
it: nothing is copied through a tensor of kvcascade's. Each request takes GPU blocks from a
small allocator for its prompt, frees them when it is answered, and keeps no GPU prefix cache of
its own, so a prompt seen before comes back from the CPU or fs tier.

``POST /generate`` with ``{"tokens": [int, ...]}``: the prompt's full blocks (16 tokens each)
are looked up, the cached prefix is loaded into the request's blocks (in parts when the CPU tier
has fewer free slots than the prefix has blocks) and checked against the bytes its prefill
would compute, the rest is "prefilled" (written into the engine's tensor
from the tokens) and stored. Answer: ``{"blocks", "cached", "tiers", "verified"}``; a body
that is not such JSON (also one nested too deep to decode, or a token that is ``true`` or
``false``: JSON booleans are no token ids) is answered 400 with what was wrong.
``GET /stats``: ``{"served", "blocks", "bytes", "tiers", "failures"}`` — requests served; the
prompt blocks asked for, found cached, loaded per tier and stored; the bytes loaded into and
stored from the engine's tensor; per tier the lookups, hits and bytes promoted from / cascaded
to it (the coordinator's Prometheus series, :class:`kvcascade.TieringMetrics`); the cascade's
failure counters.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import json
import tempfile
from collections.abc import AsyncIterator

import torch
from aiohttp import web

import kvcascade as kc

BLOCK_TOKENS = 16
HEADS, HEAD_DIM = 2, 32
GPU_BLOCKS = 256
BLOCK_BYTES = 2 * BLOCK_TOKENS * HEADS * HEAD_DIM * 2  # K and V of one block, float16
MODEL_NAME = "aiohttp-example"  # the fs tier's namespace: give your model's id
#: ``/stats`` per-tier field → the coordinator's series (kvcascade/metrics.py).
TIER_SERIES = {
    "lookups": "block_queries",
    "hits": "block_hits",
    "read_bytes": "read_bytes",
    "write_bytes": "write_bytes",
}


class Engine:
    """The engine side: its KV tensor and a free list of its blocks."""

    def __init__(self) -> None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        shape = (2, GPU_BLOCKS, BLOCK_TOKENS, HEADS, HEAD_DIM)
        self.kv = torch.zeros(shape, dtype=torch.float16, device=device)
        self.views = kc.canonical_views({"layer0": self.kv}, "flash_attn")
        self._free = list(range(GPU_BLOCKS))
        self._freed = asyncio.Condition()
        self.served = 0
        self.blocks: collections.Counter[str] = collections.Counter()
        self.bytes: collections.Counter[str] = collections.Counter()

    async def allocate(self, n: int) -> list[int]:
        """``n`` free blocks, waiting for other requests to free theirs."""
        async with self._freed:
            await self._freed.wait_for(lambda: len(self._free) >= n)
            taken, self._free = self._free[:n], self._free[n:]
        return taken

    async def free(self, blocks: list[int]) -> None:
        async with self._freed:
            self._free += blocks
            self._freed.notify_all()

    def prefill(self, key: bytes, block: int) -> None:
        """Write block ``block``'s K and V as a function of its key (the model's stand-in)."""
        self.kv[:, block] = expected_kv(key).to(self.kv.device)


CASCADE = web.AppKey("cascade", kc.Cascade)
ENGINE = web.AppKey("engine", Engine)


def block_keys(tokens: list[int]) -> list[bytes]:
    """Chained keys of the prompt's full blocks (a block's key covers every earlier token)."""
    keys = []
    for end in range(BLOCK_TOKENS, len(tokens) + 1, BLOCK_TOKENS):
        digest = hashlib.sha256(repr(tokens[:end]).encode()).digest()[:16]
        keys.append(kc.make_offload_key(digest, 0))
    return keys


def expected_kv(key: bytes) -> torch.Tensor:
    """K and V ``(2, block_size, heads, head_dim)`` float16 of the block with ``key``."""
    gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "big"))
    return torch.randn((2, BLOCK_TOKENS, HEADS, HEAD_DIM), generator=gen).half()


async def generate(request: web.Request) -> web.Response:
    cascade, engine = request.app[CASCADE], request.app[ENGINE]
    try:
        body = await request.json()
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep to decode
        raise web.HTTPBadRequest(
            text=f'body is not JSON ({exc}); expected {{"tokens": [int, ...]}}'
        ) from None
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list):
        raise web.HTTPBadRequest(text='expected {"tokens": [int, ...]}')
    for i, token in enumerate(tokens):
        if not isinstance(token, int) or isinstance(token, bool):  # JSON true is no token id
            raise web.HTTPBadRequest(
                text=f"tokens[{i}] is {json.dumps(token)}, not a token id; "
                'expected {"tokens": [int, ...]}'
            )
    keys = block_keys(tokens)
    if len(keys) > GPU_BLOCKS:
        raise web.HTTPBadRequest(text=f"at most {GPU_BLOCKS * BLOCK_TOKENS} tokens")
    ctx = kc.ReqContext(f"req-{id(request)}")
    blocks = await engine.allocate(len(keys))
    try:
        cascade.touch(keys, ctx)
        cached, tiers = 0, []
        while cached < len(keys):  # each secondary hit needs a CPU slot: a prefix may come in parts
            found = await cascade.lookup_prefix(keys[cached:], ctx)
            if not found.num_hits:
                break
            part = blocks[cached : cached + found.num_hits]
            result = await cascade.load(found.keys, ctx, part)
            loaded = result.loaded
            engine.bytes["loaded"] += result.bytes
            tiers += found.tiers[:loaded]
            cached += loaded
            if loaded < found.num_hits:
                break
        verified = sum(
            torch.equal(engine.kv[:, blocks[i]].cpu(), expected_kv(keys[i])) for i in range(cached)
        )
        for i in range(cached, len(keys)):
            engine.prefill(keys[i], blocks[i])
        if cached < len(keys):  # returns once copied out of our blocks
            stored = await cascade.store(keys[cached:], ctx, blocks[cached:])
            engine.blocks["stored"] += len(stored.stored)
            engine.bytes["stored"] += stored.bytes
            # Answer once the blocks reached every tier (a server would not wait; the example
            # does, so that what a response reports stored is in the fs tier too).
            await cascade.wait_cascades()
    finally:
        cascade.finish_request(ctx)  # also when the client went away: release the pins
        await engine.free(blocks)
    engine.served += 1
    engine.blocks.update(requested=len(keys), cached=cached)
    engine.blocks.update(f"loaded_from_{tier}" for tier in tiers)
    return web.json_response(
        {"blocks": len(keys), "cached": cached, "tiers": tiers, "verified": verified}
    )


async def stats(request: web.Request) -> web.Response:
    cascade, engine = request.app[CASCADE], request.app[ENGINE]
    metrics = cascade.coordinator.metrics
    places = {"cpu": None, **{tier.name: i for i, tier in enumerate(cascade.tiers)}}
    tiers = {
        name: {field: int(metrics.value(series, idx)) for field, series in TIER_SERIES.items()}
        for name, idx in places.items()
    }
    return web.json_response(
        {
            "served": engine.served,
            "blocks": dict(engine.blocks),
            "bytes": dict(engine.bytes),
            "tiers": tiers,
            "failures": dict(cascade.counters),
        }
    )


def make_app(fs_dir: str) -> web.Application:
    """The application; the cascade lives as long as the app (``cleanup_ctx``)."""
    app = web.Application()
    app[ENGINE] = Engine()

    async def cascade_ctx(app: web.Application) -> AsyncIterator[None]:
        config = kc.CascadeConfig(
            block_bytes=BLOCK_BYTES,
            gpu_blocks=GPU_BLOCKS,
            cpu_blocks=32,  # small: older prefixes come back from the fs tier
            secondary_tiers=[{"type": "fs", "root_dir": fs_dir}],
            model_name=MODEL_NAME,
        )
        async with kc.open_cascade(config, kv_views=app[ENGINE].views) as cascade:
            app[CASCADE] = cascade
            yield

    app.cleanup_ctx.append(cascade_ctx)
    app.router.add_post("/generate", generate)
    app.router.add_get("/stats", stats)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--fs-dir", help="fs tier directory (default: a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        web.run_app(make_app(args.fs_dir or tmp), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
