"""The block file format of the fs, s3 and valkey tiers (docs/fs-tier.md, "Block file format").

An fs block file, an s3 object and a valkey value hold the same bytes, so a block copied between
them (``aws s3 sync`` to an fs ``root_dir``) is served by either tier. Format v2
(:data:`FORMAT_VERSION`, also in the namespace digest of
:class:`~kvcascade.tiers._file_mapper.FileMapper`): a header of :data:`HEADER_BYTES` (4096) bytes
whose first 32 are little-endian ``magic b"KVCB" | version u16 | flags u16 (0) | payload length
u64 | xxh3-64 of the payload u64 | xxh3-64 of the offload key u64``, then a 32-byte MAC field,
the rest zero; then the payload (the block's KV bytes), zero-padded to a multiple of
:data:`ALIGN` bytes. The header is padded to 4096 bytes so that every fs I/O is aligned in file
offset, memory address and length (O_DIRECT). The compiled fs mover (``kernels/fs_io.cpp``)
writes and checks the same fields (never the MAC); its Python side passes it
:data:`FORMAT_VERSION`.

Authenticated blocks (docs/fs-tier.md, "Authenticated blocks"): a tier given a secret
(:func:`block_auth`: an environment variable or a file named in the tier's config) writes flag
bit 0 and, in bytes 32..64, HMAC-SHA256 under a per-namespace key over the 32 header bytes, the
payload and the offload key; its loads refuse a block without that flag or with another MAC.
The checksums say a block is intact, the MAC that a holder of the secret wrote it for this key
in this namespace. Without a secret nothing changes: flags 0, MAC field zero, flags and MAC
ignored on load, so blocks written before authentication existed stay readable.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from typing import Any

import xxhash

from .._errors import ConfigError, CorruptBlockError
from .cpu import round_up

FORMAT_VERSION = 2
"""kvcascade's block format (the header layout of this module); in the namespace digest."""
ALIGN = 4096
"""Alignment in bytes of the header, the payload region and every fs I/O."""
HEADER_BYTES = ALIGN
"""Bytes before the payload in a block file."""
_HEADER = struct.Struct("<4sHHQQQ")
_MAGIC = b"KVCB"
_FLAG_MAC = 1
"""Flags bit 0: bytes 32..64 of the header hold the block's MAC (:class:`BlockAuth`)."""
_MAC = slice(_HEADER.size, _HEADER.size + 32)
_NO_MAC = bytes(32)
MIN_SECRET_BYTES = 16
"""Shortest secret accepted (bytes, after stripping surrounding whitespace)."""
SECRET_KEYS = ("auth_secret_env", "auth_secret_file")
"""Tier config keys naming where a tier's secret comes from (one of them at most)."""


class BlockAuth:
    """The MAC of one namespace's authenticated blocks: HMAC-SHA256 (``hmac``, ``hashlib``)
    keyed by ``HMAC-SHA256(secret, "kvcascade block v<FORMAT_VERSION>" NUL namespace)``, so a
    block is bound to its namespace as well as its key. The secret is not kept, and no
    ``repr``, log line or error shows the key.

    Args:
        secret: the tier's secret (:func:`block_auth`), at least :data:`MIN_SECRET_BYTES`.
        namespace: the namespace (``FileMapper.namespace``, rank included).
    """

    __slots__ = ("_hmac",)

    def __init__(self, secret: bytes, namespace: str) -> None:
        context = f"kvcascade block v{FORMAT_VERSION}\0{namespace}".encode()
        key = hmac.new(secret, context, hashlib.sha256).digest()
        self._hmac = hmac.new(key, digestmod=hashlib.sha256)

    def __repr__(self) -> str:
        return "BlockAuth(<secret>)"

    def mac(self, header: memoryview | bytes, payload: memoryview | bytes, key: bytes) -> bytes:
        """The 32-byte MAC of the first 32 ``header`` bytes, ``payload`` and ``key``."""
        h = self._hmac.copy()
        h.update(header[: _HEADER.size])
        h.update(payload)
        h.update(key)
        return h.digest()


def check_secret_config(cfg: dict[str, Any], tier: str) -> None:
    """Validate the secret keys of a tier entry (:data:`SECRET_KEYS`) without reading them.

    Raises:
        ConfigError: both are given, or one is not a non-empty string.
    """
    given = [k for k in SECRET_KEYS if cfg.get(k) is not None]
    if len(given) > 1:
        raise ConfigError(f"{tier}: give auth_secret_env or auth_secret_file, not both")
    for k in given:
        if not isinstance(cfg[k], str) or not cfg[k]:
            raise ConfigError(f"{tier} {k} must be a non-empty string, got {cfg[k]!r}")


def block_auth(cfg: dict[str, Any], tier: str, namespace: str) -> BlockAuth | None:
    """The :class:`BlockAuth` of a tier entry: its secret is the value of the environment
    variable ``auth_secret_env`` or the content of the file ``auth_secret_file``, surrounding
    whitespace stripped; None when neither key is given (blocks are not authenticated).

    Raises:
        ConfigError: see :func:`check_secret_config`; the variable is unset, the file cannot
            be read, or the secret is shorter than :data:`MIN_SECRET_BYTES`. The message names
            the variable or the file, never the secret.
    """
    check_secret_config(cfg, tier)
    if cfg.get("auth_secret_env") is not None:
        name = cfg["auth_secret_env"]
        source = f"environment variable {name}"
        value = os.environ.get(name)
        if value is None:
            raise ConfigError(f"{tier}: auth_secret_env: {source} is not set")
        secret = value.encode()
    elif cfg.get("auth_secret_file") is not None:
        path = cfg["auth_secret_file"]
        source = f"file {path!r}"
        try:
            with open(path, "rb") as f:
                secret = f.read()
        except OSError as exc:
            raise ConfigError(
                f"{tier}: auth_secret_file: cannot read {source}: {exc.strerror}"
            ) from None
    else:
        return None
    secret = secret.strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"{tier}: the secret in {source} is shorter than {MIN_SECRET_BYTES} bytes"
        )
    return BlockAuth(secret, namespace)


def file_size(payload_bytes: int) -> int:
    """Size in bytes of the block file of a ``payload_bytes`` block (header + padded payload)."""
    return HEADER_BYTES + round_up(payload_bytes, ALIGN)


def encode_header(
    key: bytes, payload: memoryview | bytes, out: memoryview, auth: BlockAuth | None = None
) -> None:
    """Write the header fields and MAC field of ``payload`` stored under ``key`` into
    ``out[:64]`` (the rest of the header must be zero); with ``auth`` the block is
    authenticated (flag and MAC), else its MAC field is zero."""
    _HEADER.pack_into(
        out,
        0,
        _MAGIC,
        FORMAT_VERSION,
        _FLAG_MAC if auth is not None else 0,
        len(payload),
        xxhash.xxh3_64_intdigest(payload),
        xxhash.xxh3_64_intdigest(key),
    )
    out[_MAC] = auth.mac(out, payload, key) if auth is not None else _NO_MAC


def check_block(
    key: bytes,
    header: memoryview | bytes,
    payload: memoryview,
    where: str,
    auth: BlockAuth | None = None,
) -> None:
    """Verify a header read from ``where`` (a path, object or value key) against ``key`` and the
    payload that followed it; with ``auth``, also its MAC.

    Raises:
        CorruptBlockError: wrong magic, version, length or key, a checksum mismatch, or (with
            ``auth``) a block not authenticated or whose MAC differs (forged, or written with
            another secret or for another namespace); the message starts with ``where``.
    """
    magic, version, flags, length, digest, key_digest = _HEADER.unpack_from(header)
    if magic != _MAGIC or version != FORMAT_VERSION:
        raise CorruptBlockError(f"{where}: not a kvcascade v{FORMAT_VERSION} block file")
    if length != len(payload):
        raise CorruptBlockError(f"{where}: payload is {length} bytes, expected {len(payload)}")
    if key_digest != xxhash.xxh3_64_intdigest(key):
        raise CorruptBlockError(f"{where}: holds another key's block")
    if xxhash.xxh3_64_intdigest(payload) != digest:
        raise CorruptBlockError(f"{where}: checksum mismatch")
    if auth is None:
        return
    if not flags & _FLAG_MAC:
        raise CorruptBlockError(f"{where}: not authenticated (written without a secret)")
    if not hmac.compare_digest(auth.mac(header, payload, key), header[_MAC]):
        raise CorruptBlockError(f"{where}: MAC mismatch (forged, or written with another secret)")
