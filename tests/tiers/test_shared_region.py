"""SharedOffloadRegion on real mmaps in /dev/shm and real processes: the scenarios of vLLM's
``tests/v1/kv_offload/cpu/test_shared_offload_region.py`` (named per test), the crash-safety we add
(vLLM #54002, #57303; docs/cpu-tier.md), sizing (vLLM's ``kv_offload/cpu/spec.py``) and zero-copy
views."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import mmap
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvcascade import ConfigError
from kvcascade.tiers import shm
from kvcascade.tiers.cpu import round_up
from kvcascade.tiers.shm import (
    InsufficientSpaceError,
    SharedOffloadRegion,
    region_geometry,
    remove_stale_regions,
)

PAGE = mmap.PAGESIZE


@pytest.fixture
def shm_dir() -> Iterator[str]:
    """A private directory on /dev/shm (tmpfs), removed afterwards."""
    path = f"/dev/shm/kvc_test_{uuid.uuid4().hex[:10]}"
    os.mkdir(path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def small_tmpfs(tmp_path) -> Iterator[str]:
    """A 1 MiB tmpfs of our own (needs root and permission to mount)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield str(mount)
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def write_record(
    path: str, pid: int, start_time: int, blocks: int = 4, page: int = PAGE, workers: int = 1
) -> None:
    """Write the owner record of region file ``path`` (module's own format), as a creator of
    that geometry does before sizing the file."""
    st = os.stat(path)
    record = shm._OwnerRecord(pid, start_time, st.st_dev, st.st_ino, blocks, page, workers, None, 0)
    with open(path[: -len(".mmap")] + ".owner", "wb") as f:
        f.write(record.pack())


def region(
    shm_dir: str,
    rank: int | None = 0,
    workers: int = 1,
    page: int = PAGE,
    blocks: int = 4,
    iid: str = "r",
    **kw,
) -> SharedOffloadRegion:
    return SharedOffloadRegion(iid, blocks, page, workers, rank, directory=shm_dir, **kw)


# -- worker views (vLLM test_create_next_worker_view_*) -----------------------------------------


def test_create_next_worker_view_shape_and_stride(shm_dir: str) -> None:
    """vLLM test_create_next_worker_view_shape_and_stride: view shape (num_blocks, tensor_page),
    strides (cpu_page × workers, 1), int8."""
    r = region(shm_dir, rank=0, workers=2)
    view = r.create_next_worker_view(1024)
    assert view.shape == (4, 1024) and view.stride() == (2 * PAGE, 1)
    assert view.dtype == torch.int8
    del view
    r.cleanup()


def test_create_next_worker_view_storage_offset_rank0(shm_dir: str) -> None:
    """vLLM test_create_next_worker_view_storage_offset_rank0: rank 0's first view starts at
    byte 0."""
    r = region(shm_dir, rank=0, workers=2)
    assert r.create_next_worker_view(64).storage_offset() == 0
    r.cleanup()


def test_create_next_worker_view_storage_offset_rank1(shm_dir: str) -> None:
    """vLLM test_create_next_worker_view_storage_offset_rank1: rank 1's first view starts at
    cpu_page."""
    r = region(shm_dir, rank=1, workers=2)
    assert r.create_next_worker_view(64).storage_offset() == PAGE
    r.cleanup()


def test_create_next_worker_view_row_stride_with_multiple_workers(shm_dir: str) -> None:
    """vLLM test_create_next_worker_view_row_stride_with_multiple_workers: 4 workers → row
    stride 4 × cpu_page."""
    r = region(shm_dir, rank=3, workers=4)
    assert r.row_stride == 4 * PAGE
    assert r.create_next_worker_view(8).stride() == (4 * PAGE, 1)
    r.cleanup()


def test_create_next_worker_view_cursor_advances_and_exact_fill(shm_dir: str) -> None:
    """vLLM test_create_next_worker_view_cursor_advances /
    test_create_next_worker_view_exact_fill_succeeds: the cursor advances by each page until exactly
    the slot end."""
    r = region(shm_dir, rank=1, workers=2)
    offsets = [r.create_next_worker_view(p).storage_offset() for p in (1024, 1024, 2048)]
    assert offsets == [PAGE, PAGE + 1024, PAGE + 2048]
    r.cleanup()


def test_create_next_worker_view_overflow(shm_dir: str) -> None:
    """vLLM test_create_next_worker_view_single_overflow_raises /
    test_create_next_worker_view_cumulative_overflow_raises /
    test_create_next_worker_view_overflow_does_not_mutate_cursor: a single or cumulative overflow
    raises (mentioning the worker area end) without moving the cursor."""
    r = region(shm_dir, rank=0, workers=2)
    with pytest.raises(ConfigError, match="exceeds worker area end"):
        r.create_next_worker_view(PAGE + 1)
    r.create_next_worker_view(PAGE - 8)
    with pytest.raises(ConfigError, match="exceeds worker area end"):
        r.create_next_worker_view(16)
    assert r.create_next_worker_view(8).storage_offset() == PAGE - 8  # cursor unchanged
    r.cleanup()


def test_create_next_worker_view_write_visible_in_raw_mmap(shm_dir: str) -> None:
    """vLLM test_create_next_worker_view_write_visible_in_raw_mmap /
    test_create_next_worker_view_multi_tensor_layout: writes through two views of one worker land at
    row·stride + offset, the tensors consecutive within each row; the raw file shows them."""
    r = region(shm_dir, rank=0, workers=2)
    a, b = r.create_next_worker_view(16), r.create_next_worker_view(16)
    a[2].fill_(5)
    b[2].fill_(6)
    with open(r.path, "rb") as f:
        raw = f.read()
    row = 2 * r.row_stride
    assert raw[row : row + 16] == b"\x05" * 16 and raw[row + 16 : row + 32] == b"\x06" * 16
    assert raw.count(b"\x05") == 16 and raw.count(b"\x06") == 16
    del a, b
    r.cleanup()


def test_create_next_worker_view_worker_isolation(shm_dir: str) -> None:
    """vLLM test_create_next_worker_view_worker_isolation: two workers' slots do not overlap."""
    r0 = region(shm_dir, rank=0, workers=2)
    r1 = region(shm_dir, rank=1, workers=2)
    v0, v1 = r0.create_next_worker_view(PAGE), r1.create_next_worker_view(PAGE)
    v0.fill_(1)
    v1.fill_(2)
    assert bool((v0 == 1).all()) and bool((v1 == 2).all())
    del v0, v1
    r1.cleanup()
    r0.cleanup()


# -- creation, files, cleanup (vLLM test_creator_*, test_file_*, test_cleanup_*) -----------------


def test_creator_and_joiner_flags_file_and_size(shm_dir: str) -> None:
    """vLLM test_creator_flag_set_on_first_open / test_joiner_flag_not_set /
    test_file_exists_after_construction / test_file_has_correct_size: first opener creates (mode
    0600), the second joins; size = blocks × stride."""
    r0 = region(shm_dir, rank=0, workers=2)
    r1 = region(shm_dir, rank=1, workers=2)
    assert r0.is_creator and not r1.is_creator
    st = os.stat(r0.path)
    assert st.st_size == 4 * 2 * PAGE and st.st_mode & 0o777 == 0o600
    assert os.path.basename(r0.path) == "kvcascade_r.mmap"
    r1.cleanup()
    r0.cleanup()


def test_cleanup_effects_and_idempotence(shm_dir: str) -> None:
    """vLLM test_cleanup_creator_all_effects / test_cleanup_non_creator_all_effects /
    test_cleanup_idempotent / test_cleanup_after_create_next_worker_view_releases_mmap: joiner
    cleanup keeps the file, creator cleanup removes it (and its owner record); cleanup twice is
    fine, also after views were handed out."""
    r0 = region(shm_dir, rank=0, workers=2)
    r1 = region(shm_dir, rank=1, workers=2)
    view = r1.create_next_worker_view(8)
    del view
    r1.cleanup()
    assert os.path.exists(r0.path) and r1.closed
    r0.cleanup()
    r0.cleanup()
    r1.cleanup()
    assert os.listdir(shm_dir) == []


# -- prefault (vLLM test_madvise_*, test_fallback_populate_*) -------------------------------------


def test_madvise_success_selects_madvise_population(shm_dir: str, monkeypatch) -> None:
    """vLLM test_madvise_success_selects_madvise_population: with MADV_POPULATE_WRITE, one probe
    plus one call per row of a ranked region (its slot only) and no fallback."""
    calls = []
    monkeypatch.setattr(shm, "_populate_write", lambda mm, s, n: calls.append((s, n)))
    monkeypatch.setattr(SharedOffloadRegion, "_touch_pages", lambda *a: pytest.fail("fallback"))
    r = region(shm_dir, rank=1, workers=2)
    assert calls == [(0, PAGE)] + [(b * 2 * PAGE + PAGE, PAGE) for b in range(4)]
    r.cleanup()


@pytest.mark.parametrize("rank", [1, None])
def test_madvise_einval_selects_fallback(shm_dir: str, monkeypatch, rank: int | None) -> None:
    """vLLM test_madvise_einval_selects_fallback_for_ranked_region /
    test_madvise_einval_selects_fallback_for_unranked_region: EINVAL from the probe → the touch
    fallback over every ranked slot, or one range covering the whole unranked region."""

    def einval(mm, s, n):
        raise OSError(errno.EINVAL, "no such advice")

    seen = []
    monkeypatch.setattr(shm, "_populate_write", einval)
    monkeypatch.setattr(SharedOffloadRegion, "_touch_pages", lambda self, rs: seen.extend(rs))
    r = region(shm_dir, rank=rank, workers=2)
    expected = [(0, 8 * PAGE)] if rank is None else [(b * 2 * PAGE + PAGE, PAGE) for b in range(4)]
    assert seen == expected
    r.cleanup()


def test_fallback_populate_write_preserves_bytes(shm_dir: str) -> None:
    """vLLM test_fallback_populate_write_preserves_bytes_and_faults_pages: the fallback rewrites one
    byte per page with its own value: data survive."""
    r = region(shm_dir, rank=None, workers=1, blocks=8)
    data = np.frombuffer(r.memoryview, dtype=np.uint8)
    data[:] = np.arange(data.size, dtype=np.uint64).astype(np.uint8)
    before = data.copy()
    r._touch_pages([(0, r.nbytes)])
    assert np.array_equal(data, before)
    del data
    r.cleanup()


def test_madvise_unexpected_oserror_propagates(shm_dir: str, monkeypatch) -> None:
    """vLLM test_madvise_unexpected_oserror_propagates: a non-EINVAL error (EIO) escapes the
    constructor; the creator leaves no file."""

    def eio(mm, s, n):
        raise OSError(errno.EIO, "io error")

    monkeypatch.setattr(shm, "_populate_write", eio)
    with pytest.raises(OSError) as info:
        region(shm_dir)
    assert info.value.errno == errno.EIO and os.listdir(shm_dir) == []


# -- races and waiting (vLLM test_multi*_race_*, test_wait_for_file_size_*) ------------------------


def test_multi_worker_race_exactly_one_creator(shm_dir: str) -> None:
    """vLLM test_multi_worker_race_exactly_one_creator /
    test_multi_worker_race_shared_memory_visible: racing threads: exactly one creator, all
    construct, a byte written through one mapping is visible in all."""
    regions: list[SharedOffloadRegion] = []
    lock = threading.Lock()

    def attach(rank: int) -> None:
        r = region(shm_dir, rank=rank, workers=4)
        with lock:
            regions.append(r)

    threads = [threading.Thread(target=attach, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(r.is_creator for r in regions) == 1
    assert os.stat(regions[0].path).st_size == 4 * 4 * PAGE
    regions[0].memoryview[123] = 77
    assert all(r.memoryview[123] == 77 for r in regions)
    for r in sorted(regions, key=lambda r: r.is_creator):
        r.cleanup()


def test_wait_for_file_size(shm_dir: str) -> None:
    """vLLM test_wait_for_file_size_already_large_enough / test_wait_for_file_size_waits_for_grow: a
    joiner returns at once for a sized file and waits for a growing one (a creator here that
    writes the owner record and then sizes the file)."""
    path = os.path.join(shm_dir, "kvcascade_w.mmap")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)

    def create() -> None:
        write_record(path, os.getpid(), shm.process_start_time(os.getpid()) or 0)
        os.ftruncate(fd, 4 * PAGE)

    timer = threading.Timer(0.2, create)
    timer.start()
    t0 = time.monotonic()
    r = region(shm_dir, iid="w", rank=None, wait_timeout_s=10)
    assert 0.15 <= time.monotonic() - t0 < 5 and not r.is_creator
    t0 = time.monotonic()
    r2 = region(shm_dir, iid="w", rank=0, wait_timeout_s=10)
    assert time.monotonic() - t0 < 0.5
    r2.cleanup()
    r.cleanup()
    os.close(fd)


def test_wait_for_file_size_timeout(shm_dir: str) -> None:
    """vLLM test_wait_for_file_size_timeout: TimeoutError if the creator never sizes the file."""
    path = os.path.join(shm_dir, "kvcascade_t.mmap")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    with pytest.raises(TimeoutError):
        region(shm_dir, iid="t", wait_timeout_s=0.2)
    os.close(fd)


def test_joiner_races_again_when_its_file_is_unlinked(shm_dir: str) -> None:
    """A joiner waiting on a file whose creator failed and removed it kept polling the unlinked
    file until wait_timeout_s, even with a healthy region at the path meanwhile: it notices,
    races again and ends up in the same region as the new participant (one of them creates)."""
    path = os.path.join(shm_dir, "kvcascade_e.mmap")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)  # a creator, mid-creation
    result: dict[str, object] = {}

    def join() -> None:
        try:
            result["r"] = region(shm_dir, iid="e", rank=0, workers=2, wait_timeout_s=3)
        except Exception as exc:  # reported by the assertion below
            result["r"] = exc

    thread = threading.Thread(target=join)
    thread.start()
    while thread.is_alive():  # until the joiner holds its shared lock on the file
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            break
        fcntl.flock(fd, fcntl.LOCK_UN)
        time.sleep(0.005)
    os.unlink(path)  # the first creator fails and removes its file
    os.close(fd)
    new = region(shm_dir, iid="e", rank=1, workers=2)
    thread.join()
    joiner = result["r"]
    assert isinstance(joiner, SharedOffloadRegion), joiner
    assert joiner.is_creator != new.is_creator
    assert os.fstat(joiner._fd).st_ino == os.fstat(new._fd).st_ino
    joiner.create_next_worker_view(PAGE)[2].fill_(3)
    assert new.row(2)[0] == 3
    for r in sorted((joiner, new), key=lambda r: r.is_creator):
        r.cleanup()
    assert os.listdir(shm_dir) == []


def test_joiner_with_other_geometry_fails(shm_dir: str) -> None:
    """A participant with a different geometry for the same instance id is refused."""
    r = region(shm_dir, blocks=4)
    with pytest.raises(ConfigError, match="one geometry per instance_id"):
        region(shm_dir, blocks=8)
    r.cleanup()


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ((4, 100, 1), (4, 200, 1)),  # 100-byte vs 200-byte blocks, both one page a row
        ((4, PAGE, 2), (4, 2 * PAGE, 1)),  # 2 workers × 4 KiB vs 1 worker × 8 KiB
        ((8, PAGE, 1), (4, 2 * PAGE, 1)),  # 8 rows of 4 KiB vs 4 rows of 8 KiB
    ],
)
def test_joiner_with_other_geometry_of_same_file_size_fails(
    shm_dir: str, a: tuple[int, int, int], b: tuple[int, int, int]
) -> None:
    """Another geometry with the same file size was accepted (each side then read the other's
    rows wrongly): the owner record holds the geometry and the joiner is refused, naming both."""
    first = SharedOffloadRegion("g", a[0], a[1], a[2], None, directory=shm_dir)
    assert first.nbytes == b[0] * round_up(b[1] * b[2], PAGE)
    with pytest.raises(ConfigError, match="one geometry per instance_id") as info:
        SharedOffloadRegion("g", b[0], b[1], b[2], None, directory=shm_dir)
    msg = str(info.value)
    assert f"num_blocks={a[0]}, cpu_page_size={a[1]}, num_workers={a[2]}" in msg
    assert f"num_blocks={b[0]}, cpu_page_size={b[1]}, num_workers={b[2]}" in msg
    assert os.path.exists(first.path)
    first.cleanup()


def test_participants_disagreeing_on_expected_participants_fail(shm_dir: str) -> None:
    """A worker expecting 2 participants where the scheduler expects 3 unlinked the file early
    and the next worker made a second region: it is refused, the file stays, and the worker
    that agrees joins the scheduler's file."""
    sched = region(shm_dir, rank=None, workers=2, expected_participants=3)
    with pytest.raises(ConfigError, match=r"expected_participants=3.*expected_participants=2"):
        region(shm_dir, rank=0, workers=2, expected_participants=2)
    assert sorted(os.listdir(shm_dir)) == ["kvcascade_r.mmap", "kvcascade_r.owner"]
    w1 = region(shm_dir, rank=1, workers=2, expected_participants=3)
    assert not w1.is_creator
    w1.create_next_worker_view(PAGE)[0].fill_(5)
    assert sched.row(0)[PAGE] == 5
    w1.cleanup()
    sched.cleanup()


@pytest.mark.parametrize("rank", [0, None])
def test_second_participant_for_one_slot_fails(shm_dir: str, rank: int | None) -> None:
    """Two participants claiming one slot (a duplicate rank, or another engine with this
    instance_id) were both accepted: the second is refused naming the path, the slot and the
    creator's pid; once the first detaches, the slot is free again."""
    first = region(shm_dir, rank=rank, workers=2)
    who = "the scheduler (rank None)" if rank is None else "rank 0"
    with pytest.raises(ConfigError, match="another engine with this instance_id seems alive") as e:
        region(shm_dir, rank=rank, workers=2)
    assert f"{first.path}: {who} is already attached" in str(e.value)
    assert f"pid {os.getpid()}" in str(e.value)
    other = region(shm_dir, rank=1, workers=2)
    other.cleanup()
    again = region(shm_dir, rank=1, workers=2)
    assert not again.is_creator
    again.cleanup()
    first.cleanup()


# -- space and sizing failures (vLLM test_insufficient_space_*, test_ftruncate_*) ---------------


def test_insufficient_space_raises_clear_error(shm_dir: str, monkeypatch) -> None:
    """vLLM test_insufficient_space_raises_clear_error: a failed space check names requested bytes,
    available bytes and path; no file is left."""
    real = os.statvfs
    monkeypatch.setattr(
        shm.os,
        "statvfs",
        lambda p: os.statvfs_result((*real(p)[:4], 1, *real(p)[5:])),
    )
    with pytest.raises(InsufficientSpaceError, match="Insufficient space") as info:
        region(shm_dir)
    msg = str(info.value)
    assert f"requested {4 * PAGE} bytes" in msg and f"available {real(shm_dir).f_frsize}" in msg
    assert shm_dir in msg and os.listdir(shm_dir) == []


def test_too_large_region_on_small_tmpfs_fails_at_init(small_tmpfs: str) -> None:
    """vLLM test_insufficient_space_raises_clear_error on a real 1 MiB tmpfs: a 2 MiB request fails
    at init with the message, no file."""
    with pytest.raises(InsufficientSpaceError) as info:
        SharedOffloadRegion("big", 512, PAGE, directory=small_tmpfs)
    msg = str(info.value)
    assert "requested 2097152 bytes" in msg and "available" in msg and small_tmpfs in msg
    assert os.listdir(small_tmpfs) == []


def test_region_exactly_the_free_space_is_refused(small_tmpfs: str) -> None:
    """A region exactly the size of the free space passed the space check, then the owner
    record took a page and the prefault failed with a bare OSError EFAULT: the check counts the
    record's page too (InsufficientSpaceError, no file); one row less fits and prefaults."""
    vfs = os.statvfs(small_tmpfs)
    free_pages = vfs.f_bavail * vfs.f_frsize // PAGE
    with pytest.raises(InsufficientSpaceError, match=f"requested {free_pages * PAGE} bytes"):
        SharedOffloadRegion("x", free_pages, PAGE, directory=small_tmpfs)
    assert os.listdir(small_tmpfs) == []
    r = SharedOffloadRegion("x", free_pages - 1, PAGE, directory=small_tmpfs)
    r.memoryview[r.nbytes - 1] = 1
    r.cleanup()
    assert os.listdir(small_tmpfs) == []


def test_second_engine_cannot_overcommit_the_file_system(small_tmpfs: str) -> None:
    """A worker prefaults only its own slots, so the pages of a new region were counted as free
    and a second engine was admitted; the first engine's next participant then found no space.
    The creator reserves the whole file (posix_fallocate): the second engine is refused and the
    first one's worker 1 attaches."""
    w0 = SharedOffloadRegion("a", 48, PAGE, 2, 0, directory=small_tmpfs)  # 384 KiB, half touched
    with pytest.raises(InsufficientSpaceError, match="requested 720896 bytes"):
        SharedOffloadRegion("b", 176, PAGE, 1, None, directory=small_tmpfs)  # 704 KiB
    assert os.stat(w0.path).st_blocks * 512 == w0.nbytes  # reserved, not only prefaulted
    w1 = SharedOffloadRegion("a", 48, PAGE, 2, 1, directory=small_tmpfs)
    w1.create_next_worker_view(PAGE).fill_(4)
    assert w0.row(47)[PAGE] == 4
    w1.cleanup()
    w0.cleanup()
    assert os.listdir(small_tmpfs) == []


def test_fallocate_out_of_space_is_insufficient_space(small_tmpfs: str, monkeypatch) -> None:
    """Space taken between the check and the allocation: posix_fallocate's ENOSPC is an
    InsufficientSpaceError naming the sizes and the path, and no file is left (here the check is
    made to pass on a real 1 MiB tmpfs)."""
    real = os.statvfs
    monkeypatch.setattr(
        shm.os, "statvfs", lambda p: os.statvfs_result((*real(p)[:4], 1 << 40, *real(p)[5:]))
    )
    with pytest.raises(InsufficientSpaceError, match="requested 2097152 bytes") as info:
        SharedOffloadRegion("big", 512, PAGE, directory=small_tmpfs)
    assert small_tmpfs in str(info.value) and isinstance(info.value.__cause__, OSError)
    assert info.value.__cause__.errno == errno.ENOSPC
    assert os.listdir(small_tmpfs) == []


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EFBIG])
def test_fallocate_space_errors_are_insufficient_space(
    shm_dir: str, monkeypatch, code: int
) -> None:
    """ENOSPC and EFBIG from posix_fallocate are InsufficientSpaceErrors; no file is left."""

    def fail(fd, offset, length):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(shm.os, "posix_fallocate", fail)
    with pytest.raises(InsufficientSpaceError, match=f"requested {4 * PAGE} bytes"):
        region(shm_dir)
    assert os.listdir(shm_dir) == []


@pytest.mark.parametrize("code", [errno.EOPNOTSUPP, errno.EINVAL])
def test_no_fallocate_falls_back_to_ftruncate(shm_dir: str, monkeypatch, code: int) -> None:
    """A file system without fallocate (EOPNOTSUPP / EINVAL) gets the file sized by ftruncate."""

    def fail(fd, offset, length):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(shm.os, "posix_fallocate", fail)
    r = region(shm_dir)
    assert os.stat(r.path).st_size == 4 * PAGE
    r.memoryview[4 * PAGE - 1] = 7
    with open(r.path, "rb") as f:
        assert f.read()[-1] == 7
    r.cleanup()


def test_fallocate_failure_cleans_up_creator(shm_dir: str, monkeypatch) -> None:
    """vLLM test_ftruncate_failure_cleans_up_creator: a failing sizing (here posix_fallocate with
    EIO) unlinks the file and the owner record and closes before re-raising."""

    def fail(fd, offset, length):
        raise OSError(errno.EIO, "io error")

    monkeypatch.setattr(shm.os, "posix_fallocate", fail)
    with pytest.raises(OSError, match="io error") as info:
        region(shm_dir)
    assert info.value.errno == errno.EIO and os.listdir(shm_dir) == []


# -- bad arguments -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "shown"),
    [
        ({"instance_id": 123}, "123"),
        ({"instance_id": None}, "None"),
        ({"instance_id": "x" * 300}, "300 bytes"),
        ({"instance_id": "é" * 104}, "208 bytes"),
        ({"directory": 5}, "5"),
        ({"rank": True}, "True"),
        ({"rank": 0.5}, "0.5"),
        ({"rank": "0"}, "'0'"),
        ({"rank": 2}, "2"),
        ({"expected_participants": 1.5}, "1.5"),
        ({"expected_participants": "2"}, "'2'"),
        ({"expected_participants": True}, "True"),
        ({"expected_participants": 0}, "0"),
        ({"wait_timeout_s": float("nan")}, "nan"),
        ({"wait_timeout_s": -1}, "-1"),
        ({"wait_timeout_s": "x"}, "'x'"),
        ({"wait_timeout_s": float("inf")}, "inf"),
        ({"pin": 1}, "1"),
    ],
)
def test_bad_argument_is_refused_before_any_file(shm_dir: str, kw: dict, shown: str) -> None:
    """A bad argument is a ConfigError naming it and its value, raised before any file is made
    (instance_id 123 was a TypeError, 300 characters an OSError ENAMETOOLONG after the stale
    scan, rank 0.5 a TypeError after the file was created, wait_timeout_s=nan waited for ever,
    rank True and expected_participants 1.5 / True were accepted)."""
    call = {
        "instance_id": "bad",
        "num_blocks": 4,
        "cpu_page_size": PAGE,
        "num_workers": 2,
        "rank": 0,
        "directory": shm_dir,
        **kw,
    }
    with pytest.raises(ConfigError, match=next(iter(kw))) as info:
        SharedOffloadRegion(**call)
    assert shown in str(info.value)
    assert os.listdir(shm_dir) == []


def test_longest_instance_id_fits_every_file_name(shm_dir: str) -> None:
    """The longest instance_id accepted (207 bytes) makes every file of the region, the owner
    record's temp file included; one byte more is refused naming the limit."""
    r = region(shm_dir, iid="x" * 207)
    assert os.path.exists(r.path) and os.path.exists(r.path[: -len("mmap")] + "owner")
    r.cleanup()
    with pytest.raises(ConfigError, match="at most 207 bytes"):
        region(shm_dir, iid="x" * 208)
    assert os.listdir(shm_dir) == []


# -- zero-copy views and the HostBuffer interface ------------------------------------------------


def test_views_are_zero_copy(shm_dir: str) -> None:
    """A write through the tensor is seen through the memoryviews and rows, and vice versa."""
    r = region(shm_dir, rank=0, workers=2, page=100)
    assert (r.block_bytes, r.row_bytes) == (200, PAGE)
    t = r.tensor()
    assert t.shape == (4, 200) and t.stride() == (PAGE, 1)
    t[3, 150] = 42
    kv = r.create_kv_memoryview()
    assert kv.shape == (4, PAGE) and np.asarray(kv)[3, 150] == 42
    assert r.row(3)[150] == 42 and r.memoryview[3 * PAGE + 150] == 42
    r.row(1)[7] = 9
    assert int(t[1, 7]) == 9
    with pytest.raises(IndexError):
        r.row(4)
    del t, kv
    r.close()


def test_pinning_is_skipped_without_cuda(shm_dir: str, caplog, monkeypatch) -> None:
    """Without CUDA, pinning is skipped and said once per process."""
    monkeypatch.setattr(shm, "_cuda_skip_logged", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.INFO, logger="kvcascade.tiers.shm"):
        a = region(shm_dir, rank=0, workers=2)
        b = region(shm_dir, rank=1, workers=2)
    assert sum("not pinned" in rec.message for rec in caplog.records) == 1
    b.cleanup()
    a.cleanup()


def test_sizing_from_config() -> None:
    """vLLM's ``kv_offload/cpu/spec.py`` sizing, as ``tests/v1/kv_offload/test_factory.py``
    test_cpu_spec_sizes_normalized_worker_layout /
    test_cpu_spec_zero_worker_bytes_produces_empty_cache /
    test_cpu_spec_missing_cpu_bytes_to_use_raises: 32 worker bytes, 3·4096 budget → page 32, row
    4096, 3 blocks; zero worker bytes → an empty cache; a missing, zero or negative budget → what to
    set."""
    g = region_geometry(3 * 4096, 32)
    assert (g.cpu_page_size, g.block_bytes, g.row_stride, g.num_blocks) == (32, 32, 4096, 3)
    g = region_geometry(10 * 8192, 3000, num_workers=2, blocks_per_chunk=2)
    assert (g.cpu_page_size, g.block_bytes, g.row_stride, g.num_blocks) == (6000, 12000, 12288, 6)
    assert region_geometry(4096, 0).num_blocks == 0
    for bad in (None, 0, -5):
        with pytest.raises(ConfigError, match=r"cpu_bytes_to_use must be specified.*set "):
            region_geometry(bad, 32)


def test_sizing_refuses_a_budget_below_one_row_and_zero_blocks_per_chunk() -> None:
    """A budget below one row was 0 blocks without a word, blocks_per_chunk=0 a
    ZeroDivisionError: both are ConfigErrors saying what to set."""
    with pytest.raises(
        ConfigError,
        match=r"cpu_bytes_to_use \(1000\) is below one block row of "
        r"4096 bytes.*at least 4096",
    ):
        region_geometry(1000, 32)
    with pytest.raises(ConfigError, match=r"cpu_bytes_to_use \(12287\).*12288 bytes"):
        region_geometry(12287, 3000, num_workers=2, blocks_per_chunk=2)
    assert region_geometry(4096, 32).num_blocks == 1
    with pytest.raises(ConfigError, match="blocks_per_chunk must be an int >= 1, got 0"):
        region_geometry(4096, 32, blocks_per_chunk=0)


# -- crash safety --------------------------------------------------------------------------------


def test_stale_region_of_dead_owner_is_removed_live_one_kept(shm_dir: str) -> None:
    """A region no live process holds and whose owner is gone is removed at startup; one that a
    live process maps is never removed."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    path = os.path.join(shm_dir, "kvcascade_dead.mmap")
    with open(path, "wb") as f:
        f.write(b"\0" * PAGE)
    write_record(path, child.pid, 12345, blocks=1)
    live = region(shm_dir, iid="live")
    assert sorted(os.listdir(shm_dir)) == ["kvcascade_live.mmap", "kvcascade_live.owner"]
    assert remove_stale_regions(shm_dir) == []
    live.cleanup()


CHILD = r"""
import json, sys, time
import numpy as np
from kvcascade.tiers.shm import SharedOffloadRegion
directory, iid, rank, workers, expected, blocks = sys.argv[1:7]
rank = None if rank == "s" else int(rank)
workers, blocks = int(workers), int(blocks)
r = SharedOffloadRegion(iid, blocks, 4096, workers, rank, directory=directory,
                        expected_participants=int(expected) or None)
if rank is not None:
    r.create_next_worker_view(4096).fill_(rank + 1)
print("ready", r.is_creator, flush=True)
sys.stdin.readline()
kv = np.asarray(r.create_kv_memoryview())
print(json.dumps([[int(kv[b, w * 4096]) for w in range(workers)] for b in range(blocks)]),
      flush=True)
sys.stdin.readline()
"""


def spawn(
    directory: str, iid: str, rank: str, workers: int, expected: int, blocks: int = 4
) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            CHILD,
            directory,
            iid,
            rank,
            str(workers),
            str(expected),
            str(blocks),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def test_two_workers_and_scheduler_share_writes_and_unlink_early(shm_dir: str) -> None:
    """vLLM test_create_next_worker_view_multiprocess_slots /
    test_multiprocess_race_construct_and_write: two worker processes and a scheduler process race to
    attach; exactly one creates; each sees both workers' writes in the interleaved rows; once all
    three mapped it, the file is gone (nothing left to leak)."""
    procs = [spawn(shm_dir, "mp", rank, 2, 3) for rank in ("0", "1", "s")]
    ready = [p.stdout.readline().split() for p in procs]
    assert sorted(r[1] for r in ready) == ["False", "False", "True"]
    assert os.listdir(shm_dir) == []  # unlinked as soon as every participant mapped it
    for p in procs:
        p.stdin.write("\n")
        p.stdin.flush()
    views = [json.loads(p.stdout.readline()) for p in procs]
    assert all(v == [[1, 2]] * 4 for v in views)
    for p in procs:
        p.stdin.write("\n")
        p.stdin.close()
        assert p.wait(timeout=30) == 0
        p.stdout.close()


def test_new_generation_replaces_dead_one_a_lingering_worker_still_maps(shm_dir: str) -> None:
    """Generation 1's creator (the scheduler) is killed -9 while its worker 0 lingers, holding
    the file's lock: generation 2 with the same instance_id joined that file (and split itself
    over two files). The dead creator makes the file stale: generation 2 gets a fresh file of its
    own and shares it, while the old worker keeps its old mapping."""
    old_sched = spawn(shm_dir, "gen", "s", 2, 3)
    assert old_sched.stdout.readline().split() == ["ready", "True"]
    old_worker = spawn(shm_dir, "gen", "0", 2, 3)
    assert old_worker.stdout.readline().split() == ["ready", "False"]
    os.kill(old_sched.pid, signal.SIGKILL)
    old_sched.wait(timeout=30)
    sched = region(shm_dir, iid="gen", rank=None, workers=2, expected_participants=3)
    workers = [
        region(shm_dir, iid="gen", rank=r, workers=2, expected_participants=3) for r in (0, 1)
    ]
    assert sched.is_creator and not any(w.is_creator for w in workers)
    assert os.listdir(shm_dir) == []  # all three attached: unlinked early
    for w in workers:
        w.create_next_worker_view(PAGE).fill_(11 * (w.rank + 1))
    assert [sched.row(3)[0], sched.row(3)[PAGE]] == [11, 22]
    old_worker.stdin.write("\n")
    old_worker.stdin.flush()
    assert json.loads(old_worker.stdout.readline()) == [[1, 0]] * 4  # its own old region
    old_worker.stdin.write("\n")
    old_worker.stdin.close()
    assert old_worker.wait(timeout=30) == 0
    for p in (old_sched, old_worker):
        p.stdout.close()
    old_sched.stdin.close()
    for r in (*workers, sched):
        r.cleanup()


def _tmpfs_used(directory: str) -> int:
    vfs = os.statvfs(directory)
    return (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize


def test_kill_9_restarts_leave_usage_flat(shm_dir: str) -> None:
    """vLLM #54002 (the region file leaks on a crash): kill -9 of every participant, restarted 5
    times with the same instance id, leaves /dev/shm usage flat. One participant never shows up
    (3 workers and the scheduler expected, worker 2 never runs), so the file is not unlinked
    early and each restart's stale cleanup must remove it."""
    blocks = 64  # 64 rows × 12 KiB = 768 KiB per generation
    sizes, files = [], []
    for _ in range(5):
        procs = [spawn(shm_dir, "crash", rank, 3, 4, blocks) for rank in ("0", "1", "s")]
        for p in procs:
            assert p.stdout.readline().startswith("ready")
        files.append(sorted(os.listdir(shm_dir)))
        sizes.append(
            sum(os.stat(os.path.join(shm_dir, f)).st_blocks * 512 for f in os.listdir(shm_dir))
        )
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait(timeout=30)
            p.stdin.close()
            p.stdout.close()
    assert all(f == ["kvcascade_crash.mmap", "kvcascade_crash.owner"] for f in files)
    assert max(sizes) == min(sizes) and sizes[0] <= blocks * 3 * PAGE + 2 * PAGE
    used_before = _tmpfs_used(shm_dir)
    assert remove_stale_regions(shm_dir) == [
        os.path.join(shm_dir, "kvcascade_crash.mmap"),
        os.path.join(shm_dir, "kvcascade_crash.owner"),
    ]
    assert os.listdir(shm_dir) == []
    assert _tmpfs_used(shm_dir) <= used_before
