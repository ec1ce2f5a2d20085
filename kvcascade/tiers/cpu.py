"""Storage of the CPU primary tier: one page-aligned host buffer of ``num_blocks`` rows.

The primary tier is the meeting point of every transfer: the device tier copies GPU blocks into
and out of its rows, secondary tiers read rows to cascade them and write rows to promote. It is
passive memory; its bookkeeping lives in :class:`kvcascade.index.CPUOffloadingManager`.
"""

from __future__ import annotations

import contextlib
import mmap

import torch

from .._errors import ConfigError

PAGE_SIZE = mmap.PAGESIZE


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is ``>= n``."""
    return -(-n // multiple) * multiple


class HostBuffer:
    """``num_blocks`` rows of ``row_bytes`` (``block_bytes`` rounded up to the page size).

    The buffer is an anonymous ``mmap`` (page-aligned base), so every row is page-aligned, as
    O_DIRECT and pinned-memory registration want. Views are zero-copy.

    Args:
        num_blocks: number of rows (slots), ``>= 0``.
        block_bytes: KV bytes per block, ``> 0``.

    Raises:
        ConfigError: a size is negative, zero (``block_bytes``) or not an int.
    """

    def __init__(self, num_blocks: int, block_bytes: int) -> None:
        for name, value, low in (("num_blocks", num_blocks, 0), ("block_bytes", block_bytes, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an int >= {low}, got {value!r}")
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.row_bytes = round_up(block_bytes, PAGE_SIZE)
        self.nbytes = num_blocks * self.row_bytes
        try:
            self._mmap: mmap.mmap | None = mmap.mmap(-1, max(self.nbytes, PAGE_SIZE))
        except (OSError, OverflowError, MemoryError) as exc:
            raise ConfigError(
                f"cannot map {num_blocks} primary blocks × {self.row_bytes} B = {self.nbytes:,} B "
                f"of host memory ({exc}); lower cpu_blocks / cpu_bytes_to_use or block_bytes"
            ) from exc
        self._view = memoryview(self._mmap)[: self.nbytes]
        self._tensor = (
            torch.frombuffer(self._mmap, dtype=torch.int8, count=self.nbytes).view(
                num_blocks, self.row_bytes
            )
            if self.nbytes
            else torch.empty((0, self.row_bytes), dtype=torch.int8)
        )

    @property
    def memoryview(self) -> memoryview:
        """The whole buffer: a flat writable ``memoryview`` of ``num_blocks × row_bytes`` bytes."""
        return self._view

    def row(self, block_id: int) -> memoryview:
        """Writable zero-copy view of the ``block_bytes`` KV bytes of slot ``block_id``.

        Raises:
            IndexError: ``block_id`` outside ``[0, num_blocks)``.
        """
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block_id {block_id} outside [0, {self.num_blocks})")
        start = block_id * self.row_bytes
        return self._view[start : start + self.block_bytes]

    def tensor(self) -> torch.Tensor:
        """int8 tensor ``(num_blocks, block_bytes)`` over the buffer, row stride ``row_bytes``."""
        return self._tensor[:, : self.block_bytes]

    def close(self) -> None:
        """Release the views and unmap; idempotent. Outstanding views must be dropped first."""
        if self._mmap is None:
            return
        self._view.release()
        self._tensor = torch.empty((0, self.row_bytes), dtype=torch.int8)
        with contextlib.suppress(BufferError):  # a caller still holds a view: unmapped on GC
            self._mmap.close()
        self._mmap = None
