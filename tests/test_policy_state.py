"""Issue #9 item 5: a learning policy's state survives restarts beside the fs tier.

Real cascades on a real directory: run requests, close, reopen on the same fs root."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import stat
from pathlib import Path

import pytest

import kvcascade as kc
from kvcascade._policy_state import policy_state_path
from kvcascade.policies import AdaptiveCachePolicy, TurnAwareCachePolicy
from kvcascade.policies.turn_aware import MAX_STATE_BYTES


def _config(root: Path, policy: str = "turn_aware") -> kc.CascadeConfig:
    return kc.CascadeConfig(
        block_bytes=64,
        gpu_blocks=16,
        cpu_blocks=4,
        eviction_policy=policy,
        secondary_tiers=[{"type": "fs", "root_dir": str(root)}],
        model_name="test-model",
    )


def _key(conversation: int, block: int) -> bytes:
    return kc.make_offload_key(bytes([conversation, block]) * 4, 0)


async def _converse(cascade: kc.Cascade, conversations: int = 6, turns: int = 3) -> None:
    """Chat-like traffic: conversation ``c``'s turn ``t`` reads its earlier prompt plus one new
    block; every request goes through the scheduler hooks (lookup, touch, load, store)."""
    step = 0
    for turn in range(1, turns + 1):
        for c in range(conversations):
            keys = [_key(c, b) for b in range(turn + 1)]
            ctx = kc.ReqContext(f"c{c}t{turn}")
            found = await cascade.lookup_prefix(keys, ctx)
            cascade.touch(keys, ctx)
            if found.keys:
                await cascade.load(found.keys, ctx, list(range(len(found.keys))))
            rest = keys[len(found.keys) :]
            if rest:
                gpu = [(step + i) % 16 for i in range(len(rest))]
                await cascade.store(rest, ctx, gpu)
            await cascade.wait_cascades()
            cascade.finish_request(ctx)
            step += len(keys)


def _state_file(root: Path) -> Path:
    (config,) = root.glob("*/config.json")
    return config.parent / TurnAwareCachePolicy.state_file_name


async def test_learned_statistics_survive_a_restart(tmp_path: Path) -> None:
    async with kc.open_cascade(_config(tmp_path)) as cascade:
        policy = cascade.primary.policy
        assert isinstance(policy, TurnAwareCachePolicy)
        assert not _state_file(tmp_path).exists()  # nothing learned before: a fresh start
        await _converse(cascade)
        learned = policy.state()
        assert learned["pooled"]["reads"] > 0  # later turns re-read earlier prompts
        assert {tuple(c[:4]) for c in learned["classes"]} >= {(0, 0, 1, 2), (0, 0, 2, 1)}
    path = _state_file(tmp_path)
    assert policy_state_path(cascade.primary.policy, cascade.tiers) == path
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []
    assert json.loads(path.read_text()) == learned

    async with kc.open_cascade(_config(tmp_path)) as again:
        reloaded = again.primary.policy
        assert isinstance(reloaded, TurnAwareCachePolicy)
        assert reloaded.state() == learned
        assert reloaded.class_table() == policy.class_table()
        await _converse(again, conversations=2, turns=2)
        grown = reloaded.state()
    assert grown["pooled"]["labels"] > learned["pooled"]["labels"]  # saved again at shutdown
    assert json.loads(path.read_text()) == grown


async def test_adaptive_restarts_in_the_mode_it_stopped_in(tmp_path: Path) -> None:
    """The default policy (``adaptive``) saves its mode and the shadows' evidence with its
    statistics at shutdown; a cascade reopened on the same fs root starts in that mode (here
    turn-aware, as after a switch) instead of LRU mode, on the same evidence."""
    async with kc.open_cascade(_config(tmp_path, "adaptive")) as cascade:
        policy = cascade.primary.policy
        assert isinstance(policy, AdaptiveCachePolicy) and policy.lru_mode
        await _converse(cascade)
        policy.lru_mode, policy._lead, policy._square = False, 7.0, 20.0  # as after a switch
        learned = policy.state()
    assert json.loads(_state_file(tmp_path).read_text())["adaptive"] == {
        "lru_mode": False,
        "lead": 7.0,
        "square": 20.0,
    }
    async with kc.open_cascade(_config(tmp_path, "adaptive")) as again:
        reloaded = again.primary.policy
        assert isinstance(reloaded, AdaptiveCachePolicy)
        assert not reloaded.lru_mode and reloaded.state() == learned
        await _converse(again, conversations=2, turns=2)  # serves in turn-aware mode
    async with kc.open_cascade(_config(tmp_path, "turn_aware")) as plain:
        # the same file for turn_aware: its statistics, the mode ignored
        assert plain.primary.policy.class_table() == reloaded.class_table()


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"\xff\xfe garbage",
        json.dumps({"version": 1, "classes": []}).encode(),  # the old format
        json.dumps({"version": 2, "max_turn": 99, "classes": []}).encode(),
        b" " * MAX_STATE_BYTES + b"{}",  # JSON, but no state is that big: not read whole
    ],
    ids=["truncated", "binary", "old-version", "other-max-turn", "oversized"],
)
async def test_corrupt_or_incompatible_state_starts_fresh_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes
) -> None:
    async with kc.open_cascade(_config(tmp_path)) as cascade:
        await _converse(cascade, conversations=2, turns=2)
    path = _state_file(tmp_path)
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="kvcascade"):
        async with kc.open_cascade(_config(tmp_path)) as again:
            policy = again.primary.policy
            assert isinstance(policy, TurnAwareCachePolicy)
            fresh = TurnAwareCachePolicy(4).state()
            assert policy.state() == fresh
            await _converse(again, conversations=2, turns=2)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any("ignoring cache-policy state" in r.getMessage() for r in warnings)
    TurnAwareCachePolicy(4).load_state(path)  # overwritten with a valid state at shutdown


async def test_a_fifo_in_place_of_the_state_file_is_ignored_not_opened(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A FIFO would block ``open`` forever (found by a tester: start-up hung): it is refused
    as not a regular file, the policy starts fresh, and shutdown replaces it with a state."""
    async with kc.open_cascade(_config(tmp_path)) as cascade:
        await _converse(cascade, conversations=2, turns=2)
    path = _state_file(tmp_path)
    path.unlink()
    os.mkfifo(path)
    with caplog.at_level(logging.WARNING, logger="kvcascade"):

        async def reopen() -> None:
            async with kc.open_cascade(_config(tmp_path)) as again:
                assert again.primary.policy.state() == TurnAwareCachePolicy(4).state()

        await asyncio.wait_for(reopen(), 60)
    assert any("not a regular file" in r.getMessage() for r in caplog.records)
    assert path.is_file()
    TurnAwareCachePolicy(4).load_state(path)


async def test_a_policy_without_state_writes_no_file(tmp_path: Path) -> None:
    async with kc.open_cascade(_config(tmp_path, policy="lru")) as cascade:
        assert policy_state_path(cascade.primary.policy, cascade.tiers) is None
        await _converse(cascade, conversations=2, turns=2)
    namespace = _state_file(tmp_path).parent
    assert sorted(p.name for p in namespace.iterdir()) == ["config.json"]


async def test_no_fs_tier_no_state_file(tmp_path: Path) -> None:
    config = kc.CascadeConfig(
        block_bytes=64, gpu_blocks=16, cpu_blocks=4, eviction_policy="turn_aware"
    )
    async with kc.open_cascade(config) as cascade:
        assert policy_state_path(cascade.primary.policy, cascade.tiers) is None


async def test_a_failed_save_does_not_fail_shutdown(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A directory where the state file should be: the save fails, is logged, and the cascade
    still shuts down cleanly (and the next start ignores the unreadable path)."""
    with caplog.at_level(logging.WARNING, logger="kvcascade"):
        async with kc.open_cascade(_config(tmp_path)) as cascade:
            await _converse(cascade, conversations=2, turns=2)
            _state_file(tmp_path).mkdir()
        async with kc.open_cascade(_config(tmp_path)) as again:
            assert again.primary.policy.state() == TurnAwareCachePolicy(4).state()
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("could not save cache-policy state" in m for m in messages)
    assert any("ignoring cache-policy state" in m for m in messages)
    namespace = _state_file(tmp_path).parent
    assert [p.name for p in namespace.iterdir() if p.name.endswith(".tmp")] == []
