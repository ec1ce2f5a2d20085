"""Copy operations between the device KV cache and the primary tier.

Public entries: :func:`swap_blocks` (block-id level, used by the tiers), :func:`batch_copy`
(raw descriptor level), :func:`plan_chunk_copies` / :func:`plan_descriptors` (the chunk
mapping of vLLM's ``kv_offload/cpu/gpu_worker.py``), and the dispatch settings
:class:`KernelSettings`.
"""

from ._settings import KernelSettings, load_settings
from .plan import ChunkCopy, plan_chunk_copies, plan_descriptors
from .swap import (
    batch_copy,
    extension_available,
    kernel_settings,
    select_kernel,
    set_kernel_settings,
    swap_blocks,
    triton_available,
)

__all__ = [
    "ChunkCopy",
    "KernelSettings",
    "batch_copy",
    "extension_available",
    "kernel_settings",
    "load_settings",
    "plan_chunk_copies",
    "plan_descriptors",
    "select_kernel",
    "set_kernel_settings",
    "swap_blocks",
    "triton_available",
]
