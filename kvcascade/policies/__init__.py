"""Eviction policies of the CPU primary tier and their registry."""

from .arc import ARCCachePolicy
from .base import BlockStatus, CachePolicy
from .lru import LRUCachePolicy
from .registry import register_cache_policy, registered_cache_policies, resolve_cache_policy
from .turn_aware import TurnAwareCachePolicy

__all__ = [
    "ARCCachePolicy",
    "BlockStatus",
    "CachePolicy",
    "LRUCachePolicy",
    "TurnAwareCachePolicy",
    "register_cache_policy",
    "registered_cache_policies",
    "resolve_cache_policy",
]
