"""``benchmarks/serving.py`` at its tiny size: real vLLM engines (CPU backend, dummy-weight
Llama), one process per configuration, the scaled Mooncake conversation workload.

Run from the vLLM virtualenv (``.ci/run``):
``$VENV/bin/python -m pytest tests/integrations/test_vllm_serving_benchmark.py -q``
(three engine processes, ~2-3 minutes on 2 cores). Figures are not asserted: speed is the
benchmark's to report.
"""

from __future__ import annotations

import json
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
REQUESTS = 8
CONFIGS = ("vllm", "kvc-cpu-fs", "kvc-fs-restart")


def test_every_configuration_serves_the_same_tokens_from_its_tiers(tmp_path: Path) -> None:
    """Every configuration completes every request with greedy outputs equal to vLLM alone's;
    kvcascade serves prompt tokens from its CPU tier, and the restarted engine from the fs tier
    the previous engine left; the ratio rows follow ``benchmarks/_rows.py``."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    rows, details = tmp_path / "rows.json", tmp_path / "details.json"
    # fmt: off
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "serving.py"), "--size", "tiny",
        "--requests", str(REQUESTS), "--configs", ",".join(CONFIGS),
        "--json", str(rows), "--details", str(details), "--fs-dir", str(tmp_path / "fs"),
    ]
    # fmt: on
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    results = json.loads(details.read_text())
    assert sorted(results) == sorted(CONFIGS)
    expected = [len(r["tokens"]) for r in results["vllm"]["requests"]]
    for name, r in results.items():
        assert "error" not in r, (name, r.get("error"))
        assert len(r["requests"]) == REQUESTS, name
        assert [len(q["tokens"]) for q in r["requests"]] == expected, name
        assert r["outputs_equal_vllm"] == REQUESTS, name
    assert results["kvc-cpu-fs"]["tokens_cpu_tier"] > 0
    assert results["kvc-fs-restart"]["tokens_fs_tier"] > 0
    assert results["kvc-fs-restart"]["probe_first_s"] > 0
    assert results["vllm"]["tokens_cpu_tier"] == results["vllm"]["tokens_fs_tier"] == 0

    doc = json.loads(rows.read_text())
    assert doc["benchmark"] == "serving"
    names = {row["name"] for row in doc["rows"]}
    assert "probe 2k TTFT cached from fs tier (restart) / recompute" in names
    for row in doc["rows"]:
        assert set(row) == {"name", "measured", "baseline", "ratio", "goal", "met", "unit"}
        if row["baseline"] is not None:
            assert row["ratio"] == pytest.approx(row["measured"] / row["baseline"])
