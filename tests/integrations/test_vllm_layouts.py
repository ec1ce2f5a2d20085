"""The connector's worker copies blocks of every KV layout vLLM 0.32 can register (issue #15).

The caches are built by vLLM's own code on CPU tensors — ``get_kv_cache_config_from_groups``
places the layers for the layout and ``allocate_kv_cache`` views them with
``create_kv_cache_views`` — exactly as a worker receives them in ``register_kv_caches``. Each
layout's blocks then go GPU→CPU→GPU through the real copy path (``_WorkerSide`` over a real
``/dev/shm`` region). Skipped when vLLM is not importable.
"""

from __future__ import annotations

import uuid
import warnings

import pytest
import torch

with warnings.catch_warnings():  # vLLM's and torch's import-time deprecations are not ours
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm", reason="vLLM is not installed in this environment")
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from kvcascade._types import CPULoadStoreSpec, GPULoadStoreSpec
    from kvcascade.integrations import vllm as kcv
    from kvcascade.scheduler import GroupSpec, SchedulerConfig, TransferSpec
    from kvcascade.tiers.shm import region_geometry

pytestmark = pytest.mark.filterwarnings("default")

LAYERS = ("layers.0.attn", "layers.1.attn", "layers.2.attn")
NUM_BLOCKS = 6
K = 2  # GPU blocks per CPU chunk


def vllm_caches(layout: KVCacheLayout) -> tuple[dict[str, torch.Tensor], object]:
    """bf16 caches of three layers (2 KV heads, head size 8, 16 tokens a block) as vLLM
    allocates them for ``layout``, every byte random."""
    config = VllmConfig()
    config.cache_config.kv_cache_layout = layout.name
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    kv_cache_config = get_kv_cache_config_from_groups(
        config, [KVCacheGroupSpec(list(LAYERS), spec)], spec.page_size_bytes * 3 * NUM_BLOCKS
    )
    assert kv_cache_config.num_blocks == NUM_BLOCKS
    caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout)
    raw = torch.empty(0, dtype=torch.int8).set_(caches[LAYERS[0]].untyped_storage())
    raw.copy_(torch.randint(-128, 128, raw.shape, dtype=torch.int8))
    return caches, kv_cache_config


def worker_for(kv_cache_config: object) -> kcv._WorkerSide:
    """A one-worker ``_WorkerSide`` sized as ``_setup`` sizes it (one region slot per chunk)."""
    tensor = kv_cache_config.kv_cache_tensors[0]  # type: ignore[attr-defined]
    geometry = region_geometry(4 << 20, tensor.size // NUM_BLOCKS, 1, K)
    setup = kcv._Setup(
        extra={},
        scheduler=SchedulerConfig((GroupSpec(16),), 16, K),
        group_ids=(0,),
        instance_id=f"test-layouts-{uuid.uuid4().hex}",
        rank=0,
        world_size=1,
        num_cpu_blocks=geometry.num_blocks,
        cpu_page_size=geometry.cpu_page_size,
        block_bytes=geometry.block_bytes,
        model_name="tiny",
        identity={},
    )
    return kcv._WorkerSide(setup, kv_cache_config)  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda layout: layout.name)
def test_every_kv_layout_round_trips_through_the_cpu_tier(layout: KVCacheLayout) -> None:
    """Blocks 1 and 3 are stored as one CPU chunk and loaded into blocks 4 and 2: every layer's
    blocks 4 and 2 then equal the old 1 and 3 in all their bytes, and no other block changes.
    (``block_views`` refused LBNHC, BLNHC, LHBNC and BHLNC: "blocks … are not contiguous".)"""
    caches, kv_cache_config = vllm_caches(layout)
    before = {name: cache.clone() for name, cache in caches.items()}
    worker = worker_for(kv_cache_config)
    try:
        worker.register(caches)
        nbytes, _ = worker._copy(
            TransferSpec("r", CPULoadStoreSpec([0]), GPULoadStoreSpec([1, 3], [2], [0])),
            store=True,
            ready=None,
        )
        assert nbytes == 2 * sum(c[0].numel() * c.element_size() for c in caches.values())
        worker._copy(
            TransferSpec("r", CPULoadStoreSpec([0]), GPULoadStoreSpec([4, 2], [2], [0])),
            store=False,
            ready=None,
        )
    finally:
        worker.close()
    for name, cache in caches.items():
        new, old = cache.view(torch.int16), before[name].view(torch.int16)  # bit patterns
        assert torch.equal(new[4], old[1]) and torch.equal(new[2], old[3]), name
        for b in (0, 1, 3, 5):
            assert torch.equal(new[b], old[b]), (name, b)


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda layout: layout.name)
def test_block_runs_cover_each_block_once(layout: KVCacheLayout) -> None:
    """The views of one layer cover exactly its block's bytes: marking block 2 of a layer
    through vLLM's logical view marks row 2 of its views and nothing else."""
    caches, _ = vllm_caches(layout)
    raw = torch.empty(0, dtype=torch.int8).set_(caches[LAYERS[0]].untyped_storage())
    raw.zero_()
    cache = caches[LAYERS[1]]
    cache[2].view(torch.int16).fill_(-1)  # every byte 0xff
    views = kcv._block_runs(cache)
    assert sum(v.shape[1] for v in views) == cache[2].numel() * cache.element_size()
    for view in views:
        assert view.shape[0] == NUM_BLOCKS
        assert bool((view[2] == -1).all())
        assert int(torch.count_nonzero(view)) == view.shape[1]
    assert int(torch.count_nonzero(raw)) == cache[2].numel() * cache.element_size()
