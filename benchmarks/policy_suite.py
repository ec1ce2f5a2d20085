"""Robustness suite of the eviction policies (issue #19): traces the policies were not tuned on.

Every trace is built from a fixed seed: the bundled Mooncake conversation trace, transformations
of it that change what a learning policy sees (sessions interleaved differently, think times
scaled, one-off long prompts mixed in) and generators with other structure (turn counts and
context growth from other distributions, a Zipf-shared system-prompt population, no multi-turn
structure at all, a workload that changes half-way). Each trace is replayed by the engine of
``kvcascade replay --compare-policies`` (:func:`kvcascade.replay.compare.compare`: the real
``CPUOffloadingManager`` bookkeeping, free rules on, cold start, prefix-level hit ratio, with
Belady's OPT) at the given capacity fractions of the trace's unique blocks.

    python benchmarks/policy_suite.py [--requests 3000] [--traces all]
        [--capacities 0.01,0.02,0.05,0.1,0.2] [--policies lru,arc,s3fifo,turn_aware,adaptive]
        [--hints none|oracle[:noise]] [--seed 0] [--quick] [--json out.json]

Prints, per trace, one row per capacity (hit ratio of each policy and OPT) and the seconds the
trace took; then the worst margin of each policy against ``max(lru, arc)``. ``--json PATH``
writes those worst margins in ``benchmarks/_rows.py``'s format, ``adaptive``'s with the rule of
docs/policies.md (``>= -0.002``); ``--quick``: 300 requests of ``bundled`` and
``turns_geometric`` at 5 % and 20 %, where ``--requests`` / ``--traces`` / ``--capacities`` are
not given. Bad arguments are refused before any trace is replayed.
"""

from __future__ import annotations

import argparse
import bisect
import math
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.append(_HERE)

from _rows import Row, rows_path, write_rows  # noqa: E402

from kvcascade.policies import resolve_cache_policy  # noqa: E402
from kvcascade.replay.compare import Comparison, compare, parse_hints  # noqa: E402
from kvcascade.replay.trace import TOKENS_PER_BLOCK, TraceRequest, bundled_trace, read_trace  # noqa: E402

#: Block ids of generated traces start here (above every id of the bundled trace).
_FRESH = 1 << 40
#: Complete blocks a generated prompt may hold: a 128 k-token context window (131 072 tokens)
#: less the partial last block. The bundled trace's longest prompt is 241 blocks; a serving
#: engine refuses a longer prompt than its window (vLLM: ``max_model_len``).
_WINDOW_BLOCKS = 128 * 1024 // TOKENS_PER_BLOCK - 1


@dataclass
class _Conversation:
    """Turns of one conversation of the bundled trace: arrival times (ms) and requests."""

    times: list[float]
    requests: list[TraceRequest]


def conversations(trace: Sequence[TraceRequest]) -> list[_Conversation]:
    """Split ``trace`` into conversations: a request whose leading blocks are the complete
    prompt of an earlier request (its last or second-to-last block id, ids being chained) is
    that conversation's next turn; any other request starts a conversation."""
    end_of: dict[int, int] = {}  # prompt-end block id -> conversation index
    out: list[_Conversation] = []
    for request in trace:
        ids = request.hash_ids
        conv = -1
        for i in range(len(ids) - 1, 0, -1):
            conv = end_of.get(ids[i], -1)
            if conv >= 0:
                break
        if conv < 0:
            conv = len(out)
            out.append(_Conversation([], []))
        out[conv].times.append(float(request.timestamp_ms))
        out[conv].requests.append(request)
        for h in ids[-2:] if len(ids) > 2 else ids[1:]:
            end_of[h] = conv
    return out


def _assemble(items: list[tuple[float, int, tuple[int, ...]]], n: int) -> list[TraceRequest]:
    """Requests from ``(time ms, input tokens, ids)``, sorted by time (stable), first ``n``."""
    items.sort(key=lambda item: item[0])
    return [TraceRequest(i, int(t), length, ids) for i, (t, length, ids) in enumerate(items[:n])]


def _retimed(convs: list[_Conversation], starts: list[float], scale: float, n: int):
    """The conversations with new start times and turn gaps multiplied by ``scale``."""
    items = []
    for conv, start in zip(convs, starts):
        t0 = conv.times[0]
        for t, request in zip(conv.times, conv.requests):
            items.append((start + (t - t0) * scale, request.input_length, request.hash_ids))
    return _assemble(items, n)


class _Ids:
    """Fresh chained block ids for generated traces."""

    def __init__(self) -> None:
        self.next = _FRESH

    def take(self, n: int) -> tuple[int, ...]:
        start = self.next
        self.next += n
        return tuple(range(start, start + n))


def _prompt(rng: random.Random, blocks: tuple[int, ...], ids: _Ids) -> tuple[int, tuple[int, ...]]:
    """``(input tokens, ids)`` of a prompt of complete ``blocks`` and a partial last block of
    1 … 511 tokens (a fresh id: the next turn's prompt has other tokens there)."""
    return len(blocks) * TOKENS_PER_BLOCK + rng.randrange(1, TOKENS_PER_BLOCK), blocks + ids.take(1)


def _zipf_sampler(rng: random.Random, n: int, s: float) -> Callable[[], int]:
    """Draws ``0 … n-1`` with P(k) ∝ (k + 1)^-s."""
    cum = []
    acc = 0.0
    for k in range(n):
        acc += (k + 1) ** -s
        cum.append(acc)
    return lambda: min(bisect.bisect_left(cum, rng.random() * acc), n - 1)


def _chats(
    rng: random.Random,
    n: int,
    continue_p: Callable[[int], float],
    growth: Callable[[], int],
    first: Callable[[], int],
    system: Callable[[], tuple[int, ...]],
    ids: _Ids,
    rate_per_s: float = 3.4,
    think_s: float = 60.0,
    t0_ms: float = 0.0,
) -> list[tuple[float, int, tuple[int, ...]]]:
    """Multi-turn conversations until ``n`` requests: Poisson starts at ``rate_per_s``, turn
    ``t`` followed by another with ``continue_p(t)``, exponential think times of mean
    ``think_s``; a prompt is a shared system prompt, the conversation's context (``first()``
    blocks, then ``growth()`` more per turn) and a partial block (:func:`_prompt`). A prompt
    holds at most ``_WINDOW_BLOCKS`` complete blocks: a first context is cut to that, and a
    conversation whose next context would exceed it ends (the engine would refuse that turn)."""
    items: list[tuple[float, int, tuple[int, ...]]] = []
    t = t0_ms
    while len(items) < n:
        t += rng.expovariate(rate_per_s) * 1000.0
        prefix = system()
        context = prefix + ids.take(max(1, min(first(), _WINDOW_BLOCKS - len(prefix))))
        when = t
        turn = 1
        while len(items) < n:
            items.append((when, *_prompt(rng, context, ids)))
            if rng.random() >= continue_p(turn):
                break
            when += rng.expovariate(1.0 / think_s) * 1000.0
            grown = max(1, growth())
            if len(context) + grown > _WINDOW_BLOCKS:
                break
            turn += 1
            context = context + ids.take(grown)
    return items


def _lognormal(rng: random.Random, median: float, sigma: float) -> Callable[[], int]:
    return lambda: round(median * math.exp(rng.gauss(0.0, sigma)))


def _documents(
    rng: random.Random, n: int, ids: _Ids, t0_ms: float = 0.0, rate_per_s: float = 3.4
) -> list[tuple[float, int, tuple[int, ...]]]:
    """Single-turn requests: a Zipf(0.9)-popular document among ``n // 2`` (2–40 blocks under
    one of 8 shared instruction prefixes) plus a partial query block; no prompt is ever
    extended."""
    count = max(8, n // 2)
    prefixes = [ids.take(rng.randint(1, 4)) for _ in range(8)]
    docs = [prefixes[rng.randrange(8)] + ids.take(rng.randint(2, 40)) for _ in range(count)]
    pick = _zipf_sampler(rng, count, 0.9)
    items = []
    t = t0_ms
    for _ in range(n):
        t += rng.expovariate(rate_per_s) * 1000.0
        doc = docs[pick()]
        items.append((t, *_prompt(rng, doc, ids)))
    return items


def build_traces(n: int, seed: int = 0) -> dict[str, list[TraceRequest]]:
    """Every trace of the suite, ``n`` requests each (the bundled trace and its
    transformations: its first requests up to ``n``), built from ``seed``.

    Raises:
        ValueError: ``n`` < 10.
    """
    if n < 10:
        raise ValueError(f"the suite needs at least 10 requests per trace, got {n}")
    bundled = read_trace(bundled_trace())
    base = bundled[:n]
    convs = conversations(bundled)
    span = bundled[-1].timestamp_ms - bundled[0].timestamp_ms
    out: dict[str, list[TraceRequest]] = {"bundled": base}

    rng = random.Random(seed)
    starts = [rng.uniform(0.0, span) for _ in convs]
    # Sessions interleaved differently: start times redrawn, each conversation's gaps kept.
    out["interleave"] = _retimed(convs, starts, 1.0, n)
    # Think times scaled: turn gaps ×0.1 / ×10 (starts kept), then merged by time.
    firsts = [c.times[0] for c in convs]
    out["think_x0.1"] = _retimed(convs, firsts, 0.1, n)
    out["think_x10"] = _retimed(convs, firsts, 10.0, n)

    ids = _Ids()
    root = ids.take(1)
    rng = random.Random(seed + 1)
    # Memoryless turns (the turn number predicts nothing), lognormal context growth.
    out["turns_geometric"] = _assemble(
        _chats(
            rng,
            n,
            lambda turn: 0.6,
            _lognormal(rng, 3.0, 0.8),
            _lognormal(rng, 8.0, 1.0),
            lambda: root,
            ids,
        ),
        n,
    )
    rng = random.Random(seed + 2)
    # Later turns continue *less* often (the bundled trace's opposite); heavy-tailed growth.
    out["turns_decreasing"] = _assemble(
        _chats(
            rng,
            n,
            lambda turn: max(0.1, 0.85 - 0.15 * turn),
            lambda: int(rng.paretovariate(1.3)),
            _lognormal(rng, 4.0, 1.2),
            lambda: root,
            ids,
            think_s=20.0,
        ),
        n,
    )
    rng = random.Random(seed + 3)
    # A Zipf(1.1)-shared population of 200 system prompts (2–24 blocks), short chats.
    system_prompts = [ids.take(rng.randint(2, 24)) for _ in range(200)]
    pick = _zipf_sampler(rng, len(system_prompts), 1.1)
    out["zipf_system"] = _assemble(
        _chats(
            rng,
            n,
            lambda turn: 0.35,
            _lognormal(rng, 2.0, 0.7),
            _lognormal(rng, 3.0, 0.8),
            lambda: system_prompts[pick()],
            ids,
        ),
        n,
    )
    rng = random.Random(seed + 4)
    # Scan-heavy: the bundled requests plus one one-off long prompt (32–160 blocks) for every
    # two of them, at random times over the same span.
    scans = [
        (rng.uniform(0.0, base[-1].timestamp_ms), 0, root + ids.take(rng.randint(32, 160)))
        for _ in range(n // 2)
    ]
    scans = [(t, len(s) * TOKENS_PER_BLOCK, s) for t, _, s in scans]
    out["scan_mix"] = _assemble(
        [(r.timestamp_ms, r.input_length, r.hash_ids) for r in base] + scans, n
    )
    rng = random.Random(seed + 5)
    # No multi-turn structure at all: popular documents, never extended.
    out["single_turn"] = _assemble(_documents(rng, n, ids), n)
    rng = random.Random(seed + 6)
    # The workload changes half-way: bundled conversations, then popular documents.
    first_half = [(r.timestamp_ms, r.input_length, r.hash_ids) for r in base[: n // 2]]
    t_mid = first_half[-1][0]
    out["shift"] = _assemble(first_half + _documents(rng, n - n // 2, ids, t0_ms=t_mid), n)
    return out


def run_suite(
    traces: dict[str, list[TraceRequest]],
    policies: Sequence[str],
    fractions: Sequence[float],
    hints: str = "none",
    seed: int = 0,
) -> dict[str, tuple[Comparison, float]]:
    """Per trace: its comparison (:func:`kvcascade.replay.compare.compare`) and its seconds."""
    out = {}
    for name, trace in traces.items():
        start = time.perf_counter()
        result = compare(trace, policies, fractions, hints=hints, seed=seed)
        out[name] = (result, time.perf_counter() - start)
    return out


def worst_margins(results: dict[str, tuple[Comparison, float]]) -> dict[str, tuple[float, str]]:
    """Per policy: the lowest ``hit ratio − max(lru, arc)`` over every trace and capacity (both
    baselines must be among the policies), with where it occurred."""
    worst: dict[str, tuple[float, str]] = {}
    for name, (result, _) in results.items():
        for fraction in result.fractions:
            base = max(result.runs[(p, fraction)].hit_ratio for p in ("lru", "arc"))
            for policy in result.policies:
                margin = result.runs[(policy, fraction)].hit_ratio - base
                if policy not in worst or margin < worst[policy][0]:
                    worst[policy] = (margin, f"{name} @ {fraction:.0%}")
    return worst


def format_suite(results: dict[str, tuple[Comparison, float]]) -> str:
    """The suite as a Markdown table: one row per trace and capacity."""
    some = next(iter(results.values()))[0]
    names = [*some.policies, "opt"]
    lines = [
        "| trace | capacity | blocks | " + " | ".join(names) + " | s |",
        "|---|---|---|" + "---|" * len(names) + "---|",
    ]
    for trace, (result, seconds) in results.items():
        for i, (fraction, capacity) in enumerate(zip(result.fractions, result.capacities)):
            cells = [f"{result.runs[(n, fraction)].hit_ratio:.4f}" for n in names]
            when = f"{seconds:.0f}" if i == 0 else ""
            lines.append(
                f"| {trace if i == 0 else ''} | {fraction:.0%} | {capacity:,} | "
                + " | ".join(cells)
                + f" | {when} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Build the traces, replay them, print the table and the worst margins."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, help="requests per trace (default 3000)")
    parser.add_argument("--traces", help="comma-separated names, or all (the default)")
    parser.add_argument("--capacities", help="fractions of unique blocks (default 0.01,…,0.2)")
    parser.add_argument("--policies", default="lru,arc,s3fifo,turn_aware,adaptive")
    parser.add_argument("--hints", default="none")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quick", action="store_true", help="300 requests, 2 traces, 2 sizes (unless given)"
    )
    parser.add_argument(
        "--json", type=rows_path, dest="json_path", help="write the worst-margin rows here"
    )
    args = parser.parse_args(argv)
    quick = (300, "bundled,turns_geometric", "0.05,0.2")
    full = (3000, "all", "0.01,0.02,0.05,0.1,0.2")
    for name, default in zip(("requests", "traces", "capacities"), quick if args.quick else full):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.requests < 10:
        parser.error(f"--requests must be >= 10, got {args.requests}")
    policies = args.policies.split(",")
    try:
        fractions = [float(f) for f in args.capacities.split(",")]
    except ValueError:
        parser.error(f"--capacities must be comma-separated numbers, got {args.capacities!r}")
    try:
        for name in policies:
            resolve_cache_policy(name)
        parse_hints(args.hints)
    except ValueError as exc:  # ConfigError too
        parser.error(str(exc))
    policies = ["lru", "arc", *(p for p in policies if p not in ("lru", "arc"))]
    traces = build_traces(args.requests, args.seed)
    if args.traces != "all":
        wanted = args.traces.split(",")
        unknown = [t for t in wanted if t not in traces]
        if unknown:
            parser.error(f"unknown traces {unknown}; known: {', '.join(traces)}")
        traces = {t: traces[t] for t in wanted}
    try:  # compare's checks: a fraction out of (0, 1] or of 0 blocks, one given twice
        results = run_suite(traces, policies, fractions, args.hints, args.seed)
    except ValueError as exc:
        parser.error(str(exc))
    print(format_suite(results))
    print()
    rows = []
    for policy, (margin, where) in worst_margins(results).items():
        print(f"worst {policy} - max(lru, arc): {margin:+.4f} ({where})")
        goal = ">= -0.002" if policy == "adaptive" else None
        rows.append(
            Row.of(
                f"{policy} worst hit-ratio margin vs max(lru, arc)", margin, None, goal, "hit ratio"
            )
        )
    if args.json_path:
        write_rows(args.json_path, "policy_suite", rows)


if __name__ == "__main__":
    main()
