"""The fs tier (issue #5): the scenarios of vLLM's ``tests/v1/kv_offload/test_file_mapper.py`` and
``tests/v1/kv_offload/tiering/test_fs_tier.py`` (named per test) plus capacity, integrity, restart
reuse, deadlines and real faults (kill -9, ENOSPC, a stalled FIFO, concurrent writers), all on real
files through the tier's public API.

Every test runs twice (the autouse ``io_path`` fixture): with blocks moved in pure Python, and
with the compiled batch helpers of ``kernels/fs_io.cpp`` (skipped if the extension cannot be
built).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import logging
import os
import random
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tier_helpers
from tier_helpers import BLOCK, job, key, load, lookups, pattern, running, store

import kvcascade as kc
from kvcascade import LookupResult as R
from kvcascade._admin import purge_root
from kvcascade.ops import _build
from kvcascade.replay.cli import main
from kvcascade.tiers import base, fs
from kvcascade.tiers._block_format import (
    FORMAT_VERSION,
    HEADER_BYTES,
    check_block,
    encode_header,
    file_size,
)
from kvcascade.tiers._file_mapper import FileMapper, default_identity
from kvcascade.tiers.fs import FileSystemTier, fs_tier_from_config

REPO = Path(__file__).resolve().parents[2]


def compiled_extension() -> Any:
    """The kernel extension with the fs helpers (built now if needed), or skip the test."""
    ext = _build.load_extension()
    if ext is None or not hasattr(ext, "fs_store_open"):
        pytest.skip(f"kernel extension not built: {_build.extension_error()}")
    return ext


@pytest.fixture(autouse=True, params=["python", "compiled"])
def io_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which mover the tiers of a test use: pure Python (the extension "not ready yet") or the
    compiled batch helpers."""
    ext = compiled_extension() if request.param == "compiled" else None
    monkeypatch.setattr(_build, "extension_if_ready", lambda: ext)
    return str(request.param)


def mapper(**fields: Any) -> FileMapper:
    return FileMapper(default_identity(**{"model_name": "test-model", **fields}))


def make_tier(root: Path, host: kc.HostBuffer, **kw: Any) -> FileSystemTier:
    fields = kw.pop("fields", {})
    return FileSystemTier(host, root, mapper(**fields), **kw)


@pytest.fixture
def host() -> Iterator[kc.HostBuffer]:
    buf = kc.HostBuffer(16, BLOCK)
    yield buf
    buf.close()


def files(root: Path, suffix: str) -> list[Path]:
    return sorted(p for p in root.rglob(f"*{suffix}") if p.is_file() or p.is_fifo())


# -- FileMapper (vLLM tests/v1/kv_offload/test_file_mapper.py) -------------------------------
def test_exact_relative_path_for_known_identity() -> None:
    """vLLM test_get_file_name_full_structure / test_get_config_file_path:
    ``<base>_r<rank>/<hhh>/<hh>_g<g>/<hex>.bin`` and ``<base>/config.json``."""
    ident = default_identity(
        "meta-llama/Llama-3.1-8B", "bfloat16", 16, blocks_per_chunk=4, tp_size=2
    )
    m = FileMapper(ident, rank=1)
    k = kc.make_offload_key(bytes.fromhex("abcdef0123456789"), 3)
    assert (
        m.relative_path(k)
        == "meta-llama_Llama-3.1-8B_b6e719c0eb68_r1/abc/de_g3/abcdef0123456789.bin"
    )
    assert m.config_relative_path() == "meta-llama_Llama-3.1-8B_b6e719c0eb68/config.json"
    blob = json.dumps(ident, sort_keys=True, separators=(",", ":")).encode()
    assert hashlib.sha256(blob).hexdigest()[:12] == "b6e719c0eb68"


def test_run_config_fields() -> None:
    """vLLM test_get_run_config_fields: the run config is exactly the identity (vLLM's fields +
    kvcascade's)."""
    m = mapper(model_name="m", dtype="float16", tokens_per_block=16)
    assert m.run_config() == {
        "model_name": "m",
        "dtype": "float16",
        "tokens_per_hash": 16,
        "blocks_per_file": 1,
        "tp_size": 1,
        "pp_size": 1,
        "pcp_size": 1,
        "dcp_size": 1,
        "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": []}],
        "inference_engine": "kvcascade",
        "kv_layout": "NHD",
        "format_version": FORMAT_VERSION,
        "parallel_agnostic": False,
    }


def test_hybrid_identity_uses_resolved_tokens_per_hash() -> None:
    """vLLM test_hybrid_file_identity_uses_resolved_tokens_per_hash: heterogeneous groups record the
    resolved tokens_per_hash and per-group sizes."""
    ident = default_identity(
        "m", "bfloat16", [16, 64], tokens_per_hash=4, layer_names=[["a"], ["b"]]
    )
    assert ident["tokens_per_hash"] == 4
    assert ident["kv_cache_groups"] == [
        {"tokens_per_block": 16, "layer_names": ["a"]},
        {"tokens_per_block": 64, "layer_names": ["b"]},
    ]
    with pytest.raises(kc.ConfigError, match="tokens_per_hash"):
        default_identity("m", "bfloat16", [16, 64])


@pytest.mark.parametrize(
    ("opt_in", "agnostic", "replicated", "collapsed"),
    [
        (True, True, False, True),
        (True, False, False, False),
        (False, True, False, False),
        (True, False, True, True),
        (False, False, True, False),
    ],
)
def test_parallel_agnostic_collapse(
    opt_in: bool, agnostic: bool, replicated: bool, collapsed: bool
) -> None:
    """vLLM test_parallel_agnostic_collapses_namespace_when_config_allows /
    test_parallel_agnostic_ignored_when_config_disallows /
    test_namespace_kept_without_parallel_agnostic_opt_in /
    test_replicated_layout_collapses_parallel_identity /
    test_replicated_layout_requires_caller_opt_in / test_non_replicated_keeps_parallel_identity:
    collapse only with the caller's opt-in and a config that allows it: sizes 1, rank 0, no
    ``parallel_agnostic`` key; otherwise tp and rank kept, key False."""
    ident = default_identity(
        "m",
        "bfloat16",
        16,
        tp_size=2,
        parallel_agnostic=opt_in,
        config_parallelism_agnostic=agnostic,
        config_replicated=replicated,
    )
    m = FileMapper(ident, rank=1)
    assert (ident["tp_size"], m.rank, "parallel_agnostic" in ident) == (
        (1, 0, False) if collapsed else (2, 1, True)
    )
    assert ident.get("replicated_layout") is (True if opt_in and replicated else None)


def test_namespaces_of_collapse_reasons_and_layouts_differ() -> None:
    """vLLM test_parallel_agnostic_separates_persistent_layouts /
    test_canonical_layout_changes_storage_namespace /
    test_replicated_and_parallelism_agnostic_separate_layouts /
    test_replicated_layout_run_config_tp_invariant: collapsed vs specific, agnostic vs replicated,
    canonical layout all give different base paths; replicated TP2 and TP4 share one (and one run
    config)."""

    def base(**kw: Any) -> str:
        return mapper(model_name="m", dtype="bfloat16", tokens_per_block=16, **kw).base_name

    specific = base(tp_size=2)
    agnostic = base(tp_size=2, parallel_agnostic=True, config_parallelism_agnostic=True)
    replicated = base(tp_size=2, parallel_agnostic=True, config_replicated=True)
    canonical = base(tp_size=2, canonical_layout=True)
    assert len({specific, agnostic, replicated, canonical}) == 4
    assert replicated == base(tp_size=4, parallel_agnostic=True, config_replicated=True)
    assert (
        mapper(model_name="m", dtype="bfloat16", canonical_layout=True).identity["canonical_format"]
        == "v1-nhd"
    )


@pytest.mark.parametrize(
    "change",
    [
        {"model_name": "other"},
        {"model_revision": "abc123"},
        {"dtype": "float16"},
        {"tokens_per_block": 32},
        {"tokens_per_hash": 8},
        {"blocks_per_chunk": 2},
        {"tp_size": 2},
        {"pp_size": 2},
        {"pcp_size": 2},
        {"dcp_size": 2},
        {"kv_layout": "HND"},
        {"cache_salt": "tenant-b"},
    ],
)
def test_every_namespace_field_changes_the_digest(change: dict[str, Any]) -> None:
    """Issue #5 item 3: model id, revision, dtype, block geometry, parallelism, layout, salt."""
    base = dict(model_name="m", dtype="bfloat16", tokens_per_block=16)
    assert mapper(**base).digest != mapper(**{**base, **change}).digest


def test_format_version_is_in_the_digest() -> None:
    ident = default_identity("m", "bfloat16", 16)
    assert FileMapper(ident).digest != FileMapper({**ident, "format_version": 1}).digest


def test_unresolved_dtype_is_refused() -> None:
    with pytest.raises(kc.ConfigError, match="auto"):
        default_identity("m", "auto", 16)
    with pytest.raises(kc.ConfigError, match="auto"):
        FileMapper({"model_name": "m", "dtype": "auto"})


# -- fs tier basics (vLLM tests/v1/kv_offload/tiering/test_fs_tier.py) -----------------------
async def test_lookup_empty_tier(tmp_path: Path, host: kc.HostBuffer) -> None:
    """vLLM test_lookup_empty_tier: unknown keys → RETRY, then MISS after the flush."""
    tier = make_tier(tmp_path, host)
    async with running(tier):
        ctx = kc.ReqContext("r")
        assert [tier.lookup(k, ctx) for k in (key(1), key(2))] == [R.RETRY, R.RETRY]
        assert await lookups(tier, [key(1), key(2)], ctx) == [R.MISS, R.MISS]


async def test_a_root_dir_under_the_home_directory_is_expanded(
    tmp_path: Path, host: kc.HostBuffer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``~/kv`` is the home's ``kv``, as in a shell: it was a literal ``./~/kv`` (user trial,
    a quoted ``--fs-dir '~/kv'``)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    tier = make_tier(Path("~/kv"), host)
    assert tier.root == tmp_path / "home" / "kv"
    async with running(tier):
        assert (await store(tier, host, [1])).success
    assert (tmp_path / "home" / "kv" / tier.mapper.relative_path(key(1))).is_file()
    assert not (tmp_path / "~").exists()


async def test_store_creates_file_at_mapped_path_then_roundtrip(
    tmp_path: Path, host: kc.HostBuffer
) -> None:
    """vLLM test_store_creates_file_and_lookup_succeeds / test_store_then_load_roundtrip: one store
    result; the file at the mapped path; load fills the slots; files stay after the load; lookups
    HIT; a stored event with the job's keys, none for loads
    (test_successful_store_emits_stored_event, test_load_job_emits_no_event)."""
    tier = make_tier(tmp_path, host)
    async with running(tier):
        result = await store(tier, host, [1, 2])
        assert result.success and result.transfer_size == 2 * BLOCK
        assert tier.get_finished_jobs() == [result]
        path = tmp_path / tier.mapper.relative_path(key(1))
        assert path.is_file() and path.stat().st_size == file_size(BLOCK) == HEADER_BYTES + 8192
        events = list(tier.take_events())
        assert [(e.keys, e.medium, e.removed, e.tier) for e in events] == [
            ([key(1), key(2)], kc.Medium.STORAGE, False, "fs")
        ]
        assert (await load(tier, [1, 2], [7, 9])).success
        assert bytes(host.row(7)) == pattern(1) and bytes(host.row(9)) == pattern(2)
        assert path.is_file() and list(tier.take_events()) == []
        assert await lookups(tier, [key(1), key(2)], kc.ReqContext("r")) == [R.HIT, R.HIT]


async def test_a_namespace_purged_while_the_tier_runs_is_created_again(
    tmp_path: Path, host: kc.HostBuffer, caplog: pytest.LogCaptureFixture
) -> None:
    """``kvcascade purge --all`` on the root of a running tier removed its namespace, and
    every later store failed (``No such file or directory: '…_r0/040'``) until a restart (user
    trial, a ``vllm serve`` on the root): the next store creates the namespace again, says so
    once, and its blocks load back; the purged block is a miss."""
    tier = make_tier(tmp_path, host)
    async with running(tier):
        assert (await store(tier, host, [1])).success
        assert (await asyncio.to_thread(purge_root, tmp_path)).files == 1
        assert not tier.data_dir.exists()
        with caplog.at_level(logging.WARNING, logger="kvcascade"):
            assert (await store(tier, host, [2, 3], [4, 5])).success
            assert (await store(tier, host, [4], [6])).success
        assert [r.getMessage() for r in caplog.records if r.name.startswith("kvcascade")] == [
            f"fs tier fs: its namespace {tier.data_dir} was removed while the tier ran "
            "(kvcascade purge?); created it again"
        ]
        assert (tmp_path / tier.mapper.config_relative_path()).is_file()
        assert (await load(tier, [2, 3], [7, 9])).success
        assert bytes(host.row(7)) == pattern(2) and bytes(host.row(9)) == pattern(3)
        assert not (await load(tier, [1], [10])).success


def test_invalid_root_raises_at_construction(tmp_path: Path, host: kc.HostBuffer) -> None:
    """vLLM test_invalid_path_raises_at_construction: a root that cannot be created → OSError from
    the constructor."""
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(OSError):
        make_tier(tmp_path / "file" / "sub", host)


def test_config_json_fifo_is_refused_not_read(tmp_path: Path, host: kc.HostBuffer) -> None:
    """A FIFO in place of the namespace's config.json is a ConfigError naming it, at once
    (reading it would block the constructor, and the event loop, forever)."""
    m = mapper()
    fifo = tmp_path / m.config_relative_path()
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo, 0o600)
    with pytest.raises(kc.ConfigError, match=r"config\.json exists and is not a regular file"):
        FileSystemTier(host, tmp_path, m)


async def test_failed_load_of_missing_file_and_partial_batch(
    tmp_path: Path, host: kc.HostBuffer
) -> None:
    """vLLM test_failed_load_missing_file / test_multi_block_job_partial_failure /
    test_multiple_jobs_tracked_independently: a never-stored key fails its job; a 3-key load whose
    middle key is missing → one failed result listing the key before it; jobs are tracked
    independently."""
    tier = make_tier(tmp_path, host)
    async with running(tier):
        first, second = await asyncio.gather(store(tier, host, [1]), store(tier, host, [3], [1]))
        assert first.success and second.success and first.job_id != second.job_id
        missing = await load(tier, [2], [5])
        assert not missing.success and missing.successful_keys is None
        partial = await load(tier, [1, 2, 3], [5, 6, 7])
        assert not partial.success and partial.successful_keys == [key(1)]
        assert tier.counters["load_failures"] == 2


@pytest.mark.parametrize("batch", [0, 1, 2, 5])
@pytest.mark.parametrize("o_direct", [True, False])
async def test_store_load_data_integrity(
    tmp_path: Path, host: kc.HostBuffer, batch: int, o_direct: bool
) -> None:
    """vLLM test_store_load_data_integrity / test_store_load_roundtrip_without_o_direct: random data
    stored, then loaded into other slots, matches exactly, with O_DIRECT (when the filesystem takes
    it) and forced buffered I/O."""
    tier = make_tier(tmp_path, host, o_direct=o_direct)
    assert tier.o_direct is (o_direct and tier.o_direct)
    async with running(tier):
        ids = list(range(100, 100 + batch))
        assert (await store(tier, host, ids)).success
        assert (await load(tier, ids, list(range(8, 8 + batch)))).success
        assert [bytes(host.row(8 + n)) for n in range(batch)] == [pattern(i) for i in ids]


async def test_out_of_bounds_block_id_fails_store_and_load(
    tmp_path: Path, host: kc.HostBuffer
) -> None:
    """vLLM test_out_of_bounds_block_id_smoke: a slot beyond the primary buffer fails the job (no
    exception escapes)."""
    tier = make_tier(tmp_path, host)
    async with running(tier):
        assert not (await tier.submit_store(job([key(1)], [99], False))).success
        assert not (await tier.submit_load(job([key(1)], [99], True))).success


async def test_drain_waits_and_close_fails_queued_jobs(tmp_path: Path, host: kc.HostBuffer) -> None:
    """vLLM test_wait_idle_blocks_until_tasks_complete / test_shutdown_discards_pending_tasks: drain
    returns once every job is done; closing fails queued jobs (queued behind a load that holds
    the one thread in ``open()`` of a FIFO until after the close)."""
    tier = make_tier(tmp_path, host, io_threads=1)
    async with running(tier):
        futures = [tier.submit_store(job([key(i)], [i % 16], False)) for i in range(40)]
        assert tier.has_pending_work()
        await tier.drain()
        assert all(f.done() and f.result().success for f in futures)
        assert not tier.has_pending_work()
        fifo = Path(tier.path_of(key(99)))
        fifo.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(fifo, 0o600)
        blocker = tier.submit_load(job([key(99)], [1], True))
        futures = [tier.submit_store(job([key(i)], [0], False)) for i in range(100, 140)]
        tier.close()
        _unblock_fifo(fifo)
    assert not blocker.result().success  # a FIFO is no block file
    assert [f.result().error for f in futures] == ["tier closed"] * 40


# -- corruption (vLLM test_fs_tier.py's failed-load tests) ------------------------------------
@pytest.mark.parametrize("damage", ["truncate", "flip"])
async def test_corrupt_file_is_deleted_and_verdict_corrected(
    tmp_path: Path, host: kc.HostBuffer, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM test_failed_load_corrects_verdict_and_removes_corrupt_file: a good load keeps HIT and
    the file; a truncated file, or one with a byte flipped (same length), fails the load as corrupt,
    is deleted, counted, and the same request now sees MISS without a re-probe; a new request misses
    too."""
    tier = make_tier(tmp_path, host)
    async with running(tier):
        assert (await store(tier, host, [1])).success
        ctx = kc.ReqContext("r")
        assert await lookups(tier, [key(1)], ctx) == [R.HIT]
        assert (await load(tier, [1], [4])).success
        path = tmp_path / tier.mapper.relative_path(key(1))
        data = bytearray(path.read_bytes())
        if damage == "truncate":
            data = data[:-100]
        else:
            data[HEADER_BYTES + 1234] ^= 0x01
        path.write_bytes(data)
        failed = await load(tier, [1], [4])
        assert not failed.success
        assert ("short file" if damage == "truncate" else "checksum mismatch") in failed.error
        assert not path.exists() and tier.counters["corrupt_blocks"] == 1
        warned = [r for r in caplog.records if r.levelname == "WARNING" and str(path) in r.message]
        assert len(warned) == 1  # issue #21 item 10: one warning per corrupt block, not two
        assert tier.lookup(key(1), ctx) is R.MISS
        assert await lookups(tier, [key(1)], kc.ReqContext("new")) == [R.MISS]


async def test_corrupt_block_warnings_are_rate_limited_and_the_count_exact(
    tmp_path: Path,
    host: kc.HostBuffer,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A damaged disk corrupts many blocks: the tier's first corrupt block is a warning, the
    next ones within CORRUPT_WARNING_INTERVAL_S debug lines, then one warning sums up the blocks
    since the previous one; counters["corrupt_blocks"] counts every block."""
    caplog.set_level(logging.DEBUG, logger="kvcascade.tiers.base")
    tier = make_tier(tmp_path, host)
    async with running(tier):
        assert (await store(tier, host, list(range(6)))).success
        for i in range(6):
            path = tmp_path / tier.mapper.relative_path(key(i))
            data = bytearray(path.read_bytes())
            data[HEADER_BYTES + 7] ^= 0x01
            path.write_bytes(data)

        async def corrupt(i: int) -> None:
            assert not (await load(tier, [i], [8])).success

        def logged(level: str) -> list[str]:
            return [
                r.getMessage().rpartition("miss ")[2]
                for r in caplog.records
                if r.levelname == level and "treated as a miss" in r.getMessage()
            ]

        for i in range(4):
            await corrupt(i)
        [first] = [  # (asyncio's debug-mode "Executing … took" lines are not ours)
            r.getMessage()
            for r in caplog.records
            if r.levelname == "WARNING" and r.name.startswith("kvcascade")
        ]
        assert first.startswith(f"tier fs: {tier.path_of(key(0))}: checksum mismatch")
        assert logged("WARNING") == [
            "(later corrupt blocks of this tier: one warning per 60 s at most)"
        ]
        assert logged("DEBUG") == [
            f"({n} corrupt blocks since the last warning, {n + 1} in all)" for n in (1, 2, 3)
        ]
        monkeypatch.setattr(base, "CORRUPT_WARNING_INTERVAL_S", 0.0)  # the interval is over
        await corrupt(4)
        await corrupt(5)
        assert logged("WARNING")[1:] == [
            "(4 corrupt blocks since the last warning, 5 in all)",
            "(1 corrupt blocks since the last warning, 6 in all)",
        ]
        assert tier.counters["corrupt_blocks"] == 6


@pytest.mark.parametrize(("bad", "expected"), [(2, [0, 1]), (0, None)])
async def test_batched_load_keeps_blocks_before_the_corrupt_one(
    tmp_path: Path, host: kc.HostBuffer, bad: int, expected: list[int] | None
) -> None:
    """vLLM test_batched_partial_load_failure_keeps_loaded_blocks /
    test_batched_load_first_block_fails_marks_whole_batch: successful_keys = the keys before the
    first corrupt block (None if it is the first); those stay HIT, the rest MISS."""
    tier = make_tier(tmp_path, host)
    async with running(tier):
        assert (await store(tier, host, [0, 1, 2])).success
        ctx = kc.ReqContext("r")
        keys = [key(0), key(1), key(2)]
        assert await lookups(tier, keys, ctx) == [R.HIT] * 3
        path = tmp_path / tier.mapper.relative_path(key(bad))
        path.write_bytes(path.read_bytes()[: HEADER_BYTES + 10])
        result = await load(tier, [0, 1, 2], [5, 6, 7])
        assert not result.success
        assert result.successful_keys == (None if expected is None else [key(i) for i in expected])
        done = len(expected or [])
        assert [tier.lookup(k, ctx) for k in keys] == [R.HIT] * done + [R.MISS] * (3 - done)


async def test_transient_load_failure_leaves_file(tmp_path: Path, host: kc.HostBuffer) -> None:
    """vLLM test_transient_load_failure_leaves_file: an open failing with ELOOP (the file's
    directory briefly replaced by a symlink loop) fails the job but leaves the file intact."""
    tier = make_tier(tmp_path, host)
    async with running(tier):
        assert (await store(tier, host, [1])).success
        path = tmp_path / tier.mapper.relative_path(key(1))
        before = path.read_bytes()
        leaf = path.parent
        away = leaf.rename(leaf.with_name(leaf.name + ".away"))
        leaf.symlink_to(leaf.name)  # a link to itself: ELOOP
        try:
            result = await load(tier, [1], [3])
        finally:
            leaf.unlink()
            away.rename(leaf)
        assert not result.success and f"[Errno {errno.ELOOP}]" in result.error
        assert path.read_bytes() == before and tier.counters["corrupt_blocks"] == 0
        assert (await load(tier, [1], [3])).success and bytes(host.row(3)) == pattern(1)


async def test_failed_store_emits_no_event(tmp_path: Path, host: kc.HostBuffer) -> None:
    """vLLM test_partially_failed_store_emits_no_event /
    test_mixed_job_results_emit_event_only_for_successful_job: a partially failed store job (a plain
    file squats on its second block's directory) stores the other blocks but emits nothing; the
    successful job after it emits one event with its keys."""
    tier = make_tier(tmp_path, host)
    async with running(tier):
        squat = Path(tier.path_of(key(2))).parent
        squat.parent.mkdir(parents=True)
        squat.write_bytes(b"")
        failed = await store(tier, host, [1, 2, 3])
        assert not failed.success and failed.successful_keys == [key(1), key(3)]
        ok = await store(tier, host, [4])
        assert ok.success
        assert [e.keys for e in tier.take_events()] == [[key(4)]]


async def test_cross_tp_replicated_round_trip(tmp_path: Path, host: kc.HostBuffer) -> None:
    """vLLM test_fs_tier_cross_tp_round_trip: a TP2 replicated writer and a TP4 replicated reader
    share the namespace and the file path; the reader HITs and loads identical bytes."""
    fields = dict(parallel_agnostic=True, config_replicated=True)
    writer = FileSystemTier(
        host, tmp_path, FileMapper(default_identity("test-model", tp_size=2, **fields), rank=1)
    )
    reader = FileSystemTier(
        host, tmp_path, FileMapper(default_identity("test-model", tp_size=4, **fields), rank=3)
    )
    assert writer.path_of(key(1)) == reader.path_of(key(1)) and "_r0/" in writer.path_of(key(1))
    async with running(writer, reader):
        assert (await store(writer, host, [1])).success
        assert await lookups(reader, [key(1)], kc.ReqContext("r")) == [R.HIT]
        assert (await load(reader, [1], [10])).success and bytes(host.row(10)) == pattern(1)


async def test_compatible_namespace_hits_incompatible_misses(
    tmp_path: Path, host: kc.HostBuffer
) -> None:
    """Issue #5 item 3: a second tier with an equal identity (another instance, another salt
    object) hits and loads; other salt, dtype or model miss; each wrote its own config.json."""
    base = dict(model_name="org/model", dtype="bfloat16", tokens_per_block=16, cache_salt="t1")
    writer = make_tier(tmp_path, host, fields=base)
    same = make_tier(tmp_path, host, fields=dict(base))
    others = [
        make_tier(tmp_path, host, fields={**base, **c})
        for c in ({"cache_salt": "t2"}, {"dtype": "float16"}, {"model_name": "org/other"})
    ]
    async with running(writer, same, *others):
        assert (await store(writer, host, [1])).success
        assert await same.contains([key(1)]) == [True]
        assert (await load(same, [1], [11])).success and bytes(host.row(11)) == pattern(1)
        for other in others:
            assert await other.contains([key(1)]) == [False]
            assert not (await load(other, [1], [12])).success
    configs = files(tmp_path, "config.json")
    assert len(configs) == 4
    assert json.loads(configs[0].read_text()) in [t.mapper.identity for t in (writer, *others)]


async def test_permissions(tmp_path: Path, host: kc.HostBuffer) -> None:
    """Issue #5 item 8: every directory the tier creates is 0700, every file 0600."""
    root = tmp_path / "tier"
    tier = make_tier(root, host)
    async with running(tier):
        assert (await store(tier, host, [1, 2, 3])).success
    paths = [root, *root.rglob("*")]
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in paths}
    assert {m for p, m in zip(paths, modes.values(), strict=True) if p.is_dir()} == {0o700}
    assert {stat.S_IMODE(p.stat().st_mode) for p in paths if p.is_file()} == {0o600}


def test_config_keys(tmp_path: Path, host: kc.HostBuffer) -> None:
    """Issue #5 config: known keys reach the tier; unknown keys and bad values → ConfigError."""
    m = mapper()
    tier = fs_tier_from_config(
        host,
        m,
        {
            "root_dir": str(tmp_path),
            "max_bytes": 1 << 20,
            "io_threads": 3,
            "io_timeout_s": 2,
            "max_queued_jobs": 5,
            "cache_salt": "s",
            "name": "disk",
        },
    )
    assert (
        tier.max_bytes,
        tier.io_threads,
        tier.io_timeout_s,
        tier.max_queued_jobs,
        tier.name,
    ) == (1 << 20, 3, 2.0, 5, "disk")
    assert tier.mapper.identity["cache_salt"] == "s" and tier.mapper.digest != m.digest
    with pytest.raises(kc.ConfigError, match="bogus"):
        fs_tier_from_config(host, m, {"root_dir": str(tmp_path), "bogus": 1})
    for bad in (
        {},
        {"root_dir": str(tmp_path), "max_bytes": 0},
        {"root_dir": str(tmp_path), "io_threads": "4"},
        {"root_dir": str(tmp_path), "io_timeout_s": -1},
    ):
        with pytest.raises(kc.ConfigError):
            fs_tier_from_config(host, m, bad)
    # one OS thread each: a million was accepted and failed the start (found by a break-it run)
    for many in ({"io_threads": 10**6}, {"n_read_threads": 200, "n_write_threads": 57}):
        with pytest.raises(kc.ConfigError, match=r"io_threads=\d+ is more than 256"):
            fs_tier_from_config(host, m, {"root_dir": str(tmp_path / "new"), **many})
    assert not (tmp_path / "new").exists()


_PIDS_CGROUP = Path("/sys/fs/cgroup/pids")


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.access(_PIDS_CGROUP, os.W_OK),
    reason="needs root and a cgroup v1 pids controller (a container's pids limit)",
)
def test_a_start_that_cannot_start_its_threads_stops_those_it_started(tmp_path: Path) -> None:
    """Found by a break-it run: under a pids limit an fs tier whose I/O threads could not all
    be started failed its start and left every thread it had started running, so that a later
    open in the same process failed too. A child process in a pids cgroup with room for about
    50 more threads opens a tier of 200 threads, then one of 4."""
    code = textwrap.dedent(
        """
        import asyncio, sys, tempfile, threading
        import kvcascade as kc

        def cfg(threads):
            tier = {"type": "fs", "root_dir": sys.argv[1], "io_threads": threads}
            return kc.CascadeConfig(block_bytes=4096, gpu_blocks=4, cpu_blocks=4,
                                    model_name="m", secondary_tiers=[tier])

        async def main():
            before = threading.active_count()
            try:
                async with kc.open_cascade(cfg(200)):
                    print("started")
            except RuntimeError as exc:
                print("failed:", exc)
            print("threads left:", threading.active_count() - before)
            async with kc.open_cascade(cfg(4)):
                print("reopened")

        asyncio.run(main())
        """
    )
    group = _PIDS_CGROUP / f"kvcascade-test-{os.getpid()}"
    group.mkdir()
    try:
        # the child joins the group, which allows what it holds now plus 50 more
        shell = (
            f"echo $$ > {group}/tasks && echo $(( $(cat {group}/pids.current) + 50 )) > "
            f'{group}/pids.max && exec "$0" -c "$1" "$2"'
        )
        out = subprocess.run(
            ["sh", "-c", shell, sys.executable, code, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    finally:
        group.rmdir()
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("failed: can't start new thread"), out.stdout
    assert lines[1:] == ["threads left: 0", "reopened"], out.stdout + out.stderr


# -- capacity --------------------------------------------------------------------------------
async def test_lru_eviction_with_access_on_load_and_store_hit(
    tmp_path: Path, host: kc.HostBuffer
) -> None:
    """Issue #5 item 4: max_bytes = 3 files; a load and a store hit refresh recency; the least
    recently used files go, with removal events and the ``evictions`` counter."""
    tier = make_tier(tmp_path, host, max_bytes=3 * file_size(BLOCK))
    async with running(tier):
        for i in (1, 2, 3):
            assert (await store(tier, host, [i])).success
        assert (await load(tier, [1], [8])).success  # 1 is now most recent: order 2, 3, 1
        assert (await store(tier, host, [2])).success  # store hit: order 3, 1, 2
        tier.take_events()
        assert (await store(tier, host, [4])).success
        assert (await store(tier, host, [5])).success
        assert await tier.contains([key(i) for i in (1, 2, 3, 4, 5)]) == [
            False,
            True,
            False,
            True,
            True,
        ]
        assert tier.counters["evictions"] == 2 and tier.used_bytes == 3 * file_size(BLOCK)
        events = [(e.keys, e.removed) for e in tier.take_events()]
        assert events == [([key(3)], True), ([key(4)], False), ([key(1)], True), ([key(5)], False)]


async def test_file_being_read_is_not_evicted_and_gone_file_counts(
    tmp_path: Path, host: kc.HostBuffer
) -> None:
    """Issue #5 item 4: eviction skips a file being read (a load blocked on a FIFO in its place)
    and takes the next one; a victim already deleted counts as removed; a load of an evicted
    file is a clean failed job."""
    tier = make_tier(tmp_path, host, max_bytes=3 * file_size(BLOCK), io_timeout_s=10)
    async with running(tier):
        for i in (1, 2, 3):
            assert (await store(tier, host, [i])).success
        fifo = Path(tier.path_of(key(1)))
        fifo.unlink()
        os.mkfifo(fifo, 0o600)
        reading = tier.submit_load(job([key(1)], [9], True))
        while not tier._index.readers:  # the load is inside open() on the FIFO
            await asyncio.sleep(0.01)
        Path(tier.path_of(key(2))).unlink()  # already gone when evicted
        assert (await store(tier, host, [4])).success
        assert fifo.is_fifo() and tier.counters["evictions"] == 1
        assert (await store(tier, host, [5])).success  # evicts 3, still not 1
        assert fifo.is_fifo() and tier.counters["evictions"] == 2
        assert not (await load(tier, [3], [10])).success  # evicted: a clean miss
        _unblock_fifo(fifo)
        assert not (await reading).success


def _unblock_fifo(fifo: Path) -> None:
    """Open the FIFO's write end once so that a reader blocked in open() returns."""
    with contextlib.suppress(OSError):
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def on_disk(root: Path) -> int:
    """Bytes of the block files under ``root``."""
    return sum(p.stat().st_size for p in files(root, ".bin"))


@pytest.mark.parametrize("found_by", ["contains", "lookup", "load", "store"])
async def test_block_file_deleted_from_outside_is_forgotten(
    tmp_path: Path, host: kc.HostBuffer, found_by: str
) -> None:
    """Issue #14 item 6: a block file deleted behind the tier's back (an operator's rm, another
    process sharing the directory) leaves the size index as soon as a probe, a load or a store
    of its key finds it gone: ``used_bytes`` is the bytes on disk again and a store that fits
    evicts no real file (it used to count the ghost and evict the least recent real file)."""
    tier = make_tier(tmp_path, host, max_bytes=3 * file_size(BLOCK))
    async with running(tier):
        assert (await store(tier, host, [1, 2, 3])).success
        os.remove(tier.path_of(key(2)))
        if found_by == "contains":
            assert await tier.contains([key(2)]) == [False]
        elif found_by == "lookup":
            assert await lookups(tier, [key(2)], kc.ReqContext("r")) == [R.MISS]
        elif found_by == "load":  # the key after the gone one is not loaded, still indexed
            result = await load(tier, [1, 2, 3], [8, 9, 10])
            assert not result.success and result.successful_keys == [key(1)]
        if found_by != "store":
            assert tier.used_bytes == on_disk(tmp_path) == 2 * file_size(BLOCK)
        new = 2 if found_by == "store" else 4
        assert (await store(tier, host, [new], [5])).success
        assert tier.counters["evictions"] == 0
        assert await tier.contains([key(i) for i in (1, 3, new)]) == [True] * 3
        assert tier.used_bytes == on_disk(tmp_path) == 3 * file_size(BLOCK)
        # The index holds exactly the files on disk: the next store evicts one real file.
        assert (await store(tier, host, [7], [6])).success
        assert tier.counters["evictions"] == 1
        assert tier.used_bytes == on_disk(tmp_path) == 3 * file_size(BLOCK)


_TOUCH_A_SET = textwrap.dedent("""
    import asyncio
    import sys

    import kvcascade as kc
    from tier_helpers import key, running, store
    from kvcascade.tiers._file_mapper import FileMapper, default_identity
    from kvcascade.tiers._block_format import file_size
    from kvcascade.tiers.fs import FileSystemTier

    async def main():
        host = kc.HostBuffer(8, 4096)
        tier = FileSystemTier(
            host,
            sys.argv[1],
            FileMapper(default_identity("test-model")),
            max_bytes=6 * file_size(4096),
            compiled_io=False,
        )
        async with running(tier):
            assert (await store(tier, host, list(range(6)))).success
            tier.touch({key(i) for i in range(6)})
            tier.take_events()
            for i in (6, 7, 8):
                assert (await store(tier, host, [i], [6])).success
            ids = {key(i): i for i in range(6)}
            print(*[ids[k] for e in tier.take_events() if e.removed for k in e.keys])
        host.close()

    asyncio.run(main())
""")


def test_touch_of_a_set_evicts_alike_under_every_hash_seed(tmp_path: Path, io_path: str) -> None:
    """Issue #14: keys touched as a set (no order) are refreshed in key order, so which files
    a bounded tier evicts never depends on PYTHONHASHSEED (it followed the set's iteration
    order, which the seed decides for bytes)."""
    if io_path != "python":
        pytest.skip("no mover involved: runs once")
    evicted = []
    for seed in ("0", "1", "2"):
        done = subprocess.run(
            [sys.executable, "-c", _TOUCH_A_SET, str(tmp_path / f"seed{seed}")],
            capture_output=True,
            text=True,
            timeout=120,
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)]),  # this checkout
                "PYTHONHASHSEED": seed,
            },
        )
        assert done.returncode == 0, done.stderr[-2000:]
        evicted.append(done.stdout.split())
    oldest = [str(i) for i in sorted(range(6), key=key)[:3]]
    assert evicted == [oldest] * 3


# -- restart ---------------------------------------------------------------------------------
async def test_restart_reuses_files_rebuilds_size_and_removes_stale_temps(
    tmp_path: Path, host: kc.HostBuffer
) -> None:
    """Issue #5 item 6: a new tier on the directory serves the old files; with max_bytes it
    rebuilds the accounting (and trims to a smaller bound, oldest first); temp files of a dead
    process are removed, a fresh one of a live process is kept, among the block files and
    beside ``config.json``."""
    first = make_tier(tmp_path, host, max_bytes=10 * file_size(BLOCK))
    async with running(first):
        for i in range(4):
            assert (await store(first, host, [i])).success
            os.utime(first.path_of(key(i)), (1000 + i, 1000 + i))
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    leaf = Path(first.path_of(key(0))).parent
    stale = leaf / f"{key(0)[:-4].hex()}.bin_{dead}_1.tmp"
    live = leaf / f"{key(0)[:-4].hex()}.bin_{os.getpid()}_2.tmp"
    # A kill -9 while config.json or the policy state beside it was replaced
    # (kvcascade/_atomic.py) leaves a temp file in the namespace's parent directory.
    config_dir = (Path(first.root) / first.mapper.config_relative_path()).parent
    config_stale = config_dir / f"turn_aware_state.json_{dead}_3.tmp"
    config_live = config_dir / f"config.json_{os.getpid()}_4.tmp"
    for temp in (stale, live, config_stale, config_live):
        temp.write_bytes(b"partial")
    second = make_tier(tmp_path, host, max_bytes=3 * file_size(BLOCK))
    async with running(second):
        assert not stale.exists() and live.exists()
        assert not config_stale.exists() and config_live.exists()
        assert (config_dir / "config.json").exists()
        assert second.used_bytes == 3 * file_size(BLOCK) and second.counters["evictions"] == 1
        assert await second.contains([key(i) for i in range(4)]) == [False, True, True, True]
        assert (await load(second, [3], [4])).success and bytes(host.row(4)) == pattern(3)


async def test_a_temp_file_of_an_earlier_process_with_this_pid_is_removed(
    tmp_path: Path, host: kc.HostBuffer
) -> None:
    """Found by a break-it run: an engine killed while writing, restarted with the same pid (pid
    1 of every container restart) within ``io_timeout_s``, kept the temp files for ever (they are
    not counted against ``max_bytes``): the pid was alive, being its own. A temp file with this
    process's pid from before it started is now stale; one written since is kept."""
    first = make_tier(tmp_path, host, max_bytes=10 * file_size(BLOCK))
    async with running(first):
        assert (await store(first, host, [0])).success
    leaf = Path(first.path_of(key(0))).parent
    before = leaf / f"{key(1)[:-4].hex()}.bin_{os.getpid()}_1.tmp"
    since = leaf / f"{key(2)[:-4].hex()}.bin_{os.getpid()}_2.tmp"
    for temp in (before, since):
        temp.write_bytes(b"partial")
    earlier = fs._IMPORTED_AT - 5  # written by the process before this one
    os.utime(before, (earlier, earlier))
    timeout = time.time() - earlier + 600  # both younger than io_timeout_s
    second = make_tier(tmp_path, host, max_bytes=10 * file_size(BLOCK), io_timeout_s=timeout)
    async with running(second):
        assert not before.exists() and since.exists()


async def test_a_block_file_dated_in_the_future_does_not_date_new_files(
    tmp_path: Path, host: kc.HostBuffer
) -> None:
    """Found by a break-it run: one block file ten years ahead of the clock (a clock stepped
    back, files restored from another host) made a bounded tier's restart stamp every new file
    ten years ahead, so ``kvcascade purge --older-than`` never removed them."""
    first = make_tier(tmp_path, host, max_bytes=10 * file_size(BLOCK))
    async with running(first):
        assert (await store(first, host, [0])).success
    future = time.time() + 10 * 365 * 86400
    os.utime(first.path_of(key(0)), (future, future))
    second = make_tier(tmp_path, host, max_bytes=10 * file_size(BLOCK))
    async with running(second):
        assert (await store(second, host, [1, 2])).success
        stamped = [os.stat(second.path_of(key(i))).st_mtime for i in (1, 2)]
    assert all(t < time.time() + 60 for t in stamped), stamped
    assert purge_root(tmp_path, older_than_s=0, now=time.time() + 120).files == 2


def _empty_block_files(data_dir: Path, n: int) -> None:
    """``n`` empty block files of random keys (their content does not matter to the scan)."""
    rng = random.Random(0)
    for _ in range(n):
        name = rng.getrandbits(64).to_bytes(8, "big").hex()
        leaf = data_dir / name[:3] / f"{name[3:5]}_g0"
        leaf.mkdir(parents=True, exist_ok=True)
        (leaf / f"{name}.bin").touch()


async def test_a_start_beside_a_running_purge_skips_what_the_purge_removed(
    tmp_path: Path, host: kc.HostBuffer
) -> None:
    """Found by a break-it run: an engine starting while ``kvcascade purge`` removed its
    namespace failed with a bare FileNotFoundError for a block directory removed between the
    scan's listing and its walk into it. Such a directory now has no files, as in purge."""
    async with running(make_tier(tmp_path, host, max_bytes=1 << 40)):
        pass
    (data_dir,) = tmp_path.glob("*_r0")
    await asyncio.to_thread(_empty_block_files, data_dir, 3_000)
    purge = threading.Thread(target=purge_root, args=(tmp_path,))
    purge.start()
    starts, failures = 0, []
    try:
        while purge.is_alive() or not starts:
            starts += 1
            try:
                async with running(make_tier(tmp_path, host, max_bytes=1 << 40)):
                    pass
            except OSError as exc:
                failures.append(repr(exc))
    finally:
        purge.join()
    assert failures == [] and starts >= 1


@pytest.mark.parametrize("fstype", ["ramfs", None])
async def test_restart_evicts_in_write_order_within_one_clock_tick(
    tmp_path: Path, host: kc.HostBuffer, fstype: str | None
) -> None:
    """Issue #14 item 11b: blocks stored within one tick of the kernel's file clock are evicted
    after a restart oldest first, not in key (hash) order. ramfs stamps files from the coarse
    clock (as ext4 and tmpfs do on kernels before 6.13) and keeps explicit nanoseconds: the
    tier sets every new file's mtime from a strictly increasing clock; ``None``: ``tmp_path``."""
    ids = sorted(range(20, 26), key=key, reverse=True)  # written in descending key order
    with contextlib.ExitStack() as stack:
        root = stack.enter_context(mounted(tmp_path / "mnt", fstype)) if fstype else tmp_path
        first = make_tier(root, host, max_bytes=10 * file_size(BLOCK))
        async with running(first):
            assert (await store(first, host, ids)).success
        stamps = [os.stat(first.path_of(key(i))).st_mtime_ns for i in ids]
        assert stamps == sorted(set(stamps))  # strictly increasing in write order
        second = make_tier(root, host, max_bytes=len(ids) * file_size(BLOCK))
        async with running(second):
            assert second.used_bytes == len(ids) * file_size(BLOCK)
            for n, new in enumerate((30, 31), 1):
                assert (await store(second, host, [new], [8])).success
                assert second.counters["evictions"] == n
            assert await second.contains([key(i) for i in ids]) == [False, False] + [True] * 4


# -- deadlines and back-pressure --------------------------------------------------------------
async def test_stalled_reader_fails_at_deadline_and_others_finish(
    tmp_path: Path, host: kc.HostBuffer
) -> None:
    """Issue #5 item 7: a load stuck in open() on a FIFO fails at its deadline while another
    load finishes on the other thread; the stuck thread is abandoned and replaced, so both
    threads serve again afterwards."""
    tier = make_tier(tmp_path, host, io_threads=2, io_timeout_s=1.0)
    async with running(tier):
        assert (await store(tier, host, [1, 2])).success
        fifo = Path(tier.path_of(key(9)))
        fifo.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(fifo, 0o600)
        start = time.monotonic()
        stuck = tier.submit_load(job([key(9)], [5], True))
        assert (await load(tier, [1, 2], [6, 7])).success
        result = await stuck
        assert 0.9 < time.monotonic() - start < 3.0
        assert not result.success and "deadline" in result.error
        assert tier.counters["timeouts"] == 1 and tier.counters["stuck_threads"] == 1
        again = await asyncio.gather(load(tier, [1], [6]), load(tier, [2], [7]))
        assert all(r.success for r in again) and bytes(host.row(7)) == pattern(2)
        _unblock_fifo(fifo)
        while tier.counters["stuck_threads"]:
            await asyncio.sleep(0.01)


_EXIT_WITH_A_STUCK_THREAD = textwrap.dedent("""
    import asyncio, atexit, os, subprocess, sys, time
    from pathlib import Path
    import kvcascade as kc
    from kvcascade.ops import _build
    from kvcascade.tiers._file_mapper import FileMapper, default_identity
    from kvcascade.tiers.fs import FileSystemTier
    from tier_helpers import job, key, running, store

    compiled = sys.argv[2] == "compiled"
    assert not compiled or _build.load_extension() is not None
    host = kc.HostBuffer(8, 4096)
    tier = FileSystemTier(
        host, sys.argv[1], FileMapper(default_identity("test-model")), io_threads=1,
        io_timeout_s=0.3, compiled_io=compiled,
    )
    fifo = Path(tier.path_of(key(9)))

    async def main():
        async with running(tier):
            assert (await store(tier, host, [1])).success
            fifo.parent.mkdir(parents=True, exist_ok=True)
            os.mkfifo(fifo, 0o600)
            result = await tier.submit_load(job([key(9)], [5], True))
            assert not result.success and "deadline" in result.error, result
            print("abandoned", flush=True)

    asyncio.run(main())

    class SlowFinalizer:
        def __del__(self):  # runs while the interpreter finalizes (module globals cleared)
            time.sleep(1.0)

    slow = SlowFinalizer()
    # After the atexit handlers, while finalizing: a writer opens the FIFO, the stuck open returns.
    atexit.register(lambda: subprocess.Popen(["sh", "-c", f"sleep 0.3; exec 3>'{fifo}'"]))
    print("exiting", flush=True)
""")


def test_exit_while_an_abandoned_thread_returns(tmp_path: Path, io_path: str) -> None:
    """Issue #5 item 7 / #4 item 6: an I/O thread abandoned at its deadline (stuck opening a
    FIFO) that returns while the interpreter is finalizing must not kill the process. With the
    compiled mover it used to: CPython ends such a thread with pthread_exit inside the GIL
    re-acquire, and unwinding through pybind11's noexcept gil_scoped_release destructor is
    std::terminate ("terminate called without an active exception", exit status 134)."""
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_WITH_A_STUCK_THREAD, str(tmp_path / "tier"), io_path],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO / "tests")},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["abandoned", "exiting"]
    assert "terminate called" not in done.stderr


async def test_full_queue_refuses_stores_with_a_failed_result(
    tmp_path: Path, host: kc.HostBuffer
) -> None:
    """Issue #5 item 7: with the only thread blocked and max_queued_jobs = 2, a third waiting
    store is refused at once (failed result, counted, visible to get_finished_jobs); loads are
    still admitted; a job waiting past its deadline fails."""
    tier = make_tier(tmp_path, host, io_threads=1, io_timeout_s=1.5, max_queued_jobs=2)
    async with running(tier):
        fifo = Path(tier.path_of(key(9)))
        fifo.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(fifo, 0o600)
        stuck = tier.submit_load(job([key(9)], [5], True))
        queued = [tier.submit_store(job([key(i)], [i], False)) for i in (1, 2)]
        refused = tier.submit_store(job([key(3)], [3], False))
        assert refused.done() and not refused.result().success
        assert "queue full" in refused.result().error and tier.counters["store_rejected"] == 1
        assert refused.result() in tier.get_finished_jobs()
        admitted = tier.submit_load(job([key(1)], [6], True))
        assert not admitted.done()
        results = await asyncio.gather(stuck, *queued, admitted)
        assert not results[0].success
        _unblock_fifo(fifo)
        await tier.drain()


async def test_single_thread_alternates_between_loads_and_stores(
    tmp_path: Path, host: kc.HostBuffer
) -> None:
    """vLLM's ``DualQueueThreadPool`` (``tiering/fs/thread_pool.py``; neither queue starves): with
    both queues full, one thread alternates; stores are not starved by a stream of loads."""
    tier = make_tier(tmp_path, host, io_threads=1, io_timeout_s=10)
    async with running(tier):
        assert (await store(tier, host, [1])).success
        fifo = Path(tier.path_of(key(9)))
        fifo.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(fifo, 0o600)
        order: list[str] = []
        blocker = tier.submit_load(job([key(9)], [5], True))
        futures = []
        for i in range(3):
            for kind, fut in (
                ("S", tier.submit_store(job([key(10 + i)], [i], False))),
                ("L", tier.submit_load(job([key(1)], [8], True))),
            ):
                fut.add_done_callback(lambda _f, kind=kind: order.append(kind))
                futures.append(fut)
        _unblock_fifo(fifo)
        await blocker
        await asyncio.gather(*futures)
        assert order == ["S", "L"] * 3


@pytest.mark.blocks_loop  # it blocks the loop to show the threads go on without it
async def test_threads_take_queued_jobs_without_the_loop(
    tmp_path: Path, host: kc.HostBuffer
) -> None:
    """An I/O thread that finishes a job takes the next queued one itself, and finding none
    frees its slot itself: with the event loop blocked (a scheduler step that runs long), every
    queued store still reaches the disk, so does a store submitted after the thread went idle
    (its finished job's result not yet taken by the loop), and the results arrive once the loop
    runs again. In debug mode (conftest.py) a submit is slow enough that the thread drains the
    queue between two submits: the idle case, which stalled while the loop had to free the
    slot."""
    tier = make_tier(tmp_path, host, io_threads=1)
    async with running(tier):
        for i in range(8):
            host.row(i)[:] = pattern(i)
        paths = [Path(tier.path_of(key(i))) for i in range(8)]

        def wait_on_disk(n: int) -> None:  # blocks the loop: nothing is dispatched from it
            until = time.monotonic() + 30
            while not all(p.exists() for p in paths[:n]) and time.monotonic() < until:
                time.sleep(0.005)
            assert [p.exists() for p in paths[:n]] == [True] * n

        futures = [tier.submit_store(job([key(i)], [i], False)) for i in range(6)]
        wait_on_disk(6)
        time.sleep(0.05)  # the thread, done with the queue, waits idle
        futures += [tier.submit_store(job([key(i)], [i], False)) for i in (6, 7)]
        wait_on_disk(8)
        assert [r.success for r in await asyncio.gather(*futures)] == [True] * 8


# -- real faults -----------------------------------------------------------------------------
_WRITER = textwrap.dedent("""
    import asyncio, hashlib, random, sys
    import numpy as np
    import kvcascade as kc
    from kvcascade.tiers._file_mapper import FileMapper, default_identity
    from kvcascade.ops import _build
    from kvcascade.tiers.fs import FileSystemTier

    def key(i):
        return kc.make_offload_key(hashlib.sha256(str(i).encode()).digest()[:16], 0)

    async def main():
        host = kc.HostBuffer(10, {block})
        compiled = sys.argv[2] == "compiled"
        assert not compiled or _build.load_extension() is not None
        tier = FileSystemTier(
            host, sys.argv[1], FileMapper(default_identity("test-model")), io_threads=4,
            compiled_io=compiled,
        )
        async with asyncio.TaskGroup() as group:
            started = asyncio.Event()
            group.create_task(tier.serve(started.set))
            await started.wait()
            for j in range(100):
                ids = list(range(10 * j, 10 * j + 10))
                for slot, i in enumerate(ids):
                    host.row(slot)[:] = random.Random(i).randbytes({block})
                keys = [key(i) for i in ids]
                await tier.submit_store(kc.TransferJob(j, keys, np.arange(10), False))
                print(j, flush=True)
            tier.close()
    asyncio.run(main())
""")


def _kill_writer_mid_run(root: Path, io_path: str, block: int) -> None:
    """Start a process writing 1,000 blocks under ``root`` and SIGKILL it after 30 (off the
    loop: it waits for the writer's lines)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER.format(block=block), str(root), io_path],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert proc.stdout is not None
    for _ in range(30):
        assert proc.stdout.readline(), "writer died early"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()


async def test_kill_9_while_writing_1000_blocks(tmp_path: Path, io_path: str) -> None:
    """Issue #5 tests: SIGKILL a process in the middle of writing 1,000 blocks; a fresh tier on
    the directory removes the temp files, and every hit loads exactly the stored bytes."""
    block = 256 * 1024 + 4096  # two pieces on the compiled path's fused I/O
    await asyncio.to_thread(_kill_writer_mid_run, tmp_path, io_path, block)
    host = kc.HostBuffer(4, block)
    try:
        tier = FileSystemTier(host, tmp_path, mapper())
        async with running(tier):
            assert files(tmp_path, ".tmp") == []
            found = await tier.contains([key(i) for i in range(1000)])
            hits = [i for i, f in enumerate(found) if f]
            assert 300 <= len(hits) < 1000
            for i in hits:
                result = await tier.submit_load(job([key(i)], [0], True))
                assert result.success, result.error
                assert bytes(host.row(0)) == pattern(i, block)
            assert tier.counters["corrupt_blocks"] == 0
    finally:
        host.close()


@contextlib.contextmanager
def mounted(path: Path, fstype: str, options: str = "defaults") -> Iterator[Path]:
    """A fresh ``fstype`` filesystem mounted on ``path`` (created) for the ``with`` block; skips
    the test where it cannot be mounted (needs root)."""
    path.mkdir()
    done = subprocess.run(
        ["mount", "-t", fstype, "-o", options, fstype, str(path)],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        pytest.skip(f"cannot mount a {fstype} (needs root): {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


async def test_enospc_fails_cleanly_and_loads_keep_working(
    tmp_path: Path, host: kc.HostBuffer
) -> None:
    """Issue #5 tests: stores into a full filesystem fail cleanly (failed job, no temp or
    partial file), and the tier keeps serving loads of what it stored."""
    with mounted(tmp_path / "mnt", "tmpfs", "size=128k") as root:
        tier = make_tier(root, host)
        async with running(tier):
            results = [await store(tier, host, [i], [i % 4]) for i in range(20)]
            ok = [i for i, r in enumerate(results) if r.success]
            assert ok and len(ok) < 20 and all(not r.success for r in results[len(ok) :])
            assert "No space left" in results[-1].error and str(root) in results[-1].error
            assert files(root, ".tmp") == []
            assert {p.stat().st_size for p in files(root, ".bin")} == {file_size(BLOCK)}
            assert (await load(tier, ok, list(range(4, 4 + len(ok))))).success
            assert [bytes(host.row(4 + n)) for n in range(len(ok))] == [pattern(i) for i in ok]
            # A block already stored is a store hit even with no room for a temp file.
            again = await store(tier, host, [ok[0], ok[-1]], [0, 1])
            assert again.success, again.error
            assert files(root, ".tmp") == []


async def test_disk_full_mid_run_is_one_rate_limited_warning_and_clean_failures(
    tmp_path: Path,
    host: kc.HostBuffer,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A filesystem that fills mid-run (ENOSPC from the OS; the tier has no ``max_bytes``): one
    warning naming the tier and its root_dir, later refusals debug lines then a summary at most
    once per CORRUPT_WARNING_INTERVAL_S (as corrupt blocks), each refused block counted
    (``disk_full_blocks``) and a clean store failure: no temp file, no partial or corrupt
    block file, every stored block loads byte-exact."""
    caplog.set_level(logging.DEBUG, logger="kvcascade.tiers.base")
    with mounted(tmp_path / "mnt", "tmpfs", "size=128k") as root:
        tier = make_tier(root, host, name="disk")
        async with running(tier):
            results = [await store(tier, host, [i], [i % 4]) for i in range(16)]
            ok = [i for i, r in enumerate(results) if r.success]
            refused = len(results) - len(ok)
            assert ok == list(range(len(ok))) and refused >= 3
            assert tier.counters["disk_full_blocks"] == refused

            def logged(level: str) -> list[str]:
                return [
                    r.getMessage()
                    for r in caplog.records
                    if r.levelname == level
                    and r.name == "kvcascade.tiers.base"
                    and "is full" in r.getMessage()
                ]

            head = (
                f"fs tier disk: root_dir {root} is full (No space left on device): 1 of 1 "
                "blocks of a store not stored; stores fail until the filesystem has room (no "
                "block is left partly written)"
            )
            assert logged("WARNING") == [
                f"{head} (later refused blocks of this tier: one warning per 60 s at most)"
            ]
            # and nothing else: the failed jobs were a second warning for the same fault
            assert len(tier_helpers.kvcascade_warnings(caplog.records)) == 1
            assert logged("DEBUG") == [
                f"{head} ({n} refused blocks since the last warning, {n + 1} in all)"
                for n in range(1, refused)
            ]
            monkeypatch.setattr(base, "CORRUPT_WARNING_INTERVAL_S", 0.0)  # the interval is over
            both = await store(tier, host, [ok[0], 99], [0, 1])  # a store hit and a refusal
            assert not both.success and list(both.successful_keys or []) == [key(ok[0])]
            assert logged("WARNING")[1:] == [
                head.replace("1 of 1", "1 of 2")
                + f" ({refused} refused blocks since the last warning, {refused + 1} in all)"
            ]
            assert files(root, ".tmp") == [] and tier.counters["corrupt_blocks"] == 0
            assert {p.stat().st_size for p in files(root, ".bin")} == {file_size(BLOCK)}
            assert (await load(tier, ok[:8], list(range(8, 8 + len(ok[:8]))))).success
            assert [bytes(host.row(8 + n)) for n in range(len(ok[:8]))] == [
                pattern(i) for i in ok[:8]
            ]


async def test_full_disk_at_start_is_not_called_full_when_eviction_makes_room(
    tmp_path: Path, host: kc.HostBuffer, caplog: pytest.LogCaptureFixture
) -> None:
    """A bounded tier whose files fill its filesystem exactly: restarted on it, the O_DIRECT
    probe finds no room, which used to be logged as "is full: stores will fail" although each
    store evicts a file first and succeeds. Now nothing says full, and every store is done."""
    with mounted(tmp_path / "mnt", "tmpfs", "size=64k") as root:  # config.json + 5 block files
        bound = 5 * file_size(BLOCK)
        async with running(tier := make_tier(root, host, max_bytes=bound)):
            for i in range(6):
                assert (await store(tier, host, [i], [0])).success
        assert os.statvfs(root).f_bavail == 0  # full: not even the probe's page fits
        caplog.clear()
        caplog.set_level(logging.INFO, logger="kvcascade")
        again = make_tier(root, host, max_bytes=bound)
        async with running(again):
            for i in range(100, 105):
                assert (await store(again, host, [i], [0])).success
            assert (await load(again, [104], [5])).success and bytes(host.row(5)) == pattern(104)
        assert again.counters["evictions"] == 5 and again.counters["disk_full_blocks"] == 0
        messages = [r.getMessage() for r in caplog.records]
        assert not [m for m in messages if " is full" in m or "stores will fail" in m]
        if fs._O_DIRECT:
            assert f"no room for the O_DIRECT probe in {again.data_dir}" in "\n".join(messages)


async def test_read_only_filesystem_store_hits_and_misses(
    tmp_path: Path, host: kc.HostBuffer, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue #5 (failure behaviour): on a filesystem remounted read-only, a store of blocks
    already there succeeds (a store hit, as in vLLM's fs tier, which checks existence first),
    a store of a new block fails with EROFS and the present ones around it are hits, and loads
    go on. The refusal is one warning naming the tier and its root_dir (there was a second, the
    job's failure), and so it is on a tier started on the read-only mount (whose start-up says
    so at INFO: a warning there and another at its first store were two for one fault)."""
    caplog.set_level(logging.INFO, logger="kvcascade")

    def warnings() -> list[str]:
        return tier_helpers.kvcascade_warnings(caplog.records)

    with mounted(tmp_path / "mnt", "tmpfs", "size=4m") as root:
        tier = make_tier(root, host)
        async with running(tier):
            assert (await store(tier, host, [1, 2, 3])).success
            remount = subprocess.run(
                ["mount", "-o", "remount,ro", str(root)], capture_output=True, text=True
            )
            assert remount.returncode == 0, remount.stderr
            hit = await store(tier, host, [3, 1, 2], [3, 4, 5])
            assert hit.success, hit.error
            mixed = await tier.submit_store(
                job([key(1), key(2), key(7), key(3)], [4, 5, 6, 3], False)
            )
            assert not mixed.success and "Read-only file system" in mixed.error
            refusal = (
                f"fs tier fs: root_dir {root} is not writable (Read-only file system): 1 of 4 "
                "blocks of a store not stored; stores fail until it is writable (no block is "
                "left partly written) (later refused blocks of this tier: one warning per 60 s "
                "at most)"
            )
            assert warnings() == [refusal] and tier.counters["unwritable_blocks"] == 1
            assert list(mixed.successful_keys or []) == [key(1), key(2), key(3)]
            assert (hit.transfer_size, mixed.transfer_size) == (0, 0)  # store hits move nothing
            assert tier.counters["store_bytes"] == 3 * BLOCK
            assert (await load(tier, [1, 2, 3], [8, 9, 10])).success
            assert [bytes(host.row(s)) for s in (8, 9, 10)] == [pattern(i) for i in (1, 2, 3)]
            assert await tier.contains([key(7)]) == [False]
        # A tier started on the read-only mount says so once, and serves its blocks.
        caplog.clear()
        reader = make_tier(root, host)
        messages = [r.getMessage() for r in caplog.records]
        assert (
            f"fs tier: {reader.data_dir} is not writable (Read-only file system): stores will fail"
            in messages
        )
        assert not any("could not delete" in m or "O_DIRECT" in m for m in messages)
        async with running(reader):
            assert (await load(reader, [2], [11])).success
            assert bytes(host.row(11)) == pattern(2)
            assert warnings() == []
            assert not (await store(reader, host, [8])).success
            assert warnings() == [refusal.replace("1 of 4", "1 of 1")]


def test_read_only_root_without_the_namespace_names_the_tier(
    tmp_path: Path, host: kc.HostBuffer, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tier on a read-only mount that does not hold its namespace yet cannot start: the error
    (the OSError of the refused mkdir, EROFS) names the tier and its root_dir, and so does
    ``kvcascade replay --fs-dir`` on it (it named only the namespace directory)."""
    with mounted(tmp_path / "ro", "tmpfs", "size=64k,ro") as root:
        with pytest.raises(OSError) as info:
            make_tier(root, host, name="cold")
        identity_dir = (root / mapper().config_relative_path()).parent  # created first
        assert info.value.errno == errno.EROFS and info.value.filename == str(identity_dir)
        assert str(info.value) == (
            f"[Errno 30] fs tier 'cold': cannot create its namespace under root_dir {root} "
            f"(Read-only file system): '{identity_dir}'"
        )
        argv = ["replay", "--requests", "2", "--quiet", "--fs-dir", str(root / "kv")]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err == (
            f"kvcascade: error: [Errno 30] fs tier 'fs': cannot create its namespace under "
            f"root_dir {root / 'kv'} (Read-only file system): '{root / 'kv'}'\n"
        )


async def test_concurrent_writers_of_the_same_keys(tmp_path: Path) -> None:
    """Issue #5 tests: two tiers on one directory store the same 1 MiB blocks at once while a
    reader polls the files: both succeed, one file per key, no temp left, and the reader only
    ever sees no file or the whole, valid file (fs atomicity)."""
    block = 1 << 20
    hosts = [kc.HostBuffer(8, block) for _ in range(2)]
    tiers = [FileSystemTier(h, tmp_path, mapper()) for h in hosts]
    paths = [tiers[0].path_of(key(i)) for i in range(8)]
    seen: list[str] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            for i, p in enumerate(paths):
                try:
                    data = Path(p).read_bytes()
                except FileNotFoundError:
                    continue
                view = memoryview(data)
                assert len(data) == file_size(block), f"partial file {len(data)}"
                check_block(
                    key(i), view[:HEADER_BYTES], view[HEADER_BYTES : HEADER_BYTES + block], p
                )
                seen.append(p)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        async with running(*tiers):
            for h in hosts:
                for slot in range(8):
                    h.row(slot)[:] = pattern(slot, block)
            results = await asyncio.gather(
                *[
                    t.submit_store(job([key(i) for i in range(8)], list(range(8)), False))
                    for t in tiers
                ]
            )
            assert all(r.success for r in results)
    finally:
        stop.set()
        thread.join()
        for h in hosts:
            h.close()
    assert len(files(tmp_path, ".bin")) == 8 and files(tmp_path, ".tmp") == []
    assert seen


# -- the compiled batch helpers (kernels/fs_io.cpp) --------------------------------------------
BIG = 2 * 256 * 1024 + 5000  # above the 256 KiB pieces of fused I/O, with a partial last piece


@pytest.mark.parametrize("block", [BLOCK, BIG])
@pytest.mark.parametrize("o_direct", [True, False])
async def test_both_movers_write_identical_files_and_read_each_others(
    tmp_path: Path, io_path: str, block: int, o_direct: bool
) -> None:
    """The compiled helpers and the pure-Python mover write byte-identical block files (header,
    checksums, padding) and each loads the other's; buffered I/O takes the compiled path's
    piecewise, fused reads and writes (O_DIRECT on a device does not)."""
    if io_path != "compiled":
        pytest.skip("compares both movers itself")
    host = kc.HostBuffer(8, block)
    try:
        py = make_tier(tmp_path / "py", host, o_direct=o_direct, compiled_io=False)
        cc = make_tier(tmp_path / "cc", host, o_direct=o_direct)
        ids = [1, 2, 3]
        async with running(py, cc):
            for tier in (py, cc):
                assert (await store(tier, host, ids)).success
            assert cc._fused is (not cc.o_direct or fs_type(tmp_path) == 0x01021994)
            for i in ids:
                rel = py.mapper.relative_path(key(i))
                assert (tmp_path / "py" / rel).read_bytes() == (tmp_path / "cc" / rel).read_bytes()
        readers = [
            make_tier(tmp_path / "cc", host, o_direct=o_direct, compiled_io=False),
            make_tier(tmp_path / "py", host, o_direct=o_direct),
        ]
        async with running(*readers):
            for tier in readers:
                host.tensor().zero_()
                assert (await load(tier, ids, [5, 6, 7])).success
                assert [bytes(host.row(s)) for s in (5, 6, 7)] == [pattern(i, block) for i in ids]
    finally:
        host.close()


def fs_type(path: Path) -> int:
    magic, kind, message = compiled_extension().fs_type(str(path))
    assert kind == 0, message
    return int(magic)


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        ("truncate", "short file"),
        ("flip_last_piece", "checksum mismatch"),
        ("version", f"not a kvcascade v{FORMAT_VERSION} block file"),
        ("length", f"payload is {BIG + 1} bytes, expected {BIG}"),
        ("other_key", "holds another key's block"),
    ],
)
@pytest.mark.parametrize("o_direct", [True, False])
async def test_corrupt_big_block_each_check(
    tmp_path: Path, damage: str, expected: str, o_direct: bool
) -> None:
    """Every integrity check, on a block of several I/O pieces: the load fails as corrupt with
    the same words on both movers, the file is deleted and counted, the earlier block loaded."""
    host = kc.HostBuffer(4, BIG)
    try:
        tier = make_tier(tmp_path, host, o_direct=o_direct)
        async with running(tier):
            assert (await store(tier, host, [1, 2])).success
            path = tmp_path / tier.mapper.relative_path(key(2))
            data = bytearray(path.read_bytes())
            if damage == "truncate":
                data = data[: HEADER_BYTES + 300 * 1024]
            elif damage == "flip_last_piece":
                data[HEADER_BYTES + BIG - 1] ^= 0x80
            elif damage == "version":
                data[4] += 1
            elif damage == "length":
                data[8:16] = (BIG + 1).to_bytes(8, "little")
            else:
                data = bytearray((tmp_path / tier.mapper.relative_path(key(1))).read_bytes())
            path.write_bytes(data)
            result = await load(tier, [1, 2], [2, 3])
            assert not result.success and expected in result.error and str(path) in result.error
            assert result.successful_keys == [key(1)] and bytes(host.row(2)) == pattern(1, BIG)
            assert not path.exists() and tier.counters["corrupt_blocks"] == 1
    finally:
        host.close()


async def test_jobs_longer_than_one_compiled_batch(tmp_path: Path) -> None:
    """Jobs of more blocks than one compiled call takes (fs.COMPILED_BATCH) keep the job's
    semantics across calls: the failing block's index is the job's; a load reports the keys
    before it, a store every other key."""
    n = fs.COMPILED_BATCH + 6
    host = kc.HostBuffer(2 * n, 4096)
    try:
        tier = make_tier(tmp_path, host)
        async with running(tier):
            assert (await store(tier, host, list(range(n)))).success
            bad = fs.COMPILED_BATCH + 2
            Path(tier.path_of(key(bad))).unlink()
            result = await load(tier, list(range(n)), list(range(n, 2 * n)))
            assert not result.success and f"block {bad} failed" in result.error
            assert result.successful_keys == [key(i) for i in range(bad)]
            assert [bytes(host.row(n + i)) for i in range(bad)] == [
                pattern(i, 4096) for i in range(bad)
            ]
            # A store job failing in its second call (a plain file squats on a block's
            # directory) stores every other block, in both calls.
            ids = list(range(1000, 1000 + n))
            squat = Path(tier.path_of(key(ids[bad]))).parent
            squat.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            squat.write_bytes(b"")
            result = await store(tier, host, ids)
            assert not result.success and f"fs store of block {bad} failed" in result.error
            assert result.successful_keys == [key(i) for i in ids if i != ids[bad]]
            assert result.transfer_size == (n - 1) * 4096
            assert [Path(tier.path_of(key(i))).exists() for i in ids] == [
                i != ids[bad] for i in ids
            ]
            assert files(tmp_path, ".tmp") == []
    finally:
        host.close()


async def test_compiled_ops_return_errors_instead_of_raising(tmp_path: Path, io_path: str) -> None:
    """The raw fs ops report bad arguments and failed system calls as (values, kind, message)
    (store ops: (values, errnos, kind, message), going on after a failed block), never as a C++
    exception (which killed the interpreter on the H200 image); their xxh3 is
    the xxhash package's."""
    if io_path != "compiled":
        pytest.skip("calls the compiled ops")
    import xxhash

    ext = compiled_extension()
    for n in (0, 1, 16, 17, 128, 129, 240, 241, 1000, 300_000):
        data = random.Random(n).randbytes(n)
        assert ext.fs_xxh3(data) == xxhash.xxh3_64_intdigest(data)
    m = mapper()
    keys = [
        key(1),
        key(2, 7),
        kc.make_offload_key(b"\x0f", 2**32 - 1),
        kc.make_offload_key(b"ab", 0),
    ]
    prefix = f"{tmp_path}/{m.namespace}/"
    assert ext.fs_block_paths(prefix, keys) == (
        [f"{tmp_path}/{m.relative_path(k)}" for k in keys],
        0,
        "",
    )
    assert ext.fs_block_paths(prefix, [b"\x00" * 4]) == (
        [],
        1,
        "fs_block_paths: keys[0] is too short (4 bytes)",
    )
    missing = f"{prefix}{m.relative_path(key(1)).split('/', 1)[1]}"
    assert ext.fs_load_open(prefix, [key(1)], 0) == ([errno.ENOENT], 3, f"open:{missing}")
    assert ext.fs_store_write([3], [b"k"], [], 4096, 4096, 2, 0) == (
        [],
        [],
        1,
        "fs_store_write: lengths differ: fds 1, keys 1, addrs 0",
    )
    assert ext.fs_load_read([-1], [b"k"], [4096], 4096, 4096, 2, 0) == (
        [],
        1,
        "fs_load_read: fds[0] is negative",
    )
    assert ext.fs_store_write([], [], [], 4096, 100, 2, 0)[2:] == (
        1,
        "fs_store_write: span_bytes must be a multiple of 4096 >= payload_bytes (4096), got 100",
    )
    top = Path(missing).parent.parent
    assert ext.fs_store_open(prefix, [key(1)], "_x.tmp", 0, True) == (
        [ext.FS_FAILED],
        [errno.ENOENT],
        3,
        f"mkdir:{top}",
    )
    assert ext.fs_store_abort([ext.FS_EXISTS], prefix, [key(1)], ".tmp") == ([0], 0, "")
    # A store op goes on after a failed block: the first commit finds its temp file gone.
    Path(prefix).mkdir()
    two = [key(1), key(2)]
    fds, errnos, kind, _ = ext.fs_store_open(prefix, two, "_y.tmp", 0, False)
    assert (errnos, kind) == ([0, 0], 0) and min(fds) >= 0
    gone = f"{missing}_y.tmp"
    Path(gone).unlink()
    assert ext.fs_store_commit(fds, prefix, two, "_y.tmp", True, 0) == (
        [ext.FS_FAILED, 0],
        [errno.ENOENT, 0],
        3,
        f"rename:{gone}",
    )
    assert [Path(p).is_file() for p in ext.fs_block_paths(prefix, two)[0]] == [False, True]


@pytest.mark.parametrize("max_bytes", [None, 1 << 20])
async def test_store_of_a_present_key_keeps_the_file(
    tmp_path: Path, host: kc.HostBuffer, max_bytes: int | None
) -> None:
    """As vLLM's ``tiering/fs/io.py``: a store of a key whose file exists leaves that file as it is
    (a hit, 0 bytes written, no temp file left), with or without a size index; the compiled mover
    without one learns it from rename(RENAME_NOREPLACE) instead of a lookup first."""
    tier = make_tier(tmp_path, host, max_bytes=max_bytes)
    async with running(tier):
        assert (await store(tier, host, [1, 2], [0, 1])).success
        path = Path(tier.path_of(key(1)))
        before, mtime = path.read_bytes(), path.stat().st_mtime_ns
        host.row(0)[:] = pattern(99)  # other bytes under the same key: must not replace the file
        result = await tier.submit_store(job([key(1), key(3)], [0, 2], False))
        assert result.success and result.transfer_size == BLOCK
        assert path.read_bytes() == before and path.stat().st_mtime_ns == mtime
        assert files(tmp_path, ".tmp") == [] and len(files(tmp_path, ".bin")) == 3
        assert (await load(tier, [1], [5])).success and bytes(host.row(5)) == pattern(1)
        if max_bytes is not None:
            assert tier.used_bytes == 3 * file_size(BLOCK)


async def test_a_mapper_with_other_paths_keeps_the_python_mover(
    tmp_path: Path, host: kc.HostBuffer, io_path: str
) -> None:
    """The compiled helpers build FileMapper's paths themselves; a mapper that lays files out
    otherwise is checked at first use and its tier moves blocks in Python, at its own paths."""

    class FlatMapper(FileMapper):
        def relative_path(self, key: bytes) -> str:
            return f"{self.namespace}/{key.hex()}.bin"

    tier = FileSystemTier(host, tmp_path, FlatMapper(default_identity("test-model")))
    async with running(tier):
        assert (await store(tier, host, [1, 2])).success
        assert tier.compiled_io is False or io_path == "python"
        assert Path(tier.path_of(key(1))).parent == tier.data_dir
        assert (await load(tier, [1, 2], [5, 6])).success
        assert [bytes(host.row(s)) for s in (5, 6)] == [pattern(1), pattern(2)]


async def test_store_job_failing_twice_midway_cleans_up(tmp_path: Path) -> None:
    """A 20-block store job into a full filesystem whose last block's directory is squatted by
    a plain file: every block that fits is stored whole, each later one fails (ENOSPC, and
    ENOTDIR for the last), the first failure in order names the cause, and no temp file or
    partial file is left."""
    host = kc.HostBuffer(20, BLOCK)
    try:
        with mounted(tmp_path / "mnt", "tmpfs", "size=128k") as root:
            tier = make_tier(root, host)
            async with running(tier):
                squat = Path(tier.path_of(key(19))).parent
                squat.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                squat.write_bytes(b"")
                result = await store(tier, host, list(range(20)))
                assert not result.success and "No space left" in (result.error or "")
                stored = result.successful_keys or []
                assert 0 < len(stored) < 19 and stored == [key(i) for i in range(len(stored))]
                assert f"{20 - len(stored)} of 20 blocks failed" in (result.error or "")
                assert result.transfer_size == len(stored) * BLOCK
                assert files(root, ".tmp") == []
                assert {p.stat().st_size for p in files(root, ".bin")} == {file_size(BLOCK)}
                assert len(files(root, ".bin")) == len(stored)
    finally:
        host.close()


@pytest.mark.parametrize("max_bytes", [None, 1 << 20])
async def test_store_job_moves_every_block_after_one_failed_block(
    tmp_path: Path, host: kc.HostBuffer, max_bytes: int | None
) -> None:
    """Issue #14 defect 11: a store job goes on after a failing block. Of five blocks, the
    second cannot be opened (a plain file squats on its directory: ENOTDIR) and the fourth
    cannot be written (its directory is a full 4 KiB tmpfs: ENOSPC); the job fails, reports
    exactly the three others as stored with their bytes, and their files load back byte-exact;
    the failed blocks leave no file and no temp file, and the size index counts three files."""
    ids = [1, 2, 3, 4, 5]
    tier = make_tier(tmp_path, host, max_bytes=max_bytes)
    leaves = [Path(tier.path_of(key(i))).parent for i in ids]
    assert len({leaf.parent for leaf in leaves}) == len(ids)  # no shared directory
    leaves[1].parent.mkdir(mode=0o700, parents=True)
    leaves[1].write_bytes(b"")
    leaves[3].parent.mkdir(mode=0o700, parents=True)
    with mounted(leaves[3], "tmpfs", "size=4k") as full:
        async with running(tier):
            result = await store(tier, host, ids)
            assert not result.success
            assert result.successful_keys == [key(1), key(3), key(5)]
            assert result.transfer_size == 3 * BLOCK
            assert "fs store of block 1 failed" in (result.error or "")
            assert "Not a directory" in (result.error or "")
            assert "2 of 5 blocks failed" in (result.error or "")
            assert [Path(tier.path_of(key(i))).is_file() for i in ids] == [
                True,
                False,
                True,
                False,
                True,
            ]
            assert files(tmp_path, ".tmp") == [] and list(full.iterdir()) == []
            if max_bytes is not None:
                assert tier.used_bytes == 3 * file_size(BLOCK)
            loaded = await load(tier, [1, 3, 5], [10, 11, 12])
            assert loaded.success, loaded.error
            assert [bytes(host.row(s)) for s in (10, 11, 12)] == [pattern(i) for i in (1, 3, 5)]


# -- authenticated blocks (issue #21 item 5) ------------------------------------------------
SECRET = "kvcascade-fs-test-secret-0123456789"  # tests assert it never shows up


def auth_tier(root: Path, host: kc.HostBuffer, secret_env: str | None = None) -> FileSystemTier:
    cfg: dict[str, Any] = {"root_dir": str(root)}
    if secret_env is not None:
        cfg["auth_secret_env"] = secret_env
    return fs_tier_from_config(host, mapper(), cfg)


def forge(path: Path, k: bytes, payload: bytes, mac: bytes | None = None) -> None:
    """Write a block file of ``payload`` under ``k`` with valid checksums; with ``mac``, flag it
    authenticated with that (made-up) MAC."""
    data = bytearray(file_size(len(payload)))
    encode_header(k, payload, memoryview(data)[:HEADER_BYTES])
    if mac is not None:
        data[6] = 1  # flags bit 0: authenticated
        data[32:64] = mac
    data[HEADER_BYTES : HEADER_BYTES + len(payload)] = payload
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(data))


async def test_forged_block_with_valid_checksum_is_refused_and_deleted(
    tmp_path: Path,
    host: kc.HostBuffer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With a secret, a block forged with valid checksums (unflagged, or flagged with a made-up
    MAC) fails its load, is deleted and counted; the tier's own blocks load. The same forged
    file is served by a tier without a secret (checksums only, as before)."""
    monkeypatch.setenv("KVC_TEST_SECRET", SECRET)
    tier = auth_tier(tmp_path, host, "KVC_TEST_SECRET")
    assert not tier.compiled_io  # the compiled helpers do not compute the MAC
    async with running(tier):
        assert (await store(tier, host, [1])).success
        raw = (tmp_path / tier.mapper.relative_path(key(1))).read_bytes()
        assert raw[6] == 1 and raw[32:64] != bytes(32)  # flagged, with a MAC
        assert (await load(tier, [1], [4])).success and bytes(host.row(4)) == pattern(1)
        for i, mac, reason in [(2, None, "not authenticated"), (3, b"\x07" * 32, "MAC mismatch")]:
            path = tmp_path / tier.mapper.relative_path(key(i))
            forge(path, key(i), pattern(99), mac)
            check_block(key(i), path.read_bytes()[:HEADER_BYTES], memoryview(pattern(99)), "x")
            failed = await load(tier, [i], [5])
            assert not failed.success and reason in failed.error
            assert not path.exists()
        assert tier.counters["corrupt_blocks"] == 2
    plain = auth_tier(tmp_path, host)
    async with running(plain):
        path = tmp_path / plain.mapper.relative_path(key(2))
        forge(path, key(2), pattern(99))
        assert (await load(plain, [2], [5])).success and bytes(host.row(5)) == pattern(99)
        assert (await load(plain, [1], [6])).success  # authenticated blocks stay readable
    assert SECRET not in caplog.text


async def test_same_secret_shares_blocks_another_reads_nothing(
    tmp_path: Path,
    host: kc.HostBuffer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two tiers with the same secret (one from the environment, one from a file) share blocks;
    a tier with another secret, or one without a secret storing, gets misses only (the block
    fails its MAC and is deleted). The secret is in no log record and not in config.json."""
    caplog.set_level(logging.DEBUG)
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")  # surrounding whitespace is stripped
    monkeypatch.setenv("KVC_TEST_SECRET", SECRET)
    monkeypatch.setenv("KVC_OTHER_SECRET", SECRET[::-1])
    root = tmp_path / "cache"
    writer = auth_tier(root, host, "KVC_TEST_SECRET")
    reader = fs_tier_from_config(
        host, mapper(), {"root_dir": str(root), "auth_secret_file": str(secret_file)}
    )
    other = auth_tier(root, host, "KVC_OTHER_SECRET")
    plain = auth_tier(root, host)
    async with running(writer, reader, other, plain):
        assert (await store(writer, host, [1, 2])).success
        assert (await load(reader, [1, 2], [8, 9])).success
        assert bytes(host.row(8)) == pattern(1) and bytes(host.row(9)) == pattern(2)
        failed = await load(other, [1], [10])
        assert not failed.success and "MAC mismatch" in failed.error
        assert not Path(writer.path_of(key(1))).exists()  # deleted by the failed check
        assert (await store(plain, host, [3])).success
        failed = await load(reader, [3], [10])
        assert not failed.success and "not authenticated" in failed.error
    for text in [caplog.text, *(p.read_text() for p in root.rglob("config.json"))]:
        assert SECRET not in text and SECRET[::-1] not in text
    assert SECRET not in repr(writer._auth) and SECRET not in repr(vars(writer))


def test_secret_config_errors_name_the_source_never_the_secret(
    tmp_path: Path, host: kc.HostBuffer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both keys, a bad type, an unset variable, an unreadable file or a short secret: each a
    ConfigError naming the variable or file (never the secret), raised before the directory
    is created."""
    monkeypatch.setenv("KVC_SHORT_SECRET", "tooshort")
    monkeypatch.delenv("KVC_UNSET_SECRET", raising=False)
    root = tmp_path / "never"
    for extra, message in [
        ({"auth_secret_env": "A", "auth_secret_file": "/f"}, "not both"),
        ({"auth_secret_env": 5}, "auth_secret_env must be a non-empty string, got 5"),
        ({"auth_secret_env": "KVC_UNSET_SECRET"}, "environment variable KVC_UNSET_SECRET is not"),
        ({"auth_secret_file": str(tmp_path / "nope")}, "cannot read file .*nope"),
        ({"auth_secret_env": "KVC_SHORT_SECRET"}, "KVC_SHORT_SECRET is shorter than 16 bytes"),
    ]:
        cfg = {"root_dir": str(root), **extra}
        with pytest.raises(kc.ConfigError, match=message) as info:
            fs_tier_from_config(host, mapper(), cfg)
        assert "tooshort" not in str(info.value)
    with pytest.raises(kc.ConfigError, match="not both"):
        fs.check_fs_tier_config(
            {"root_dir": "x", "auth_secret_env": "A", "auth_secret_file": "B"}, 1
        )
    assert not root.exists()


async def test_engines_with_the_same_secret_share_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Three Cascades on one fs root, one after the other: the second (same secret) finds and
    loads the first one's block byte for byte; the third (another secret) finds the file but
    its load fails the MAC (loaded 0), and the file is gone. No secret in logs or config.json."""
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("KVC_ENGINE_SECRET", SECRET)
    monkeypatch.setenv("KVC_ENGINE_OTHER", SECRET[::-1])

    def cfg(env: str) -> kc.CascadeConfig:
        tier = {"type": "fs", "root_dir": str(tmp_path), "auth_secret_env": env}
        return kc.CascadeConfig(
            block_bytes=64, gpu_blocks=8, cpu_blocks=4, secondary_tiers=[tier], model_name="m"
        )

    async with kc.open_cascade(cfg("KVC_ENGINE_SECRET")) as writer:
        writer.device.kv[1] = 7
        ctx = kc.ReqContext("w")
        assert (await writer.store([key(1)], ctx, [1])).stored == [key(1)]
        await writer.wait_cascades()
        writer.finish_request(ctx)
    [path] = files(tmp_path, ".bin")
    for env, loaded in [("KVC_ENGINE_SECRET", 1), ("KVC_ENGINE_OTHER", 0)]:
        async with kc.open_cascade(cfg(env)) as reader:
            ctx = kc.ReqContext("r")
            found = await reader.lookup_prefix([key(1)], ctx)
            assert found.tiers == ["fs"]
            assert (await reader.load(found.keys, ctx, [5])).loaded == loaded
            reader.finish_request(ctx)
            if loaded:
                assert bytes(reader.device.kv[5].numpy()) == b"\x07" * 64
    assert not path.exists()  # deleted by the engine with the other secret
    for text in [caplog.text, *(p.read_text() for p in tmp_path.rglob("config.json"))]:
        assert SECRET not in text and SECRET[::-1] not in text
