"""Storage of the CPU primary tier: one page-aligned host buffer of ``num_blocks`` rows.

The primary tier is the meeting point of every transfer: the device tier copies GPU blocks into
and out of its rows, secondary tiers read rows to cascade them and write rows to promote. It is
passive memory; its bookkeeping lives in :class:`kvcascade.index.CPUOffloadingManager`.
"""

from __future__ import annotations

import contextlib
import logging
import mmap

import torch

from .._errors import ConfigError
from .._validate import check_int

log = logging.getLogger(__name__)

PAGE_SIZE = mmap.PAGESIZE
#: Largest single ``cudaHostRegister`` call (rounded down to whole rows, at least one row).
PIN_CHUNK_BYTES = 1 << 30


def _cuda_ok(err: object) -> bool:
    return int(getattr(err, "value", err)) == 0  # type: ignore[call-overload]


def register_host_memory(base: int, nbytes: int, row_bytes: int, what: str) -> list[int]:
    """Register ``[base, base + nbytes)`` as pinned CUDA host memory (``cudaHostRegister``), in
    chunks of whole rows of at most :data:`PIN_CHUNK_BYTES`, all or nothing.

    Pinned host memory lets the copy engines DMA asynchronously; pageable memory makes CUDA
    copy synchronously on the calling thread. Every return code is checked: a failure (e.g.
    ``RLIMIT_MEMLOCK``, no CUDA driver) unregisters the chunks already registered, logs one
    warning naming ``what`` and returns ``[]`` — the memory stays pageable and copies still work.

    Returns:
        the registered chunk addresses, for :func:`unregister_host_memory`.
    """
    cudart = torch.cuda.cudart()
    chunk = max(1, PIN_CHUNK_BYTES // row_bytes) * row_bytes
    registered: list[int] = []
    for offset in range(0, nbytes, chunk):
        err = cudart.cudaHostRegister(base + offset, min(chunk, nbytes - offset), 0)
        if not _cuda_ok(err):
            failures = [p for p in registered if not _cuda_ok(cudart.cudaHostUnregister(p))]
            log.warning(
                "cudaHostRegister of %s failed at offset %d (error %s); it stays unpinned%s",
                what,
                offset,
                err,
                f" and {len(failures)} chunk(s) could not be unregistered" if failures else "",
            )
            return []
        registered.append(base + offset)
    return registered


def unregister_host_memory(chunks: list[int], what: str) -> None:
    """``cudaHostUnregister`` every chunk from :func:`register_host_memory`; a failure is logged."""
    if not chunks:
        return
    cudart = torch.cuda.cudart()
    for ptr in chunks:
        err = cudart.cudaHostUnregister(ptr)
        if not _cuda_ok(err):
            log.warning("cudaHostUnregister of %s failed (error %s)", what, err)


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
        check_int("num_blocks", num_blocks, 0)
        check_int("block_bytes", block_bytes, 1)
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
        self._pinned: list[int] = []
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

    @property
    def pinned(self) -> bool:
        """Whether :meth:`pin` registered the buffer as pinned CUDA host memory."""
        return bool(self._pinned)

    def pin(self) -> bool:
        """Register the buffer as pinned CUDA host memory (issue #15), as the shared region does
        (:func:`register_host_memory`: whole-row chunks, all or nothing, one warning and pageable
        memory on failure); idempotent. Unregistered by :meth:`close`.

        Returns:
            whether the buffer is pinned (False without CUDA or when registration failed).
        """
        if not self._pinned and self.nbytes and self._mmap and torch.cuda.is_available():
            what = f"the primary host buffer ({self.nbytes:,} B)"
            self._pinned = register_host_memory(
                self._tensor.data_ptr(), self.nbytes, self.row_bytes, what
            )
        return self.pinned

    def tensor(self) -> torch.Tensor:
        """int8 tensor ``(num_blocks, block_bytes)`` over the buffer, row stride ``row_bytes``."""
        return self._tensor[:, : self.block_bytes]

    def close(self) -> None:
        """Release the views and unmap; idempotent. Outstanding views must be dropped first."""
        if self._mmap is None:
            return
        unregister_host_memory(self._pinned, "the primary host buffer")
        self._pinned = []
        self._view.release()
        self._tensor = torch.empty((0, self.row_bytes), dtype=torch.int8)
        with contextlib.suppress(BufferError):  # a caller still holds a view: unmapped on GC
            self._mmap.close()
        self._mmap = None
