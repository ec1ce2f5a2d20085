"""``KVCascadeConnector``: kvcascade as a vLLM v1 KV connector (``KVConnectorBase_V1``).

Enable it with::

    --kv-transfer-config '{"kv_connector": "KVCascadeConnector",
      "kv_connector_module_path": "kvcascade.integrations.vllm", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"cpu_bytes_to_use": 8000000000}}'

The extra config takes vLLM OffloadingConnector's keys (spec §1.9; ``docs/vllm.md``).
Supported vLLM: ``SUPPORTED_VLLM`` (checked when the connector is built).

Scheduler role: a :class:`~kvcascade.scheduler.OffloadScheduler` decides loads and stores; the
:class:`~kvcascade.TieringCoordinator` and the secondary-tier actors run on an event loop on a
background thread (:class:`~kvcascade.integrations._loop.LoopThread`) over the primary tier's
shared ``/dev/shm`` region; each hook reaches the loop through the portal and waits only for that
bookkeeping call. Worker role: the KV caches are registered as int8 ``(num_blocks, page_bytes)``
views, the worker maps the same region, and copies run on one thread per direction (stores
deferred to the next step's start, spec §5.1). Hooks never raise on a tier or transfer failure: a
failed load is reported through ``failed_recving`` and vLLM recomputes the request (with
``kv_load_failure_policy: "recompute"``; vLLM's default ``"fail"`` fails the request instead).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

try:
    import vllm
    from packaging.version import Version
    from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorTransferResults,
        KVConnectorWorkerMetadata,
        SupportsHMA,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        build_offloading_config,
    )
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        SlidingWindowSpec,
        group_kernel_blocks,
    )
    from vllm.v1.request import RequestStatus
except ImportError as exc:  # pragma: no cover - exercised only without vLLM
    raise ImportError(
        "kvcascade.integrations.vllm needs vLLM (pip install 'kvcascade[vllm]')"
    ) from exc

from .._config import CascadeConfig
from .._types import CPULoadStoreSpec, ReqContext
from ..coordinator import TieringCoordinator
from ..index.cpu import CPUOffloadingManager
from ..ops import batch_copy, plan_chunk_copies, plan_descriptors
from ..policies.registry import resolve_cache_policy
from ..scheduler import (
    GroupSpec,
    OffloadScheduler,
    ScheduledRequest,
    SchedulerConfig,
    StepInput,
    StepPlan,
    TransferSpec,
)
from ..tiers._file_mapper import default_identity
from ..tiers.base import SecondaryTier
from ..tiers.registry import TierContext, create_secondary_tier
from ..tiers.shm import SharedOffloadRegion, region_geometry
from ..views import block_views
from ._loop import LoopThread

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

#: vLLM releases this adapter is written and tested against: ``[low, high)``.
SUPPORTED_VLLM = ("0.32", "0.33")
_SPECS = ("CPUOffloadingSpec", "TieringOffloadingSpec")


def check_vllm_version(version: str) -> None:
    """Raise a clear error when ``version`` is outside :data:`SUPPORTED_VLLM`.

    Raises:
        RuntimeError: unsupported vLLM version (the message names the supported range).
    """
    low, high = (Version(v) for v in SUPPORTED_VLLM)
    if not low <= Version(Version(version).base_version) < high:
        raise RuntimeError(
            f"kvcascade's vLLM connector supports vllm>={SUPPORTED_VLLM[0]},<{SUPPORTED_VLLM[1]}; "
            f"found vllm {version}. Install a supported vLLM or a kvcascade release for yours."
        )


# -- metadata --------------------------------------------------------------------------------
@dataclass
class KVCascadeMetadata(KVConnectorMetadata):
    """Scheduler → workers, once per step: the step's :class:`~kvcascade.scheduler.StepPlan`."""

    load_jobs: dict[int, TransferSpec]
    store_jobs: dict[int, TransferSpec]
    jobs_to_flush: set[int]


@dataclass
class KVCascadeWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers → scheduler: ``completed[job]`` = workers that finished it; ``failed`` = jobs
    some worker failed; bytes and seconds of finished transfers per direction."""

    completed: dict[int, int] = field(default_factory=dict)
    failed: set[int] = field(default_factory=set)
    load_bytes: int = 0
    store_bytes: int = 0
    load_seconds: float = 0.0
    store_seconds: float = 0.0

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Sum counts per job id, union failures, add transfer totals."""
        assert isinstance(other, KVCascadeWorkerMetadata)
        completed = dict(self.completed)
        for job_id, n in other.completed.items():
            completed[job_id] = completed.get(job_id, 0) + n
        return KVCascadeWorkerMetadata(
            completed,
            self.failed | other.failed,
            self.load_bytes + other.load_bytes,
            self.store_bytes + other.store_bytes,
            self.load_seconds + other.load_seconds,
            self.store_seconds + other.store_seconds,
        )


# -- configuration -------------------------------------------------------------------------------
@dataclass
class _Setup:
    """Everything both roles derive from vLLM's configuration (spec §1.8, §1.9)."""

    extra: dict[str, Any]
    scheduler: SchedulerConfig
    group_ids: tuple[int, ...]
    layer_names: tuple[tuple[str, ...], ...]
    instance_id: str
    rank: int
    world_size: int
    num_cpu_blocks: int
    cpu_page_size: int
    block_bytes: int
    model_name: str
    dtype: str
    tokens_per_hash: int


def _group_spec(spec: Any, tokens_per_chunk: int, tokens_per_block: int) -> GroupSpec:
    if isinstance(spec, SlidingWindowSpec):
        return GroupSpec(tokens_per_block, math.ceil(spec.sliding_window / tokens_per_chunk))
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return GroupSpec(tokens_per_block, math.ceil(spec.attention_chunk_size / tokens_per_chunk))
    if isinstance(spec, FullAttentionSpec):
        return GroupSpec(tokens_per_block)
    raise ValueError(
        f"kvcascade's connector does not offload {type(spec).__name__} KV-cache groups "
        "(Mamba/recurrent state is not supported)"
    )


def _setup(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> _Setup:
    """Validate the extra config with OffloadingConnector's rules and derive the geometry.

    Raises:
        ValueError: unsupported ``spec_name``, ``secondary_tiers`` not a list or given to the CPU
            spec, ``store_threshold >= 2``, an unknown cache policy, ``blocks_per_chunk`` /
            ``block_size`` conflicts (vLLM's messages), a non-attention group.
        ConfigError: ``cpu_bytes_to_use`` missing or invalid, unknown keys, a bad tier config.
    """
    kv_transfer_config = vllm_config.kv_transfer_config
    assert kv_transfer_config is not None
    extra = dict(kv_transfer_config.kv_connector_extra_config or {})
    spec_name = extra.get("spec_name", "CPUOffloadingSpec")
    if spec_name not in _SPECS:
        raise ValueError(f"Unsupported spec type {spec_name!r}; kvcascade accepts {_SPECS}")
    tiers = extra.get("secondary_tiers", [])
    if not isinstance(tiers, list):
        raise ValueError(f"secondary_tiers must be a list, got {tiers!r}")
    if tiers and spec_name != "TieringOffloadingSpec":
        raise ValueError("secondary_tiers needs spec_name 'TieringOffloadingSpec'")
    if int(extra.get("store_threshold", 0)) >= 2:
        raise ValueError("store_threshold >= 2 (reuse filtering) is not supported by kvcascade")
    resolve_cache_policy(extra.get("eviction_policy", "lru"), extra.get("cache_policy_module_path"))
    offload = build_offloading_config(vllm_config, kv_cache_config)
    k = offload.cache.blocks_per_chunk
    par = offload.parallel
    geometry = region_geometry(
        extra.get("cpu_bytes_to_use"), offload.worker_kv_bytes_per_block, par.world_size, k
    )
    groups = []
    for g in offload.groups:
        spec = kv_cache_config.kv_cache_groups[g.group_id].kv_cache_spec
        groups.append(_group_spec(spec, g.tokens_per_block * k, g.tokens_per_block))
    full_chunks = {
        g.tokens_per_block * k for g, s in zip(offload.groups, groups) if s.window_chunks is None
    }
    if len(full_chunks) == 1:
        (a_tokens,) = full_chunks
        for i, (g, s) in enumerate(zip(offload.groups, groups)):
            t = g.tokens_per_block * k
            if s.window_chunks is not None and t < a_tokens and s.window_chunks < a_tokens // t:
                groups[i] = GroupSpec(s.tokens_per_block, s.window_chunks, a_tokens // t)
    scheduler = SchedulerConfig(
        tuple(groups),
        offload.cache.tokens_per_hash,
        k,
        par.world_size,
        bool(extra.get("offload_prompt_only", True)),
        bool(vllm_config.cache_config.enable_prefix_caching),
    )
    return _Setup(
        extra,
        scheduler,
        tuple(g.group_id for g in offload.groups),
        tuple(g.layer_names for g in offload.groups),
        offload.engine_id.replace("/", "_"),
        par.rank,
        par.world_size,
        geometry.num_blocks,
        geometry.cpu_page_size,
        geometry.block_bytes,
        offload.model.name,
        offload.model.dtype,
        offload.cache.tokens_per_hash,
    )


# -- scheduler side ----------------------------------------------------------------------------
class _RequestView:
    """A vLLM ``Request`` seen as :class:`kvcascade.scheduler.RequestView` (live values)."""

    __slots__ = ("_req",)

    def __init__(self, req: Request) -> None:
        self._req = req

    @property
    def request_id(self) -> str:
        return self._req.request_id

    @property
    def num_tokens(self) -> int:
        return self._req.num_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return self._req.num_prompt_tokens

    @property
    def num_computed_tokens(self) -> int:
        return self._req.num_computed_tokens

    @property
    def block_hashes(self) -> list[bytes]:
        return self._req.block_hashes  # type: ignore[return-value]

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None:
        return self._req.kv_transfer_params

    @property
    def skip_reading_prefix_cache(self) -> bool:
        return bool(self._req.skip_reading_prefix_cache)

    @property
    def finished(self) -> bool:
        return self._req.is_finished()

    @property
    def aborted(self) -> bool:
        return self._req.status == RequestStatus.FINISHED_ABORTED


class _PortalManager:
    """The coordinator's synchronous hooks, each run on the loop thread through the portal."""

    def __init__(self, loop: LoopThread) -> None:
        self._loop = loop
        self._coord = loop.coordinator

    def lookup(self, key: bytes, ctx: ReqContext) -> Any:
        return self._loop.call(self._coord.lookup, key, ctx)

    def prepare_load(self, keys: Any, ctx: ReqContext) -> CPULoadStoreSpec:
        return self._loop.call(self._coord.prepare_load, keys, ctx)

    def touch(self, keys: Any, ctx: ReqContext | None = None) -> None:
        self._loop.call(self._coord.touch, keys, ctx)

    def complete_load(self, keys: Any, ctx: ReqContext) -> None:
        self._loop.call(self._coord.complete_load, keys, ctx)

    def prepare_store(self, keys: Any, ctx: ReqContext) -> Any:
        return self._loop.call(self._coord.prepare_store, keys, ctx)

    def complete_store(self, keys: Any, ctx: ReqContext, success: bool = True) -> None:
        self._loop.call(self._coord.complete_store, keys, ctx, success)

    def on_new_request(self, ctx: ReqContext) -> Any:
        return self._loop.call(self._coord.on_new_request, ctx)

    def on_request_finished(self, ctx: ReqContext) -> None:
        self._loop.call(self._coord.on_request_finished, ctx)

    def on_schedule_end(self, ctx: Any) -> None:
        self._loop.call(self._coord.on_schedule_end, ctx)

    def has_pending_work(self) -> bool:
        return self._loop.call(self._coord.has_pending_work)

    def take_events(self) -> list[Any]:
        return self._loop.call(lambda: list(self._coord.take_events()))

    def reset_cache(self) -> None:
        self._loop.run(self._coord.reset_cache)


def _build_tiers(setup: _Setup, region: SharedOffloadRegion) -> Any:
    """The coordinator factory run on the loop thread (primary over the region + tiers)."""
    config = CascadeConfig.from_extra_config(
        setup.extra,
        cpu_blocks=setup.num_cpu_blocks,
        block_bytes=setup.block_bytes,
        model_name=setup.model_name,
    )

    def build() -> tuple[TieringCoordinator, list[SecondaryTier]]:
        identity = default_identity(
            model_name=setup.model_name,
            dtype=setup.dtype,
            tokens_per_block=[g.tokens_per_block for g in setup.scheduler.groups],
            tokens_per_hash=setup.tokens_per_hash,
            blocks_per_chunk=setup.scheduler.blocks_per_chunk,
            layer_names=setup.layer_names,
            tp_size=setup.world_size,
        )
        ctx = TierContext(region, identity)  # type: ignore[arg-type]
        tiers: list[SecondaryTier] = []
        try:
            for tier_cfg in config.secondary_tiers:
                tiers.append(create_secondary_tier(tier_cfg, ctx))
        except BaseException:
            for tier in tiers:
                tier.close()
            raise
        primary = CPUOffloadingManager(
            config.num_cpu_blocks, config.eviction_policy, enable_events=config.enable_events
        )
        coord = TieringCoordinator(
            primary, tiers, pending_write_timeout_s=config.pending_write_timeout_s
        )
        return coord, tiers

    return build


class _SchedulerSide:
    def __init__(self, setup: _Setup) -> None:
        self.setup = setup
        self.region = SharedOffloadRegion(
            setup.instance_id,
            setup.num_cpu_blocks,
            setup.cpu_page_size,
            setup.world_size,
            None,
            expected_participants=setup.world_size + 1,
        )
        try:
            self.loop = LoopThread(_build_tiers(setup, self.region))
        except BaseException:
            self.region.cleanup()
            raise
        self.sched = OffloadScheduler(setup.scheduler, _PortalManager(self.loop))
        self.transfer_totals = KVCascadeWorkerMetadata()

    def close(self) -> None:
        self.loop.close()
        self.region.cleanup()


# -- worker side -------------------------------------------------------------------------------
@dataclass
class _LayerViews:
    gpu: torch.Tensor  # int8 (num_gpu_blocks, page) over the layer's cache
    cpu: torch.Tensor  # int8 (num_cpu_chunks, page × k) in this worker's slot of the region
    page: int


@dataclass
class _Running:
    job_id: int
    req_id: str | None  # set for loads
    future: concurrent.futures.Future[tuple[int, float]]


class _WorkerSide:
    """Registered views, the region, two copy threads (one per direction; on CUDA each with its
    own side stream) and the completion bookkeeping."""

    def __init__(self, setup: _Setup, kv_cache_config: KVCacheConfig) -> None:
        self.setup = setup
        self.kv_cache_config = kv_cache_config
        self.region: SharedOffloadRegion | None = None
        self.groups: list[list[_LayerViews]] = []
        self.device = torch.device("cpu")
        self._stores = concurrent.futures.ThreadPoolExecutor(1, "kvcascade-d2h")
        self._loads = concurrent.futures.ThreadPoolExecutor(1, "kvcascade-h2d")
        self._queued: list[tuple[int, TransferSpec]] = []
        self._flushed: set[int] = set()
        self._running: list[_Running] = []
        self._meta = KVCascadeWorkerMetadata()
        self.load_failed_blocks: set[int] = set()
        self._streams: dict[bool, torch.cuda.Stream] = {}

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        setup = self.setup
        num_blocks = self.kv_cache_config.num_blocks
        self.region = SharedOffloadRegion(
            setup.instance_id,
            setup.num_cpu_blocks,
            setup.cpu_page_size,
            setup.world_size,
            setup.rank,
            expected_participants=setup.world_size + 1,
        )
        k = setup.scheduler.blocks_per_chunk
        seen: dict[tuple[int, int], torch.Tensor] = {}
        for gid in setup.group_ids:
            group = self.kv_cache_config.kv_cache_groups[gid]
            views: list[_LayerViews] = []
            for name in group.layer_names:
                ref = group_kernel_blocks(kv_caches[name], num_blocks)
                self.device = ref.device
                ident = (ref.data_ptr(), ref.stride(0))
                if ident in seen:  # layers sharing one tensor share its bytes
                    continue
                (gpu,) = block_views(ref)  # zero-copy int8 (num_blocks, page), spec §1.6
                page = gpu.shape[1]
                seen[ident] = gpu
                views.append(_LayerViews(gpu, self.region.create_next_worker_view(page * k), page))
            self.groups.append(views)
        if self.device.type == "cuda":  # one side stream per direction (one copy thread each)
            self._streams = {store: torch.cuda.Stream(self.device) for store in (True, False)}

    # copies (run on the copy threads) ------------------------------------------------------------
    def _copy(
        self, spec: TransferSpec, store: bool, ready: torch.cuda.Event | None
    ) -> tuple[int, float]:
        """Copy one job's blocks of every layer (spec §5.3 plan) as one batch of descriptors.

        On CUDA the batch is enqueued on this direction's side stream after ``ready`` (recorded
        on the compute stream when the job was submitted: a store must not read KV still being
        written, a load must not race pending writes into its blocks), and this copy thread —
        never the forward pass — waits for it. Loads let the driver read the host rows out of
        stream order (spec §5.4 "ANY"). Returns (bytes, seconds)."""
        if spec.cpu is None:
            raise RuntimeError("load job without a source (prepare_load failed)")
        start = time.perf_counter()
        k = self.setup.scheduler.blocks_per_chunk
        gpu_ids = spec.gpu.block_ids.tolist()
        cpu_ids = spec.cpu.block_ids.tolist()
        parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        g_pos = c_pos = 0
        for views, n, bi in zip(self.groups, spec.gpu.group_sizes, spec.gpu.block_indices):
            if n == 0:
                continue
            chunks = -(-(n + bi % k) // k)
            plan = plan_chunk_copies(
                [n], [bi], gpu_ids[g_pos : g_pos + n], cpu_ids[c_pos : c_pos + chunks], k
            )
            g_pos += n
            c_pos += chunks
            parts += [plan_descriptors(plan, lv.gpu, lv.cpu, lv.page, store=store) for lv in views]
        if not parts:
            return 0, time.perf_counter() - start
        src, dst, sizes = (torch.cat(column) for column in zip(*parts))
        # wait_for_build=False: until the kernels are built (in the background) the copies use
        # batch_copy's fallbacks — a compile never holds up a store (issue #15).
        if ready is None:
            total = batch_copy(src, dst, sizes, wait_for_build=False)
        else:
            stream = self._streams[store]
            stream.wait_event(ready)
            total = batch_copy(
                src,
                dst,
                sizes,
                stream=stream,
                src_access_any=not store,
                wait_for_build=False,
                host_side="dst" if store else "src",
            )
            done = torch.cuda.Event(blocking=True)  # the waiting thread sleeps in the driver
            done.record(stream)
            done.synchronize()
        return total, time.perf_counter() - start

    # step hooks --------------------------------------------------------------------------------
    def _submit(self, job_id: int, spec: TransferSpec, store: bool) -> None:
        ready = None
        if self.device.type == "cuda":  # a marker on the compute stream; nothing waits here
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        pool = self._stores if store else self._loads
        fut = pool.submit(self._copy, spec, store, ready)
        self._running.append(_Running(job_id, None if store else spec.req_id, fut))

    def _submit_queued(self) -> None:
        queued, self._queued = self._queued, []
        for job_id, spec in queued:
            self._submit(job_id, spec, store=True)

    def start(self, meta: KVCascadeMetadata) -> None:
        self._submit_queued()
        for job_id, spec in meta.load_jobs.items():
            self._submit(job_id, spec, store=False)

    def queue_stores(self, meta: KVCascadeMetadata) -> None:
        for job_id, spec in meta.store_jobs.items():
            if job_id not in self._flushed:
                self._queued.append((job_id, spec))
        self._flushed.clear()

    def flush(self, meta: KVCascadeMetadata) -> None:
        flush = meta.jobs_to_flush
        if not flush:
            return
        for job_id in flush & set(meta.store_jobs):
            self._queued.append((job_id, meta.store_jobs[job_id]))
            self._flushed.add(job_id)
        self._submit_queued()
        waits = [r.future for r in self._running if r.job_id in flush]
        concurrent.futures.wait(waits)

    def finished(self) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults()
        still: list[_Running] = []
        for run in self._running:
            if not run.future.done():
                still.append(run)
                continue
            self._meta.completed[run.job_id] = 1
            exc = run.future.exception()
            if exc is not None:
                log.warning("kvcascade transfer %d failed: %r", run.job_id, exc)
                self._meta.failed.add(run.job_id)
            else:
                nbytes, seconds = run.future.result()
                if run.req_id is None:
                    self._meta.store_bytes += nbytes
                    self._meta.store_seconds += seconds
                else:
                    self._meta.load_bytes += nbytes
                    self._meta.load_seconds += seconds
            if run.req_id is not None:
                out.finished_recving.add(run.req_id)
                if exc is not None:
                    out.failed_recving.add(run.req_id)
        self._running = still
        return out

    def take_meta(self) -> KVCascadeWorkerMetadata | None:
        meta, self._meta = self._meta, KVCascadeWorkerMetadata()
        return meta if meta.completed else None

    def close(self) -> None:
        concurrent.futures.wait([r.future for r in self._running])
        self._stores.shutdown(wait=True)
        self._loads.shutdown(wait=True)
        self.groups = []
        if self.region is not None:
            self.region.cleanup()


# -- the connector -------------------------------------------------------------------------------
class KVCascadeConnector(KVConnectorBase_V1, SupportsHMA):
    """kvcascade's GPU → CPU → secondary-tier offload as a vLLM v1 KV connector.

    Constructed by vLLM once per role: ``(vllm_config, role, kv_cache_config)``.

    Raises (at construction):
        RuntimeError: unsupported vLLM version.
        ValueError / ConfigError: a bad ``kv_connector_extra_config`` (see ``_setup``).
    """

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        check_vllm_version(vllm.__version__)
        super().__init__(vllm_config, role, kv_cache_config)
        setup = _setup(vllm_config, kv_cache_config)
        self._setup = setup
        self._sched_side: _SchedulerSide | None = None
        self._worker_side: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched_side = _SchedulerSide(setup)
        else:
            self._worker_side = _WorkerSide(setup, kv_cache_config)

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a dropped store is a future miss, never lost data."""
        return False

    @property
    def scheduler(self) -> OffloadScheduler:
        """The scheduler-side rules (scheduler role only)."""
        assert self._sched_side is not None
        return self._sched_side.sched

    @property
    def coordinator(self) -> TieringCoordinator:
        """The coordinator on the loop thread (call it only through :meth:`call_on_loop`)."""
        assert self._sched_side is not None
        return self._sched_side.loop.coordinator

    def call_on_loop(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` on the coordinator's loop thread (metrics, tests)."""
        assert self._sched_side is not None
        return self._sched_side.loop.call(fn, *args)

    # -- scheduler hooks ----------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        self.scheduler.on_new_request(_RequestView(request))

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        sched = self.scheduler
        try:
            if not sched.is_tracked(request.request_id):
                sched.on_new_request(_RequestView(request))
            return sched.get_num_new_matched_tokens(request.request_id, num_computed_tokens)
        except Exception:
            log.exception("kvcascade lookup failed for %s; treating as a miss", request.request_id)
            return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        group_blocks = [
            [(b.block_id, b.block_hash is not None) for b in blocks.blocks[gid]]
            for gid in self._setup.group_ids
        ]
        self.scheduler.update_state_after_alloc(
            request.request_id, group_blocks, num_external_tokens
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVCascadeMetadata:
        gids = self._setup.group_ids
        scheduled = [
            ScheduledRequest(
                req_id, None if ids is None else [ids[g] for g in gids], resumed=resumed
            )
            for req_id, ids, resumed in yield_req_data(scheduler_output)
        ]
        step = StepInput(
            scheduled,
            scheduler_output.num_scheduled_tokens,
            scheduler_output.finished_req_ids or (),
            scheduler_output.preempted_req_ids or (),
            [r.req_id for r in scheduler_output.scheduled_new_reqs],
            [c.dst_block_id for c in scheduler_output.kv_cache_block_copies or ()],
        )
        try:
            plan = self.scheduler.build_step(step)
        except Exception:
            log.exception("kvcascade: building the step's transfers failed; none this step")
            plan = StepPlan()
        return KVCascadeMetadata(plan.load_jobs, plan.store_jobs, plan.jobs_to_flush)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, KVCascadeWorkerMetadata):
            return
        assert self._sched_side is not None
        self._sched_side.transfer_totals = self._sched_side.transfer_totals.aggregate(
            KVCascadeWorkerMetadata(
                {}, set(), meta.load_bytes, meta.store_bytes, meta.load_seconds, meta.store_seconds
            )
        )  # type: ignore[assignment]
        try:
            self.scheduler.on_jobs_finished(meta.completed, meta.failed)
        except Exception:
            log.exception("kvcascade: applying transfer results failed")

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        try:
            self.scheduler.request_finished(request.request_id)
        except Exception:
            log.exception("kvcascade: request_finished failed for %s", request.request_id)
        return False, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, [])

    def has_pending_push_work(self) -> bool:
        try:
            return self.scheduler.has_pending_work()
        except Exception:
            log.exception("kvcascade: has_pending_work failed")
            return False

    def take_events(self) -> Iterable[Any]:
        """Offload events are drained (kept bounded) but not published to vLLM's KV-event stream
        in this version; see ``docs/vllm.md``."""
        if self._sched_side is not None:
            with contextlib.suppress(Exception):
                self.scheduler.take_events()
        return ()

    def reset_cache(self) -> bool | None:
        """Drop all offload state (spec §6.11); waits for the tiers to drain."""
        self.scheduler.reset_cache()
        return True

    def transfer_stats(self) -> dict[str, float]:
        """Scheduler counters and worker transfer totals, flat (see ``docs/vllm.md``)."""
        assert self._sched_side is not None
        s = self.scheduler.stats
        t = self._sched_side.transfer_totals
        return {
            "loads": s.loads,
            "stores": s.stores,
            "loaded_chunks": s.loaded_chunks,
            "stored_chunks": s.stored_chunks,
            "failed_loads": s.failed_loads,
            "failed_stores": s.failed_stores,
            "allocation_failures": s.allocation_failures,
            "load_prepare_failures": s.load_prepare_failures,
            "lookup_sync_seconds": s.lookup_sync_seconds,
            "load_bytes": t.load_bytes,
            "store_bytes": t.store_bytes,
            "load_seconds": t.load_seconds,
            "store_seconds": t.store_seconds,
        }

    # -- worker hooks -------------------------------------------------------------------------
    @property
    def _worker(self) -> _WorkerSide:
        assert self._worker_side is not None
        return self._worker_side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, KVCascadeMetadata)
        self._worker.flush(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVCascadeMetadata)
        self._worker.start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVCascadeMetadata)
        self._worker.queue_stores(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._worker.finished()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        results = self._worker.finished()
        return results.finished_sending, results.finished_recving

    def build_connector_worker_meta(self) -> KVCascadeWorkerMetadata | None:
        if self._worker_side is None:
            return None
        return self._worker_side.take_meta()

    def shutdown(self) -> None:
        if self._worker_side is not None:
            self._worker_side.close()
        if self._sched_side is not None:
            self._sched_side.close()
