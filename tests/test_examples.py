"""The runnable examples run and print what they promise (the vLLM one runs in the vLLM venv
from tests/test_vllm_e2e.py's environment only, so it is only syntax-checked here)."""

from __future__ import annotations

import os
import py_compile
import subprocess
import sys
from pathlib import Path

import valkey_fixtures

server = valkey_fixtures.server  # a redis-server process for the shared-pool example

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


def run(name: str, *args: str) -> str:
    # this checkout's kvcascade, also in the processes an example spawns (not another install)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_asyncio_cascade_example(tmp_path: Path) -> None:
    out = run("asyncio_cascade.py", str(tmp_path))
    assert "prefix hit: blocks 0-3 from ['fs', 'fs', 'fs', 'fs']" in out
    assert "prefix hit: blocks 4-7 from" in out
    assert "loaded 8 of 8 blocks back, byte-exact" in out


def test_scheduler_hooks_example() -> None:
    out = run("scheduler_hooks.py")
    lines = out.splitlines()
    assert lines[0] == "step 0: lookup → RETRY"
    assert "HIT_PENDING" in out and "lookup → HIT" in out
    assert "b'\\x07\\x07\\x07\\x07'" in out


def test_vllm_example_compiles() -> None:
    py_compile.compile(str(EXAMPLES / "vllm_offline.py"), doraise=True)


@valkey_fixtures.needs_server
def test_shared_pool_example(server: valkey_fixtures.Server) -> None:
    out = run("shared_pool.py", server.url, "examples-test")
    assert "engine A: prefilled and stored 8 blocks" in out
    assert "engine B: prefix of 8 blocks from ['valkey']" in out
    assert "engine B: loaded 8 of 8 blocks, byte-exact" in out
