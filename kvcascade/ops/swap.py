"""Block copies between a device KV view and the primary tier's host buffer.

:func:`swap_blocks` copies rows given by block ids: it turns them into copy descriptors
``(src address, dst address, bytes)`` and dispatches to one of four implementations (the device
tier and the vLLM connector's worker side build descriptors from a copy plan themselves,
:mod:`kvcascade.ops.plan`, and call :func:`batch_copy` / :func:`triton_batch_copy`):

============  ==================================================================================
``"cpp"``     the ``kernels/swap_blocks.cpp`` batch op: host ``memcpy`` (threaded above 4 MiB) for
              CPU↔CPU, ``cudaMemcpyBatchAsync`` / per-copy ``cudaMemcpyAsync`` on the current
              stream when a CUDA tensor is involved (``kernels/swap_blocks_cuda.cu``).
``"triton"``  the ``kernels/triton_swap.py`` kernel, for many small pages read from pinned host
              memory into the GPU (also GPU→pinned host when forced; under
              ``TRITON_INTERPRET=1`` CPU↔CPU only).
``"torch"``   ``index_select`` + ``index_copy_`` (always available; the reference).
``"auto"``    vLLM's rule (``kv_offload/cpu/gpu_worker.py``): CPU→GPU uses ``"triton"`` when
              Triton is usable, the host rows are pinned, page and addresses are multiples of 8,
              the page is below
              ``triton_max_page_bytes`` (28 KiB) and there are at least
              ``triton_min_descriptors`` (16) copies, else ``"cpp"``; GPU→CPU likewise with
              ``triton_max_store_page_bytes`` (default 0: always ``"cpp"``, vLLM's rule);
              GPU→GPU and CPU→CPU use ``"cpp"``. Without a built extension ``"cpp"`` becomes
              ``"torch"``.
============  ==================================================================================

Thresholds are :class:`~kvcascade.ops._settings.KernelSettings` (vLLM's values, tuned on H100
PCIe Gen5, overridable by a JSON file). On CUDA every path only *enqueues* on the current stream;
the caller synchronises (events) before reading the destination or reusing the source.
"""

from __future__ import annotations

import logging
from typing import Literal

import numpy as np
import torch

from . import _build
from ._settings import KernelSettings, load_settings

log = logging.getLogger("kvcascade.ops")

Kernel = Literal["auto", "cpp", "triton", "torch"]
KERNELS: tuple[str, ...] = ("auto", "cpp", "triton", "torch")

_settings: KernelSettings | None = None


def kernel_settings() -> KernelSettings:
    """The dispatch thresholds in effect (loaded once from the settings file, if any)."""
    global _settings
    if _settings is None:
        _settings = load_settings()
    return _settings


def set_kernel_settings(settings: KernelSettings | None) -> None:
    """Replace the thresholds (``None`` = reload from the settings file on next use)."""
    global _settings
    _settings = settings


def extension_available() -> bool:
    """Whether the C++ batch op is built (building it on first call)."""
    return _build.load_extension() is not None


def triton_available() -> bool:
    """Whether the Triton kernel can be loaded (Triton installed, not ROCm)."""
    return torch.version.hip is None and _build.load_triton() is not None


def _as_descriptor_array(t: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"batch_copy: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"batch_copy: {name} must be a CPU tensor, got device {t.device}")
    if t.dtype != torch.int64:
        raise ValueError(f"batch_copy: {name} must be int64, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"batch_copy: {name} must be 1-D, got shape {tuple(t.shape)}")
    return t.contiguous()


def batch_copy(
    src_ptrs: torch.Tensor,
    dst_ptrs: torch.Tensor,
    sizes: torch.Tensor,
    *,
    stream: torch.cuda.Stream | int | None = None,
    src_access_any: bool = False,
    wait_for_build: bool = True,
    host_side: Literal["src", "dst"] | None = None,
) -> int:
    """Copy ``sizes[i]`` bytes from address ``src_ptrs[i]`` to address ``dst_ptrs[i]`` for every i.

    Args:
        src_ptrs, dst_ptrs: 1-D int64 CPU tensors of raw addresses (host addresses when ``stream``
            is None; any unified address otherwise). Ranges must not overlap.
        sizes: 1-D int64 CPU tensor of byte counts (≥ 0), same length.
        stream: None → synchronous host ``memcpy`` on the calling thread (threaded above 4 MiB, GIL
            released). A ``torch.cuda.Stream`` or raw ``cudaStream_t`` integer → enqueued on that
            stream (``cudaMemcpyBatchAsync`` when available), asynchronous.
        src_access_any: CUDA only — the source may be read out of stream order (safe for host
            memory nobody writes meanwhile, e.g. loads).
        wait_for_build: False (the serving paths): if the extension is not loaded yet, start
            building it in the background and copy now with a fallback — ``ctypes.memmove`` per
            descriptor on the host, a torch ``copy_`` per descriptor on ``stream`` (host side
            wrapped with ``torch.frombuffer``, device side through ``__cuda_array_interface__``;
            asynchronous from pinned host memory, synchronous from pageable).
        host_side: with ``stream`` and ``wait_for_build=False``: which side is host memory
            (``"src"`` for CPU→GPU, ``"dst"`` for GPU→CPU), so the torch fallback can wrap it.

    Returns:
        total bytes copied (or enqueued).

    Raises:
        TypeError / ValueError: a descriptor array is not a 1-D int64 CPU tensor, lengths differ, a
            size is negative, an address is null, or ``host_side`` is missing or not ``"src"`` /
            ``"dst"`` where it is needed.
        RuntimeError: a CUDA error (message names the descriptor), or ``stream`` given with
            ``wait_for_build=True`` but the extension was built without CUDA.
    """
    src_ptrs = _as_descriptor_array(src_ptrs, "src_ptrs")
    dst_ptrs = _as_descriptor_array(dst_ptrs, "dst_ptrs")
    sizes = _as_descriptor_array(sizes, "sizes")
    if not (len(src_ptrs) == len(dst_ptrs) == len(sizes)):
        raise ValueError(
            f"batch_copy: lengths differ: src_ptrs {len(src_ptrs)}, dst_ptrs {len(dst_ptrs)}, "
            f"sizes {len(sizes)}"
        )
    if stream is not None and not wait_for_build and host_side not in ("src", "dst"):
        raise ValueError(
            f"batch_copy: host_side must be 'src' or 'dst' for a stream copy that does not wait "
            f"for the build, got {host_side!r}"
        )
    ext = _build.load_extension() if wait_for_build else _build.extension_if_ready()
    if stream is None:
        if ext is not None:
            return _checked(ext.batch_copy(src_ptrs, dst_ptrs, sizes))
        return _host_copy_fallback(src_ptrs, dst_ptrs, sizes)
    handle = stream.cuda_stream if isinstance(stream, torch.cuda.Stream) else int(stream)
    if ext is not None and ext.has_cuda():
        return _checked(ext.batch_copy_cuda(src_ptrs, dst_ptrs, sizes, handle, src_access_any))
    if wait_for_build:
        raise RuntimeError(
            "batch_copy on a CUDA stream needs the extension built with CUDA "
            f"(build error: {_build.extension_error()})"
        )
    if not isinstance(stream, torch.cuda.Stream):
        stream = torch.cuda.ExternalStream(handle)
    return _stream_copy_fallback(src_ptrs, dst_ptrs, sizes, stream, host_side == "src")


def _checked(result: tuple[int, int, str]) -> int:
    """Bytes from an extension op's ``(bytes, error kind, message)``; raises its error.

    The ops return errors instead of throwing (see ``kernels/swap_blocks.cpp``): kind 1 →
    ``ValueError``, kind 2 (a CUDA error) → ``RuntimeError``."""
    nbytes, kind, message = result
    if kind == 0:
        return nbytes
    raise (ValueError if kind == 1 else RuntimeError)(message)


def _host_copy_fallback(src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor) -> int:
    import ctypes

    total = 0
    for s, d, z in _checked_descriptors(src, dst, sizes):
        if z:
            ctypes.memmove(d, s, z)
        total += z
    return total


def _checked_descriptors(
    src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor
) -> list[tuple[int, int, int]]:
    """The descriptors as ``(src, dst, size)`` ints, each checked (size ≥ 0, no null address)."""
    out = list(zip(src.tolist(), dst.tolist(), sizes.tolist(), strict=True))
    for i, (s, d, z) in enumerate(out):
        if z < 0:
            raise ValueError(f"batch_copy: sizes[{i}] = {z} is negative")
        if z and (s == 0 or d == 0):
            raise ValueError(f"batch_copy: descriptor {i} has a null address (src {s}, dst {d})")
    return out


class _DeviceBytes:
    """``size`` bytes of device memory at ``ptr``, for ``torch.as_tensor`` (CUDA array
    interface v3; ``stream: None`` — the caller orders the work)."""

    def __init__(self, ptr: int, size: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


def _stream_copy_fallback(
    src: torch.Tensor,
    dst: torch.Tensor,
    sizes: torch.Tensor,
    stream: torch.cuda.Stream,
    load: bool,
) -> int:
    """One torch ``copy_`` per descriptor on ``stream`` (host side: ``src`` when ``load``)."""
    import ctypes

    descriptors = _checked_descriptors(src, dst, sizes)
    total = 0
    with torch.cuda.stream(stream):
        for s, d, z in descriptors:
            if not z:
                continue
            host_ptr, dev_ptr = (s, d) if load else (d, s)
            host = torch.frombuffer((ctypes.c_uint8 * z).from_address(host_ptr), dtype=torch.uint8)
            dev = torch.as_tensor(_DeviceBytes(dev_ptr, z), device=stream.device)
            if load:
                dev.copy_(host, non_blocking=True)
            else:
                host.copy_(dev, non_blocking=True)
            total += z
    return total


def _check_views(src: torch.Tensor, dst: torch.Tensor) -> None:
    if src.dtype != torch.int8 or dst.dtype != torch.int8:
        raise ValueError(f"swap_blocks needs int8 views, got {src.dtype} and {dst.dtype}")
    if src.dim() != 2 or dst.dim() != 2 or src.shape[1] != dst.shape[1]:
        raise ValueError(f"page sizes differ: src {tuple(src.shape)}, dst {tuple(dst.shape)}")


def _check_ids(src_ids: np.ndarray, dst_ids: np.ndarray, n_src: int, n_dst: int) -> None:
    if src_ids.ndim != 1 or src_ids.shape != dst_ids.shape:
        raise ValueError(f"{src_ids.size} source ids but {dst_ids.size} destination ids")
    if len(src_ids) == 0:
        return
    for name, ids, bound in (("src", src_ids, n_src), ("dst", dst_ids, n_dst)):
        if ids.min() < 0 or ids.max() >= bound:
            bad = ids[(ids < 0) | (ids >= bound)]
            raise ValueError(f"{name} block id out of range [0, {bound}): {bad.tolist()}")


def block_descriptors(
    src: torch.Tensor, dst: torch.Tensor, src_ids: np.ndarray, dst_ids: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Descriptor arrays for copying row ``src[src_ids[i]]`` to row ``dst[dst_ids[i]]``.

    Rows must be contiguous (``stride(1) == 1``); the row stride may exceed the page. Ids are
    assumed validated. Returns three 1-D int64 CPU tensors ``(src_ptrs, dst_ptrs, sizes)``.
    """
    page = src.shape[1]
    s = src.data_ptr() + np.asarray(src_ids, dtype=np.int64) * src.stride(0)
    d = dst.data_ptr() + np.asarray(dst_ids, dtype=np.int64) * dst.stride(0)
    z = np.full(len(s), page, dtype=np.int64)
    return torch.from_numpy(s), torch.from_numpy(d), torch.from_numpy(z)


def _triton_ok(src: torch.Tensor, dst: torch.Tensor, page: int) -> str | None:
    """None if the Triton kernel may copy these views, else the reason it may not."""
    if not triton_available():
        return "Triton is not available"
    if page % 8 or src.data_ptr() % 8 or dst.data_ptr() % 8:
        return f"page {page} and base addresses must be multiples of 8"
    if src.stride(0) % 8 or dst.stride(0) % 8:
        return f"row strides {src.stride(0)}, {dst.stride(0)} must be multiples of 8"
    mod = _build.load_triton()
    if mod is None:
        return "Triton is not available"
    if mod.interpreted():
        if src.is_cuda or dst.is_cuda:
            return "TRITON_INTERPRET=1 runs on CPU tensors only"
    else:
        if not (src.is_cuda or dst.is_cuda):
            return "the compiled Triton kernel needs a CUDA tensor (or set TRITON_INTERPRET=1)"
        for name, t in (("source", src), ("destination", dst)):
            if not t.is_cuda and not t.is_pinned():
                return f"the host {name} rows must be pinned for the Triton kernel"
    return None


def select_kernel(
    src: torch.Tensor, dst: torch.Tensor, n: int, *, wait_for_build: bool = True
) -> str:
    """The implementation ``kernel="auto"`` picks for ``n`` copies between these views.

    ``wait_for_build=False`` (the serving paths): an extension still building counts as absent
    (``"torch"`` instead of ``"cpp"``) and its build is started in the background."""
    page = src.shape[1]
    rows_ok = src.stride(1) == 1 and dst.stride(1) == 1
    ext = _build.load_extension() if wait_for_build else _build.extension_if_ready()
    cuda = src.is_cuda or dst.is_cuda
    native = "cpp" if rows_ok and ext is not None and (not cuda or ext.has_cuda()) else "torch"
    if rows_ok and src.is_cuda != dst.is_cuda and "cpu" in (src.device.type, dst.device.type):
        cfg = kernel_settings()
        limit = cfg.triton_max_page_bytes if dst.is_cuda else cfg.triton_max_store_page_bytes
        if page < limit and n >= cfg.triton_min_descriptors and _triton_ok(src, dst, page) is None:
            return "triton"
    return native


def swap_blocks(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_ids: np.ndarray,
    dst_ids: np.ndarray,
    *,
    kernel: Kernel = "auto",
) -> int:
    """Copy row ``src[src_ids[i]]`` into row ``dst[dst_ids[i]]`` for every i.

    Args:
        src: int8 tensor ``(num_src_blocks, page_bytes)``; rows may be strided (row stride ≥ page,
            e.g. a view of a shared host region). Non-torch kernels need ``stride(1) == 1``.
        dst: int8 tensor ``(num_dst_blocks, page_bytes)`` with the same page size.
        src_ids, dst_ids: 1-D int64 arrays of equal length (block ids; dst ids should be distinct).
        kernel: ``"auto"`` (vLLM's dispatch, see the module docstring), or force ``"cpp"``,
            ``"triton"`` or ``"torch"``.

    Returns:
        bytes copied (``len(src_ids) × page_bytes``). On CUDA the copy is enqueued on the current
        stream and may still be running; host→GPU copies through the C++ op let the driver read
        the host rows out of stream order (``cudaMemcpyBatchAsync`` source access order "ANY", as in
        vLLM's ``kv_offload/cpu/gpu_worker.py``), so nothing may write those rows until
        the copy completes.

    The first non-torch call builds the extension (tens of seconds, cached on disk afterwards):
    call :func:`extension_available` once at start-up, off the event loop.

    Raises:
        ValueError: mismatched lengths, page sizes or dtypes, an id out of range, an unknown
            ``kernel``, or a forced kernel that cannot copy these views (the message says why).
        RuntimeError: the forced ``"cpp"`` kernel is not built, or a CUDA error.
    """
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {', '.join(KERNELS)}")
    _check_views(src, dst)
    src_ids = np.asarray(src_ids, dtype=np.int64)
    dst_ids = np.asarray(dst_ids, dtype=np.int64)
    _check_ids(src_ids, dst_ids, src.shape[0], dst.shape[0])
    n = len(src_ids)
    if n == 0:
        return 0
    page = src.shape[1]
    if kernel == "auto":
        kernel = select_kernel(src, dst, n)  # type: ignore[assignment]
    if kernel == "torch":
        return _swap_torch(src, dst, src_ids, dst_ids)
    if src.stride(1) != 1 or dst.stride(1) != 1:
        raise ValueError(
            f"kernel {kernel!r} needs contiguous rows, "
            f"got strides {src.stride()} and {dst.stride()}"
        )
    if kernel == "triton":
        why = _triton_ok(src, dst, page)
        if why is not None:
            raise ValueError(f"kernel 'triton' cannot copy these views: {why}")
        return _swap_triton(src, dst, src_ids, dst_ids)
    ext = _build.load_extension()
    if ext is None:
        raise RuntimeError(f"kernel 'cpp' is not built: {_build.extension_error()}")
    s, d, z = block_descriptors(src, dst, src_ids, dst_ids)
    cuda = dst if dst.is_cuda else src
    if not cuda.is_cuda:
        return _checked(ext.batch_copy(s, d, z))
    if not ext.has_cuda():
        raise RuntimeError("kernel 'cpp' was built without CUDA; use kernel='torch'")
    with torch.cuda.device(cuda.device):
        stream = torch.cuda.current_stream(cuda.device).cuda_stream
        load = src.device.type == "cpu"
        return _checked(ext.batch_copy_cuda(s, d, z, stream, load))


def _swap_torch(
    src: torch.Tensor, dst: torch.Tensor, src_ids: np.ndarray, dst_ids: np.ndarray
) -> int:
    s = torch.from_numpy(src_ids).to(src.device)
    d = torch.from_numpy(dst_ids).to(dst.device)
    rows = src.index_select(0, s)
    if rows.device != dst.device:
        rows = rows.to(dst.device, non_blocking=False)
    dst.index_copy_(0, d, rows)
    return len(src_ids) * src.shape[1]


def _swap_triton(
    src: torch.Tensor, dst: torch.Tensor, src_ids: np.ndarray, dst_ids: np.ndarray
) -> int:
    s, d, z = block_descriptors(src, dst, src_ids, dst_ids)
    cuda = dst if dst.is_cuda else src
    if cuda.is_cuda:
        with torch.cuda.device(cuda.device):
            return triton_batch_copy(s, d, z, src.shape[1], device=cuda.device)
    return triton_batch_copy(s, d, z, src.shape[1])


def triton_batch_copy(
    src_ptrs: torch.Tensor,
    dst_ptrs: torch.Tensor,
    sizes: torch.Tensor,
    max_page_bytes: int,
    device: torch.device | None = None,
) -> int:
    """The Triton kernel over descriptor arrays (vLLM's ``kv_offload/cpu/swap_blocks_triton.py``),
    enqueued on the current stream.

    Args:
        src_ptrs, dst_ptrs, sizes: 1-D int64 CPU descriptor arrays (sizes multiples of 8 bytes).
        max_page_bytes: the largest size (chooses the kernel's chunk).
        device: the CUDA device to run on (descriptors are copied there); None under
            ``TRITON_INTERPRET=1`` (CPU tensors).

    Returns:
        bytes enqueued. Raises RuntimeError when Triton is not available.
    """
    mod = _build.load_triton()
    if mod is None:
        raise RuntimeError("kernel 'triton' is not available")
    if device is None and torch.cuda.is_available() and not mod.interpreted():
        device = torch.device("cuda")
    total = int(sizes.sum())  # before the arrays move to the device
    if device is not None:
        src_ptrs, dst_ptrs, sizes = (
            t.pin_memory().to(device, non_blocking=True) for t in (src_ptrs, dst_ptrs, sizes)
        )
    mod.batch_copy(src_ptrs, dst_ptrs, sizes, max_page_bytes, kernel_settings().triton_num_programs)
    return total
