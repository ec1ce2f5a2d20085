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
from .cascade import Cascade, LoadResult, PrefixLookup, StoreResult, open_cascade
from .coordinator import TieringCoordinator
from .index.cpu import CPUOffloadingManager
from .metrics import TieringMetrics
from .policies import BlockStatus, CachePolicy, register_cache_policy
from .tiers.base import SecondaryTier
from .tiers.cpu import HostBuffer
from .tiers.device import DeviceTier
from .tiers.fs import FileSystemTier
from .tiers.memory import MemoryTier

__version__ = "0.1.0"

__all__ = [
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
    "FileSystemTier",
    "GPULoadStoreSpec",
    "HostBuffer",
    "JobResult",
    "KVCascadeError",
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
    "StoreResult",
    "TierUnavailableError",
    "TieringCoordinator",
    "TieringMetrics",
    "TraceError",
    "TransferError",
    "TransferJob",
    "__version__",
    "make_offload_key",
    "open_cascade",
    "register_cache_policy",
    "split_offload_key",
]
