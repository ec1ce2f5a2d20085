"""``CPUOffloadingManager.on_request_finished``: the request's accesses handed to the policy once,
as vLLM 0.32's ``kv_offload/cpu/manager.py`` does, and ``lru`` / ``arc``'s rules for them
(``kv_offload/cpu/policies/lru.py`` / ``arc.py``). Keys in vLLM's layout (hash + 4-byte group).
"""

from __future__ import annotations

import pytest

from kvcascade import CPUOffloadingManager, ReqContext, make_offload_key


def k(*ids: int, group: int = 0) -> list[bytes]:
    """Keys of small integers in KV-cache group ``group``."""
    return [make_offload_key(b"h%d" % i, group) for i in ids]


def store(mgr: CPUOffloadingManager, keys: list[bytes], ctx: ReqContext) -> list[bytes]:
    """Store ``keys`` for ``ctx``'s request; returns the keys evicted to make room."""
    out = mgr.prepare_store(keys, ctx)
    assert out is not None
    mgr.complete_store(out.keys_to_store, ctx)
    return out.evicted_keys


def load(mgr: CPUOffloadingManager, keys: list[bytes], ctx: ReqContext) -> None:
    mgr.prepare_load(keys, ctx)
    mgr.complete_load(keys, ctx)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_request_keys_are_evicted_deepest_first(policy: str) -> None:
    """A finished request's chain is evicted tail first (15, 14, …), not in store order."""
    mgr = CPUOffloadingManager(16, policy)
    ctx = ReqContext("r1")
    for start in range(0, 16, 4):  # four stores, head first
        store(mgr, k(*range(start, start + 4)), ctx)
    mgr.on_request_finished(ctx)
    evicted = store(mgr, k(100, 101, 102), ReqContext("r2"))
    assert evicted == k(15, 14, 13)


def test_without_finish_store_order_stands() -> None:
    """Until the request finishes, completion order rules (head evicted first)."""
    mgr = CPUOffloadingManager(4, "lru")
    store(mgr, k(0, 1, 2, 3), ReqContext("r1"))
    assert store(mgr, k(9), ReqContext("r2")) == k(0)


def test_lru_groups_one_after_the_other() -> None:
    """Keys of two groups, presented interleaved: group 0's head is most recent, then group 0's
    tail, then group 1's head … group 1's tail is evicted first (vLLM ``order_request_keys``
    without token positions)."""
    mgr = CPUOffloadingManager(4, "lru")
    ctx = ReqContext("r1")
    a, b = k(0, 1), k(0, 1, group=1)
    store(mgr, [a[0], b[0], a[1], b[1]], ctx)
    mgr.on_request_finished(ctx)
    assert mgr.policy.evictable_keys() == [b[1], b[0], a[1], a[0]]


def test_arc_reuse_counts_once_and_insertion_keeps_t1() -> None:
    """ARC: a ready key the request loaded moves T1 → T2 once; a key it only inserted stays in
    T1, moved to its recent end; a key it inserted and then read back is not a reuse."""
    mgr = CPUOffloadingManager(8, "arc")
    r1 = ReqContext("r1")
    store(mgr, k(0, 1), r1)
    mgr.on_request_finished(r1)
    assert list(mgr.policy.t1) == k(1, 0) and list(mgr.policy.t2) == []

    r2 = ReqContext("r2")
    load(mgr, k(0), r2)
    store(mgr, k(0, 2, 3), r2)  # 0 offered again while ready: still one reuse
    load(mgr, k(2), r2)  # its own insertion read back (a cascade, a promotion): no reuse
    mgr.on_request_finished(r2)
    assert list(mgr.policy.t1) == k(1, 3, 2)
    assert list(mgr.policy.t2) == k(0)

    r3 = ReqContext("r3")
    load(mgr, k(0, 1), r3)
    mgr.on_request_finished(r3)
    assert list(mgr.policy.t1) == k(3, 2)
    assert list(mgr.policy.t2) == k(1, 0)


def test_finish_applies_once_and_not_across_reset() -> None:
    """A second call is a no-op; a context recorded before ``reset_cache`` is void after it."""
    mgr = CPUOffloadingManager(4, "lru")
    r1 = ReqContext("r1")
    store(mgr, k(0, 1), r1)
    mgr.on_request_finished(r1)
    r2 = ReqContext("r2")
    store(mgr, k(2, 3), r2)
    mgr.on_request_finished(r2)
    mgr.on_request_finished(r1)  # would make 1, 0 the most recent again
    assert mgr.policy.evictable_keys() == k(1, 0, 3, 2)

    r3 = ReqContext("r3")
    store(mgr, k(5, 6), r3)
    mgr.reset_cache()
    store(mgr, k(7, 8), ReqContext("r4"))
    mgr.on_request_finished(r3)  # recorded before the reset: nothing happens
    assert mgr.policy.evictable_keys() == k(7, 8)


def test_a_context_used_after_its_finish_starts_a_new_record() -> None:
    """Where vLLM asserts, a context that presents keys again after its finish is a new record:
    its next finish ranks only what it presented since."""
    mgr = CPUOffloadingManager(4, "lru")
    ctx = ReqContext("r1")
    store(mgr, k(0, 1), ctx)
    mgr.on_request_finished(ctx)
    store(mgr, k(2), ReqContext("r2"))
    store(mgr, k(3), ctx)
    mgr.on_request_finished(ctx)
    assert mgr.policy.evictable_keys() == k(1, 0, 2, 3)


def _chains(mgr: CPUOffloadingManager, touch: bool) -> list[bytes]:
    """200 requests extending or starting chains (seeded), on the manager API, each finished;
    ``touch``: also touch every request's keys as the fronts do. Returns the evicted keys."""
    import random

    rng = random.Random(0)
    chains: list[int] = []
    evicted: list[bytes] = []
    for i in range(200):
        if chains and rng.random() < 0.6:
            c = rng.randrange(len(chains))
            chains[c] += rng.randint(1, 4)
        else:
            chains.append(rng.randint(2, 8))
            c = len(chains) - 1
        keys = [make_offload_key(b"c%d-%d" % (c, j), 0) for j in range(chains[c])]
        ctx = ReqContext(f"r{i}")
        run = 0
        while run < len(keys) and mgr.lookup(keys[run], ctx).name == "HIT":
            run += 1
        if touch:
            mgr.touch(keys, ctx)
        if run:
            load(mgr, keys[:run], ctx)
        out = mgr.prepare_store(keys[run:], ctx)
        if out is not None:
            evicted += out.evicted_keys
            mgr.complete_store(out.keys_to_store, ctx)
        mgr.on_request_finished(ctx)
    return evicted


def test_adaptive_lru_mode_evicts_as_lru() -> None:
    """docs/policies.md: ``adaptive`` in LRU mode ranks exactly as ``lru`` (with its
    request-finish ranking) when the front touches every request's keys, as ours do."""
    lru = _chains(CPUOffloadingManager(60, "lru"), True)
    adaptive_mgr = CPUOffloadingManager(60, "adaptive")
    adaptive = _chains(adaptive_mgr, True)
    assert adaptive_mgr.policy.lru_mode and len(lru) > 1000
    assert adaptive == lru
