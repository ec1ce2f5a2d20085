"""Secondary-tier registry and factory, and the async lookup.

The scenarios of vLLM's ``tests/v1/kv_offload/tiering/test_factory.py`` and
``tests/v1/kv_offload/tiering/test_async_lookup.py``, named per test."""

from __future__ import annotations

import asyncio
import sys
import types
from collections.abc import Sequence

import pytest

import kvcascade as kc
from kvcascade import LookupResult as R
from kvcascade.tiers import registry
from kvcascade.tiers.registry import TierContext, create_secondary_tier, register_secondary_tier


def key(i: int) -> bytes:
    return kc.make_offload_key(i.to_bytes(8, "big"), 0)


@pytest.fixture
def ctx() -> TierContext:
    host = kc.HostBuffer(4, 64)
    yield TierContext(host, {"model_name": "m"})
    host.close()


def test_builtin_tiers_resolve_to_secondary_tiers(ctx: TierContext) -> None:
    """vLLM test_pre_registered_tiers_can_be_imported / test_example_tier_registered: registered
    types import and build SecondaryTier subclasses; example is an alias of the memory tier."""
    for kind in ("memory", "example"):
        tier = create_secondary_tier({"type": kind}, ctx)
        assert isinstance(tier, kc.MemoryTier)
        assert tier.name == kind


def test_create_multiple_tiers(ctx: TierContext) -> None:
    """vLLM test_create_multiple_tiers: two configs → two tiers with their own names."""
    tiers = [create_secondary_tier({"type": "memory", "name": n}, ctx) for n in ("a", "b")]
    assert [t.name for t in tiers] == ["a", "b"]


def test_register_new_tier_type(ctx: TierContext) -> None:
    """vLLM test_register_new_tier_type / test_duplicate_registration_raises: a new type registers
    and builds; a duplicate registration is refused."""
    name = "test-registered-tier"
    register_secondary_tier(name, lambda c, **kw: kc.MemoryTier(c.host, **kw))
    try:
        assert create_secondary_tier({"type": name}, ctx).name == name
        with pytest.raises(ValueError, match="already registered"):
            register_secondary_tier(name, lambda c, **kw: kc.MemoryTier(c.host))
    finally:
        del registry._REGISTRY[name]


def test_missing_and_unknown_type_raise(ctx: TierContext) -> None:
    """vLLM test_missing_tier_type_raises / test_unknown_tier_type_raises: missing type → "must
    include 'type'"; unknown without module_path → an error that lists the known types."""
    with pytest.raises(ValueError, match="must include 'type'"):
        create_secondary_tier({"root_dir": "/x"}, ctx)
    with pytest.raises(ValueError) as err:
        create_secondary_tier({"type": "tape"}, ctx)
    assert str(err.value) == (  # the documented types; vLLM's two names said to be aliases
        "Unknown secondary tier type 'tape'; known: fs, memory, s3, valkey (vLLM's names "
        "example = memory, obj = s3 are accepted too), or a class name with 'module_path'"
    )
    with pytest.raises(kc.ConfigError, match="tape"):
        kc.CascadeConfig(cpu_blocks=1, secondary_tiers=[{"type": "tape"}])


class PluginTier(kc.MemoryTier):
    """An out-of-tree tier loaded through module_path."""


def test_module_path_tiers(ctx: TierContext, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM test_create_tier_from_module_path / test_module_path_not_subclass_raises /
    test_module_path_invalid_module_raises: module_path loads the class named by type (must subclass
    SecondaryTier); a bad module raises ModuleNotFoundError."""
    module = types.ModuleType("kvcascade_test_plugin")
    module.PluginTier = PluginTier  # type: ignore[attr-defined]
    module.NotATier = object  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvcascade_test_plugin", module)
    tier = create_secondary_tier(
        {"type": "PluginTier", "module_path": "kvcascade_test_plugin", "name": "p"}, ctx
    )
    assert isinstance(tier, PluginTier) and tier.name == "p"
    with pytest.raises(ModuleNotFoundError):
        create_secondary_tier({"type": "X", "module_path": "no_such_module_kvc"}, ctx)
    with pytest.raises(TypeError, match="not a SecondaryTier"):
        create_secondary_tier({"type": "NotATier", "module_path": "kvcascade_test_plugin"}, ctx)


def test_duplicate_tier_names_rejected() -> None:
    with pytest.raises(kc.ConfigError, match="'memory'"):
        kc.CascadeConfig(cpu_blocks=1, secondary_tiers=[{"type": "memory"}, {"type": "memory"}])


class CountingTier(kc.MemoryTier):
    """A memory tier that counts existence probes."""

    def __init__(self, host: kc.HostBuffer) -> None:
        super().__init__(host, name="counting")
        self.probed: list[list[bytes]] = []

    def _probe(self, keys: Sequence[bytes]) -> list[bool]:
        self.probed.append(list(keys))
        return super()._probe(keys)


async def run_tier(tier: kc.SecondaryTier) -> asyncio.Task[None]:
    started = asyncio.Event()
    task = asyncio.create_task(tier.serve(started.set))
    await started.wait()
    return task


async def step(tier: kc.SecondaryTier) -> None:
    """End a step: flush the probe batch and wait for it."""
    tier.on_schedule_end(kc.ScheduleEndContext())
    await tier._lookup.wait_probes()


async def test_async_lookup_resolves_after_flush() -> None:
    """vLLM test_new_key_returns_none / test_found_key_returns_true /
    test_not_found_key_returns_false / test_multiple_keys_single_step /
    test_repeated_lookup_same_key_no_duplicate_batch: a new key answers RETRY and is probed once per
    batch; after the flush the verdicts are HIT / MISS; repeated lookups never re-enqueue."""
    host = kc.HostBuffer(2, 64)
    tier = CountingTier(host)
    task = await run_tier(tier)
    tier.blocks[key(1)] = b"x" * 64
    r = kc.ReqContext("a")
    assert [tier.lookup(key(i), r) for i in (1, 2, 1)] == [R.RETRY, R.RETRY, R.RETRY]
    await step(tier)
    assert tier.probed == [[key(1), key(2)]]
    assert tier.lookup(key(1), r) is R.HIT
    assert tier.lookup(key(2), r) is R.MISS
    await step(tier)
    assert tier.probed == [[key(1), key(2)]]  # cached verdicts, no second probe
    tier.close()
    await task
    host.close()


async def test_async_lookup_cleanup_and_mark_miss() -> None:
    """vLLM test_cleanup_removes_entries / test_cleanup_preserves_shared_entries /
    test_cleanup_unknown_req_id_is_noop / test_mark_miss_flips_cached_verdict_without_reprobing:
    verdicts live while a request refers to them; mark_miss flips a cached verdict without
    re-probing; cleanup of an unknown request is a no-op."""
    host = kc.HostBuffer(2, 64)
    tier = CountingTier(host)
    task = await run_tier(tier)
    tier.blocks[key(1)] = b"x" * 64
    a, b = kc.ReqContext("a"), kc.ReqContext("b")
    tier.lookup(key(1), a)
    tier.lookup(key(1), b)
    await step(tier)
    assert tier.lookup(key(1), a) is R.HIT
    tier._lookup.mark_miss([key(1), key(9)])
    assert tier.lookup(key(1), b) is R.MISS
    tier.on_request_finished(kc.ReqContext("nobody"))
    tier.on_request_finished(a)
    assert tier.lookup(key(1), b) is R.MISS  # b still holds the verdict
    tier.on_request_finished(b)
    assert tier.lookup(key(1), b) is R.RETRY  # forgotten: probed again
    assert len(tier.probed) == 1
    tier.close()
    await task
    host.close()
