"""CascadeConfig refuses at construction what would fail only at open_cascade, or never
(issue #21 item 8)."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvcascade as kc


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"eviction_policy": None}, "eviction_policy must be a string, got NoneType"),
        ({"eviction_policy": "mru"}, "Unknown cache policy"),
        ({"secondary_tiers": [{"type": "fs"}]}, "fs tier needs 'root_dir'"),
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


def test_two_fs_tiers_on_one_directory_are_refused(tmp_path: Path) -> None:
    """The bounded one would evict the other's files."""
    tiers = [
        {"type": "fs", "root_dir": str(tmp_path)},
        {"type": "fs", "root_dir": f"{tmp_path}/./", "name": "bounded", "max_bytes": 1 << 20},
    ]
    with pytest.raises(kc.ConfigError, match="'fs' and 'bounded' share root_dir"):
        kc.CascadeConfig(cpu_blocks=4, secondary_tiers=tiers)
    tiers[1]["root_dir"] = str(tmp_path / "other")
    kc.CascadeConfig(cpu_blocks=4, secondary_tiers=tiers)  # two directories: fine
