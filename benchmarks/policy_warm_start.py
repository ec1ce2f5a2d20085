"""What a learning policy's cold start costs, and what its saved state gives back (issue #19).

``turn_aware`` and ``adaptive`` learn per-class re-read statistics online; a cascade with an fs
tier saves them at shutdown and loads them at start (docs/policies.md, *State across
restarts*). This benchmark replays a trace with the engine of ``kvcascade replay
--compare-policies`` (:func:`kvcascade.replay.compare.simulate`: the real
``CPUOffloadingManager``, free rules on, prefix-level hit ratio), per policy and capacity:

* ``cold``: the whole trace from a cold start (the figures of docs/policies.md's goals);
* ``warm (in-sample)``: the whole trace again, starting from the statistics of the cold run —
  an upper bound (they were learned on the same requests), not a claim;
* ``cold 2nd`` / ``warm 2nd``: the second half of the trace alone, cold and starting from the
  statistics learned on the first half alone (a restart: yesterday's state, today's traffic);
  ``cold 1st`` / ``warm 1st``: the same the other way round.

The capacity is a fraction of the whole trace's unique blocks in every run. Prints one column per
policy and capacity; ``cold, its 2nd half`` is the whole cold run's hit ratio over the second
half's requests (its first half is ``cold 1st``: the cold start is that half's shortfall).

    python benchmarks/policy_warm_start.py [TRACE] [--requests N] [--policies turn_aware,adaptive]
        [--capacities 0.01,0.05,0.1] [--quick] [--json PATH]

``--json PATH``: per policy and capacity, ``warm 2nd`` against ``cold 2nd`` and ``warm 1st``
against ``cold 1st`` (goal ``>= 1.0``: a saved state does not cost hits on other traffic) in
``benchmarks/_rows.py``'s format; ``--quick``: by default 3,000 requests, ``turn_aware`` at 5 %
(where the goal is missed: docs/policies.md, *State across restarts*).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.append(_HERE)

from _rows import Row, rows_path, write_rows  # noqa: E402

from kvcascade import CPUOffloadingManager  # noqa: E402
from kvcascade.replay.compare import keeps_state, simulate, unique_blocks  # noqa: E402
from kvcascade.replay.trace import TraceRequest, bundled_trace, read_trace  # noqa: E402

#: The runs of :func:`measure`, in the order they are printed.
_RUNS = (
    "cold",
    "cold, its 2nd half",
    "warm (in-sample)",
    "cold 1st",
    "warm 1st",
    "cold 2nd",
    "warm 2nd",
)


def measure(trace: Sequence[TraceRequest], policy: str, capacity: int) -> dict[str, float]:
    """Hit ratios of ``policy`` at ``capacity`` blocks, by run name (:data:`_RUNS`; the
    module docstring): six simulations."""
    half = len(trace) // 2
    first, second = trace[:half], trace[half:]
    cold = simulate(trace, policy, capacity)
    cold_first = simulate(first, policy, capacity)
    cold_second = simulate(second, policy, capacity)
    in_sample = simulate(trace, policy, capacity, policy_state=cold.policy_state)
    warm_first = simulate(first, policy, capacity, policy_state=cold_second.policy_state)
    warm_second = simulate(second, policy, capacity, policy_state=cold_first.policy_state)
    # The first half of the whole cold run is the cold run of the first half (same decisions,
    # ``cold 1st``): the rest of its hits fell in the second half.
    later = cold.instances - cold_first.instances
    return {
        "cold": cold.hit_ratio,
        "cold, its 2nd half": (cold.hits - cold_first.hits) / later if later else 0.0,
        "warm (in-sample)": in_sample.hit_ratio,
        "cold 1st": cold_first.hit_ratio,
        "warm 1st": warm_first.hit_ratio,
        "cold 2nd": cold_second.hit_ratio,
        "warm 2nd": warm_second.hit_ratio,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", nargs="?", help="JSONL trace (default: the bundled trace)")
    parser.add_argument("--requests", type=int, help="the first N requests (>= 2)")
    parser.add_argument("--policies", help="learning policies (default turn_aware,adaptive)")
    parser.add_argument("--capacities", help="fractions in (0, 1] (default 0.01,0.05,0.1)")
    parser.add_argument(
        "--quick", action="store_true", help="defaults of 3,000 requests, turn_aware, 5 %%"
    )
    parser.add_argument(
        "--json", type=rows_path, dest="json_path", help="write the ratio rows here"
    )
    args = parser.parse_args(argv)
    quick = (3000, "turn_aware", "0.05") if args.quick else (None, "turn_aware,adaptive", None)
    requests = args.requests if args.requests is not None else quick[0]
    policies = [p for p in (args.policies or quick[1]).split(",") if p]
    try:
        fractions = [float(f) for f in (args.capacities or quick[2] or "0.01,0.05,0.1").split(",")]
    except ValueError:
        parser.error(f"--capacities must be comma-separated numbers, got {args.capacities!r}")
    if requests is not None and requests < 2:
        parser.error(f"--requests must be >= 2 (two halves), got {requests}")
    if not all(0.0 < f <= 1.0 for f in fractions):
        parser.error(f"--capacities must be within (0, 1], got {args.capacities!r}")
    for name in policies:
        if not keeps_state(CPUOffloadingManager(1, name).policy):  # ConfigError: unknown
            parser.error(f"policy {name!r} keeps no learned state: nothing to warm-start")
    trace = read_trace(args.trace or bundled_trace(), limit=requests)
    unique = unique_blocks(trace)
    print(f"{len(trace):,} requests, {unique:,} unique blocks; prefix-level hit ratio", flush=True)
    rows: list[Row] = []
    columns: list[tuple[str, dict[str, float]]] = []
    for policy in policies:
        for fraction in fractions:
            capacity = int(fraction * unique)
            if not capacity:
                parser.error(f"capacity {fraction} of {unique:,} unique blocks is 0 blocks")
            start = time.perf_counter()
            got = measure(trace, policy, capacity)
            label = f"{policy} {fraction:.0%}"
            print(f"  {label}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
            columns.append((label, got))
            for half in ("1st", "2nd"):
                rows.append(
                    Row.of(
                        f"{policy} {fraction:g} warm/cold {half} half",
                        got[f"warm {half}"],
                        got[f"cold {half}"],
                        ">= 1.0",
                        "hit ratio",
                    )
                )
    width = max(16, *(len(label) + 2 for label, _ in columns))
    print(f"{'run':<20}" + "".join(f"{label:>{width}}" for label, _ in columns))
    for name in _RUNS:
        print(f"{name:<20}" + "".join(f"{got[name]:>{width}.4f}" for _, got in columns))
    if args.json_path:
        write_rows(args.json_path, "policy_warm_start", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
