"""CPUOffloadingManager conformance: the applicable scenarios of vLLM's
``tests/v1/kv_offload/cpu/test_manager.py``), LRU and ARC where the scenario applies to both.

Not applicable: vLLM's test_filter_reused_manager_reports_stores_skipped_counter and
test_filter_reused_manager (the reuse filter, ``store_threshold``, is not implemented).
"""

from __future__ import annotations

from collections import OrderedDict

import pytest

from kvcascade import CPUOffloadingManager, LookupResult, Medium, ReqContext
from kvcascade.policies import ARCCachePolicy, BlockStatus, LRUCachePolicy

HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING


def k(*ids: int) -> list[bytes]:
    """Keys for small integers."""
    return [b"key%d" % i for i in ids]


def slots(out) -> list[int]:
    return out.store_spec.block_ids.tolist()


def events(mgr: CPUOffloadingManager) -> list[tuple[str, set[bytes]]]:
    return [("removed" if e.removed else "stored", set(e.keys)) for e in mgr.take_events()]


def store(mgr: CPUOffloadingManager, *ids: int):
    out = mgr.prepare_store(k(*ids))
    assert out is not None
    mgr.complete_store(out.keys_to_store)
    return out


def test_cpu_eviction_removed_precedes_stored() -> None:
    """vLLM test_cpu_eviction_removed_precedes_stored: the removal event of an eviction precedes the
    store event; medium CPU."""
    mgr = CPUOffloadingManager(2, enable_events=True)
    store(mgr, 1, 2)
    list(mgr.take_events())
    store(mgr, 3)
    evs = list(mgr.take_events())
    assert [(e.removed, e.keys) for e in evs] == [(True, k(1)), (False, k(3))]
    assert all(e.medium is Medium.CPU for e in evs)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_already_stored_block_not_evicted_during_prepare_store(policy: str) -> None:
    """vLLM test_already_stored_block_not_evicted_during_prepare_store: keys of the call are
    protected; the LRU candidate 2 (passed again) survives."""
    mgr = CPUOffloadingManager(4, policy)
    store(mgr, 1, 2)
    mgr.touch(k(1))
    out = mgr.prepare_store(k(2, 3, 4, 5))
    assert out is not None
    assert out.keys_to_store == k(3, 4, 5)
    assert slots(out) == [2, 3, 0]
    assert out.evicted_keys == k(1)
    mgr.complete_store(out.keys_to_store)
    assert mgr.lookup(k(2)[0]) is HIT


def test_cpu_manager_reports_cache_usage_gauge() -> None:
    """vLLM test_cpu_manager_reports_cache_usage_gauge: usage is 0 for capacity 0 and an empty
    cache, 0.5/1.0 at 2/4 allocated, then drops to 0.5/0.0 as stores complete."""
    assert CPUOffloadingManager(0).get_stats().usage == 0.0
    mgr = CPUOffloadingManager(4)
    assert mgr.get_stats().usage == 0.0
    mgr.prepare_store(k(1, 2))
    assert mgr.get_stats().usage == 0.5
    mgr.prepare_store(k(3, 4))
    assert mgr.get_stats().usage == 1.0
    mgr.complete_store(k(1, 2))
    assert mgr.get_stats().usage == 0.5
    mgr.complete_store(k(3, 4))
    assert mgr.get_stats().usage == 0.0


def test_cpu_manager_reports_allocation_size_histogram() -> None:
    """vLLM test_cpu_manager_reports_allocation_size_histogram: allocations of 2 then 1 new key (3
    requested, 2 present) → count 2, sum 3; the next call has no samples. Buckets are vLLM's 1, 4,
    16, …, 262144."""
    mgr = CPUOffloadingManager(8)
    store(mgr, 1, 2)
    store(mgr, 1, 2, 3)
    stats = mgr.get_stats()
    assert (stats.allocation_count, stats.allocation_sum) == (2, 3)
    assert stats.allocation_counts[:2] == [1, 1]  # 1 key → bucket "≤1", 2 keys → "≤4"
    assert mgr.get_stats().allocation_count == 0


def test_cpu_manager_reports_allocation_size_on_allocation_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM test_cpu_manager_reports_allocation_size_on_allocation_failure: an allocation that
    raises is still recorded (count 1, sum 3); the error escapes."""
    mgr = CPUOffloadingManager(8)

    def boom(n: int) -> list:
        raise RuntimeError("allocation failed")

    monkeypatch.setattr(mgr, "_allocate", boom)
    with pytest.raises(RuntimeError, match="allocation failed"):
        mgr.prepare_store(k(1, 2, 3))
    stats = mgr.get_stats()
    assert (stats.allocation_count, stats.allocation_sum) == (1, 3)


def test_cpu_manager_reports_allocation_size_on_eviction_failure() -> None:
    """vLLM test_cpu_manager_reports_allocation_size_on_eviction_failure: capacity 1 with a pinned
    block: prepare_store returns None, histogram records 1."""
    mgr = CPUOffloadingManager(1)
    store(mgr, 1)
    mgr.prepare_load(k(1))
    mgr.get_stats()
    assert mgr.prepare_store(k(2)) is None
    stats = mgr.get_stats()
    assert (stats.allocation_count, stats.allocation_sum) == (1, 1)


def test_cpu_manager_reports_cache_write_and_read_usage_gauges() -> None:
    """vLLM test_cpu_manager_reports_cache_write_and_read_usage_gauges: write usage while stores
    pend, read usage while loads pin, and their sum."""
    mgr = CPUOffloadingManager(4)
    mgr.prepare_store(k(1, 2))
    assert mgr.get_stats().write_usage == 0.5
    mgr.complete_store(k(1, 2))
    stats = mgr.get_stats()
    assert (stats.write_usage, stats.read_usage) == (0.0, 0.0)
    mgr.prepare_load(k(1))
    assert mgr.get_stats().read_usage == 0.25
    mgr.prepare_store(k(3, 4))
    stats = mgr.get_stats()
    assert (stats.write_usage, stats.read_usage, stats.usage) == (0.5, 0.25, 0.75)


def test_cpu_manager_clears_write_usage_after_failed_store() -> None:
    """vLLM test_cpu_manager_clears_write_usage_after_failed_store: a failed completion returns
    write, read and total usage to 0."""
    mgr = CPUOffloadingManager(4)
    mgr.prepare_store(k(1, 2))
    mgr.complete_store(k(1, 2), success=False)
    stats = mgr.get_stats()
    assert (stats.write_usage, stats.read_usage, stats.usage) == (0.0, 0.0, 0.0)
    assert mgr.num_free == 4


def test_cpu_manager() -> None:
    """vLLM test_cpu_manager, the LRU walkthrough (capacity 4): slots, victims, None when full, load
    pinning, touch order, failed completion and the exact event sets."""
    mgr = CPUOffloadingManager(4, "lru", enable_events=True)
    out = mgr.prepare_store(k(1, 2))
    assert slots(out) == [0, 1]
    mgr.complete_store(k(1, 2))
    assert [mgr.lookup(x) for x in k(1, 2)] == [HIT, HIT]
    out = mgr.prepare_store(k(2, 3, 4, 5))
    assert (out.keys_to_store, out.evicted_keys, slots(out)) == (k(3, 4, 5), k(1), [2, 3, 0])
    assert mgr.prepare_store(k(1, 6)) is None
    mgr.complete_store(k(2, 3, 4, 5))
    assert mgr.prepare_load(k(2, 3)).block_ids.tolist() == [1, 2]
    assert mgr.prepare_store(k(6, 7, 8)) is None  # 2 and 3 are pinned
    mgr.complete_load(k(2, 3))  # no use: 2 and 3 keep their rank (vLLM 0.32's LRU)
    out = mgr.prepare_store(k(6, 7, 8))
    assert (out.evicted_keys, slots(out)) == (k(2, 3, 4), [3, 2, 1])
    mgr.complete_store(k(6, 7, 8))
    mgr.touch(k(5, 6, 7))
    assert mgr.policy.evictable_keys() == k(8, 7, 6, 5)
    out = mgr.prepare_store(k(9))
    assert (out.evicted_keys, slots(out)) == (k(8), [1])
    mgr.complete_store(k(7, 9), success=False)
    assert (mgr.lookup(k(7)[0]), mgr.lookup(k(9)[0])) == (HIT, MISS)
    assert events(mgr) == [
        ("stored", set(k(1, 2))),
        ("removed", set(k(1))),
        ("stored", set(k(3, 4, 5))),
        ("removed", set(k(2, 3, 4))),
        ("stored", set(k(6, 7, 8))),
        ("removed", set(k(8))),
    ]


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_prepare_load_preserves_key_order(policy: str) -> None:
    """vLLM test_prepare_load_preserves_key_order: prepare_load's slot ids are co-indexed with the
    keys, forward and permuted."""
    mgr = CPUOffloadingManager(4, policy)
    store(mgr, 1, 2, 3, 4)
    assert mgr.prepare_load(k(1, 2, 3, 4)).block_ids.tolist() == [0, 1, 2, 3]
    assert mgr.prepare_load(k(3, 1, 4, 2)).block_ids.tolist() == [2, 0, 3, 1]


def arc(mgr: CPUOffloadingManager) -> ARCCachePolicy:
    assert isinstance(mgr.policy, ARCCachePolicy)
    return mgr.policy


def test_arc_basic() -> None:
    """vLLM TestARCPolicy.test_basic: HIT_PENDING before completion, HIT after, MISS unknown; both
    in T1."""
    mgr = CPUOffloadingManager(4, "arc")
    mgr.prepare_store(k(1, 2))
    assert mgr.lookup(k(1)[0]) is PENDING
    mgr.complete_store(k(1, 2))
    assert [mgr.lookup(x) for x in k(1, 2, 3)] == [HIT, HIT, MISS]
    assert list(arc(mgr).t1) == k(1, 2) and not arc(mgr).t2


def test_arc_t1_to_t2_promotion() -> None:
    """vLLM TestARCPolicy.test_t1_to_t2_promotion: touching a completed T1 block moves it to T2; a
    not-ready one stays in T1."""
    mgr = CPUOffloadingManager(4, "arc")
    store(mgr, 1)
    mgr.prepare_store(k(2))
    mgr.touch(k(1, 2))
    assert list(arc(mgr).t2) == k(1) and list(arc(mgr).t1) == k(2)


def test_arc_eviction_with_load() -> None:
    """vLLM TestARCPolicy.test_eviction_with_load: blocks pinned by loads block eviction; after
    complete_load it succeeds."""
    mgr = CPUOffloadingManager(2, "arc")
    store(mgr, 1, 2)
    mgr.prepare_load(k(1, 2))
    assert mgr.prepare_store(k(3)) is None
    mgr.complete_load(k(1, 2))
    out = mgr.prepare_store(k(3))
    assert out is not None and len(out.evicted_keys) >= 1


def test_arc_adaptive_target() -> None:
    """vLLM TestARCPolicy.test_adaptive_target: an evicted key lands in B1; touching the ghost
    raises target_t1_size."""
    mgr = CPUOffloadingManager(2, "arc")
    store(mgr, 1, 2)
    store(mgr, 3)
    assert list(arc(mgr).b1) == k(1)
    before = arc(mgr).target_t1_size
    mgr.touch(k(1))
    assert arc(mgr).target_t1_size > before


def test_arc_t1_t2_eviction_policy() -> None:
    """vLLM TestARCPolicy.test_t1_t2_eviction_policy: T1={1,2}, T2={3,4}, |T1| ≥ target: a new store
    evicts 1 into B1; 5 joins T1."""
    mgr = CPUOffloadingManager(4, "arc")
    store(mgr, 1, 2, 3, 4)
    mgr.touch(k(3, 4))
    out = store(mgr, 5)
    assert out.evicted_keys == k(1)
    assert list(arc(mgr).b1) == k(1) and list(arc(mgr).t1) == k(2, 5)


class _CountingDict(OrderedDict):
    """Counts how often each key is yielded by ``items()`` iterations."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.yields: dict[bytes, int] = {}

    def items(self):  # type: ignore[override]
        for item in super().items():
            self.yields[item[0]] = self.yields.get(item[0], 0) + 1
            yield item


def _count_scans(policy: ARCCachePolicy) -> tuple[_CountingDict, _CountingDict]:
    policy._t1 = _CountingDict(policy._t1)
    policy._t2 = _CountingDict(policy._t2)
    return policy._t1, policy._t2


def test_arc_batch_eviction_scans_t1_and_t2_once() -> None:
    """vLLM TestARCPolicy.test_batch_eviction_scans_t1_and_t2_once: batch order = T1 picks then T2
    picks; each entry is yielded at most once."""
    policy = ARCCachePolicy(4)
    for i, key in enumerate(k(1, 2, 3, 4)):
        policy.insert(key, _ready(i))
    policy.touch(k(3, 4))
    t1, t2 = _count_scans(policy)
    victims = policy.evict(3, set())
    assert [key for key, _ in victims] == k(1, 2, 4)
    assert max(t1.yields.values()) == 1 and max(t2.yields.values()) == 1


def test_arc_batch_eviction_falls_back_after_t1_iterator_exhausted() -> None:
    """vLLM TestARCPolicy.test_batch_eviction_falls_back_after_t1_iterator_exhausted: one eligible
    T1 entry with |T1| ≥ target: the rest come from T2, in order."""
    policy = ARCCachePolicy(6)
    for i, key in enumerate(k(1, 2, 3, 4)):
        policy.insert(key, _ready(i))
    policy.get(k(2)[0]).ref_cnt = 1  # pinned
    policy.touch(k(4, 3))  # T2 = [3, 4]
    t1, t2 = _count_scans(policy)
    victims = policy.evict(3, set())
    assert [key for key, _ in victims] == k(1, 3, 4)
    assert max(t1.yields.values()) == 1 and max(t2.yields.values()) == 1


def test_arc_batch_eviction_failure_is_atomic() -> None:
    """vLLM TestARCPolicy.test_batch_eviction_failure_is_atomic: evict(2) with one candidate returns
    None and leaves T1/T2/B1/B2 unchanged."""
    policy = ARCCachePolicy(4)
    for i, key in enumerate(k(1, 2)):
        policy.insert(key, _ready(i))
    policy.get(k(2)[0]).ref_cnt = -1
    state = [list(x) for x in (policy.t1, policy.t2, policy.b1, policy.b2)]
    assert policy.evict(2, set()) is None
    assert [list(x) for x in (policy.t1, policy.t2, policy.b1, policy.b2)] == state


def test_arc_ghost_list_bounds() -> None:
    """vLLM TestARCPolicy.test_ghost_list_bounds: after many evictions |B1|, |B2| ≤ capacity and the
    target stays in [0, c]."""
    mgr = CPUOffloadingManager(3, "arc")
    for i in range(60):
        store(mgr, i)
        mgr.touch(k(i, i - 1, i - 5, i - 9))
        policy = arc(mgr)
        assert len(policy.b1) <= 3 and len(policy.b2) <= 3
        assert 0 <= policy.target_t1_size <= 3


def test_arc_touch_ordering() -> None:
    """vLLM TestARCPolicy.test_touch_ordering: touch [1,3,4] promotes 1 and refreshes 3,4: T1={2},
    T2={1,3,4}; next store evicts 2."""
    mgr = CPUOffloadingManager(4, "arc")
    store(mgr, 1, 2, 3, 4)
    mgr.touch(k(3, 4))
    mgr.touch(k(1, 3, 4))
    assert list(arc(mgr).t1) == k(2) and list(arc(mgr).t2) == k(4, 3, 1)
    assert store(mgr, 5).evicted_keys == k(2)


def test_arc_failed_store() -> None:
    """vLLM TestARCPolicy.test_failed_store: a failed new key leaves T1/T2 (MISS); its victim stays
    evicted (in B1)."""
    mgr = CPUOffloadingManager(1, "arc")
    store(mgr, 1)
    mgr.prepare_store(k(2))
    mgr.complete_store(k(2), success=False)
    assert (mgr.lookup(k(1)[0]), mgr.lookup(k(2)[0])) == (MISS, MISS)
    assert list(arc(mgr).b1) == k(1) and not arc(mgr).t1 and not arc(mgr).t2


def test_arc_full_scenario() -> None:
    """vLLM TestARCPolicy.test_full_scenario: evictions come from T1 while the T2 members 2 and 3
    stay HIT; event sets."""
    mgr = CPUOffloadingManager(3, "arc", enable_events=True)
    store(mgr, 1, 2, 3)
    mgr.touch(k(2, 3))
    assert store(mgr, 4).evicted_keys == k(1)
    assert store(mgr, 5).evicted_keys == k(4)
    assert [mgr.lookup(x) for x in k(2, 3, 5)] == [HIT, HIT, HIT]
    assert events(mgr) == [
        ("stored", set(k(1, 2, 3))),
        ("removed", set(k(1))),
        ("stored", set(k(4))),
        ("removed", set(k(4))),
        ("stored", set(k(5))),
    ]


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_evictable_cache_block_count(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM test_evictable_cache_block_count: num_evictable through store/complete, a double load
    (no double decrement), eviction, failed store, reset, and the fast-path None that never consults
    the policy."""
    mgr = CPUOffloadingManager(2, policy)
    mgr.prepare_store(k(1, 2))
    assert mgr.num_evictable == 0
    mgr.complete_store(k(1, 2))
    assert mgr.num_evictable == 2
    mgr.prepare_load(k(1))
    mgr.prepare_load(k(1))
    assert mgr.num_evictable == 1
    mgr.complete_load(k(1))
    assert mgr.num_evictable == 1
    mgr.complete_load(k(1))
    assert mgr.num_evictable == 2
    out = mgr.prepare_store(k(3))
    assert len(out.evicted_keys) == 1 and mgr.num_evictable == 1
    mgr.complete_store(k(3), success=False)
    assert mgr.num_evictable == 1 and mgr.num_free == 1
    mgr.reset_cache()
    assert (mgr.num_evictable, mgr.num_write_pending, mgr.num_free) == (0, 0, 2)
    mgr.prepare_store(k(4, 5))

    def never(*args: object) -> None:
        raise AssertionError("policy.evict must not be called")

    monkeypatch.setattr(mgr.policy, "evict", never)
    assert mgr.prepare_store(k(6)) is None


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_touch_forwards_req_context_to_policy(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM test_touch_forwards_req_context_to_policy: manager.touch passes the same keys and
    ReqContext object to the policy."""
    mgr = CPUOffloadingManager(2, policy)
    seen = []
    monkeypatch.setattr(mgr.policy, "touch", lambda keys, ctx: seen.append((keys, ctx)))
    ctx, keys = ReqContext("r1"), k(1, 2)
    mgr.touch(keys, ctx)
    assert seen == [(keys, ctx)] and seen[0][1] is ctx


def test_lookup_counters_and_reset() -> None:
    """vLLM's ``get_stats`` counters (lookups, hits, pending hits, evictions) and reset_cache."""
    mgr = CPUOffloadingManager(1)
    store(mgr, 1)
    mgr.prepare_store(k(2))  # evicts 1
    for key in k(1, 2):
        mgr.lookup(key)
    stats = mgr.get_stats()
    assert (stats.lookups, stats.hits, stats.pending_hits, stats.evictions) == (2, 0, 1, 1)
    mgr.reset_cache()
    assert mgr.lookup(k(2)[0]) is MISS and mgr.prepare_store(k(3)).store_spec.block_ids[0] == 0


def _ready(slot: int) -> BlockStatus:
    return BlockStatus(slot, 0)


def test_lru_policy_is_registered_default() -> None:
    """The default policy is LRU, as in vLLM's ``kv_offload/cpu/manager.py``."""
    assert isinstance(CPUOffloadingManager(1).policy, LRUCachePolicy)
