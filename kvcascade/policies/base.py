"""The cache-policy interface of the CPU primary tier (vLLM ``kv_offload/cpu/policies/base.py``).

A policy owns the key → :class:`BlockStatus` map of the primary tier and decides eviction order.
It is synchronous, does no I/O, and is driven only by :class:`kvcascade.CPUOffloadingManager`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Iterator, Sequence

from .._types import ReqContext
from .._validate import check_int


class BlockStatus:
    """State of one primary-tier slot while a key is tracked in it (docs/cpu-tier.md).

    Attributes:
        ref_cnt: ``-1`` not ready (a write into the slot is in flight); ``0`` ready and idle
            (evictable); ``n > 0`` ready and pinned by ``n`` in-flight reads.
        block_id: the primary-tier slot (0 … num_blocks-1).

    :class:`kvcascade.CPUOffloadingManager` keeps one object per slot and reuses it when the
    slot is handed out again (saves an allocation per store); a caller must therefore not keep a
    ``BlockStatus`` across calls that may evict or fail its key. Memory: 48 B plus the
    ``block_id`` int.
    """

    __slots__ = ("block_id", "ref_cnt")

    def __init__(self, block_id: int, ref_cnt: int = -1) -> None:
        self.block_id = block_id
        self.ref_cnt = ref_cnt

    @property
    def is_ready(self) -> bool:
        """True once the write into the slot completed (``ref_cnt >= 0``)."""
        return self.ref_cnt >= 0

    def __repr__(self) -> str:
        return f"BlockStatus(block_id={self.block_id}, ref_cnt={self.ref_cnt})"


def as_sequence(keys: Collection[bytes]) -> Sequence[bytes]:
    """``keys`` itself if it is a list or tuple (no copy), else a list of it (for ``reversed``)."""
    return keys if isinstance(keys, list | tuple) else list(keys)


def tail_to_head(key_groups: Sequence[Sequence[bytes]]) -> Iterator[bytes]:
    """A finished request's keys (:meth:`CachePolicy.on_request_finished`), deepest first: the
    reverse of vLLM's ``order_request_keys`` (``kv_offload/cpu/policies/base.py``), groups one
    after the other."""
    for group in reversed(key_groups):
        yield from reversed(group)


class CachePolicy(ABC):
    """Eviction policy of the primary tier; same contract as vLLM's ``CachePolicy``
    (``kv_offload/cpu/policies/base.py``).

    Implementations are constructed as ``cls(cache_capacity=num_blocks)``. Every method runs on
    the caller's thread and must be cheap (O(1) per key, eviction O(n + skipped)). The manager
    guarantees: ``insert`` only of absent keys; ``mark_evictable`` exactly when a block's
    ``ref_cnt`` becomes 0, ``mark_non_evictable`` exactly when it leaves 0.
    """

    #: True for policies that read :class:`kvcascade.SessionHint` s themselves (through the
    #: ``ctx`` of ``touch``); the others get the simple admission rule of
    #: :func:`kvcascade.hints.admits_new_blocks`.
    uses_hints: bool = False

    def __init__(self, cache_capacity: int) -> None:
        """Raises: ConfigError (a ValueError): ``cache_capacity`` not an int ``>= 0``."""
        self.cache_capacity = check_int("cache_capacity", cache_capacity, 0)

    @abstractmethod
    def get(self, key: bytes) -> BlockStatus | None:
        """The block tracked under ``key``, or None. Never changes recency."""

    @abstractmethod
    def insert(self, key: bytes, block: BlockStatus) -> None:
        """Track a new block (normally not ready, ``ref_cnt == -1``)."""

    @abstractmethod
    def remove(self, key: bytes) -> None:
        """Forget ``key`` (failed-store cleanup); no ghost entry is kept.

        Raises:
            KeyError: ``key`` is not tracked.
        """

    @abstractmethod
    def touch(self, keys: Collection[bytes], ctx: ReqContext | None = None) -> None:
        """Mark ``keys`` recently used; the *first* key ends up most recent."""

    @abstractmethod
    def evict(self, n: int, protected: Collection[bytes]) -> list[tuple[bytes, BlockStatus]] | None:
        """Choose and forget exactly ``n`` evictable (``ref_cnt == 0``), unprotected blocks.

        Atomic: returns None and changes nothing when the policy finds fewer than ``n``
        candidates. ``evict(0, ...)`` returns ``[]``. Victims are returned in eviction order.
        """

    @abstractmethod
    def clear(self) -> None:
        """Forget everything (ghost state too)."""

    def admits(self, ctx: ReqContext | None, n: int = 1) -> bool:
        """Hook: whether ``n`` new blocks of the request of ``ctx`` should be stored at all
        (asked before ``prepare_store`` for policies with ``uses_hints``; see
        :func:`kvcascade.hints.admits_new_blocks`). Default: always."""
        return True

    def on_store_miss(self, keys: Sequence[bytes], ctx: ReqContext) -> None:  # noqa: B027
        """Hook: ``keys`` (absent, about to be inserted) were offered to ``prepare_store`` by
        ``ctx``'s request, each key once per request (vLLM's ``CachePolicy.on_store_miss``,
        ``kv_offload/cpu/policies/base.py``). Default: nothing (vLLM's default touches them; ours
        get ``touch`` from the fronts). ``arc`` adapts to ghost hits here."""

    def on_request_finished(  # noqa: B027 - optional hook
        self,
        key_groups: Sequence[Sequence[bytes]],
        insertion_only_keys: set[bytes],
        reused_keys: set[bytes],
        ctx: ReqContext,
    ) -> None:
        """Hook: one request's accesses, once, when it finished (vLLM's
        ``CachePolicy.on_request_finished``, ``kv_offload/cpu/policies/base.py``; called by
        :meth:`kvcascade.CPUOffloadingManager.on_request_finished`).

        Args:
            key_groups: per KV-cache group (increasing group index), the keys the request
                stored, offered while ready, or loaded, head to tail; some may have been evicted
                since (policies skip untracked keys).
            insertion_only_keys: keys this request's stores allocated and it did not reuse.
            reused_keys: ready keys it loaded or offered again, not inserted by itself.
            ctx: the request's context.

        Default: nothing (vLLM's default touches each group instead; ours already get
        ``touch`` from the fronts). ``lru`` and ``arc`` implement vLLM's rules.
        """

    def mark_evictable(self, key: bytes) -> None:  # noqa: B027 - optional hook
        """Hook: the block's ``ref_cnt`` became 0."""

    def mark_non_evictable(self, key: bytes) -> None:  # noqa: B027 - optional hook
        """Hook: the block's ``ref_cnt`` left 0."""

    @abstractmethod
    def keys(self) -> Iterable[bytes]:
        """Every tracked key (for diagnostics and invariant checks)."""
