"""Canonical KV-cache views: zero-copy int8 ``(num_blocks, page_bytes)`` (vLLM's
``CanonicalKVCaches`` in ``kv_offload/base.py``, built as its ``offloading/worker.py`` does).

Whatever an attention backend's layout, the offload path wants one thing per tensor: block ``b``
as row ``b`` of an int8 matrix. When the block dimension is physically outermost, one strided view
covers the tensor; when an outer dimension (FlashAttention's K/V axis) has a larger stride than
the blocks, the tensor is split along it into one view per outer index. No data is copied: every
view shares the tensor's storage, so a write through one is seen through the other.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
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


class CanonicalViews(list[torch.Tensor]):
    """What :func:`canonical_views` returns: the views (a list of int8 ``(num_blocks, page)``
    tensors) and what their bytes mean — per layer its name, layout, KV dtype and the shape of
    one block — which a :class:`kvcascade.Cascade` built over them folds into its namespace
    (:meth:`identity`): two engines whose blocks have the same size but another layout, dtype
    or geometry never read each other's blocks. ``a + b`` and ``a += b`` of two such lists
    keep both descriptions (an engine with layers of two layouts); what other list operations
    make (a slice, ``list(a)``, ``a + [view]``) is a plain list, whose namespace has only the
    views' page sizes (pass the ``CanonicalViews`` itself).

    Attributes:
        layers: per layer, in view order, ``(name, layout, dtype name, shape of one block,
            number of views)``; the block shape is the tensor's shape without its block
            dimension (e.g. ``(2, block_size, heads, head_dim)`` for ``flash_attn``).
    """

    def __init__(
        self,
        views: Iterable[torch.Tensor],
        layers: Sequence[tuple[str, str, str, tuple[int, ...], int]],
    ) -> None:
        super().__init__(views)
        self.layers = tuple(layers)

    def __add__(self, other: Any) -> Any:  # list's signature
        if isinstance(other, CanonicalViews):
            return CanonicalViews([*self, *other], self.layers + other.layers)
        return list(self) + other

    def __iadd__(self, other: Any) -> CanonicalViews:  # list's signature
        super().__iadd__(other)
        if isinstance(other, CanonicalViews):
            self.layers += other.layers
        return self

    def identity(self) -> dict[str, Any]:
        """Namespace fields (:func:`kvcascade.tiers._file_mapper.default_identity`): the page
        sizes of the views (``kv_view_pages``) and, while :attr:`layers` accounts for every
        view, ``dtype`` and ``kv_layout`` (comma-joined per layer where layers differ), the
        layer names as one KV-cache group and ``kv_block_shapes``."""
        out: dict[str, Any] = {"kv_view_pages": [int(v.shape[1]) for v in self]}
        if sum(n for *_, n in self.layers) != len(self):
            return out  # the list was changed by other means: its pages are all that is known

        def joined(values: list[str]) -> str:
            return values[0] if len(set(values)) == 1 else ",".join(values)

        out["dtype"] = joined([dtype for _, _, dtype, _, _ in self.layers])
        out["kv_layout"] = joined([layout for _, layout, _, _, _ in self.layers])
        out["layer_names"] = [[name for name, *_ in self.layers]]
        out["kv_block_shapes"] = [list(shape) for _, _, _, shape, _ in self.layers]
        return out


def canonical_views(kv_caches: Mapping[str, torch.Tensor], layout: str) -> CanonicalViews:
    """Canonical views of every layer's KV tensor, layer by layer (and K before V).

    Args:
        kv_caches: layer name → KV tensor, in layer order.
        layout: a key of :data:`BLOCK_DIM` (``flash_attn``, ``flashinfer``, ``cpu``, ``mla``,
            ``cross_layer``).

    Returns:
        The views, with each layer's name, layout, dtype and block shape
        (:class:`CanonicalViews`).

    Raises:
        ValueError: unknown ``layout`` (the message lists the known ones), tensors that
            disagree on ``num_blocks``, or a layout whose blocks are not contiguous.
    """
    if layout not in BLOCK_DIM:
        raise ValueError(f"unknown KV layout {layout!r}; known: {', '.join(sorted(BLOCK_DIM))}")
    dim = BLOCK_DIM[layout]
    views: list[torch.Tensor] = []
    layers = []
    for name, tensor in kv_caches.items():
        own = block_views(tensor, dim)
        views += own
        shape = (*tensor.shape[:dim], *tensor.shape[dim + 1 :])
        layers.append((name, layout, str(tensor.dtype).removeprefix("torch."), shape, len(own)))
    counts = {v.shape[0] for v in views}
    if len(counts) > 1:
        raise ValueError(f"layers disagree on num_blocks: {sorted(counts)}")
    return CanonicalViews(views, layers)
