"""The robustness suite (issue #19, ``benchmarks/policy_suite.py``) at a small size: its traces
are well-formed and seeded; at 5 % and 20 % the adaptive policy is never below ``max(lru,
arc)`` by more than 0.002 on two of them — one where the turn-aware model holds, one where it
does not — and on the bundled trace's first 2 000 requests it keeps part of the turn-aware gain
(docs/policies.md has the full table at 2 000 requests)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import policy_suite

from kvcascade.replay.compare import compare
from kvcascade.replay.trace import TOKENS_PER_BLOCK, bundled_trace, read_trace

N = 1000


@pytest.fixture(scope="module")
def traces() -> dict[str, list]:
    return policy_suite.build_traces(N, seed=0)


def test_traces_are_seeded_and_well_formed(traces: dict[str, list]) -> None:
    assert sorted(traces) == sorted(
        [
            "bundled",
            "interleave",
            "think_x0.1",
            "think_x10",
            "turns_geometric",
            "turns_decreasing",
            "zipf_system",
            "scan_mix",
            "single_turn",
            "shift",
        ]
    )
    again = policy_suite.build_traces(N, seed=0)
    for name, trace in traces.items():
        assert len(trace) == N, name
        assert trace == again[name], f"{name} is not reproducible from its seed"
        times = [r.timestamp_ms for r in trace]
        assert times == sorted(times), name
        assert [r.index for r in trace] == list(range(N))
        for r in trace:
            assert r.hash_ids and len(r.hash_ids) == -(-r.input_length // TOKENS_PER_BLOCK)


def test_chained_ids_mean_equal_prefixes(traces: dict[str, list]) -> None:
    """The suite's generators keep the trace format's rule: one id, one prefix."""
    for name, trace in traces.items():
        prefix_of: dict[int, tuple[int, ...]] = {}
        for r in trace:
            for i, h in enumerate(r.hash_ids):
                assert prefix_of.setdefault(h, r.hash_ids[:i]) == r.hash_ids[:i], name


def test_generated_prompts_fit_a_128k_context_window() -> None:
    """Pareto-grown contexts end at the window (seed 7 reaches it: uncapped, its longest
    ``turns_decreasing`` prompt was 428 blocks at 2 000 requests); the trace keeps its length."""
    window = 128 * 1024 // TOKENS_PER_BLOCK  # blocks, the partial last one included
    traces = policy_suite.build_traces(N, seed=7)
    longest = {name: max(len(r.hash_ids) for r in trace) for name, trace in traces.items()}
    assert longest["turns_decreasing"] == window
    assert max(longest.values()) <= window
    assert len(traces["turns_decreasing"]) == N


def test_conversations_follow_turns() -> None:
    from kvcascade.replay.trace import TraceRequest

    trace = [
        TraceRequest(0, 0, 1500, (0, 1, 2)),
        TraceRequest(1, 5, 1000, (0, 7)),
        TraceRequest(2, 9, 2600, (0, 1, 2, 3, 4, 5)),
        TraceRequest(3, 12, 3100, (0, 1, 2, 3, 4, 5, 6)),
    ]
    convs = policy_suite.conversations(trace)
    assert [[r.index for r in c.requests] for c in convs] == [[0, 2, 3], [1]]
    assert convs[0].times == [0.0, 9.0, 12.0]


@pytest.mark.parametrize("fraction", [0.05, 0.2])
@pytest.mark.parametrize("name", ["bundled", "turns_geometric"])
def test_adaptive_is_never_below_lru_and_arc(
    traces: dict[str, list], name: str, fraction: float
) -> None:
    """The never-below rule of issue #19 on a trace where the turn-aware model predicts reuse
    (``bundled``: at 5 % the adaptive policy follows it) and one where the turn number
    predicts nothing (``turns_geometric``: the turn-aware policy alone is below LRU there)."""
    result = compare(traces[name], ["lru", "arc", "turn_aware", "adaptive"], [fraction])
    hit = {p: result.runs[(p, fraction)].hit_ratio for p in ("lru", "arc", "turn_aware", "opt")}
    best = max(hit["lru"], hit["arc"])
    adaptive = result.runs[("adaptive", fraction)].hit_ratio
    assert adaptive >= best - 0.002
    assert hit["opt"] >= max(best, adaptive)
    if name == "turns_geometric":
        assert hit["turn_aware"] < best - 0.01
    elif fraction == 0.05:
        assert hit["turn_aware"] > best + 0.01


def test_adaptive_keeps_part_of_the_turn_aware_gain() -> None:
    """On the bundled trace's first 2 000 requests at 5 % the shadows' lead becomes significant
    and the adaptive policy follows the turn-aware model (docs/policies.md: 0.0841 against
    LRU's 0.0488); at 1 000 requests it is not significant yet, and the policy stays LRU."""
    trace = read_trace(bundled_trace())[:2000]
    result = compare(trace, ["lru", "arc", "adaptive"], [0.05])
    hit = {p: result.runs[(p, 0.05)].hit_ratio for p in ("lru", "arc", "adaptive")}
    assert hit["adaptive"] > max(hit["lru"], hit["arc"]) + 0.02
