"""Every benchmark of ``benchmarks/`` in one run, and one table of their ratio rows.

Each benchmark runs as a subprocess with ``--json PATH`` (and ``--quick`` with ``--quick``), from
the repository root with this checkout first on ``PYTHONPATH``; its rows
(``benchmarks/_rows.py``) are collected into one table (benchmark, name, measured, baseline,
ratio, goal, met) printed at the end and written to ``DIR/ratios.json`` and ``DIR/ratios.txt``
beside each benchmark's own JSON (``DIR/<benchmark>.json``) and output (``DIR/<benchmark>.log``).

The sides that drive vLLM (``fs_tier``, ``bookkeeping``, ``kvcascade_impl``) run in
``--vllm-python`` when it exists (default ``/tmp/kvcascade-vllm-venv/bin/python`` if present):
there ``fs_tier`` and ``bookkeeping`` add vLLM's side to their own; without it they run here on
kvcascade's sides alone and ``kvcascade_impl`` (vLLM's tiering manager) is skipped.
``serving.py`` runs in ``--vllm-python`` too (its engines and the model it writes need vLLM
and transformers) and is skipped without it.
``model_mutations.py`` is a tool that checks the strength of the model tests, not a benchmark:
it is not run.

    python benchmarks/run_all.py --quick [--out DIR] [--vllm-python PATH] [--only a,b]
    python benchmarks/run_all.py --table DIR/ratios.json [more row files]   # print a table

Exit status 1 when a benchmark failed (its output is in ``DIR/<benchmark>.log``), else 0; a
missed goal is a ``no`` in the table, not a failure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_VLLM_PYTHON = "/tmp/kvcascade-vllm-venv/bin/python"


@dataclass(frozen=True)
class Benchmark:
    """A script of ``benchmarks/`` and where it runs.

    ``vllm``: "side" runs it in the vLLM python when there is one (else here), "required" only
    there (skipped without it), None always here.
    """

    script: str
    vllm: str | None = None

    @property
    def stem(self) -> str:
        return Path(self.script).stem


BENCHMARKS = (
    Benchmark("fs_tier.py", "side"),
    Benchmark("bookkeeping.py", "side"),
    Benchmark("kvcascade_impl.py", "required"),
    Benchmark("copy_blocks.py"),
    Benchmark("loop_lag.py"),
    Benchmark("loop_portal.py"),
    Benchmark("policy_cost.py"),
    Benchmark("policy_suite.py"),
    Benchmark("policy_warm_start.py"),
    Benchmark("s3_tier.py"),
    Benchmark("valkey_tier.py"),
    Benchmark("slow_tier.py"),
    Benchmark("serving.py", "required"),
)


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if value == 0 or not math.isfinite(value):
        return str(value)
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"


def format_table(docs: list[dict]) -> str:
    """The ratio rows of ``docs`` (each ``{"benchmark", "rows"}``, benchmarks/_rows.py) as one
    aligned text table; a doc with ``"error"`` shows it on one line instead of rows."""
    header = ("benchmark", "name", "measured", "baseline", "ratio", "goal", "met")
    lines: list[tuple[str, ...]] = [header]
    for doc in docs:
        if doc.get("error"):
            lines.append((doc["benchmark"], f"({doc['error']})", "", "", "", "", ""))
            continue
        for row in doc["rows"]:
            met = {True: "yes", False: "NO", None: "-"}[row["met"]]
            measured = f"{_fmt(row['measured'])} {row['unit']}"
            lines.append(
                (
                    doc["benchmark"],
                    row["name"],
                    measured,
                    _fmt(row["baseline"]),
                    _fmt(row["ratio"]),
                    row["goal"] or "-",
                    met,
                )
            )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for n, line in enumerate(lines):
        cells = [c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))]
        out.append("  ".join(cells).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def _load_docs(paths: list[str]) -> list[dict]:
    """Row files, or a ``ratios.json`` (a list of them)."""
    docs: list[dict] = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        docs.extend(data if isinstance(data, list) else [data])
    return docs


def _command(bench: Benchmark, args: argparse.Namespace, json_path: Path) -> list[str] | str:
    """The command line of ``bench``, or why it is skipped."""
    script = HERE / bench.script
    if not script.exists():
        return "no such file"
    vllm_python = args.vllm_python
    if bench.vllm == "required" and vllm_python is None:
        return "no vLLM python (--vllm-python)"
    python = vllm_python if bench.vllm and vllm_python else sys.executable
    cmd = [python, str(script), "--json", str(json_path)]
    if args.quick:
        cmd.append("--quick")
    return cmd


def run(args: argparse.Namespace) -> int:
    out = Path(args.out or tempfile.mkdtemp(prefix="kvcascade-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    wanted = set(args.only.split(",")) if args.only else None
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    docs: list[dict] = []
    failed = 0
    start_all = time.perf_counter()
    for bench in BENCHMARKS:
        if wanted is not None and bench.stem not in wanted:
            continue
        json_path = out / f"{bench.stem}.json"
        json_path.unlink(missing_ok=True)
        cmd = _command(bench, args, json_path)
        if isinstance(cmd, str):
            print(f"{bench.stem}: skipped ({cmd})", flush=True)
            docs.append({"benchmark": bench.stem, "error": f"skipped: {cmd}", "rows": []})
            continue
        start = time.perf_counter()
        with open(out / f"{bench.stem}.log", "w") as log:
            try:
                rc = subprocess.run(
                    cmd,
                    cwd=ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    timeout=args.timeout,
                ).returncode
            except subprocess.TimeoutExpired:
                rc = f"timed out after {args.timeout} s"
        seconds = time.perf_counter() - start
        if rc == 0 and json_path.exists():
            doc = json.loads(json_path.read_text())
            doc["seconds"] = seconds
            print(f"{bench.stem}: {len(doc['rows'])} rows in {seconds:.0f} s", flush=True)
        else:
            failed += 1
            why = rc if isinstance(rc, str) else f"exit status {rc}" if rc else "no JSON written"
            doc = {
                "benchmark": bench.stem,
                "error": f"failed: {why}, see {bench.stem}.log",
                "rows": [],
            }
            print(f"{bench.stem}: FAILED ({why}; {out / (bench.stem + '.log')})", flush=True)
        docs.append(doc)
    table = format_table(docs)
    (out / "ratios.json").write_text(json.dumps(docs, indent=1) + "\n")
    (out / "ratios.txt").write_text(table + "\n")
    print()
    print(table)
    print(f"\n{time.perf_counter() - start_all:.0f} s in all; rows and logs in {out}")
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="every benchmark at its quick size")
    parser.add_argument("--out", help="directory for the JSON and logs (default: a temp dir)")
    default_vllm = DEFAULT_VLLM_PYTHON if os.path.exists(DEFAULT_VLLM_PYTHON) else None
    parser.add_argument("--vllm-python", default=default_vllm, help="a python with vLLM 0.32")
    parser.add_argument("--only", help="comma-separated benchmark names (script stems)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per benchmark")
    parser.add_argument("--table", nargs="+", metavar="JSON", help="only print these rows' table")
    args = parser.parse_args()
    if args.table:
        print(format_table(_load_docs(args.table)))
        return 0
    if args.vllm_python is not None and not os.path.exists(args.vllm_python):
        parser.error(f"--vllm-python {args.vllm_python!r} does not exist")
    if args.only:
        unknown = set(args.only.split(",")) - {b.stem for b in BENCHMARKS}
        if unknown:
            parser.error(f"--only: unknown benchmarks {sorted(unknown)}")
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
