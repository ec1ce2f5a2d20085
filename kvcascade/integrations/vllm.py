"""``KVCascadeConnector``: kvcascade as a vLLM v1 KV connector (``KVConnectorBase_V1``).

Enable it with::

    --kv-transfer-config '{"kv_connector": "KVCascadeConnector",
      "kv_connector_module_path": "kvcascade.integrations.vllm", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"cpu_bytes_to_use": 8000000000}}'

The extra config takes vLLM OffloadingConnector's keys (``offloading/config.py``; ``docs/vllm.md``).
Supported vLLM: ``SUPPORTED_VLLM`` (checked when the connector is built).

Scheduler role: a :class:`~kvcascade.scheduler.OffloadScheduler` decides loads and stores; it,
the :class:`~kvcascade.TieringCoordinator` and the secondary-tier actors run on an event loop on
a background thread (:class:`~kvcascade.integrations._loop.LoopThread`) over the primary tier's
shared ``/dev/shm`` region; each hook is at most one call through the portal, which waits only
for that bookkeeping (never for I/O). Worker role: the KV caches are registered as int8
``(num_blocks, page_bytes)`` views, the worker maps the same region, and copies run on one
thread per direction (stores deferred to the next step's start, as vLLM's
``offloading/worker.py``). Hooks never raise on a
tier or transfer failure: a failed load is reported through ``failed_recving`` and vLLM
recomputes the request (with ``kv_load_failure_policy: "recompute"``; vLLM's default ``"fail"``
fails the request instead).

For routers and operators (``docs/vllm.md``): the tiers' events go to vLLM's KV-event stream
(``take_events``, :mod:`._vllm_events`), the statistics to vLLM's ``/metrics``
(``get_kv_connector_stats`` / ``build_prom_metrics``, :mod:`._vllm_metrics`), and a request's
hints (``kv_transfer_params``, vLLM 0.33's ``kv_hints``) to :class:`~kvcascade.SessionHint`.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.thread  # registers its exit hook before ours (see _close_at_exit)
import functools
import hashlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

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
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
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

from .._config import CascadeConfig, check_vllm_keys, spec_name_of
from .._errors import ConfigError
from .._lifecycle import build_coordinator
from ..coordinator import TieringCoordinator
from ..hints import with_envelope_hint
from ..ops import plan_chunk_copies, plan_descriptors
from ..policies.registry import resolve_cache_policy
from ..scheduler import (
    BlockEvent,
    GroupSpec,
    OffloadScheduler,
    ScheduledRequest,
    SchedulerConfig,
    StepInput,
    StepPlan,
    TransferSpec,
)
from ..tiers._file_mapper import default_identity
from ..tiers.device import DeviceCopier
from ..tiers.shm import SharedOffloadRegion, region_geometry
from ..views import block_views
from ._loop import LoopThread
from ._vllm_events import vllm_kv_events
from ._vllm_metrics import KVCascadePromMetrics, StatsDeltas

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

#: vLLM releases this adapter is written and tested against: ``[low, high)``.
SUPPORTED_VLLM = ("0.32", "0.34")


def _log_through_vllm() -> None:
    """Give the ``kvcascade`` logger the handlers and level of vLLM's ``vllm`` logger
    (``vllm/logger.py``'s default config, which does not propagate), so kvcascade's lines reach
    the engine's log formatted as vLLM's own: the INFO ``tiers ready`` line
    (docs/operators.md), warnings with their process prefix. Without it only warnings reached
    stderr, bare (Python's last-resort handler). Nothing changes when the application set up
    logging itself (a handler on ``kvcascade`` or on the root logger) or vLLM did not
    (``VLLM_CONFIGURE_LOGGING=0``)."""
    ours, theirs = logging.getLogger("kvcascade"), logging.getLogger("vllm")
    if ours.handlers or logging.getLogger().handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(theirs.level)
    ours.propagate = False


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
    """Everything both roles derive from vLLM's configuration (as ``build_offloading_config``)."""

    extra: dict[str, Any]
    scheduler: SchedulerConfig
    group_ids: tuple[int, ...]
    instance_id: str
    rank: int
    world_size: int
    num_cpu_blocks: int
    cpu_page_size: int
    block_bytes: int
    model_name: str
    identity: dict[str, Any]


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


#: Keys of the HF config that name where or by which library it was written, never what the
#: model computes; left out of ``hf_config_sha256`` so that a copy of a model shares its KV.
_HF_CONFIG_VOLATILE = ("_name_or_path", "transformers_version", "_commit_hash")


def _jsonable(value: Any) -> Any:
    """``value`` as JSON-able data that is the same in every process (a callable by its name)."""
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', '?')}"
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def _namespace_identity(
    vllm_config: VllmConfig,
    offload: Any,
    kv_cache_config: KVCacheConfig,
    block_bytes: int,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """The namespace identity of the secondary tiers, from the engine's own configuration.

    Two engines share KV files iff these fields are equal (``docs/vllm.md`` lists them and what
    a change does): the model (``model``, ``model_revision``, ``model_name`` from the extra
    config or the model), ``model_dtype`` and the resolved KV ``dtype``/``kv_cache_dtype``, the
    KV layout vLLM resolved (``CacheConfig.kv_cache_layout``, ``vllm/v1/kv_cache_layout.py``),
    tokens per block / hash and ``blocks_per_file``, tp/pp/pcp/dcp sizes and ``world_size``
    (a row holds every worker's slot in rank order), ``block_bytes``, ``quantization``,
    ``hf_overrides``, ``max_position_embeddings``, ``rope`` and a digest of the whole HF text
    config (every field that changes what the model computes), and the top-level
    ``cache_salt``. A tier's own ``cache_salt`` is folded in by the tier
    (:meth:`~kvcascade.tiers._file_mapper.FileMapper.with_salt`).

    Raises:
        RuntimeError: vLLM has not resolved the KV cache layout yet.
    """
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    par = vllm_config.parallel_config
    layout = cache.kv_cache_layout or kv_cache_config.kv_cache_layout
    if layout is None:  # resolved by the engine core before any connector is built
        raise RuntimeError("vLLM has not resolved the KV cache layout (kv_cache_layout is None)")
    hf = model.hf_text_config.to_dict()
    rope = hf.get("rope_parameters") or {
        k: hf[k] for k in ("rope_scaling", "rope_theta") if hf.get(k) is not None
    }
    digest_fields = {k: v for k, v in hf.items() if k not in _HF_CONFIG_VOLATILE}
    hf_digest = hashlib.sha256(
        json.dumps(digest_fields, sort_keys=True, default=str).encode()
    ).hexdigest()
    return default_identity(
        model_name=extra.get("model_name") or model.model,
        dtype=offload.model.dtype,
        tokens_per_block=[g.tokens_per_block for g in offload.groups],
        tokens_per_hash=offload.cache.tokens_per_hash,
        blocks_per_chunk=offload.cache.blocks_per_chunk,
        layer_names=[g.layer_names for g in offload.groups],
        tp_size=par.tensor_parallel_size,
        pp_size=par.pipeline_parallel_size,
        pcp_size=par.prefill_context_parallel_size,
        dcp_size=par.decode_context_parallel_size,
        kv_layout=layout,
        model_revision=model.revision,
        cache_salt=extra.get("cache_salt"),
        model=model.model,
        model_dtype=str(model.dtype).removeprefix("torch."),
        kv_cache_dtype=cache.cache_dtype,
        world_size=par.world_size,
        block_bytes=block_bytes,
        quantization=model.quantization,
        hf_overrides=_jsonable(model.hf_overrides),
        max_position_embeddings=hf.get("max_position_embeddings"),
        rope=_jsonable(rope),
        hf_config_sha256=hf_digest,
    )


#: ``CascadeConfig`` keys a vLLM engine sets itself (``_build_tiers``); refused in the extra config.
_ENGINE_DERIVED_KEYS = frozenset({"cpu_blocks", "gpu_blocks", "block_bytes"})


def _setup(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> _Setup:
    """Validate the extra config with OffloadingConnector's rules and derive the geometry.

    Raises:
        ValueError: unsupported ``spec_name``, ``secondary_tiers`` not a list or given to the CPU
            spec, an unknown cache policy, a non-attention group.
        ConfigError: a vLLM key of the wrong type or range (``block_size`` /
            ``blocks_per_chunk`` conflicts, ``store_threshold`` not an int or ``>= 2``:
            :func:`kvcascade._config.check_vllm_keys`), ``cpu_bytes_to_use`` missing or
            invalid, unknown keys, a key the engine sets itself (``cpu_blocks``,
            ``gpu_blocks``, ``block_bytes``), a bad tier config.
    """
    kv_transfer_config = vllm_config.kv_transfer_config
    assert kv_transfer_config is not None
    extra = dict(kv_transfer_config.kv_connector_extra_config or {})
    spec_name = spec_name_of(extra)
    tiers = extra.get("secondary_tiers", [])
    if not isinstance(tiers, list):
        raise ValueError(f"secondary_tiers must be a list, got {tiers!r}")
    if tiers and spec_name != "TieringOffloadingSpec":
        raise ValueError("secondary_tiers needs spec_name 'TieringOffloadingSpec'")
    check_vllm_keys(extra)  # before any of them is read (a cast of store_threshold named none)
    derived = sorted(set(extra) & _ENGINE_DERIVED_KEYS)
    if derived:  # from_extra_config's overrides would replace them without a word
        raise ConfigError(
            f"kv_connector_extra_config keys {derived} are derived by the connector from the "
            "engine (the CPU tier's size from cpu_bytes_to_use, the block from the KV cache "
            "geometry); remove them"
        )
    resolve_cache_policy(
        extra.get("eviction_policy", CascadeConfig.eviction_policy),
        extra.get("cache_policy_module_path"),
    )
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
        offload.engine_id.replace("/", "_"),
        par.rank,
        par.world_size,
        geometry.num_blocks,
        geometry.cpu_page_size,
        geometry.block_bytes,
        offload.model.name,
        _namespace_identity(vllm_config, offload, kv_cache_config, geometry.block_bytes, extra),
    )


# -- engines in this process --------------------------------------------------------------------
#: The open scheduler and worker sides of this process, by engine (instance id).
_LOCAL_SCHEDULERS: dict[str, _SchedulerSide] = {}
_LOCAL_WORKERS: dict[str, _WorkerSide] = {}


def _close_at_exit() -> None:
    """Close every engine side still open when the interpreter exits (an offline script that
    never closes its ``LLM``), workers first so their last stores reach the scheduler side.

    Registered with ``threading``'s exit hooks, which run before ``concurrent.futures``
    refuses new work (its own hook, registered earlier, runs later) and before daemon threads
    such as the loop are abandoned; vLLM's own finalizer (``atexit``) comes after that, too
    late for the tiers' executors (``cannot schedule new futures after interpreter shutdown``).
    """
    for side in [*_LOCAL_WORKERS.values(), *_LOCAL_SCHEDULERS.values()]:
        try:
            side.close()
        except Exception:
            log.exception("kvcascade: closing the connector at interpreter exit failed")


threading._register_atexit(_close_at_exit)  # type: ignore[attr-defined]


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
        """The request's ``kv_transfer_params``, with the session hint of vLLM 0.33's
        ``Request.kv_hints`` envelope added (:func:`kvcascade.hints.with_envelope_hint`)."""
        return with_envelope_hint(
            self._req.kv_transfer_params, getattr(self._req, "kv_hints", None)
        )

    @property
    def skip_reading_prefix_cache(self) -> bool:
        return bool(self._req.skip_reading_prefix_cache)

    @property
    def finished(self) -> bool:
        return self._req.is_finished()

    @property
    def aborted(self) -> bool:
        return self._req.status == RequestStatus.FINISHED_ABORTED


def _build_tiers(setup: _Setup, region: SharedOffloadRegion) -> Callable[[], TieringCoordinator]:
    """The coordinator factory run on the loop thread: the primary tier over the region and the
    secondary tiers (:func:`kvcascade._lifecycle.build_coordinator`, as ``Cascade`` builds).

    Raises:
        ConfigError: a bad ``kv_connector_extra_config`` value (raised here, before the loop
            thread starts).
    """
    config = CascadeConfig.from_extra_config(
        setup.extra,
        cpu_blocks=setup.num_cpu_blocks,
        block_bytes=setup.block_bytes,
        model_name=setup.model_name,
    )
    return functools.partial(build_coordinator, config, region, setup.identity)  # type: ignore[arg-type]


class _SchedulerSide:
    """The scheduler role's state: the region, the loop thread and the
    :class:`~kvcascade.scheduler.OffloadScheduler` over the coordinator.

    The scheduler and the coordinator run on the loop thread and each connector hook that
    changes their state is one portal call (:meth:`call`), whatever number of keys it looks up
    or stores: a round trip is two thread wake-ups, 0.5-1.6 ms on average in
    ``benchmarks/serving.py --quick`` with both cores busy (why a woken thread waits that long:
    docs/coordinator.md, loop lag), while the bookkeeping a hook does takes microseconds.
    The hooks that only read take none: the metrics are read on the calling thread
    (``prometheus_client`` values are thread-safe), and the tiers' events are taken in the
    portal calls of :meth:`build_step` and :meth:`apply_results` and handed out by
    :meth:`take_events` (vLLM takes them after both in a step, ``Scheduler.update_from_output``
    in ``vllm/v1/core/sched/scheduler.py``).
    """

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
        self.sched = OffloadScheduler(setup.scheduler, self.loop.coordinator)
        self.transfer_totals = KVCascadeWorkerMetadata()
        self._events: list[BlockEvent] = []  # taken on the loop, not handed out yet
        self._deferred: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        _LOCAL_SCHEDULERS[setup.instance_id] = self

    def call(self, fn: Callable[..., _R], *args: Any) -> _R:
        """Run the deferred calls (:meth:`defer`), then ``fn(*args)``, on the loop thread
        (:meth:`LoopThread.call`, one round trip), where the scheduler and the coordinator live.

        Raises:
            TierUnavailableError: the loop is closing or closed.
        """
        if not self._deferred:
            return self.loop.call(fn, *args)
        deferred, self._deferred = self._deferred, []
        return self.loop.call(_after, deferred, fn, args)

    def defer(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)`` for the loop thread: it runs at the start of the next
        :meth:`call`, in order with the other deferred calls, before anything else reads the
        scheduler's state. For the hooks whose result vLLM does not read (``on_new_request``,
        ``update_state_after_alloc``, ``request_finished``): they cost no round trip of their
        own. A deferred call that raises is logged (hooks never raise into vLLM)."""
        self._deferred.append((fn, args))

    def flush(self) -> None:
        """Run the deferred calls now (before a reset or close)."""
        if self._deferred:
            self.call(lambda: None)

    def matched_tokens(self, request: Request, num_computed: int) -> tuple[int | None, bool]:
        """(loop thread) ``get_num_new_matched_tokens``, tracking the request first if needed."""
        sched = self.sched
        if not sched.is_tracked(request.request_id):
            sched.on_new_request(_RequestView(request))
        return sched.get_num_new_matched_tokens(request.request_id, num_computed)

    def _then_take_events(self, fn: Callable[..., _R], *args: Any) -> _R:
        """(loop thread) ``fn(*args)``, then the tiers' events since the last take, kept for
        :meth:`take_events`."""
        out = fn(*args)
        self._events.extend(self.sched.take_events())
        return out

    def build_step(self, step: StepInput) -> StepPlan:
        """The step's transfers (:meth:`OffloadScheduler.build_step`), one portal call."""
        return self.call(self._then_take_events, self.sched.build_step, step)

    def take_events(self) -> list[BlockEvent]:
        """The tiers' events taken since the last call (no portal call); events that happen
        later are taken at the next step's :meth:`build_step`."""
        events, self._events = self._events, []
        return events

    def reset_cache(self) -> None:
        """Reset the scheduler and the coordinator; waits for the tiers to drain."""

        async def reset() -> None:
            await self.sched.reset_cache()

        self.flush()
        self.loop.run(reset)

    def apply_results(self, meta: KVCascadeWorkerMetadata) -> None:
        """Apply a worker's transfer results (its stores complete: their blocks cascade)."""
        self.transfer_totals = self.transfer_totals.aggregate(
            KVCascadeWorkerMetadata(
                {}, set(), meta.load_bytes, meta.store_bytes, meta.load_seconds, meta.store_seconds
            )
        )  # type: ignore[assignment]
        self.call(self._then_take_events, self.sched.on_jobs_finished, meta.completed, meta.failed)

    def close(self) -> None:
        """Drain the tiers (bounded, ``LoopThread.close``), stop the loop, release the region;
        idempotent."""
        if _LOCAL_SCHEDULERS.pop(self.setup.instance_id, None) is not None:
            try:
                self.flush()
            except Exception:
                log.exception("kvcascade: the deferred scheduler hooks failed at close")
        self.loop.close()
        self.region.cleanup()


def _after(
    deferred: list[tuple[Callable[..., Any], tuple[Any, ...]]],
    fn: Callable[..., _R],
    args: tuple[Any, ...],
) -> _R:
    """(loop thread) The deferred calls in order (each failure logged), then ``fn(*args)``."""
    for call, call_args in deferred:
        try:
            call(*call_args)
        except Exception:
            log.exception("kvcascade: scheduler hook %s failed", call.__name__)
    return fn(*args)


# -- worker side -------------------------------------------------------------------------------
def _block_runs(cache: torch.Tensor) -> list[torch.Tensor]:
    """Zero-copy int8 views ``(num_blocks, run_bytes)`` of one layer's cache, whatever layout
    vLLM registered: together, row ``b`` of the views holds every byte of block ``b``.

    ``cache`` is the layer's view as vLLM's ``create_kv_cache_views``
    (``vllm/v1/kv_cache_interface.py``) builds it — logical ``(B, H, N, C)`` (or ``B`` split into
    manager × kernel blocks by ``group_kernel_blocks``), strided by the resolved
    ``KVCacheLayout``. The dimensions after ``B`` are taken in physical (stride) order; those
    forming one contiguous run with the innermost stay in the row, the others are split off in
    front of ``B`` (one view per index): LBHNC, LBNHC, BLHNC and BLNHC give one view (a block
    is one run of a layer's bytes), LHBNC and BHLNC one view per head.

    Raises:
        ValueError: the block's bytes are not covered by such views (overlapping strides).
    """
    inner = sorted(range(1, cache.dim()), key=cache.stride, reverse=True)
    dense: list[int] = []
    run = 1
    for dim in reversed(inner):
        if cache.shape[dim] != 1 and cache.stride(dim) != run:
            break
        dense.insert(0, dim)
        run *= cache.shape[dim]
    outer = inner[: len(inner) - len(dense)]
    return block_views(cache.permute(*outer, 0, *dense), block_dim=len(outer))


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
        self._copier = DeviceCopier(self.device)
        _LOCAL_WORKERS[setup.instance_id] = self

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        setup = self.setup
        num_blocks = self.kv_cache_config.num_blocks
        if self.region is not None:
            # Registered again: vLLM keeps its process-wide worker connector after an engine
            # of this process failed to start and registers the next engine's caches with it;
            # the old mapping goes (it stayed mapped, and its slot in the region's owner
            # record taken: docs/cpu-tier.md).
            self.region.cleanup()
            self.region = None
            self.groups = []
        self.region = SharedOffloadRegion(
            setup.instance_id,
            setup.num_cpu_blocks,
            setup.cpu_page_size,
            setup.world_size,
            setup.rank,
            expected_participants=setup.world_size + 1,
        )
        k = setup.scheduler.blocks_per_chunk
        seen: set[tuple[int, int]] = set()
        for gid in setup.group_ids:
            group = self.kv_cache_config.kv_cache_groups[gid]
            views: list[_LayerViews] = []
            for name in group.layer_names:
                ref = group_kernel_blocks(kv_caches[name], num_blocks)
                self.device = ref.device
                ident = (ref.data_ptr(), ref.stride(0))
                if ident in seen:  # layers sharing one tensor share its bytes
                    continue
                seen.add(ident)
                for gpu in _block_runs(ref):
                    page = gpu.shape[1]
                    cpu = self.region.create_next_worker_view(page * k)
                    views.append(_LayerViews(gpu, cpu, page))
            self.groups.append(views)
        self._copier = DeviceCopier(self.device)  # on CUDA a side stream per direction

    # copies (run on the copy threads) ------------------------------------------------------------
    def _copy(
        self, spec: TransferSpec, store: bool, ready: torch.cuda.Event | None
    ) -> tuple[int, float]:
        """Copy one job's blocks of every layer (the copy plan of docs/device.md) as one batch of
        descriptors, through the copy core shared with ``DeviceTier``
        (:meth:`kvcascade.tiers.device.DeviceCopier.launch`).

        On CUDA the batch is enqueued on this direction's side stream after ``ready`` (recorded
        on the compute stream when the job was submitted), and this copy thread — never the
        forward pass — waits for it. Returns (bytes, seconds)."""
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
        direction = "store" if store else "load"
        total, end = self._copier.launch(direction, (src, dst, sizes), ready)
        if end is not None:
            end.synchronize()  # the waiting thread sleeps in the driver
        return total, time.perf_counter() - start

    # step hooks --------------------------------------------------------------------------------
    def _submit(self, job_id: int, spec: TransferSpec, store: bool) -> None:
        ready = self._copier.mark()
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
        """Run the queued stores, wait for every copy, hand the results to this engine's
        scheduler side when it lives in this process (vLLM's ``uni`` executor: the engine steps
        no more, so they would be lost), release the region; idempotent."""
        if _LOCAL_WORKERS.pop(self.setup.instance_id, None) is None:
            return
        if self.groups:
            self._submit_queued()
        concurrent.futures.wait([r.future for r in self._running])
        self.finished()
        sched = _LOCAL_SCHEDULERS.get(self.setup.instance_id)
        if sched is not None and self._meta.completed:
            try:
                sched.apply_results(self.take_meta())  # type: ignore[arg-type]
            except Exception:
                log.exception("kvcascade: applying the last transfer results at close failed")
        self._stores.shutdown(wait=True)
        self._loads.shutdown(wait=True)
        self.groups = []
        if self.region is not None:
            self.region.cleanup()


# -- the connector -------------------------------------------------------------------------------
_P = ParamSpec("_P")
_R = TypeVar("_R")


def _scheduler_hook(
    fn: Callable[Concatenate[KVCascadeConnector, _P], _R],
) -> Callable[Concatenate[KVCascadeConnector, _P], _R]:
    """Adds a scheduler-side hook's wall time (``time.perf_counter``, seconds) to the
    connector's ``scheduler_seconds`` (:meth:`KVCascadeConnector.transfer_stats`): the time
    vLLM's scheduler thread spends inside kvcascade, whatever it waited for."""

    @functools.wraps(fn)
    def timed(self: KVCascadeConnector, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        start = time.perf_counter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            self._scheduler_seconds += time.perf_counter() - start

    return timed


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
        _log_through_vllm()
        super().__init__(vllm_config, role, kv_cache_config)
        setup = _setup(vllm_config, kv_cache_config)
        self._setup = setup
        self._sched_side: _SchedulerSide | None = None
        self._worker_side: _WorkerSide | None = None
        events = vllm_config.kv_events_config
        self._publish_events = bool(events is not None and events.enable_kv_cache_events)
        self._stats_deltas = StatsDeltas()
        self._scheduler_seconds = 0.0
        if role == KVConnectorRole.SCHEDULER:
            self._sched_side = _SchedulerSide(setup)
        else:
            self._worker_side = _WorkerSide(setup, kv_cache_config)

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a dropped store is a future miss, never lost data."""
        return False

    @property
    def _side(self) -> _SchedulerSide:
        assert self._sched_side is not None
        return self._sched_side

    @property
    def scheduler(self) -> OffloadScheduler:
        """The scheduler-side rules (scheduler role only); they run on the coordinator's loop
        thread: call them only through :meth:`call_on_loop` (its counters, ``stats``, may be
        read from any thread)."""
        return self._side.sched

    @property
    def coordinator(self) -> TieringCoordinator:
        """The coordinator on the loop thread (call it only through :meth:`call_on_loop`)."""
        assert self._sched_side is not None
        return self._sched_side.loop.coordinator

    def call_on_loop(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` on the coordinator's loop thread (metrics, tests)."""
        return self._side.call(fn, *args)

    # -- scheduler hooks ----------------------------------------------------------------------
    @_scheduler_hook
    def on_new_request(self, request: Request) -> None:
        self._side.defer(self.scheduler.on_new_request, _RequestView(request))

    @_scheduler_hook
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        side = self._side
        try:
            return side.call(side.matched_tokens, request, num_computed_tokens)
        except Exception:
            log.exception("kvcascade lookup failed for %s; treating as a miss", request.request_id)
            return 0, False

    @_scheduler_hook
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        group_blocks = [
            [(b.block_id, b.block_hash is not None) for b in blocks.blocks[gid]]
            for gid in self._setup.group_ids
        ]
        self._side.defer(
            self.scheduler.update_state_after_alloc,
            request.request_id,
            group_blocks,
            num_external_tokens,
        )

    @_scheduler_hook
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVCascadeMetadata:
        gids = self._setup.group_ids
        # The flag is "resumed" on vLLM 0.32 (new requests: False) and "is_full_table" on 0.33
        # (new requests: True); both mean the ids are the whole table, which replaces ours.
        scheduled = [
            ScheduledRequest(
                req_id, None if ids is None else [ids[g] for g in gids], resumed=full_table
            )
            for req_id, ids, full_table in yield_req_data(scheduler_output)
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
            plan = self._side.build_step(step)
        except Exception:
            log.exception("kvcascade: building the step's transfers failed; none this step")
            plan = StepPlan()
        return KVCascadeMetadata(plan.load_jobs, plan.store_jobs, plan.jobs_to_flush)

    @_scheduler_hook
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, KVCascadeWorkerMetadata):
            return
        assert self._sched_side is not None
        try:
            self._sched_side.apply_results(meta)
        except Exception:
            log.exception("kvcascade: applying transfer results failed")

    @_scheduler_hook
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._side.defer(self.scheduler.request_finished, request.request_id)
        return False, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, [])

    @_scheduler_hook
    def has_pending_push_work(self) -> bool:
        """True while the engine must keep stepping for kvcascade (vLLM's ``Scheduler.has_requests``
        and, at shutdown, ``EngineCore.has_work`` read it): a GPU→CPU store not yet acknowledged
        by every worker (``OffloadScheduler.has_pending_work`` counts its jobs) or a tier job in
        flight."""
        try:
            return self._side.call(self.scheduler.has_pending_work)
        except Exception:
            log.exception("kvcascade: has_pending_work failed")
            return False

    @_scheduler_hook
    def take_events(self) -> Iterable[KVCacheEvent]:
        """The tiers' stored/removed events since the last call as vLLM ``BlockStored`` /
        ``BlockRemoved`` (``_vllm_events``) when vLLM publishes KV events
        (``--kv-events-config`` with ``enable_kv_cache_events``); drained and dropped otherwise,
        so they stay bounded. They were taken on the loop by this step's earlier hooks (no
        portal call of its own). Never raises: a failure is logged and gives no events."""
        if self._sched_side is None:
            return ()
        try:
            events = self._sched_side.take_events()
            return vllm_kv_events(events) if self._publish_events else ()
        except Exception:
            log.exception("kvcascade: taking the tiers' KV events failed")
            return ()

    def reset_cache(self) -> bool | None:
        """Drop all offload state (as vLLM's ``reset_cache``); waits for the tiers to drain."""
        self._side.reset_cache()
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
            "scheduler_seconds": self._scheduler_seconds,
            "load_bytes": t.load_bytes,
            "store_bytes": t.store_bytes,
            "load_seconds": t.load_seconds,
            "store_seconds": t.store_seconds,
        }

    @_scheduler_hook
    def get_kv_connector_stats(self) -> OffloadingConnectorStats | None:
        """This step's increase of :meth:`transfer_stats` and of the coordinator's per-tier
        metrics, for vLLM's ``/metrics`` (``_vllm_metrics``); None on the worker side and in a
        step with nothing new. Read on the calling thread (no portal call: the coordinator's
        metrics are ``prometheus_client`` values, safe to read from any thread, as a scrape
        does). Never raises: a failure is logged and gives None."""
        if self._sched_side is None:
            return None
        try:
            tiers = self.coordinator.get_stats()
            return self._stats_deltas.take(self.transfer_stats(), tiers)
        except Exception:
            log.exception("kvcascade: collecting connector stats failed")
            return None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> OffloadingConnectorStats | None:
        """The API server's copy of a :meth:`get_kv_connector_stats` payload (vLLM's
        ``OffloadingConnectorStats``: counters add, gauges keep the latest)."""
        return OffloadingConnectorStats(data=data) if data is not None else None

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVCascadePromMetrics:
        """kvcascade's ``vllm:kv_offload_*`` series in the API server's registry."""
        return KVCascadePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """False (vLLM 0.33's hook): the worker's views and copy plans point into the KV
        caches registered at start and do not follow sleep mode's remap, so vLLM refuses
        ``--enable-sleep-mode`` with this connector instead of copying into freed memory."""
        return False

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
