"""The local filesystem tier (``type: "fs"``): one checksummed file per block, atomic, bounded.

Layout (the path formula of vLLM's ``kv_offload/file_mapper.py``, ``FileMapper``)::

    <root_dir>/<model>_<digest12>/config.json                       the namespace identity
    <root_dir>/<model>_<digest12>_r<rank>/<hhh>/<hh>_g<group>/<hex>.bin

File format: :mod:`kvcascade.tiers._block_format` (a 4096-byte header, then the payload padded
with the primary row's padding to a multiple of 4096 bytes), so that every I/O is aligned in file
offset, memory address (primary rows and the per-thread header buffer are page-aligned ``mmap``
memory) and length: O_DIRECT can then be used wherever the filesystem accepts it. The cost is
4 KiB per file (6 % of a 64 KiB block, 0.1 % of a 4 MiB one).

I/O (the rules of vLLM's ``tiering/fs/io.py``): O_DIRECT is probed once per namespace directory at
construction (one aligned page written to a probe file); any error (overlayfs, old tmpfs, some
NFS) selects buffered I/O for the tier's lifetime. A store writes ``<path>_<pid>_<random>.tmp``
opened ``O_CREAT|O_EXCL`` (mode 0600) with one vectored write (header + payload), with
``max_bytes`` sets its mtime (:meth:`FileSystemTier._stamps`), closes it and ``os.replace``-s it
over ``<path>``, so a reader sees no file or the whole file; a key whose file exists is not
rewritten. A load opens the file and reads header and payload with one vectored read straight
into the primary row. A short file is deleted and fails its block; a header, key or checksum
mismatch deletes the file, counts ``counters["corrupt_blocks"]`` and fails the block, so the
caller recomputes. Other errors (missing file, EIO, …) fail the block and leave the file alone.
A load job stops at its first failing block and reports the blocks before it as done (a prefix
is useless after its first gap); a store job goes on after a failing block, so that every block
that can be stored is, and reports exactly the blocks stored (:meth:`FileSystemTier._store_failed`).

Compiled path: once the kernel extension is loaded (:func:`compiled_fs_io`, built in the
background on first use), each job runs through ``kernels/fs_io.cpp`` a batch of up to
:data:`COMPILED_BATCH` blocks per call with the GIL released: stores as open (existence check,
temp file) → write (checksum, header, payload; the only call inside the row-access window) →
commit (mtime, close, rename); loads as open → read + verify. Where a read or write is a CPU copy
(buffered I/O or tmpfs), blocks above 256 KiB move in 256 KiB pieces, each hashed while it is in
the CPU cache. Same files, same checks, same failure outcomes as the pure-Python path, which runs
while the extension builds, if it cannot build, with ``compiled_io=False``, or for a tier with
authenticated blocks (``auth``: the helpers do not compute the MAC).

Capacity: with ``max_bytes`` the tier keeps an LRU index of its files
(:class:`~kvcascade.tiers._capacity.CapacityIndex`; access recorded on load,
on a store of a key already present, and on :meth:`FileSystemTier.touch`); a store that would
exceed ``max_bytes`` first deletes the least recently used files (``counters["evictions"]``,
one removal event per store batch). Files being read are skipped by eviction; a load of a file
evicted meanwhile fails that block like a miss. A file deleted from outside the tier leaves the
index when a probe, load or store of its key finds it gone. ``max_bytes`` counts file sizes
(header and padding included). Without ``max_bytes`` files accumulate, as in vLLM.

Restart: a new tier on an existing directory serves the files there. At start-up (inside
:meth:`~kvcascade.tiers.base.SecondaryTier.serve`, on an I/O thread) it scans its namespace
directory: temp files of a dead process, or older than ``io_timeout_s``, are deleted, and with
``max_bytes`` the index is rebuilt (recency = file modification time in ns, which a bounded
tier sets from a strictly increasing clock, :meth:`FileSystemTier._stamps`) and trimmed to the
bound.

Permissions: directories are created 0700 and files 0600 (KV bytes reveal prompts).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import mmap
import os
import random
import secrets
import stat
import threading
import time
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

import numpy as np

from .._atomic import replace_file
from .._errors import ConfigError, CorruptBlockError, TransferError
from .._keys import make_offload_key
from .._validate import config_int, config_name, config_seconds
from ..ops import _build
from ..ops.swap import _checked
from ._block_format import (
    ALIGN,
    FORMAT_VERSION,
    HEADER_BYTES,
    SECRET_KEYS,
    BlockAuth,
    block_auth,
    check_block,
    check_secret_config,
    encode_header,
    file_size,
)
from ._capacity import CapacityIndex
from ._file_mapper import FileMapper
from .base import SecondaryTier
from .cpu import PAGE_SIZE, HostBuffer, round_up

log = logging.getLogger(__name__)

FS_PROBE_TIMEOUT_S = 2.0
"""Default ``probe_timeout_s`` of an fs tier, seconds: a probe is a ``stat`` queued behind the
tier's writes, so a busy local disk must not read as hung; a hung mount still misses it. (The
network tiers use :data:`kvcascade.tiers.base.PROBE_TIMEOUT_S`.)"""

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_TMPFS_MAGIC = 0x01021994
"""``statfs`` ``f_type`` of tmpfs: O_DIRECT there is still a CPU copy, so I/O is fused."""
FUSED_PIECE_BYTES = 256 << 10
"""Where I/O is a CPU copy (tmpfs, buffered): bytes per read or write of a block, each hashed
while in the CPU cache (``kernels/fs_io.cpp``)."""
COMPILED_BATCH = 64
"""Most blocks per call of the compiled helpers (bounds the files a job holds open at once)."""
COMPILED_STORE_BYTES = 1 << 20
"""With O_DIRECT on a device: bytes of rows per compiled store call (1 to
:data:`COMPILED_BATCH` blocks). A call opens all its temp files before writing any, which
measured up to 20 % slower for 1–4 MiB blocks with O_DIRECT on ext4 than one block at a time;
small blocks, and every size where I/O is a CPU copy (tmpfs, buffered), gain from batching."""
_OS_ERROR, _CORRUPT = 3, 4  # error kinds of the fs ops (kernels/kvc_result.h)
#: A second before this module was imported (s since the epoch): every temp file this process
#: writes is younger, even by a file clock that lags the wall clock by a tick
#: (:meth:`FileSystemTier._is_stale_temp`).
_IMPORTED_AT = time.time() - 1.0

#: The most I/O threads an fs tier config may ask for (each is an OS thread).
MAX_IO_THREADS = 256

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_UNWRITABLE_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)
"""The errors of a filesystem (or a quota) with no room for a write."""

if PAGE_SIZE % ALIGN:
    raise ImportError(f"page size {PAGE_SIZE} is not a multiple of {ALIGN}")


def compiled_fs_io() -> ModuleType | None:
    """The compiled batch I/O helpers (``kernels/fs_io.cpp``) if the kernel extension is loaded.

    Otherwise starts loading it in the background (a build takes about a minute on 2 cores) and
    returns None at once: the tier then moves blocks in pure Python, in the same file format.
    """
    ext = _build.extension_if_ready()
    return ext if ext is not None and hasattr(ext, "fs_store_open") else None


class _Rows(list[memoryview]):
    """The rows of a job, plus their addresses (for the compiled helpers)."""

    addresses: list[int]


def probe_o_direct(directory: str | os.PathLike[str]) -> bool:
    """True when ``directory`` accepts an O_DIRECT write of one aligned page (vLLM's ``fs/io.py``).

    Any OSError (EINVAL on overlayfs, old tmpfs, some NFS) means buffered I/O. A directory that
    cannot be written at all (a read-only mount of a pre-filled cache) is logged as such: its
    loads are served, its stores fail. A full filesystem is not said to be full here (a bounded
    tier at its bound frees a file before each store): a store it refuses is
    (:meth:`FileSystemTier._store_failed`).
    """
    if not _O_DIRECT:
        return False
    probe = os.path.join(directory, f".o_direct_probe_{os.getpid()}_{secrets.randbits(32)}")
    page = mmap.mmap(-1, ALIGN)
    fd: int | None = None
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_DIRECT, 0o600)
        return os.write(fd, page) == ALIGN
    except OSError as exc:
        if fd is None and exc.errno in _UNWRITABLE_ERRNOS:
            # Not a warning: the first store it refuses is (FileSystemTier._store_failed).
            log.info("fs tier: %s is not writable (%s): stores will fail", directory, exc.strerror)
        elif exc.errno in _FULL_ERRNOS:
            # Not "full": a bounded tier evicts before it writes, so its stores may well fit.
            log.info(
                "fs tier: no room for the O_DIRECT probe in %s (%s); buffered I/O", directory, exc
            )
        else:
            log.warning("fs tier: O_DIRECT unavailable in %s (%s); buffered I/O", directory, exc)
        return False
    finally:
        page.close()
        if fd is not None:
            os.close(fd)
            _unlink_quietly(probe)


class FileSystemTier(SecondaryTier):
    """Secondary tier storing one checksummed file per block under ``root_dir``.

    Same contract as vLLM's ``FileSystemTierManager`` (``tiering/fs/manager.py``, ``io.py``,
    ``thread_pool.py``) plus capacity, integrity, restart reuse and deadlines (module docstring).

    Args:
        host: the primary tier's buffer.
        root_dir: directory of the tier (a leading ``~`` is the user's home, as in a shell);
            created with mode 0700 (missing parents too) if missing, with a warning naming it,
            so that a mistyped path is seen before it fills another disk.
        mapper: the namespace (:class:`FileMapper`).
        name: tier name in metrics and events (default ``"fs"``).
        io_threads: I/O threads (half prefer loads, half stores).
        io_timeout_s: per-job deadline in seconds from submission.
        max_queued_jobs: jobs allowed to wait for a thread; stores beyond it are refused.
        probe_timeout_s: deadline of one existence probe in seconds; past it the probe answers
            MISS (:class:`~kvcascade.tiers.base.SecondaryTier`).
        max_bytes: bound on the bytes of block files; None = unbounded.
        o_direct: try O_DIRECT (probed once); False forces buffered I/O.
        compiled_io: use the compiled batch helpers once the extension is loaded (module
            docstring); False keeps every job in pure Python.
        auth: authenticate blocks (:class:`~kvcascade.tiers._block_format.BlockAuth`): every
            block written with a MAC, every load checked, a block failing it deleted as
            corrupt. Such a tier moves blocks in pure Python (the compiled helpers do not
            compute the MAC); None = checksums only.

    Raises:
        OSError: ``root_dir``, the namespace's ``config.json`` or its data directory cannot
            be created (a read-only mount, no permission); the message names the tier and
            ``root_dir``, the error's ``filename`` the path refused.
        ConfigError: ``config.json`` exists with another identity (a digest collision) or is
            not a regular file, ``max_bytes`` is not positive, or ``root_dir`` exists and is
            not a directory.
    """

    def __init__(
        self,
        host: HostBuffer,
        root_dir: str | os.PathLike[str],
        mapper: FileMapper,
        name: str = "fs",
        io_threads: int = 4,
        io_timeout_s: float = 30.0,
        max_queued_jobs: int = 1024,
        max_bytes: int | None = None,
        o_direct: bool = True,
        compiled_io: bool = True,
        auth: BlockAuth | None = None,
        probe_timeout_s: float = FS_PROBE_TIMEOUT_S,
    ) -> None:
        super().__init__(
            name,
            host,
            io_threads=io_threads,
            io_timeout_s=io_timeout_s,
            max_queued_jobs=max_queued_jobs,
            probe_timeout_s=probe_timeout_s,
        )
        if max_bytes is not None and max_bytes <= 0:
            raise ConfigError(f"fs tier max_bytes must be > 0, got {max_bytes}")
        self.root = Path(root_dir).expanduser()
        self.mapper = mapper
        self.max_bytes = max_bytes
        self.block_file_bytes = file_size(host.block_bytes)
        self._prefix = os.path.join(self.root, "")
        self.data_dir = self.root / mapper.namespace
        self._config_path = self.root / mapper.config_relative_path()
        try:
            self._make_namespace()
        except OSError as exc:  # a read-only or foreign directory: say which tier it is
            raise type(exc)(
                exc.errno,
                f"fs tier {name!r}: cannot create its namespace under root_dir {self.root} "
                f"({exc.strerror})",
                exc.filename,
            ) from exc
        self.o_direct = o_direct and probe_o_direct(self.data_dir)
        self._flags = _O_DIRECT if self.o_direct else 0
        self._lock = threading.Lock()  # guards _last_stamp
        self._index = CapacityIndex(max_bytes) if max_bytes is not None else None
        self._last_stamp = 0  # the latest mtime (ns since the epoch) given to a new file
        self._buffers = threading.local()
        self._pid = os.getpid()
        self._span = round_up(host.block_bytes, ALIGN)
        self._base = host.tensor().data_ptr()  # address of row 0 (the mmap never moves)
        self._data_prefix = os.path.join(self._prefix, mapper.namespace, "")
        self._auth = auth
        # The helpers take str paths (UTF-8); a path that cannot be encoded stays in Python, and
        # so does an authenticated tier (the helpers neither write nor check the MAC).
        self.compiled_io = compiled_io and auth is None and _utf8(self._data_prefix)
        self._fused: bool | None = None  # decided on first compiled use (needs fs_type)
        if self.compiled_io:
            compiled_fs_io()  # start loading the extension now, not on the first job

    def _make_namespace(self) -> None:
        """Create ``root_dir`` if missing (with a warning naming it), the namespace's
        ``config.json`` and its data directory; existing ones are used as they are (a
        read-only cache filled before needs no write).

        Raises:
            ConfigError: ``root_dir`` is not a directory; see :meth:`_write_config`.
            OSError: a directory or ``config.json`` cannot be created.
        """
        if self.root.exists():
            if not self.root.is_dir():
                raise ConfigError(
                    f"fs tier root_dir {str(self.root)!r} exists and is not a directory"
                )
        else:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            log.warning(
                "fs tier %s: root_dir %s did not exist; created it (check the path if an "
                "existing directory was meant)",
                self.name,
                self.root.resolve(),
            )
        self._write_config()
        self.data_dir.mkdir(mode=0o700, exist_ok=True)

    def _recreate_namespace(self) -> None:
        """Create the namespace again after something removed it while the tier ran
        (``kvcascade purge --all`` or ``--namespace``, ``kvcascade/_admin.py``): without it
        every later store failed with ``No such file or directory`` until a restart. Also when
        only ``config.json`` went: a purge racing this tier's writes removes it but may leave
        the data directory (``rmtree`` cannot remove a directory the tier writes into), and
        block files without ``config.json`` are invisible to ``kvcascade inspect`` and
        ``purge``, and the learned policy state could not be saved beside it.

        Raises:
            OSError, ConfigError: as :meth:`_make_namespace` (the store job fails with it).
        """
        self._make_namespace()
        log.warning(
            "fs tier %s: its namespace %s was removed while the tier ran (kvcascade purge?); "
            "created it again",
            self.name,
            self.data_dir,
        )

    def _write_config(self) -> None:
        path = self._config_path
        path.parent.mkdir(mode=0o700, exist_ok=True)
        identity = self.mapper.run_config()
        try:
            if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block start-up forever
                raise ConfigError(f"{path} exists and is not a regular file")
            existing = json.loads(path.read_text())
        except FileNotFoundError:
            replace_file(path, json.dumps(identity, indent=2, sort_keys=True).encode())
            return
        except ValueError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
        if existing != identity:
            raise ConfigError(f"{path} records another identity (digest collision): {existing}")

    @property
    def used_bytes(self) -> int:
        """Bytes of block files accounted by the LRU index (0 when ``max_bytes`` is None)."""
        return self._index.used if self._index is not None else 0

    def path_of(self, key: bytes) -> str:
        """Absolute path of the block file of ``key``."""
        return self._prefix + self.mapper.relative_path(key)

    def _rows(self, block_ids: Iterable[int]) -> list[memoryview]:
        # Whole aligned rows (payload + the row's padding) so that O_DIRECT I/O is aligned.
        view, stride, span, base = self.host.memoryview, self.host.row_bytes, self._span, self._base
        n = self.host.num_blocks
        ids = block_ids.tolist() if isinstance(block_ids, np.ndarray) else block_ids
        rows = _Rows()
        addresses = rows.addresses = []
        for b in ids:
            b = int(b)
            if not 0 <= b < n:
                raise IndexError(f"block_id {b} outside [0, {n})")
            start = b * stride
            rows.append(view[start : start + span])
            addresses.append(base + start)
        return rows

    def _header_buffer(self) -> memoryview:
        buf: memoryview | None = getattr(self._buffers, "header", None)
        if buf is None:
            buf = self._buffers.header = memoryview(mmap.mmap(-1, HEADER_BYTES))
        return buf

    # -- start-up scan ---------------------------------------------------------------------
    async def _startup(self) -> None:
        await self._call_blocking(self._scan, deadline=False)

    def _scan(self) -> None:
        """Delete stale temp files (block files in the namespace; ``config.json`` and the
        policy state beside it, ``kvcascade/_atomic.py``); with ``max_bytes``, rebuild the LRU
        index and trim it."""
        found: list[tuple[int, bytes, int]] = []
        stale = 0
        now = time.time()
        config_dir = self._config_path.parent
        for entry in _entries(config_dir, dirs=False):
            if entry.name.endswith(".tmp") and self._is_stale_temp(entry, now):
                _unlink_quietly(entry.path)
                stale += 1
        for top in _entries(self.data_dir, dirs=True):
            for leaf in _entries(top.path, dirs=True):
                group = _group_of(leaf.name)
                if group is None:
                    continue
                # a directory removed while the scan walks (``kvcascade purge``) has no files
                for entry in _entries(leaf.path, dirs=False):
                    if entry.name.endswith(".tmp"):
                        if self._is_stale_temp(entry, now):
                            _unlink_quietly(entry.path)
                            stale += 1
                    elif self._index is not None and entry.name.endswith(".bin"):
                        try:
                            st = entry.stat()
                            key = make_offload_key(bytes.fromhex(entry.name[:-4]), group)
                        except (OSError, ValueError):
                            continue
                        found.append((st.st_mtime_ns, key, st.st_size))
        if stale:
            log.info("fs tier %s: removed %d stale temp files", self.name, stale)
        if self._index is None:
            return
        # A time ahead of the clock (a clock stepped back, files restored from another host)
        # counts as now: carried forward it would stamp every new file in the future, where
        # ``kvcascade purge --older-than`` never finds them old.
        now_ns = time.time_ns()
        found = sorted((min(t, now_ns), key, size) for t, key, size in found)
        self._index.add((key, size) for _, key, size in found)  # oldest first, ties by key
        if found:  # new files are stamped after every file found, whatever the clock does
            with self._lock:
                self._last_stamp = max(self._last_stamp, found[-1][0])
        self._evict_and_reserve(0)

    def _is_stale_temp(self, entry: os.DirEntry[str], now: float) -> bool:
        """A temp file ``…_<pid>_<n>.tmp`` is stale when its writer is gone, when it is older
        than ``io_timeout_s``, or when it carries this process's pid but is older than this
        module's import: a process before this one had the pid (pid 1 of every container
        restart) and was killed while writing (docs/fs-tier.md, *Restart*)."""
        try:
            pid = int(entry.name[:-4].rsplit("_", 2)[1])
            if pid != self._pid:
                os.kill(pid, 0)
        except (ValueError, IndexError, ProcessLookupError):
            return True  # not ours, or its writer is gone
        except PermissionError:
            pass  # a live process of another user
        try:
            mtime = entry.stat().st_mtime
        except FileNotFoundError:
            return False
        return now - mtime > self.io_timeout_s or (pid == self._pid and mtime < _IMPORTED_AT)

    # -- capacity --------------------------------------------------------------------------
    def _evict_and_reserve(self, size: int) -> bool:
        """Account ``size`` more bytes, first deleting LRU files to stay within ``max_bytes``
        (:meth:`CapacityIndex.reserve`).

        Returns False (nothing reserved, nothing deleted) when ``size`` cannot fit even after
        eviction.
        """
        if self._index is None:
            return True
        victims = self._index.reserve(size)
        if victims is None:
            return False
        if victims:
            for key in victims:
                _unlink_quietly(self.path_of(key))  # a file already gone counts as removed
            self._index.evicted(victims)
            with self._counters_lock:
                self.counters["evictions"] += len(victims)
            self._announce_removed(victims)
        return True

    def _stamps(self, n: int) -> int:
        """The first of ``n`` consecutive modification times (ns since the epoch) for files
        written now: the wall clock, but strictly after every time given before and every file
        found at start-up, so that the restart scan orders files as they were written even
        where the kernel's file clock ticks coarsely (every few ms: many stores per tick).
        Set only with ``max_bytes`` (one ``futimens`` per new file, ~1 µs): an unbounded tier
        never evicts, and its files restarted under a bound fall back to the kernel's times."""
        with self._lock:
            first = max(time.time_ns(), self._last_stamp + 1)
            self._last_stamp = first + n - 1
        return first

    def _unreserve(self, size: int) -> None:
        if self._index is not None:
            self._index.unreserve(size)

    def _record(self, key: bytes, size: int, reserved: bool) -> None:
        """``key`` holds a ``size``-byte file and was just used: most recently used."""
        if self._index is not None:
            self._index.record(key, size, reserved)

    def _forget(self, key: bytes) -> None:
        """Drop ``key`` from the size index: its file was found gone (deleted from outside the
        tier: an operator's ``rm``, another process sharing the directory) or was deleted as
        corrupt. A file present again by the time the entry is gone (a concurrent store of the
        key) is indexed again, so the index never loses a file it must count."""
        if self._index is None:
            return
        size = self._index.forget(key)
        if size is not None and os.path.exists(self.path_of(key)):
            self._index.record(key, size)

    def _discard(self, key: bytes) -> None:
        """Delete ``key``'s file (an error is logged only) and forget it."""
        _unlink_quietly(self.path_of(key))
        self._forget(key)

    def _stored_event_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        return list(keys) if self._index is None else self._index.present(keys)

    def touch(self, keys: Collection[bytes]) -> None:
        """Mark ``keys`` most recently used, the last one most (vLLM's touch recency; only with
        ``max_bytes``; :meth:`CapacityIndex.touch`)."""
        if self._index is not None:
            self._index.touch(keys)

    # -- blocking movers -------------------------------------------------------------------
    def _compiled(self, rows: Sequence[memoryview]) -> ModuleType | None:
        """The compiled helpers for this job, or None (pure Python)."""
        if not self.compiled_io or not isinstance(rows, _Rows):
            return None
        ext = compiled_fs_io()
        if ext is not None and self._fused is None:
            self._setup_compiled(ext)
        return ext if self.compiled_io else None

    def _setup_compiled(self, ext: ModuleType) -> None:
        """First compiled use: check that the helpers build this mapper's paths, choose fused
        I/O (buffered, or tmpfs where O_DIRECT is a copy too)."""
        samples = [make_offload_key(bytes(range(1, 17)), 0), make_offload_key(b"\xab", 70000)]
        paths, kind, _ = ext.fs_block_paths(self._data_prefix, samples)
        if kind or paths != [self.path_of(k) for k in samples]:
            log.warning("fs tier %s: mapper paths differ from the compiled helpers'", self.name)
            self.compiled_io = False
        magic, kind, _ = ext.fs_type(str(self.data_dir))
        self._fused = not self.o_direct or (kind == 0 and magic == _TMPFS_MAGIC)

    def _store_blocks(self, keys: Sequence[bytes], rows: Sequence[memoryview]) -> int:
        """Store every block it can; payload bytes written (store hits write none).

        A failing block does not stop the job (a store's later blocks are still worth having,
        unlike a load's after a gap): see :meth:`_store_failed`.

        Raises:
            TransferError: some blocks failed (:meth:`_store_failed`).
            TimeoutError: the job passed its deadline (its result is discarded).
        """
        if not (self.data_dir.is_dir() and self._config_path.is_file()):  # two stats a job
            self._recreate_namespace()
        ext = self._compiled(rows)
        if ext is None:
            return self._store_blocks_py(keys, rows)
        assert isinstance(rows, _Rows)
        per_call = COMPILED_BATCH
        if not self._fused:  # O_DIRECT on a device
            per_call = max(1, min(COMPILED_BATCH, COMPILED_STORE_BYTES // self._span))
        written = 0
        failures: list[tuple[int, OSError]] = []
        for lo in range(0, len(keys), per_call):
            done, failed = self._store_batch(
                ext, keys, rows.addresses, lo, min(lo + per_call, len(keys))
            )
            written += done
            failures += failed
        if failures:
            self._store_failed(keys, failures, written)
        return written

    def _store_batch(
        self, ext: ModuleType, keys: Sequence[bytes], addresses: list[int], lo: int, hi: int
    ) -> tuple[int, list[tuple[int, OSError]]]:
        """Store blocks ``lo:hi`` of a job with the compiled helpers; (payload bytes written,
        the failed blocks as (index in the job, cause) in job order).

        Same outcome as :meth:`_store_one` over each block: every block that can be stored is
        stored and recorded; a failed one leaves no file, no temp file and no reservation. A
        block whose store failed (a read-only or full filesystem) while its file is present —
        written before, or by another writer meanwhile — is a store hit, as :meth:`_store_one`
        finds it before writing.

        Raises:
            TimeoutError: the job passed its deadline before its rows were read.
        """
        batch = keys[lo:hi]
        prefix = self._data_prefix
        suffix = f"_{self._pid}_{random.getrandbits(63)}.tmp"
        exists = ext.FS_EXISTS
        size = HEADER_BYTES + self._span
        # With a size index, check existence first (a present key must not reserve room);
        # otherwise let the rename refuse to replace a present file (no lookup per new name).
        check_first = self._index is not None
        fds, errnos, kind, message = ext.fs_store_open(
            prefix, batch, suffix, self._flags, check_first
        )
        failed = _failures(errnos, kind, message)
        to_write = list(fds)  # the open temp files to write (fd >= 0)
        reserved: list[int] = []  # blocks holding a reservation, until committed or failed
        if self._index is not None:
            for j, fd in enumerate(fds):
                if fd == exists:
                    self._record(batch[j], self.block_file_bytes, reserved=False)
                elif fd >= 0:
                    self._forget(batch[j])  # an index entry left by a file deleted from outside
                    if self._evict_and_reserve(size):
                        reserved.append(j)
                    else:
                        failed[j] = _no_room(size)
                        to_write[j] = exists
        to_commit: list[int] = []
        outcomes: list[int] = []
        try:
            with self._row_access():
                _, errnos, kind, message = ext.fs_store_write(
                    to_write,
                    batch,
                    addresses[lo:hi],
                    self.host.block_bytes,
                    self._span,
                    FORMAT_VERSION,
                    FUSED_PIECE_BYTES if self._fused else 0,
                )
            write_failed = _failures(errnos, kind, message)  # their temp files stay open
            failed.update(write_failed)
            to_commit = [exists if j in write_failed else fd for j, fd in enumerate(to_write)]
            stamp = self._stamps(len(batch)) if self._index is not None else 0  # 0: the kernel's
            outcomes, errnos, kind, message = ext.fs_store_commit(
                to_commit, prefix, batch, suffix, not check_first, stamp
            )
            failed.update(_failures(errnos, kind, message))  # closed, temp file unlinked
        finally:
            # Temp files left open: refused room, failed writes, or every one when the job
            # stopped before its commit ran (past its deadline).
            handled = to_commit if outcomes else [exists] * len(fds)
            rest = [exists if by >= 0 else fd for fd, by in zip(fds, handled, strict=True)]
            if any(fd >= 0 for fd in rest):
                errors, _, _ = ext.fs_store_abort(rest, prefix, batch, suffix)
                for key, err in zip(batch, errors, strict=True):
                    if err:
                        tmp = self.path_of(key) + suffix
                        log.warning("fs tier: could not delete %s: %s", tmp, os.strerror(err))
            if not outcomes:
                for _ in reserved:
                    self._unreserve(size)
        for j in reserved:
            if j in failed:
                self._unreserve(size)
        written = 0
        for j, fd in enumerate(fds):
            if fd < 0 or j in failed:  # a store hit found first, or a failed block
                continue
            if outcomes[j] == ext.FS_EXISTED:  # kept the file already there (no reservation)
                self._record(batch[j], self.block_file_bytes, reserved=False)
            else:
                self._record(batch[j], size, reserved=True)
                written += self.host.block_bytes
        failures = []
        for j, exc in sorted(failed.items()):
            if os.path.exists(self.path_of(batch[j])):  # present after all: a store hit
                self._record(batch[j], self.block_file_bytes, reserved=False)
            else:
                failures.append((lo + j, exc))
        return written, failures

    def _store_blocks_py(self, keys: Sequence[bytes], rows: Sequence[memoryview]) -> int:
        written = 0
        failures: list[tuple[int, OSError]] = []
        for i, (key, row) in enumerate(zip(keys, rows, strict=True)):
            try:
                written += self._store_one(key, row)
            except OSError as exc:
                if self._job_abandoned():  # past its deadline: the result is discarded
                    raise
                failures.append((i, exc))
        if failures:
            self._store_failed(keys, failures, written)
        return written

    def _store_failed(
        self, keys: Sequence[bytes], failures: list[tuple[int, OSError]], written: int
    ) -> NoReturn:
        """Fail a store job whose blocks ``failures`` ((index, cause), job order, not empty)
        failed after the others were stored (store hits included) with ``written`` payload
        bytes: the same partial result as the S3 tier's (``kvcascade/tiers/s3.py``).

        Blocks the filesystem refused for want of room (ENOSPC, EDQUOT: a disk that filled
        mid-run, not the tier's own ``max_bytes``) are counted in
        ``counters["disk_full_blocks"]``, blocks it refused to write at all (EROFS, EACCES,
        EPERM: a read-only mount) in ``counters["unwritable_blocks"]``; each kind is warned
        about naming the tier and its ``root_dir``, rate-limited as corrupt blocks are
        (:meth:`_limited_warning`), and a job that failed of these alone is ``reported`` (its
        failure is no second warning). Their temp files are already removed: a refused block
        is a failed store, never a corrupt file.

        Raises:
            TransferError: always; names the first failed block and its cause (also the
                exception's cause) and how many failed; ``succeeded``: the other keys, in job
                order; ``transferred_bytes``: ``written``.
        """
        warned = 0
        for counter, errnos, state, until in (
            ("disk_full_blocks", _FULL_ERRNOS, "is full", "the filesystem has room"),
            ("unwritable_blocks", _UNWRITABLE_ERRNOS, "is not writable", "it is writable"),
        ):
            refused = [
                e for _, e in failures if e.errno in errnos and not isinstance(e, _OverBound)
            ]
            if refused:
                warned += len(refused)
                self._limited_warning(
                    counter,
                    len(refused),
                    f"fs tier {self.name}: root_dir {self.root} {state} ({refused[0].strerror}): "
                    f"{len(refused)} of {len(keys)} blocks of a store not stored; stores fail "
                    f"until {until} (no block is left partly written)",
                    "refused blocks",
                )
        i, exc = failures[0]
        bad = {j for j, _ in failures}
        more = f"; {len(failures)} of {len(keys)} blocks failed" if len(failures) > 1 else ""
        raise TransferError(
            f"fs store of block {i} failed: {_naming(exc, self.path_of(keys[i]))}{more}",
            [k for j, k in enumerate(keys) if j not in bad],
            written,
            reported=warned == len(failures),
        ) from exc

    def _store_one(self, key: bytes, row: memoryview) -> int:
        path = self.path_of(key)
        if os.path.exists(path):
            self._record(key, self.block_file_bytes, reserved=False)
            return 0
        self._forget(key)  # an index entry left by a file deleted from outside
        size = HEADER_BYTES + len(row)
        if not self._evict_and_reserve(size):
            raise _no_room(size)
        payload = row[: self.host.block_bytes]
        header = self._header_buffer()
        tmp = f"{path}_{self._pid}_{random.getrandbits(63)}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | self._flags
        fd: int | None = None
        try:
            try:
                fd = os.open(tmp, flags, 0o600)
            except FileNotFoundError:  # first block of its directory
                _make_dirs(os.path.dirname(path))
                fd = os.open(tmp, flags, 0o600)
            try:
                with self._row_access():
                    encode_header(key, payload, header, self._auth)
                    done = os.writev(fd, [header, row])
                    while done < size:  # a short write: go on, so the real error shows
                        rest = (
                            [header[done:], row]
                            if done < HEADER_BYTES
                            else [row[done - HEADER_BYTES :]]
                        )
                        written = os.writev(fd, rest)
                        if not written:
                            raise OSError(errno.EIO, f"short write to {tmp}")
                        done += written
                if self._index is not None:  # recency after a restart (_stamps)
                    stamp = self._stamps(1)
                    with contextlib.suppress(OSError):  # refused: the file's own mtime stands
                        os.utime(fd, ns=(stamp, stamp))
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            self._unreserve(size)
            if fd is not None:  # nothing to delete if the temp file was never created
                _unlink_quietly(tmp)
            raise
        self._record(key, size, reserved=True)
        return len(payload)

    def _load_blocks(self, keys: Sequence[bytes], rows: Sequence[memoryview]) -> int:
        ext = self._compiled(rows)
        if ext is None:
            return self._load_blocks_py(keys, rows)
        assert isinstance(rows, _Rows)
        read = 0
        for lo in range(0, len(keys), COMPILED_BATCH):
            hi = min(lo + COMPILED_BATCH, len(keys))
            read += self._load_batch(ext, keys, rows.addresses, lo, hi)
        return read

    def _load_batch(
        self, ext: ModuleType, keys: Sequence[bytes], addresses: list[int], lo: int, hi: int
    ) -> int:
        """Load blocks ``lo:hi`` of a job with the compiled helpers; payload bytes read.

        Same outcome as :meth:`_load_one` over each block in turn. Every file is opened before
        any row is written, so a stalled open never writes into rows released meanwhile.

        Raises:
            TransferError: a block failed (cause: its OSError, or a CorruptBlockError after the
                file was deleted); the keys before it succeeded.
            TimeoutError: the job passed its deadline before its rows were written.
        """
        batch = keys[lo:hi]
        failure: tuple[int, Exception] | None = None
        limit = len(batch)  # blocks [0, limit) are read
        if self._index is not None:  # readers matter only when files can be evicted
            limit = self._index.begin_reads(batch)
            if limit < len(batch):
                path = self.path_of(batch[limit])
                failure = (limit, FileNotFoundError(errno.ENOENT, "evicted", path))
        tracked = limit if self._index is not None else 0
        try:
            fds, kind, message = ext.fs_load_open(self._data_prefix, batch[:limit], self._flags)
            failure = _failure(fds, kind, message) or failure
            try:
                # The opens may block (a FIFO, a hung NFS): until here the rows are untouched.
                with self._row_access():
                    opened, fds = fds, []  # fs_load_read closes them, whatever happens
                    done, kind, message = ext.fs_load_read(
                        opened,
                        batch[: len(opened)],
                        addresses[lo : lo + len(opened)],
                        self.host.block_bytes,
                        self._span,
                        FORMAT_VERSION,
                        FUSED_PIECE_BYTES if self._fused else 0,
                    )
            finally:
                for fd in fds:  # not handed over (the job passed its deadline)
                    os.close(fd)
            if kind == _CORRUPT:
                done.pop()
                path = self.path_of(batch[len(done)])
                failure = (len(done), CorruptBlockError(f"{path}: {message}"))
            else:
                failure = _failure(done, kind, message) or failure
        finally:
            if self._index is not None and tracked:
                self._index.end_reads(batch[:tracked])
        if self._index is not None:
            for key in batch[: len(done)]:
                self._record(key, HEADER_BYTES + self._span, reserved=False)
        if failure is None:
            return len(done) * self.host.block_bytes
        i, exc = failure
        if isinstance(exc, CorruptBlockError):
            self._corrupt(exc, functools.partial(self._discard, batch[i]))
            raise TransferError(str(exc), keys[: lo + i]) from exc
        if isinstance(exc, FileNotFoundError):
            self._forget(batch[i])
        raise TransferError(
            f"fs load of block {lo + i} failed: {_naming(exc, self.path_of(batch[i]))}",
            keys[: lo + i],
        ) from exc

    def _load_blocks_py(self, keys: Sequence[bytes], rows: Sequence[memoryview]) -> int:
        read = 0
        for i, (key, row) in enumerate(zip(keys, rows, strict=True)):
            path = self.path_of(key)
            try:
                read += self._load_one(key, path, row)
            except CorruptBlockError as exc:
                self._corrupt(exc, functools.partial(self._discard, key))
                raise TransferError(str(exc), keys[:i]) from exc
            except OSError as exc:
                if isinstance(exc, FileNotFoundError):
                    self._forget(key)
                raise TransferError(
                    f"fs load of block {i} failed: {_naming(exc, path)}", keys[:i]
                ) from exc
        return read

    def _load_one(self, key: bytes, path: str, row: memoryview) -> int:
        size = HEADER_BYTES + len(row)
        header = self._header_buffer()
        index = self._index  # readers matter only when files can be evicted
        if index is not None and not index.begin_reads([key]):
            raise FileNotFoundError(errno.ENOENT, "evicted", path)
        try:
            fd = os.open(path, os.O_RDONLY | self._flags)
            try:
                # The open may block (a FIFO, a hung NFS): until here the rows are untouched.
                with self._row_access():
                    n = os.preadv(fd, [header, row], 0)
                    if n != size:  # header and checksum vouch for the bytes read
                        raise CorruptBlockError(
                            f"{path}: short file ({n} bytes read, expected {size})"
                        )
                    payload = row[: self.host.block_bytes]
                    check_block(key, header, payload, path, self._auth)
            finally:
                os.close(fd)
        finally:
            if index is not None:
                index.end_reads([key])
        self._record(key, size, reserved=False)
        return len(payload)

    def _remove(self, keys: Sequence[bytes]) -> list[bool]:
        """Unlink each key's block file and drop it from the size index."""
        present = []
        for key in keys:
            try:
                os.unlink(self.path_of(key))
                present.append(True)
            except FileNotFoundError:
                present.append(False)
            self._forget(key)
        return present

    def _probe(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key's block file is a regular file; a key found gone leaves the index."""
        found = []
        for key in keys:
            try:
                found.append(stat.S_ISREG(os.stat(self.path_of(key)).st_mode))
            except FileNotFoundError:
                found.append(False)
                self._forget(key)
            except (OSError, ValueError):  # as os.path.isfile: ENOTDIR, ELOOP, ...
                found.append(False)
        return found


def _failure(values: list[int], kind: int, message: str) -> tuple[int, OSError] | None:
    """The failing block of a compiled load op's ``(values, kind, message)`` and its OSError
    (None when it succeeded); pops the failing block's errno off ``values``.

    Raises:
        ValueError: the op refused its arguments (kind 1); RuntimeError for another kind.
    """
    if not kind:
        return None
    _raise_unless_os_error(kind, message)
    err = values.pop()
    return len(values), _os_error(err, message)


def _failures(errnos: list[int], kind: int, message: str) -> dict[int, OSError]:
    """The failed blocks of a compiled store op's ``(values, errnos, kind, message)``: index in
    the call → its OSError. The first one names the file of ``message``; the others name none
    (:func:`_naming` adds the block's path).

    Raises:
        ValueError: the op refused its arguments (kind 1); RuntimeError for another kind.
    """
    if not kind:
        return {}
    _raise_unless_os_error(kind, message)
    failed: dict[int, OSError] = {}
    for j, err in enumerate(errnos):
        if err:
            failed[j] = _os_error(err, "" if failed else message)
    return failed


def _raise_unless_os_error(kind: int, message: str) -> None:
    if kind != _OS_ERROR:
        _checked((0, kind, message))
        raise RuntimeError(f"fs op failed (error kind {kind}): {message}")


def _os_error(err: int, message: str) -> OSError:
    """The OSError of errno ``err``, naming the file of a compiled op's ``"<call>:<file>"``."""
    _call, _, filename = message.partition(":")
    if filename:
        return OSError(err, os.strerror(err), filename)
    return OSError(err, os.strerror(err))


def _naming(exc: OSError, path: str) -> str:
    """``exc`` as text, with the block's file path when the error does not name a file
    (a failed write or read: ENOSPC, EIO)."""
    return str(exc) if exc.filename else f"{exc}: {path!r}"


class _OverBound(OSError):
    """A block refused by the tier's own ``max_bytes`` (ENOSPC), not by the filesystem."""


def _no_room(size: int) -> OSError:
    return _OverBound(errno.ENOSPC, f"block file of {size} bytes does not fit in max_bytes")


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _make_dirs(leaf: str) -> None:
    """Create ``<hhh>/<hh>_g<group>`` with mode 0700 at both levels (makedirs applies the mode
    to the last level only)."""
    for path in (os.path.dirname(leaf), leaf):
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)


def _entries(path: str | os.PathLike[str], dirs: bool) -> list[os.DirEntry[str]]:
    """The subdirectories (``dirs``) or the regular files of ``path``; [] when it is gone."""
    try:
        with os.scandir(path) as entries:
            if dirs:
                return [e for e in entries if e.is_dir(follow_symlinks=False)]
            return [e for e in entries if e.is_file(follow_symlinks=False)]
    except FileNotFoundError:
        return []


def _group_of(leaf_name: str) -> int | None:
    _, _, group = leaf_name.partition("_g")
    return int(group) if group.isdigit() else None


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("fs tier: could not delete %s: %s", path, exc)


_CONFIG_KEYS = {
    "root_dir",
    "max_bytes",
    "io_threads",
    "io_timeout_s",
    "max_queued_jobs",
    "probe_timeout_s",
    "cache_salt",
    "name",
    "n_read_threads",
    "n_write_threads",
    *SECRET_KEYS,
}


def fs_tier_from_config(
    host: HostBuffer, mapper: FileMapper, cfg: dict[str, Any]
) -> FileSystemTier:
    """Build an fs tier from a ``secondary_tiers`` entry (``type`` already removed).

    Keys: ``root_dir`` (required), ``max_bytes`` (bytes of block files; default unbounded),
    ``io_threads`` (default 4, at most :data:`MAX_IO_THREADS`), ``io_timeout_s`` (seconds,
    default 30), ``max_queued_jobs`` (default 1024), ``probe_timeout_s`` (seconds per existence
    probe, default 2),
    ``cache_salt`` (tenant salt folded into the namespace), ``name`` (default ``"fs"``),
    ``auth_secret_env`` or ``auth_secret_file`` (the environment variable or file holding the
    secret of authenticated blocks, :func:`~kvcascade.tiers._block_format.block_auth`; default
    none). vLLM's ``n_read_threads`` + ``n_write_threads`` are accepted and summed into
    ``io_threads`` when that is absent.

    Raises:
        ConfigError: see :func:`check_fs_tier_config` and
            :func:`~kvcascade.tiers._block_format.block_auth` (raised before the directory is
            touched).
        OSError: the directory cannot be created.
    """
    args = check_fs_tier_config(cfg, host.block_bytes)
    if cfg.get("cache_salt"):
        mapper = mapper.with_salt(cfg["cache_salt"])
    auth = block_auth(cfg, "fs tier", mapper.namespace)
    return FileSystemTier(host, args.pop("root_dir"), mapper, auth=auth, **args)


def check_fs_tier_config(cfg: dict[str, Any], block_bytes: int) -> dict[str, Any]:
    """Validate an fs tier entry without touching the disk (``CascadeConfig`` calls it at
    construction, so a bad value fails there, not at ``open_cascade``).

    Returns:
        the :class:`FileSystemTier` keyword arguments (``root_dir`` included).

    Raises:
        ConfigError: missing ``root_dir``, an unknown key (named in the message), or a value of
            the wrong type or range (``io_threads=0``, ``max_bytes=-5``, ``name=""``, …).
    """
    unknown = sorted(set(cfg) - _CONFIG_KEYS)
    if unknown:
        raise ConfigError(f"unknown fs tier keys {unknown}; known: {sorted(_CONFIG_KEYS)}")
    if "root_dir" not in cfg:
        raise ConfigError("fs tier needs 'root_dir' (a directory path)")
    root = cfg["root_dir"]
    if not isinstance(root, (str, os.PathLike)) or not str(root) or "\0" in str(root):
        raise ConfigError(
            f"fs tier root_dir must be a non-empty directory path without NUL, got {root!r}"
        )

    def integer(key: str, default: int) -> int:
        return config_int(cfg, key, default, "fs tier")

    if "io_threads" in cfg:
        threads = integer("io_threads", 4)
    else:
        threads = integer("n_read_threads", 2) + integer("n_write_threads", 2)
    if threads > MAX_IO_THREADS:
        raise ConfigError(
            f"fs tier io_threads={threads} is more than {MAX_IO_THREADS} (one thread each; a "
            "few per device keep it busy)"
        )
    timeout = config_seconds(cfg, "io_timeout_s", 30.0, "fs tier")
    if "cache_salt" in cfg and not isinstance(cfg["cache_salt"], str):
        raise ConfigError(f"fs tier cache_salt must be a string, got {cfg['cache_salt']!r}")
    name = config_name(cfg, "fs", "fs tier")
    check_secret_config(cfg, "fs tier")
    max_bytes = integer("max_bytes", 0) if "max_bytes" in cfg else None
    if max_bytes is not None and max_bytes < file_size(block_bytes):
        raise ConfigError(
            f"fs tier max_bytes={max_bytes} cannot hold one block file "
            f"({file_size(block_bytes)} B for {block_bytes} B blocks)"
        )
    return {
        "root_dir": root,
        "name": name,
        "io_threads": threads,
        "io_timeout_s": timeout,
        "max_queued_jobs": integer("max_queued_jobs", 1024),
        "probe_timeout_s": config_seconds(cfg, "probe_timeout_s", FS_PROBE_TIMEOUT_S, "fs tier"),
        "max_bytes": max_bytes,
    }
