"""Model test of the asyncio ``Cascade`` as a whole (issue #14): a small CPU tier, an fs tier on
a real directory (bounded or not) and a fault-scripted memory tier, under concurrent requests.

Rules: ``lookup_prefix``, ``load`` and ``store`` (awaited at once, or left running as tasks and
awaited or cancelled a few loop iterations later), ``touch``, ``finish_request`` (also right
after a lookup: an abort), keys repeated in one call and shared between requests, a store from
the GPU rows a load in flight is filling and a load into the GPU rows a store in flight copies
from, and faults: block files deleted, truncated or corrupted, memory-tier jobs that fail or
stall past their deadline (``io_timeout_s``, with a short ``pending_write_timeout_s``), and a
restart on the same fs directory (with the temp files a ``kill -9`` of the last writer leaves,
which the restart must delete).

The GPU is the cascade's own device KV cache (``cascade.device.kv``, a CPU tensor): before a
store the rule writes the bytes of each key into its GPU row; after a load it reads them back.

Invariants: every byte a load reports loaded equals the bytes stored under that key; every
ready primary row, every memory-tier block and every fs block file holds the bytes of its key
(a write in flight is never readable); no call raises but a ``ValueError``/``TypeError`` for
keys given twice. After all requests finished and the cascades drained (before a restart and at
the end): no pin, no reservation and no quarantined slot is left in the primary tier, and the
bounded fs tier's ``used_bytes`` equals the bytes of its block files on disk (after a probe of
every key, which drops the index entries of files deleted from outside).

The default run is deterministic (``derandomize``); ``KVCASCADE_MODEL_EXAMPLES=<n>`` runs ``n``
random examples instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from test_coordinator_model import ScriptedTier

import kvcascade as kc
from kvcascade._policy_state import policy_state_path
from kvcascade.tiers._block_format import HEADER_BYTES, file_size

BLOCK = 512  # KV bytes of one block
GPU_ROWS = 8
HASHES = [hashlib.sha256(b"h%d" % i).digest()[:16] for i in range(4)]
KEYS = [kc.make_offload_key(h, 0) for h in HASHES]


def alias(key: bytes) -> bytes:
    """The key of the same block hash in KV-cache group 1: the same bytes (:func:`payload`)."""
    return kc.make_offload_key(key[:-4], 1)


def payload(key: bytes) -> bytes:
    """The KV bytes of ``key``: a function of its block hash only."""
    return (hashlib.sha256(key[:-4]).digest() * (BLOCK // 32))[:BLOCK]


ALL_KEYS = KEYS + [alias(k) for k in KEYS]


class ErrorLog(logging.Handler):
    """The ERROR records of the ``kvcascade`` loggers while it is attached (both model tests)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []
        logging.getLogger("kvcascade").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.name}: {record.getMessage()} ({record.exc_info!r:.200})")

    def close(self) -> None:
        logging.getLogger("kvcascade").removeHandler(self)
        super().close()


class FaultyTier(ScriptedTier):
    """The scripted memory tier with a short deadline, built by the cascade (``module_path``)."""

    def __init__(self, host: kc.HostBuffer, name: str, io_timeout_s: float) -> None:
        super().__init__(host, name)
        self.io_timeout_s = io_timeout_s


@dataclass(eq=False)
class Request:
    ctx: kc.ReqContext
    found: list[bytes] = field(default_factory=list)  # the last lookup's prefix
    op: Op | None = None  # its call in flight


@dataclass(eq=False)
class Op:
    """A ``load`` or ``store`` left running as a task."""

    kind: str
    req: Request
    keys: list[bytes]
    rows: list[int]
    task: asyncio.Task[object]
    aliases: dict[bytes, int] = field(default_factory=dict)  # stored from our rows: alias → i


def _duplicated(keys: list[bytes]) -> bool:
    return len(set(keys)) < len(keys)


#: Requests' ``kv_transfer_params`` in turn: none, session hints the default policy files under
#: classes of their own (an ending session, a short ``ttl_s`` that expires within a run, a
#: priority), and malformed ones that must be served as unhinted (docs/policies.md, *Session
#: hints*). With secondary tiers no hint refuses a store, so the model's expectations hold.
_HINTS: list[dict[str, Any] | None] = [
    None,
    {"kvcascade_hint": {"continues": False, "ttl_s": 0.01, "priority": 2}},
    {"kvcascade_hint": {"continues": True, "priority": -1}},
    {"kvcascade_hint": {"ttl_s": 10**400}},
    {"kvcascade_hint": {1: 1, "x": 2}},
]


class CascadeModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.root = tempfile.mkdtemp(prefix="kvc-model-")
        self.stack: contextlib.AsyncExitStack | None = None
        self.reqs: list[Request] = []
        self.ops: list[Op] = []
        self.tainted: set[bytes] = set()  # keys whose bytes the test cannot know
        self.provisional: set[bytes] = set()  # stored from rows a load in flight fills
        self.damaged: set[bytes] = set()  # fs files the test truncated or corrupted
        # fs files truncated since the tier was opened: it counts them at their written size
        # until it reads them; a tier opened later counts what it finds on disk
        self.truncated: set[bytes] = set()
        self.n = 0
        self.errors = ErrorLog()

    def run(self, aw: Awaitable[Any]) -> Any:
        return self.loop.run_until_complete(aw)

    # -- lifecycle -------------------------------------------------------------------------
    @initialize(
        cpu_blocks=st.integers(1, 6),
        max_files=st.sampled_from([None, 2, 4]),
        write_timeout=st.sampled_from([None, 0.05]),
    )
    def start(self, cpu_blocks: int, max_files: int | None, write_timeout: float | None) -> None:
        fs: dict[str, object] = {"type": "fs", "root_dir": self.root, "io_threads": 2}
        if max_files is not None:
            fs["max_bytes"] = max_files * file_size(BLOCK)
        mem = {"type": "FaultyTier", "module_path": __name__, "name": "mem", "io_timeout_s": 0.1}
        self.config = kc.CascadeConfig(
            block_bytes=BLOCK,
            gpu_blocks=GPU_ROWS,
            cpu_blocks=cpu_blocks,
            secondary_tiers=[fs, mem],
            pending_write_timeout_s=write_timeout,
            model_name="test-model",
        )
        self._open()

    def _open(self) -> None:
        self.stack = contextlib.AsyncExitStack()
        self.cascade: kc.Cascade = self.run(
            self.stack.enter_async_context(kc.open_cascade(self.config))
        )
        self.fs: kc.FileSystemTier = self.cascade.tiers[0]  # type: ignore[assignment]
        self.mem: FaultyTier = self.cascade.tiers[1]  # type: ignore[assignment]
        self.rules_since_restart = 0
        self.truncated.clear()

    def _request(self, i: int) -> Request:
        while len(self.reqs) <= i:
            self.reqs.append(self._new_ctx())
        return self.reqs[i]

    def _new_ctx(self) -> Request:
        self.n += 1
        params = _HINTS[self.n % len(_HINTS)]
        return Request(kc.ReqContext(f"q{self.n}", None if params is None else dict(params)))

    def _free_rows(self, rows: list[int], n: int) -> list[int] | None:
        busy = {r for op in self.ops for r in op.rows}
        free = [r for r in rows if r not in busy]
        return free[:n] if len(free) >= n else None

    # -- results ---------------------------------------------------------------------------
    def _loaded(self, op_keys: list[bytes], rows: list[int], result: kc.LoadResult) -> None:
        """Every GPU row a load reports filled holds the bytes of its key."""
        kv = self.cascade.device.kv
        skip = self.tainted | self.provisional
        for key, row in list(zip(op_keys, rows))[: result.loaded]:
            if key not in skip:
                assert kv[row].numpy().tobytes() == payload(key), (
                    f"load of {key.hex()[:8]} into GPU row {row} delivered other bytes than "
                    "were stored under that key"
                )

    def _finish_op(self, op: Op, cancelled: bool = False) -> None:
        self.ops.remove(op)
        op.req.op = None
        loaded = 0
        if op.kind == "load" and not cancelled:
            result: kc.LoadResult = op.task.result()
            self._loaded(op.keys, op.rows, result)
            loaded = result.loaded
        for key, i in op.aliases.items():  # stored from our rows while we filled them
            self.provisional.discard(key)
            if cancelled or i >= loaded:
                self.tainted.add(key)

    def _await(self, op: Op) -> None:
        try:
            self.run(asyncio.wait([op.task]))
            op.task.result()
        except (ValueError, TypeError):
            assert _duplicated(op.keys), "a call failed without keys given twice"
            op.req.found = []
            self.ops.remove(op)
            op.req.op = None
            return
        self._finish_op(op)

    # -- rules -----------------------------------------------------------------------------
    @rule(
        i=st.integers(0, 2),
        keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3),
        repeat=st.booleans(),
    )
    def lookup(self, i: int, keys: list[bytes], repeat: bool) -> None:
        """``repeat``: the first key is given twice (``[K, K, ...]``)."""
        req = self._request(i)
        if req.op is not None:
            return
        if repeat:
            keys = [keys[0], *keys]
        try:
            out: kc.PrefixLookup = self.run(self.cascade.lookup_prefix(keys, req.ctx))
        except (ValueError, TypeError):
            assert _duplicated(keys), "lookup_prefix failed without keys given twice"
            return
        req.found = list(out.keys)

    @rule(
        i=st.integers(0, 2),
        rows=st.permutations(range(GPU_ROWS)),
        background=st.booleans(),
    )
    def load(self, i: int, rows: list[int], background: bool) -> None:
        req = self._request(i)
        if req.op is not None or not req.found:
            return
        picked = self._free_rows(rows, len(req.found))
        if picked is None:
            return
        keys, req.found = req.found, []
        self.cascade.device.kv[picked] = 0  # stale KV, unlike any key's bytes
        task = self.loop.create_task(self.cascade.load(keys, req.ctx, picked))
        op = Op("load", req, keys, picked, task)
        self.ops.append(op)
        req.op = op
        if not background:
            self._await(op)

    @rule(
        i=st.integers(0, 2),
        keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3),
        rows=st.permutations(range(GPU_ROWS)),
        background=st.booleans(),
    )
    def store(self, i: int, keys: list[bytes], rows: list[int], background: bool) -> None:
        req = self._request(i)
        if req.op is not None:
            return
        picked = self._free_rows(rows, len(keys))
        if picked is None:
            return
        kv = self.cascade.device.kv
        for key, row in zip(keys, picked):  # the forward pass computes the KV
            kv[row] = torch.frombuffer(bytearray(payload(key)), dtype=torch.int8)
        task = self.loop.create_task(self.cascade.store(keys, req.ctx, picked))
        op = Op("store", req, keys, picked, task)
        self.ops.append(op)
        req.op = op
        if not background:
            self._await(op)

    @precondition(lambda self: any(op.kind == "load" for op in self.ops))
    @rule(j=st.integers(0, 7), spins=st.integers(0, 3))
    def store_from_rows_being_loaded(self, j: int, spins: int) -> None:
        """Another request stores the block a load in flight is bringing into a GPU row (under
        its group-1 key, same bytes): the store must copy what the load delivers."""
        loads = [op for op in self.ops if op.kind == "load"]
        op = loads[j % len(loads)]
        for _ in range(spins):
            self.run(asyncio.sleep(0))
        if op.task.done():
            return
        i = j % len(op.keys)
        key = alias(op.keys[i])
        if key == op.keys[i] or key in self.provisional:
            return
        other = self._new_ctx()
        self.provisional.add(key)
        try:
            out: kc.StoreResult = self.run(self.cascade.store([key], other.ctx, [op.rows[i]]))
        except (ValueError, TypeError):  # a clear refusal of rows being loaded is fine
            out = kc.StoreResult()
        self.cascade.finish_request(other.ctx)
        if key in out.stored:
            op.aliases[key] = i
        else:
            self.provisional.discard(key)

    @rule(
        key=st.sampled_from(KEYS),
        keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True),
        rows=st.permutations(range(GPU_ROWS)),
        spins=st.integers(0, 2),
    )
    def load_into_rows_being_stored(
        self, key: bytes, keys: list[bytes], rows: list[int], spins: int
    ) -> None:
        """A store from GPU rows is left running, and another request loads ``key`` into the
        first of those rows (the reverse of ``store_from_rows_being_loaded``): the store, called
        first, must publish the rows' bytes from before the load, never the loaded ones (found
        by a break-it run), and the load must deliver ``key``'s bytes."""
        picked = self._free_rows(rows, len(keys))
        if picked is None:
            return
        reader, writer = self._new_ctx(), self._new_ctx()
        found: kc.PrefixLookup = self.run(self.cascade.lookup_prefix([key], reader.ctx))
        kv = self.cascade.device.kv
        for k, row in zip(keys, picked):
            kv[row] = torch.frombuffer(bytearray(payload(k)), dtype=torch.int8)
        store = Op(
            "store",
            writer,
            keys,
            picked,
            self.loop.create_task(self.cascade.store(keys, writer.ctx, picked)),
        )
        self.ops.append(store)
        writer.op = store
        for _ in range(spins):
            self.run(asyncio.sleep(0))
        if found.keys:
            result: kc.LoadResult = self.run(self.cascade.load(found.keys, reader.ctx, picked[:1]))
            self._loaded(list(found.keys), picked[:1], result)
        self._await(store)
        self.cascade.finish_request(reader.ctx)
        self.cascade.finish_request(writer.ctx)

    @precondition(lambda self: not self.ops)
    @rule(key=st.sampled_from(KEYS), rows=st.permutations(range(GPU_ROWS)))
    def load_a_key_twice_while_it_cascades(self, key: bytes, rows: list[int]) -> None:
        """``store([K])``, then at once ``lookup_prefix([K, K])`` and ``load`` into two GPU rows
        while K's cascade may still hold its read pin: the calls refuse the repeated key, or the
        pins of K stay balanced (else a load or the cascade's result fails on a missing pin)."""
        writer, reader = self._new_ctx(), self._new_ctx()
        self.cascade.device.kv[rows[0]] = torch.frombuffer(
            bytearray(payload(key)), dtype=torch.int8
        )
        try:
            self.run(self.cascade.store([key], writer.ctx, rows[:1]))
            out: kc.PrefixLookup = self.run(self.cascade.lookup_prefix([key, key], reader.ctx))
            if len(out.keys) == 2:
                result = self.run(self.cascade.load([key, key], reader.ctx, rows[1:3]))
                self._loaded([key, key], rows[1:3], result)
        except (ValueError, TypeError):
            pass  # the repeated key refused
        finally:
            self.cascade.finish_request(writer.ctx)
            self.cascade.finish_request(reader.ctx)

    @precondition(lambda self: not self.ops)
    @rule(j=st.integers(0, 3), row=st.integers(0, GPU_ROWS - 1))
    def store_from_a_row_a_promotion_fills(self, j: int, row: int) -> None:
        """A key only a secondary tier holds is loaded into a GPU row (its promotion in flight),
        and meanwhile its group-1 alias is stored from that row: the store must publish the
        bytes the load brings, not the row's stale bytes."""
        absent = [
            k
            for k in KEYS
            if self.cascade.primary.get_block(k) is None
            and self.cascade.primary.get_block(alias(k)) is None
            and k not in self.tainted
            and os.path.exists(self.fs.path_of(k))
            and k not in self.damaged
        ]
        if not absent:
            return
        key = absent[j % len(absent)]
        reader, writer = self._new_ctx(), self._new_ctx()
        out: kc.PrefixLookup = self.run(self.cascade.lookup_prefix([key], reader.ctx))
        if out.keys:
            self.cascade.device.kv[row] = 0  # stale KV
            load = self.loop.create_task(self.cascade.load([key], reader.ctx, [row]))
            stored: kc.StoreResult = self.run(self.cascade.store([alias(key)], writer.ctx, [row]))
            result: kc.LoadResult = self.run(load)
            self._loaded([key], [row], result)
            if alias(key) in stored.stored and not result.loaded:
                self.tainted.add(alias(key))  # the row kept its stale bytes
        self.cascade.finish_request(reader.ctx)
        self.cascade.finish_request(writer.ctx)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True))
    def abort_then_drain(self, keys: list[bytes]) -> None:
        """A request looks up (secondary hits queue promotions into reserved slots) and is
        aborted before any load; then drain and check that no reservation outlived it."""
        req = self._new_ctx()
        self.run(self.cascade.lookup_prefix(keys, req.ctx))
        self.cascade.finish_request(req.ctx)
        self._drain_and_check()

    @precondition(lambda self: bool(self.ops))
    @rule(j=st.integers(0, 7))
    def await_op(self, j: int) -> None:
        self._await(self.ops[j % len(self.ops)])

    @precondition(lambda self: bool(self.ops))
    @rule(j=st.integers(0, 7), spins=st.integers(0, 4))
    def cancel_op(self, j: int, spins: int) -> None:
        op = self.ops[j % len(self.ops)]
        for _ in range(spins):
            self.run(asyncio.sleep(0))
        op.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            self.run(asyncio.wait([op.task]))
        if op.task.cancelled():
            self._finish_op(op, cancelled=True)
        else:
            self._await(op)

    @rule(i=st.integers(0, 2), keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3))
    def touch(self, i: int, keys: list[bytes]) -> None:
        try:
            self.cascade.touch(keys, self._request(i).ctx)
        except (ValueError, TypeError):
            assert _duplicated(keys), "touch failed without keys given twice"

    @rule(i=st.integers(0, 2))
    def finish(self, i: int) -> None:
        """The request ends (after a lookup without its load: an abort)."""
        req = self._request(i)
        if req.op is not None:
            return
        self.cascade.finish_request(req.ctx)
        self.reqs[i] = self._new_ctx()

    # -- faults ----------------------------------------------------------------------------
    @rule(
        key=st.sampled_from(ALL_KEYS),
        fault=st.sampled_from(
            ["delete", "truncate", "corrupt", "drop", "fail", "stall", "release", "release"]
        ),
    )
    def fault(self, key: bytes, fault: str) -> None:
        """Damage ``key``'s block file (delete, truncate: a short read, corrupt bytes), drop it
        from the memory tier, script the memory tier's next job to fail (EIO-like) or stall
        past its deadline, or release the stalled jobs."""
        if fault in ("fail", "stall"):
            self.mem.modes.append(fault)
        elif fault == "release":
            self.mem.release.set()
            self.mem.modes.clear()
            self.run(asyncio.sleep(0.01))
            self.mem.release.clear()
        elif fault == "drop":
            self.mem.blocks.pop(key, None)
        elif os.path.exists(path := self.fs.path_of(key)):
            if fault == "delete":
                os.unlink(path)
                return
            with open(path, "r+b") as f:
                if fault == "truncate":
                    f.truncate(HEADER_BYTES + BLOCK // 2)
                    self.truncated.add(key)
                else:
                    f.seek(HEADER_BYTES + 7)
                    f.write(b"\xff\x00\xff")
            self.damaged.add(key)

    @precondition(lambda self: self.rules_since_restart >= 20)
    @rule()
    def restart(self) -> None:
        """Drain, check, close the cascade, and open a new one on the same fs directory; the
        temp files a ``kill -9`` of the last writer would have left (a block file's, and the
        policy state's beside ``config.json``, ``kvcascade/_atomic.py``) are gone after it."""
        self._drain_and_check()
        config = Path(self.fs.root) / self.fs.mapper.config_relative_path()
        state = policy_state_path(self.cascade.primary.policy, self.cascade.tiers) or config
        block = Path(self.fs.path_of(ALL_KEYS[0]))
        self._close()
        dead = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # no process has it
        block.parent.mkdir(parents=True, exist_ok=True)
        crashed = [Path(f"{path}_{dead}_0.tmp") for path in (block, state)]
        for temp in crashed:
            temp.write_bytes(b"partial")
        self._open()
        survived = [temp for temp in crashed if temp.exists()]
        assert not survived, f"a dead writer's temp files survived the restart: {survived}"

    # -- drain -----------------------------------------------------------------------------
    def _drain_and_check(self) -> None:
        self.mem.release.set()
        self.mem.modes.clear()
        for op in list(self.ops):
            self._await(op)
        for req in self.reqs:
            self.cascade.finish_request(req.ctx)
        self.reqs = []
        cascade = self.cascade
        for _ in range(500):  # until every abandoned I/O thread has returned and reported
            self.run(cascade.wait_cascades())
            for tier in cascade.tiers:
                self.run(tier.drain())
            self.run(asyncio.sleep(0.01))
            cascade.coordinator.poll_now()
            # queued promotions are no work in flight: they must have been submitted by now
            if (
                not cascade.coordinator.job_futures()
                and not any(t.has_pending_work() for t in cascade.tiers)
                and not self.mem.counters["stuck_threads"]
            ):
                break
        self.mem.release.clear()
        primary = cascade.primary
        tracked = list(primary.policy.keys())
        states = {k.hex()[:8]: primary.get_block(k).ref_cnt for k in tracked}  # type: ignore[union-attr]
        assert all(v == 0 for v in states.values()), (
            f"pins (> 0) or reservations (-1) left after every request finished: {states}"
        )
        assert primary.num_free + len(tracked) == primary.num_blocks, (
            f"{primary.num_blocks - primary.num_free - len(tracked)} primary slots neither free "
            "nor tracked (quarantined) after the cascades drained"
        )
        assert not self.errors.records, self.errors.records[0]
        if self.fs.max_bytes is not None:
            # A file deleted from outside leaves the index when a probe finds it gone.
            self.run(self.fs.contains(ALL_KEYS))
            on_disk = 0
            for key in ALL_KEYS:
                with contextlib.suppress(FileNotFoundError):
                    size = os.path.getsize(self.fs.path_of(key))
                    # a file truncated by the test counts as written until the tier reads it
                    on_disk += file_size(BLOCK) if key in self.truncated else size
            assert self.fs.used_bytes == on_disk, (
                f"fs tier counts {self.fs.used_bytes} B of block files, {on_disk} B on disk"
            )

    def _close(self) -> None:
        if self.stack is not None:
            self.run(self.stack.aclose())
            self.stack = None

    # -- invariants ------------------------------------------------------------------------
    @invariant()
    def nothing_logged_an_error(self) -> None:
        """An ERROR from kvcascade (e.g. the coordinator's "applying the result of job") is a
        broken invariant the code caught and logged instead of raising."""
        assert not self.errors.records, self.errors.records[0]

    @invariant()
    def stored_bytes_are_the_keys_bytes(self) -> None:
        if self.stack is None:
            return
        self.rules_since_restart += 1
        skip = self.tainted | self.provisional
        primary = self.cascade.primary
        host = self.cascade.host
        for key in list(primary.policy.keys()):
            block = primary.get_block(key)
            assert block is not None and block.ref_cnt >= -1
            if block.ref_cnt >= 0 and key not in skip:
                assert bytes(host.row(block.block_id)) == payload(key), (
                    f"ready primary slot {block.block_id} holds other bytes than {key.hex()[:8]}"
                )
        for key, data in list(self.mem.blocks.items()):
            if key not in skip:
                assert data == payload(key), f"memory tier holds other bytes for {key.hex()[:8]}"
        for key in ALL_KEYS:
            path = self.fs.path_of(key)
            try:
                with open(path, "rb") as f:
                    f.seek(HEADER_BYTES)
                    data = f.read(BLOCK)
            except FileNotFoundError:
                self.damaged.discard(key)
                self.truncated.discard(key)
                continue
            if key not in skip and key not in self.damaged:
                assert data == payload(key), f"fs block file of {key.hex()[:8]} holds other bytes"

    def teardown(self) -> None:
        try:
            if self.stack is not None:
                self._drain_and_check()
        finally:
            if self.stack is not None:
                self.mem.release.set()
            self._close()
            self.errors.close()
            self.loop.close()
            shutil.rmtree(self.root, ignore_errors=True)


_EXAMPLES = int(os.environ.get("KVCASCADE_MODEL_EXAMPLES", "0"))
CascadeModel.TestCase.settings = settings(
    max_examples=_EXAMPLES or 40,
    stateful_step_count=40,
    derandomize=not _EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCascadeModel = CascadeModel.TestCase
