"""The chunked copy plan of vLLM's ``kv_offload/cpu/gpu_worker.py``: which CPU sub-block each GPU
block of a transfer maps to.

A CPU *chunk* holds ``k = blocks_per_chunk`` consecutive GPU blocks (*sub-blocks*). Sub-block
``j`` of chunk ``c`` lives at ``cpu_base + c·row_stride + j·page``; GPU block ``b`` at
``gpu_base + b·gpu_stride``. This module is pure bookkeeping: no tensors are touched by
:func:`plan_chunk_copies`; :func:`plan_descriptors` turns a plan into copy descriptors for one
(GPU view, CPU view) pair.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch


class ChunkCopy(NamedTuple):
    """One GPU block ↔ CPU sub-block pairing: sub-block ``pos`` of CPU chunk ``cpu_chunk``."""

    gpu_block: int
    cpu_chunk: int
    pos: int


def plan_chunk_copies(
    gpu_spec_group_sizes: Sequence[int],
    block_indices: Sequence[int],
    gpu_block_ids: Sequence[int],
    cpu_chunk_ids: Sequence[int],
    blocks_per_chunk: int,
) -> list[ChunkCopy]:
    """Pair every GPU block of a transfer with its CPU sub-block (docs/device.md), group by group.

    For group ``g`` with ``n = gpu_spec_group_sizes[g]`` blocks starting at group block index
    ``bi = block_indices[g]``, the first GPU block sits ``s = bi mod k`` sub-blocks into its chunk;
    the group consumes ``n`` GPU ids and ``ceil((n + s) / k)`` CPU chunk ids, taken in order from
    the concatenated id lists. GPU block ``i`` of the group pairs with chunk ``(s + i) div k`` of
    the group's run, position ``(s + i) mod k``. Groups of size 0 are skipped and consume nothing.
    Callers repeat the plan once per layer ref of the group (ops ordered group → ref → block).

    Example: ``k=3``, one group of 4 blocks at block index 4, GPU ids ``[0, 1, 2, 3]``, CPU chunks
    ``[7, 2]`` → ``(0, 7, 1), (1, 7, 2), (2, 2, 0), (3, 2, 1)``.

    Returns:
        one :class:`ChunkCopy` per GPU block, in group order.

    Raises:
        ValueError: ``blocks_per_chunk < 1``, mismatched group lists, a negative size or index, or
            id lists whose lengths differ from what the groups consume.
    """
    k = int(blocks_per_chunk)
    if k < 1:
        raise ValueError(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
    if len(gpu_spec_group_sizes) != len(block_indices):
        raise ValueError(
            f"{len(gpu_spec_group_sizes)} group sizes but {len(block_indices)} block indices"
        )
    plan: list[ChunkCopy] = []
    gpu_pos = 0
    cpu_pos = 0
    for g, (n, bi) in enumerate(zip(gpu_spec_group_sizes, block_indices, strict=True)):
        n, bi = int(n), int(bi)
        if n < 0 or bi < 0:
            raise ValueError(f"group {g}: size {n} and block index {bi} must be >= 0")
        if n == 0:
            continue
        s = bi % k
        chunks = -(-(n + s) // k)
        gpu_run = gpu_block_ids[gpu_pos : gpu_pos + n]
        cpu_run = cpu_chunk_ids[cpu_pos : cpu_pos + chunks]
        gpu_pos += n
        cpu_pos += chunks
        if len(gpu_run) < n or len(cpu_run) < chunks:
            break  # reported below with the full totals
        for i in range(n):
            j = s + i
            plan.append(ChunkCopy(int(gpu_run[i]), int(cpu_run[j // k]), j % k))
    if gpu_pos != len(gpu_block_ids) or cpu_pos != len(cpu_chunk_ids):
        raise ValueError(
            f"groups consume {gpu_pos} GPU blocks and {cpu_pos} CPU chunks, but "
            f"{len(gpu_block_ids)} GPU block ids and {len(cpu_chunk_ids)} CPU chunk ids were given"
        )
    return plan


def plan_descriptors(
    plan: Sequence[ChunkCopy],
    gpu_view: torch.Tensor,
    cpu_view: torch.Tensor,
    page_bytes: int,
    *,
    store: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copy descriptors ``(src_ptrs, dst_ptrs, sizes)`` for ``plan`` over one view pair.

    Args:
        plan: from :func:`plan_chunk_copies`.
        gpu_view: int8 ``(num_gpu_blocks, gpu_page)``; block b at ``data_ptr + b·stride(0)``.
        cpu_view: int8 ``(num_chunks, ≥ k·page_bytes)``; sub-block j of chunk c at
            ``data_ptr + c·stride(0) + j·page_bytes``.
        page_bytes: bytes per op (the ref's un-padded page size).
        store: True for GPU→CPU (src = GPU), False for CPU→GPU.

    Returns:
        three 1-D int64 CPU tensors of length ``len(plan)`` for :func:`kvcascade.ops.batch_copy`.

    Raises:
        ValueError: a block, chunk or position outside its view.
    """
    m = len(plan)
    arr = np.asarray(plan, dtype=np.int64).reshape(m, 3)
    gpu_ids, chunks, pos = arr[:, 0], arr[:, 1], arr[:, 2]
    if m and (
        gpu_ids.min() < 0
        or gpu_ids.max() >= gpu_view.shape[0]
        or chunks.min() < 0
        or chunks.max() >= cpu_view.shape[0]
        or (pos.max() + 1) * page_bytes > cpu_view.shape[1]
        or page_bytes > gpu_view.shape[1]
    ):
        raise ValueError(
            f"plan does not fit views gpu {tuple(gpu_view.shape)} / cpu {tuple(cpu_view.shape)} "
            f"with page {page_bytes}"
        )
    gpu_addr = gpu_view.data_ptr() + gpu_ids * gpu_view.stride(0)
    cpu_addr = cpu_view.data_ptr() + chunks * cpu_view.stride(0) + pos * page_bytes
    src, dst = (gpu_addr, cpu_addr) if store else (cpu_addr, gpu_addr)
    sizes = np.full(m, page_bytes, dtype=np.int64)
    return torch.from_numpy(src), torch.from_numpy(dst), torch.from_numpy(sizes)
