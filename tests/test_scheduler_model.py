"""Model test of the scheduler side as vLLM drives it (issue #14): ``OffloadScheduler`` over a
real ``TieringCoordinator`` and a scripted memory tier, run by a fake engine that imitates
vLLM v1's scheduler (``vllm/v1/core/sched/scheduler.py``) and a fake worker that imitates
``kvcascade.integrations.vllm._WorkerSide``.

The machine has one rule, the engine step, so every example is a run of steps long enough for
requests to be stored, evicted, promoted and read again. Before a step: a burst of requests may
arrive (sharing a family's prompt prefix, continuing an earlier request as its next turn, with a
higher priority than the waiting queue, or owned by another connector of a MultiConnector that
computes them or loads their KV itself), the tier's next job may be scripted to fail, a running
request may be preempted and a live one aborted.

Each engine step: preempted requests free their blocks; running requests get the blocks their
next tokens need (the last running request is preempted when blocks run out); waiting requests
are looked up (``get_num_new_matched_tokens``), get blocks, and ``update_state_after_alloc`` —
with the tokens to load, or 0 (also for a request another connector of a MultiConnector owns,
which our scheduler never looked up); ``build_step``; the worker flushes ``jobs_to_flush``,
submits the stores queued last step and this step's loads, copies each job before or after the
forward pass, runs the forward pass (writes the KV of the scheduled tokens into their GPU
blocks), queues this step's stores, and reports finished jobs now or a step later;
``on_jobs_finished``; requests that reached their length finish (``request_finished``, then
their blocks are freed and re-used, last freed first). The event loop runs between steps so
tier jobs complete.

Checked: a store copies only GPU blocks that still hold the KV of its key (a block re-allocated
and rewritten must have been flushed first); every loaded chunk holds the bytes of its key;
every ready primary row and every tier block holds the bytes of its key; a promotion that
landed for a request stays in the primary tier until that request's next lookup, and is a hit
there; a request's store cursor passes a chunk only if the chunk is stored, being written, or
its own write of it failed — never leaving a hole when another request's write of a shared
chunk fails.

The default run is deterministic (``derandomize``); ``KVCASCADE_MODEL_EXAMPLES=<n>`` runs ``n``
random examples instead.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from test_cascade_model import ErrorLog
from test_coordinator_model import ScriptedTier

import kvcascade as kc
from kvcascade.scheduler import (
    GroupSpec,
    OffloadScheduler,
    ScheduledRequest,
    SchedulerConfig,
    StepInput,
    StepPlan,
    TransferSpec,
)

T = 4  # tokens per block = per hash = per chunk (blocks_per_chunk 1)
BLOCK = 64  # KV bytes of one block
GPU_BLOCKS = 16  # ids 1..16; 0 is vLLM's null block
FAMILIES = ["f0", "f1", "f2", "f3"]  # requests of one family share their prompt's leading tokens


def payload(key: bytes) -> bytes:
    """The KV bytes every request computes for the chunk of ``key``."""
    return (hashlib.sha256(key).digest() * (BLOCK // 32))[:BLOCK]


@dataclass(eq=False)
class Request:
    """An engine request as ``RequestView``, plus the fake engine's state of it."""

    request_id: str
    family: str
    num_prompt_tokens: int
    max_new: int
    parent: Request | None = None  # the earlier turn of the conversation it continues
    foreign: str = ""  # owned by another connector of a MultiConnector: "scheduled", "remote"
    num_tokens: int = 0
    num_computed_tokens: int = 0
    kv_transfer_params: dict | None = None
    skip_reading_prefix_cache: bool = False
    finished: bool = False
    aborted: bool = False
    status: str = "waiting"  # waiting, loading, running, done
    blocks: list[int] = field(default_factory=list)
    freed: list[int] = field(default_factory=list)  # blocks held when it finished
    hits: int = 0
    out: int = 0
    resumed: bool = False
    load_failed: bool = False
    own_failed: set[bytes] = field(default_factory=set)  # keys its own failed stores carried
    checked: int = 0  # chunks below this passed the cursor check
    watch: dict[int, int] = field(default_factory=dict)  # chunk → time its write was in flight

    def __post_init__(self) -> None:
        self.num_tokens = self.num_prompt_tokens

    def block_hash(self, j: int) -> bytes:
        # A next turn's blocks within its parent's tokens are the parent's; other blocks
        # entirely inside the prompt are shared by the family; later ones are the request's
        # own (they hold its sampled tokens).
        if self.parent is not None and (j + 1) * T <= self.parent.num_tokens:
            return self.parent.block_hash(j)
        owner = self.family if (j + 1) * T <= self.num_prompt_tokens else self.request_id
        return hashlib.sha256(f"{owner}/{j}".encode()).digest()[:16]

    def key(self, j: int) -> bytes:
        return kc.make_offload_key(self.block_hash(j), 0)

    @property
    def block_hashes(self) -> list[bytes]:
        return [self.block_hash(j) for j in range(self.num_tokens // T)]


class RecordingTier(ScriptedTier):
    """The scripted memory tier; reports each promotion that landed to ``on_landed``."""

    on_landed: Callable[[str, Sequence[bytes]], None] | None = None

    def submit_load(self, job: kc.TransferJob) -> asyncio.Future[kc.JobResult]:
        fut = super().submit_load(job)

        def landed(f: asyncio.Future[kc.JobResult]) -> None:
            result = f.result()
            keys = job.keys if result.success else (result.successful_keys or [])
            if keys and job.req_context is not None and self.on_landed is not None:
                self.on_landed(job.req_context.req_id, list(keys))

        fut.add_done_callback(landed)
        return fut


@dataclass
class WorkerJob:
    job_id: int
    spec: TransferSpec
    keys: list[bytes]
    store: bool
    copied: bool = False
    failed: bool = False


class SchedulerModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.actors: list[asyncio.Task[None]] = []
        self.host: kc.HostBuffer | None = None
        self.errors = ErrorLog()

    def run(self, aw: Awaitable[Any]) -> Any:
        return self.loop.run_until_complete(aw)

    @initialize(cpu_blocks=st.sampled_from([2, 6, 3, 8]))
    def start(self, cpu_blocks: int) -> None:
        self.host = kc.HostBuffer(cpu_blocks, BLOCK)
        self.primary = kc.CPUOffloadingManager(cpu_blocks, enable_events=True)
        self.tier = RecordingTier(self.host, "mem")
        self.tier.on_landed = self._landed
        started = asyncio.Event()
        self.actors.append(self.loop.create_task(self.tier.serve(started.set)))
        self.run(started.wait())
        self.coord = kc.TieringCoordinator(self.primary, [self.tier])
        self.sched = OffloadScheduler(SchedulerConfig((GroupSpec(T),), T), self.coord)
        self.gpu = np.zeros((GPU_BLOCKS + 1, BLOCK), dtype=np.uint8)
        self.free = list(range(GPU_BLOCKS, 0, -1))  # pop() hands out the last freed first
        self.reqs: list[Request] = []
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.finished_ids: list[str] = []  # finished since the last step (vLLM's list)
        self.queued: list[WorkerJob] = []  # stores waiting for the next step's start
        self.remote_loads: list[Request] = []  # the other connector's loads of this step
        self.unacked: list[WorkerJob] = []  # copied, not yet reported
        self.fail_stores: tuple[int, ...] = ()  # positions of this step's failing store copies
        self.stores_copied = 0
        self.landed: dict[str, set[bytes]] = {}  # promotions that landed for each request
        self.ready_at: dict[bytes, int] = {}  # last time a write of the key succeeded
        self.t = 0

    def _landed(self, req_id: str, keys: Sequence[bytes]) -> None:
        self.landed.setdefault(req_id, set()).update(keys)
        for key in keys:
            self.ready_at[key] = self.t

    # -- rules -------------------------------------------------------------------------------
    # One rule: every example is a run of engine steps, so that requests live long enough to
    # be stored, evicted, promoted and read.
    _BURST = st.tuples(  # the arguments of _arrive
        st.sampled_from(FAMILIES),
        st.lists(st.tuples(st.integers(1, 3), st.integers(1, T - 1)), min_size=1, max_size=3),
        st.integers(1, 4),
        st.sampled_from(["", "", "scheduled", "remote"]),
        st.booleans(),
        st.none() | st.integers(0, 15),
    )

    def _arrive(
        self,
        family: str,
        sizes: list[tuple[int, int]],
        max_new: int,
        foreign: str,
        front: bool,
        turn: int | None,
    ) -> None:
        """A burst of requests whose prompts share the family's leading tokens (``chunks`` full
        chunks plus ``tail`` tokens each). ``foreign``: owned by another connector of a
        MultiConnector, which computes it (``"scheduled"``) or first loads its full chunks into
        its blocks (``"remote"``, WAITING_FOR_REMOTE_KVS; our connector sees an allocation with
        0 external tokens). ``front``: the burst has a higher priority than the waiting queue
        (vLLM's ``--scheduling-policy priority``) and is looked up first. ``turn``: the first
        request of the burst is the next turn of a completed request (its prompt: that
        request's tokens and ``tail`` more), so it reads blocks stored long ago."""
        done = [r for r in self.reqs if r.status == "done" and not r.aborted and not r.foreign]
        done = [r for r in done if r.num_tokens <= 5 * T]  # keep prompts within the GPU
        parent = done[turn % len(done)] if turn is not None and done and not foreign else None
        burst = []
        for chunks, tail in sizes:
            if len(self.reqs) >= 16:
                break
            rid = f"r{len(self.reqs)}"
            if parent is not None:
                size, fam = parent.num_tokens + tail, parent.family
            else:
                size, fam = chunks * T + tail, rid if foreign else family
            req = Request(rid, fam, size, max_new, parent=parent, foreign=foreign)
            parent = None
            self.reqs.append(req)
            burst.append(req)
            if not foreign:
                self.sched.on_new_request(req)
        if front:
            self.waiting[:0] = burst
        else:
            self.waiting += burst

    @rule(
        arrive=st.none() | _BURST,
        late_copy=st.booleans(),
        late_ack=st.booleans(),
        drain=st.booleans(),
        fail=st.sampled_from([(), (), (), (0,), (1,)]),
        tier=st.sampled_from(["", "", "ok", "fail"]),
        preempt=st.sampled_from([None] * 6 + [0, 1]),
        abort=st.sampled_from([None] * 10 + [0, 1]),
    )
    def step(
        self,
        arrive: tuple[str, list[tuple[int, int]], int, str, bool, int | None] | None,
        late_copy: bool,
        late_ack: bool,
        drain: bool,
        fail: tuple[int, ...],
        tier: str,
        preempt: int | None,
        abort: int | None,
    ) -> None:
        """One engine step; the worker fails the store jobs it copies at positions ``fail``
        of this step's copy order. Before it: ``tier`` scripts the tier's next job (ok or
        fail); ``preempt`` picks a running request the scheduler preempts this step;
        ``abort`` picks a live request the client aborts. (Folded into the step so that most
        rules advance the engine.) ``arrive``: a burst of requests (``_arrive``) first."""
        if arrive is not None:
            self._arrive(*arrive)
        if tier:
            self.tier.modes.append(tier)
        if abort is not None:
            live = [r for r in self.reqs if r.status in ("waiting", "running")]
            if live:
                req = live[abort % len(live)]
                req.aborted = True
                self._finish(req)
        self.t += 1
        self.fail_stores = fail
        self.stores_copied = 0
        preempted: list[str] = []
        scheduled: list[ScheduledRequest] = []
        tokens: dict[str, int] = {}
        if preempt is not None and self.running:
            self._preempt(self.running[preempt % len(self.running)], preempted)
        for req in list(self.running):
            if req not in self.running:
                continue  # preempted for an earlier request
            n = req.num_tokens - req.num_computed_tokens
            new = self._grow(req, req.num_computed_tokens + n, preempted)
            if new is None:
                continue
            scheduled.append(ScheduledRequest(req.request_id, [new] if new else None))
            tokens[req.request_id] = n
        for req in list(self.waiting):
            if req.status == "loading":
                continue  # WAITING_FOR_REMOTE_KVS
            if not self._schedule_waiting(req, scheduled, tokens):
                break  # FCFS: no blocks for this one, none for the ones behind it
        step = StepInput(scheduled, tokens, self.finished_ids, preempted, [])
        self.finished_ids = []
        cursors_before = self._cursors()
        plan = self.sched.build_step(step)
        evicted = {
            kc.make_offload_key(h, e.group_idx)
            for e in self.sched.take_events()
            if e.removed and e.medium == "CPU"
            for h in e.block_hashes
        }
        self._check_cursors(cursors_before, evicted)
        self._work(plan, tokens, late_copy)
        if not late_ack:
            self._ack()
        for req in [r for r in self.running if r.request_id in tokens]:
            req.num_computed_tokens += tokens[req.request_id]
            if req.num_computed_tokens == req.num_tokens:  # sampled one token
                req.num_tokens += 1
                req.out += 1
                if req.out >= req.max_new:
                    self._finish(req)
        self.run(asyncio.sleep(0.001))
        if drain:
            futures = self.coord.job_futures()
            if futures:
                self.run(asyncio.wait(futures, timeout=5))
        self.run(self.tier._lookup.wait_probes())
        self._check_pending_writes()

    # -- the fake engine ---------------------------------------------------------------------
    def _grow(self, req: Request, num_tokens: int, preempted: list[str]) -> list[int] | None:
        """Blocks for ``num_tokens`` tokens of a running request, preempting the last running
        request while they are short; None if ``req`` itself was preempted."""
        need = math.ceil(num_tokens / T) - len(req.blocks)
        while len(self.free) < need:
            victim = self.running[-1]
            self._preempt(victim, preempted)
            if victim is req:
                return None
        new = [self.free.pop() for _ in range(max(need, 0))]
        req.blocks += new
        return new

    def _preempt(self, req: Request, preempted: list[str]) -> None:
        self.running.remove(req)
        self.free += req.blocks
        req.blocks = []
        req.num_computed_tokens = 0
        req.status = "waiting"
        req.resumed = True
        self.waiting.insert(0, req)
        preempted.append(req.request_id)

    def _schedule_waiting(
        self, req: Request, scheduled: list[ScheduledRequest], tokens: dict[str, int]
    ) -> bool:
        """Look a waiting request up and allocate it; False when blocks ran out."""
        rid = req.request_id
        hits = 0
        remote = (req.num_prompt_tokens // T) * T
        if req.foreign == "remote" and req.num_computed_tokens == 0 and remote:
            # The other connector loads the full chunks into fresh blocks this step.
            need = remote // T
            if len(self.free) < need:
                return False
            req.blocks = [self.free.pop() for _ in range(need)]
            self.sched.update_state_after_alloc(rid, [[(b, False) for b in req.blocks]], 0)
            req.status = "loading"
            self.remote_loads.append(req)
            return True
        if req.num_computed_tokens == 0 and not req.foreign:
            self._check_landed(req)
            run = self._landed_run(req)
            hits, _ = self.sched.get_num_new_matched_tokens(rid, 0)
            if hits is None:
                return True  # asked again next step
            if not req.load_failed:
                assert hits >= run * T, (
                    f"{rid}: {run} leading chunks were pinned for it or promoted for it, "
                    f"but its lookup matched {hits} tokens (a landed promotion was lost)"
                )
            self.landed.pop(rid, None)
        if hits:
            need = math.ceil(hits / T)
            if len(self.free) < need:
                return False
            req.blocks = [self.free.pop() for _ in range(need)]
            self.sched.update_state_after_alloc(rid, [[(b, False) for b in req.blocks]], hits)
            req.status = "loading"
            req.hits = hits
            return True
        need = math.ceil(req.num_tokens / T) - len(req.blocks)
        if len(self.free) < need:
            return False
        req.blocks += [self.free.pop() for _ in range(need)]
        computed = req.num_computed_tokens // T
        self.sched.update_state_after_alloc(
            rid, [[(b, j < computed) for j, b in enumerate(req.blocks)]], 0
        )
        scheduled.append(ScheduledRequest(rid, [list(req.blocks)], resumed=req.resumed))
        tokens[rid] = req.num_tokens - req.num_computed_tokens
        req.status = "running"
        self.waiting.remove(req)
        self.running.append(req)
        return True

    def _check_landed(self, req: Request) -> None:
        """A block promoted for a request stays in the primary tier until that request's next
        lookup reads it or the request finishes (vLLM #49902). Checked after every step and
        right before the request's lookup (an earlier request's lookup may have evicted it)."""
        if req.finished:
            return
        for key in self.landed.get(req.request_id, ()):
            assert self.primary.get_block(key) is not None, (
                f"the promotion of {key.hex()[:8]} landed for {req.request_id}, which has not "
                "read it yet, but the block was evicted"
            )

    def _landed_run(self, req: Request) -> int:
        """Leading chunks of ``req`` that its lookup must find: pinned by its earlier lookup
        or promoted for it since."""
        state = self.coord._req_state.get(req.request_id)  # the lookup pins it holds
        pinned = state.lookup_pins if state is not None else set()
        landed = self.landed.get(req.request_id, set())
        run = 0
        while run < req.num_tokens // T and (req.key(run) in pinned or req.key(run) in landed):
            run += 1
        return run

    def _finish(self, req: Request) -> None:
        req.finished = True
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self.sched.request_finished(req.request_id)
        req.freed = req.blocks
        self.free += req.blocks
        req.blocks = []
        req.status = "done"
        self.finished_ids.append(req.request_id)

    # -- the fake worker ---------------------------------------------------------------------
    def _job(self, job_id: int, spec: TransferSpec, store: bool) -> WorkerJob:
        req = next(r for r in self.reqs if r.request_id == spec.req_id)
        blocks = req.blocks or req.freed
        keys = [req.key(blocks.index(b)) for b in spec.gpu.block_ids.tolist()]
        return WorkerJob(job_id, spec, keys, store)

    def _copy(self, job: WorkerJob) -> None:
        if job.copied:
            return
        job.copied = True
        spec = job.spec
        if job.store:
            self.stores_copied += 1
            if self.stores_copied - 1 in self.fail_stores:
                job.failed = True
                return
        if spec.cpu is None:
            job.failed = True  # a load the scheduler could not prepare
            return
        assert self.host is not None
        for key, gpu, cpu in zip(job.keys, spec.gpu.block_ids.tolist(), spec.cpu.block_ids):
            row = self.host.row(int(cpu))
            if job.store:
                assert bytes(self.gpu[gpu]) == payload(key), (
                    f"store job {job.job_id} of {spec.req_id} copies GPU block {gpu} for "
                    f"{key.hex()[:8]}, but the block was re-allocated and rewritten "
                    "(the store was not flushed first)"
                )
                row[:] = self.gpu[gpu].tobytes()
            else:
                assert bytes(row) == payload(key), (
                    f"load job {job.job_id} of {spec.req_id}: primary slot {cpu} does not "
                    f"hold the bytes of {key.hex()[:8]}"
                )
                self.gpu[gpu] = np.frombuffer(bytes(row), dtype=np.uint8)

    def _work(self, plan: StepPlan, tokens: dict[str, int], late_copy: bool) -> None:
        flushed = plan.jobs_to_flush & set(plan.store_jobs)
        for job_id in sorted(flushed):
            self.queued.append(self._job(job_id, plan.store_jobs[job_id], True))
        running = self.queued
        self.queued = []
        for job in running:  # handle_preemptions: flushed jobs copy before anything else
            if job.job_id in plan.jobs_to_flush:
                self._copy(job)
        for req in self.remote_loads:  # the other connector's loads, before our copies end
            for j, b in enumerate(req.blocks):
                self.gpu[b] = np.frombuffer(payload(req.key(j)), np.uint8)
            req.num_computed_tokens = len(req.blocks) * T
            req.status = "waiting"
        self.remote_loads = []
        running += [self._job(j, spec, False) for j, spec in plan.load_jobs.items()]
        if not late_copy:
            for job in running:
                self._copy(job)
        for req in self.running:  # the forward pass writes the scheduled tokens' KV
            n = tokens.get(req.request_id, 0)
            if n:
                first = req.num_computed_tokens // T
                last = (req.num_computed_tokens + n - 1) // T
                for j in range(first, last + 1):
                    self.gpu[req.blocks[j]] = np.frombuffer(payload(req.key(j)), np.uint8)
        for job in running:  # copies still running on the copy threads finish now
            self._copy(job)
        self.queued = [
            self._job(j, spec, True) for j, spec in plan.store_jobs.items() if j not in flushed
        ]
        self.unacked += running

    def _ack(self) -> None:
        jobs, self.unacked = self.unacked, []
        if not jobs:
            return
        by_req = {r.request_id: r for r in self.reqs}
        for job in jobs:
            if job.store and job.failed:
                by_req[job.spec.req_id].own_failed.update(job.keys)
            elif job.store:
                for key in job.keys:
                    self.ready_at[key] = self.t
        done = self.sched.on_jobs_finished(
            {j.job_id: 1 for j in jobs}, {j.job_id for j in jobs if j.failed}
        )
        failed_loads = {j.spec.req_id for j in jobs if not j.store and j.failed}
        for rid in done:
            req = by_req[rid]
            if req.status != "loading":
                continue
            req.status = "waiting"
            if rid in failed_loads:
                req.load_failed = True  # vLLM recomputes the request
                req.num_computed_tokens = 0
            else:
                req.num_computed_tokens = req.hits

    # -- cursor checks -------------------------------------------------------------------------
    def _cursors(self) -> dict[str, int]:
        return {
            r.request_id: self.sched.store_cursor(r.request_id)
            for r in self.reqs
            if not r.foreign and self.sched.is_tracked(r.request_id)
        }

    def _present(self, key: bytes) -> bool:
        block = self.primary.get_block(key)
        return (block is not None and block.ref_cnt >= 0) or key in self.tier.blocks

    def _writing(self, key: bytes) -> bool:
        block = self.primary.get_block(key)
        return block is not None and block.ref_cnt == -1

    def _check_cursors(self, before: dict[str, int], evicted: set[bytes]) -> None:
        """Chunks a request's store cursor passed in this step: stored (or evicted since),
        being written (watched until the write ends), or its own write failed."""
        for req in self.reqs:
            rid = req.request_id
            if rid not in before or not self.sched.is_tracked(rid):
                continue
            cursor = self.sched.store_cursor(rid)
            for c in range(max(req.checked, before[rid]), cursor):
                key = req.key(c)
                if self._writing(key):
                    req.watch[c] = self.t
                else:
                    assert self._present(key) or key in evicted or key in req.own_failed, (
                        f"{rid}'s store cursor passed chunk {c}, which is neither stored nor "
                        "being written"
                    )
            req.checked = max(req.checked, cursor)

    def _check_pending_writes(self) -> None:
        """A chunk a cursor passed while another request's write of it was in flight: once
        that write ended, the chunk is stored, or the cursor went back to it."""
        for req in self.reqs:
            rid = req.request_id
            if not req.watch or not self.sched.is_tracked(rid):
                continue
            cursor = self.sched.store_cursor(rid)
            for c, since in list(req.watch.items()):
                key = req.key(c)
                if c >= cursor or self.ready_at.get(key, -1) >= since or self._present(key):
                    del req.watch[c]
                elif not self._writing(key):
                    assert key in req.own_failed, (
                        f"{rid}'s store cursor ({cursor}) passed chunk {c} while another "
                        "request wrote it; that write failed and the chunk is a hole"
                    )
                    del req.watch[c]

    # -- invariants ----------------------------------------------------------------------------
    @invariant()
    def nothing_logged_an_error(self) -> None:
        """An ERROR from kvcascade (e.g. the coordinator's "applying the result of job") is a
        broken invariant the code caught and logged instead of raising."""
        assert not self.errors.records, self.errors.records[0]

    @invariant()
    def landed_promotions_stay_until_read(self) -> None:
        if self.host is not None:
            for req in self.reqs:
                self._check_landed(req)

    @invariant()
    def rows_hold_their_keys(self) -> None:
        if self.host is None:
            return
        primary = self.primary
        tracked = list(primary.policy.keys())
        blocks = [primary.get_block(k) for k in tracked]
        assert all(b.ref_cnt >= -1 for b in blocks)
        assert primary.num_free + len(tracked) == primary.num_blocks, "slots not conserved"
        for key, block in zip(tracked, blocks):
            if block.ref_cnt >= 0:
                assert bytes(self.host.row(block.block_id)) == payload(key), (
                    f"ready primary slot {block.block_id} holds other bytes than {key.hex()[:8]}"
                )
        for key, data in list(self.tier.blocks.items()):
            assert data == payload(key), f"tier block {key.hex()[:8]} holds other bytes"

    def teardown(self) -> None:
        self.errors.close()
        if self.host is not None:
            self.tier.release.set()
            self.run(self.tier.drain())
            self.tier.close()
            self.run(asyncio.gather(*self.actors))
        self.loop.close()
        if self.host is not None:
            self.host.close()


_EXAMPLES = int(os.environ.get("KVCASCADE_MODEL_EXAMPLES", "0"))
SchedulerModel.TestCase.settings = settings(
    max_examples=_EXAMPLES or 60,
    stateful_step_count=60,
    derandomize=not _EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSchedulerModel = SchedulerModel.TestCase
