"""The suite's guards of tests/conftest.py, run on a small suite of their own in a subprocess."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import conftest

_TESTS = """
import asyncio
import time

import pytest


async def test_blocks_the_loop():
    time.sleep(1.3)  # a blocking call on the event loop


@pytest.mark.blocks_loop
async def test_blocks_the_loop_on_purpose():
    time.sleep(1.3)


async def test_awaits():
    await asyncio.sleep(0.4)  # the loop stays free


async def test_blocks_briefly():
    time.sleep(0.01)


def test_hangs():
    time.sleep(120)


def test_sync_may_block():
    time.sleep(0.4)  # no event loop: nothing to hold
"""


def _outcomes(tmp_path: Path) -> tuple[dict[str, str], str]:
    guard = Path(conftest.__file__).read_text()
    assert "TEST_TIMEOUT_S = 600\n" in guard
    (tmp_path / "conftest.py").write_text(
        guard.replace("TEST_TIMEOUT_S = 600\n", "TEST_TIMEOUT_S = 3\n")
    )
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n"
        "asyncio_debug = true\nmarkers = blocks_loop: on purpose\n"
    )
    (tmp_path / "test_guarded.py").write_text(_TESTS)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "test_guarded.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    outcomes = {}
    for line in proc.stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("PASSED", "FAILED", "ERROR") and rest.startswith("test_guarded.py::"):
            name = rest.removeprefix("test_guarded.py::").split(" ")[0]
            outcomes[name] = outcomes.get(name, word) if word != "ERROR" else "ERROR"
    return outcomes, proc.stdout + proc.stderr


def test_blocking_call_on_the_loop_and_a_hung_test_fail_their_own_test(tmp_path: Path) -> None:
    outcomes, output = _outcomes(tmp_path)
    assert outcomes == {
        "test_blocks_the_loop": "ERROR",
        "test_blocks_the_loop_on_purpose": "PASSED",
        "test_awaits": "PASSED",
        "test_blocks_briefly": "PASSED",
        "test_hangs": "FAILED",
        "test_sync_may_block": "PASSED",
    }, output
    assert f"a callback held the event loop >= {conftest.SLOW_CALLBACK_S} s" in output
    assert "TestTimeout: test ran past 3 s" in output
