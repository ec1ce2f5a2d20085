"""Eviction policies of the CPU primary tier and their registry."""

from .adaptive import AdaptiveCachePolicy
from .arc import ARCCachePolicy
from .base import BlockStatus, CachePolicy
from .lru import LRUCachePolicy
from .registry import register_cache_policy, registered_cache_policies, resolve_cache_policy
from .s3fifo import S3FIFOCachePolicy
from .turn_aware import TurnAwareCachePolicy

__all__ = [
    "ARCCachePolicy",
    "AdaptiveCachePolicy",
    "BlockStatus",
    "CachePolicy",
    "LRUCachePolicy",
    "S3FIFOCachePolicy",
    "TurnAwareCachePolicy",
    "register_cache_policy",
    "registered_cache_policies",
    "resolve_cache_policy",
]
