"""The block file format of the fs, s3 and valkey tiers (docs/fs-tier.md, "Block file format").

An fs block file, an s3 object and a valkey value hold the same bytes, so a block copied between
them (``aws s3 sync`` to an fs ``root_dir``) is served by either tier. Format v2
(:data:`FORMAT_VERSION`, also in the namespace digest of
:class:`~kvcascade.tiers._file_mapper.FileMapper`): a header of :data:`HEADER_BYTES` (4096) bytes
whose first 32 are little-endian ``magic b"KVCB" | version u16 | flags u16 (0) | payload length
u64 | xxh3-64 of the payload u64 | xxh3-64 of the offload key u64``, the rest zero; then the
payload (the block's KV bytes), zero-padded to a multiple of :data:`ALIGN` bytes. The header is
padded to 4096 bytes so that every fs I/O is aligned in file offset, memory address and length
(O_DIRECT). The compiled fs mover (``kernels/fs_io.cpp``) writes and checks the same fields; its
Python side passes it :data:`FORMAT_VERSION`.
"""

from __future__ import annotations

import struct

import xxhash

from .._errors import CorruptBlockError
from .cpu import round_up

FORMAT_VERSION = 2
"""kvcascade's block format (the header layout of this module); in the namespace digest."""
ALIGN = 4096
"""Alignment in bytes of the header, the payload region and every fs I/O."""
HEADER_BYTES = ALIGN
"""Bytes before the payload in a block file."""
_HEADER = struct.Struct("<4sHHQQQ")
_MAGIC = b"KVCB"


def file_size(payload_bytes: int) -> int:
    """Size in bytes of the block file of a ``payload_bytes`` block (header + padded payload)."""
    return HEADER_BYTES + round_up(payload_bytes, ALIGN)


def encode_header(key: bytes, payload: memoryview | bytes, out: memoryview) -> None:
    """Write the header fields of ``payload`` stored under ``key`` into ``out[:32]`` (the rest
    of the header must be zero)."""
    _HEADER.pack_into(
        out,
        0,
        _MAGIC,
        FORMAT_VERSION,
        0,
        len(payload),
        xxhash.xxh3_64_intdigest(payload),
        xxhash.xxh3_64_intdigest(key),
    )


def check_block(key: bytes, header: memoryview | bytes, payload: memoryview, where: str) -> None:
    """Verify a header read from ``where`` (a path, object or value key) against ``key`` and the
    payload that followed it.

    Raises:
        CorruptBlockError: wrong magic, version, length or key, or a checksum mismatch; the
            message starts with ``where``.
    """
    magic, version, _flags, length, digest, key_digest = _HEADER.unpack_from(header)
    if magic != _MAGIC or version != FORMAT_VERSION:
        raise CorruptBlockError(f"{where}: not a kvcascade v{FORMAT_VERSION} block file")
    if length != len(payload):
        raise CorruptBlockError(f"{where}: payload is {length} bytes, expected {len(payload)}")
    if key_digest != xxhash.xxh3_64_intdigest(key):
        raise CorruptBlockError(f"{where}: holds another key's block")
    if xxhash.xxh3_64_intdigest(payload) != digest:
        raise CorruptBlockError(f"{where}: checksum mismatch")
