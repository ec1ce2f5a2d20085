"""An in-memory secondary tier (``type: "memory"``; vLLM's ``example`` tier is an alias).

Shipped for users' tests: it behaves like a real tier (actor, jobs, futures, events) without disks
or S3. Blocks are kept as ``bytes`` copies in a dict; nothing is ever evicted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .._errors import TransferError
from .base import SecondaryTier
from .cpu import HostBuffer

if TYPE_CHECKING:
    from .registry import TierContext


class MemoryTier(SecondaryTier):
    """Secondary tier keeping every block in a Python dict (unbounded)."""

    def __init__(self, host: HostBuffer, name: str = "memory", io_threads: int = 1) -> None:
        super().__init__(name, host, io_threads=io_threads)
        self.blocks: dict[bytes, bytes] = {}

    def _store_blocks(self, keys: Sequence[bytes], rows: Sequence[memoryview]) -> int:
        with self._row_access():
            for key, row in zip(keys, rows):
                self.blocks.setdefault(key, bytes(row))
        return sum(len(r) for r in rows)

    def _load_blocks(self, keys: Sequence[bytes], rows: Sequence[memoryview]) -> int:
        with self._row_access():
            for i, (key, row) in enumerate(zip(keys, rows)):
                data = self.blocks.get(key)
                if data is None:
                    raise TransferError(f"memory tier has no block {key!r}", keys[:i])
                row[:] = data
        return sum(len(r) for r in rows)

    def _probe(self, keys: Sequence[bytes]) -> list[bool]:
        return [k in self.blocks for k in keys]

    def _remove(self, keys: Sequence[bytes]) -> list[bool]:
        return [self.blocks.pop(k, None) is not None for k in keys]


def memory_tier_factory(ctx: TierContext, name: str = "memory") -> MemoryTier:
    """Factory of ``{"type": "memory"}`` (alias ``"example"``); the only key is ``name``."""
    return MemoryTier(ctx.host, name=name)
