"""The device tier: the engine's KV cache and the GPU↔CPU copies (an asyncio actor).

The KV cache is the engine's own: its canonical int8 views ``(num_gpu_blocks, page_i)``
(:func:`kvcascade.canonical_views` of its KV tensors, any layout that handles, on CUDA or the
CPU), copied to and from directly; block ``b``'s bytes in the primary tier are its pages of every
view in order (view ``i`` at byte ``k × (page_0 + … + page_{i-1})`` of the chunk, its k
sub-blocks after one another). Without views the tier allocates one int8 tensor
``(num_gpu_blocks, gpu_page_bytes)`` itself (CUDA when available, else the CPU standing in for
device memory): the replay's stand-in for an engine. A primary-tier chunk holds
``blocks_per_chunk`` (k) GPU blocks; a transfer pairs GPU blocks with CPU sub-blocks by the copy
plan (docs/device.md; :func:`kvcascade.ops.plan_chunk_copies`) and moves them, every view at once,
with one batched copy (:func:`kvcascade.ops.batch_copy`). The device tier never talks to a
secondary tier.

Two mailboxes, one per direction (stores GPU→CPU, loads CPU→GPU); transfers of one direction
complete in submission order (docs/device.md). Every copy runs on that direction's worker thread,
never on the event-loop thread (issue #15: a copy from pageable memory is synchronous in CUDA,
and the first copies must not wait for the kernel build — they use the fallbacks of
:func:`kvcascade.ops.batch_copy` until the extension has loaded in the background).

* **CUDA**: the host buffer is pinned (:meth:`HostBuffer.pin`; if registration fails it stays
  pageable and copies are synchronous on the worker thread). Each direction has its own side
  stream. On the loop a ``ready`` event is recorded on the compute stream (a store must not read
  KV still being written; a load must not race pending writes into its blocks); the worker
  thread makes the side stream wait for it, enqueues the copy (the same stream orders it after
  the previous transfer of that direction) and records an end event (``blocking=True``: waiting
  sleeps, no spinning). The end event goes to that direction's **event bridge**: one waiter
  thread per direction synchronises its events in submission order and resolves each transfer's
  future with ``call_soon_threadsafe``, so a finished load never waits behind a slow store. No
  thread per transfer, no polling of the loop.
* **CPU** (no GPU): the copy itself is the work, done on the same worker thread (FIFO); the
  awaitable is the same.

A failed or cancelled transfer resolves with ``DeviceTransfer(success=False)``; nothing asserts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._errors import ConfigError, TierUnavailableError
from .._validate import check_int
from ..ops import _build, batch_copy
from ..ops.plan import plan_chunk_copies, plan_descriptors
from ..ops.swap import select_kernel, triton_batch_copy
from .cpu import HostBuffer

log = logging.getLogger(__name__)


@dataclass
class DeviceTransfer:
    """Result of one GPU↔CPU transfer: ``success``, ``bytes`` moved, wall ``seconds``."""

    success: bool
    bytes: int = 0
    seconds: float = 0.0
    error: str | None = None


DIRECTIONS = ("store", "load")


class EventBridge:
    """Turns CUDA events into asyncio futures: one daemon waiter thread (the device tier has one
    per direction).

    :meth:`wait` queues ``(event, future)``; the thread calls ``event.synchronize()`` (events made
    with ``blocking=True`` sleep in the driver) in submission order and resolves the future on
    its loop. Completion latency is one thread wake-up.
    """

    def __init__(self, name: str = "kvcascade-cuda-events") -> None:
        self._queue: queue.SimpleQueue[tuple[Any, asyncio.Future[None]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def wait(self, event: Any) -> asyncio.Future[None]:
        """A future resolved once ``event`` (a ``torch.cuda.Event`` or anything with
        ``synchronize()``) has completed; its exception if synchronising failed."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.put((event, fut))
        return fut

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            event, fut = item
            error: BaseException | None = None
            try:
                event.synchronize()
            except BaseException as exc:  # delivered to the awaiting task
                error = exc
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting
                fut.get_loop().call_soon_threadsafe(_resolve, fut, error)

    def close(self) -> None:
        """Stop the waiter after the events already queued; idempotent."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()


def _resolve(fut: asyncio.Future[None], error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


class DeviceCopier:
    """The GPU↔CPU copy core shared by :class:`DeviceTier` and the vLLM connector's worker side
    (``kvcascade/integrations/vllm.py``): one side stream per direction on CUDA, and one batched
    copy of a transfer's descriptors on it (module docstring).

    Args:
        device: the device of the KV cache; on the CPU there are no streams and a copy is
            synchronous on the calling thread.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._streams = {d: torch.cuda.Stream(device) for d in DIRECTIONS} if self.cuda else {}

    def mark(self) -> torch.cuda.Event | None:
        """On the thread that submits a transfer: an event on its current (compute) stream that
        the copy waits for — a store must not read KV still being written, a load must not race
        pending writes into its blocks. None on the CPU."""
        if not self.cuda:
            return None
        ready = torch.cuda.Event()  # a marker; nothing waits for it here
        ready.record(torch.cuda.current_stream(self.device))
        return ready

    def launch(
        self,
        direction: str,
        descriptors: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        ready: torch.cuda.Event | None,
        triton_page: int | None = None,
    ) -> tuple[int, torch.cuda.Event | None]:
        """On the copy thread: copy ``descriptors`` (``(src_ptr, dst_ptr, size)`` int64 columns of
        :func:`kvcascade.ops.plan.plan_descriptors`) for ``direction`` (``"store"`` GPU→CPU,
        ``"load"`` CPU→GPU). Returns (bytes, end event).

        On CUDA the copy is enqueued on the direction's side stream after ``ready`` (the same
        stream orders it after the previous transfer of that direction) — with Triton when
        ``triton_page`` (the uniform page, bytes) is given, else :func:`kvcascade.ops.batch_copy`,
        loads reading the host rows in any order — and the end event (``blocking=True``: waiting
        for it sleeps) is recorded after it. On the CPU the copy is done when this returns and
        the end event is None. Never waits for the kernel build (the fallbacks copy meanwhile,
        issue #15).

        Raises:
            RuntimeError / ValueError: the copy failed (bad descriptors, a CUDA error).
        """
        if not self.cuda:
            return batch_copy(*descriptors, wait_for_build=False), None
        load = direction == "load"
        stream = self._streams[direction]
        with torch.cuda.device(self.device):
            stream.wait_event(ready)
            if triton_page is not None:
                with torch.cuda.stream(stream):  # many small pages: Triton (docs/device.md)
                    nbytes = triton_batch_copy(*descriptors, triton_page, self.device)
            else:
                nbytes = batch_copy(
                    *descriptors,
                    stream=stream,
                    src_access_any=load,
                    wait_for_build=False,
                    host_side="src" if load else "dst",
                )
            end = torch.cuda.Event(blocking=True)
            end.record(stream)
        return nbytes, end


class DeviceTier:
    """Owner of the device KV cache and its transfers to and from the primary tier.

    Args:
        num_blocks: GPU blocks in the cache (``>= 1``).
        host: the primary tier's buffer; a chunk (row) holds ``blocks_per_chunk`` GPU pages.
        blocks_per_chunk: GPU blocks per primary-tier chunk (k ``>= 1``, docs/device.md); the GPU
            page is ``host.block_bytes // k`` bytes.
        device: torch device of the self-allocated cache; default CUDA when available, else CPU.
        views: the engine's KV cache as canonical views (:func:`kvcascade.canonical_views`):
            int8 ``(num_blocks, page_i)`` tensors with contiguous rows, on one device, their
            pages adding up to the GPU page; None: the tier allocates ``kv`` itself.

    Attributes:
        kv: the self-allocated int8 ``(num_blocks, gpu_page_bytes)`` cache; None with ``views``.
        views: the views copied to and from (``[kv]`` when self-allocated).

    Raises:
        ConfigError: ``num_blocks < 1``, ``blocks_per_chunk`` does not divide the block size, or
            ``views`` that are not such views (the message names the view and what is wrong).
    """

    def __init__(
        self,
        num_blocks: int,
        host: HostBuffer,
        blocks_per_chunk: int = 1,
        device: str | None = None,
        views: Sequence[torch.Tensor] | None = None,
    ) -> None:
        check_int("gpu num_blocks", num_blocks, 1)
        if blocks_per_chunk < 1 or host.block_bytes % blocks_per_chunk:
            raise ConfigError(
                f"blocks_per_chunk={blocks_per_chunk} must be >= 1 and divide the block size "
                f"({host.block_bytes} bytes)"
            )
        self.host = host
        self.blocks_per_chunk = blocks_per_chunk
        self.page_bytes = host.block_bytes // blocks_per_chunk
        self.kv: torch.Tensor | None = None
        if views is not None:
            self.views = _checked_views(views, num_blocks, self.page_bytes, device)
            self.device = self.views[0].device
        else:
            self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
            try:
                self.kv = torch.zeros(
                    (num_blocks, self.page_bytes), dtype=torch.int8, device=self.device
                )
            except (RuntimeError, MemoryError) as exc:
                raise ConfigError(
                    f"cannot allocate the device KV cache: {num_blocks} blocks × "
                    f"{self.page_bytes} B = {num_blocks * self.page_bytes:,} B on {self.device} "
                    f"({exc}); lower gpu_blocks or block_bytes"
                ) from exc
            self.views = [self.kv]
        self._num_blocks = num_blocks
        self._pools = {
            d: concurrent.futures.ThreadPoolExecutor(1, f"kvcascade-{d}") for d in DIRECTIONS
        }
        self._bridges: dict[str, EventBridge] = {}
        self._copier = DeviceCopier(self.device)
        if self._copier.cuda:
            _build.extension_if_ready()  # start building the kernels now, off the hot path
            host.pin()
            self._bridges = {d: EventBridge(f"kvcascade-{d}-events") for d in DIRECTIONS}
        self._closed = False
        self.bytes_stored = 0
        self.bytes_loaded = 0

    @property
    def num_blocks(self) -> int:
        """GPU blocks in the cache."""
        return self._num_blocks

    def _layout(self) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """Per view: the view, its columns of the host rows (its k pages of each chunk), and
        its page bytes.

        Raises:
            ValueError: the views' pages no longer add up to the GPU page (the transfer fails).
        """
        host = self.host.tensor()
        k = self.blocks_per_chunk
        out, offset = [], 0
        for view in self.views:
            page = view.shape[1]
            out.append((view, host[:, offset : offset + k * page], page))
            offset += k * page
        if offset != k * self.page_bytes:
            raise ValueError(f"views hold {offset // k} bytes per block, not {self.page_bytes}")
        return out

    def _descriptors(
        self, plan: Sequence[Any], store: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copy descriptors of ``plan`` over every view and its columns of the host rows."""
        parts = [
            plan_descriptors(plan, view, columns, page, store=store)
            for view, columns, page in self._layout()
        ]
        if len(parts) == 1:
            return parts[0]
        src, dst, sizes = (torch.cat(column) for column in zip(*parts))
        return src, dst, sizes

    async def store(self, gpu_ids: Sequence[int], cpu_slots: Sequence[int]) -> DeviceTransfer:
        """Copy GPU blocks ``gpu_ids[i]`` into primary chunks ``cpu_slots[i]`` (k = 1)."""
        return await self.transfer("store", [len(gpu_ids)], [0], gpu_ids, cpu_slots)

    async def load(self, cpu_slots: Sequence[int], gpu_ids: Sequence[int]) -> DeviceTransfer:
        """Copy primary chunks ``cpu_slots[i]`` into GPU blocks ``gpu_ids[i]`` (k = 1)."""
        return await self.transfer("load", [len(gpu_ids)], [0], gpu_ids, cpu_slots)

    async def transfer(
        self,
        direction: str,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
        gpu_ids: Sequence[int],
        cpu_chunks: Sequence[int],
    ) -> DeviceTransfer:
        """One GPU↔CPU transfer, docs/device.md's copy plan (``GPULoadStoreSpec`` + CPU chunks).

        Args:
            direction: ``"store"`` (GPU→CPU) or ``"load"`` (CPU→GPU).
            group_sizes, block_indices, gpu_ids: as :class:`kvcascade.GPULoadStoreSpec`.
            cpu_chunks: primary-tier chunk ids consumed in order.

        Returns:
            the outcome; a bad plan or a copy error gives ``success=False`` with the reason.

        Raises:
            TierUnavailableError: the tier is closed.
            ValueError: ``direction`` is neither ``"store"`` nor ``"load"``.
        """
        if direction not in ("store", "load"):
            raise ValueError(f"direction must be 'store' or 'load', got {direction!r}")
        if self._closed:
            raise TierUnavailableError("device tier is closed")
        start = time.perf_counter()
        try:
            plan = plan_chunk_copies(
                group_sizes, block_indices, gpu_ids, cpu_chunks, self.blocks_per_chunk
            )
            descriptors = self._descriptors(plan, store=direction == "store")
            ready = self._copier.mark()
            nbytes, end = await asyncio.get_running_loop().run_in_executor(
                self._pools[direction], self._launch, direction, descriptors, ready
            )
            if end is not None:
                await self._bridges[direction].wait(end)
        except (RuntimeError, ValueError) as exc:
            return DeviceTransfer(False, error=f"{type(exc).__name__}: {exc}")
        if direction == "store":
            self.bytes_stored += nbytes
        else:
            self.bytes_loaded += nbytes
        return DeviceTransfer(True, nbytes, time.perf_counter() - start)

    def _launch(
        self,
        direction: str,
        descriptors: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        ready: torch.cuda.Event | None,
    ) -> tuple[int, torch.cuda.Event | None]:
        """Worker thread: one transfer through the copy core, with Triton for many small pages
        (:func:`kvcascade.ops.swap.select_kernel`); returns (bytes, end event or None)."""
        triton_page = None
        if self._copier.cuda:
            # the kernel is chosen on the view of the largest page and its host columns
            view, host, page = max(self._layout(), key=lambda entry: entry[2])
            src, dst = (host, view) if direction == "load" else (view, host)
            if select_kernel(src, dst, len(descriptors[0]), wait_for_build=False) == "triton":
                triton_page = page
        return self._copier.launch(direction, descriptors, ready, triton_page)

    def close(self) -> None:
        """Finish running copies, stop the worker threads and the event bridges; idempotent."""
        self._closed = True
        for pool in self._pools.values():
            pool.shutdown(wait=True)
        for bridge in self._bridges.values():
            bridge.close()


def _checked_views(
    views: Sequence[torch.Tensor], num_blocks: int, page_bytes: int, device: str | None
) -> list[torch.Tensor]:
    """``views`` as a list, checked: int8 ``(num_blocks, page_i)`` with contiguous rows, one
    device (``device`` when given), pages adding up to ``page_bytes``.

    Raises:
        ConfigError: ``views`` is a tensor, not a sequence of them; the first view that is not
            such a view, named by its index.
    """
    if isinstance(views, torch.Tensor):  # list() would split it into its rows
        raise ConfigError(
            f"kv_views must be a list of int8 (num_blocks, page_bytes) tensors "
            f"(kvcascade.canonical_views), got one {views.dtype} {tuple(views.shape)} tensor: "
            "pass [view]"
        )
    out = list(views)
    if not out:
        raise ConfigError("kv_views is empty: give the engine's canonical views")
    for i, view in enumerate(out):
        if not isinstance(view, torch.Tensor) or view.dtype != torch.int8 or view.dim() != 2:
            what = f"{view.dtype} {tuple(view.shape)}" if isinstance(view, torch.Tensor) else view
            raise ConfigError(
                f"kv_views[{i}] must be an int8 (num_blocks, page_bytes) tensor "
                f"(kvcascade.canonical_views), got {what!r}"
            )
        if view.shape[0] != num_blocks:
            raise ConfigError(
                f"kv_views[{i}] has {view.shape[0]} blocks, gpu_blocks is {num_blocks}"
            )
        if view.shape[1] and view.stride(1) != 1:
            raise ConfigError(f"kv_views[{i}]: a block's bytes are not contiguous")
        if view.device != out[0].device:
            raise ConfigError(f"kv_views[{i}] is on {view.device}, kv_views[0] on {out[0].device}")
    if device is not None and torch.device(device) != out[0].device:
        raise ConfigError(f"kv_views are on {out[0].device}, device {device!r} was asked for")
    total = sum(view.shape[1] for view in out)
    if total != page_bytes:
        raise ConfigError(
            f"kv_views hold {total} bytes per block, the GPU page is {page_bytes} bytes "
            "(block_bytes / blocks_per_chunk)"
        )
    return out
