"""The cascade: one object that owns every tier and the awaitable API.

``async with kvcascade.open_cascade(config) as cascade:`` builds the device tier and, with
:func:`kvcascade._lifecycle.build_coordinator`, the primary and secondary tiers and their
coordinator, runs the tier actors (:func:`kvcascade._lifecycle.serve_coordinator`: one task
group), and on exit drains and stops them (no actor outlives the block). The awaitable API —
:meth:`Cascade.lookup_prefix`, :meth:`Cascade.load`, :meth:`Cascade.store` — drives the same
:class:`~kvcascade.coordinator.TieringCoordinator` state that a synchronous scheduler drives
through its hooks.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ._config import CascadeConfig
from ._errors import TierUnavailableError
from ._keys import check_offload_key
from ._lifecycle import build_coordinator, serve_coordinator
from ._types import OffloadingEvent, ReqContext
from ._validate import is_int
from .coordinator import PrefixLookup, TieringCoordinator
from .tiers._file_mapper import default_identity
from .tiers.base import SecondaryTier
from .tiers.cpu import HostBuffer
from .tiers.device import DeviceTier, DeviceTransfer
from .views import views_identity

log = logging.getLogger(__name__)


@dataclass
class LoadResult:
    """Outcome of :meth:`Cascade.load`: how many leading keys reached the GPU.

    ``loaded`` keys were copied (``bytes`` in total, ``seconds`` of device copy); the keys after
    them failed (promotion failure, corrupt block) and must be recomputed.
    """

    loaded: int
    bytes: int = 0
    seconds: float = 0.0
    failed_keys: list[bytes] = field(default_factory=list)


@dataclass
class StoreResult:
    """Outcome of :meth:`Cascade.store`: keys newly written to the primary tier, and dropped."""

    stored: list[bytes] = field(default_factory=list)
    dropped: int = 0
    bytes: int = 0


@dataclass
class InvalidateResult:
    """Outcome of :meth:`Cascade.invalidate`.

    ``removed`` maps each tier (``"cpu"`` for the primary, then the secondary tiers' names) to
    the number of blocks removed there; ``in_use`` lists keys the primary tier kept because a
    request reads or writes them now (invalidate them again once those requests finish).
    """

    removed: dict[str, int] = field(default_factory=dict)
    in_use: list[bytes] = field(default_factory=list)


class Cascade:
    """GPU → CPU → secondary tiers, built from a :class:`CascadeConfig`.

    Use :func:`open_cascade`; constructing directly does not start the actors.

    Args:
        config: tiers and sizes.
        kv_views: the engine's own KV cache, as :func:`kvcascade.canonical_views` of its KV
            tensors (any layout that handles, CUDA or CPU; ``gpu_blocks`` blocks, pages adding
            up to ``block_bytes``): loads and stores copy straight to and from them. What each
            view's bytes mean (layer, layout, dtype, block shape, order;
            :func:`kvcascade.views.views_identity`) is part of the persistent tiers' namespace:
            blocks of the same size written by an engine of another layout, dtype or geometry
            are never read. None: the device tier allocates a stand-in ``device.kv`` int8
            ``(gpu_blocks, block_bytes)`` (the replay's engine).

    Attributes:
        host: the primary tier's buffer (``num_cpu_blocks × row_bytes`` bytes).
        primary: the primary tier's bookkeeping.
        device: the device tier (``device.views``: the KV views copied to and from).
        tiers: secondary tiers in cascade order.
        coordinator: the synchronous hooks over all of them.

    Raises:
        ConfigError: a bad configuration value, or ``kv_views`` that do not fit it
            (:class:`~kvcascade.tiers.device.DeviceTier`).
    """

    def __init__(
        self, config: CascadeConfig, *, kv_views: Sequence[torch.Tensor] | None = None
    ) -> None:
        self.config = config
        self._closed = False
        self.host = HostBuffer(config.num_cpu_blocks, config.block_bytes)
        self.device = DeviceTier(config.gpu_blocks, self.host, views=kv_views)
        identity = default_identity(
            model_name=config.model_name,
            cache_salt=config.cache_salt,
            block_bytes=config.block_bytes,
            **(views_identity(kv_views) if kv_views is not None else {}),
        )
        try:
            self.coordinator: TieringCoordinator = build_coordinator(config, self.host, identity)
        except BaseException:
            self._release()
            raise
        self.primary = self.coordinator.primary
        self.tiers: list[SecondaryTier] = self.coordinator.tiers
        # GPU block id → the unfinished loads writing it / stores reading it. A call waits for
        # those of the other kind that were called before it: calls on one block take effect
        # in call order (a store never publishes bytes a later load wrote, vLLM #46951 and its
        # reverse; a load never overwrites a block an earlier store still copies from).
        self._loading: dict[int, set[asyncio.Future[None]]] = {}
        self._storing: dict[int, set[asyncio.Future[None]]] = {}
        self._opened = False
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop that opened it
        self._thread = 0  # and its thread
        self._drops_logged = False
        self.counters: collections.Counter[str] = collections.Counter()

    # -- awaitable API ---------------------------------------------------------------------
    async def lookup_prefix(self, keys: Sequence[bytes], ctx: ReqContext) -> PrefixLookup:
        """The longest prefix of ``keys`` available in any tier (awaits secondary probes).

        Primary hits are pinned for the request at once (the coordinator's lookup pins; released
        by :meth:`load` or :meth:`finish_request`); secondary hits get a primary slot reserved
        and a promotion queued, as with vLLM's lookup (``kv_offload/tiering/manager.py``), so they
        cannot be evicted before :meth:`load`. A key whose write is in flight for another request
        counts as available: :meth:`load` waits for that write instead of issuing a second one.

        A secondary hit needs a free primary slot for its promotion: a key that finds none ends
        the prefix (allocation failure = miss, as in vLLM's
        ``kv_offload/tiering/manager.py``), so through a CPU tier smaller than the
        prefix a long prefix comes back in parts — :meth:`load` one part, then look up the rest
        (``examples/asyncio_cascade.py``).
        """
        self._check(keys, ctx)
        return await self.coordinator.lookup_prefix(keys, ctx)

    async def load(
        self, keys: Sequence[bytes], ctx: ReqContext, gpu_ids: Sequence[int]
    ) -> LoadResult:
        """Bring ``keys`` (a prefix found by :meth:`lookup_prefix`) into GPU blocks ``gpu_ids``.

        Flushes the queued promotions and awaits every write the keys depend on (promotions and
        GPU→CPU stores, also other requests'), then copies the leading run of keys that are
        ready in the primary tier. Keys after the first failure are released and reported in
        ``failed_keys``; a failed key is never reported as loaded (a failed CPU→GPU copy counts
        its keys in ``counters["load_failed_blocks"]``). Cancelled while copying, the copy
        finishes before the pins are released. Calls on one GPU block take effect in call
        order: a load into any of ``gpu_ids`` first waits for the unfinished :meth:`store`
        calls made before it from those blocks (it never overwrites the bytes a store is
        copying), and until it returns a later :meth:`store` from them waits for it (a store
        never publishes the bytes a load is replacing).

        Raises:
            TypeError / ValueError: see :func:`_check_request` (bad keys, ctx or GPU ids).
        """
        self._check(keys, ctx, gpu_ids)
        async with self._in_call_order(self._loading, self._storing, gpu_ids):
            return await self._load(keys, ctx, gpu_ids)

    async def _load(
        self, keys: Sequence[bytes], ctx: ReqContext, gpu_ids: Sequence[int]
    ) -> LoadResult:
        coord = self.coordinator
        coord.on_schedule_end()
        waits = coord.write_futures(keys)
        if waits:
            await asyncio.wait(waits)
        coord.poll_now()
        ready = list(keys[: coord.readable_prefix(keys)])
        coord.release_lookup_pins(ctx, keys[len(ready) :])
        if not ready:
            return LoadResult(0, failed_keys=list(keys))
        slots = coord.prepare_load(ready, ctx).block_ids
        copy = asyncio.ensure_future(
            self.device.load(slots, np.asarray(gpu_ids[: len(ready)], dtype=np.int64))
        )
        try:
            transfer = await _uncancellable(copy)
        finally:
            coord.complete_load(ready, ctx)
        if not transfer.success:
            log.warning("device load failed: %s", transfer.error)
            self.counters["load_failed_blocks"] += len(ready)
            return LoadResult(0, failed_keys=list(keys))
        return LoadResult(len(ready), transfer.bytes, transfer.seconds, list(keys[len(ready) :]))

    async def store(
        self, keys: Sequence[bytes], ctx: ReqContext, gpu_ids: Sequence[int]
    ) -> StoreResult:
        """Offload GPU blocks ``gpu_ids[i]`` under ``keys[i]`` (GPU → CPU, then the cascade).

        A source block that an unfinished :meth:`load` called before this store is filling is
        copied only after that load returns, and a :meth:`load` into ``gpu_ids`` called after
        it waits until this store returns (calls on one GPU block take effect in call order).
        Keys already present (or being written) are skipped. The jobs finished since the last
        call are applied first (finished cascades release their pins and their room in
        the cascade queue; a promotion that landed for a request finished unread leaves its
        slot evictable). When the primary tier has no evictable room, waits for in-flight
        cascades to release their pins and tries once more; then the leading keys
        that fit are stored and the rest dropped (counted in ``counters["store_dropped_blocks"]``
        and in ``StoreResult.dropped``; the first drop is logged as a warning). The cascade to
        secondary tiers runs in the background. Cancelled while copying, the copy finishes and
        its outcome is recorded.

        Raises:
            TypeError / ValueError: see :func:`_check_request` (bad keys, ctx or GPU ids).
        """
        self._check(keys, ctx, gpu_ids)
        async with self._in_call_order(self._storing, self._loading, gpu_ids):
            return await self._store(keys, ctx, gpu_ids)

    async def _store(
        self, keys: Sequence[bytes], ctx: ReqContext, gpu_ids: Sequence[int]
    ) -> StoreResult:
        coord = self.coordinator
        # An asyncio caller has no steps: the jobs finished since the last call are applied
        # first, or their cascades count as queued (every later cascade refused by
        # back-pressure) and keep their pins, and the slots of promotions that landed for a
        # request finished unread stay reserved (docs/coordinator.md, *Rules that keep it correct
        # where the parts meet*).
        coord.poll_now()
        out = coord.prepare_store(keys, ctx)
        if out is None and (cascades := coord.job_futures(promotions=False)):
            await asyncio.wait(cascades)
            coord.poll_now()
            out = coord.prepare_store(keys, ctx)
        dropped = 0
        if out is None:  # store the leading part that fits; the rest is dropped
            fits = coord.storable_prefix(keys)
            out = coord.prepare_store(keys[:fits], ctx) if fits else None
            dropped = len(keys) - (fits if out is not None else 0)
            self._count_dropped(dropped, len(keys), "the CPU tier has no evictable room")
        if out is None:
            return StoreResult(dropped=dropped)
        if not out.keys_to_store:
            return StoreResult(dropped=dropped)
        index = {k: i for i, k in enumerate(keys)}
        src = np.asarray([gpu_ids[index[k]] for k in out.keys_to_store], dtype=np.int64)
        copy = asyncio.ensure_future(self.device.store(src, out.store_spec.block_ids))  # type: ignore[attr-defined]
        try:
            transfer = await _uncancellable(copy)
        finally:
            coord.complete_store(out.keys_to_store, ctx, success=_succeeded(copy))
        if not transfer.success:
            log.warning("device store failed: %s", transfer.error)
            self.counters["store_dropped_blocks"] += len(out.keys_to_store)
            return StoreResult(dropped=dropped + len(out.keys_to_store))
        return StoreResult(out.keys_to_store, dropped, transfer.bytes)

    @contextlib.asynccontextmanager
    async def _in_call_order(
        self,
        mine: dict[int, set[asyncio.Future[None]]],
        other: dict[int, set[asyncio.Future[None]]],
        gpu_ids: Sequence[int],
    ) -> AsyncIterator[None]:
        """Register a call on ``gpu_ids`` in ``mine`` (``_loading`` or ``_storing``) until the
        block ends, first waiting for the calls of the other kind on those blocks made before
        it. Only earlier calls are waited for, so two calls never wait for each other."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        blocks = {int(i) for i in gpu_ids}
        earlier = {f for i in blocks for f in other.get(i, ())}
        for i in blocks:
            mine.setdefault(i, set()).add(done)
        try:
            if earlier:
                await asyncio.wait(earlier)
            yield
        finally:
            for i in blocks:
                calls = mine[i]
                calls.discard(done)
                if not calls:
                    del mine[i]
            done.set_result(None)

    def _count_dropped(self, dropped: int, asked: int, why: str) -> None:
        """Count dropped store keys; log the first drop as a warning, later ones at debug."""
        if not dropped:
            return
        self.counters["store_dropped_blocks"] += dropped
        (log.debug if self._drops_logged else log.warning)(
            "store dropped %d of %d keys: %s (counted in "
            "counters['store_dropped_blocks']; later drops are logged at debug level)",
            dropped,
            asked,
            why,
        )
        self._drops_logged = True

    def touch(self, keys: Sequence[bytes], ctx: ReqContext) -> None:
        """Record that a request reads ``keys`` — every block of its prompt, cached or not, in
        order — once per request, as vLLM's scheduler does when it allocates the request
        (vLLM ``offloading/scheduler.py``): refreshes recency in every tier and is what learning
        policies (``turn_aware``) learn from. :meth:`lookup_prefix` does not touch: a caller that
        never touches gets LRU-like behaviour from ``turn_aware``.

        Raises:
            TypeError / ValueError: see :func:`_check_request`.
        """
        self._check(keys, ctx)
        self.coordinator.touch(keys, ctx)

    async def invalidate(self, keys: Sequence[bytes]) -> InvalidateResult:
        """Remove ``keys`` from every tier, so they are never served again (a forged or stale
        block, a tenant's data to delete).

        The primary tier forgets the idle ones at once (a key being read or written is left
        and reported in ``in_use``); every secondary tier deletes its copies
        (:meth:`SecondaryTier.invalidate`). Cascades already in flight finish first, so none
        of them writes a key back after it was removed.

        Raises:
            TypeError / ValueError: see :func:`_check_request`.
            whatever a tier's removal raised (:meth:`SecondaryTier.invalidate`); the tiers
            before it have removed their copies.
        """
        self._check(keys, ReqContext("invalidate"))
        await self.wait_cascades()
        removed, in_use = self.primary.remove(keys)
        out = InvalidateResult({"cpu": len(removed)}, in_use)
        for tier in self.tiers:
            out.removed[tier.name] = await tier.invalidate(keys)
        return out

    def finish_request(self, ctx: ReqContext) -> None:
        """The request will submit nothing more (finished or cancelled): release its pins and
        tell the coordinator.

        Raises:
            TypeError: ``ctx`` is not a :class:`ReqContext`.
            RuntimeError: called from outside the event loop of the open cascade
                (:meth:`_check_loop`).
        """
        _check_ctx(ctx)
        if self._opened and not self._closed:
            self._check_loop()
        self.coordinator.on_request_finished(ctx)

    async def wait_cascades(self) -> None:
        """Wait for every cascade in flight and apply the results (replay's step barrier).

        Raises:
            RuntimeError: called from outside the event loop of the open cascade
                (:meth:`_check_loop`).
        """
        if self._opened and not self._closed:
            self._check_loop()
        cascades = self.coordinator.job_futures(promotions=False)
        if cascades:
            await asyncio.wait(cascades)
        self.coordinator.poll_now()

    def events(self) -> AsyncIterator[OffloadingEvent]:
        """KV events (stored/removed, per tier, in order) as they happen; ends at shutdown."""
        return self.coordinator.events()

    # -- lifecycle ---------------------------------------------------------------------------
    def _release(self) -> None:
        self._closed = True
        self.device.close()
        self.host.close()

    def _check_open(self) -> None:
        """Refuse a call on a cascade that is not open, or from outside its event loop.

        Raises:
            TierUnavailableError: the cascade is closed or closing (its ``async with`` ended).
            RuntimeError: the cascade was never opened (built directly, not by
                :func:`open_cascade`: its tier actors do not run), or the call comes from
                another thread or event loop than the one that opened it (the coordinator and
                the tier actors are that loop's; a call from elsewhere copied the KV, then
                failed at the cascade submission and left its CPU slots pinned). Call it
                there: ``asyncio.run_coroutine_threadsafe`` or anyio's ``BlockingPortal``.
        """
        if self._closed:
            raise TierUnavailableError("the cascade is closed")
        if not self._opened:
            raise RuntimeError(
                "the cascade was not opened: use `async with kvcascade.open_cascade(config)`"
            )
        self._check_loop()

    def _check_loop(self) -> None:
        """Refuse a call from another thread or event loop than the one that opened the cascade
        (:meth:`_check_open`); a synchronous call from that loop's thread while the loop is
        not running (between ``run_until_complete`` calls) is its own.

        Raises:
            RuntimeError: naming what to do instead.
        """
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        same = threading.get_ident() == self._thread if loop is None else loop is self._loop
        if not same:
            raise RuntimeError(
                "Cascade called from outside the event loop that opened it (another thread or "
                "event loop): submit the call to that loop (asyncio.run_coroutine_threadsafe, "
                "anyio's BlockingPortal)"
            )

    def _check(self, keys: Sequence[bytes], ctx: ReqContext, gpu_ids: Any = None) -> None:
        """:func:`_check_request`, plus: the cascade is open, called from its event loop
        (:meth:`_check_open`), and every GPU id is a block.

        Raises:
            RuntimeError / TierUnavailableError: see :meth:`_check_open`.
            TypeError / ValueError: see :func:`_check_request`; a GPU id outside
                ``[0, gpu_blocks)``, or one GPU id given for two keys (one key's KV would be
                stored under both, or one load would overwrite the other).
        """
        self._check_open()
        _check_request(keys, ctx, gpu_ids)
        if gpu_ids is not None and len(gpu_ids):
            n = self.device.num_blocks
            listed = [int(i) for i in gpu_ids]
            bad = [i for i in listed if not 0 <= i < n]
            if bad:
                raise ValueError(f"GPU block ids out of range [0, {n}): {bad[:8]}")
            if len(set(listed)) < len(listed):
                repeated = sorted({i for i in listed if listed.count(i) > 1})[:8]
                raise ValueError(f"GPU block ids given for more than one key: {repeated}")


def _check_request(keys: Sequence[bytes], ctx: ReqContext, gpu_ids: Any = None) -> None:
    """Reject arguments that would silently do the wrong thing.

    Raises:
        TypeError: ``keys`` is not a sequence of ``bytes`` (a single key, str or int keys),
            ``ctx`` is not a :class:`ReqContext`, ``gpu_ids`` is not a list, tuple or numpy
            array (a set has no order, a generator no length), or a GPU id is not an integer.
        ValueError: ``keys`` and ``gpu_ids`` differ in length, a key is too short to be an
            offload key (block hash + 4-byte group index, :func:`kvcascade.make_offload_key`),
            or a key is given twice (a prefix never repeats a chained block hash; a repeated
            key would be pinned once and unpinned twice, LMCache #2954).
    """
    if isinstance(keys, (bytes, bytearray, str)) or not isinstance(keys, Sequence):
        raise TypeError(f"keys must be a sequence of offload keys (bytes), got {keys!r:.80}")
    for key in keys:
        check_offload_key(key)
    if len(set(keys)) < len(keys):
        repeated = [k for k, n in collections.Counter(keys).items() if n > 1]
        raise ValueError(f"offload keys given more than once: {repeated[:4]!r:.200}")
    _check_ctx(ctx)
    if gpu_ids is None:
        return
    if not isinstance(gpu_ids, (Sequence, np.ndarray)) or isinstance(gpu_ids, (str, bytes)):
        raise TypeError(
            "GPU block ids must be a list, tuple or numpy array of ints (ordered like the keys), "
            f"got {type(gpu_ids).__name__}"
        )
    if len(keys) != len(gpu_ids):
        raise ValueError(f"{len(keys)} keys but {len(gpu_ids)} GPU block ids")
    for gpu_id in gpu_ids:
        if not (is_int(gpu_id) or isinstance(gpu_id, np.integer)):
            raise TypeError(f"GPU block ids must be integers, got {gpu_id!r}")


def _check_ctx(ctx: object) -> None:
    if not isinstance(ctx, ReqContext):
        raise TypeError(f"ctx must be a kvcascade.ReqContext, got {type(ctx).__name__}")


async def _uncancellable(copy: asyncio.Future[DeviceTransfer]) -> DeviceTransfer:
    """Await a device copy; if the caller is cancelled, let the copy finish first (its rows
    must stay pinned until then), then re-raise the cancellation."""
    try:
        return await asyncio.shield(copy)
    except asyncio.CancelledError:
        await asyncio.wait([copy])
        raise


def _succeeded(copy: asyncio.Future[DeviceTransfer]) -> bool:
    """True if a device copy finished and succeeded."""
    return (
        copy.done() and not copy.cancelled() and copy.exception() is None and copy.result().success
    )


@contextlib.asynccontextmanager
async def open_cascade(
    config: CascadeConfig, *, kv_views: Sequence[torch.Tensor] | None = None
) -> AsyncIterator[Cascade]:
    """Build a :class:`Cascade` (``kv_views``: the engine's KV cache, see there), run its tier
    actors, and stop them when the block exits.

    On exit (normal or by an exception, which propagates unchanged) every tier is drained
    (bounded by ``SHUTDOWN_TIMEOUT_S`` seconds), its actor stops, its threads are joined, and
    the host buffer is unmapped; no actor task outlives the block
    (:func:`kvcascade._lifecycle.serve_coordinator`).

    Raises:
        ConfigError: a bad configuration value.
        OSError: a tier's directory cannot be created.
    """
    cascade = Cascade(config, kv_views=kv_views)
    try:
        async with serve_coordinator(cascade.coordinator):
            cascade._loop = asyncio.get_running_loop()
            cascade._thread = threading.get_ident()
            cascade._opened = True
            try:
                yield cascade
            finally:
                cascade._closed = True  # from here on the tiers drain: new calls are refused
    finally:
        cascade._release()
