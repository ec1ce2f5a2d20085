"""Offload keys: the identity of one chunk of one KV-cache group (vLLM ``kv_offload/base.py``).

An offload key is a plain ``bytes`` value: the raw block-hash bytes followed by the KV-cache group
index as 4 bytes, big-endian, unsigned. Raw bytes (not tuples) keep the garbage collector out of
the bookkeeping's way, as in vLLM's ``OffloadKey``.
"""

from __future__ import annotations

from ._validate import is_int

_GROUP_BYTES = 4
_MAX_GROUP = (1 << 32) - 1


def make_offload_key(block_hash: bytes, group_idx: int) -> bytes:
    """Build the offload key of ``block_hash`` in KV-cache group ``group_idx``.

    Same layout as vLLM's ``make_offload_key``: ``block_hash + group_idx.to_bytes(4, "big")``.

    Raises:
        TypeError: ``block_hash`` is not bytes-like or ``group_idx`` is not an int.
        ValueError: ``block_hash`` is empty or ``group_idx`` is outside ``[0, 2**32)``.
    """
    if not isinstance(block_hash, (bytes, bytearray, memoryview)):
        raise TypeError(f"block_hash must be bytes, got {type(block_hash).__name__}")
    if not is_int(group_idx):
        raise TypeError(f"group_idx must be an int, got {type(group_idx).__name__}")
    if not 0 <= group_idx <= _MAX_GROUP:
        raise ValueError(f"group_idx must be in [0, 2**32), got {group_idx}")
    if len(block_hash) == 0:
        raise ValueError("block_hash must not be empty")
    return bytes(block_hash) + group_idx.to_bytes(_GROUP_BYTES, "big")


def check_offload_key(key: object) -> None:
    """Refuse what cannot be an offload key, before it reaches any state: the hooks batch the
    keys of many requests into one tier job, where one bad key failed the job of them all
    (another request's lookups answered ``RETRY`` for ever).

    Raises:
        TypeError: ``key`` is not ``bytes`` (a str, an int, None, a bytearray).
        ValueError: ``key`` has no block-hash bytes before its 4-byte group suffix.
    """
    if not isinstance(key, bytes):
        raise TypeError(f"offload keys must be bytes, got {type(key).__name__} {key!r:.40}")
    if len(key) <= _GROUP_BYTES:
        raise ValueError(
            f"offload key too short ({len(key)} bytes: {key!r:.40}); build keys with "
            "kvcascade.make_offload_key(block_hash, group_idx)"
        )


def split_offload_key(key: bytes) -> tuple[bytes, int]:
    """Inverse of :func:`make_offload_key`: ``(block_hash, group_idx)``.

    Raises:
        ValueError: ``key`` has no block-hash bytes before its 4-byte group suffix.
    """
    if len(key) <= _GROUP_BYTES:
        raise ValueError(f"offload key too short ({len(key)} bytes): {key!r}")
    return bytes(key[:-_GROUP_BYTES]), int.from_bytes(key[-_GROUP_BYTES:], "big")
