"""CascadeConfig refuses at construction what would fail only at open_cascade, or never
(issue #21 item 8)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

import kvcascade as kc
from kvcascade.tiers._file_mapper import FileMapper, default_identity
from kvcascade.tiers.fs import fs_tier_from_config
from kvcascade.tiers.s3 import s3_tier_from_config
from kvcascade.tiers.valkey import valkey_tier_from_config


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"eviction_policy": None}, "eviction_policy must be a string, got NoneType"),
        ({"eviction_policy": "mru"}, "Unknown cache policy"),
        ({"cache_policy_module_path": 5}, "cache_policy_module_path must be a module name"),
        (
            {"eviction_policy": "Nope", "cache_policy_module_path": "kvcascade.policies.lru"},
            "module 'kvcascade.policies.lru' has no class 'Nope'",
        ),
        ({"secondary_tiers": [{"type": "fs"}]}, "fs tier needs 'root_dir'"),
        (
            {"secondary_tiers": [{"type": "fs", "root_dir": 5}]},
            "fs tier root_dir must be a non-empty directory path without NUL, got 5",
        ),
        (
            {"secondary_tiers": [{"type": "fs", "root_dir": ""}]},
            "fs tier root_dir must be a non-empty directory path without NUL, got ''",
        ),
        (
            {"secondary_tiers": [{"type": "fs", "root_dir": "/tmp/a\0b"}]},
            "without NUL, got '/tmp/a\\x00b'",
        ),
        ({"secondary_tiers": [{"type": "fs", "root_dir": "R", "io_threads": 0}]}, "got 0"),
        ({"secondary_tiers": [{"type": "fs", "root_dir": "R", "max_bytes": -5}]}, "got -5"),
        ({"secondary_tiers": [{"type": "fs", "root_dir": "R", "bogus": 1}]}, "['bogus']"),
        ({"secondary_tiers": [{"type": "memory", "bogus": 1}]}, "bogus"),
    ],
)
def test_bad_values_fail_at_construction(overrides: dict, message: str, tmp_path: Path) -> None:
    for tier in overrides.get("secondary_tiers", []):
        if tier.get("root_dir") == "R":
            tier["root_dir"] = str(tmp_path / "kv")
    with pytest.raises(kc.ConfigError) as err:
        kc.CascadeConfig(cpu_blocks=4, **overrides)
    assert message in str(err.value)
    assert not (tmp_path / "kv").exists()  # refused before touching the disk


async def test_cache_policy_module_path_names_the_primary_tier_policy() -> None:
    """vLLM's ``cache_policy_module_path`` (docs/vllm.md): an unregistered class name in that
    module. The key was accepted and dropped: the config then refused the class name as an
    unknown policy, and the connector, whose own check had passed, failed to start."""
    from kvcascade.policies.lru import LRUCachePolicy

    extra = {
        "eviction_policy": "LRUCachePolicy",
        "cache_policy_module_path": "kvcascade.policies.lru",
    }
    config = kc.CascadeConfig.from_extra_config({"cpu_blocks": 4, "block_bytes": 64, **extra})
    assert (config.eviction_policy, config.cache_policy_module_path) == tuple(extra.values())
    async with kc.open_cascade(config) as cascade:
        assert type(cascade.primary.policy) is LRUCachePolicy


def test_a_primary_tier_of_no_slots_is_refused() -> None:
    """Every store would be dropped and no tier behind it ever written (a user trial's find)."""
    with pytest.raises(kc.ConfigError, match="cpu_blocks must be > 0, got 0"):
        kc.CascadeConfig(cpu_blocks=0)


def test_a_device_kv_cache_beyond_a_64_bit_size_is_refused() -> None:
    """torch's own refusal was a TypeError traceback (Overflow when unpacking long long)."""
    with pytest.raises(kc.ConfigError) as err:
        kc.CascadeConfig(cpu_blocks=4, gpu_blocks=1 << 61, block_bytes=4)
    assert str(err.value) == (
        f"gpu_blocks={1 << 61} × block_bytes=4 = {1 << 63:,} B of device KV cache is beyond "
        "any device (2**63 B); lower gpu_blocks or block_bytes"
    )
    kc.CascadeConfig(cpu_blocks=4, gpu_blocks=(1 << 61) - 1, block_bytes=4)  # torch's limit


def test_two_fs_tiers_on_one_directory_are_refused(tmp_path: Path) -> None:
    """The bounded one would evict the other's files."""
    tiers = [
        {"type": "fs", "root_dir": str(tmp_path)},
        {"type": "fs", "root_dir": f"{tmp_path}/./", "name": "bounded", "max_bytes": 1 << 20},
    ]
    with pytest.raises(kc.ConfigError, match="'fs' and 'bounded' share root_dir"):
        kc.CascadeConfig(cpu_blocks=4, secondary_tiers=tiers, model_name="m")
    tiers[1]["root_dir"] = str(tmp_path / "other")
    kc.CascadeConfig(cpu_blocks=4, secondary_tiers=tiers, model_name="m")  # two directories


def test_an_fs_root_dir_under_the_home_directory_is_expanded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``~/kv`` beside ``$HOME/kv`` is one directory (the tier expands a leading ``~``:
    tests/tiers/test_fs_tier.py)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    tiers = [
        {"type": "fs", "root_dir": "~/kv"},
        {"type": "fs", "root_dir": str(tmp_path / "kv"), "name": "bounded", "max_bytes": 1 << 20},
    ]
    with pytest.raises(kc.ConfigError, match="'fs' and 'bounded' share root_dir"):
        kc.CascadeConfig(cpu_blocks=4, secondary_tiers=tiers, model_name="m")


@pytest.mark.parametrize(
    "tier",
    [
        {"type": "fs", "root_dir": "R"},
        {"type": "s3", "bucket": "kv-bucket", "name": "objects"},
        {"type": "valkey", "url": "redis://127.0.0.1:1"},
        {"type": "MemoryTier", "module_path": "kvcascade.tiers.memory", "name": "plugin"},
    ],
)
def test_a_persistent_tier_without_model_name_is_refused(tier: dict, tmp_path: Path) -> None:
    """Two embedders of equal geometry on one directory, bucket or server would share a
    namespace without a model name, and read each other's KV: refused, naming the key and the
    tier, before the disk is touched; with model_name the same entry is accepted. An
    out-of-tree tier may keep its blocks anywhere: it needs one too."""
    if tier.get("root_dir") == "R":
        tier["root_dir"] = str(tmp_path / "kv")
    name = tier.get("name", tier["type"])
    with pytest.raises(kc.ConfigError) as err:
        kc.CascadeConfig(cpu_blocks=4, secondary_tiers=[{"type": "memory"}, tier])
    assert str(err.value).startswith(f"model_name is required with secondary tier {name!r}")
    with pytest.raises(kc.ConfigError, match="model_name is required"):
        kc.CascadeConfig.from_extra_config({"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [tier]})
    assert not (tmp_path / "kv").exists()
    config = kc.CascadeConfig(cpu_blocks=4, secondary_tiers=[tier], model_name="org/model")
    assert config.model_name == "org/model"


def test_cpu_and_memory_only_configs_need_no_model_name() -> None:
    """Blocks that die with the process need no namespace (vLLM's ``example`` is ``memory``)."""
    assert kc.CascadeConfig(cpu_blocks=4).model_name is None
    for kind in ("memory", "example"):
        assert kc.CascadeConfig(cpu_blocks=4, secondary_tiers=[{"type": kind}]).model_name is None
    with pytest.raises(kc.ConfigError, match="model_name must be a non-empty string, got ''"):
        kc.CascadeConfig(cpu_blocks=4, model_name="")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("m" * 240, "model_name is 240 bytes in UTF-8, more than 200"),
        ("é" * 101, "model_name is 202 bytes in UTF-8, more than 200"),
        ("org/mod\0el", "model_name 'org/mod\\x00el' holds a NUL character"),
        ("org/\udc80", "is not valid Unicode text"),
    ],
)
def test_a_model_name_that_cannot_name_a_directory_is_refused(
    name: str, message: str, tmp_path: Path
) -> None:
    """Found by a break-it run: a 240-character name failed the open with a bare ``OSError: File
    name too long`` after writing ``config.json`` (a namespace ``inspect`` listed with no block
    directory), and a NUL with a bare ``ValueError`` after creating ``root_dir``."""
    tier = {"type": "fs", "root_dir": str(tmp_path / "kv")}
    with pytest.raises(kc.ConfigError, match=re.escape(message)):
        kc.CascadeConfig(cpu_blocks=4, secondary_tiers=[tier], model_name=name)
    assert not (tmp_path / "kv").exists()
    assert kc.CascadeConfig(cpu_blocks=4, secondary_tiers=[tier], model_name="é" * 100)


@pytest.mark.parametrize(
    ("tiers", "message"),
    [
        (
            [{"type": "memory"}, {"type": "memory"}],
            "secondary tier name 'memory' is used twice; give each tier its own 'name'",
        ),
        (
            [{"type": "memory", "name": "cpu"}],
            "secondary tier name 'cpu' is reserved (the GPU and CPU tiers' names)",
        ),
    ],
)
def test_a_tier_name_used_twice_or_reserved_is_refused(tiers: list, message: str) -> None:
    with pytest.raises(kc.ConfigError) as err:
        kc.CascadeConfig(cpu_blocks=4, secondary_tiers=tiers)
    assert str(err.value) == message


@pytest.mark.parametrize("kind", ["s3", "valkey", "fs", "memory"])
@pytest.mark.parametrize("name", ["", None, 5])
def test_a_tier_name_that_is_not_a_non_empty_string_is_refused(
    kind: str, name: object, tmp_path: Path
) -> None:
    """The uniqueness check read ``tier.get("name", type)`` and the s3 and valkey factories
    ``cfg.get("name") or type``: ``"name": ""`` beside a default-named tier of the same type
    passed, and two tiers were named ``s3`` (found by a break-it run). One rule now
    (``kvcascade.tiers.registry.tier_name``): the check, every factory and the replay read
    it, and a name that is not a non-empty string is refused, naming it, before anything
    exists."""
    keys = {
        "s3": {"bucket": "kvb"},
        "valkey": {"url": "redis://127.0.0.1:1"},
        "fs": {"root_dir": str(tmp_path / "a")},
        "memory": {},
    }[kind]
    first = {"type": "fs", "root_dir": str(tmp_path / "fs"), "name": "first"}
    tiers = [first, {"type": kind, **keys}]
    with pytest.raises(kc.ConfigError) as err:
        kc.CascadeConfig(
            cpu_blocks=4, model_name="m", secondary_tiers=[*tiers, {**tiers[1], "name": name}]
        )
    assert (
        str(err.value) == f"secondary tier {kind!r} name must be a non-empty string, got {name!r}"
    )
    assert not (tmp_path / "fs").exists() and not (tmp_path / "a").exists()
    if kind != "memory":  # the factories called directly read the same rule
        factory = {
            "s3": s3_tier_from_config,
            "valkey": valkey_tier_from_config,
            "fs": fs_tier_from_config,
        }[kind]
        host = kc.HostBuffer(1, 64)
        with pytest.raises(kc.ConfigError) as err:
            factory(host, FileMapper(default_identity("m")), {**keys, "name": name})
        host.close()
        assert str(err.value) == f"{kind} tier name must be a non-empty string, got {name!r}"
        assert not (tmp_path / "a").exists()


def test_an_unsupported_spec_name_is_refused_as_the_connector_refuses_it() -> None:
    """``kvcascade replay --config '{"spec_name": "Foo"}'`` ran, and the same extra config
    failed at vLLM's engine start (user trial)."""
    with pytest.raises(kc.ConfigError) as err:
        kc.CascadeConfig.from_extra_config({"spec_name": "TieringSpec", "cpu_blocks": 4})
    assert str(err.value) == (
        "Unsupported spec type 'TieringSpec'; kvcascade accepts "
        "('CPUOffloadingSpec', 'TieringOffloadingSpec')"
    )
    config = kc.CascadeConfig.from_extra_config({"spec_name": "CPUOffloadingSpec", "cpu_blocks": 4})
    assert config.cpu_blocks == 4


@pytest.mark.parametrize(
    ("threshold", "message"),
    [
        ("abc", "store_threshold must be an integer, got 'abc'"),
        (None, "store_threshold must be an integer, got None"),
        (2.5, "store_threshold must be an integer, got 2.5"),
        (2, "store_threshold=2: the reuse filter is not supported"),
    ],
)
def test_store_threshold_is_checked_before_it_is_read(threshold: object, message: str) -> None:
    """The connector cast ``store_threshold`` with ``int()`` before checking it: 'abc' failed
    the engine start with a bare ValueError naming no key, and 2.5 was read as 2 (found by a
    break-it run); it now runs these checks first (``check_vllm_keys``)."""
    with pytest.raises(kc.ConfigError, match=re.escape(message)):
        kc.CascadeConfig.from_extra_config({"cpu_blocks": 4, "store_threshold": threshold})


@pytest.mark.parametrize(
    "value", [math.nan, math.inf, -math.inf, 10**400, 0], ids=["nan", "inf", "-inf", "10**400", "0"]
)
def test_pending_write_timeout_must_be_finite_and_positive(value: object) -> None:
    """``pending_write_timeout_s=nan`` was accepted (an ``is_number`` check) and no write ever
    expired (``start < now - nan`` is false); ``10**400`` would have raised a bare
    ``OverflowError`` at the first expiry pass (found by a break-it run). ``inf`` means no
    deadline, which is spelt ``null``: refused too."""
    with pytest.raises(kc.ConfigError) as err:
        kc.CascadeConfig(cpu_blocks=4, pending_write_timeout_s=value)
    assert str(err.value) == (
        "pending_write_timeout_s (seconds; null: no deadline) must be a finite number > 0, "
        f"got {value!r:.40}"
    )
    for good in (None, 0.5, 120):
        assert kc.CascadeConfig(cpu_blocks=4, pending_write_timeout_s=good)


_SECONDS_KEYS = (
    [("fs", {"root_dir": "R"}, key) for key in ("io_timeout_s", "probe_timeout_s")]
    + [
        ("s3", {"bucket": "kvb"}, key)
        for key in (
            "connect_timeout_s",
            "read_timeout_s",
            "io_timeout_s",
            "probe_timeout_s",
            "orphan_upload_age_s",
        )
    ]
    + [
        ("valkey", {"url": "redis://127.0.0.1:1"}, key)
        for key in ("connect_timeout_s", "timeout_s", "io_timeout_s", "probe_timeout_s")
    ]
)


@pytest.mark.parametrize("value", [math.nan, math.inf, 10**400], ids=["nan", "inf", "10**400"])
@pytest.mark.parametrize(("kind", "keys", "key"), _SECONDS_KEYS)
def test_every_seconds_key_of_a_tier_must_be_finite(
    kind: str, keys: dict, key: str, value: object, tmp_path: Path
) -> None:
    """The tiers' seconds keys passed ``inf`` (an ``is_number`` check: a deadline that never
    comes) and ``10**400`` (then a bare ``OverflowError`` from ``float()``, not a
    ConfigError); NaN only by luck of a ``> 0`` test. Each is now a ConfigError naming the
    key and the value, before an fs tier listed first has created its directory."""
    keys = {k: str(tmp_path / "kv") if v == "R" else v for k, v in keys.items()}
    first = {"type": "fs", "root_dir": str(tmp_path / "fs"), "name": "first"}
    with pytest.raises(kc.ConfigError) as err:
        kc.CascadeConfig(
            cpu_blocks=4,
            model_name="m",
            secondary_tiers=[first, {"type": kind, **keys, key: value}],
        )
    bound = ">= 0" if key == "orphan_upload_age_s" else "> 0"
    assert str(err.value) == (
        f"{kind} tier {key} must be a finite number {bound}, got {value!r:.40}"
    )
    assert not (tmp_path / "fs").exists() and not (tmp_path / "kv").exists()
    kc.CascadeConfig(
        cpu_blocks=4, model_name="m", secondary_tiers=[{"type": kind, **keys, key: 0.25}]
    )
