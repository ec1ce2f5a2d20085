"""The composition root and the one lifecycle of a coordinator with its tiers, for both fronts.

:func:`build_coordinator` makes the secondary tiers over a primary buffer, the primary tier's
bookkeeping and the :class:`~kvcascade.coordinator.TieringCoordinator` from a
:class:`~kvcascade.CascadeConfig`; :func:`serve_coordinator` runs it. ``open_cascade`` enters
both for the awaitable API; the vLLM connector's loop thread
(:class:`~kvcascade.integrations._loop.LoopThread`) enters the same two on its event loop.

The lifecycle (``docs/architecture.md``, "The actors and their mailboxes"):

1. the primary policy's learned state is loaded from beside the first fs tier
   (:mod:`kvcascade._policy_state`);
2. each tier's actor (:meth:`SecondaryTier.run`) is started in one anyio task group — held by
   a task of its own, so the block may end in another task than the one that entered it — in
   cascade order, each waited for until it is ready;
3. on exit — normal, by an exception, by cancellation (during the start too: it is cancelled
   at once), or because a start failed — in a
   shielded scope: the tiers drain (bounded by ``SHUTDOWN_TIMEOUT_S``), the policy state is
   saved, the coordinator shuts down (queued jobs fail, running ones finish), and the actors are
   awaited (bounded by ``SHUTDOWN_TIMEOUT_S``, then cancelled). No actor outlives the block, and
   the block's exception propagates unchanged.

An actor that fails after its start is logged, never raised into the block: the caller's
requests then fail with that tier's own errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
from anyio.abc import TaskStatus

from ._config import CascadeConfig
from ._errors import ConfigError, TierUnavailableError
from ._policy_state import load_policy_state, policy_state_path, save_policy_state
from .coordinator import TieringCoordinator
from .index.cpu import CPUOffloadingManager
from .tiers.base import SecondaryTier
from .tiers.cpu import HostBuffer
from .tiers.registry import TierContext, create_secondary_tier

log = logging.getLogger(__name__)

#: Seconds each shutdown step may take: the tiers' drain, then the actors' exit.
SHUTDOWN_TIMEOUT_S = 30.0


def build_coordinator(
    config: CascadeConfig, host: HostBuffer, identity: dict[str, Any]
) -> TieringCoordinator:
    """The secondary tiers of ``config`` over ``host``, the primary tier's bookkeeping and the
    coordinator over both; nothing started.

    Args:
        config: a validated configuration (``num_cpu_blocks`` rows of ``host``).
        host: the primary tier's buffer (a :class:`HostBuffer` or the connector's
            ``SharedOffloadRegion``).
        identity: namespace identity of the persistent tiers
            (:func:`kvcascade.tiers._file_mapper.default_identity`).

    Raises:
        ConfigError: ``host`` has another number of rows or block size than ``config``
            (before any tier is built: slots past its rows had no memory behind them, and
            blocks of its size were written into the namespace of ``config.block_bytes``).
        ConfigError / OSError / whatever a tier factory raised: the tiers built before it were
            closed.
    """
    if (host.num_blocks, host.block_bytes) != (config.num_cpu_blocks, config.block_bytes):
        raise ConfigError(
            f"the primary tier's buffer has {host.num_blocks} rows of {host.block_bytes} bytes, "
            f"the config {config.num_cpu_blocks} of {config.block_bytes}: build them from one "
            "geometry"
        )
    tiers: list[SecondaryTier] = []
    try:
        context = TierContext(host, identity)
        for tier_cfg in config.secondary_tiers:
            tiers.append(create_secondary_tier(tier_cfg, context))
            tiers[-1].event_queue.enabled = config.enable_events  # the primary's too, below
        primary = CPUOffloadingManager(
            config.num_cpu_blocks,
            config.eviction_policy,
            cache_policy_module_path=config.cache_policy_module_path,
            enable_events=config.enable_events,
        )
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    return TieringCoordinator(
        primary, tiers, pending_write_timeout_s=config.pending_write_timeout_s
    )


@contextlib.asynccontextmanager
async def serve_coordinator(coordinator: TieringCoordinator) -> AsyncIterator[TieringCoordinator]:
    """Run ``coordinator``'s tier actors for the block; stop them when it exits (module
    docstring). Enter it on the event loop that runs the coordinator's hooks; it may be exited
    from another task than the one that entered it (the actors' task group lives in a task of
    its own, ``kvcascade-lifecycle``).

    Cancelled while the tiers start (an embedder's start-up deadline, ``asyncio.wait_for``),
    the start is cancelled too rather than run to the tiers' own timeouts (a valkey server that
    accepts and never answers: 15 s with the defaults, a hung S3 endpoint 90 s); the started
    actors stop as on any exit.

    Raises:
        whatever an actor's start-up raised, after the whole shutdown ran: a failed start leaves
        nothing running.
    """
    ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()
    lifecycle = asyncio.create_task(_serve(coordinator, ready, stop), name="kvcascade-lifecycle")
    try:
        await asyncio.shield(ready)
        yield coordinator
    finally:
        stop.set()
        if not ready.done():  # cancelled while a tier starts: so is the start, at once
            lifecycle.cancel()
        try:
            await asyncio.shield(lifecycle)
        except asyncio.CancelledError:  # cancelled again while stopping: finish stopping first
            await asyncio.wait([lifecycle])
            raise
        finally:
            if ready.done() and not ready.cancelled():
                ready.exception()  # a start failure seen after a cancellation: retrieved


async def _serve(
    coordinator: TieringCoordinator, ready: asyncio.Future[None], stop: asyncio.Event
) -> None:
    """The lifecycle task: policy state, the actors' task group, the shielded bounded stop.
    Resolves ``ready`` once every actor started (or with the start's error); stops once
    ``stop`` is set or the start failed. Raises only its own cancellation."""
    try:
        policy = coordinator.primary.policy
        state_path = policy_state_path(policy, coordinator.tiers)
        if state_path is not None:
            load_policy_state(policy, state_path)
        exited: list[anyio.Event] = []
        async with anyio.create_task_group() as group:
            try:
                for tier in coordinator.tiers:
                    exited.append(anyio.Event())
                    await group.start(_actor, tier, exited[-1], name=f"kvcascade-{tier.name}")
            except Exception as exc:
                ready.set_exception(exc)
            else:
                log.info("kvcascade: %s", _tiers_line(coordinator.tiers))
                ready.set_result(None)
                await stop.wait()
            finally:
                with anyio.CancelScope(shield=True):
                    await _drain(coordinator)
                    if state_path is not None:
                        save_policy_state(policy, state_path)
                    coordinator.shutdown()
                    with anyio.move_on_after(SHUTDOWN_TIMEOUT_S):
                        for event in exited:
                            await event.wait()
                    late = [t.name for t, e in zip(coordinator.tiers, exited) if not e.is_set()]
                    if late:
                        log.warning("kvcascade: tier actors %s did not stop; cancelled", late)
                        group.cancel_scope.cancel()
    finally:
        if not ready.done():  # cancelled while starting (the loop is going away)
            ready.set_exception(TierUnavailableError("the cascade stopped while starting"))


_PLACE_ATTRS = ("root", "bucket", "endpoint", "url", "prefix", "max_bytes")
"""Tier attributes that say where a tier keeps its blocks and how much it may keep (fs:
``root``, ``max_bytes``; s3: ``bucket``, ``endpoint``, ``prefix``, ``max_bytes``; valkey:
``url``, ``prefix``), in the order :func:`_tiers_line` shows them."""


def _tiers_line(tiers: Sequence[SecondaryTier]) -> str:
    """``cpu N blocks × B bytes = T bytes; <name> (<type>): root=…, max_bytes=…; …`` (the
    primary tier from the tiers' shared host buffer; ``max_bytes=None`` shows as unbounded)."""
    if not tiers:
        return "no secondary tiers (GPU and CPU only)"
    host = tiers[0].host
    parts = [
        f"cpu {host.num_blocks:,} blocks × {host.block_bytes:,} bytes = "
        f"{host.num_blocks * host.block_bytes:,} bytes"
    ]
    for tier in tiers:
        places = [
            f"{attr}={'unbounded' if value is None else value}"
            for attr in _PLACE_ATTRS
            if hasattr(tier, attr) and (value := getattr(tier, attr)) != ""
        ]
        kind = type(tier).__name__
        parts.append(
            f"{tier.name} ({kind}): {', '.join(places)}" if places else f"{tier.name} ({kind})"
        )
    return "tiers ready: " + "; ".join(parts)


async def _actor(
    tier: SecondaryTier, exited: anyio.Event, *, task_status: TaskStatus[None]
) -> None:
    """One tier's actor in the task group: ready once the tier calls ``started``; a failure
    before that is the start's error (raised by ``TaskGroup.start``), one after it is logged."""
    started = False

    def ready() -> None:
        nonlocal started
        started = True
        task_status.started()

    try:
        await tier.serve(ready)
    except Exception as exc:
        if not started:
            raise
        log.error("tier actor %s failed: %r", tier.name, exc)
    finally:
        exited.set()


async def _drain(coordinator: TieringCoordinator) -> None:
    """Wait for every tier's submitted jobs, at most ``SHUTDOWN_TIMEOUT_S`` seconds in all."""
    with anyio.move_on_after(SHUTDOWN_TIMEOUT_S) as scope:
        for tier in coordinator.tiers:
            await tier.drain()
    if scope.cancelled_caught:
        log.warning("kvcascade: tiers did not drain within %.0f s", SHUTDOWN_TIMEOUT_S)
