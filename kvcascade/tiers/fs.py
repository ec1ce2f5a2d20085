"""The local filesystem tier (``type: "fs"``): one file per block, atomic, checksummed.

Layout (spec §4.1): ``<root_dir>/<model>_<digest12>_r<rank>/<hhh>/<hh>_g<group>/<hex>.bin``, with
``config.json`` (the namespace identity) in ``<root_dir>/<model>_<digest12>/``.

File format v1: a 32-byte little-endian header — magic ``b"KVCB"``, format version (u16), flags
(u16, 0), payload length in bytes (u64), xxh3-64 of the payload (u64), reserved (u64, 0) —
followed by the payload (the block's KV bytes). A file whose header, length or checksum does not
match is deleted on load and the block fails as corrupt, so the caller recomputes.

Stores are atomic: the payload goes to ``<path>_<random>.tmp`` created with ``O_CREAT|O_EXCL``
(mode 0600), then ``os.replace`` renames it over ``<path>``; a reader sees nothing or the whole
file. A store of a key whose file exists is a no-op. Directories are created with mode 0700.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import xxhash

from .._errors import ConfigError, CorruptBlockError, TransferError
from ._file_mapper import FORMAT_VERSION, FileMapper
from .base import SecondaryTier
from .cpu import HostBuffer

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<4sHHQQQ")
_MAGIC = b"KVCB"
HEADER_BYTES = _HEADER.size


def encode_header(payload: memoryview | bytes) -> bytes:
    """The 32-byte v1 header of ``payload``."""
    return _HEADER.pack(_MAGIC, FORMAT_VERSION, 0, len(payload), xxhash.xxh3_64_intdigest(payload), 0)


def check_block(header: bytes | bytearray, payload: memoryview, path: str) -> None:
    """Verify a header read from ``path`` against the payload that followed it.

    Raises:
        CorruptBlockError: wrong magic, version or length, or checksum mismatch.
    """
    magic, version, _flags, length, digest, _ = _HEADER.unpack(header)
    if magic != _MAGIC or version != FORMAT_VERSION:
        raise CorruptBlockError(f"{path}: not a kvcascade v{FORMAT_VERSION} block file")
    if length != len(payload):
        raise CorruptBlockError(f"{path}: payload is {length} bytes, expected {len(payload)}")
    if xxhash.xxh3_64_intdigest(payload) != digest:
        raise CorruptBlockError(f"{path}: checksum mismatch")


class FileSystemTier(SecondaryTier):
    """Secondary tier storing one checksummed file per block under ``root_dir``.

    Args:
        host: the primary tier's buffer.
        root_dir: directory of the tier (created with mode 0700 if missing).
        mapper: the namespace (:class:`FileMapper`).
        name: tier name in metrics and events (default ``"fs"``).
        io_threads: thread-pool size for file I/O.
        io_timeout_s: per-job deadline in seconds.

    Raises:
        OSError: ``root_dir`` or the namespace's ``config.json`` cannot be created.
    """

    def __init__(
        self,
        host: HostBuffer,
        root_dir: str | os.PathLike[str],
        mapper: FileMapper,
        name: str = "fs",
        io_threads: int = 4,
        io_timeout_s: float = 30.0,
    ) -> None:
        super().__init__(name, host, io_threads=io_threads, io_timeout_s=io_timeout_s)
        self.root = Path(root_dir)
        self.mapper = mapper
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        config_path = self.root / mapper.config_relative_path()
        config_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not config_path.exists():
            config_path.write_text(json.dumps(mapper.identity, indent=2, sort_keys=True))
        (self.root / mapper.namespace).mkdir(mode=0o700, exist_ok=True)

    def path_of(self, key: bytes) -> str:
        """Absolute path of the block file of ``key``."""
        return os.path.join(self.root, self.mapper.relative_path(key))

    # -- blocking movers -------------------------------------------------------------------
    def _store_blocks(self, keys: Sequence[bytes], rows: Sequence[memoryview]) -> int:
        written = 0
        for i, (key, row) in enumerate(zip(keys, rows)):
            try:
                written += self._store_one(self.path_of(key), row)
            except OSError as exc:
                raise TransferError(f"fs store of block {i} failed: {exc}", keys[:i]) from exc
        return written

    @staticmethod
    def _store_one(path: str, payload: memoryview) -> int:
        if os.path.exists(path):
            return 0
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        tmp = f"{path}_{secrets.randbits(63)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                expected = HEADER_BYTES + len(payload)
                if os.writev(fd, [encode_header(payload), payload]) != expected:
                    raise OSError(f"short write to {tmp}")
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        return len(payload)

    def _load_blocks(self, keys: Sequence[bytes], rows: Sequence[memoryview]) -> int:
        read = 0
        for i, (key, row) in enumerate(zip(keys, rows)):
            path = self.path_of(key)
            try:
                read += self._load_one(path, row)
            except CorruptBlockError as exc:
                self.counters["corrupt_blocks"] += 1
                log.warning("fs tier: %s; file deleted, block treated as a miss", exc)
                _unlink_quietly(path)
                raise TransferError(str(exc), keys[:i]) from exc
            except OSError as exc:
                raise TransferError(f"fs load of block {i} failed: {exc}", keys[:i]) from exc
        return read

    @staticmethod
    def _load_one(path: str, row: memoryview) -> int:
        header = bytearray(HEADER_BYTES)
        fd = os.open(path, os.O_RDONLY)
        try:
            n = os.preadv(fd, [header, row], 0)
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if n != HEADER_BYTES + len(row) or size != n:
            raise CorruptBlockError(f"{path}: {size} bytes on disk, expected {HEADER_BYTES + len(row)}")
        check_block(header, row, path)
        return len(row)

    def _probe(self, keys: Sequence[bytes]) -> list[bool]:
        return [os.path.exists(self.path_of(k)) for k in keys]


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("fs tier: could not delete %s: %s", path, exc)


def fs_tier_from_config(host: HostBuffer, mapper: FileMapper, cfg: dict[str, Any]) -> FileSystemTier:
    """Build an fs tier from a ``secondary_tiers`` entry (``type`` already removed).

    Keys: ``root_dir`` (required), ``io_threads`` (default 4), ``io_timeout_s`` (default 30),
    ``name`` (default ``"fs"``).

    Raises:
        ConfigError: missing ``root_dir`` or an unknown key.
    """
    known = {"root_dir", "io_threads", "io_timeout_s", "name", "n_read_threads", "n_write_threads"}
    unknown = set(cfg) - known
    if unknown:
        raise ConfigError(f"unknown fs tier keys {sorted(unknown)}; known: {sorted(known)}")
    if not cfg.get("root_dir"):
        raise ConfigError("fs tier needs 'root_dir'")
    threads = int(cfg.get("io_threads", max(cfg.get("n_read_threads", 4), cfg.get("n_write_threads", 4))))
    return FileSystemTier(
        host,
        cfg["root_dir"],
        mapper,
        name=cfg.get("name", "fs"),
        io_threads=threads,
        io_timeout_s=float(cfg.get("io_timeout_s", 30.0)),
    )
