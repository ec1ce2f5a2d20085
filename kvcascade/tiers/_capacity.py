"""The byte-bounded LRU index of the blocks a tier holds (fs files, s3 objects).

One index per tier: key → bytes of the block's file or object, least recently used first
(docs/fs-tier.md and docs/s3-tier.md, "Capacity"). With ``max_bytes`` it accounts the bytes it
holds plus those reserved by stores in flight, and :meth:`CapacityIndex.reserve` picks the least
recently used blocks to evict before a store that would exceed the bound, skipping blocks being
read (:meth:`CapacityIndex.begin_reads`) or already being evicted. Without ``max_bytes`` nothing
is accounted; ``max_keys`` then bounds the keys remembered (the s3 tier's cache of keys known to
be in the bucket), dropping the least recently used.

Thread-safe: one lock guards every method, so the fs tier's I/O threads and the s3 tier's event
loop use the same index.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Collection, Iterable, Sequence


class CapacityIndex:
    """Byte-bounded LRU index of a tier's blocks (module docstring).

    Args:
        max_bytes: bound on the accounted bytes; None: unbounded (nothing accounted).
        max_keys: with ``max_bytes`` None, the most keys remembered; None: no bound.

    Attributes:
        readers: key → loads reading it now (a block being read is never a victim).
    """

    def __init__(self, max_bytes: int | None, max_keys: int | None = None) -> None:
        self.max_bytes = max_bytes
        self.max_keys = max_keys
        self.readers: collections.Counter[bytes] = collections.Counter()
        self._sizes: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._used = 0
        self._evicting: set[bytes] = set()
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        """Bytes accounted: the blocks held plus the reservations (0 when unbounded)."""
        return self._used

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def present(self, keys: Iterable[bytes]) -> list[bytes]:
        """The ``keys`` in the index, in their order."""
        with self._lock:
            return [k for k in keys if k in self._sizes]

    def add(self, items: Iterable[tuple[bytes, int]]) -> None:
        """Add ``(key, bytes)`` items, each more recently used than the one before (a restart
        scan, oldest first); keys already present are left as they are."""
        with self._lock:
            for key, size in items:
                if key not in self._sizes:
                    self._sizes[key] = size
                    if self.max_bytes is not None:
                        self._used += size

    def record(self, key: bytes, size: int, reserved: bool = False) -> None:
        """``key`` holds a ``size``-byte block and was just used: most recently used.

        ``reserved``: ``size`` was accounted by :meth:`reserve` for this block (returned if the
        key was present already, e.g. stored meanwhile by another job).
        """
        bounded = self.max_bytes is not None
        with self._lock:
            if key in self._sizes:
                self._sizes.move_to_end(key)
                if reserved and bounded:
                    self._used -= size
                return
            self._sizes[key] = size
            if bounded and not reserved:
                self._used += size
            elif not bounded and self.max_keys is not None and len(self._sizes) > self.max_keys:
                self._sizes.popitem(last=False)

    def forget(self, key: bytes) -> int | None:
        """Drop ``key``; its bytes, or None if it was not indexed."""
        with self._lock:
            size = self._sizes.pop(key, None)
            if size is not None and self.max_bytes is not None:
                self._used -= size
            return size

    def touch(self, keys: Collection[bytes]) -> None:
        """Mark the indexed ``keys`` most recently used, the last one most (vLLM's touch
        recency). Keys given without an order (a set) are refreshed in key order, so that
        eviction never depends on the iteration order of a set (PYTHONHASHSEED)."""
        ordered = keys if isinstance(keys, Sequence) else sorted(keys)
        with self._lock:
            for key in ordered:
                if key in self._sizes:
                    self._sizes.move_to_end(key)

    def reserve(self, size: int) -> list[bytes] | None:
        """Account ``size`` more bytes, choosing least recently used victims to stay within
        ``max_bytes``: they leave the index and are marked being evicted, and the caller deletes
        them, then calls :meth:`evicted`.

        Returns:
            the victims (``[]`` when unbounded or nothing must go), or None when ``size``
            cannot fit (nothing reserved, nothing chosen).
        """
        if self.max_bytes is None:
            return []
        if size > self.max_bytes:
            return None
        with self._lock:
            need = self._used + size - self.max_bytes
            victims: list[bytes] = []
            for key, nbytes in self._sizes.items():
                if need <= 0:
                    break
                if not self.readers[key] and key not in self._evicting:
                    victims.append(key)
                    need -= nbytes
            if need > 0:
                return None
            for key in victims:
                self._used -= self._sizes.pop(key)
            self._evicting.update(victims)
            self._used += size
            return victims

    def evicted(self, victims: Iterable[bytes]) -> None:
        """The caller deleted ``victims`` (from :meth:`reserve`): they may be stored again."""
        with self._lock:
            self._evicting.difference_update(victims)

    def unreserve(self, size: int) -> None:
        """Return ``size`` bytes reserved by :meth:`reserve` for a store that failed."""
        if self.max_bytes is not None:
            with self._lock:
                self._used -= size

    def begin_reads(self, keys: Sequence[bytes]) -> int:
        """Protect ``keys`` from eviction while they are read; returns how many of them, from
        the first, are protected: the reads stop before the first key being evicted (the caller
        fails it as a miss). Pair with :meth:`end_reads` of those keys."""
        with self._lock:
            for n, key in enumerate(keys):
                if key in self._evicting:
                    return n
                self.readers[key] += 1
            return len(keys)

    def end_reads(self, keys: Iterable[bytes]) -> None:
        """The reads of ``keys`` (protected by :meth:`begin_reads`) ended."""
        with self._lock:
            for key in keys:
                self.readers[key] -= 1
                if not self.readers[key]:
                    del self.readers[key]

    def clear(self) -> None:
        """Forget every key (reservations of stores in flight stay accounted)."""
        with self._lock:
            for size in self._sizes.values():
                if self.max_bytes is not None:
                    self._used -= size
            self._sizes.clear()
