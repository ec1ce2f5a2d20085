"""Cache policies: the registry (vLLM's
``tests/v1/kv_offload/cpu/policies/test_factory.py``), our ARC fallback (docs/cpu-tier.md), and a
model-based stateful test of CPUOffloadingManager with LRU and ARC."""

from __future__ import annotations

import re
import sys
import types

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    rule,
)

import kvcascade as kc
from kvcascade import ConfigError, CPUOffloadingManager, LookupResult, ReqContext
from kvcascade.policies import (
    ARCCachePolicy,
    BlockStatus,
    CachePolicy,
    LRUCachePolicy,
    register_cache_policy,
    registered_cache_policies,
    registry,
    resolve_cache_policy,
)
from kvcascade.policies.s3fifo import S3FIFOCachePolicy


@pytest.fixture
def isolated_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))


class CustomPolicy(LRUCachePolicy):
    """An out-of-tree policy for the factory tests."""


@pytest.fixture
def custom_module(monkeypatch: pytest.MonkeyPatch) -> str:
    module = types.ModuleType("kvc_custom_policies")
    module.CustomPolicy = CustomPolicy  # type: ignore[attr-defined]
    module.NotAPolicy = dict  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module.__name__


def test_pre_registered_policies_can_be_imported() -> None:
    """vLLM test_pre_registered_policies_can_be_imported: every registry entry resolves to a
    CachePolicy subclass."""
    for name in registered_cache_policies():
        assert issubclass(resolve_cache_policy(name), CachePolicy)


def test_lru_and_arc_registered() -> None:
    """vLLM test_lru_and_arc_registered: "lru" and "arc" resolve to the LRU and ARC classes."""
    assert resolve_cache_policy("lru") is LRUCachePolicy
    assert resolve_cache_policy("arc") is ARCCachePolicy


def test_register_and_resolve_custom_policy(isolated_registry: None) -> None:
    """vLLM test_register_and_resolve_custom_policy: a registered custom policy resolves and the
    manager uses it."""
    register_cache_policy("custom", CustomPolicy)
    assert resolve_cache_policy("custom") is CustomPolicy
    assert type(CPUOffloadingManager(2, "custom").policy) is CustomPolicy


def test_register_lazy_string(isolated_registry: None, custom_module: str) -> None:
    """Registering a "module:Class" string imports it only when resolved."""
    register_cache_policy("lazy", f"{custom_module}:CustomPolicy")
    assert resolve_cache_policy("lazy") is CustomPolicy


@pytest.mark.parametrize("name", ["nope", "nope:", "a:b:c"])
def test_unregistered_policy_raises(name: str) -> None:
    """vLLM test_unregistered_policy_raises / test_unregistered_policy_without_module_path_raises:
    unknown name (no module path) → ValueError "Unknown cache policy" listing the registered
    names."""
    with pytest.raises(ValueError, match="Unknown cache policy") as info:
        resolve_cache_policy(name)
    assert isinstance(info.value, ConfigError)
    assert "arc" in str(info.value) and "lru" in str(info.value)
    with pytest.raises(ConfigError, match="Unknown cache policy"):
        CPUOffloadingManager(1, name)


def test_duplicate_registration_raises(isolated_registry: None) -> None:
    """vLLM test_duplicate_registration_raises: registering a taken name → ValueError "is already
    registered"."""
    with pytest.raises(ValueError, match="is already registered"):
        register_cache_policy("lru", CustomPolicy)


@pytest.mark.parametrize(
    ("name", "cls", "message"),
    [
        (7, "kvcascade.policies.lru:LRUCachePolicy", "must be a non-empty string, got 7"),
        ("", "kvcascade.policies.lru:LRUCachePolicy", "must be a non-empty string, got ''"),
        ("mine", dict, "expected a CachePolicy subclass or 'module.path:ClassName'"),
        ("mine", "no-colon", "expected a CachePolicy subclass or 'module.path:ClassName'"),
    ],
)
def test_a_bad_registration_is_refused(
    isolated_registry: None, name: object, cls: object, message: str
) -> None:
    """A non-string name registered broke every later "Unknown cache policy" message (sorting
    an int among strings: TypeError); nothing is registered when refused."""
    before = registered_cache_policies()
    with pytest.raises(ValueError, match=re.escape(message)):
        register_cache_policy(name, cls)  # type: ignore[arg-type]
    assert registered_cache_policies() == before
    with pytest.raises(ConfigError, match="Unknown cache policy 'typo'"):
        resolve_cache_policy("typo")


def test_an_abstract_policy_class_is_refused_by_the_config() -> None:
    """It validated, and failed only when the primary tier was built ("Can't instantiate")."""
    with pytest.raises(ConfigError, match="is an abstract class"):
        kc.CascadeConfig(cpu_blocks=4, eviction_policy="kvcascade.policies.base:CachePolicy")


def test_dynamic_load_via_cache_policy_module_path(custom_module: str) -> None:
    """vLLM test_dynamic_load_via_cache_policy_module_path: an unregistered name plus a module path
    resolves the class of that name; so does "module:Class"."""
    assert resolve_cache_policy("CustomPolicy", custom_module) is CustomPolicy
    assert resolve_cache_policy(f"{custom_module}:CustomPolicy") is CustomPolicy


def test_manager_resolves_policy_via_module_path(custom_module: str) -> None:
    """vLLM test_manager_resolves_policy_via_module_path: a manager built with a module path uses
    that policy."""
    mgr = CPUOffloadingManager(2, "CustomPolicy", cache_policy_module_path=custom_module)
    assert type(mgr.policy) is CustomPolicy


def test_bad_policy_classes_raise(custom_module: str) -> None:
    """Non-policy classes, missing classes and missing modules are ConfigErrors."""
    with pytest.raises(ConfigError, match="not a CachePolicy"):
        resolve_cache_policy(f"{custom_module}:NotAPolicy")
    with pytest.raises(ConfigError, match="has no class"):
        resolve_cache_policy(f"{custom_module}:Missing")
    with pytest.raises(ConfigError, match="cannot import"):
        resolve_cache_policy("kvc_no_such_module:X")


def _arc_with(t1_ready: int, t2_ready: int, t2_pinned: int, target: float) -> ARCCachePolicy:
    policy = ARCCachePolicy(8)
    t2_keys = []
    for i in range(t1_ready + t2_ready + t2_pinned):
        policy.insert(b"k%d" % i, BlockStatus(i, 0))
        if i >= t1_ready:
            t2_keys.append(b"k%d" % i)
    policy.touch(t2_keys)
    for key in t2_keys[t2_ready:]:
        policy.get(key).ref_cnt = 1
    policy.target_t1_size = target
    return policy


def test_arc_falls_back_to_t1_when_t2_has_no_candidate() -> None:
    """Divergence (docs/cpu-tier.md): |T1| < target and T2 all pinned: vLLM returns None, we evict
    T1."""
    policy = _arc_with(t1_ready=2, t2_ready=0, t2_pinned=2, target=5.0)
    victims = policy.evict(2, set())
    assert victims is not None and [k for k, _ in victims] == [b"k0", b"k1"]
    assert list(policy.b1) == [b"k0", b"k1"] and not policy.t1


def test_arc_fallback_mixes_sides_and_keeps_order() -> None:
    """T2 is preferred (|T1| < target); once its one idle block is taken, T1 supplies the rest."""
    policy = _arc_with(t1_ready=2, t2_ready=1, t2_pinned=1, target=5.0)
    victims = policy.evict(3, set())
    assert [k for k, _ in victims] == [b"k2", b"k0", b"k1"]
    assert list(policy.b2) == [b"k2"] and list(policy.b1) == [b"k0", b"k1"]


def test_arc_fails_only_without_enough_candidates() -> None:
    """A store fails only when fewer than n idle, unprotected blocks exist in total."""
    policy = _arc_with(t1_ready=2, t2_ready=0, t2_pinned=2, target=5.0)
    assert policy.evict(2, {b"k0"}) is None
    assert list(policy.t1) == [b"k0", b"k1"]


# --------------------------------------------------------------------------------------------
# Model-based test
# --------------------------------------------------------------------------------------------

CAPACITY = 4
KEYS = st.lists(st.integers(0, 7).map(lambda i: b"m%d" % i), min_size=1, max_size=4)


class ManagerMachine(RuleBasedStateMachine):
    """Drives the manager against a plain model (dicts and a list) and checks invariants."""

    policy_name = "lru"
    loads = Bundle("loads")
    stores = Bundle("stores")

    def __init__(self) -> None:
        super().__init__()
        self.mgr = CPUOffloadingManager(CAPACITY, self.policy_name, enable_events=True)
        self.ref: dict[bytes, int] = {}  # key → ref count (-1 = not ready)
        # LRU model (vLLM 0.32's ranks, kv_offload/cpu/policies/lru.py): every tracked key,
        # lowest rank first; a store ranks a key, a touch re-ranks it, pinned or not.
        self.order: list[bytes] = []
        self.event_keys: set[bytes] = set()

    @rule(target=stores, keys=KEYS)
    def prepare_store(self, keys: list[bytes]):
        new = list(dict.fromkeys(key for key in keys if key not in self.ref))
        free = CAPACITY - len(self.ref)
        need = len(new) - free
        eligible = [key for key in self.order if self.ref[key] == 0 and key not in keys]
        out = self.mgr.prepare_store(keys)
        if need > len(eligible):
            assert out is None  # no candidates: must fail (and, with our ARC, only then)
            return multiple()
        assert out is not None, "a store failed although enough idle blocks exist"
        assert out.keys_to_store == new
        victims = out.evicted_keys
        assert len(victims) == max(need, 0)
        for key in victims:
            assert self.ref[key] == 0 and key not in keys, "evicted a pinned/protected block"
            del self.ref[key]
            self.order.remove(key)
        if self.policy_name == "lru":
            assert victims == eligible[: len(victims)]
        for key in new:
            self.ref[key] = -1
            self.order.append(key)
        return out.keys_to_store

    @rule(keys=consumes(stores), success=st.booleans())
    def complete_store(self, keys: list[bytes], success: bool) -> None:
        self.mgr.complete_store(keys, success=success)
        for key in keys:
            if self.ref.get(key) != -1:
                continue
            if success:
                self.ref[key] = 0
            else:
                del self.ref[key]
                self.order.remove(key)

    @rule(target=loads, data=st.data())
    def prepare_load(self, data: st.DataObject):
        ready = sorted(key for key, n in self.ref.items() if n >= 0)
        if not ready:
            return multiple()
        keys = data.draw(st.lists(st.sampled_from(ready), min_size=1, max_size=3))
        spec = self.mgr.prepare_load(keys)
        assert spec.block_ids.tolist() == [self.mgr.get_block(key).block_id for key in keys]
        for key in keys:
            self.ref[key] += 1
        return keys

    @rule(keys=consumes(loads))
    def complete_load(self, keys: list[bytes]) -> None:
        self.mgr.complete_load(keys)
        for key in keys:
            self.ref[key] -= 1

    @rule(keys=KEYS)
    def touch(self, keys: list[bytes]) -> None:
        self.mgr.touch(keys)
        for key in reversed(keys):
            if key in self.ref:
                self.order.remove(key)
                self.order.append(key)

    @rule(keys=KEYS)
    def lookup(self, keys: list[bytes]) -> None:
        for key in keys:
            n = self.ref.get(key)
            want = (
                LookupResult.MISS
                if n is None
                else LookupResult.HIT_PENDING
                if n < 0
                else LookupResult.HIT
            )
            assert self.mgr.lookup(key) is want

    @invariant()
    def consistent(self) -> None:
        mgr = self.mgr
        keys = mgr.policy.keys()
        tracked = {key: mgr.get_block(key) for key in keys}
        assert set(tracked) == set(self.ref)
        assert {key: b.ref_cnt for key, b in tracked.items()} == self.ref
        assert all(n >= -1 for n in self.ref.values())
        slots = [b.block_id for b in tracked.values()]
        assert len(set(slots)) == len(slots) and all(0 <= s < CAPACITY for s in slots)
        assert mgr.num_free + len(tracked) == CAPACITY
        assert mgr.num_evictable == sum(1 for n in self.ref.values() if n == 0)
        assert mgr.num_write_pending == sum(1 for n in self.ref.values() if n == -1)
        for event in mgr.take_events():
            if event.removed:
                assert set(event.keys) <= self.event_keys
                self.event_keys -= set(event.keys)
            else:
                assert not set(event.keys) & self.event_keys
                self.event_keys |= set(event.keys)
        assert self.event_keys == {key for key, n in self.ref.items() if n >= 0}
        if isinstance(mgr.policy, ARCCachePolicy):
            policy = mgr.policy
            assert len(policy.b1) <= CAPACITY and len(policy.b2) <= CAPACITY
            assert 0 <= policy.target_t1_size <= CAPACITY


class ARCManagerMachine(ManagerMachine):
    policy_name = "arc"


class S3FIFOManagerMachine(ManagerMachine):
    policy_name = "s3fifo"


_settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestLRUManagerModel = ManagerMachine.TestCase
TestLRUManagerModel.settings = _settings
TestARCManagerModel = ARCManagerMachine.TestCase
TestARCManagerModel.settings = _settings
TestS3FIFOManagerModel = S3FIFOManagerMachine.TestCase
TestS3FIFOManagerModel.settings = _settings


def _s3_request(mgr: CPUOffloadingManager, keys: list[bytes], req: str) -> list[bytes]:
    ctx = ReqContext(req)
    mgr.touch(keys, ctx)
    out = mgr.prepare_store(keys, ctx)
    assert out is not None
    mgr.complete_store(out.keys_to_store, ctx)
    mgr.touch(keys, ctx)
    return out.evicted_keys


def test_s3fifo_evicts_one_hit_blocks_first_and_readmits_ghosts_to_main() -> None:
    mgr = CPUOffloadingManager(10, "s3fifo")
    policy = mgr.policy
    assert isinstance(policy, S3FIFOCachePolicy)
    for i in range(10):
        assert _s3_request(mgr, [b"k%d" % i], f"r{i}") == []
    mgr.touch([b"k0"], ReqContext("reader"))  # a second request reads k0
    # The storing request's own touches are no reuse: k1 … k9 are one-hit blocks.
    assert _s3_request(mgr, [b"n0"], "n0") == [b"k1"]  # k0 went to main instead
    assert list(policy._main) == [b"k0"]
    assert list(policy._ghost) == [b"k1"]
    assert _s3_request(mgr, [b"k1"], "again") == [b"k2"]
    assert list(policy._main) == [b"k0", b"k1"]  # a ghost comes back into main
    assert b"k1" not in policy._ghost


def test_s3fifo_keeps_a_request_head_longest() -> None:
    """Deepest first within a request: the closing touch orders the chain head last."""
    mgr = CPUOffloadingManager(3, "s3fifo")
    _s3_request(mgr, [b"a", b"b", b"c"], "chain")
    assert _s3_request(mgr, [b"x"], "other") == [b"c"]
