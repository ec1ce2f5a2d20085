"""Secondary-tier types: name → factory registry (vLLM's ``tiering/factory.py``).

Built-in types resolve lazily (no import until used): ``fs``; ``memory`` (vLLM's ``example`` is an
alias); ``s3`` (vLLM's ``obj`` is an alias); ``valkey`` (a Valkey / Redis server or cluster).
Out-of-tree tiers either register a factory with :func:`register_secondary_tier`, or are named
in config by ``type`` plus ``module_path`` — the class called ``type`` is imported from that
module, like vLLM's ``SecondaryTierFactory``.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._errors import ConfigError
from .._validate import config_name
from ._file_mapper import FileMapper
from .base import SecondaryTier
from .cpu import HostBuffer


@dataclass(frozen=True)
class TierContext:
    """What every tier factory receives besides its own config keys.

    Attributes:
        host: the primary tier's buffer (rows addressed by slot id).
        identity: namespace identity fields of persistent tiers (model, dtype, geometry, salt).
    """

    host: HostBuffer
    identity: dict[str, Any]

    def mapper(self) -> FileMapper:
        """The namespace of a persistent tier (a tier's own ``cache_salt`` refines it)."""
        return FileMapper(dict(self.identity))


TierFactory = Callable[..., SecondaryTier]

#: vLLM's names of built-in types (its ``tiering/factory.py``) → kvcascade's.
_ALIASES = {"example": "memory", "obj": "s3"}

_REGISTRY: dict[str, str | TierFactory] = {
    "fs": "kvcascade.tiers.registry:_fs_factory",
    "memory": "kvcascade.tiers.memory:memory_tier_factory",
    "example": "kvcascade.tiers.memory:memory_tier_factory",
    "s3": "kvcascade.tiers.registry:_s3_factory",
    "obj": "kvcascade.tiers.registry:_s3_factory",
    "valkey": "kvcascade.tiers.registry:_valkey_factory",
}


def _fs_factory(ctx: TierContext, **kwargs: Any) -> SecondaryTier:
    from .fs import fs_tier_from_config

    return fs_tier_from_config(ctx.host, ctx.mapper(), kwargs)


def _s3_factory(ctx: TierContext, **kwargs: Any) -> SecondaryTier:
    try:
        from .s3 import s3_tier_from_config
    except ModuleNotFoundError as exc:
        raise ConfigError(
            f"the s3 tier needs aiobotocore ({exc.name} is missing): pip install 'kvcascade[s3]'"
        ) from exc
    return s3_tier_from_config(ctx.host, ctx.mapper(), kwargs)


def _valkey_factory(ctx: TierContext, **kwargs: Any) -> SecondaryTier:
    try:
        from .valkey import valkey_tier_from_config
    except ModuleNotFoundError as exc:
        raise ConfigError(
            f"the valkey tier needs redis-py ({exc.name} is missing): "
            "pip install 'kvcascade[valkey]'"
        ) from exc
    return valkey_tier_from_config(ctx.host, ctx.mapper(), kwargs)


#: Types whose blocks live and die with the process that made them (no namespace needed).
_PROCESS_LOCAL = frozenset({"memory", "example"})


def tier_name(tier_cfg: dict[str, Any]) -> str:
    """The name of a ``secondary_tiers`` entry (``type`` checked): its ``name``, the type when
    absent; the one rule for it (:class:`kvcascade.CascadeConfig`'s uniqueness check and the
    tier's factory read the same).

    Raises:
        ConfigError: ``name`` is not a non-empty string (``""`` made a second tier named after
            its type beside the default-named one), naming the type and the value.
    """
    return config_name(tier_cfg, tier_cfg["type"], f"secondary tier {tier_cfg['type']!r}")


def is_process_local(tier_cfg: dict[str, Any]) -> bool:
    """Whether a ``secondary_tiers`` entry keeps its blocks only inside this process (the
    built-in ``memory`` tier). Every other type — fs, s3, valkey, a registered or
    ``module_path`` type — may keep them where another process or a later run reads them, so
    its namespace needs a ``model_name`` (:class:`kvcascade.CascadeConfig`)."""
    return tier_cfg["type"] in _PROCESS_LOCAL and not tier_cfg.get("module_path")


def register_secondary_tier(type_name: str, factory: str | TierFactory) -> None:
    """Register a tier type: ``factory(ctx: TierContext, **tier_kwargs) -> SecondaryTier``
    (or a ``"module:function"`` string resolved on first use).

    Raises:
        ValueError: ``type_name`` is already registered.
    """
    if type_name in _REGISTRY:
        raise ValueError(f"secondary tier type {type_name!r} is already registered")
    _REGISTRY[type_name] = factory


def registered_secondary_tiers() -> list[str]:
    """The registered tier type names, sorted."""
    return sorted(_REGISTRY)


def _resolve(path: str) -> Any:
    module_name, _, attr = path.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def resolve_tier_factory(tier_cfg: dict[str, Any]) -> TierFactory:
    """The factory for one ``secondary_tiers`` entry (checks ``type`` and ``module_path``).

    Raises:
        ConfigError: ``type`` missing or empty, or unknown without ``module_path``.
        ModuleNotFoundError: ``module_path`` does not import.
        TypeError: the class named ``type`` in ``module_path`` is not a :class:`SecondaryTier`.
    """
    if not isinstance(tier_cfg, dict):
        raise ConfigError(f"each secondary tier must be a dict, got {tier_cfg!r}")
    kind = tier_cfg.get("type")
    if not kind or not isinstance(kind, str):
        raise ConfigError(f"secondary tier config must include 'type': {tier_cfg!r}")
    module_path = tier_cfg.get("module_path")
    if module_path:
        cls = getattr(importlib.import_module(module_path), kind, None)
        if not (inspect.isclass(cls) and issubclass(cls, SecondaryTier)):
            raise TypeError(f"{module_path}.{kind} is not a SecondaryTier subclass: {cls!r}")
        return lambda ctx, **kw: cls(ctx.host, **kw)
    entry = _REGISTRY.get(kind)
    if entry is None:
        types = [t for t in registered_secondary_tiers() if t not in _ALIASES]
        aliases = ", ".join(f"{alias} = {name}" for alias, name in _ALIASES.items())
        raise ConfigError(
            f"Unknown secondary tier type {kind!r}; known: {', '.join(types)} (vLLM's names "
            f"{aliases} are accepted too), or a class name with 'module_path'"
        )
    return _resolve(entry) if isinstance(entry, str) else entry


# Checks of a type's keys that need no I/O, run when a CascadeConfig is built.
_CHECKS: dict[str, str] = {
    "fs": "kvcascade.tiers.fs:check_fs_tier_config",
    "s3": "kvcascade.tiers._s3_config:s3_tier_options",
    "obj": "kvcascade.tiers._s3_config:s3_tier_options",
    "valkey": "kvcascade.tiers._valkey_config:valkey_tier_options",
}


def check_tier_config(tier_cfg: dict[str, Any], block_bytes: int) -> None:
    """Refuse a ``secondary_tiers`` entry that could not build a tier, without building it:
    unknown type, keys its factory does not take, missing required keys, and for the built-in
    types the keys' values.

    Raises:
        ConfigError: see :func:`resolve_tier_factory`, :func:`tier_name` and the type's
            checker (e.g.
            :func:`kvcascade.tiers.fs.check_fs_tier_config`,
            :func:`kvcascade.tiers._s3_config.s3_tier_options`,
            :func:`kvcascade.tiers._valkey_config.valkey_tier_options`).
    """
    _, kwargs = _factory_and_kwargs(tier_cfg, None)
    check = _CHECKS.get(tier_cfg["type"]) if not tier_cfg.get("module_path") else None
    if check is not None:
        _resolve(check)(kwargs, block_bytes)


def create_secondary_tier(tier_cfg: dict[str, Any], ctx: TierContext) -> SecondaryTier:
    """Build one tier: its config without ``type``/``module_path`` becomes keyword arguments;
    ``name`` defaults to the type (:func:`tier_name`).

    Raises:
        ConfigError: see :func:`resolve_tier_factory` and :func:`tier_name`, or a bad tier
            key.
    """
    factory, kwargs = _factory_and_kwargs(tier_cfg, ctx)
    return factory(ctx, **kwargs)


def _factory_and_kwargs(
    tier_cfg: dict[str, Any], ctx: TierContext | None
) -> tuple[TierFactory, dict[str, Any]]:
    """The entry's factory and keyword arguments (``name``: :func:`tier_name`), checked to
    bind to the factory's signature.

    Raises:
        ConfigError: see :func:`resolve_tier_factory` and :func:`tier_name`, or a key the
            factory does not take.
    """
    factory = resolve_tier_factory(tier_cfg)
    kwargs = {k: v for k, v in tier_cfg.items() if k not in ("type", "module_path")}
    kwargs["name"] = tier_name(tier_cfg)
    try:
        inspect.signature(factory).bind(ctx, **kwargs)
    except TypeError as exc:
        raise ConfigError(f"secondary tier {tier_cfg['type']!r}: {exc}") from exc
    return factory, kwargs
