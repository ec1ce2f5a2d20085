"""Shared vocabulary of bookkeeping and data movement.

Names and meanings of vLLM's ``vllm/v1/kv_offload/base.py`` (lookup, specs, events) and
``vllm/v1/kv_offload/tiering/base.py`` (transfer jobs and results).

The bookkeeping side (``index/``) and the data side (``tiers/``) never import each other; they meet
through these types.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import numpy as np

_T = TypeVar("_T")


class LookupResult(enum.Enum):
    """Answer of a one-key lookup (vLLM ``kv_offload/base.py``).

    ``HIT``: present and readable now. ``MISS``: absent or not obtainable. ``HIT_PENDING``: present
    but a write into it is in flight (it will become readable). ``RETRY``: undecided, ask again
    after the next schedule end (an asynchronous probe is pending).
    """

    MISS = "miss"
    HIT = "hit"
    HIT_PENDING = "hit_pending"
    RETRY = "retry"


class Medium(enum.StrEnum):
    """Storage medium of a tier. The GPU is not a medium."""

    CPU = "CPU"
    STORAGE = "STORAGE"


class OffloadPolicy(enum.StrEnum):
    """Which chunks a request offers for storing."""

    BLOCK_LEVEL = "block_level"
    REQUEST_LEVEL = "request_level"


@dataclass
class RequestOffloadingContext:
    """Returned by ``on_new_request``."""

    policy: OffloadPolicy = OffloadPolicy.BLOCK_LEVEL


class ScheduleEndContext(NamedTuple):
    """Passed to ``on_schedule_end`` once per scheduler step."""

    new_req_ids: Collection[str] = ()
    preempted_req_ids: Collection[str] = ()


@dataclass(eq=False)
class ReqContext:
    """Per-request context handed to every hook; one object per request, reused across calls.

    Attributes:
        req_id: the engine's request id.
        kv_transfer_params: the request's ``kv_transfer_params`` dict (or None).
    """

    req_id: str
    kv_transfer_params: dict[str, Any] | None = None
    _state: dict[type, Any] = field(default_factory=dict, repr=False)

    def set_state(self, value: Any) -> None:
        """Store a per-type scratch value (one slot per ``type(value)``)."""
        self._state[type(value)] = value

    def get_state(self, cls: type[_T]) -> _T | None:
        """Return the scratch value stored for ``cls``, or None."""
        return self._state.get(cls)


class LoadStoreSpec:
    """Marker base: where the data of a transfer is."""


class BlockIDsLoadStoreSpec(LoadStoreSpec):
    """A list of block ids kept as a 1-D numpy ``int64`` array."""

    def __init__(self, block_ids: Sequence[int] | np.ndarray) -> None:
        self.block_ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.block_ids.tolist()})"


class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """Primary-tier (CPU) slots; ``block_ids[i]`` belongs to ``keys[i]`` of the producing call."""


class GPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """GPU block ids ordered by KV-cache group.

    Args:
        block_ids: GPU block ids, group after group.
        group_sizes: number of GPU blocks of each group; must sum to ``len(block_ids)``.
        block_indices: logical index (in GPU blocks, within the request) of each group's first
            listed block; one entry per group.

    Raises:
        ValueError: the sizes do not add up or the lists differ in length.
    """

    def __init__(
        self,
        block_ids: Sequence[int] | np.ndarray,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
    ) -> None:
        super().__init__(block_ids)
        self.group_sizes = tuple(int(s) for s in group_sizes)
        self.block_indices = tuple(int(i) for i in block_indices)
        if sum(self.group_sizes) != len(self.block_ids):
            raise ValueError(
                f"group_sizes {self.group_sizes} sum to {sum(self.group_sizes)}, "
                f"but {len(self.block_ids)} block ids were given"
            )
        if len(self.block_indices) != len(self.group_sizes):
            raise ValueError(
                f"{len(self.block_indices)} block_indices for {len(self.group_sizes)} groups"
            )


@dataclass
class PrepareStoreOutput:
    """Result of ``prepare_store``: keys newly allocated, their slots, the victims."""

    keys_to_store: list[bytes]
    store_spec: LoadStoreSpec
    evicted_keys: list[bytes]


@dataclass
class OffloadingEvent:
    """Keys stored into (``removed=False``) or removed from a tier of ``medium``.

    ``tier`` names the tier that owns the storage ("cpu", "fs", "s3", ...).
    """

    keys: list[bytes]
    medium: Medium
    removed: bool
    tier: str = "cpu"


@dataclass
class TransferJob:
    """A primary↔secondary transfer.

    Attributes:
        job_id: monotonic id shared by cascades and promotions.
        keys: offload keys, parallel to ``block_ids``.
        block_ids: primary-tier slots (int64), pinned (stores) or reserved not-ready (loads).
        is_promotion: True for secondary→primary loads, False for cascades.
        req_context: the request the job belongs to.
    """

    job_id: int
    keys: list[bytes]
    block_ids: np.ndarray
    is_promotion: bool
    req_context: ReqContext | None = None


@dataclass
class JobResult:
    """Outcome of a transfer job.

    ``success=True`` means every key succeeded. On failure ``successful_keys`` lists the keys that
    did transfer (a subset of the job's keys), or is None when all keys share the job's fate.
    ``transfer_size`` is in bytes, ``transfer_time`` in seconds.

    ``abandoned``: the job failed at its deadline while its I/O thread was still inside a call;
    its primary rows may still be read or written by that thread, so they must stay out of use
    until a later result for the same ``job_id`` with ``released=True`` arrives (sent when the
    thread returns).
    """

    job_id: int
    success: bool
    successful_keys: list[bytes] | None = None
    transfer_size: int = 0
    transfer_time: float = 0.0
    error: str | None = None
    abandoned: bool = False
    released: bool = False
