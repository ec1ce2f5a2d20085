"""Triton batch copy for many small pages (kvcascade's CPU→GPU load path, spec §5.4).

One descriptor is (source address, destination address, byte count) in three int64 arrays. Program
``p`` of ``num_programs`` handles descriptors ``p, p + num_programs, …``; each descriptor is copied
as ``size / 8`` 64-bit words in masked chunks of ``CHUNK_WORDS`` words. Sizes and addresses must be
multiples of 8 bytes (the caller checks).

On a GPU the descriptor arrays must live on the device and the source may be pinned (or
``cudaHostRegister``-ed) host memory, which the GPU reads through unified addressing; pageable host
memory is not readable by the kernel. Under ``TRITON_INTERPRET=1`` the kernel runs on the CPU with
CPU tensors: the interpreter turns the loaded int64 addresses into numpy pointer arrays and
dereferences them directly, so the same raw-address kernel runs unchanged (no base-tensor + offset
variant is needed). ``TRITON_INTERPRET`` must be set before this module is imported, because
``triton.jit`` decides between compiled and interpreted at decoration time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Upper bound of the per-iteration chunk, in bytes (one masked load/store of 1024 words).
MAX_CHUNK_BYTES = 8192


@triton.jit
def _batch_copy_words(
    src_ptrs,
    dst_ptrs,
    sizes,
    n,
    num_programs,
    CHUNK_WORDS: tl.constexpr,
):
    pid = tl.program_id(0)
    for i in range(pid, n, num_programs):
        src = tl.load(src_ptrs + i).to(tl.pointer_type(tl.int64))
        dst = tl.load(dst_ptrs + i).to(tl.pointer_type(tl.int64))
        words = tl.load(sizes + i) // 8
        for start in range(0, words, CHUNK_WORDS):
            offs = start + tl.arange(0, CHUNK_WORDS)
            mask = offs < words
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def chunk_bytes(max_page_bytes: int) -> int:
    """Chunk size for a batch: the next power of two ≥ the largest page, capped at 8 KiB, ≥ 8."""
    return min(max(8, triton.next_power_of_2(max(1, max_page_bytes))), MAX_CHUNK_BYTES)


def batch_copy(
    src_ptrs: torch.Tensor,
    dst_ptrs: torch.Tensor,
    sizes: torch.Tensor,
    max_page_bytes: int,
    num_programs: int,
) -> None:
    """Launch the copy of every descriptor on the current stream (asynchronous on a GPU).

    Args:
        src_ptrs, dst_ptrs, sizes: 1-D int64 tensors of equal length ``n`` on the device that runs
            the kernel (CPU only under ``TRITON_INTERPRET=1``); sizes in bytes, multiples of 8.
        max_page_bytes: the largest entry of ``sizes`` (chooses the chunk size).
        num_programs: grid size upper bound; ``min(num_programs, n)`` programs are launched.
    """
    n = int(src_ptrs.numel())
    if n == 0:
        return
    grid = (max(1, min(num_programs, n)),)
    _batch_copy_words[grid](
        src_ptrs,
        dst_ptrs,
        sizes,
        n,
        grid[0],
        CHUNK_WORDS=chunk_bytes(max_page_bytes) // 8,
    )


def interpreted() -> bool:
    """Whether this module was imported under ``TRITON_INTERPRET=1`` (kernel runs on the CPU)."""
    return not isinstance(_batch_copy_words, triton.runtime.JITFunction)
