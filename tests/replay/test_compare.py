"""Policy comparison (issue #9): OPT against brute force, the comparison against a plain
simulation on a trace slice, oracle hints, and the CLI."""

from __future__ import annotations

import itertools
import json
import os
import random
from collections import OrderedDict
from pathlib import Path

import pytest

from kvcascade import ConfigError
from kvcascade.replay.cli import main
from kvcascade.replay.compare import (
    compare,
    oracle_hints,
    parse_hints,
    simulate,
    storable_blocks,
    unique_blocks,
)
from kvcascade.replay.opt import belady_hits
from kvcascade.replay.trace import TraceRequest, bundled_trace, read_trace


def _brute_force(requests: list[list[int]], capacity: int) -> int:
    """Best prefix-level hits over every sequence of cache contents (exhaustive search)."""
    best: dict[frozenset[int], int] = {frozenset(): 0}
    for ids in requests:
        nxt: dict[frozenset[int], int] = {}
        for cached, hits in best.items():
            run = len(list(itertools.takewhile(cached.__contains__, ids)))
            pool = sorted(cached | set(ids))
            for size in range(min(capacity, len(pool)) + 1):
                for keep in itertools.combinations(pool, size):
                    state = frozenset(keep)
                    if nxt.get(state, -1) < hits + run:
                        nxt[state] = hits + run
        best = nxt
    return max(best.values())


def _random_chains(rng: random.Random, n: int) -> list[list[int]]:
    """Requests over a small prefix tree: ids are chained (same id ⇒ same prefix)."""
    tree: dict[tuple[int, ...], int] = {}
    requests = []
    for _ in range(n):
        path: tuple[int, ...] = ()
        ids = []
        for _ in range(rng.randint(1, 3)):
            path = (*path, rng.randint(0, 1))
            ids.append(tree.setdefault(path, len(tree)))
        requests.append(ids)
    return requests


@pytest.mark.parametrize("seed", range(12))
def test_opt_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    requests = _random_chains(rng, 6)
    for capacity in (1, 2, 3):
        assert belady_hits(requests, capacity) == _brute_force(requests, capacity)


def test_opt_hand_made_trace() -> None:
    requests = [[0, 1, 2], [0, 3], [0, 1, 2, 4], [0, 3], [0, 1]]
    assert belady_hits(requests, 2) == _brute_force(requests, 2) == 6
    assert belady_hits(requests, 0) == 0
    assert belady_hits(requests, 10) == 1 + 3 + 2 + 2


def _plain_lru(trace: list[TraceRequest], capacity: int) -> float:
    """Textbook block-stream LRU: a request's blocks are used in order (the last most recent)
    after its leading hits are counted; evictions spare the request's own blocks; when it ends
    its blocks are ranked deepest first (the head most recent), as the manager's
    ``on_request_finished`` does (vLLM's ``kv_offload/cpu/policies/lru.py``)."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = instances = 0
    for request in trace:
        ids = request.hash_ids
        run = len(list(itertools.takewhile(lambda h: h in cache, ids)))
        hits += run
        instances += len(ids)
        for h in ids:
            cache[h] = None
            cache.move_to_end(h)
        mine = set(ids)
        while len(cache) > capacity:
            victim = next(h for h in cache if h not in mine)
            del cache[victim]
        for h in reversed(ids):
            if h in cache:
                cache.move_to_end(h)
    return hits / instances


@pytest.fixture(scope="module")
def trace_slice() -> list[TraceRequest]:
    return read_trace(bundled_trace(), limit=1500)


def test_comparison_lru_matches_plain_simulation(trace_slice: list[TraceRequest]) -> None:
    """With the free rules off and no second touch effect on misses, the real bookkeeping's
    LRU equals the plain block-stream LRU within 0.001 (vLLM's touch after prepare_store
    re-orders earlier hits, see docs/policies.md)."""
    unique = unique_blocks(trace_slice)
    result = compare(trace_slice, ["lru", "turn_aware"], [0.05, 0.1], free_rules=False)
    for fraction in (0.05, 0.1):
        capacity = int(fraction * unique)
        run = result.runs[("lru", fraction)]
        assert run.capacity == capacity
        assert run.hit_ratio == pytest.approx(_plain_lru(trace_slice, capacity), abs=1e-3)
        opt = result.runs[("opt", fraction)]
        assert opt.hits == belady_hits([r.hash_ids for r in trace_slice], capacity)
        assert opt.hit_ratio >= run.hit_ratio
        assert opt.hit_ratio >= result.runs[("turn_aware", fraction)].hit_ratio


def test_free_rules_never_store_partial_blocks(trace_slice: list[TraceRequest]) -> None:
    capacity = unique_blocks(trace_slice)  # nothing is ever evicted
    run = simulate(trace_slice, "turn_aware", capacity, free_rules=True)
    # Every hit block is a complete block of an earlier request.
    full = {h for r in trace_slice for h in r.hash_ids[: storable_blocks(r, free_rules=True)]}
    seen: set[int] = set()
    expected = 0
    for r in trace_slice:
        expected += len(list(itertools.takewhile(lambda h: h in seen, r.hash_ids)))
        seen.update(h for h in r.hash_ids[: storable_blocks(r, True)] if h in full)
    assert run.hits == expected


def test_oracle_hints() -> None:
    trace = [
        TraceRequest(0, 0, 1024, (0, 1)),  # continued by request 2
        TraceRequest(1, 0, 1000, (0, 5)),  # full part is the root, extended by request 2
        TraceRequest(2, 0, 2048, (0, 1, 2, 3)),  # nothing later
        TraceRequest(3, 0, 1500, (0, 7, 8)),  # 7 is not extended later
    ]
    assert [h.continues for h in oracle_hints(trace)] == [True, True, False, False]
    flipped = oracle_hints(trace, noise=1.0)
    assert [h.continues for h in flipped] == [False, False, True, True]
    assert parse_hints("oracle:0.1") == (True, 0.1)
    assert parse_hints("none") == (False, 0.0)
    for bad in ("oracle:2", "magic", "oracle:x"):
        with pytest.raises(ValueError):
            parse_hints(bad)


def test_cli_compare(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "replay",
            "--compare-policies",
            "lru,turn_aware",
            "--capacities",
            "0.05",
            "--requests",
            "300",
            "--hints",
            "oracle:0.1",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "turn_aware" in out and "opt" in out and "5.00%" in out


def test_cli_compare_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "--compare-policies", "lru", "--capacities", "2"]) == 2
    assert main(["replay", "--compare-policies", "nope", "--requests", "5"]) == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--compare-policies", "lru,arc,lru"], "policy 'lru' is given twice"),
        (["--compare-policies", "lru", "--capacities", "0.1,0.1"], "capacity fraction 0.1 is"),
        (
            ["--compare-policies", "lru", "--capacities", "0.5,0.505"],
            "capacity fractions 0.5 and 0.505 are both 29 blocks of the trace's 59 unique",
        ),
        (["--compare-policies", ","], "--compare-policies needs at least one entry, got ','"),
        (["--compare-policies", "lru", "--capacities", " ,"], "--capacities needs at least "),
    ],
)
def test_cli_compare_refuses_a_repeated_or_missing_policy_or_capacity(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--compare-policies lru,lru`` printed the lru column twice: a repeated policy (or
    capacity, a repeated row) is refused before any simulation, naming it; so is a list of
    no entries, naming its option."""
    assert main(["replay", "--requests", "5", "--quiet", *argv]) == 2
    out = capsys.readouterr()
    assert f"kvcascade: error: {message}" in out.err and out.out == ""


def test_an_unknown_policy_is_refused_before_any_run(trace_slice: list[TraceRequest]) -> None:
    """Found by a break-it run: ``--compare-policies lru,bogus`` simulated every run of lru
    before refusing ``bogus``."""
    runs: list[int] = []
    with pytest.raises(ConfigError, match="bogus"):
        compare(trace_slice, ["lru", "bogus"], [0.05], progress=runs.append)
    assert runs == []


def test_cli_compare_refuses_a_trace_of_no_blocks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every request with empty ``hash_ids``: the error said "give at least 1/0"."""
    trace = tmp_path / "empty.jsonl"
    trace.write_text('{"hash_ids": [], "input_length": 0}\n' * 3)
    assert main(["replay", str(trace), "--compare-policies", "lru", "--quiet"]) == 2
    out = capsys.readouterr()
    assert out.err == (
        "kvcascade: error: the trace has no blocks to cache (every request's hash_ids is empty)\n"
    )


def _labels(trace: list[TraceRequest]) -> int:
    """Blocks a turn-aware policy files under the free rules: per request its touched (complete)
    keys but the root, at least one."""
    return sum(max(1, n - 1) for r in trace if (n := storable_blocks(r, free_rules=True)))


def test_a_run_hands_over_its_learned_state(trace_slice: list[TraceRequest]) -> None:
    """``simulate`` returns the learning policies' statistics after the run (None for LRU);
    a run started from them is the run of a policy that had loaded them (what a cascade does
    with the state file beside its fs tier), deterministic, and differs from a cold one."""
    capacity = int(0.05 * unique_blocks(trace_slice))
    assert simulate(trace_slice, "lru", capacity).policy_state is None
    first, second = trace_slice[:750], trace_slice[750:]
    learned = simulate(first, "turn_aware", capacity).policy_state
    assert learned is not None and learned["version"] == 2
    total_labels = learned["pooled"]["labels"]
    assert total_labels == _labels(first)
    cold = simulate(second, "turn_aware", capacity)
    warm = simulate(second, "turn_aware", capacity, policy_state=learned)
    again = simulate(second, "turn_aware", capacity, policy_state=learned)
    assert (warm.hits, warm.instances) == (again.hits, again.instances)
    assert warm.instances == cold.instances and warm.hits != cold.hits
    # The warm run learned on: its statistics are the first half's plus the second half's.
    assert warm.policy_state["pooled"]["labels"] == (total_labels + _labels(second))
    # LRU keeps no state: the same run with or without one.
    lru = simulate(second, "lru", capacity, policy_state=learned)
    assert lru.hits == simulate(second, "lru", capacity).hits


def test_cli_compare_from_a_saved_state(
    trace_slice: list[TraceRequest], tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--policy-state PATH``: the learning policies start from a state file as a cascade
    saves it (``save_state``); a file that is no state, of another ``max_turn``, or no file
    at all is refused before any simulation, naming it; without --compare-policies it is
    refused too."""
    from kvcascade.policies import TurnAwareCachePolicy
    from kvcascade.policies.turn_aware import MAX_STATE_BYTES

    policy = TurnAwareCachePolicy(100)
    policy.set_state(simulate(trace_slice[:500], "turn_aware", 500).policy_state)
    path = tmp_path / "turn_aware_state.json"
    policy.save_state(path)
    argv = ["replay", "--compare-policies", "lru,turn_aware", "--requests", "300", "--quiet"]
    assert main([*argv, "--capacities", "0.05", "--policy-state", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"learning policies start from {str(path)!r}" in out
    other = TurnAwareCachePolicy(100, max_turn=3)
    other.save_state(tmp_path / "three.json")
    (tmp_path / "junk.json").write_text("{not json")
    (tmp_path / "null.json").write_text("null")
    (tmp_path / "digits.json").write_text('{"version": ' + "1" * 5000 + "}")
    huge = json.loads(path.read_text())
    huge["classes"][0][4] = 10**400  # a count beyond a float
    (tmp_path / "huge.json").write_text(json.dumps(huge))
    (tmp_path / "big.json").write_text(" " * MAX_STATE_BYTES + "{}")  # valid JSON, too big
    os.mkfifo(tmp_path / "fifo")  # would block a plain read forever
    for bad, message in (
        (tmp_path / "three.json", "does not suit policy 'turn_aware'"),
        (tmp_path / "junk.json", "not a policy state file"),
        (tmp_path / "null.json", "not a policy state file (a JSON object, not NoneType)"),
        (tmp_path / "digits.json", "not a policy state file"),
        (tmp_path / "huge.json", "does not suit policy 'turn_aware'"),
        (tmp_path / "big.json", "not a policy state file (larger than 1,048,576 bytes)"),
        (tmp_path / "fifo", "not a regular file"),
        (tmp_path, "not a regular file"),
    ):
        assert main([*argv, "--policy-state", str(bad)]) == 2
        got = capsys.readouterr()
        assert message in got.err and repr(str(bad)) in got.err and got.out == ""
        assert "state: " not in got.err  # the path names the source, once
        assert got.err.count("\n") == 1  # one line, no traceback
    # a state no listed policy learns from: refused, not silently ignored
    lru_only = ["replay", "--compare-policies", "lru,arc", "--requests", "30", "--quiet"]
    assert main([*lru_only, "--policy-state", str(path)]) == 2
    assert "none of the policies lru, arc learns" in capsys.readouterr().err
    assert main(["replay", "--requests", "5", "--policy-state", str(path)]) == 2
    assert "--policy-state: only meaningful with --compare-policies" in capsys.readouterr().err
