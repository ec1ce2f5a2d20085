"""``kvcascade/_atomic.py``: the one temp-file + ``os.replace`` helper, and the int/bool guards
of ``kvcascade/_validate.py``."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

import kvcascade as kc
from kvcascade._atomic import replace_file
from kvcascade._validate import check_int, config_int, config_seconds, is_int, is_number


def test_replace_file_writes_0600_and_replaces(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    target.write_text("old")
    replace_file(target, b"new", fsync=True)
    assert target.read_bytes() == b"new"
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600
    assert os.listdir(tmp_path) == ["state.json"]


def test_replace_file_failure_leaves_no_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "a_directory"
    target.mkdir()
    with pytest.raises(IsADirectoryError):
        replace_file(target, b"x")
    assert os.listdir(tmp_path) == ["a_directory"]


@pytest.mark.parametrize(("value", "ok"), [(1, True), (0, True), (True, False), (1.0, False)])
def test_is_int_refuses_bools(value: object, ok: bool) -> None:
    assert is_int(value) is ok
    assert is_number(value) is (ok or (value == 1.0 and not isinstance(value, bool)))


def test_config_guards_name_the_bad_value() -> None:
    assert config_int({"io_threads": 3}, "io_threads", 4, "fs tier") == 3
    assert config_int({}, "io_threads", 4, "fs tier") == 4
    with pytest.raises(kc.ConfigError, match=r"fs tier io_threads must be an int >= 1, got True"):
        config_int({"io_threads": True}, "io_threads", 4, "fs tier")
    assert config_seconds({"t": 2}, "t", 1.0, "s3 tier") == 2.0
    with pytest.raises(kc.ConfigError, match="s3 tier t must be a finite number > 0, got 0"):
        config_seconds({"t": 0}, "t", 1.0, "s3 tier")
    with pytest.raises(kc.ConfigError, match="num_blocks must be an int >= 0, got -1"):
        check_int("num_blocks", -1, 0)
