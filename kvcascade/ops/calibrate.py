"""``kvcascade calibrate``: measure the copy kernels on this machine and write the crossover.

For both directions between pinned host rows and device blocks (CPU→GPU loads, GPU→CPU stores)
it times the C++ batch op and the Triton kernel for each page size and descriptor count, and
writes :class:`~kvcascade.ops._settings.KernelSettings` — per direction the page size from which
Triton stops winning, and the smallest descriptor count at which it wins for loads — to the
settings file the library reads (:func:`~kvcascade.ops._settings.settings_path`). Without a CUDA
device there is nothing to choose: it reports the host copy rate and writes nothing.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from ._settings import KernelSettings, settings_path
from .swap import Kernel, swap_blocks

PAGE_SIZES = (4096, 8192, 16384, 28672, 32768, 65536, 131072, 262144, 1048576)
COUNTS = (4, 8, 16, 32, 128)
Direction = Literal["load", "store"]


@dataclass
class Measurement:
    """Median seconds of one ``swap_blocks`` call and the GB/s it means.

    ``direction`` is ``"load"`` (host rows → device blocks) or ``"store"`` (device → host)."""

    kernel: str
    page_bytes: int
    count: int
    seconds: float
    direction: Direction = "load"

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (1e9 bytes)."""
        return self.page_bytes * self.count / self.seconds / 1e9


def _time(fn: Callable[[], object], sync: Callable[[], None], reps: int) -> float:
    fn()
    sync()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return float(np.median(samples))


def measure(
    device: torch.device,
    kernels: Sequence[Kernel],
    page_sizes: Sequence[int] = PAGE_SIZES,
    counts: Sequence[int] = COUNTS,
    reps: int = 20,
    direction: Direction = "load",
) -> list[Measurement]:
    """Time each kernel copying ``count`` pages of ``page_bytes`` between host rows and ``device``
    (``"load"``: host → device; ``"store"``: device → host).

    Host rows are pinned when ``device`` is CUDA. Raises whatever a kernel raises.
    """
    out = []
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for page in page_sizes:
        n_blocks = max(counts) * 2
        host = torch.randint(-128, 127, (n_blocks, page), dtype=torch.int8)
        if cuda:
            host = host.pin_memory()
        dev = torch.zeros((n_blocks, page), dtype=torch.int8, device=device)
        rng = np.random.default_rng(0)
        for count in counts:
            src = rng.permutation(n_blocks)[:count].astype(np.int64)
            dst = rng.permutation(n_blocks)[:count].astype(np.int64)
            pair = (host, dev) if direction == "load" else (dev, host)
            for kernel in kernels:
                call = functools.partial(swap_blocks, *pair, src, dst, kernel=kernel)
                seconds = _time(call, sync, reps)
                out.append(Measurement(kernel, page, count, seconds, direction))
    return out


def crossover(results: Sequence[Measurement], provenance: str) -> KernelSettings:
    """Settings from measurements of ``cpp`` and ``triton``: per direction, Triton is used for
    pages below the smallest page size where it loses at the largest count; from the smallest
    count at which it wins loads of the smallest page size. A direction with no measurements
    keeps its default."""
    by = {(m.direction, m.kernel, m.page_bytes, m.count): m.seconds for m in results}
    defaults = KernelSettings()

    def max_page(direction: Direction, default: int) -> int:
        pages = sorted({m.page_bytes for m in results if m.direction == direction})
        if not pages:
            return default
        top = max(m.count for m in results if m.direction == direction)
        t, c = "triton", "cpp"
        loses = (p for p in pages if by[direction, t, p, top] >= by[direction, c, p, top])
        return next(loses, pages[-1] + 1)

    loads = [m for m in results if m.direction == "load"]
    min_count = defaults.triton_min_descriptors
    if loads:
        smallest = min(m.page_bytes for m in loads)
        counts = sorted({m.count for m in loads})
        min_count = next(
            (
                c
                for c in counts
                if by[("load", "triton", smallest, c)] < by[("load", "cpp", smallest, c)]
            ),
            counts[-1] + 1,
        )
    return KernelSettings(
        triton_max_page_bytes=max_page("load", defaults.triton_max_page_bytes),
        triton_max_store_page_bytes=max_page("store", defaults.triton_max_store_page_bytes),
        triton_min_descriptors=min_count,
        provenance=provenance,
    )


def calibrate(path: Path | None = None, reps: int = 20) -> tuple[list[Measurement], Path | None]:
    """Measure on the current device; on CUDA write the crossover settings to ``path``
    (default :func:`settings_path`). Returns the measurements and the file written (or None)."""
    if not torch.cuda.is_available():
        results = measure(
            torch.device("cpu"), ["cpp", "torch"], (4096, 65536), counts=(16, 128), reps=reps
        )
        return results, None
    device = torch.device("cuda")
    results = [
        m
        for direction in ("load", "store")
        for m in measure(device, ["cpp", "triton"], reps=reps, direction=direction)
    ]
    name = torch.cuda.get_device_name(device)
    settings = crossover(results, f"kvcascade calibrate on {name}, {time.strftime('%Y-%m-%d')}")
    target = path or settings_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(asdict(settings), indent=2) + "\n")
    return results, target
