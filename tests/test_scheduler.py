"""Scheduler-side offload rules (kvcascade.scheduler) driven by a plain fake scheduler.

Each test names the vLLM test it mirrors, from
``tests/v1/kv_connector/unit/offloading_connector/test_scheduler.py``, in its docstring. No vLLM
needed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

import kvcascade as kc
from kvcascade import LookupResult as R
from kvcascade.scheduler import (
    GroupSpec,
    OffloadScheduler,
    ScheduledRequest,
    SchedulerConfig,
    StepInput,
    is_store_reachable,
    parse_max_offload_tokens,
)

H, M, P, T = R.HIT, R.MISS, R.HIT_PENDING, R.RETRY


def h(i: int) -> bytes:
    return i.to_bytes(8, "big")


def key(i: int, group: int = 0) -> bytes:
    return kc.make_offload_key(h(i), group)


@dataclass
class FakeRequest:
    """A request as RequestView: token counts and one hash per ``tokens_per_hash`` tokens."""

    request_id: str
    num_prompt_tokens: int
    num_tokens: int = 0
    num_computed_tokens: int = 0
    tokens_per_hash: int = 4
    hash_base: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    skip_reading_prefix_cache: bool = False
    finished: bool = False
    aborted: bool = False

    def __post_init__(self) -> None:
        self.num_tokens = self.num_tokens or self.num_prompt_tokens

    @property
    def block_hashes(self) -> list[bytes]:
        return [h(self.hash_base + i) for i in range(self.num_tokens // self.tokens_per_hash)]


@dataclass
class FakeManager:
    """Records hook calls; lookups answer from ``answers`` (default MISS)."""

    answers: dict[bytes, R] = field(default_factory=dict)
    calls: list[tuple[str, Any]] = field(default_factory=list)
    store_fails: bool = False
    load_fails: bool = False
    present: set[bytes] = field(default_factory=set)
    policy: kc.OffloadPolicy = kc.OffloadPolicy.BLOCK_LEVEL
    next_slot: int = 0

    def lookup(self, k: bytes, ctx: kc.ReqContext) -> R:
        self.calls.append(("lookup", k))
        return self.answers.get(k, M)

    def prepare_load(self, keys: Collection[bytes], ctx: kc.ReqContext) -> kc.CPULoadStoreSpec:
        self.calls.append(("prepare_load", list(keys)))
        if self.load_fails:
            raise kc.BlockUnavailableError(list(keys))
        return kc.CPULoadStoreSpec(list(range(100, 100 + len(keys))))

    def touch(self, keys: Collection[bytes], ctx: kc.ReqContext | None = None) -> None:
        self.calls.append(("touch", list(keys)))

    def complete_load(self, keys: Collection[bytes], ctx: kc.ReqContext) -> None:
        self.calls.append(("complete_load", list(keys)))

    def prepare_store(self, keys: Collection[bytes], ctx: kc.ReqContext):
        self.calls.append(("prepare_store", list(keys)))
        if self.store_fails:
            return None
        new = [k for k in keys if k not in self.present]
        self.present.update(new)
        slots = list(range(self.next_slot, self.next_slot + len(new)))
        self.next_slot += len(new)
        return kc.PrepareStoreOutput(new, kc.CPULoadStoreSpec(slots), [])

    def complete_store(self, keys: Collection[bytes], ctx: kc.ReqContext, success: bool = True):
        self.calls.append(("complete_store", (list(keys), success)))

    def on_new_request(self, ctx: kc.ReqContext) -> kc.RequestOffloadingContext:
        self.calls.append(("on_new_request", ctx.req_id))
        return kc.RequestOffloadingContext(self.policy)

    def on_request_finished(self, ctx: kc.ReqContext) -> None:
        self.calls.append(("on_request_finished", ctx.req_id))

    def on_schedule_end(self, ctx: kc.ScheduleEndContext) -> None:
        self.calls.append(("on_schedule_end", ctx))

    def has_pending_work(self) -> bool:
        return False

    def take_events(self) -> list[kc.OffloadingEvent]:
        return []

    def reset_cache(self) -> None:
        self.calls.append(("reset_cache", None))

    def named(self, name: str) -> list[Any]:
        return [arg for n, arg in self.calls if n == name]


def make(
    k: int = 1,
    groups: Sequence[GroupSpec] = (GroupSpec(4),),
    workers: int = 1,
    prompt_only: bool = True,
    **manager: Any,
) -> tuple[OffloadScheduler, FakeManager]:
    m = FakeManager(**manager)
    cfg = SchedulerConfig(tuple(groups), 4, k, workers, prompt_only)
    return OffloadScheduler(cfg, m), m


class Engine:
    """A plain fake engine scheduler: blocks are allocated from a counter, one step at a time."""

    def __init__(self, sched: OffloadScheduler, block_tokens: int = 4, groups: int = 1) -> None:
        self.sched = sched
        self.block_tokens = block_tokens
        self.groups = groups
        self.next_block = 1
        self.blocks: dict[str, list[int]] = {}

    def alloc(self, n: int) -> list[int]:
        ids = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return ids

    def step(
        self,
        scheduled: dict[str, int],
        *,
        new_blocks: dict[str, list[int]] | None = None,
        finished: Sequence[str] = (),
        preempted: Sequence[str] = (),
        reqs: dict[str, FakeRequest] | None = None,
    ) -> kc.scheduler.StepPlan:
        sched_reqs = []
        for rid in scheduled:
            ids = (new_blocks or {}).get(rid, [])
            self.blocks.setdefault(rid, []).extend(ids)
            sched_reqs.append(ScheduledRequest(rid, [ids] * self.groups if ids else None))
        plan = self.sched.build_step(
            StepInput(sched_reqs, dict(scheduled), list(finished), list(preempted))
        )
        for rid, n in scheduled.items():  # the forward pass computes the scheduled tokens
            if reqs and rid in reqs:
                reqs[rid].num_computed_tokens += n
        return plan


def admit(
    sched: OffloadScheduler, req: FakeRequest, num_computed: int = 0
) -> tuple[int | None, bool]:
    sched.on_new_request(req)
    return sched.get_num_new_matched_tokens(req.request_id, num_computed)


def ack(sched: OffloadScheduler, plan: kc.scheduler.StepPlan, workers: int = 1) -> list[str]:
    jobs = {j: workers for j in [*plan.load_jobs, *plan.store_jobs]}
    return sched.on_jobs_finished(jobs)


# -- lookup: maximal prefix (vLLM TestMaximalPrefixLookup) -----------------------------------
@pytest.mark.parametrize(
    ("answers", "expected", "calls"),
    [
        ([H, H], 2, 2),  # all hit
        ([M, M], 0, 1),  # all miss
        ([H, H, M, H], 2, 3),  # partial prefix
        ([M, H], 0, 1),  # miss first
        ([H], 1, 1),  # single hit
        ([], 0, 0),  # empty
        ([T], None, 1),  # RETRY alone
        ([P], None, 1),  # HIT_PENDING alone
        ([T, H], None, 2),  # RETRY defers, the scan continues
        ([H, T], None, 2),  # RETRY after hit
        ([H, P, H, M, H], None, 4),  # HIT_PENDING defers, does not stop the scan
        ([T, M, H], None, 2),  # RETRY then miss
    ],
)
def test_maximal_prefix(answers: list[R], expected: int | None, calls: int) -> None:
    """vLLM TestMaximalPrefixLookup: maximal-prefix lookup over one full-attention group."""
    sched, m = make()
    m.answers = {key(i): a for i, a in enumerate(answers)}
    keys = [key(i) for i in range(len(answers))]
    assert sched._maximal_prefix(keys, kc.ReqContext("r")) == expected
    assert len(m.named("lookup")) == calls


# -- lookup: suffix window (vLLM TestSlidingWindowLookup) -----------------------------------
@pytest.mark.parametrize(
    ("answers", "window", "expected"),
    [
        ([H, H], 2, 2),  # exact window
        ([M, M, M], 2, 0),  # all miss
        ([M, H, H], 2, 3),  # window at end
        ([M, H, H, M], 2, 3),  # window in middle
        ([H, H, M], 3, 2),  # prefix fallback
        ([M, H, M], 1, 2),  # window 1
        ([H, M, H, M], 2, 1),  # gap resets the run
        ([H, H, M, H, H], 2, 5),  # rightmost window wins
        ([H, M, H, H, H], 4, 1),  # prefix fallback with gap
        ([], 2, 0),  # empty
        ([H, H, T, H], 2, None),  # RETRY defers
        ([H, H, T], 2, None),  # RETRY defers even with a full window elsewhere
        ([H, P, H], 3, None),  # HIT_PENDING counts but defers
    ],
)
def test_suffix_window(answers: list[R], window: int, expected: int | None) -> None:
    """vLLM TestSlidingWindowLookup (``_lookup_complete_chunks``): suffix-window lookup."""
    sched, m = make()
    m.answers = {key(i): a for i, a in enumerate(answers)}
    keys = [key(i) for i in range(len(answers))]
    assert sched._suffix_window(keys, window, kc.ReqContext("r")) == expected


# -- store reachability (vLLM test_is_store_reachable_swa_chunk) -----------------------------
@pytest.mark.parametrize(
    ("chunk", "storable", "window", "alignment", "expected"),
    [
        (61, 64, 2, 64, False),
        (62, 64, 2, 64, True),
        (63, 64, 2, 64, True),
        (61, 64, 3, 64, True),  # eagle's extra chunk keeps 61
        (46, 48, 2, 64, True),  # a partial segment [0, 48): keep 46, 47
        (47, 48, 2, 64, True),
        (45, 48, 2, 64, False),
        (0, 64, 2, None, True),  # no alignment → keep
        (0, 2, 2, 64, True),  # storable 2 → keep
        (1, 2, 2, 64, True),
        (64 + 61, 128, 2, 64, False),
        (64 + 62, 128, 2, 64, True),
    ],
)
def test_is_store_reachable(
    chunk: int, storable: int, window: int, alignment: int | None, expected: bool
) -> None:
    """vLLM test_is_store_reachable_swa_chunk: the segment-tail rule for windowed chunks
    (``_build_store_jobs``)."""
    assert is_store_reachable(chunk, storable, window, alignment) is expected


# -- stores ---------------------------------------------------------------------------------
def test_store_chunks_once_and_partial_chunk_waits() -> None:
    """vLLM test_offloading_connector: k=3, incremental cursor stores each complete chunk once; a
    partial chunk is not stored; an empty keys_to_store advances the cursor."""
    sched, m = make(k=3, prompt_only=False)
    eng = Engine(sched)
    req = FakeRequest("a", num_prompt_tokens=30)  # 7 full blocks of 4 → 2 chunks of 12
    assert admit(sched, req) == (0, False)
    plan = eng.step({"a": 30}, new_blocks={"a": eng.alloc(8)}, reqs={"a": req})
    [(_job_id, spec)] = plan.store_jobs.items()
    assert m.named("prepare_store") == [[key(2), key(5)]]
    assert spec.gpu.block_ids.tolist() == [1, 2, 3, 4, 5, 6]
    assert spec.gpu.group_sizes == (6,) and spec.gpu.block_indices == (0,)
    assert sched.store_cursor("a") == 2
    # decode 6 more tokens: 36 tokens → chunk 2 complete
    req.num_tokens = 36
    plan = eng.step({"a": 6}, new_blocks={"a": eng.alloc(1)}, reqs={"a": req})
    assert m.named("prepare_store")[-1] == [key(8)]
    [spec] = plan.store_jobs.values()
    assert spec.gpu.block_ids.tolist() == [7, 8, 9] and spec.gpu.block_indices == (6,)
    ack(sched, plan)
    # already present → empty keys_to_store → cursor advances, no job
    m.present.add(key(11))
    req.num_tokens = 48
    plan = eng.step({"a": 12}, new_blocks={"a": eng.alloc(3)}, reqs={"a": req})
    assert not plan.store_jobs and sched.store_cursor("a") == 4


def test_offload_prompt_only() -> None:
    """vLLM test_offload_prompt_only: with offload_prompt_only (the default) only prompt chunks are
    offered."""
    sched, m = make()
    eng = Engine(sched)
    req = FakeRequest("a", num_prompt_tokens=24)
    admit(sched, req)
    eng.step({"a": 24}, new_blocks={"a": eng.alloc(6)}, reqs={"a": req})
    for _ in range(8):  # decode 8 tokens → two more full blocks, never offered
        req.num_tokens += 1
        eng.step({"a": 1}, new_blocks={"a": eng.alloc(1)} if req.num_tokens % 4 == 1 else {})
        req.num_computed_tokens += 1
    offered = [k for ks in m.named("prepare_store") for k in ks]
    assert offered == [key(i) for i in range(6)]


def test_failed_prepare_store_retries_and_leaves_others_alone() -> None:
    """vLLM test_scheduler_reports_allocation_failure / test_offloading_connector: prepare_store
    None → counted, cursor unmoved, retried next step; another request in the same step is
    unaffected."""
    sched, m = make()
    eng = Engine(sched)
    a = FakeRequest("a", num_prompt_tokens=8)
    b = FakeRequest("b", num_prompt_tokens=8, hash_base=1000)
    admit(sched, a)
    admit(sched, b)
    orig = m.prepare_store

    def fail_for_a(keys: Collection[bytes], ctx: kc.ReqContext):
        return None if ctx.req_id == "a" else orig(keys, ctx)

    m.prepare_store = fail_for_a  # type: ignore[method-assign]
    plan = eng.step(
        {"a": 8, "b": 8}, new_blocks={"a": eng.alloc(2), "b": eng.alloc(2)}, reqs={"a": a, "b": b}
    )
    assert sched.stats.allocation_failures == 1
    assert sched.store_cursor("a") == 0 and sched.store_cursor("b") == 2
    assert [s.req_id for s in plan.store_jobs.values()] == ["b"]
    m.prepare_store = orig  # type: ignore[method-assign]
    a.num_tokens += 1
    plan = eng.step({"a": 1}, reqs={"a": a})
    [spec] = plan.store_jobs.values()
    assert spec.req_id == "a" and spec.gpu.block_ids.tolist() == [1, 2]


def test_last_block_stored_at_finish_not_partial() -> None:
    """vLLM test_last_block_offloaded_at_request_finish /
    test_on_request_finished_fires_after_final_block_store: a block completed by the final decode is
    stored from finished_req_ids in the next step (only computed tokens); a still-partial block is
    not; on_request_finished fires once, after that final prepare_store; state is cleaned up."""
    sched, m = make(prompt_only=False)
    eng = Engine(sched)
    req = FakeRequest("a", num_prompt_tokens=6)
    admit(sched, req)
    ack(sched, eng.step({"a": 6}, new_blocks={"a": eng.alloc(2)}, reqs={"a": req}))
    req.num_tokens = 10  # decoded 4; the last sampled token (10th) has no KV
    req.num_computed_tokens = 9
    req.finished = True
    sched.request_finished("a")
    plan = eng.step({}, finished=["a"])
    assert m.named("prepare_store")[-1] == [key(1)]  # tokens 4..8 computed; 8..10 partial
    names = [n for n, _ in m.calls]
    assert names.index("on_request_finished") > len(names) - 1 - names[::-1].index("prepare_store")
    assert m.named("on_request_finished") == ["a"]
    ack(sched, plan)
    assert sched.num_tracked_requests() == 0


def test_abort_queued_request_builds_no_store_job() -> None:
    """vLLM test_abort_queued_request_does_not_build_store_job: an aborted request that was never
    scheduled stores nothing and is dropped."""
    sched, _m = make()
    eng = Engine(sched)
    req = FakeRequest("a", num_prompt_tokens=16, aborted=True, finished=True)
    admit(sched, req)
    sched.request_finished("a")
    plan = eng.step({}, finished=["a"])
    assert not plan.store_jobs and sched.num_tracked_requests() == 0


def test_on_request_finished_not_deferred_by_stores_in_flight() -> None:
    """vLLM test_on_request_finished_not_deferred_until_store_completion: the manager hook fires in
    the step after finish even with stores in flight; the state lives until the store is
    acknowledged."""
    sched, m = make()
    eng = Engine(sched)
    req = FakeRequest("a", num_prompt_tokens=8)
    admit(sched, req)
    plan = eng.step({"a": 8}, new_blocks={"a": eng.alloc(2)}, reqs={"a": req})
    req.finished = True
    sched.request_finished("a")
    eng.step({}, finished=["a"])
    assert m.named("on_request_finished") == ["a"]
    assert sched.num_tracked_requests() == 1
    ack(sched, plan)
    assert sched.num_tracked_requests() == 0


def test_complete_store_per_job_after_all_worker_acks() -> None:
    """vLLM test_complete_store_called_per_job / test_complete_store_waits_for_all_worker_acks: one
    complete_store per job with only its keys, after every worker's ack."""
    sched, m = make(workers=3)
    eng = Engine(sched)
    req = FakeRequest("a", num_prompt_tokens=12)
    admit(sched, req)
    p1 = eng.step({"a": 4}, new_blocks={"a": eng.alloc(1)}, reqs={"a": req})
    p2 = eng.step({"a": 8}, new_blocks={"a": eng.alloc(2)}, reqs={"a": req})
    (j1,), (j2,) = p1.store_jobs, p2.store_jobs
    sched.on_jobs_finished({j1: 1, j2: 1})
    sched.on_jobs_finished({j1: 1})
    assert m.named("complete_store") == []
    sched.on_jobs_finished({j1: 1, j2: 2})
    assert m.named("complete_store") == [([key(0)], True), ([key(1), key(2)], True)]


def test_failed_store_completes_with_failure() -> None:
    """A store a worker failed is completed with success=False (vLLM's ``offloading/worker.py``
    asserts instead)."""
    sched, m = make()
    eng = Engine(sched)
    req = FakeRequest("a", num_prompt_tokens=4)
    admit(sched, req)
    plan = eng.step({"a": 4}, new_blocks={"a": eng.alloc(1)}, reqs={"a": req})
    sched.on_jobs_finished(dict.fromkeys(plan.store_jobs, 1), failed=set(plan.store_jobs))
    assert m.named("complete_store") == [([key(0)], False)]
    assert sched.stats.failed_stores == 1


@pytest.mark.parametrize("value", [None, "5", 5.0, -1, True])
def test_max_offload_tokens_validation(value: Any) -> None:
    """vLLM test_max_offload_tokens_validation: invalid caps mean no cap; 0 stores nothing (lookups
    still happen)."""
    assert parse_max_offload_tokens({"max_offload_tokens": value}) is None
    sched, _m = make()
    eng = Engine(sched)
    req = FakeRequest("a", 8, kv_transfer_params={"max_offload_tokens": value})
    admit(sched, req)
    plan = eng.step({"a": 8}, new_blocks={"a": eng.alloc(2)}, reqs={"a": req})
    assert len(plan.store_jobs) == 1


def test_max_offload_tokens_zero_and_cap() -> None:
    """vLLM test_max_offload_tokens_zero_does_not_record_pending_lookups /
    test_max_offload_tokens_validation: cap 0 → lookups happen but nothing is stored; cap 4 → one
    chunk."""
    sched, m = make()
    eng = Engine(sched)
    zero = FakeRequest("z", 8, kv_transfer_params={"max_offload_tokens": 0})
    cap = FakeRequest("c", 8, hash_base=50, kv_transfer_params={"max_offload_tokens": 4})
    admit(sched, zero)
    admit(sched, cap)
    assert len(m.named("lookup")) == 2
    plan = eng.step({"z": 8, "c": 8}, new_blocks={"z": eng.alloc(2), "c": eng.alloc(2)}, reqs={})
    assert m.named("prepare_store") == [[key(50)]]
    assert [s.req_id for s in plan.store_jobs.values()] == ["c"]


def test_request_level_policy_restores_prefix_hits() -> None:
    """vLLM test_request_level_policy_stores_all_blocks: REQUEST_LEVEL offers the loaded prefix too;
    BLOCK_LEVEL does not."""
    for policy, offered in (
        (kc.OffloadPolicy.REQUEST_LEVEL, [key(0), key(1), key(2)]),
        (kc.OffloadPolicy.BLOCK_LEVEL, [key(2)]),
    ):
        sched, m = make(policy=policy, answers={key(0): H, key(1): H})
        eng = Engine(sched)
        req = FakeRequest("a", 13)
        assert admit(sched, req) == (8, True)
        ids = eng.alloc(4)
        sched.update_state_after_alloc("a", [[(b, False) for b in ids]], 8)
        req.num_computed_tokens = 8
        plan = eng.step({"a": 5}, new_blocks={"a": ids}, reqs={"a": req})
        assert m.named("prepare_store") == [offered]
        ack(sched, plan)
        assert sched.fenced_block_ids() == set()


# -- loads ----------------------------------------------------------------------------------
def test_load_job_skips_gpu_cached_blocks() -> None:
    """vLLM test_offloading_connector (``update_state_after_alloc``): a load of a middle chunk:
    GPU-cached blocks are not loaded, the GPU spec carries the block index of the first loaded
    block; touch covers all keys."""
    sched, m = make(k=2, answers={key(3): H, key(5): H})
    req = FakeRequest("a", 26)  # 6 blocks, 3 chunks: keys 1, 3, 5
    hits = admit(sched, req, num_computed=8)  # the GPU holds blocks 0, 1 (chunk 0)
    assert hits == (16, True)
    assert m.named("touch") == [[key(1), key(3), key(5)]]
    blocks = [(11, True), (12, True), (13, False), (14, False), (15, False), (16, False)]
    sched.update_state_after_alloc("a", [blocks], 16)
    plan = sched.build_step(StepInput())
    [spec] = plan.load_jobs.values()
    assert m.named("prepare_load") == [[key(3), key(5)]]
    assert spec.gpu.block_ids.tolist() == [13, 14, 15, 16]
    assert spec.gpu.block_indices == (2,) and spec.cpu is not None
    assert sched.store_cursor("a") == 3  # block level: loaded chunks are not stored again
    assert sched.on_jobs_finished({next(iter(plan.load_jobs)): 1}) == ["a"]
    assert m.named("complete_load") == [[key(3), key(5)]]


def test_no_lookup_when_less_than_a_chunk_remains() -> None:
    """vLLM test_offloading_connector: fewer than a chunk beyond the computed tokens → no lookup,
    0."""
    sched, m = make(k=2, answers={key(1): H})
    req = FakeRequest("a", 10)
    assert admit(sched, req, num_computed=8) == (0, False)
    assert m.named("lookup") == []


def test_prepare_load_failure_becomes_failed_job() -> None:
    """A prepare_load that raises never escapes: the load job has no source and is failed, so
    the engine recomputes; nothing is unpinned."""
    sched, m = make(answers={key(0): H}, load_fails=True)
    req = FakeRequest("a", 6)
    assert admit(sched, req) == (4, True)
    sched.update_state_after_alloc("a", [[(1, False), (2, False)]], 4)
    plan = sched.build_step(StepInput())
    [(job_id, spec)] = plan.load_jobs.items()
    assert spec.cpu is None and sched.stats.load_prepare_failures == 1
    sched.on_jobs_finished({job_id: 1}, failed={job_id})
    assert m.named("complete_load") == [] and sched.stats.failed_loads == 1
    # the engine recomputes: the request is not offered the same (failing) hit again
    assert sched.get_num_new_matched_tokens("a", 0) == (0, False)


def test_concurrent_lookups_of_the_same_prefix_wait() -> None:
    """vLLM test_concurrent_lookups_of_the_same_prefix: a second request for chunks being loaded is
    deferred, no second load."""
    sched, _m = make(answers={key(0): H, key(1): H})
    a, b = FakeRequest("a", 9), FakeRequest("b", 9)
    assert admit(sched, a) == (8, True)
    sched.update_state_after_alloc("a", [[(1, False), (2, False), (3, False)]], 8)
    assert admit(sched, b) == (None, False)
    plan = sched.build_step(StepInput())
    ack(sched, plan)
    assert sched.get_num_new_matched_tokens("b", 0) == (8, True)
    # as vLLM's test_scheduler_reports_lookup_async_delay_on_resolve
    assert len(sched.stats.lookup_async_delays) == 1


def test_abort_while_loading_keeps_state_until_load_completes() -> None:
    """vLLM test_abort_loading_requests: an aborted request with a load in flight stays until the
    load completes."""
    sched, _m = make(answers={key(0): H})
    req = FakeRequest("a", 5)
    admit(sched, req)
    sched.update_state_after_alloc("a", [[(1, False), (2, False)]], 4)
    plan = sched.build_step(StepInput())
    req.finished = req.aborted = True
    sched.request_finished("a")
    sched.build_step(StepInput(finished_req_ids=["a"]))
    assert sched.num_tracked_requests() == 1
    ack(sched, plan)
    assert sched.num_tracked_requests() == 0


def test_skip_reading_prefix_cache_still_stores() -> None:
    """vLLM test_skip_reading_prefix_cache: no lookup or load, but the blocks are stored."""
    sched, m = make(answers={key(0): H})
    eng = Engine(sched)
    req = FakeRequest("a", 8, skip_reading_prefix_cache=True)
    assert admit(sched, req) == (0, False)
    assert m.named("lookup") == []
    plan = eng.step({"a": 8}, new_blocks={"a": eng.alloc(2)}, reqs={"a": req})
    assert len(plan.store_jobs) == 1


# -- preemption and fences --------------------------------------------------------------------
def test_preemption_flushes_stores_and_defers_readmission() -> None:
    """vLLM test_request_preemption / test_pending_transfer_defers_prefix_lookup /
    test_async_preempt_readmit_before_transfer_output_is_deferred: a preempted request's stores are
    flushed; re-admitted before their ack it is deferred (block ids cleared); afterwards it reloads
    its chunks from the cache."""
    sched, _m = make()
    eng = Engine(sched)
    req = FakeRequest("a", 8)
    admit(sched, req)
    p1 = eng.step({"a": 8}, new_blocks={"a": eng.alloc(2)}, reqs={"a": req})
    p2 = eng.step({}, preempted=["a"])
    assert p2.jobs_to_flush == set(p1.store_jobs)
    assert sched.get_num_new_matched_tokens("a", 0) == (None, False)
    ack(sched, p1)
    assert sched.request_jobs("a") == set()


def test_preempted_request_reloads() -> None:
    """vLLM test_request_preemption: the resumed request loads its stored chunks (all but the last
    token's chunk: a full-prompt hit keeps one token to compute, as vLLM needs)."""
    sched, m = make()
    eng = Engine(sched)
    req = FakeRequest("a", 9)
    admit(sched, req)
    ack(sched, eng.step({"a": 9}, new_blocks={"a": eng.alloc(3)}, reqs={"a": req}))
    eng.step({}, preempted=["a"])
    m.answers = {key(0): H, key(1): H}
    assert sched.get_num_new_matched_tokens("a", 0) == (8, True)
    ids = eng.alloc(3)
    sched.update_state_after_alloc("a", [[(b, False) for b in ids]], 8)
    plan = sched.build_step(StepInput([ScheduledRequest("a", [ids], resumed=True)], {"a": 1}))
    [spec] = plan.load_jobs.values()
    assert spec.gpu.block_ids.tolist() == ids[:2]


def test_a_request_preempted_and_scheduled_again_in_one_step_stores_its_own_blocks() -> None:
    """Found by a break-it run (the scheduler model's ``rows_hold_their_keys`` on a random run):
    a request preempted and scheduled again, with new blocks, in the same step lost those
    blocks (the preemption cleared them after they were applied), and the next step's store
    copied block 10 as its first chunk, another token's KV under chunk 0's key."""
    coord = kc.TieringCoordinator(kc.CPUOffloadingManager(8), [])
    sched = OffloadScheduler(SchedulerConfig((GroupSpec(4),), 4), coord)
    req = FakeRequest("a", 12)
    admit(sched, req)
    ack(sched, sched.build_step(StepInput([ScheduledRequest("a", [[1, 2, 3]])], {"a": 2})))
    req.num_computed_tokens = 0  # preempted, and admitted again in the same step
    assert sched.get_num_new_matched_tokens("a", 0) == (0, False)
    sched.update_state_after_alloc("a", [[(7, False), (8, False), (9, False)]], 0)
    again = ScheduledRequest("a", [[7, 8, 9]], resumed=True)
    plan = sched.build_step(StepInput([again], {"a": 12}, preempted_req_ids=["a"]))
    stored = [b for spec in plan.store_jobs.values() for b in spec.gpu.block_ids.tolist()]
    ack(sched, plan)
    req.num_computed_tokens, req.num_tokens = 12, 13
    plan = sched.build_step(StepInput([ScheduledRequest("a", [[10]])], {"a": 1}))
    stored += [b for spec in plan.store_jobs.values() for b in spec.gpu.block_ids.tolist()]
    assert stored == [7, 8, 9]  # chunks 0-2 from the blocks that hold them


def test_fence_on_reuse_of_finished_requests_blocks() -> None:
    """vLLM test_loads_do_not_populate_fence_index / test_fence_at_update_state_after_alloc /
    test_fence_at_build_store_jobs / test_request_finished_with_pending_stores_populates_fence /
    test_multiple_in_flight_stores_all_flushed_by_fence: loads never enter the fence; a finished
    request's in-flight stores fence their source blocks; reusing such a block (new prefill or load)
    flushes every job reading it; acks empty the fence."""
    sched, m = make()
    eng = Engine(sched)
    a = FakeRequest("a", 8)
    admit(sched, a)
    p1 = eng.step({"a": 4}, new_blocks={"a": [1]}, reqs={"a": a})
    p2 = eng.step({"a": 4}, new_blocks={"a": [2]}, reqs={"a": a})
    assert sched.fenced_block_ids() == set()  # full attention: fenced only at finish
    a.finished = True
    sched.request_finished("a")
    assert sched.fenced_block_ids() == {1, 2}
    eng.step({}, finished=["a"])
    b = FakeRequest("b", 8, hash_base=100)
    admit(sched, b)
    p3 = eng.step({"b": 8}, new_blocks={"b": [2, 1]}, reqs={"b": b})
    assert p3.jobs_to_flush == set(p1.store_jobs) | set(p2.store_jobs)
    ack(sched, p1)
    ack(sched, p2)
    assert sched.fenced_block_ids() == set()
    # a load into a block still fenced is flushed too (vLLM test_fence_at_update_state_after_alloc)
    c = FakeRequest("c", 8, hash_base=200)
    admit(sched, c)
    p4 = eng.step({"c": 8}, new_blocks={"c": [5, 6]}, reqs={"c": c})
    c.finished = True
    sched.request_finished("c")
    eng.step({}, finished=["c"])
    m.answers = {key(100): H}
    d = FakeRequest("d", 5, hash_base=100)
    assert admit(sched, d) == (4, True)
    sched.update_state_after_alloc("d", [[(5, False), (7, False)]], 4)
    p5 = sched.build_step(StepInput())
    assert p5.jobs_to_flush == set(p4.store_jobs)
    assert set(p5.load_jobs).isdisjoint(sched._fence.get(5, set()))


def test_sliding_window_and_full_groups() -> None:
    """vLLM test_two_groups_full_and_sliding_window /
    test_request_finished_mixed_full_attn_and_sliding_window: a full-attention group and a window
    group (W=2): windowed blocks are fenced at store creation, full-attention blocks at finish;
    lookup needs the prefix in the full group and the last W chunks in the windowed one; touch skips
    chunks outside the window."""
    groups = (GroupSpec(4), GroupSpec(4, window_chunks=2))
    sched, m = make(groups=groups)
    eng = Engine(sched, groups=2)
    req = FakeRequest("a", 17)
    admit(sched, req)
    plan = eng.step({"a": 17}, new_blocks={"a": eng.alloc(5)}, reqs={"a": req})
    [spec] = plan.store_jobs.values()
    assert spec.gpu.group_sizes == (4, 4)
    assert sched.fenced_block_ids() == {1, 2, 3, 4}  # windowed group's blocks only
    req.finished = True
    sched.request_finished("a")
    ack(sched, plan)
    sched.build_step(StepInput(finished_req_ids=["a"]))
    # lookup: full group has chunks 0..3, window group only 2, 3 → hit 16 of 17 tokens
    m.answers = {key(i, 0): H for i in range(4)} | {key(2, 1): H, key(3, 1): H}
    b = FakeRequest("b", 17)
    assert admit(sched, b) == (16, True)
    touched = m.named("touch")[-1]
    assert touched == [key(i, 0) for i in range(4)] + [key(2, 1), key(3, 1)]
    # a missing window chunk near the end shrinks the hit to the earlier window
    m.answers[key(3, 1)] = M
    m.answers[key(1, 1)] = H
    c = FakeRequest("c", 17)
    assert admit(sched, c) == (12, True)


def test_stale_window_block_after_failed_store_is_skipped() -> None:
    """vLLM test_stale_sliding_window_block_after_prepare_store_failure: after a failed
    prepare_store, a windowed block id re-allocated elsewhere is zeroed and skipped (never stored
    with someone else's data)."""
    groups = (GroupSpec(4), GroupSpec(4, window_chunks=1))
    sched, m = make(groups=groups, store_fails=True)
    eng = Engine(sched, groups=2)
    a = FakeRequest("a", 8)
    admit(sched, a)
    eng.step({"a": 8}, new_blocks={"a": [1, 2]}, reqs={"a": a})
    m.store_fails = False
    b = FakeRequest("b", 4, hash_base=50)
    admit(sched, b)
    plan = eng.step({"b": 4, "a": 0}, new_blocks={"b": [1]}, reqs={})
    by_req = {s.req_id: s for s in plan.store_jobs.values()}
    assert by_req["a"].gpu.group_sizes == (2, 1)  # windowed block 1 was zeroed
    assert by_req["a"].gpu.block_ids.tolist() == [1, 2, 2]


def test_two_groups_different_block_sizes() -> None:
    """vLLM test_two_groups_different_block_sizes: groups of 4- and 8-token blocks keep their own
    chunks and cursors."""
    sched, m = make(groups=(GroupSpec(4), GroupSpec(8)))
    req = FakeRequest("a", 16)
    admit(sched, req)
    sched.build_step(StepInput([ScheduledRequest("a", [[1, 2, 3, 4], [5, 6]])], {"a": 16}))
    assert m.named("prepare_store") == [[key(i, 0) for i in range(4)] + [key(1, 1), key(3, 1)]]


# -- reset ----------------------------------------------------------------------------------
def test_reset_cache() -> None:
    """vLLM test_reset_cache / test_reset_cache_finalizes_finished_request_with_pending_store:
    in-flight jobs flushed, manager reset, cursors to 0, stale acks ignored; a finished request with
    a pending store gets on_request_finished exactly once."""
    sched, m = make(answers={key(10): H})
    eng = Engine(sched)
    a = FakeRequest("a", 8)
    admit(sched, a)
    p1 = eng.step({"a": 8}, new_blocks={"a": eng.alloc(2)}, reqs={"a": a})
    a.finished = True
    sched.request_finished("a")
    b = FakeRequest("b", 8, hash_base=10)
    admit(sched, b)
    sched.update_state_after_alloc("b", [[(7, False), (8, False)]], 4)
    loads = sched.build_step(StepInput())
    b.num_computed_tokens = 4
    sched.reset_cache()
    assert m.named("reset_cache") == [None]
    assert m.named("on_request_finished") == ["a"]
    assert sched.stale_job_threshold == 2 and sched.store_cursor("b") == 0
    plan = sched.build_step(StepInput())
    assert plan.jobs_to_flush == set(p1.store_jobs) | set(loads.load_jobs)
    ack(sched, p1)
    assert m.named("complete_store") == []
    assert not sched.has_pending_work()


# -- events -----------------------------------------------------------------------------------
def test_events_translate_per_group() -> None:
    """vLLM test_take_events_publishes_routable_block_stored /
    test_take_events_groups_removed_hashes_by_kv_group (placeholder form): events become one
    BlockEvent per group with raw hashes, medium and removal flag."""
    sched, m = make()
    m.take_events = lambda: [  # type: ignore[method-assign]
        kc.OffloadingEvent([key(1), key(2, 1), key(3)], kc.Medium.CPU, False),
        kc.OffloadingEvent([key(4)], kc.Medium.STORAGE, True, "fs"),
    ]
    events = sched.take_events()
    assert [(e.block_hashes, e.group_idx, e.medium, e.removed) for e in events] == [
        ([h(1), h(3)], 0, "CPU", False),
        ([h(2)], 1, "CPU", False),
        ([h(4)], 0, "STORAGE", True),
    ]


def test_config_validation() -> None:
    """vLLM test_blocks_per_chunk_must_be_positive: blocks_per_chunk must be positive; block sizes
    must be hash multiples."""
    with pytest.raises(ValueError, match="greater than 0"):
        SchedulerConfig((GroupSpec(4),), 4, 0)
    with pytest.raises(ValueError, match="tokens_per_hash"):
        SchedulerConfig((GroupSpec(6),), 4)


# -- with a real coordinator --------------------------------------------------------------------
async def test_with_real_coordinator() -> None:
    """The same rules over a real TieringCoordinator (primary only): store, ack, then a second
    request with the same prefix loads the stored chunks from the primary's slots."""
    primary = kc.CPUOffloadingManager(8, enable_events=True)
    coord = kc.TieringCoordinator(primary, [])
    sched = OffloadScheduler(SchedulerConfig((GroupSpec(4),), 4), coord)
    a = FakeRequest("a", 9)
    admit(sched, a)
    plan = sched.build_step(StepInput([ScheduledRequest("a", [[1, 2, 3]])], {"a": 9}))
    [spec] = plan.store_jobs.values()
    ack(sched, plan)
    b = FakeRequest("b", 9)
    assert admit(sched, b) == (8, True)
    sched.update_state_after_alloc("b", [[(4, False), (5, False), (6, False)]], 8)
    load = sched.build_step(StepInput())
    [lspec] = load.load_jobs.values()
    assert lspec.cpu is not None
    assert lspec.cpu.block_ids.tolist() == spec.cpu.block_ids.tolist()  # type: ignore[union-attr]
    ack(sched, load)
    assert [e.removed for e in sched.take_events()] == [False]
    await asyncio.sleep(0)


# -- issue #14: where the parts meet ----------------------------------------------------------
async def test_store_cursor_does_not_skip_a_chunk_whose_write_later_fails() -> None:
    """Defect 4 (vLLM #54415): A and B share chunk 0 in one step; A stores it, B skips it as
    being written. A's store fails: B stores chunk 0 itself next step, so the prefix has no
    hole and a third request hits both chunks."""
    primary = kc.CPUOffloadingManager(8)
    sched = OffloadScheduler(
        SchedulerConfig((GroupSpec(4),), 4), kc.TieringCoordinator(primary, [])
    )
    a, b = FakeRequest("a", 5), FakeRequest("b", 9)
    admit(sched, a)
    admit(sched, b)
    step = StepInput(
        [ScheduledRequest("a", [[1, 2]]), ScheduledRequest("b", [[3, 4, 5]])], {"a": 5, "b": 9}
    )
    plan = sched.build_step(step)
    (a_job,) = [j for j, s in plan.store_jobs.items() if s.req_id == "a"]
    (b_job,) = [j for j, s in plan.store_jobs.items() if s.req_id == "b"]
    assert plan.store_jobs[b_job].gpu.block_ids.tolist() == [4]  # chunk 1 only
    assert sched.store_cursor("b") == 0  # chunk 0 is someone else's write in flight
    sched.on_jobs_finished({a_job: 1, b_job: 1}, failed={a_job})
    a.num_computed_tokens, b.num_computed_tokens = 5, 9
    retry = sched.build_step(StepInput([ScheduledRequest("b")], {"b": 1}))
    [spec] = retry.store_jobs.values()
    assert spec.req_id == "b" and spec.gpu.block_ids.tolist() == [3]
    ack(sched, retry)
    c = FakeRequest("c", 9)
    assert admit(sched, c) == (8, True)


def test_store_is_flushed_when_its_blocks_are_allocated_with_zero_external_tokens() -> None:
    """Defect 5 (vLLM #46951): a finished request's store still reads blocks 1 and 2; they are
    handed to another request through update_state_after_alloc(..., 0) (a connector in front,
    MultiConnector) or scheduled for a request this scheduler does not track: the store is
    flushed that step."""
    for via_alloc in (True, False):
        sched, _m = make()
        eng = Engine(sched)
        a = FakeRequest("a", 8)
        admit(sched, a)
        p1 = eng.step({"a": 8}, new_blocks={"a": [1, 2]}, reqs={"a": a})
        a.finished = True
        sched.request_finished("a")
        assert eng.step({}, finished=["a"]).jobs_to_flush == set()
        if via_alloc:
            admit(sched, FakeRequest("c", 8, hash_base=100))
            sched.update_state_after_alloc("c", [[(2, False), (1, False)]], 0)
            plan = sched.build_step(StepInput())
        else:  # a request of another connector, never seen by this scheduler
            plan = sched.build_step(StepInput([ScheduledRequest("x", [[2, 1]])], {"x": 8}))
        assert plan.jobs_to_flush == set(p1.store_jobs)
