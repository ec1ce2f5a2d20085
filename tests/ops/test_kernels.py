"""Copy kernels (issue #6): every path byte-identical to an index_select reference.

Runs on CPU always and, when a GPU is present, the same cases with CUDA tensors. The Triton
kernel on CPU needs ``TRITON_INTERPRET=1`` before Triton is imported, so that test runs in a
subprocess (this process keeps compiled Triton for the CUDA cases).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from build_fixtures import build_in_progress, still_building  # noqa: F401 (fixture)

from kvcascade.ops import (
    ChunkCopy,
    KernelSettings,
    _build,
    batch_copy,
    load_settings,
    plan_chunk_copies,
    plan_descriptors,
    select_kernel,
    set_kernel_settings,
    swap_blocks,
)
from kvcascade.ops import swap as swap_mod

REPO = Path(__file__).resolve().parents[2]
HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
# (src device, dst device) pairs: host↔host always; with a GPU also H2D, D2H and D2D.
DIRECTIONS = [("cpu", "cpu")] + (
    [("cpu", "cuda"), ("cuda", "cpu"), ("cuda", "cuda")] if HAS_CUDA else []
)
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def _random_rows(n: int, page: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, (n, page), dtype=torch.int8, generator=g)


def _host(t: torch.Tensor, pinned: bool) -> torch.Tensor:
    return t.pin_memory() if pinned and HAS_CUDA else t


def make_case(
    src_dev: str, dst_dev: str, page: int, n_src: int, n_dst: int, row_stride: int, offset: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """src ``(n_src, page)`` contiguous random rows; dst a strided view over a random base."""
    src = _random_rows(n_src, page, seed=page)
    base = _random_rows(n_dst, row_stride, seed=page + 1)
    src = src.to(src_dev) if src_dev != "cpu" else _host(src, pinned=True)
    base = base.to(dst_dev) if dst_dev != "cpu" else _host(base, pinned=True)
    dst = base[:, offset : offset + page]
    assert dst.stride() == (row_stride, 1)
    return src, dst, base


def pick_ids(n_src: int, n_dst: int, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    src_ids = rng.integers(0, n_src, size=n)  # repeats allowed
    dst_ids = rng.permutation(n_dst)[:n]  # distinct
    return src_ids.astype(np.int64), dst_ids.astype(np.int64)


def reference(base, offset, page, src, src_ids, dst_ids) -> torch.Tensor:
    ref = base.cpu().clone()
    rows = src.cpu().index_select(0, torch.from_numpy(src_ids))
    ref[:, offset : offset + page].index_copy_(0, torch.from_numpy(dst_ids), rows)
    return ref


def _sync() -> None:
    if HAS_CUDA:
        torch.cuda.synchronize()


# ---------------------------------------------------------------- build / availability


def test_cpu_extension_compiled() -> None:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    ext = _build.load_extension()
    assert ext is not None, _build.extension_error()
    assert hasattr(ext, "batch_copy")
    assert ext.has_cuda() == _build.cuda_wanted()
    a = torch.zeros(2, 16, dtype=torch.int8)
    b = torch.zeros(2, 16, dtype=torch.int8)
    assert select_kernel(a, b, 20) == "cpp"


def test_a_completed_build_loads_without_ninja_or_a_process() -> None:
    """A process started on a completed build imports its library directly: it starts no
    process (the ``subprocess.Popen`` audit event never fires) and needs no ninja or compiler
    (``PATH`` has none). vLLM's shutdown without ``--shutdown-timeout`` fails on an engine
    descendant that exits while it kills the tree (docs/vllm.md, *Exit and shutdown*): a server
    on a built cache must start none."""
    if _build.load_extension() is None:
        pytest.skip(f"extension not built: {_build.extension_error()}")
    code = textwrap.dedent(
        """
        import sys
        started = []
        sys.addaudithook(lambda event, args: started.append(args[0]) if event in (
            "subprocess.Popen", "os.posix_spawn", "os.fork", "os.exec") else None)
        from kvcascade.ops import _build
        assert _build.extension_if_ready() is None  # loads in the background
        _build._background.join(60)
        ext = _build.extension_if_ready()
        print(ext is not None and hasattr(ext, "batch_copy"), started, _build.extension_error())
        """
    )
    env = {**os.environ, "PATH": "/nonexistent"}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True", "[]", "None"]


def test_a_changed_library_is_not_taken_for_the_completed_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stamp names the library's size and mtime: a library replaced or touched since its
    build completed is built again (torch's ``load``, which runs ninja), never imported blind."""
    if _build.load_extension() is None:
        pytest.skip(f"extension not built: {_build.extension_error()}")
    name = _build.extension_spec()[0]
    built = _build.build_dir(name)
    monkeypatch.setenv("KVCASCADE_BUILD_DIR", str(tmp_path))
    copy = _build.build_dir(name)
    for file in (f"{name}.so", _build.BUILT_STAMP):
        shutil.copy2(built / file, copy / file)
    assert _build._built_library(name) == copy / f"{name}.so"
    stat = (copy / f"{name}.so").stat()
    os.utime(copy / f"{name}.so", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert _build._built_library(name) is None
    (copy / _build.BUILT_STAMP).unlink()
    assert _build._built_library(name) is None


def test_kernel_sources_found() -> None:
    d = _build.kernels_dir()
    assert d is not None
    assert (d / "swap_blocks.cpp").is_file()
    assert (d / "fs_io.cpp").is_file() and (d / "kvc_result.h").is_file()
    assert (d / "swap_blocks_cuda.cu").is_file()
    assert (d / "triton_swap.py").is_file()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_cuda_source_compiles_with_nvcc(tmp_path: Path) -> None:
    proc = subprocess.run(
        ["bash", str(REPO / "kernels" / "check_nvcc.sh"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    obj = tmp_path / "swap_blocks_cuda.o"
    assert obj.is_file() and obj.stat().st_size > 0
    assert proc.stdout.strip() == str(obj)


def test_build_failure_logs_one_warning_and_falls_back(monkeypatch, caplog) -> None:
    monkeypatch.setattr(_build, "_extension", None)
    monkeypatch.setattr(_build, "_attempted", False)
    monkeypatch.setattr(_build, "_error", None)

    def broken() -> None:
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(_build, "_build", broken)
    with caplog.at_level(logging.WARNING, logger="kvcascade.ops"):
        assert _build.load_extension() is None
        assert _build.load_extension() is None
        src, dst, base = make_case("cpu", "cpu", 64, 8, 8, 64, 0)
        src_ids, dst_ids = pick_ids(8, 8, 5, seed=1)
        ref = reference(base, 0, 64, src, src_ids, dst_ids)
        assert select_kernel(src, dst, 5) == "torch"
        assert swap_blocks(src, dst, src_ids, dst_ids) == 5 * 64
        with pytest.raises(RuntimeError, match="no compiler here"):
            swap_blocks(src, dst, src_ids, dst_ids, kernel="cpp")
        # batch_copy still works on the host through the ctypes fallback
        a = torch.arange(8, dtype=torch.int8)
        b = torch.zeros(8, dtype=torch.int8)
        n = batch_copy(
            torch.tensor([a.data_ptr()]), torch.tensor([b.data_ptr()]), torch.tensor([8])
        )
        assert n == 8 and torch.equal(a, b)
    assert torch.equal(base, ref)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "no compiler here" in warnings[0].getMessage()


# ---------------------------------------------------------------- swap_blocks, every path

CPP_PAGES = [8, 13, 1000, 4096, 4099, 65536]
CASES = [  # (page, n_src, n_dst, n, row_stride_extra, offset)
    (p, 40, 48, 32, extra, off) for p in CPP_PAGES for extra, off in ((0, 0), (24, 8))
]


def _case_id(case) -> str:
    page, _, _, n, extra, _ = case
    return f"page{page}-n{n}-" + ("strided" if extra else "dense")


@pytest.mark.parametrize("direction", DIRECTIONS, ids=lambda d: f"{d[0]}->{d[1]}")
@pytest.mark.parametrize("kernel", ["torch", "cpp", "auto"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_swap_blocks_matches_reference(direction, kernel, case) -> None:
    page, n_src, n_dst, n, extra, off = case
    src, dst, base = make_case(*direction, page, n_src, n_dst, page + extra, off)
    src_ids, dst_ids = pick_ids(n_src, n_dst, n, seed=page + n)
    ref = reference(base, off, page, src, src_ids, dst_ids)
    assert swap_blocks(src, dst, src_ids, dst_ids, kernel=kernel) == n * page
    _sync()
    assert torch.equal(base.cpu(), ref)  # rows written, padding and other rows untouched


@pytest.mark.parametrize("direction", DIRECTIONS, ids=lambda d: f"{d[0]}->{d[1]}")
def test_cpp_large_batch_threads(direction) -> None:
    """> 4 MiB in one batch: the host op splits the byte stream over threads."""
    page, n = 96 * 1024 + 8, 80  # ~7.5 MiB, page not a power of two
    src, dst, base = make_case(*direction, page, n, n + 4, page + 64, 32)
    src_ids, dst_ids = pick_ids(n, n + 4, n, seed=7)
    ref = reference(base, 32, page, src, src_ids, dst_ids)
    assert swap_blocks(src, dst, src_ids, dst_ids, kernel="cpp") == n * page
    _sync()
    assert torch.equal(base.cpu(), ref)


@pytest.mark.parametrize("kernel", ["auto", "cpp", "torch"])
@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch(kernel, device) -> None:
    src, dst, base = make_case(device, device, 64, 4, 4, 64, 0)
    before = base.cpu().clone()
    empty = np.zeros(0, dtype=np.int64)
    assert swap_blocks(src, dst, empty, empty, kernel=kernel) == 0
    _sync()
    assert torch.equal(base.cpu(), before)
    e = torch.zeros(0, dtype=torch.int64)
    assert batch_copy(e, e, e) == 0


def test_batch_copy_host_split_inside_one_descriptor() -> None:
    """One 9 MiB descriptor among zero-size ones: threads split it mid-descriptor."""
    big = _random_rows(1, 9 * 1024 * 1024 + 3, seed=3)[0]
    small = _random_rows(1, 5, seed=4)[0]
    out_big = torch.zeros_like(big)
    out_small = torch.zeros_like(small)
    src = torch.tensor([small.data_ptr(), 0, big.data_ptr(), 0], dtype=torch.int64)
    dst = torch.tensor([out_small.data_ptr(), 0, out_big.data_ptr(), 0], dtype=torch.int64)
    sizes = torch.tensor([5, 0, big.numel(), 0], dtype=torch.int64)
    assert batch_copy(src, dst, sizes) == 5 + big.numel()
    assert torch.equal(out_big, big) and torch.equal(out_small, small)
    ext = _build.load_extension()
    if ext is not None:  # 4 threads whatever the core count (auto: one core fewer than present)
        out_big.zero_()
        out_small.zero_()
        assert ext.batch_copy(src, dst, sizes, max_threads=4) == (5 + big.numel(), 0, "")
        assert torch.equal(out_big, big) and torch.equal(out_small, small)
    # same through the ctypes fallback
    out_big.zero_()
    out_small.zero_()
    assert swap_mod._host_copy_fallback(src, dst, sizes) == 5 + big.numel()
    assert torch.equal(out_big, big) and torch.equal(out_small, small)


TRITON_SCRIPT = textwrap.dedent(
    """
    import numpy as np, torch
    from kvcascade.ops import swap_blocks, select_kernel, triton_available
    from kvcascade.ops import _build
    assert triton_available()
    assert _build.load_triton().interpreted()
    cases = [(8, 0, 0, 3), (64, 0, 0, 20), (4096, 24, 8, 13), (520, 16, 8, 40), (16384, 0, 0, 17)]
    for page, extra, off, n in cases:
        g = torch.Generator().manual_seed(page)
        src = torch.randint(-128, 128, (n + 5, page), dtype=torch.int8, generator=g)
        base = torch.randint(-128, 128, (n + 7, page + extra), dtype=torch.int8, generator=g)
        dst = base[:, off:off + page]
        rng = np.random.default_rng(n)
        s = rng.integers(0, n + 5, size=n).astype(np.int64)
        d = rng.permutation(n + 7)[:n].astype(np.int64)
        ref = base.clone()
        ref[:, off:off + page].index_copy_(0, torch.from_numpy(d),
                                           src.index_select(0, torch.from_numpy(s)))
        assert swap_blocks(src, dst, s, d, kernel="triton") == n * page
        assert torch.equal(base, ref), (page, extra, off, n)
        assert select_kernel(src, dst, n) == "cpp"  # auto never picks Triton host->host
    e = np.zeros(0, dtype=np.int64)
    assert swap_blocks(src, dst, e, e, kernel="triton") == 0
    try:
        swap_blocks(torch.zeros(4, 12, dtype=torch.int8), torch.zeros(4, 12, dtype=torch.int8),
                    np.array([0]), np.array([1]), kernel="triton")
    except ValueError as exc:
        assert "page 12" in str(exc), exc
    else:
        raise AssertionError("page 12 accepted by the Triton kernel")
    print("TRITON-OK")
    """
)


_INTERPRETER_NUMPY_BUG = "only 0-dimensional arrays can be converted to Python scalars"


def triton_version() -> str:
    import triton

    return triton.__version__


def test_triton_kernel_interpreted_on_cpu() -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", TRITON_SCRIPT],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    if proc.returncode and _INTERPRETER_NUMPY_BUG in proc.stderr:
        pytest.skip(
            f"Triton {triton_version()}'s interpreter calls int() on 1-element arrays, which "
            f"NumPy {np.__version__} refuses (seen with Triton 3.6 + NumPy 2.5; Triton 3.9 works)"
        )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "TRITON-OK" in proc.stdout


@needs_cuda
@pytest.mark.parametrize("direction", [("cpu", "cuda"), ("cuda", "cpu")], ids=["h2d", "d2h"])
@pytest.mark.parametrize("page", [8, 1000 * 8, 4096, 28 * 1024 - 8, 65536])
def test_triton_kernel_cuda(page, direction) -> None:
    pytest.importorskip("triton")
    n = 40
    src, dst, base = make_case(*direction, page, n + 3, n + 5, page + 16, 8)
    src_ids, dst_ids = pick_ids(n + 3, n + 5, n, seed=page)
    ref = reference(base, 8, page, src, src_ids, dst_ids)
    assert swap_blocks(src, dst, src_ids, dst_ids, kernel="triton") == n * page
    _sync()
    assert torch.equal(base.cpu(), ref)


@needs_cuda
@pytest.mark.parametrize("direction", DIRECTIONS[1:], ids=lambda d: f"{d[0]}->{d[1]}")
def test_cpp_cuda_side_stream(direction) -> None:
    """On a non-default stream the CUDA op uses cudaMemcpyBatchAsync (CUDA runtime >= 12.8)."""
    page, n = 4096 + 8, 64
    src, dst, base = make_case(*direction, page, n, n + 3, page + 8, 0)
    src_ids, dst_ids = pick_ids(n, n + 3, n, seed=5)
    ref = reference(base, 0, page, src, src_ids, dst_ids)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        assert swap_blocks(src, dst, src_ids, dst_ids, kernel="cpp") == n * page
    stream.synchronize()
    assert torch.equal(base.cpu(), ref)


@needs_cuda
def test_auto_dispatch_cuda_follows_spec() -> None:
    set_kernel_settings(KernelSettings())
    try:
        host = torch.zeros(64, 4096, dtype=torch.int8).pin_memory()
        gpu = torch.zeros(64, 4096, dtype=torch.int8, device="cuda")
        want_triton = "triton" if swap_mod.triton_available() else "cpp"
        assert select_kernel(host, gpu, 16) == want_triton
        assert select_kernel(host, gpu, 15) == "cpp"  # fewer than 16 descriptors
        assert select_kernel(gpu, host, 64) == "cpp"  # stores: the batch op by default
        big_h = torch.zeros(4, 28 * 1024, dtype=torch.int8).pin_memory()
        big_g = torch.zeros(4, 28 * 1024, dtype=torch.int8, device="cuda")
        assert select_kernel(big_h, big_g, 64) == "cpp"  # page not < 28 KiB
        assert select_kernel(host.clone(), gpu, 64) == "cpp"  # pageable host memory
        set_kernel_settings(KernelSettings(triton_max_store_page_bytes=16 * 1024))
        assert select_kernel(gpu, host, 64) == want_triton  # stores below the store threshold
        assert select_kernel(big_g, big_h, 64) == "cpp"  # 28 KiB ≥ 16 KiB
        assert select_kernel(gpu, host.clone(), 64) == "cpp"  # pageable host memory
        assert select_kernel(gpu, gpu.clone(), 64) == "cpp"  # GPU→GPU never
    finally:
        set_kernel_settings(None)


# ---------------------------------------------------------------- errors


def test_swap_blocks_errors() -> None:
    src = torch.zeros(4, 16, dtype=torch.int8)
    dst = torch.zeros(6, 16, dtype=torch.int8)
    one = np.array([0])
    with pytest.raises(ValueError, match=r"torch\.float32"):
        swap_blocks(src.float(), dst, one, one)
    with pytest.raises(ValueError, match=r"\(4, 16\).*\(6, 8\)"):
        swap_blocks(src, dst[:, :8], one, one)
    with pytest.raises(ValueError, match="2 source ids but 1 destination ids"):
        swap_blocks(src, dst, np.array([0, 1]), one)
    with pytest.raises(ValueError, match=r"src block id out of range \[0, 4\): \[4\]"):
        swap_blocks(src, dst, np.array([1, 4]), np.array([0, 1]))
    with pytest.raises(ValueError, match=r"dst block id out of range \[0, 6\): \[-1\]"):
        swap_blocks(src, dst, one, np.array([-1]))
    with pytest.raises(ValueError, match="'bogus'"):
        swap_blocks(src, dst, one, one, kernel="bogus")  # type: ignore[arg-type]
    cols = torch.zeros(16, 4, dtype=torch.int8).t()  # (4, 16) with stride(1) == 4
    with pytest.raises(ValueError, match=r"contiguous rows.*\(1, 4\)"):
        swap_blocks(cols, dst, one, one, kernel="cpp")
    swap_blocks(cols, dst, one, one, kernel="torch")  # the torch path copes with any strides


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="interpreter mode")
def test_triton_forced_on_cpu_needs_interpreter() -> None:
    pytest.importorskip("triton")
    src = torch.zeros(20, 64, dtype=torch.int8)
    ids = np.arange(20)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        swap_blocks(src, src.clone(), ids, ids, kernel="triton")


def test_batch_copy_errors() -> None:
    a = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="lengths differ: src_ptrs 2, dst_ptrs 3, sizes 2"):
        batch_copy(a, torch.zeros(3, dtype=torch.int64), a)
    with pytest.raises(ValueError, match=r"sizes must be int64, got torch.int32"):
        batch_copy(a, a, a.int())
    with pytest.raises(ValueError, match=r"dst_ptrs must be 1-D, got shape \(1, 2\)"):
        batch_copy(a, a.view(1, 2), a)
    with pytest.raises(TypeError, match=r"src_ptrs must be a torch\.Tensor, got list"):
        batch_copy([1, 2], a, a)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"sizes\[1\] = -5 is negative"):
        batch_copy(a, a, torch.tensor([0, -5]))
    with pytest.raises(ValueError, match="descriptor 0 has a null address"):
        batch_copy(a, a, torch.tensor([8, 0]))
    if HAS_CUDA:
        with pytest.raises(ValueError, match="must be a CPU tensor, got device cuda"):
            batch_copy(a.cuda(), a, a)


def test_extension_op_validates_itself() -> None:
    """The raw C++ op checks its inputs too (it trusts addresses, not shapes) and returns the
    error instead of throwing: an exception out of an extension killed the process on the H200
    image (torch 2.11.0+cu130)."""
    ext = _build.load_extension()
    if ext is None:
        pytest.skip(f"extension not built: {_build.extension_error()}")
    a = torch.zeros(2, dtype=torch.int64)
    assert ext.batch_copy(a, a[:1], a) == (
        0,
        1,
        "batch_copy: lengths differ: src_ptrs 2, dst_ptrs 1, sizes 2",
    )
    assert ext.batch_copy(a, a, a.int()) == (0, 1, "batch_copy: sizes must be int64, got Int")
    assert ext.batch_copy(a.view(2, 1), a, a)[2].startswith(
        "batch_copy: src_ptrs must be 1-D, got 2 dimensions"
    )
    assert ext.batch_copy(a, a, torch.tensor([0, -3])) == (
        0,
        1,
        "batch_copy: sizes[1] = -3 is negative",
    )
    src = torch.arange(16, dtype=torch.int8)
    dst = torch.zeros(16, dtype=torch.int8)
    ptrs = (torch.tensor([src.data_ptr()]), torch.tensor([dst.data_ptr()]), torch.tensor([16]))
    assert ext.batch_copy(*ptrs) == (16, 0, "")
    assert torch.equal(src, dst)


# ------------------------------------------------------ chunk plan (docs/device.md, copy plan)


def test_plan_worked_example() -> None:
    plan = plan_chunk_copies([4], [4], [0, 1, 2, 3], [7, 2], 3)
    assert plan == [(0, 7, 1), (1, 7, 2), (2, 2, 0), (3, 2, 1)]
    assert plan[0] == ChunkCopy(gpu_block=0, cpu_chunk=7, pos=1)


def test_plan_groups_concatenate_and_skip_empty() -> None:
    # group 0: 2 blocks at index 0 (k=2 → 1 chunk); group 1 empty; group 2: 3 blocks at index 3
    # (s=1 → ceil(4/2)=2 chunks); group 3: k=2, n=1 at index 2 → 1 chunk
    plan = plan_chunk_copies([2, 0, 3, 1], [0, 5, 3, 2], [10, 11, 20, 21, 22, 30], [1, 5, 6, 9], 2)
    assert plan == [
        (10, 1, 0),
        (11, 1, 1),
        (20, 5, 1),
        (21, 6, 0),
        (22, 6, 1),
        (30, 9, 0),
    ]
    assert plan_chunk_copies([3], [7], [4, 5, 6], [0, 1, 2], 1) == [(4, 0, 0), (5, 1, 0), (6, 2, 0)]
    assert plan_chunk_copies([], [], [], [], 4) == []


def test_plan_errors() -> None:
    with pytest.raises(ValueError, match="consume 4 GPU blocks and 2 CPU chunks, but 4 GPU"):
        plan_chunk_copies([4], [4], [0, 1, 2, 3], [7, 2, 9], 3)
    with pytest.raises(ValueError, match="but 3 GPU block ids and 2 CPU chunk ids"):
        plan_chunk_copies([4], [4], [0, 1, 2], [7, 2], 3)
    with pytest.raises(ValueError, match="blocks_per_chunk must be >= 1, got 0"):
        plan_chunk_copies([1], [0], [0], [0], 0)
    with pytest.raises(ValueError, match="2 group sizes but 1 block indices"):
        plan_chunk_copies([1, 1], [0], [0, 1], [0, 1], 1)
    with pytest.raises(ValueError, match="size -1"):
        plan_chunk_copies([-1], [0], [], [], 1)


def test_host_copy_does_not_wait_for_a_running_build(build_in_progress) -> None:  # noqa: F811
    """Issue #15 defect 3: the serving path copies with the fallback while the build runs in
    the background, and uses the extension once it has loaded."""
    src = _random_rows(4, 64, seed=3)
    dst = torch.zeros_like(src)
    s, d, z = plan_descriptors(
        plan_chunk_copies([2], [0], [0, 3], [2, 1], 1), src, dst, 64, store=True
    )
    assert batch_copy(s, d, z, wait_for_build=False) == 128
    assert still_building()
    assert torch.equal(dst[2], src[0]) and torch.equal(dst[1], src[3])
    assert select_kernel(src, dst, 2, wait_for_build=False) == "torch"
    build_in_progress.set()
    _build._background.join(35)
    assert select_kernel(src, dst, 2, wait_for_build=False) == "cpp"


def test_build_outlives_a_process_that_exits_mid_build(tmp_path: Path) -> None:
    """Issue #15 defect 3: a process that starts the background build and exits (an offline
    job) must not leave ninja running without the build's lock — the next process's ninja would
    race it on the same object files. The build runs in a process of its own holding the
    ``flock`` until it is done: once the lock is free the extension is complete. While it runs,
    the process that wants it has no child (vLLM kills an engine's process tree and fails on a
    descendant that exits meanwhile: ``kvcascade/ops/_build.py``)."""
    import fcntl
    import time

    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    code = textwrap.dedent(
        """
        import os
        import time
        from pathlib import Path
        from kvcascade.ops import _build
        name = _build.extension_spec()[0]
        print(name, flush=True)
        assert _build.extension_if_ready() is None
        ninja = _build.build_dir(name) / "build.ninja"
        while not ninja.exists():  # torch writes it under the lock, just before running ninja
            time.sleep(0.01)
        me = str(os.getpid())
        stats = [Path(d) / "stat" for d in Path("/proc").iterdir() if d.name.isdigit()]
        ppids = [s.read_text().rsplit(")", 1)[1].split()[1] for s in stats if s.exists()]
        print(ppids.count(me), flush=True)
        """
    )
    env = {**os.environ, "KVCASCADE_BUILD_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    name, children = proc.stdout.split()
    assert children == "0"
    with open(tmp_path / name / "kvcascade.flock", "a") as handle:
        deadline = time.monotonic() + 1200
        while True:  # the builder may take minutes on a busy machine
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.monotonic() < deadline, "the build did not finish"
                time.sleep(0.5)
        assert (tmp_path / name / f"{name}.so").is_file()


def test_triton_probe_does_not_wait_for_a_running_build(
    build_in_progress,  # noqa: F811
    monkeypatch,
) -> None:
    """Issue #15 defect 3: probing for Triton (done by every "auto" dispatch) took the lock the
    C++ build holds for its whole minute; it has its own lock now."""
    monkeypatch.setattr(_build, "_triton_attempted", False)
    monkeypatch.setattr(_build, "_triton", None)
    assert _build.extension_if_ready() is None
    _build.load_triton()
    assert still_building()


def test_stream_copy_that_does_not_wait_needs_host_side() -> None:
    """The stream fallback must know which side is host memory; refused before any copy."""
    src = _random_rows(2, 16, seed=4)
    dst = torch.zeros_like(src)
    s, d, z = plan_descriptors([ChunkCopy(0, 1, 0)], src, dst, 16, store=True)
    with pytest.raises(ValueError, match=r"host_side must be 'src' or 'dst'.*got 'gpu'"):
        batch_copy(s, d, z, stream=0, wait_for_build=False, host_side="gpu")
    assert int(dst.abs().sum()) == 0


@needs_cuda
@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
@pytest.mark.parametrize("store", [True, False], ids=["store", "load"])
def test_stream_copy_fallback_matches_the_extension(pinned: bool, store: bool) -> None:
    """The torch fallback used while the extension builds moves the same bytes as the C++ op."""
    k, page = 2, 48
    gpu = _random_rows(8, page, seed=21).cuda()
    host = _host(_random_rows(4, k * page + 16, seed=22), pinned)
    plan = plan_chunk_copies([3], [1], [5, 0, 7], [3, 1], k)
    outs = []
    for fallback in (True, False):
        g, h = gpu.clone(), host.clone()
        h = _host(h, pinned)
        desc = plan_descriptors(plan, g, h, page, store=store)
        stream = torch.cuda.Stream()
        if fallback:
            n = swap_mod._stream_copy_fallback(*desc, stream, load=not store)
        else:
            n = batch_copy(*desc, stream=stream, src_access_any=not store)
        stream.synchronize()
        assert n == 3 * page
        outs.append((g.cpu(), h.clone()))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("store", [True, False], ids=["store", "load"])
def test_plan_descriptors_copy(device, store) -> None:
    k, page = 3, 40
    gpu = _random_rows(10, page + 8, seed=11)[:, :page]  # padded device pages
    host_base = _random_rows(5, k * page + 24, seed=12)  # row stride > k·page
    gpu = gpu.to(device) if device != "cpu" else gpu
    host_base = _host(host_base, pinned=True)
    plan = plan_chunk_copies([4], [4], [0, 1, 2, 3], [3, 1], k)
    src, dst, sizes = plan_descriptors(plan, gpu, host_base, page, store=store)
    gpu_before, host_before = gpu.cpu().clone(), host_base.clone()
    stream = torch.cuda.current_stream() if device == "cuda" else None
    assert batch_copy(src, dst, sizes, stream=stream) == 4 * page
    _sync()
    for g, c, p in plan:
        sub = slice(p * page, (p + 1) * page)
        if store:
            assert torch.equal(host_base[c, sub], gpu_before[g])
        else:
            assert torch.equal(gpu[g].cpu(), host_before[c, sub])
    with pytest.raises(ValueError, match="does not fit"):
        plan_descriptors([ChunkCopy(0, 5, 0)], gpu, host_base, page, store=True)


# ---------------------------------------------------------------- settings


def test_settings_defaults_and_override(tmp_path: Path, monkeypatch) -> None:
    d = KernelSettings()
    assert (d.triton_max_page_bytes, d.triton_min_descriptors, d.triton_num_programs) == (
        28 * 1024,
        16,
        12,
    )
    assert d.triton_max_store_page_bytes == 0  # vLLM: stores always the batch op
    assert "H100" in d.provenance
    p = tmp_path / "kernel_settings.json"
    assert load_settings(p) == d  # missing file → defaults
    p.write_text(json.dumps({"triton_min_descriptors": 32, "provenance": "bench on H200"}))
    s = load_settings(p)
    assert s.triton_min_descriptors == 32 and s.triton_max_page_bytes == 28 * 1024
    assert s.provenance == "bench on H200"
    monkeypatch.setenv("KVCASCADE_KERNEL_SETTINGS", str(p))
    assert load_settings() == s
    p.write_text(json.dumps({"triton_num_programs": 0}))
    with pytest.raises(ValueError, match=r"triton_num_programs .* positive int: 0"):
        load_settings(p)
    p.write_text(json.dumps({"triton_max_store_page_bytes": 0}))
    assert load_settings(p).triton_max_store_page_bytes == 0  # 0 = stores never use Triton
    p.write_text(json.dumps({"triton_max_store_page_bytes": -1}))
    with pytest.raises(ValueError, match=r"triton_max_store_page_bytes .* non-negative int: -1"):
        load_settings(p)
    p.write_text("[1]")
    with pytest.raises(ValueError, match="JSON object, got list"):
        load_settings(p)
