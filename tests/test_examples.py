"""The runnable examples run and print what they promise (the vLLM one runs in the vLLM venv
from tests/integrations/test_vllm_e2e.py's environment only, so it is only syntax-checked here)."""

from __future__ import annotations

import asyncio
import collections
import os
import py_compile
import subprocess
import sys
from pathlib import Path

import aiohttp
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
    """Run twice on one directory: the second run finds the first run's blocks (restart hits)
    and verifies them byte-exact, as it does the blocks it loads back from the fs tier."""
    first = run("asyncio_cascade.py", str(tmp_path))
    assert "prefill-1: 0 of 8 blocks cached by an earlier run" in first
    assert first.count("stored 4 blocks") == 2
    assert "prefill-2: prefix hit: blocks 0-3 from ['fs', 'fs', 'fs', 'fs']" in first
    assert "prefill-2: prefix hit: blocks 4-7 from" in first
    assert "loaded 8 of 8 blocks back, byte-exact" in first
    second = run("asyncio_cascade.py", str(tmp_path))
    assert "prefill-1: prefix hit: blocks 0-3 from ['fs', 'fs', 'fs', 'fs']" in second
    assert "prefill-1: 8 of 8 blocks cached by an earlier run" in second
    assert "stored" not in second
    assert "loaded 8 of 8 blocks back, byte-exact" in second


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


async def test_aiohttp_server_example_serves_concurrent_requests(tmp_path: Path) -> None:
    """Issue #21 item 1: examples/aiohttp_server.py, a real server process on 127.0.0.1 whose
    handlers await the cascade on the engine's own KV tensor. Waves of eight concurrent prompts
    of 2 blocks, the first block shared: wave A, four waves of other prompts (41 blocks for 32
    CPU slots: A's own blocks, the least recent, go to the fs tier only), then A again: every
    block found, the shared one in the CPU tier, A's own in the fs tier, each loaded block
    equal to its prefill. Process start and stop run in a thread: they block for seconds."""
    port = valkey_fixtures.free_port()
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    cmd = [sys.executable, str(EXAMPLES / "aiohttp_server.py"), "--port", str(port)]
    proc = await asyncio.to_thread(
        subprocess.Popen,
        [*cmd, "--fs-dir", str(tmp_path)],
        env={**os.environ, "PYTHONPATH": path},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    shared = list(range(16))  # the block every prompt starts with
    waves = [
        [shared + [1000 * (8 * w + i + 1) + t for t in range(16)] for i in range(8)]
        for w in range(5)
    ]
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(600):  # the server imports torch and opens the cascade first
                try:
                    async with session.get(f"{base}/stats") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.2)
            else:
                raise AssertionError("the example server never answered")

            async def one(tokens: list[int]) -> dict:
                async with session.post(f"{base}/generate", json={"tokens": tokens}) as r:
                    assert r.status == 200, await r.text()
                    return await r.json()

            async def wave(prompts: list[list[int]]) -> list[dict]:
                return await asyncio.gather(*(one(p) for p in prompts))

            answers = []
            for prompts in waves:
                results = await wave(prompts)
                assert all(r["blocks"] == 2 and r["verified"] == r["cached"] for r in results)
                answers += results
            again = await wave(waves[0])
            assert [(r["cached"], r["verified"]) for r in again] == [(2, 2)] * 8, again
            assert [r["tiers"] for r in again] == [["cpu", "fs"]] * 8
            answers += again
            async with session.get(f"{base}/stats") as resp:
                stats = await resp.json()
            # /stats adds up what the answers said, and the tiers' series agree with it
            cached = sum(r["cached"] for r in answers)
            loaded = collections.Counter(t for r in answers for t in r["tiers"])
            assert stats["served"] == 48
            assert stats["blocks"]["requested"] == 96 and stats["blocks"]["cached"] == cached
            assert stats["blocks"]["loaded_from_fs"] == loaded["fs"] >= 8
            assert stats["blocks"]["loaded_from_cpu"] == loaded["cpu"] >= 8
            stored = stats["blocks"]["stored"]
            assert 96 - cached >= stored >= 41  # each of the 41 distinct blocks at least once
            assert stats["bytes"] == {"loaded": cached * 4096, "stored": stored * 4096}
            assert set(stats["tiers"]) == {"cpu", "fs"}
            assert stats["tiers"]["fs"]["hits"] >= loaded["fs"]
            assert stats["tiers"]["fs"]["read_bytes"] == loaded["fs"] * 4096
            assert stats["tiers"]["fs"]["write_bytes"] == stored * 4096
            assert stats["failures"] == {}
            async with session.post(f"{base}/generate", json={"tokens": "x"}) as resp:
                assert resp.status == 400
            async with session.post(f"{base}/generate", data=b"{not json") as resp:
                assert resp.status == 400
                assert "body is not JSON" in await resp.text()
            deep = b"[" * 100_000 + b"]" * 100_000  # was a 500: RecursionError in the decoder
            async with session.post(f"{base}/generate", data=deep) as resp:
                assert resp.status == 400
                assert "body is not JSON (maximum recursion depth exceeded" in await resp.text()
            bools = {"tokens": [1, True, False]}  # bools are ints in Python, not token ids
            async with session.post(f"{base}/generate", json=bools) as resp:
                assert resp.status == 400
                assert (await resp.text()).startswith("tokens[1] is true, not a token id")
    finally:
        proc.terminate()
        _, err = await asyncio.to_thread(proc.communicate, None, 60)
    assert proc.returncode == 0, err[-2000:]
    assert list(tmp_path.rglob("*.bin"))  # the fs tier kept the blocks
