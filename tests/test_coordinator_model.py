"""Randomised model test of the whole coordinator (issue #4): a primary tier and two secondary
tiers whose jobs complete, fail part-way or stall at random, driven through the synchronous
hooks. After every step: no ref count below -1 (not ready), every block pinned by the test is
still present and readable, slots are conserved, nothing leaks after ``reset_cache``, and every
byte a load delivered equals what was stored under that key. A GPU→CPU store may stay in flight
across its request's finish and the next use of the same context (vLLM's order: a request
finishes before its last stores land); once every request finished and every job was observed,
no block may stay pinned."""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Sequence

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import kvcascade as kc
from kvcascade import LookupResult as R

BLOCK = 32
KEYS = [kc.make_offload_key(i.to_bytes(8, "big"), 0) for i in range(10)]
REQS = ["a", "b", "c"]


def payload(key: bytes) -> bytes:
    return bytes([key[7] + 1]) * BLOCK


class ScriptedTier(kc.MemoryTier):
    """A memory tier whose next jobs complete, fail after some keys, or stall until released."""

    def __init__(self, host: kc.HostBuffer, name: str) -> None:
        super().__init__(host, name=name)
        self.modes: collections.deque[str] = collections.deque()
        self.release = threading.Event()

    def _mode(self) -> str:
        mode = self.modes.popleft() if self.modes else "ok"
        if mode == "stall":
            self.release.wait(30)
        return mode

    def _store_blocks(self, keys: Sequence[bytes], rows: Sequence[memoryview]) -> int:
        if self._mode() == "fail" and keys:
            super()._store_blocks(keys[:1], rows[:1])
            raise kc.TransferError("scripted store failure", keys[:1])
        return super()._store_blocks(keys, rows)

    def _load_blocks(self, keys: Sequence[bytes], rows: Sequence[memoryview]) -> int:
        if self._mode() == "fail" and keys:
            super()._load_blocks(keys[:1], rows[:1])
            raise kc.TransferError("scripted load failure", keys[:1])
        return super()._load_blocks(keys, rows)


class CoordinatorModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.host = kc.HostBuffer(4, BLOCK)
        self.primary = kc.CPUOffloadingManager(4, enable_events=True)
        self.tiers = [ScriptedTier(self.host, f"t{i}") for i in range(2)]
        self.actors = []
        for tier in self.tiers:
            started = asyncio.Event()
            self.actors.append(self.loop.create_task(tier.serve(started.set)))
            self.loop.run_until_complete(started.wait())
        self.coord = kc.TieringCoordinator(self.primary, self.tiers)
        self.ctx = {r: kc.ReqContext(r) for r in REQS}
        self.loads: dict[str, list[bytes]] = {r: [] for r in REQS}  # keys pinned by prepare_load
        self.looked_up: dict[str, set[bytes]] = {r: set() for r in REQS}  # HIT (lookup pins)
        # GPU→CPU stores prepared and not completed yet: (context, keys)
        self.in_flight: list[tuple[kc.ReqContext, list[bytes]]] = []
        self.finished: list[kc.ReqContext] = []  # contexts of uses an id has had before
        for r in REQS:
            self.coord.on_new_request(self.ctx[r])

    def run(self, coro: object) -> object:
        return self.loop.run_until_complete(coro)  # type: ignore[arg-type]

    @rule(
        req=st.sampled_from(REQS),
        keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3),
        ok=st.booleans(),
    )
    def store(self, req: str, keys: list[bytes], ok: bool) -> None:
        ctx = self.ctx[req]
        out = self.coord.prepare_store(keys, ctx)
        if out is None:
            return
        for key, slot in zip(out.keys_to_store, out.store_spec.block_ids):
            self.host.row(int(slot))[:] = payload(key)
        self.coord.complete_store(out.keys_to_store, ctx, success=ok)

    @rule(req=st.sampled_from(REQS), keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3))
    def start_store(self, req: str, keys: list[bytes]) -> None:
        ctx = self.ctx[req]
        out = self.coord.prepare_store(keys, ctx)
        if out is None or not out.keys_to_store:
            return
        for key, slot in zip(out.keys_to_store, out.store_spec.block_ids):
            self.host.row(int(slot))[:] = payload(key)
        self.in_flight.append((ctx, list(out.keys_to_store)))

    @precondition(lambda self: self.in_flight)
    @rule(i=st.integers(0, 7), ok=st.booleans())
    def land_store(self, i: int, ok: bool) -> None:
        ctx, keys = self.in_flight.pop(i % len(self.in_flight))
        self.coord.complete_store(keys, ctx, success=ok)

    @rule()
    def quiesce(self) -> None:
        """Every store lands, every request finishes, every job is observed: no pin is left
        (a later use of a finished request's context took over its state, and the old store's
        landing dropped the new use's lookup pins: slots pinned for ever)."""
        self.release_stalls()
        while self.in_flight:
            self.land_store(0, True)
        for r in REQS:
            self.complete_load(r)
            self.coord.on_request_finished(self.ctx[r])
            self.looked_up[r].clear()
        for _ in range(2):  # finishing submits the queued promotions
            for tier in self.tiers:
                self.run(tier.drain())
            self.coord.poll_now()
        primary = self.primary
        tracked = list(primary.policy.keys())
        pinned = [k for k in tracked if primary.get_block(k).ref_cnt > 0]
        assert not pinned, f"{len(pinned)} blocks pinned with no request alive"
        for r in REQS:
            self.coord.on_new_request(self.ctx[r])

    @rule(req=st.sampled_from(REQS), key=st.sampled_from(KEYS))
    def lookup(self, req: str, key: bytes) -> None:
        if self.coord.lookup(key, self.ctx[req]) is R.HIT:
            self.looked_up[req].add(key)

    @rule(tier=st.integers(0, 1), mode=st.sampled_from(["ok", "fail", "stall"]))
    def script(self, tier: int, mode: str) -> None:
        self.tiers[tier].modes.append(mode)

    @rule()
    def step(self) -> None:
        self.coord.on_schedule_end()
        self.run(asyncio.sleep(0.002))
        for tier in self.tiers:
            self.run(tier._lookup.wait_probes())

    @rule()
    def release_stalls(self) -> None:
        for tier in self.tiers:
            tier.release.set()
            tier.modes.clear()

    @rule(req=st.sampled_from(REQS))
    def load(self, req: str) -> None:
        keys = sorted(self.looked_up[req])
        if not keys or self.loads[req]:
            return
        spec = self.coord.prepare_load(keys, self.ctx[req])
        self.looked_up[req].clear()
        for key, slot in zip(keys, spec.block_ids):
            assert bytes(self.host.row(int(slot))) == payload(key), "loaded bytes differ"
        self.loads[req] = keys

    @rule(req=st.sampled_from(REQS))
    def complete_load(self, req: str) -> None:
        if self.loads[req]:
            self.coord.complete_load(self.loads[req], self.ctx[req])
            self.loads[req] = []

    @rule(req=st.sampled_from(REQS), new_context=st.booleans())
    def finish(self, req: str, new_context: bool) -> None:
        """The request finishes and its id is used again, by the same ``ReqContext`` or by a
        new one (as vLLM makes one per request)."""
        self.complete_load(req)
        self.coord.on_request_finished(self.ctx[req])
        self.looked_up[req].clear()
        if new_context:
            self.finished.append(self.ctx[req])
            self.ctx[req] = kc.ReqContext(req)
        self.coord.on_new_request(self.ctx[req])

    @precondition(lambda self: self.finished)
    @rule(i=st.integers(0, 7))
    def finish_again(self, i: int) -> None:
        """An abort after the finish, of a use whose id has a new use by now: it changes
        nothing (it released the new use's lookup pins, and another request evicted a block
        the new use had a HIT for; found by a break-it run)."""
        self.coord.on_request_finished(self.finished[i % len(self.finished)])

    @precondition(lambda self: not any(self.loads.values()) and not self.in_flight)
    @rule()
    def reset(self) -> None:
        self.release_stalls()
        self.run(self.coord.reset_cache())
        for r in REQS:
            self.looked_up[r].clear()
        assert self.primary.num_free == self.primary.num_blocks, "slots leaked after reset"
        assert not self.coord.has_pending_work()

    @invariant()
    def consistent(self) -> None:
        primary = self.primary
        tracked = list(primary.policy.keys())
        blocks = [primary.get_block(k) for k in tracked]
        assert all(b.ref_cnt >= -1 for b in blocks)
        slots = [b.block_id for b in blocks]
        assert len(set(slots)) == len(slots), "two keys share a slot"
        assert primary.num_free + len(tracked) == primary.num_blocks, "slots not conserved"
        for r in REQS:
            for key in [*self.loads[r], *self.looked_up[r]]:
                block = primary.get_block(key)
                assert block is not None and block.ref_cnt >= 1, "a pinned block was evicted"

    def teardown(self) -> None:
        self.release_stalls()
        for tier in self.tiers:
            self.run(tier.drain())
            tier.close()
        self.run(asyncio.gather(*self.actors))
        self.loop.close()
        self.host.close()


CoordinatorModel.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCoordinatorModel = CoordinatorModel.TestCase


def _used_again_with_a_store_in_flight(model: CoordinatorModel, new_context: bool) -> None:
    """vLLM's order: ``b`` finishes while its GPU→CPU store is in flight, its id is used again
    (by the same ``ReqContext`` or a new one) and gets a primary hit, pinned."""
    model.store("a", [KEYS[0]], True)
    model.step()
    model.start_store("b", [KEYS[1]])
    model.finish("b", new_context)
    model.lookup("b", KEYS[0])
    assert model.looked_up["b"] == {KEYS[0]}


def test_a_store_landing_after_its_request_finished_and_its_context_was_used_again() -> None:
    """The model's rules in the order a break-it run found (then the old store lands): the new
    use's lookup pin went with the old use's state and the slot stayed pinned with no request
    alive."""
    model = CoordinatorModel()
    try:
        _used_again_with_a_store_in_flight(model, new_context=False)
        model.land_store(0, True)
        model.load("b")
        model.complete_load("b")
        model.quiesce()
    finally:
        model.teardown()


def test_an_abort_after_the_finish_leaves_the_next_use_of_the_id_alone() -> None:
    """A break-it run's order (the id used again by a new ``ReqContext``, then the old context
    finished again: an abort after the finish). That released the new use's lookup pin, and a
    store of other keys evicted the block the new use was about to load."""
    model = CoordinatorModel()
    try:
        _used_again_with_a_store_in_flight(model, new_context=True)
        model.finish_again(0)
        model.store("a", [KEYS[2], KEYS[3], KEYS[4]], True)  # a full primary: one eviction
        model.consistent()
        model.load("b")
        model.complete_load("b")
        model.quiesce()
    finally:
        model.teardown()
