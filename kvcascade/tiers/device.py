"""The device tier: the engine's KV cache and the GPU↔CPU copies (an asyncio actor).

The KV cache is an int8 tensor ``(num_blocks, page_bytes)`` on CUDA when available, else on the
CPU standing in for device memory. Two FIFO mailboxes — stores (GPU→CPU) and loads (CPU→GPU) —
each served by one worker thread, so transfers of one direction complete in submission order.
Copies go through :func:`kvcascade.ops.swap_blocks` into the primary tier's host buffer; the
device tier never talks to a secondary tier.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from dataclasses import dataclass

import numpy as np
import torch

from .._errors import ConfigError, TierUnavailableError
from ..ops import swap_blocks
from .cpu import HostBuffer


@dataclass
class DeviceTransfer:
    """Result of one GPU↔CPU transfer: ``success``, ``bytes`` moved, wall ``seconds``."""

    success: bool
    bytes: int = 0
    seconds: float = 0.0
    error: str | None = None


class DeviceTier:
    """Owner of the device KV cache and its transfers to and from the primary tier.

    Args:
        num_blocks: GPU blocks in the cache (``>= 1``).
        host: the primary tier's buffer (its ``block_bytes`` is the page size).
        device: torch device; default CUDA when available, else CPU.

    Raises:
        ConfigError: ``num_blocks < 1``.
    """

    def __init__(self, num_blocks: int, host: HostBuffer, device: str | None = None) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ConfigError(f"gpu num_blocks must be an int >= 1, got {num_blocks!r}")
        self.host = host
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.kv = torch.zeros((num_blocks, host.block_bytes), dtype=torch.int8, device=self.device)
        self._store_pool = concurrent.futures.ThreadPoolExecutor(1, "kvcascade-d2h")
        self._load_pool = concurrent.futures.ThreadPoolExecutor(1, "kvcascade-h2d")
        self._closed = False
        self.bytes_stored = 0
        self.bytes_loaded = 0

    @property
    def num_blocks(self) -> int:
        """GPU blocks in the cache."""
        return self.kv.shape[0]

    async def store(self, gpu_ids: np.ndarray, cpu_slots: np.ndarray) -> DeviceTransfer:
        """Copy GPU blocks ``gpu_ids[i]`` into primary slots ``cpu_slots[i]`` (GPU→CPU)."""
        result = await self._run(self._store_pool, self.kv, self.host.tensor(), gpu_ids, cpu_slots)
        self.bytes_stored += result.bytes
        return result

    async def load(self, cpu_slots: np.ndarray, gpu_ids: np.ndarray) -> DeviceTransfer:
        """Copy primary slots ``cpu_slots[i]`` into GPU blocks ``gpu_ids[i]`` (CPU→GPU)."""
        result = await self._run(self._load_pool, self.host.tensor(), self.kv, cpu_slots, gpu_ids)
        self.bytes_loaded += result.bytes
        return result

    async def _run(
        self,
        pool: concurrent.futures.ThreadPoolExecutor,
        src: torch.Tensor,
        dst: torch.Tensor,
        src_ids: np.ndarray,
        dst_ids: np.ndarray,
    ) -> DeviceTransfer:
        if self._closed:
            raise TierUnavailableError("device tier is closed")
        start = time.perf_counter()
        loop = asyncio.get_running_loop()
        try:
            nbytes = await loop.run_in_executor(pool, swap_blocks, src, dst, src_ids, dst_ids)
        except (RuntimeError, ValueError) as exc:
            return DeviceTransfer(False, error=f"{type(exc).__name__}: {exc}")
        return DeviceTransfer(True, nbytes, time.perf_counter() - start)

    def close(self) -> None:
        """Finish running copies and release the worker threads; idempotent."""
        self._closed = True
        self._store_pool.shutdown(wait=True)
        self._load_pool.shutdown(wait=True)
