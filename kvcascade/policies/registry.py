"""Name → cache-policy class registry (vLLM ``kv_offload/cpu/policies/factory.py``).

Names resolve lazily to ``"module:Class"`` strings, so registering costs no import. Resolution
order (as vLLM's factory): a registered name; else, with ``module_path`` (vLLM's
``cache_policy_module_path``), the class called ``name`` in that module; else ``name`` itself in
the form ``"module.path:ClassName"``.
"""

from __future__ import annotations

import importlib
import inspect

from .._errors import ConfigError
from .base import CachePolicy

_REGISTRY: dict[str, str | type[CachePolicy]] = {
    "lru": "kvcascade.policies.lru:LRUCachePolicy",
    "arc": "kvcascade.policies.arc:ARCCachePolicy",
    "turn_aware": "kvcascade.policies.turn_aware:TurnAwareCachePolicy",
    "s3fifo": "kvcascade.policies.s3fifo:S3FIFOCachePolicy",
    "adaptive": "kvcascade.policies.adaptive:AdaptiveCachePolicy",
}


def register_cache_policy(name: str, cls: str | type[CachePolicy]) -> None:
    """Register ``cls`` (a class or a ``"module.path:ClassName"`` string) under ``name``.

    Raises:
        ValueError: ``name`` is already registered ("… is already registered"), is not a
            non-empty string, or ``cls`` is neither a :class:`CachePolicy` subclass nor a
            ``"module.path:ClassName"`` string (nothing is registered then).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a cache policy name must be a non-empty string, got {name!r:.40}")
    is_path = isinstance(cls, str) and cls.count(":") == 1 and all(cls.partition(":")[::2])
    if not (is_path or (isinstance(cls, type) and issubclass(cls, CachePolicy))):
        raise ValueError(
            f"cache policy {name!r}: expected a CachePolicy subclass or 'module.path:ClassName',"
            f" got {cls!r:.60}"
        )
    if name in _REGISTRY:
        raise ValueError(f"cache policy {name!r} is already registered")
    _REGISTRY[name] = cls


def registered_cache_policies() -> list[str]:
    """The registered policy names, sorted."""
    return sorted(_REGISTRY)


def _import_class(module_name: str, class_name: str, what: str) -> object:
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"eviction_policy {what!r}: cannot import {module_name!r}: {exc}"
        ) from exc
    try:
        return getattr(module, class_name)
    except AttributeError as exc:
        raise ConfigError(
            f"eviction_policy {what!r}: module {module_name!r} has no class {class_name!r}"
        ) from exc


def resolve_cache_policy(name: str, module_path: str | None = None) -> type[CachePolicy]:
    """The policy class for ``name`` (see the module docstring for the resolution order).

    Raises:
        ConfigError (a ValueError): ``"Unknown cache policy …"`` listing the registered names;
            an import that fails; a class that is not a :class:`CachePolicy` subclass, or an
            abstract one.
    """
    if not isinstance(name, str):
        raise ConfigError(f"eviction_policy must be a string, got {type(name).__name__}")
    entry = _REGISTRY.get(name)
    if isinstance(entry, str):
        module_name, _, class_name = entry.partition(":")
        cls = _import_class(module_name, class_name, name)
    elif entry is not None:
        cls = entry
    elif module_path:
        cls = _import_class(module_path, name, name)
    elif name.count(":") == 1 and all(name.partition(":")[::2]):
        module_name, _, class_name = name.partition(":")
        cls = _import_class(module_name, class_name, name)
    else:
        raise ConfigError(
            f"Unknown cache policy {name!r}; registered: {', '.join(registered_cache_policies())}"
            " (or set eviction_policy to 'module.path:ClassName', or set"
            " cache_policy_module_path)"
        )
    if not (isinstance(cls, type) and issubclass(cls, CachePolicy)):
        raise ConfigError(f"eviction_policy {name!r} resolves to {cls!r}, not a CachePolicy")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise ConfigError(f"eviction_policy {name!r} is an abstract class (no {missing})")
    return cls
