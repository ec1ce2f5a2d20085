"""Name → cache-policy class registry (spec §2.4 factory, §9.4).

Names resolve lazily to ``"module:Class"`` strings so that registering costs no import.
"""

from __future__ import annotations

import importlib

from .._errors import ConfigError
from .base import CachePolicy

_REGISTRY: dict[str, str | type[CachePolicy]] = {
    "lru": "kvcascade.policies.lru:LRUCachePolicy",
}


def register_cache_policy(name: str, cls: str | type[CachePolicy]) -> None:
    """Register ``cls`` (a class or a ``"module.path:ClassName"`` string) under ``name``.

    Raises:
        ValueError: ``name`` is already registered.
    """
    if name in _REGISTRY:
        raise ValueError(f"cache policy {name!r} is already registered")
    _REGISTRY[name] = cls


def registered_cache_policies() -> list[str]:
    """The registered policy names, sorted."""
    return sorted(_REGISTRY)


def _import_class(path: str) -> type:
    module_name, sep, class_name = path.partition(":")
    if not sep or not module_name or not class_name:
        raise ConfigError(f"eviction_policy {path!r} must be a registered name or 'module:Class'")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, class_name)
    except AttributeError as exc:
        raise ConfigError(f"module {module_name!r} has no class {class_name!r}") from exc


def resolve_cache_policy(name: str) -> type[CachePolicy]:
    """The policy class for ``name``: a registered name or ``"module.path:ClassName"``.

    Raises:
        ConfigError (a ValueError): unknown name (the message lists the known ones), or the class
            is not a :class:`CachePolicy` subclass.
    """
    if not isinstance(name, str):
        raise ConfigError(f"eviction_policy must be a string, got {type(name).__name__}")
    entry = _REGISTRY.get(name)
    if entry is None and ":" not in name:
        raise ConfigError(
            f"Unknown cache policy {name!r}; known: {', '.join(registered_cache_policies())} "
            "(or give 'module.path:ClassName')"
        )
    cls = _import_class(entry if isinstance(entry, str) else name) if not isinstance(
        entry, type
    ) else entry
    if not (isinstance(cls, type) and issubclass(cls, CachePolicy)):
        raise ConfigError(f"eviction_policy {name!r} resolves to {cls!r}, not a CachePolicy")
    return cls
