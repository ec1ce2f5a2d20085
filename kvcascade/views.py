"""Canonical KV-cache views: zero-copy int8 ``(num_blocks, page_bytes)`` (vLLM's
``CanonicalKVCaches`` in ``kv_offload/base.py``, built as its ``offloading/worker.py`` does).

Whatever an attention backend's layout, the offload path wants one thing per tensor: block ``b``
as row ``b`` of an int8 matrix. When the block dimension is physically outermost, one strided view
covers the tensor; when an outer dimension (FlashAttention's K/V axis) has a larger stride than
the blocks, the tensor is split along it into one view per outer index. No data is copied: every
view shares the tensor's storage, so a write through one is seen through the other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

#: Where the ``num_blocks`` dimension sits in each supported layout.
BLOCK_DIM = {
    "flash_attn": 1,  # (2, num_blocks, block_size, heads, head_dim) — K/V outermost
    "flashinfer": 0,  # HND: (num_blocks, 2, heads, block_size, head_dim)
    "cpu": 0,  # vLLM's CPU backend: (num_blocks, kv_heads, block_size, 2·head_dim)
    "mla": 0,  # (num_blocks, block_size, latent_dim)
    "cross_layer": 0,  # (num_blocks, layers × page)
}


def block_views(tensor: torch.Tensor, block_dim: int = 0) -> list[torch.Tensor]:
    """Zero-copy int8 views ``(num_blocks, page_bytes)`` of ``tensor``, row ``b`` = block ``b``.

    Args:
        tensor: any dtype, any device; dimension ``block_dim`` indexes blocks.
        block_dim: position of the block dimension.

    Returns:
        One view if each block is contiguous in memory; else one view per index of the
        dimensions before ``block_dim`` (e.g. K and V), in order.

    Raises:
        ValueError: ``block_dim`` out of range, or a block's bytes are not contiguous even after
            splitting the outer dimensions (such a layout cannot be copied block by block).
    """
    if not 0 <= block_dim < tensor.dim():
        raise ValueError(f"block_dim {block_dim} out of range for shape {tuple(tensor.shape)}")
    if block_dim > 0:
        return [v for part in tensor.unbind(0) for v in block_views(part, block_dim - 1)]
    one_block = tensor[0] if tensor.shape[0] else tensor.new_empty(tensor.shape[1:])
    if not one_block.is_contiguous():
        raise ValueError(
            f"blocks of a tensor of shape {tuple(tensor.shape)} and strides {tensor.stride()} "
            "are not contiguous; give the block dimension's position in the layout"
        )
    elem = tensor.element_size()
    page = one_block.numel() * elem
    row_stride = tensor.stride(0) * elem if tensor.shape[0] > 1 else page
    view = torch.empty(0, dtype=torch.int8, device=tensor.device)
    view.set_(
        tensor.untyped_storage(),
        tensor.storage_offset() * elem,
        (tensor.shape[0], page),
        (row_stride, 1),
    )
    return [view]


#: The attribute of a canonical view that says what its bytes mean (:func:`views_identity`).
_MEANING = "_kvcascade_meaning"


def canonical_views(kv_caches: Mapping[str, torch.Tensor], layout: str) -> list[torch.Tensor]:
    """Canonical views of every layer's KV tensor, layer by layer (and K before V).

    Each view also records what its bytes mean — its layer's name, the layout, the KV dtype,
    the shape of one block (the tensor's shape without its block dimension) and which of the
    layer's views it is (K or V of ``flash_attn``) — which :func:`views_identity` reads: the
    record goes with the view tensor itself, so any list built from these views (a copy, a
    slice, views of two layouts joined, another order) describes what it holds.

    Args:
        kv_caches: layer name → KV tensor, in layer order.
        layout: a key of :data:`BLOCK_DIM` (``flash_attn``, ``flashinfer``, ``cpu``, ``mla``,
            ``cross_layer``).

    Raises:
        ValueError: unknown ``layout`` (the message lists the known ones), tensors that
            disagree on ``num_blocks``, or a layout whose blocks are not contiguous.
    """
    if layout not in BLOCK_DIM:
        raise ValueError(f"unknown KV layout {layout!r}; known: {', '.join(sorted(BLOCK_DIM))}")
    dim = BLOCK_DIM[layout]
    views: list[torch.Tensor] = []
    for name, tensor in kv_caches.items():
        dtype = str(tensor.dtype).removeprefix("torch.")
        shape = [*tensor.shape[:dim], *tensor.shape[dim + 1 :]]
        for part, view in enumerate(block_views(tensor, dim)):
            setattr(view, _MEANING, [name, layout, dtype, shape, part])
            views.append(view)
    counts = {v.shape[0] for v in views}
    if len(counts) > 1:
        raise ValueError(f"layers disagree on num_blocks: {sorted(counts)}")
    return views


def views_identity(views: Sequence[torch.Tensor]) -> dict[str, Any]:
    """The namespace field of an engine's KV views (``kv_views``; docs/fs-tier.md,
    *Namespace*): per view, in order, what :func:`canonical_views` recorded of it and its page
    size — ``[layer, layout, dtype, block shape, part, page bytes]`` — or only its page size
    for a view made otherwise (an int8 view says nothing of its dtype or layout). Two engines
    whose blocks have the same size but another layout, dtype, geometry or view order never
    share a namespace."""
    return {
        "kv_views": [[*getattr(v, _MEANING, []), int(v.shape[1])] for v in views],
    }
