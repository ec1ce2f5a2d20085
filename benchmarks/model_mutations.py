"""Do the model machines of issue #14 find its defects 1-5? Reverts each fix, one at a time, in a
copy of the checkout and runs the model test that should catch it.

For each mutation: copy ``kvcascade/``, ``tests/`` and ``pyproject.toml`` into a temp dir, apply
the mutation (a text replacement whose old text must occur exactly once), and run
``python -m pytest <model test> -x -q -p no:cacheprovider --hypothesis-show-statistics`` there.
``KVCASCADE_KERNELS_DIR`` points at this checkout's ``kernels/``, so the copy gets the same
extension name (``kvcascade.ops._build.extension_spec`` hashes the sources' directory) and
reuses this checkout's C++ build instead of building its own.

Usage::

    python benchmarks/model_mutations.py                    # the default deterministic runs
    python benchmarks/model_mutations.py --examples 200 --seed 1
    python benchmarks/model_mutations.py --only defect3

Prints one row per mutation: caught or not, the examples Hypothesis ran (``--examples`` unset:
the deterministic ``derandomize`` run), and the first failure line.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASCADE = "tests/test_cascade_model.py"
SCHEDULER = "tests/test_scheduler_model.py"


@dataclass(frozen=True)
class Mutation:
    name: str
    test: str
    edits: tuple[tuple[str, str, str], ...]  # (file, fixed text, pre-fix text)


MUTATIONS = [
    Mutation(
        "defect1",
        CASCADE,
        (
            (
                "kvcascade/coordinator.py",
                "        self._flush_pending_promotions(ctx.req_id)\n",
                "",
            ),
        ),
    ),
    Mutation(
        "defect2",
        CASCADE,
        (
            (
                "kvcascade/cascade.py",
                "    if len(set(keys)) < len(keys):\n"
                "        repeated = [k for k, n in collections.Counter(keys).items() if n > 1]\n"
                "        raise ValueError("
                'f"offload keys given more than once: {repeated[:4]!r:.200}")\n',
                "",
            ),
            (
                "kvcascade/coordinator.py",
                "        for key in keys:\n"
                "            if key in pins:\n"
                "                del pins[key]\n"
                "            else:\n"
                "                fresh.append(key)\n",
                "        fresh = [k for k in keys if k not in pins]\n"
                "        for key in keys:\n"
                "            pins.pop(key, None)\n",
            ),
        ),
    ),
    Mutation(
        "defect3",
        SCHEDULER,
        (
            (
                "kvcascade/coordinator.py",
                "            self._hold_for_reader(ok, job.req_context)\n",
                "",
            ),
        ),
    ),
    Mutation(
        "defect4",
        SCHEDULER,
        (
            (
                "kvcascade/scheduler.py",
                "        reach = list(storable)\n",
                "        return list(storable)\n        reach = list(storable)\n",
            ),
        ),
    ),
    Mutation(
        "defect5a",
        SCHEDULER,
        (
            (
                "kvcascade/scheduler.py",
                "            for blocks in group_blocks:\n"
                "                self._step_allocated.update(bid for bid, _ in blocks if bid)\n"
                "            return\n",
                "            return\n",
            ),
            (
                "kvcascade/scheduler.py",
                "                for new in sched.new_block_ids or ():\n"
                "                    self._step_allocated.update(b for b in new if b)\n"
                "                continue\n",
                "                continue\n",
            ),
        ),
    ),
    Mutation(
        "defect5b",
        CASCADE,
        (
            (
                "kvcascade/cascade.py",
                "        while loads := {id(f): f for i in gpu_ids "
                "if (f := self._loading.get(int(i)))}:\n"
                "            await asyncio.wait(loads.values())\n",
                "",
            ),
        ),
    ),
]


def _mutate(tree: Path, mutation: Mutation) -> None:
    for rel, old, new in mutation.edits:
        path = tree / rel
        text = path.read_text()
        n = text.count(old)
        assert n == 1, f"{mutation.name}: the fixed text occurs {n} times in {rel}"
        path.write_text(text.replace(old, new))


def _examples(output: str) -> int | None:
    """Examples Hypothesis ran in the generate phase (``--hypothesis-show-statistics``)."""
    counts = re.findall(
        r"during generate phase.*?\n\s*- (\d+) passing examples?, (\d+) failing", output, re.S
    )
    if counts:
        passing, failing = map(int, counts[0])
        return passing + failing
    return None


def run_one(mutation: Mutation, examples: int | None, seed: int, timeout_s: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"kvc-{mutation.name}-") as tmp:
        tree = Path(tmp)
        for sub in ("kvcascade", "tests"):
            shutil.copytree(
                ROOT / sub, tree / sub, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
            )
        shutil.copy2(ROOT / "pyproject.toml", tree / "pyproject.toml")
        _mutate(tree, mutation)
        env = dict(os.environ, KVCASCADE_KERNELS_DIR=str(ROOT / "kernels"))
        env.pop("KVCASCADE_MODEL_EXAMPLES", None)
        if examples:
            env["KVCASCADE_MODEL_EXAMPLES"] = str(examples)
        cmd = [
            sys.executable, "-m", "pytest", mutation.test, "-x", "-q", "-p", "no:cacheprovider",
            "--hypothesis-show-statistics", f"--hypothesis-seed={seed}",
        ]  # fmt: skip
        t0 = time.monotonic()
        try:
            proc = subprocess.run(
                cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s
            )
            out, rc = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            out, rc = str(exc.stdout or "") + str(exc.stderr or ""), None
        wall = time.monotonic() - t0
    first = next(
        (ln.strip() for ln in out.splitlines() if ln.startswith("E ") and "Error" in ln), ""
    )
    return {
        "name": mutation.name,
        "test": mutation.test,
        "caught": rc == 1,
        "rc": rc,
        "examples": _examples(out),
        "wall_s": round(wall),
        "first": first[:110],
        "output": out,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, help="random examples (default: derandomize)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", action="append", help="mutation name (repeatable)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per run")
    ap.add_argument("--verbose", action="store_true", help="print each run's output")
    args = ap.parse_args()
    picked = [m for m in MUTATIONS if not args.only or m.name in args.only]
    mode = f"random {args.examples} seed {args.seed}" if args.examples else "derandomize"
    print(f"{'mutation':9} {'caught':6} {'examples':8} {'wall_s':6}  mode / first failure")
    for m in picked:
        r = run_one(m, args.examples, args.seed, args.timeout)
        if args.verbose:
            print(r["output"])
        caught = "yes" if r["caught"] else ("TIMEOUT" if r["rc"] is None else f"no({r['rc']})")
        ex = r["examples"] if r["examples"] is not None else "?"
        row = f"{r['name']:9} {caught:6} {ex!s:8} {r['wall_s']:<6}"
        print(f"{row}  {mode}: {r['first']}", flush=True)


if __name__ == "__main__":
    main()
