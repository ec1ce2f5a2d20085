"""Canonical int8 block views over real KV tensors, for each layout (issue #6, vLLM's
``CanonicalKVCaches``)."""

from __future__ import annotations

import pytest
import torch

from kvcascade.views import block_views, canonical_views

NB, BS, H, D = 6, 4, 2, 8

LAYOUTS = {
    "flash_attn": (2, NB, BS, H, D),
    "flashinfer": (NB, 2, H, BS, D),
    "cpu": (NB, H, BS, 2 * D),
    "mla": (NB, BS, 3 * D),
    "cross_layer": (NB, 3 * BS * H * D),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_write_through_tensor_is_read_through_view(layout: str, dtype: torch.dtype) -> None:
    shape = LAYOUTS[layout]
    kv = torch.zeros(shape, dtype=dtype)
    views = canonical_views({"layer.0": kv}, layout)
    assert all(v.dtype == torch.int8 and v.shape[0] == NB for v in views)
    assert sum(v.shape[1] for v in views) * NB == kv.numel() * kv.element_size()
    block = 3
    source = torch.arange(kv.numel(), dtype=torch.float32).reshape(shape).to(dtype)
    if layout == "flash_attn":
        kv[:, block] = source[:, block]
        expected = b"".join(
            source[i, block].contiguous().view(torch.int8).numpy().tobytes() for i in range(2)
        )
    else:
        kv[block] = source[block]
        expected = source[block].contiguous().view(torch.int8).numpy().tobytes()
    got = b"".join(v[block].numpy().tobytes() for v in views)
    assert got == expected
    assert all(v[block - 1].abs().sum() == 0 for v in views)  # neighbours untouched


def test_view_writes_reach_the_tensor_without_copy() -> None:
    kv = torch.zeros(LAYOUTS["flashinfer"], dtype=torch.bfloat16)
    (view,) = block_views(kv)
    assert view.untyped_storage().data_ptr() == kv.untyped_storage().data_ptr()
    view[2] = torch.full((view.shape[1],), 0x3F, dtype=torch.int8)
    assert kv[2].float().unique().tolist() == [pytest.approx(0.74609375)]  # bf16 0x3F3F
    assert kv[1].abs().sum() == 0


def test_strided_rows_of_a_larger_buffer() -> None:
    """A tensor whose blocks sit in a larger buffer (padding after each block) keeps its stride."""
    buffer = torch.zeros(NB, 256, dtype=torch.int8)
    kv = buffer[:, :128].view(torch.bfloat16).view(NB, 4, 16)
    (view,) = block_views(kv)
    assert view.stride() == (256, 1) and view.shape == (NB, 128)


def test_bad_layouts_raise() -> None:
    with pytest.raises(ValueError, match="unknown KV layout 'nhd'"):
        canonical_views({"l": torch.zeros(2, 2)}, "nhd")
    with pytest.raises(ValueError, match="not contiguous"):
        block_views(torch.zeros(4, 6).t())
    with pytest.raises(ValueError, match="disagree"):
        canonical_views({"a": torch.zeros(3, 8), "b": torch.zeros(4, 8)}, "mla")
