"""Configuration: vLLM's ``kv_connector_extra_config`` keys plus kvcascade's own.

vLLM's keys: its ``docs/features/kv_offloading_usage.md``; kvcascade's: docs/vllm.md.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from ._errors import ConfigError
from ._validate import check_number, is_int
from .tiers._file_mapper import check_model_name
from .tiers.cpu import PAGE_SIZE, round_up

# vLLM OffloadingConnector keys accepted for compatibility (docs/vllm.md) and kvcascade's own keys.
_VLLM_KEYS = {
    "spec_name",
    "spec_module_path",
    "cpu_bytes_to_use",
    "block_size",
    "blocks_per_chunk",
    "eviction_policy",
    "cache_policy_module_path",
    "store_threshold",
    "max_tracker_size",
    "offload_prompt_only",
    "self_describing_kv_events",
    "canonical_layout",
    "secondary_tiers",
}
_OWN_KEYS = {
    "cpu_blocks",
    "gpu_blocks",
    "block_bytes",
    "model_name",
    "cache_salt",
    "enable_events",
    "pending_write_timeout_s",
}
KNOWN_KEYS = frozenset(_VLLM_KEYS | _OWN_KEYS)


def _positive_int(name: str, value: Any) -> int:
    if not is_int(value):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value <= 0:
        raise ConfigError(f"{name} must be > 0, got {value}")
    return value


_SECRET_KEYS = frozenset({"access_key", "secret_key", "session_token", "password"})


def redact(tier: dict[str, Any]) -> dict[str, Any]:
    """A copy of a tier entry with credentials replaced by ``"***"`` (for logs and reports)."""
    return {k: "***" if k in _SECRET_KEYS and v else v for k, v in tier.items()}


#: The ``spec_name`` values kvcascade implements (vLLM's offloading specs).
OFFLOADING_SPECS = ("CPUOffloadingSpec", "TieringOffloadingSpec")


def spec_name_of(extra: dict[str, Any]) -> str:
    """The ``spec_name`` of a ``kv_connector_extra_config`` (vLLM's default
    ``CPUOffloadingSpec``).

    Raises:
        ConfigError: another value (vLLM's message), so that ``kvcascade replay --config``
            refuses what the connector refuses.
    """
    spec_name = extra.get("spec_name", OFFLOADING_SPECS[0])
    if spec_name not in OFFLOADING_SPECS:
        raise ConfigError(
            f"Unsupported spec type {spec_name!r}; kvcascade accepts {OFFLOADING_SPECS}"
        )
    return spec_name


def check_vllm_keys(extra: dict[str, Any]) -> None:
    """The validation vLLM applies to its keys that kvcascade accepts (vLLM's
    ``build_offloading_config``)."""
    spec_name_of(extra)
    if "block_size" in extra and "blocks_per_chunk" in extra:
        raise ConfigError("Specify only one of block_size and blocks_per_chunk")
    for key in ("blocks_per_chunk", "block_size"):
        if key in extra:
            value = extra[key]
            if not is_int(value) or value <= 0:
                raise ConfigError(f"{key} must be an integer greater than 0, got {value!r}")
    threshold = extra.get("store_threshold", 0)
    if not is_int(threshold):
        raise ConfigError(f"store_threshold must be an integer, got {threshold!r}")
    if threshold >= 2:
        raise ConfigError(
            f"store_threshold={threshold}: the reuse filter is not supported with tiering "
            "(as vLLM's TieringOffloadingSpec); use 0"
        )
    for key in ("offload_prompt_only", "self_describing_kv_events", "canonical_layout"):
        if key in extra and not isinstance(extra[key], bool):
            raise ConfigError(f"{key} must be true or false, got {extra[key]!r}")


@dataclass(repr=False)
class CascadeConfig:
    """Everything :func:`kvcascade.open_cascade` needs.

    Attributes:
        block_bytes: KV bytes of one block (chunk) across all workers, ``> 0``.
        gpu_blocks: blocks in the device KV cache.
        cpu_blocks: primary-tier slots; derived from ``cpu_bytes_to_use`` when None
            (``cpu_bytes_to_use // round_up(block_bytes, PAGE_SIZE)``, vLLM's
            ``kv_offload/cpu/spec.py``).
        cpu_bytes_to_use: primary-tier budget in bytes (vLLM's key).
        eviction_policy: primary-tier policy name or ``"module:Class"`` (default
            ``"adaptive"``: turn-aware while a miniature simulation says it beats LRU, else LRU;
            docs/policies.md; ``"lru"`` is vLLM's default).
        cache_policy_module_path: module to import an unregistered ``eviction_policy`` class
            name from (vLLM's key; :func:`kvcascade.policies.resolve_cache_policy`).
        secondary_tiers: list of tier dicts, each with ``type`` (``fs``, ``memory``, ``s3``,
            ``valkey`` — vLLM's ``example`` and ``obj`` are aliases of ``memory`` and ``s3`` —,
            a registered type, or a class name with ``module_path``) and that tier's keys, in
            cascade order; ``name`` (default: the type) must be a non-empty string and unique.
        model_name: the model's id (e.g. ``"meta-llama/Llama-3.1-8B"``), the first field of the
            namespace of the persistent tiers (docs/fs-tier.md, "Namespace"). Required with any
            secondary tier but ``memory`` (fs, s3, valkey, out-of-tree types: their blocks outlive
            the process or are shared between processes), so that two models of equal geometry
            on one directory, bucket or server never read each other's KV; None (the default)
            is allowed only without such a tier. The vLLM connector passes the served model.
            At most 200 bytes in UTF-8, no NUL (it names a directory:
            :func:`~kvcascade.tiers._file_mapper.check_model_name`).
        cache_salt: tenant salt folded into that namespace.
        enable_events: queue KV events for ``take_events``.
        pending_write_timeout_s: seconds after which a primary write still in flight is failed
            and its key becomes a miss, a finite number ``> 0`` (None: never; vLLM has no such
            deadline, #49829).

    Raises:
        ConfigError: at construction, a value outside its attribute's rule (NaN or an
            infinity for ``pending_write_timeout_s`` too), naming it; a tier entry's:
            :func:`kvcascade.tiers.registry.check_tier_config`.
    """

    block_bytes: int = 4096
    gpu_blocks: int = 1024
    cpu_blocks: int | None = None
    cpu_bytes_to_use: int | None = None
    eviction_policy: str = "adaptive"
    cache_policy_module_path: str | None = None
    secondary_tiers: list[dict[str, Any]] = field(default_factory=list, repr=False)
    model_name: str | None = None
    cache_salt: str | None = None
    enable_events: bool = True
    pending_write_timeout_s: float | None = 120.0

    def __post_init__(self) -> None:
        _positive_int("block_bytes", self.block_bytes)
        _positive_int("gpu_blocks", self.gpu_blocks)
        device_bytes = self.gpu_blocks * self.block_bytes
        if device_bytes >= 1 << 63:  # torch cannot even express the size of the tensor
            raise ConfigError(
                f"gpu_blocks={self.gpu_blocks} × block_bytes={self.block_bytes} = "
                f"{device_bytes:,} B of device KV cache is beyond any device (2**63 B); "
                "lower gpu_blocks or block_bytes"
            )
        if self.cpu_blocks is not None:
            _positive_int("cpu_blocks", self.cpu_blocks)  # 0 slots would drop every store
        if self.cpu_bytes_to_use is not None:
            _positive_int("cpu_bytes_to_use", self.cpu_bytes_to_use)
        if self.cpu_blocks is None and self.cpu_bytes_to_use is None:
            raise ConfigError(
                "cpu_bytes_to_use must be specified (bytes of CPU DRAM for the primary tier), "
                "or cpu_blocks"
            )
        if not isinstance(self.enable_events, bool):
            raise ConfigError(f"enable_events must be true or false, got {self.enable_events!r}")
        if self.model_name is not None:
            check_model_name(self.model_name)
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise ConfigError(f"cache_salt must be a string, got {self.cache_salt!r}")
        row = round_up(self.block_bytes, PAGE_SIZE)
        if (
            self.cpu_blocks is None
            and self.cpu_bytes_to_use is not None
            and (self.cpu_bytes_to_use < row)
        ):
            raise ConfigError(
                f"cpu_bytes_to_use={self.cpu_bytes_to_use} B is smaller than one primary block "
                f"({row} B for {self.block_bytes} B of KV); give at least {row}"
            )
        if self.pending_write_timeout_s is not None:  # NaN never expired a write
            check_number(
                "pending_write_timeout_s (seconds; null: no deadline)",
                self.pending_write_timeout_s,
                0,
                above=True,
            )
        if not isinstance(self.secondary_tiers, list):
            raise ConfigError(f"secondary_tiers must be a list, got {self.secondary_tiers!r}")
        from .policies.registry import resolve_cache_policy
        from .tiers.registry import check_tier_config, is_process_local, tier_name

        module_path = self.cache_policy_module_path
        if module_path is not None and not (isinstance(module_path, str) and module_path):
            raise ConfigError(
                f"cache_policy_module_path must be a module name or null, got {module_path!r}"
            )
        resolve_cache_policy(self.eviction_policy, module_path)
        names = set()
        roots: dict[str, str] = {}
        for tier in self.secondary_tiers:
            check_tier_config(tier, self.block_bytes)
            name = tier_name(tier)
            if name in ("gpu", "cpu"):
                raise ConfigError(
                    f"secondary tier name {name!r} is reserved (the GPU and CPU tiers' names)"
                )
            if name in names:
                raise ConfigError(
                    f"secondary tier name {name!r} is used twice; give each tier its own 'name'"
                )
            names.add(name)
            if tier["type"] == "fs":
                root = os.path.realpath(os.path.expanduser(tier["root_dir"]))
                if root in roots:
                    raise ConfigError(
                        f"fs tiers {roots[root]!r} and {name!r} share root_dir {root!r}: one "
                        "would evict or delete the other's files; give each its own directory"
                    )
                roots[root] = name
        persistent = [t for t in self.secondary_tiers if not is_process_local(t)]
        if self.model_name is None and persistent:
            tier = persistent[0]
            raise ConfigError(
                f"model_name is required with secondary tier {tier_name(tier)!r} "
                f"(type {tier['type']!r}): its blocks outlive this process or are shared, and "
                "engines of equal geometry but different models would read each other's KV; "
                "set model_name to the model's id (e.g. 'meta-llama/Llama-3.1-8B')"
            )

    def __repr__(self) -> str:
        fields = ", ".join(
            f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self) if f.repr
        )
        tiers = [redact(t) for t in self.secondary_tiers]
        return f"CascadeConfig({fields}, secondary_tiers={tiers!r})"

    @property
    def num_cpu_blocks(self) -> int:
        """Primary-tier slots (vLLM ``kv_offload/cpu/spec.py`` sizing when derived from
        ``cpu_bytes_to_use``)."""
        if self.cpu_blocks is not None:
            return self.cpu_blocks
        assert self.cpu_bytes_to_use is not None
        return self.cpu_bytes_to_use // round_up(self.block_bytes, PAGE_SIZE)

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any], **overrides: Any) -> CascadeConfig:
        """Build from a ``kv_connector_extra_config``-style dict; ``overrides`` win.

        vLLM keys with no meaning outside a vLLM engine (``spec_name``, ``block_size``, …) are
        accepted and ignored here, once their values pass vLLM's checks (``check_vllm_keys``).

        Raises:
            ConfigError: an unknown key (the message lists the known ones) or a bad value.
        """
        if not isinstance(extra, dict):
            raise ConfigError(f"config must be a JSON object, got {type(extra).__name__}")
        unknown = sorted(set(extra) - KNOWN_KEYS)
        if unknown:
            raise ConfigError(f"unknown config keys {unknown}; known: {sorted(KNOWN_KEYS)}")
        check_vllm_keys(extra)
        values = {k: copy.deepcopy(v) for k, v in extra.items() if k in _OWN_KEYS}
        for key in (
            "cpu_bytes_to_use",
            "eviction_policy",
            "cache_policy_module_path",
            "secondary_tiers",
        ):
            if key in extra:
                values[key] = copy.deepcopy(extra[key])
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)
