"""The primary tier's memory as one shared file in ``/dev/shm`` (vLLM's ``SharedOffloadRegion``).

One engine's worker processes and its scheduler map the same file
``<directory>/kvcascade_<instance_id>.mmap`` (``directory`` defaults to ``/dev/shm``). Row ``b``
holds block ``b`` of every worker, interleaved::

    row b = [ worker 0 slot | worker 1 slot | … | worker W-1 slot | padding to a page ]

so secondary tiers read and write a whole block as one row, and each worker carves its tensors
out of its own slot with :meth:`SharedOffloadRegion.create_next_worker_view`.

Life cycle (see ``docs/cpu-tier.md``):

1. **Stale cleanup** — every constructor first calls :func:`remove_stale_regions`: a region file
   whose owner record (sidecar ``kvcascade_<instance_id>.owner``) names a dead creator (pid +
   process start time) is unlinked, even while a lingering participant of that dead generation
   still holds its ``flock`` (it keeps its mapping); a file without a matching record only when
   no live process holds it (each participant keeps a shared ``flock`` while mapped) and it is
   over a minute old. The path must still name the same device and inode (an old generation
   never deletes a new one).
2. **Create or attach** — exactly one process wins ``open(O_CREAT | O_EXCL, 0600)``; it checks
   the free space for the file plus the sidecar's page (:class:`InsufficientSpaceError` names
   requested bytes, available bytes and path, and leaves no file), writes the owner record
   (itself, the geometry ``num_blocks`` / ``cpu_page_size`` / ``num_workers``,
   ``expected_participants``, and its own slot in the bitmap of attached participants), then
   reserves the file's space with ``posix_fallocate`` (``ENOSPC`` / ``EFBIG``:
   :class:`InsufficientSpaceError`; ``ftruncate`` where the file system has no fallocate). The
   others open the file and wait (bounded, :class:`DeadlineExceededError`, a ``TimeoutError``)
   until the record names it and the file has its size; a record of another geometry or
   ``expected_participants`` is a :class:`ConfigError` naming both; a file unlinked meanwhile
   makes them race again. Each joiner then claims its slot (its rank, or the scheduler's) in
   the record: a slot already taken is a :class:`ConfigError` (another engine with this
   instance_id seems alive).
3. **Map and prefault** — everyone maps the whole file shared. Pages are prefaulted with
   ``MADV_POPULATE_WRITE`` (value 23) where the kernel has it, else by a read-modify-write of one
   byte per page; a worker prefaults only its own slot of every row, the scheduler all of it.
4. **Early unlink** — with ``expected_participants`` given, the participant whose claim brings
   the record to that many attached unlinks the file and the sidecar (every participant holds
   the file open by then), so nothing can leak even on ``kill -9`` (the memory goes with the
   last mapping).
5. **Pinning** — on CUDA, workers register their mapping as pinned host memory in chunks of
   whole rows (:func:`kvcascade.tiers.cpu.register_host_memory`, as the asyncio API's host
   buffer), checking every return code; any failure unregisters what was registered and logs
   one warning (transfers still work, unpinned). Without CUDA this is skipped, logged once
   per process.
6. :meth:`SharedOffloadRegion.cleanup` (idempotent) unpins, drops views, unmaps, releases the
   lock and closes the file; the creator unlinks the file and sidecar if they are still its own,
   a joiner gives its slot in the record back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import glob
import logging
import mmap
import os
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from .._atomic import TEMP_SUFFIX_MAX_BYTES, replace_file
from .._errors import ConfigError, DeadlineExceededError, InsufficientSpaceError
from .._validate import check_int, check_number, is_int
from .cpu import PAGE_SIZE, register_host_memory, round_up, unregister_host_memory

logger = logging.getLogger(__name__)

DEFAULT_DIRECTORY = "/dev/shm"
#: ``madvise`` advice that populates (prefaults) pages writable; Linux ≥ 5.14.
MADV_POPULATE_WRITE = 23
_POLL_S = 0.005
# A region file without a matching owner record younger than this may be in creation.
_CREATION_GRACE_S = 60.0
_PREFIX = "kvcascade_"
# Longest file name a file system takes (NAME_MAX of Linux), in bytes.
_NAME_MAX = 255
# Sidecar record: magic, creator pid, creator start time (clock ticks after boot), st_dev, st_ino
# of the region file, num_blocks, cpu_page_size, num_workers, expected_participants (0: None);
# then the bitmap of attached participants, num_workers // 8 + 1 bytes, little-endian (bit r:
# rank r, bit num_workers: the scheduler).
_OWNER = struct.Struct("<8sqQQQqqqq")
_MAGIC = b"KVCSHM02"
_cuda_skip_logged = False


@dataclass(frozen=True)
class RegionGeometry:
    """Sizes of a shared region derived from the configuration (vLLM's ``kv_offload/cpu/spec.py``).

    Attributes:
        cpu_page_size: bytes of one worker's slot in a row (worker bytes × blocks per chunk).
        block_bytes: KV bytes of one block across all workers (``cpu_page_size × num_workers``).
        row_stride: ``block_bytes`` rounded up to the page size (bytes between rows).
        num_blocks: rows that fit in ``cpu_bytes_to_use`` (``cpu_bytes_to_use // row_stride``).
    """

    cpu_page_size: int
    block_bytes: int
    row_stride: int
    num_blocks: int

    @property
    def nbytes(self) -> int:
        """Size of the region file in bytes."""
        return self.num_blocks * self.row_stride


def region_geometry(
    cpu_bytes_to_use: int | None,
    worker_bytes_per_block: int,
    num_workers: int = 1,
    blocks_per_chunk: int = 1,
) -> RegionGeometry:
    """Size the primary tier from the configuration, as vLLM's ``kv_offload/cpu/spec.py``.

    Args:
        cpu_bytes_to_use: host-memory budget in bytes, total across all workers.
        worker_bytes_per_block: KV bytes of one GPU block on one worker (all its layers).
        num_workers: workers sharing a row (the world size of the engine).
        blocks_per_chunk: GPU blocks per primary-tier block.

    Returns:
        The geometry; everything 0 when ``worker_bytes_per_block`` or ``num_workers`` is 0 (an
        empty cache, still valid).

    Raises:
        ConfigError: ``cpu_bytes_to_use`` missing, zero, negative or below one row (the message
            says what to set), a size that is not a non-negative int, or ``blocks_per_chunk``
            below 1.
    """
    if cpu_bytes_to_use is not None and not is_int(cpu_bytes_to_use):
        raise ConfigError(f"cpu_bytes_to_use must be an integer, got {cpu_bytes_to_use!r}")
    if not cpu_bytes_to_use or cpu_bytes_to_use < 0:
        raise ConfigError(
            f"cpu_bytes_to_use must be specified as a positive number of bytes (got "
            f"{cpu_bytes_to_use!r}): set cpu_bytes_to_use in the kvcascade config / vLLM "
            "kv_connector_extra_config to the host memory for the CPU tier, summed over workers"
        )
    check_int("worker_bytes_per_block", worker_bytes_per_block, 0)
    check_int("num_workers", num_workers, 0)
    check_int("blocks_per_chunk", blocks_per_chunk, 1)
    if worker_bytes_per_block == 0 or num_workers == 0:
        return RegionGeometry(0, 0, 0, 0)
    cpu_page_size = worker_bytes_per_block * blocks_per_chunk
    block_bytes = cpu_page_size * num_workers
    row_stride = round_up(block_bytes, PAGE_SIZE)
    if cpu_bytes_to_use < row_stride:
        raise ConfigError(
            f"cpu_bytes_to_use ({cpu_bytes_to_use}) is below one block row of {row_stride} bytes "
            f"({num_workers} worker(s) x {cpu_page_size} bytes, rounded up to the page size): set "
            f"cpu_bytes_to_use to at least {row_stride} (one row per CPU-tier block)"
        )
    return RegionGeometry(cpu_page_size, block_bytes, row_stride, cpu_bytes_to_use // row_stride)


def region_path(instance_id: str, directory: str = DEFAULT_DIRECTORY) -> str:
    """Path of the region file of ``instance_id``.

    Raises:
        ConfigError: ``instance_id`` is not a string, is empty, contains a path separator or
            NUL, or is so long that a file name of the region (the sidecar's temp file
            ``kvcascade_<instance_id>.owner_<pid>_<random>.tmp`` is the longest) would exceed
            255 bytes; ``directory`` is not a string.
    """
    if not isinstance(instance_id, str) or not instance_id or {"/", "\0"} & set(instance_id):
        raise ConfigError(f"instance_id must be a non-empty file-name part, got {instance_id!r}")
    if not isinstance(directory, str):
        raise ConfigError(f"directory must be a str path, got {directory!r}")
    limit = _NAME_MAX - len(f"{_PREFIX}.owner") - TEMP_SUFFIX_MAX_BYTES
    if len(os.fsencode(instance_id)) > limit:
        raise ConfigError(
            f"instance_id {instance_id!r:.60} is {len(os.fsencode(instance_id))} bytes: the "
            f"region's file names (kvcascade_<instance_id>.mmap / .owner and the owner record's "
            f"temp file) would exceed {_NAME_MAX} bytes; use at most {limit} bytes"
        )
    return os.path.join(directory, f"{_PREFIX}{instance_id}.mmap")


def _sidecar_path(path: str) -> str:
    return path[: -len(".mmap")] + ".owner"


def process_start_time(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks after boot (``/proc/<pid>/stat`` field 22),
    or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # Fields after the command name (which may contain spaces) start at field 3.
    return int(data[data.rindex(b")") + 2 :].split()[19])


def _owner_alive(pid: int, start_time: int) -> bool:
    return pid > 0 and process_start_time(pid) == start_time


@dataclass(frozen=True)
class _OwnerRecord:
    """The sidecar's record: who created which region file, for which geometry, and which
    participants have attached (``attached``: bit ``r`` for rank ``r``, bit ``num_workers`` for
    the scheduler)."""

    pid: int
    start_time: int
    st_dev: int
    st_ino: int
    num_blocks: int
    cpu_page_size: int
    num_workers: int
    expected_participants: int | None
    attached: int

    @property
    def geometry(self) -> tuple[int, int, int, int | None]:
        """``(num_blocks, cpu_page_size, num_workers, expected_participants)``."""
        return (self.num_blocks, self.cpu_page_size, self.num_workers, self.expected_participants)

    def names(self, st: os.stat_result) -> bool:
        """True if the record is about the file of ``st`` (same device and inode)."""
        return (self.st_dev, self.st_ino) == (st.st_dev, st.st_ino)

    def pack(self) -> bytes:
        """The record as stored in the sidecar."""
        head = _OWNER.pack(
            _MAGIC,
            self.pid,
            self.start_time,
            self.st_dev,
            self.st_ino,
            *self.geometry[:3],
            self.expected_participants or 0,
        )
        return head + self.attached.to_bytes(self.num_workers // 8 + 1, "little")

    @classmethod
    def unpack(cls, data: bytes) -> _OwnerRecord | None:
        """The record in ``data``, or None if it is not a whole record of this format."""
        if len(data) < _OWNER.size:
            return None
        magic, pid, start, dev, ino, blocks, page, workers, expected = _OWNER.unpack_from(data)
        if magic != _MAGIC or workers < 1 or len(data) != _OWNER.size + workers // 8 + 1:
            return None
        attached = int.from_bytes(data[_OWNER.size :], "little")
        return cls(pid, start, dev, ino, blocks, page, workers, expected or None, attached)


def _describe(geometry: tuple[int, int, int, int | None]) -> str:
    blocks, page, workers, expected = geometry
    return (
        f"num_blocks={blocks}, cpu_page_size={page}, num_workers={workers}, "
        f"expected_participants={expected}"
    )


def _read_owner(path: str) -> _OwnerRecord | None:
    """The record of sidecar ``path``, or None if it is absent or not a valid record."""
    try:
        with open(path, "rb") as f:
            return _OwnerRecord.unpack(f.read())
    except OSError:
        return None


def _remove_record(sidecar: str, st: os.stat_result) -> bool:
    """Unlink ``sidecar`` if its record is about the file of ``st``; True if it was unlinked."""
    owner = _read_owner(sidecar)
    if owner is None or not owner.names(st):
        return False
    with contextlib.suppress(FileNotFoundError):
        os.unlink(sidecar)
        return True
    return False


def _same_file(path: str, st: os.stat_result) -> bool:
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)


def remove_stale_regions(directory: str = DEFAULT_DIRECTORY) -> list[str]:
    """Unlink region files (and their sidecars) left behind by crashed engines.

    A region whose owner record names it is stale when its recorded creator (pid + start time)
    is dead, even while a lingering participant of that dead generation still holds its
    ``flock``: that participant keeps its mapping (unlinking frees nothing under it), and a new
    generation with the same instance_id gets a fresh file instead of joining the dead one. A
    region without a matching record (its creator may not have written it yet) is stale only
    when no live process holds its ``flock`` (every participant holds a shared lock while it
    maps the file; the kernel drops it when the process dies, ``kill -9`` included) and it is
    older than a minute. Before unlinking, the path must still name the file examined (same
    ``st_dev``/``st_ino``), so a region created meanwhile by a new generation is never removed.
    Sidecars whose region is gone and whose owner is dead are removed too.

    Returns:
        The paths removed.
    """
    removed: list[str] = []
    for path in glob.glob(os.path.join(glob.escape(directory), f"{_PREFIX}*.mmap")):
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            owner = _read_owner(_sidecar_path(path))
            if owner is not None and owner.names(st):
                if _owner_alive(owner.pid, owner.start_time):
                    continue  # its creator is alive
            else:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # no record yet and a live participant maps it
                if time.time() - st.st_mtime < _CREATION_GRACE_S:
                    continue  # no owner record yet: possibly being created by a live process
            if _same_file(path, st):
                os.unlink(path)
                removed.append(path)
                if _remove_record(_sidecar_path(path), st):
                    removed.append(_sidecar_path(path))
        finally:
            os.close(fd)
    for sidecar in glob.glob(os.path.join(glob.escape(directory), f"{_PREFIX}*.owner")):
        owner = _read_owner(sidecar)
        region = sidecar[: -len(".owner")] + ".mmap"
        if (
            owner is not None
            and not os.path.exists(region)
            and not _owner_alive(owner.pid, owner.start_time)
        ):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(sidecar)
                removed.append(sidecar)
    if removed:
        logger.warning("removed %d stale kvcascade region file(s): %s", len(removed), removed)
    return removed


def _populate_write(mm: mmap.mmap, start: int, length: int) -> None:
    """``madvise(MADV_POPULATE_WRITE)`` over ``[start, start + length)`` (page-aligned start)."""
    mm.madvise(MADV_POPULATE_WRITE, start, length)


def _log_cuda_skip_once() -> None:
    global _cuda_skip_logged
    if not _cuda_skip_logged:
        _cuda_skip_logged = True
        logger.info("CUDA not available: the shared offload region is not pinned")


class SharedOffloadRegion:
    """The primary tier's host memory, shared by one engine's workers and its scheduler.

    Offers the :class:`~kvcascade.tiers.cpu.HostBuffer` interface (``num_blocks``,
    ``block_bytes``, ``row_bytes``, ``memoryview``, ``row(i)``, ``tensor()``, ``close()``), so
    the cascade can use either. The module docstring describes the life cycle.

    Args:
        instance_id: names the file ``kvcascade_<instance_id>.mmap``; the same for every
            participant of one engine.
        num_blocks: rows, ``> 0``.
        cpu_page_size: bytes of one worker's slot in a row, ``> 0``.
        num_workers: slots per row, ``>= 1``.
        rank: this worker's slot, or None for the scheduler side (maps, prefaults everything,
            never pins, has no worker views).
        expected_participants: number of processes that will map the region (workers +
            scheduler, at most ``num_workers + 1``); once that many have attached, the file is
            unlinked. None: the file stays until the creator's :meth:`cleanup` (or a later
            stale cleanup). All participants must give the same value.
        directory: where the file lives (tests use a private tmpfs directory).
        wait_timeout_s: seconds (finite, ``>= 0``) a non-creator waits for the creator to
            record and size the file.
        pin: register the mapping as pinned CUDA host memory (default: when ``rank`` is set).

    Attributes:
        path: the file path. is_creator: this process created the file. row_stride / row_bytes:
        bytes between rows (a multiple of the page size). block_bytes: KV bytes of one block
        across all workers (``cpu_page_size × num_workers``). nbytes: file size.

    Raises:
        ConfigError: a bad argument (a size, ``rank``, ``expected_participants``,
            ``wait_timeout_s`` not a finite number >= 0, ``pin``, ``instance_id``, ``directory``:
            refused before any file is touched); a region of this instance_id recorded with
            another geometry or ``expected_participants``; this participant's slot (rank, or
            the scheduler's) already taken.
        InsufficientSpaceError: the file system lacks the space (no file is left behind).
        DeadlineExceededError: the creator did not record and size the file within
            ``wait_timeout_s``.
        OSError: mapping or ``madvise`` failed (other than ``EINVAL`` from the probe).
    """

    def __init__(
        self,
        instance_id: str,
        num_blocks: int,
        cpu_page_size: int,
        num_workers: int = 1,
        rank: int | None = None,
        *,
        expected_participants: int | None = None,
        directory: str = DEFAULT_DIRECTORY,
        wait_timeout_s: float = 30.0,
        pin: bool | None = None,
    ) -> None:
        check_int("num_blocks", num_blocks, 1)
        check_int("cpu_page_size", cpu_page_size, 1)
        check_int("num_workers", num_workers, 1)
        if rank is not None and not (is_int(rank) and 0 <= rank < num_workers):
            raise ConfigError(f"rank must be an int in [0, {num_workers}) or None, got {rank!r}")
        if expected_participants is not None:
            check_int("expected_participants", expected_participants, 1)
            if expected_participants > num_workers + 1:
                raise ConfigError(
                    f"expected_participants must be at most num_workers + 1 (the workers and "
                    f"the scheduler) = {num_workers + 1}, got {expected_participants}"
                )
        wait_timeout_s = check_number("wait_timeout_s", wait_timeout_s, 0)
        if pin is not None and not isinstance(pin, bool):
            raise ConfigError(f"pin must be a bool or None, got {pin!r}")
        self.path = region_path(instance_id, directory)
        self.num_blocks = num_blocks
        self.cpu_page_size = cpu_page_size
        self.num_workers = num_workers
        self.rank = rank
        self.block_bytes = cpu_page_size * num_workers
        self.row_stride = round_up(self.block_bytes, PAGE_SIZE)
        self.nbytes = num_blocks * self.row_stride
        self.is_creator = False
        self._geometry = (num_blocks, cpu_page_size, num_workers, expected_participants)
        # This participant's bit in the owner record's bitmap; set while ``_claimed``.
        self._slot = 1 << (num_workers if rank is None else rank)
        self._claimed = False
        self._cursor = 0
        self._fd: int | None = None
        self._st: os.stat_result | None = None
        self._mmap: mmap.mmap | None = None
        self._pinned: list[int] = []
        self._closed = False
        self._view = memoryview(b"")
        self._tensor = torch.empty((0, self.row_stride), dtype=torch.int8)
        remove_stale_regions(directory)
        self._open(wait_timeout_s)
        try:
            assert self._fd is not None
            self._mmap = mmap.mmap(self._fd, self.nbytes, mmap.MAP_SHARED)
            self._view = memoryview(self._mmap)
            self._tensor = torch.frombuffer(self._mmap, dtype=torch.int8).view(
                num_blocks, self.row_stride
            )
            self._prefault()
            if pin if pin is not None else rank is not None:
                self._pin()
        except BaseException:
            self.cleanup()
            raise

    # -- creation ------------------------------------------------------------------------------
    def _open(self, wait_timeout_s: float) -> None:
        """Create or attach to the file; afterwards ``_fd`` is sized and locked shared, the path
        names it (unless the last expected participant unlinked it), and this participant holds
        its slot in the owner record."""
        deadline = time.monotonic() + wait_timeout_s
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                creator = True
            except FileExistsError:
                try:
                    fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW)
                except FileNotFoundError:
                    continue  # unlinked between our two opens: race again
                creator = False
            fcntl.flock(fd, fcntl.LOCK_SH)
            st = os.fstat(fd)
            if not _same_file(self.path, st):
                os.close(fd)  # a stale cleanup removed it before we locked it
                continue
            self._fd, self._st, self.is_creator = fd, st, creator
            try:
                if creator:
                    self._create()
                    return
                if self._join(deadline):
                    return
            except BaseException:
                self._release_fd(unlink=creator)
                raise
            self._release_fd(unlink=False)  # unlinked or replaced meanwhile: race again

    def _create(self) -> None:
        """Check the space (the file and the sidecar's page), write the owner record (geometry,
        this participant's slot), then reserve the file's space with ``posix_fallocate`` (or
        size it with ``ftruncate`` where the file system has no fallocate).

        Raises:
            InsufficientSpaceError: the file system lacks the space (also ``ENOSPC`` / ``EFBIG``
                from ``posix_fallocate``).
            OSError: writing the record or sizing the file failed otherwise.
        """
        assert self._fd is not None and self._st is not None
        pid = os.getpid()
        record = _OwnerRecord(
            pid,
            process_start_time(pid) or 0,
            self._st.st_dev,
            self._st.st_ino,
            *self._geometry,
            attached=self._slot,
        )
        data = record.pack()
        record_bytes = round_up(len(data), PAGE_SIZE)
        if self.nbytes + record_bytes > self._available():
            raise self._no_space(record_bytes)
        # Before sizing: a joiner accepts the file only once the record names it.
        replace_file(_sidecar_path(self.path), data)
        self._claimed = True
        try:
            # Allocates every page now: a prefault (or a peer's) cannot run out of space later.
            os.posix_fallocate(self._fd, 0, self.nbytes)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EFBIG):
                raise self._no_space(record_bytes) from exc
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(self._fd, self.nbytes)  # no fallocate on this file system
        self._unlink_if_complete(record)

    def _available(self) -> int:
        """Bytes free for us on the file system of the region (``statvfs``)."""
        vfs = os.statvfs(os.path.dirname(self.path))
        return vfs.f_bavail * vfs.f_frsize

    def _no_space(self, record_bytes: int) -> InsufficientSpaceError:
        return InsufficientSpaceError(
            f"Insufficient space for the shared offload region {self.path}: requested "
            f"{self.nbytes} bytes (+ {record_bytes} for its owner record), available "
            f"{self._available()} bytes in {os.path.dirname(self.path)} (lower "
            "cpu_bytes_to_use or enlarge the file system)"
        )

    def _join(self, deadline: float) -> bool:
        """Wait until the creator has recorded and sized the file, check that the record holds
        this participant's geometry, and claim this participant's slot.

        Returns:
            False if the path stopped naming the file meanwhile (its creator failed and removed
            it, or a stale cleanup did, maybe with a new file there already): nothing claimed.

        Raises:
            ConfigError: the record holds another geometry or ``expected_participants``, or
                another participant holds this slot.
            DeadlineExceededError: the file was not recorded and sized before ``deadline``
                (``time.monotonic()`` seconds).
        """
        assert self._fd is not None and self._st is not None
        sidecar = _sidecar_path(self.path)
        while _same_file(self.path, self._st):
            owner = _read_owner(sidecar)
            if owner is not None and owner.names(self._st):
                if owner.geometry != self._geometry:
                    raise ConfigError(
                        f"{self.path} was created for {_describe(owner.geometry)}; this "
                        f"participant has {_describe(self._geometry)}: all participants must "
                        "use one geometry per instance_id (and one expected_participants)"
                    )
                if os.fstat(self._fd).st_size == self.nbytes and self._claim_slot():
                    return True
            if time.monotonic() >= deadline:
                raise DeadlineExceededError(
                    f"{self.path} was not recorded and sized by its creator within wait_timeout_s"
                )
            time.sleep(_POLL_S)
        return False

    @contextlib.contextmanager
    def _locked_record(self) -> Iterator[tuple[int, _OwnerRecord] | None]:
        """The sidecar's descriptor, locked exclusively, with its record, if the sidecar path
        still names it and the record is about this region's file; else None."""
        assert self._st is not None
        sidecar = _sidecar_path(self.path)
        try:
            fd = os.open(sidecar, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            yield None
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            st = os.fstat(fd)
            owner = _OwnerRecord.unpack(os.pread(fd, st.st_size, 0))
            if owner is not None and owner.names(self._st) and _same_file(sidecar, st):
                yield fd, owner
            else:
                yield None
        finally:
            os.close(fd)  # also drops the lock

    def _claim_slot(self) -> bool:
        """Mark this participant attached in the owner record; the last expected participant
        unlinks the file and the sidecar.

        Returns:
            False if the record is gone or no longer about this file (nothing claimed).

        Raises:
            ConfigError: another participant holds this slot (another engine with this
                instance_id, or a duplicate rank).
        """
        with self._locked_record() as locked:
            if locked is None:
                return False
            fd, owner = locked
            if owner.attached & self._slot:
                who = "the scheduler (rank None)" if self.rank is None else f"rank {self.rank}"
                raise ConfigError(
                    f"{self.path}: {who} is already attached (the region was created by pid "
                    f"{owner.pid}): another engine with this instance_id seems alive; stop it "
                    "or give this engine its own instance_id"
                )
            owner = dataclasses.replace(owner, attached=owner.attached | self._slot)
            os.pwrite(fd, owner.pack(), 0)
            self._claimed = True
            self._unlink_if_complete(owner)
        return True

    def _unlink_if_complete(self, owner: _OwnerRecord) -> None:
        """Unlink the file and the sidecar once ``expected_participants`` have attached."""
        expected = owner.expected_participants
        if expected is not None and owner.attached.bit_count() >= expected:
            self._unlink_files()

    def _unlink_files(self) -> None:
        """Unlink the file and the sidecar, each only if it is still this region's."""
        assert self._st is not None
        if _same_file(self.path, self._st):
            os.unlink(self.path)
        _remove_record(_sidecar_path(self.path), self._st)

    def _prefault(self) -> None:
        """Fault in the pages this participant uses (its slots, or everything)."""
        assert self._mmap is not None
        ranges = self._prefault_ranges()
        try:
            _populate_write(self._mmap, 0, PAGE_SIZE)  # probe: does the kernel know the advice?
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self._touch_pages(ranges)
            return
        for start, length in ranges:
            _populate_write(self._mmap, start, length)

    def _prefault_ranges(self) -> list[tuple[int, int]]:
        """Page-aligned ``(start, length)`` ranges to prefault: the whole file for the scheduler
        or a worker whose slots span whole rows, else this worker's slot of every row."""
        if self.rank is None or self.num_workers == 1:
            return [(0, self.nbytes)]
        ranges = []
        for row in range(self.num_blocks):
            begin = row * self.row_stride + self.rank * self.cpu_page_size
            start = begin - begin % PAGE_SIZE
            end = min(round_up(begin + self.cpu_page_size, PAGE_SIZE), self.nbytes)
            ranges.append((start, end - start))
        return ranges

    def _touch_pages(self, ranges: list[tuple[int, int]]) -> None:
        """Fallback prefault: rewrite one byte per page with its own value (peers' bytes are
        kept; run before any KV data is written)."""
        pages = np.frombuffer(self._view, dtype=np.uint8)
        for start, length in ranges:
            idx = np.arange(start, start + length, PAGE_SIZE)
            pages[idx] = pages[idx]
        del pages

    def _pin(self) -> None:
        """Register the mapping as pinned CUDA host memory, row-aligned chunks, all or nothing."""
        if not torch.cuda.is_available():
            _log_cuda_skip_once()
            return
        self._pinned = register_host_memory(
            self._tensor.data_ptr(), self.nbytes, self.row_stride, str(self.path)
        )

    # -- views -----------------------------------------------------------------------------
    @property
    def row_bytes(self) -> int:
        """Bytes between rows (``row_stride``), a multiple of the page size."""
        return self.row_stride

    @property
    def memoryview(self) -> memoryview:
        """The whole region as a flat writable ``memoryview`` of ``nbytes`` bytes (zero-copy)."""
        return self._view

    def create_kv_memoryview(self) -> memoryview:
        """Zero-copy ``memoryview`` of shape ``(num_blocks, row_stride)``, format ``B``: block
        ``b`` is row ``b`` (what secondary tiers address)."""
        return self._view.cast("B", (self.num_blocks, self.row_stride))

    def row(self, block_id: int) -> memoryview:
        """Writable zero-copy view of the ``block_bytes`` KV bytes of row ``block_id``.

        Raises:
            IndexError: ``block_id`` outside ``[0, num_blocks)``.
        """
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block_id {block_id} outside [0, {self.num_blocks})")
        start = block_id * self.row_stride
        return self._view[start : start + self.block_bytes]

    def tensor(self) -> torch.Tensor:
        """int8 tensor ``(num_blocks, block_bytes)``, strides ``(row_stride, 1)``, zero-copy."""
        return self._tensor[:, : self.block_bytes]

    def create_next_worker_view(self, tensor_page: int) -> torch.Tensor:
        """Carve the next ``tensor_page`` bytes of this worker's slot out of every row.

        Returns:
            int8 tensor ``(num_blocks, tensor_page)``, strides ``(row_stride, 1)``, starting at
            byte ``rank × cpu_page_size + cursor`` of row 0; the cursor then advances by
            ``tensor_page`` (same contract as vLLM's ``create_next_worker_view``).

        Raises:
            ConfigError: ``tensor_page`` is not positive, the view would exceed the worker area
                end (the cursor is left unchanged), or this is the scheduler's region.
        """
        if self.rank is None:
            raise ConfigError("the scheduler's region (rank None) has no worker slot")
        check_int("tensor_page", tensor_page, 1)
        end = self._cursor + tensor_page
        if end > self.cpu_page_size:
            raise ConfigError(
                f"a view of {tensor_page} bytes at cursor {self._cursor} exceeds worker area end "
                f"({self.cpu_page_size} bytes per slot)"
            )
        start = self.rank * self.cpu_page_size + self._cursor
        self._cursor = end
        return self._tensor[:, start : start + tensor_page]

    # -- teardown --------------------------------------------------------------------------
    def _release_fd(self, unlink: bool) -> None:
        """Close the file (dropping the lock); with ``unlink`` also unlink the files, else give
        back this participant's slot in the owner record."""
        if self._fd is None:
            return
        if unlink:
            self._unlink_files()
        elif self._claimed:
            with self._locked_record() as locked:
                if locked is not None:
                    fd, owner = locked
                    owner = dataclasses.replace(owner, attached=owner.attached & ~self._slot)
                    os.pwrite(fd, owner.pack(), 0)
        self._claimed = False
        os.close(self._fd)  # also drops the flock
        self._fd = None

    def cleanup(self) -> None:
        """Unpin, drop views, unmap, unlock and close; the creator also unlinks its files.

        Idempotent. Views handed out earlier must be dropped by their holders before the
        mapping can actually go (until then it stays mapped, never freed under them).
        """
        if self._closed:
            return
        self._closed = True
        unregister_host_memory(self._pinned, str(self.path))
        self._pinned = []
        if self._mmap is not None:
            self._tensor = torch.empty((0, self.row_stride), dtype=torch.int8)
            self._view.release()
            # BufferError: a caller still holds a view; the mapping goes when it is collected.
            with contextlib.suppress(BufferError):
                self._mmap.close()
            self._mmap = None
        self._release_fd(unlink=self.is_creator)

    close = cleanup

    @property
    def closed(self) -> bool:
        """True after :meth:`cleanup`."""
        return self._closed
