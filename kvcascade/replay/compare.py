"""``kvcascade replay --compare-policies``: eviction policies against Belady's OPT on a trace.

Cache model (reproduces issue #9's LRU / ARC / OPT columns with the free rules off):

* One cache level: the CPU primary tier's real bookkeeping (:class:`CPUOffloadingManager` with
  the policy under test) of ``capacity`` blocks; no GPU prefix cache, no secondary tier, no
  bytes (bookkeeping only — the byte path is what ``kvcascade replay`` checks).
* Each trace request, in arrival order, runs the connector's hook sequence (vLLM
  ``offloading/scheduler.py``): look up its keys in order and stop at the first miss (``h`` leading
  hits); ``touch`` its keys; ``prepare_load`` / ``complete_load`` the ``h`` hits; ``prepare_store``
  the rest (in pieces of at most ``capacity`` blocks), ``touch`` again, ``complete_store``;
  ``on_request_finished``.
* Prefix-level hit ratio: the sum of ``h`` over all requests divided by all block instances
  (a cached block counts only if every earlier block of its request hit). Cold start.
* Capacity: a fraction of the trace's unique blocks, rounded down.

Free rules (``free_rules=True``, the default here; issue #9 item 1):

1. A prompt's last block is not stored when it is partial (``input_length`` not a multiple of
   512 tokens): a real engine has no key for it, so it is neither stored nor touched.
2. Deepest-first eviction within a request's chain: after a request's transfers complete it is
   touched once more, so the chain's head is its most recent block. For LRU the manager's
   ``on_request_finished`` (called after every request, free rules or not) already does this;
   for ARC the touch also promotes the request's ready T1 blocks to T2 (docs/policies.md); the
   turn-aware policy additionally passes over blocks that have a resident child.

``kvcascade replay`` without ``--compare-policies`` keeps issue #2's byte-exact contract (every
listed block is complete and stored); the free rules are options of this mode only.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._types import LookupResult, ReqContext
from ..hints import SessionHint, admits_new_blocks
from ..index.cpu import CPUOffloadingManager
from ..policies import resolve_cache_policy
from .opt import belady_hits
from .run import block_key
from .trace import TOKENS_PER_BLOCK, TraceRequest

_HIT = LookupResult.HIT


def storable_blocks(request: TraceRequest, free_rules: bool) -> int:
    """Leading blocks of ``request`` that may be stored: all, or all but a partial last one."""
    n = len(request.hash_ids)
    if free_rules and n and request.input_length % TOKENS_PER_BLOCK:
        return n - 1
    return n


def unique_blocks(trace: Sequence[TraceRequest]) -> int:
    """Distinct block ids of ``trace``."""
    return len({h for request in trace for h in request.hash_ids})


def oracle_hints(
    trace: Sequence[TraceRequest], noise: float = 0.0, seed: int = 0
) -> list[SessionHint]:
    """``continues`` hints read off the trace: a request continues when a later request
    extends its chain (holds its last complete block at the same depth and is longer).

    ``noise`` (0–1) is the fraction of hints flipped, chosen with ``random.Random(seed)``.

    Raises:
        ValueError: ``noise`` outside ``[0, 1]``.
    """
    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"hint noise must be within [0, 1], got {noise}")
    # block id -> longest later request length holding it (chained ids fix the depth)
    longest_after: dict[int, int] = {}
    truth = [False] * len(trace)
    for i in range(len(trace) - 1, -1, -1):
        ids = trace[i].hash_ids
        full = storable_blocks(trace[i], True)
        if full:
            truth[i] = longest_after.get(ids[full - 1], 0) > full
        for h in ids:
            if longest_after.get(h, 0) < len(ids):
                longest_after[h] = len(ids)
    rng = random.Random(seed)
    return [SessionHint(continues=t != (rng.random() < noise)) for t in truth]


@dataclass
class PolicyRun:
    """Outcome of one simulated run: hit block instances of ``instances``, stores dropped."""

    policy: str
    capacity: int
    hits: int
    instances: int
    dropped_blocks: int = 0
    #: The policy's learned statistics after the run (``TurnAwareCachePolicy.state()``); None
    #: for a policy that keeps none (``lru``, ``arc``, ``s3fifo``).
    policy_state: dict[str, Any] | None = None

    @property
    def hit_ratio(self) -> float:
        """Prefix-level hit ratio."""
        return self.hits / self.instances if self.instances else 0.0


def simulate(
    trace: Sequence[TraceRequest],
    policy: str,
    capacity: int,
    free_rules: bool = True,
    hints: Sequence[SessionHint | None] | None = None,
    progress: Callable[[int], None] | None = None,
    policy_state: dict[str, Any] | None = None,
) -> PolicyRun:
    """Run ``trace`` through a :class:`CPUOffloadingManager` of ``capacity`` blocks.

    Args:
        trace: requests in arrival order.
        policy: eviction policy name (see :func:`kvcascade.policies.resolve_cache_policy`).
        capacity: blocks (``>= 0``).
        free_rules: apply the two free rules (module docstring).
        hints: per request, a hint set on its context (or None).
        progress: called with 1 after each request.
        policy_state: learned statistics to start from instead of a cold start (what
            ``TurnAwareCachePolicy.state()`` returns, as the lifecycle saves beside the fs
            tier: docs/policies.md, *State across restarts*); ignored by a policy that keeps
            none (:func:`keeps_state`).

    Raises:
        ConfigError: unknown policy or bad capacity.
        ValueError: ``policy_state`` is malformed or of another version or ``max_turn``.
    """
    manager = CPUOffloadingManager(capacity, policy)
    learns = keeps_state(manager.policy)
    if policy_state is not None and learns:
        manager.policy.set_state(policy_state)  # type: ignore[attr-defined]
    clock_s = [0.0]
    if hasattr(manager.policy, "clock"):
        manager.policy.clock = lambda: clock_s[0]  # type: ignore[attr-defined]
    keys_of: dict[int, bytes] = {}
    hits = instances = dropped = 0
    piece = max(1, capacity)
    lookup = manager.lookup
    for i, request in enumerate(trace):
        clock_s[0] = request.timestamp_ms / 1000.0
        keys = []
        for h in request.hash_ids:
            key = keys_of.get(h)
            if key is None:
                key = keys_of[h] = block_key(h)
            keys.append(key)
        n_store = storable_blocks(request, free_rules)
        store_keys = keys[:n_store]
        ctx = ReqContext(f"req-{i}")
        if hints is not None and hints[i] is not None:
            ctx.set_state(hints[i])
        run = 0
        for key in keys:
            if lookup(key, ctx) is not _HIT:
                break
            run += 1
        hits += run
        instances += len(keys)
        touched = store_keys if free_rules else keys
        manager.touch(touched, ctx)
        if run:
            manager.prepare_load(keys[:run], ctx)
            manager.complete_load(keys[:run], ctx)
        new = store_keys[run:]
        if new and not admits_new_blocks(ctx, manager.policy, len(new)):
            new = []
        for start in range(0, len(new), piece):
            out = manager.prepare_store(new[start : start + piece], ctx)
            if out is None:
                dropped += len(new[start : start + piece])
                continue
            manager.touch(touched, ctx)
            manager.complete_store(out.keys_to_store, ctx)
        if free_rules:
            manager.touch(touched, ctx)
        manager.on_request_finished(ctx)
        if progress is not None:
            progress(1)
    state = manager.policy.state() if learns else None  # type: ignore[attr-defined]
    return PolicyRun(policy, capacity, hits, instances, dropped, state)


def keeps_state(policy: object) -> bool:
    """Whether ``policy`` has learned statistics to hand over as a dict: ``state()`` /
    ``set_state()`` (``turn_aware``, ``adaptive``). The lifecycle needs the file half of the
    same contract, ``save_state`` / ``load_state`` (``kvcascade._policy_state.supports_state``).
    """
    return callable(getattr(policy, "state", None)) and callable(getattr(policy, "set_state", None))


def opt_run(trace: Sequence[TraceRequest], capacity: int, free_rules: bool = True) -> PolicyRun:
    """Belady's OPT (:func:`.opt.belady_hits`) on the same model as :func:`simulate`."""
    hits = belady_hits(
        [r.hash_ids for r in trace],
        capacity,
        [storable_blocks(r, free_rules) for r in trace],
    )
    return PolicyRun("opt", capacity, hits, sum(len(r.hash_ids) for r in trace))


@dataclass
class Comparison:
    """Per capacity fraction, each policy's run and OPT's."""

    fractions: list[float]
    capacities: list[int]
    policies: list[str]
    runs: dict[tuple[str, float], PolicyRun] = field(default_factory=dict)
    hints: str = "none"
    free_rules: bool = True
    #: Where the learning policies' starting statistics came from (None: a cold start).
    warm_from: str | None = None


def parse_hints(spec: str) -> tuple[bool, float]:
    """``none`` → (False, 0); ``oracle`` → (True, 0); ``oracle:0.1`` → (True, 0.1).

    Raises:
        ValueError: any other form.
    """
    if spec == "none":
        return False, 0.0
    name, _, noise = spec.partition(":")
    if name != "oracle":
        raise ValueError(f"--hints must be 'none' or 'oracle[:noise]', got {spec!r}")
    try:
        value = float(noise) if noise else 0.0
    except ValueError:
        raise ValueError(f"--hints noise must be a number, got {noise!r}") from None
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"--hints noise must be within [0, 1], got {value}")
    return True, value


def compare(
    trace: Sequence[TraceRequest],
    policies: Sequence[str],
    fractions: Sequence[float],
    free_rules: bool = True,
    hints: str = "none",
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
    policy_state: dict[str, Any] | None = None,
    warm_from: str | None = None,
) -> Comparison:
    """Simulate every policy at every capacity fraction, plus OPT (see :func:`simulate`).

    Hints (``none`` or ``oracle[:noise]``, :func:`oracle_hints`) go to every policy; OPT needs
    none. ``policy_state`` (``warm_from`` names its source in the table's title) is where every
    policy that learns starts (:func:`simulate`); it is checked against each of them before any
    run, and at least one of ``policies`` must learn.

    Raises:
        ValueError: a trace of no blocks, a fraction outside ``(0, 1]`` or of 0 blocks, a
            policy or fraction given twice or two fractions of one size in blocks (its column
            or row would be printed twice), a bad ``hints`` spec, a
            ``policy_state`` a learning policy refuses (malformed, another version or
            ``max_turn``) or one that no policy of ``policies`` learns from.
        ConfigError: an unknown policy.
    """
    for what, values in (("policy", policies), ("capacity fraction", fractions)):
        seen: set[object] = set()
        for value in values:
            if value in seen:
                raise ValueError(f"{what} {value!r} is given twice; give each once")
            seen.add(value)
    for name in policies:  # before any run: a bad last name cost the runs of the others
        resolve_cache_policy(name)
    use_hints, noise = parse_hints(hints)
    if policy_state is not None:
        source = repr(warm_from) if warm_from else "policy_state"
        learners = 0
        for name in policies:
            probe = CPUOffloadingManager(1, name).policy
            if not keeps_state(probe):
                continue
            learners += 1
            try:
                probe.set_state(policy_state)  # type: ignore[attr-defined]
            except ValueError as exc:
                raise ValueError(f"{source} does not suit policy {name!r}: {exc}") from exc
        if not learners:
            raise ValueError(
                f"{source}: none of the policies {', '.join(policies)} learns, so none would "
                "start from it (turn_aware and adaptive do)"
            )
    request_hints = oracle_hints(trace, noise, seed) if use_hints else None
    unique = unique_blocks(trace)
    if not unique:
        raise ValueError("the trace has no blocks to cache (every request's hash_ids is empty)")
    capacities: list[int] = []
    for fraction in fractions:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"capacity fractions must be within (0, 1], got {fraction}")
        capacity = int(fraction * unique)
        if not capacity:  # a row of a 0-block cache, while 0 itself is refused
            raise ValueError(
                f"capacity fraction {fraction} of the trace's {unique:,} unique blocks is 0 "
                f"blocks; give at least 1/{unique:,}"
            )
        if capacity in capacities:  # its row would be printed twice
            other = fractions[capacities.index(capacity)]
            raise ValueError(
                f"capacity fractions {other} and {fraction} are both {capacity:,} blocks of the "
                f"trace's {unique:,} unique blocks; give each size once"
            )
        capacities.append(capacity)
    result = Comparison(list(fractions), capacities, list(policies), hints=hints)
    result.free_rules = free_rules
    if policy_state is not None:
        result.warm_from = warm_from or "the given state"
    for fraction, capacity in zip(fractions, capacities):
        for name in policies:
            result.runs[(name, fraction)] = simulate(
                trace, name, capacity, free_rules, request_hints, progress, policy_state
            )
        result.runs[("opt", fraction)] = opt_run(trace, capacity, free_rules)
    return result


def format_comparison(result: Comparison) -> str:
    """The comparison as a fixed-width table: one row per capacity, one column per policy."""
    names = [*result.policies, "opt"]
    width = max(10, *(len(n) + 2 for n in names))
    header = f"{'capacity':>9}{'blocks':>9}" + "".join(f"{n:>{width}}" for n in names)
    lines = [
        f"kvcascade replay --compare-policies (prefix-level hit ratio; free rules "
        f"{'on' if result.free_rules else 'off'}; hints {result.hints}"
        + (f"; learning policies start from {result.warm_from!r}" if result.warm_from else "")
        + ")",
        header,
        "-" * len(header),
    ]
    for fraction, capacity in zip(result.fractions, result.capacities):
        row = f"{fraction:>9.2%}{capacity:>9,}"
        for name in names:
            row += f"{result.runs[(name, fraction)].hit_ratio:>{width}.4f}"
        lines.append(row)
    return "\n".join(lines)
