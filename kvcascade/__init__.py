"""kvcascade: an asyncio-native three-tier KV cache (GPU HBM → CPU DRAM → files / S3).

After vLLM v1's ``kv_offload`` tiering. Public surface::

    import kvcascade as kc
    config = kc.CascadeConfig(
        cpu_blocks=1024,
        secondary_tiers=[{"type": "fs", "root_dir": "kv-cache"}],
        model_name="meta-llama/Llama-3.1-8B",  # required with a persistent tier: its namespace
    )
    async with kc.open_cascade(config) as cascade:
        ...

The names are imported on first use (PEP 562), so ``kvcascade --help`` and ``--version`` start
without importing torch; ``from kvcascade import X`` and ``kvcascade.X`` work as usual.
"""

import importlib as _importlib

__version__ = "0.1.0"

# Public name → the module that defines it.
_EXPORTS: dict[str, str] = {
    "CascadeConfig": "._config",
    "BlockUnavailableError": "._errors",
    "ConfigError": "._errors",
    "CorruptBlockError": "._errors",
    "DeadlineExceededError": "._errors",
    "InsufficientSpaceError": "._errors",
    "KVCascadeError": "._errors",
    "TierUnavailableError": "._errors",
    "TraceError": "._errors",
    "TransferError": "._errors",
    "make_offload_key": "._keys",
    "split_offload_key": "._keys",
    "BlockIDsLoadStoreSpec": "._types",
    "CPULoadStoreSpec": "._types",
    "GPULoadStoreSpec": "._types",
    "JobResult": "._types",
    "LoadStoreSpec": "._types",
    "LookupResult": "._types",
    "Medium": "._types",
    "OffloadPolicy": "._types",
    "OffloadingEvent": "._types",
    "PrepareStoreOutput": "._types",
    "ReqContext": "._types",
    "RequestOffloadingContext": "._types",
    "ScheduleEndContext": "._types",
    "TransferJob": "._types",
    "Cascade": ".cascade",
    "InvalidateResult": ".cascade",
    "LoadResult": ".cascade",
    "PrefixLookup": ".coordinator",
    "StoreResult": ".cascade",
    "open_cascade": ".cascade",
    "build_coordinator": "._lifecycle",
    "serve_coordinator": "._lifecycle",
    "TieringCoordinator": ".coordinator",
    "SessionHint": ".hints",
    "hint_of": ".hints",
    "CPUOffloadingManager": ".index.cpu",
    "TieringMetrics": ".metrics",
    "batch_copy": ".ops",
    "swap_blocks": ".ops",
    "ARCCachePolicy": ".policies",
    "AdaptiveCachePolicy": ".policies",
    "BlockStatus": ".policies",
    "CachePolicy": ".policies",
    "LRUCachePolicy": ".policies",
    "S3FIFOCachePolicy": ".policies",
    "TurnAwareCachePolicy": ".policies",
    "register_cache_policy": ".policies",
    "SecondaryTier": ".tiers.base",
    "HostBuffer": ".tiers.cpu",
    "DeviceTier": ".tiers.device",
    "DeviceTransfer": ".tiers.device",
    "EventBridge": ".tiers.device",
    "FileSystemTier": ".tiers.fs",
    "MemoryTier": ".tiers.memory",
    "TierContext": ".tiers.registry",
    "register_secondary_tier": ".tiers.registry",
    "SharedOffloadRegion": ".tiers.shm",
    "region_geometry": ".tiers.shm",
    "block_views": ".views",
    "canonical_views": ".views",
}


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvcascade' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__all__ = [
    "ARCCachePolicy",
    "AdaptiveCachePolicy",
    "BlockIDsLoadStoreSpec",
    "BlockStatus",
    "BlockUnavailableError",
    "CPULoadStoreSpec",
    "CPUOffloadingManager",
    "CachePolicy",
    "Cascade",
    "CascadeConfig",
    "ConfigError",
    "CorruptBlockError",
    "DeadlineExceededError",
    "DeviceTier",
    "DeviceTransfer",
    "EventBridge",
    "FileSystemTier",
    "GPULoadStoreSpec",
    "HostBuffer",
    "InsufficientSpaceError",
    "InvalidateResult",
    "JobResult",
    "KVCascadeError",
    "LRUCachePolicy",
    "LoadResult",
    "LoadStoreSpec",
    "LookupResult",
    "Medium",
    "MemoryTier",
    "OffloadPolicy",
    "OffloadingEvent",
    "PrefixLookup",
    "PrepareStoreOutput",
    "ReqContext",
    "RequestOffloadingContext",
    "S3FIFOCachePolicy",
    "ScheduleEndContext",
    "SecondaryTier",
    "SessionHint",
    "SharedOffloadRegion",
    "StoreResult",
    "TierContext",
    "TierUnavailableError",
    "TieringCoordinator",
    "TieringMetrics",
    "TraceError",
    "TransferError",
    "TransferJob",
    "TurnAwareCachePolicy",
    "__version__",
    "batch_copy",
    "block_views",
    "build_coordinator",
    "canonical_views",
    "hint_of",
    "make_offload_key",
    "open_cascade",
    "region_geometry",
    "register_cache_policy",
    "register_secondary_tier",
    "serve_coordinator",
    "split_offload_key",
    "swap_blocks",
]
