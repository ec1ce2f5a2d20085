"""kvcascade: an asyncio-native three-tier KV cache (GPU HBM → CPU DRAM → files / S3).

After vLLM v1's ``kv_offload`` tiering. Public surface::

    import kvcascade as kc
    async with kc.open_cascade(kc.CascadeConfig(cpu_blocks=1024)) as cascade:
        ...
"""

from ._config import CascadeConfig
from ._errors import (
    BlockUnavailableError,
    ConfigError,
    CorruptBlockError,
    KVCascadeError,
    TierUnavailableError,
    TraceError,
    TransferError,
)
from ._keys import make_offload_key, split_offload_key
from ._types import (
    BlockIDsLoadStoreSpec,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    JobResult,
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadPolicy,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    TransferJob,
)
from .cascade import (
    Cascade,
    LoadResult,
    PrefixLookup,
    StoreResult,
    open_cascade,
    start_tier_actors,
    stop_tier_actors,
)
from .coordinator import TieringCoordinator
from .hints import SessionHint, hint_of
from .index.cpu import CPUOffloadingManager
from .metrics import TieringMetrics
from .ops import batch_copy, swap_blocks
from .policies import (
    ARCCachePolicy,
    BlockStatus,
    CachePolicy,
    LRUCachePolicy,
    TurnAwareCachePolicy,
    register_cache_policy,
)
from .tiers.base import SecondaryTier
from .tiers.cpu import HostBuffer
from .tiers.device import DeviceTier, DeviceTransfer, EventBridge
from .tiers.fs import FileSystemTier
from .tiers.memory import MemoryTier
from .tiers.registry import TierContext, register_secondary_tier
from .tiers.shm import SharedOffloadRegion, region_geometry
from .views import block_views, canonical_views

__version__ = "0.1.0"

__all__ = [
    "ARCCachePolicy",
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
    "DeviceTier",
    "DeviceTransfer",
    "EventBridge",
    "FileSystemTier",
    "GPULoadStoreSpec",
    "HostBuffer",
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
    "canonical_views",
    "hint_of",
    "make_offload_key",
    "open_cascade",
    "region_geometry",
    "register_cache_policy",
    "register_secondary_tier",
    "split_offload_key",
    "start_tier_actors",
    "stop_tier_actors",
    "swap_blocks",
]
