"""The ratio rows every benchmark writes (``benchmarks/_rows.py``), ``benchmarks/run_all.py``'s
table over them, and a real benchmark subprocess writing them (``policy_cost.py --json``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))

import run_all
from _rows import Row, write_rows

BENCH = Path(run_all.__file__).resolve().parent


def test_row_ratio_and_goal() -> None:
    row = Row.of("store 1M kvcascade/vLLM", 3.0, 2.0, ">= 1.0", "GB/s")
    assert (row.ratio, row.met) == (1.5, True)
    assert Row.of("x", 1.0, 4.0, ">= 1.0", "GB/s").met is False
    assert Row.of("x", 1.0, 4.0, "<= 0.5", "us/key").met is True
    # no baseline: the goal applies to the measured value itself
    margin = Row.of("margin", -0.001, None, ">= -0.002", "hit ratio")
    assert (margin.ratio, margin.met) == (None, True)
    assert Row.of("x", 1.0, 2.0, None, "ms").met is None


def test_bad_goal_names_the_goal() -> None:
    with pytest.raises(ValueError, match="'about 1'"):
        Row.of("x", 1.0, 2.0, "about 1", "GB/s")


def test_write_rows_and_table(tmp_path: Path) -> None:
    path = tmp_path / "rows.json"
    write_rows(path, "fs_tier", [Row.of("load 4M kvcascade/vLLM", 1.0, 2.0, ">= 1.0", "GB/s")])
    doc = json.loads(path.read_text())
    assert doc["benchmark"] == "fs_tier"
    assert doc["rows"] == [
        {
            "name": "load 4M kvcascade/vLLM",
            "measured": 1.0,
            "baseline": 2.0,
            "ratio": 0.5,
            "goal": ">= 1.0",
            "met": False,
            "unit": "GB/s",
        }
    ]
    failed = {"benchmark": "s3_tier", "error": "failed: exit status 1", "rows": []}
    lines = run_all.format_table([doc, failed]).splitlines()
    assert lines[0].split() == ["benchmark", "name", "measured", "baseline", "ratio", "goal", "met"]
    row = ["fs_tier", "load", "4M", "kvcascade/vLLM", "1", "GB/s", "2", "0.5", ">=", "1.0", "NO"]
    assert lines[2].split() == row
    assert lines[3].split()[:2] == ["s3_tier", "(failed:"]


def test_a_benchmark_writes_its_rows(tmp_path: Path) -> None:
    out = tmp_path / "policy_cost.json"
    env = dict(os.environ, PYTHONPATH=str(BENCH.parent))
    cmd = [sys.executable, str(BENCH / "policy_cost.py"), "--n", "2000", "--runs", "1"]
    cmd += ["--policies", "lru,arc", "--json", str(out)]
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=300)
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "policy_cost"
    assert [r["name"] for r in doc["rows"]] == [
        "arc capacity 2000 arc/lru",
        "arc capacity 200 arc/lru",
    ]
    for row in doc["rows"]:
        assert row["ratio"] == pytest.approx(row["measured"] / row["baseline"])
        assert row["goal"] == "<= 2.0" and row["unit"] == "us/key"


def test_the_warm_start_benchmark_writes_its_rows(tmp_path: Path) -> None:
    """``policy_warm_start.py`` on a small slice: its two rows per policy and capacity (each
    half warm against cold) agree with the printed table; a policy that keeps no state is a
    usage error (exit 2), not a table of warm figures equal to cold ones."""
    out = tmp_path / "policy_warm_start.json"
    env = dict(os.environ, PYTHONPATH=str(BENCH.parent))
    cmd = [sys.executable, str(BENCH / "policy_warm_start.py"), "--requests", "400"]
    cmd += ["--capacities", "0.05", "--policies", "turn_aware", "--json", str(out)]
    done = subprocess.run(cmd, check=True, env=env, capture_output=True, text=True, timeout=300)
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "policy_warm_start"
    names = [r["name"] for r in doc["rows"]]
    assert names == ["turn_aware 0.05 warm/cold 1st half", "turn_aware 0.05 warm/cold 2nd half"]
    table = {line[:20].strip(): float(line.split()[-1]) for line in done.stdout.splitlines()[2:]}
    for row, half in zip(doc["rows"], ("1st", "2nd")):
        assert row["measured"] == pytest.approx(table[f"warm {half}"], abs=5e-5)
        assert row["baseline"] == pytest.approx(table[f"cold {half}"], abs=5e-5)
        assert row["goal"] == ">= 1.0" and row["unit"] == "hit ratio"
    # the whole cold run's ratio lies between its halves' (cold 1st and its 2nd half)
    low, high = sorted((table["cold 1st"], table["cold, its 2nd half"]))
    assert low - 5e-5 <= table["cold"] <= high + 5e-5
    bad = subprocess.run([*cmd[:2], "--policies", "lru"], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "policy 'lru' keeps no learned state" in bad.stderr


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        ("policy_suite.py", ["--requests", "5"], "--requests must be >= 10, got 5"),
        ("policy_suite.py", ["--capacities", "abc"], "--capacities must be comma-separated"),
        ("policy_suite.py", ["--hints", "oracle:1.5"], "noise must be within [0, 1], got 1.5"),
        ("policy_suite.py", ["--policies", "foo"], "Unknown cache policy 'foo'"),
        ("policy_suite.py", ["--json", "."], "argument --json: '.' is not a file path"),
        ("policy_cost.py", ["--n", "0"], "--n must be >= 10, got 0"),
        ("policy_cost.py", ["--batch", "-1"], "--batch must be >= 1, got -1"),
        ("policy_cost.py", ["--policies", "lru,arc,arc"], "names a policy twice"),
        ("policy_warm_start.py", ["--json", "/nonexistent/x.json"], "is not writable"),
    ],
)
def test_a_benchmark_refuses_bad_arguments_before_it_runs(
    script: str, args: list[str], message: str
) -> None:
    """Usage errors (exit 2, the bad value named), not a traceback — and not after the run: a
    ``--json`` directory failed only at the end; ``--batch -1`` printed a row of no work."""
    env = dict(os.environ, PYTHONPATH=str(BENCH.parent))
    done = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr
    assert done.stdout == ""


def test_quick_leaves_the_options_given_alone() -> None:
    """``--quick`` sets only what is not given (it replaced ``--traces`` and ``--requests``)."""
    env = dict(os.environ, PYTHONPATH=str(BENCH.parent))
    cmd = [sys.executable, str(BENCH / "policy_suite.py"), "--quick", "--traces", "shift"]
    cmd += ["--requests", "40", "--policies", "lru"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=120)
    rows = [line.split("|") for line in done.stdout.splitlines() if line.startswith("|")][2:]
    assert [r[1].strip() for r in rows] == ["shift", ""]
    assert [r[2].strip() for r in rows] == ["5%", "20%"]
    assert done.stdout.splitlines()[0].split("|")[4:6] == [" lru ", " arc "]
