"""The vLLM examples run and print what they promise (from the vLLM virtualenv; ``.ci/run``).

``examples/vllm_router.py --tiny`` starts two real ``vllm serve`` processes sharing one fs tier
and routes over their KV-event streams (a few minutes on 2 cores).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm", reason="vLLM is not installed in this environment")
    import kvcascade

ROOT = Path(kvcascade.__file__).resolve().parents[1]


def test_router_sends_each_turn_to_the_instance_holding_its_prefix() -> None:
    """Two users' turns go to A and B; each second turn finds its 8 blocks in its instance's CPU
    tier (256 cached tokens); with A stopped, alice's third turn goes to B, which loads her 10
    blocks from the shared fs tier (320 cached tokens, as the router predicted from A's events).
    """
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "vllm_router.py"), "--tiny"],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert lines[1:6] == [
        "alice turn 1: -> A, miss; cached prompt tokens 0",
        "bob turn 1: -> B, miss; cached prompt tokens 0",
        "alice turn 2: -> A, 8 blocks held (CPU); cached prompt tokens 256",
        "bob turn 2: -> B, 8 blocks held (CPU); cached prompt tokens 256",
        "instance A stopped (exit code 0)",
    ]
    assert lines[6:9] == [
        "alice turn 3: -> B, 10 blocks held (STORAGE); cached prompt tokens 320",
        "instance A: 2 requests, 256 hit tokens",
        "instance B: 3 requests, 576 hit tokens",
    ]
    assert lines[9].startswith("events received: ")
    assert "BlockStored/CPU" in lines[9] and "BlockStored/STORAGE" in lines[9]
