"""Drive the coordinator the way a synchronous engine scheduler does: one call per hook, once per
step, never blocking — and watch when a promotion from a secondary tier becomes a hit
(docs/coordinator.md, "Step timeline").

    python examples/scheduler_hooks.py
"""

from __future__ import annotations

import asyncio

import kvcascade as kc
from kvcascade import LookupResult


def key(i: int) -> bytes:
    return kc.make_offload_key(i.to_bytes(8, "big"), 0)


async def main() -> None:
    host = kc.HostBuffer(num_blocks=2, block_bytes=4096)
    primary = kc.CPUOffloadingManager(num_blocks=2, enable_events=True)
    memory = kc.MemoryTier(host)  # the in-memory secondary tier shipped for tests
    memory.blocks[key(7)] = b"\x07" * 4096  # a block another engine left in the tier
    coordinator = kc.TieringCoordinator(primary, [memory])
    async with kc.serve_coordinator(coordinator):  # the tier actors run inside the block
        request = kc.ReqContext("req-1")
        coordinator.on_new_request(request)

        for step in range(4):
            result = coordinator.lookup(key(7), request)
            print(f"step {step}: lookup → {result.name}")
            if result is LookupResult.HIT:
                slots = coordinator.prepare_load([key(7)], request).block_ids
                row = bytes(host.row(int(slots[0])))
                print(f"  load from primary slot {slots[0]}: {row[:4]!r}…")
                coordinator.complete_load([key(7)], request)
                break
            coordinator.on_schedule_end()  # flush probes and promotions; no waiting
            await asyncio.sleep(0.01)  # the engine's forward pass; tier actors work meanwhile
        coordinator.on_request_finished(request)
        print(
            "events:",
            [(e.tier, "removed" if e.removed else "stored") for e in coordinator.take_events()],
        )
    host.close()


if __name__ == "__main__":
    asyncio.run(main())
