"""``kvcascade replay``: a simulated engine running a real trace through the cascade, byte-exact.

Each trace request is one engine step: the GPU prefix cache (LRU over ``gpu_blocks`` blocks)
serves the leading blocks it holds; the cascade finds the longest further prefix held by the CPU
primary tier or a secondary tier, promotes and loads it into GPU blocks; the remaining blocks are
"prefilled" with bytes that are a deterministic function of (block id, byte offset); the new
blocks are then stored through the cascade. Every block loaded back into the GPU is compared byte
for byte with the expected pattern: a mismatch is counted as served wrong and recomputed, never a
hit.

The report keeps, per tier, what went wrong (:func:`_tier_failures`), the time each request
waited for its cached prefix (``lookup_prefix`` + ``load``, the cascade's part of a request's
time to first token) and, per request, the hits per tier and the bytes moved on each link so far
(:func:`write_plot` draws them).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._config import CascadeConfig, redact
from .._errors import ConfigError
from .._keys import make_offload_key
from .._types import ReqContext
from ..cascade import Cascade, open_cascade
from ..tiers.registry import tier_name
from .trace import TraceRequest

_K1 = np.uint64(0x9E3779B97F4A7C15)
_K2 = np.uint64(0xBF58476D1CE4E5B9)
_K3 = np.uint64(0x94D049BB133111EB)


def block_key(block_id: int) -> bytes:
    """Offload key of trace block ``block_id`` (8-byte big-endian hash, group 0)."""
    return make_offload_key(block_id.to_bytes(8, "big"), 0)


def expected_bytes(block_ids: Sequence[int], nbytes: int) -> np.ndarray:
    """The KV bytes the replay writes for each block: uint8 ``(len(block_ids), nbytes)``.

    Word ``j`` of block ``b`` is ``mix(b) ^ (j × K)`` (64-bit), so any swapped, stale or flipped
    byte shows.
    """
    ids = np.asarray(block_ids, dtype=np.uint64)
    with np.errstate(over="ignore"):
        seed = (ids + _K1) * _K2
        seed ^= seed >> np.uint64(31)
        seed *= _K3
        words = -(-nbytes // 8)
        pattern = np.arange(words, dtype=np.uint64)[None, :] * _K1 ^ seed[:, None]
    return pattern.view(np.uint8)[:, :nbytes]


class GPUPrefixCache:
    """The engine's GPU prefix cache: LRU of block id → GPU block, ``capacity`` blocks."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._free = list(range(capacity - 1, -1, -1))
        self.evictions = 0

    def leading_hits(self, hash_ids: Sequence[int]) -> int:
        """Length of the leading run of ``hash_ids`` held by the cache."""
        n = 0
        for h in hash_ids:
            if h not in self.blocks:
                break
            n += 1
        return n

    def touch(self, hash_ids: Sequence[int]) -> None:
        """Move ``hash_ids`` to the most-recent end, in order."""
        for h in hash_ids:
            self.blocks.move_to_end(h)

    def allocate(self, hash_ids: Sequence[int], protected: Sequence[int]) -> list[int]:
        """GPU blocks for ``hash_ids`` (freed first if cached), evicting LRU unprotected blocks."""
        for h in hash_ids:
            if h in self.blocks:
                self._free.append(self.blocks.pop(h))
        keep = set(protected)
        while len(self._free) < len(hash_ids):
            victim = next(h for h in self.blocks if h not in keep)
            self._free.append(self.blocks.pop(victim))
            self.evictions += 1
        out = [self._free.pop() for _ in hash_ids]
        for h, gpu_id in zip(hash_ids, out):
            self.blocks[h] = gpu_id
        return out


@dataclass
class ReplayReport:
    """What a replay measured. ``bytes`` and ``hit_blocks`` are keyed by tier / direction.

    ``corrupt_blocks``: blocks a tier's integrity check caught (deleted, recomputed; the sum of
    ``tiers[name]["corrupt_blocks"]``). ``mismatched_blocks``: blocks loaded into the GPU with
    wrong bytes (served wrong; the replay exits non-zero). ``dropped_store_blocks``: GPU → CPU
    stores the primary tier dropped. ``tiers``: per secondary tier, :func:`_tier_failures`.
    ``load_latency_s``: per request, seconds of ``lookup_prefix`` + ``load``. ``hit_series``
    (per tier) and ``instance_series``: per request, hit blocks and block instances;
    ``bytes_series``: per link, bytes moved up to the end of each request.
    """

    requests: int = 0
    block_instances: int = 0
    hit_blocks: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    verified_blocks: int = 0
    corrupt_blocks: int = 0
    mismatched_blocks: int = 0
    evictions: dict[str, int] = field(default_factory=dict)
    dropped_store_blocks: int = 0
    tiers: dict[str, dict[str, int]] = field(default_factory=dict)
    wall_s: float = 0.0
    config: dict[str, Any] = field(default_factory=dict)
    load_latency_s: list[float] = field(default_factory=list)
    hit_series: dict[str, list[int]] = field(default_factory=dict)
    instance_series: list[int] = field(default_factory=list)
    bytes_series: dict[str, list[int]] = field(default_factory=dict)

    @property
    def prefix_hit_ratio(self) -> float:
        """All hit block instances / block instances."""
        return sum(self.hit_blocks.values()) / self.block_instances if self.block_instances else 0.0

    def latency_percentiles_ms(self) -> dict[str, float]:
        """p50 / p90 / p99 / max of :attr:`load_latency_s`, milliseconds (empty: no requests)."""
        if not self.load_latency_s:
            return {}
        ms = np.asarray(self.load_latency_s) * 1e3
        p50, p90, p99 = np.percentile(ms, [50, 90, 99])
        return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "max": float(ms.max())}

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON-ready dict (the ``--json`` file; the per-request series are left
        out)."""
        return {
            "requests": self.requests,
            "block_instances": self.block_instances,
            "hit_blocks": dict(self.hit_blocks),
            "prefix_hit_ratio": self.prefix_hit_ratio,
            "bytes": dict(self.bytes),
            "verified_blocks": self.verified_blocks,
            "corrupt_blocks": self.corrupt_blocks,
            "mismatched_blocks": self.mismatched_blocks,
            "evictions": dict(self.evictions),
            "dropped_store_blocks": self.dropped_store_blocks,
            "tiers": {name: dict(rows) for name, rows in self.tiers.items()},
            "load_latency_ms": self.latency_percentiles_ms(),
            "wall_s": self.wall_s,
            "config": self.config,
        }


async def replay(
    trace: Sequence[TraceRequest],
    config: CascadeConfig,
    progress: Callable[[int], Awaitable[None] | None] | None = None,
) -> ReplayReport:
    """Run ``trace`` through a cascade built from ``config``; see the module docstring.

    Args:
        trace: the requests, in arrival order (one step each).
        config: tiers and sizes; ``config.gpu_blocks`` must hold the longest request.
        progress: called with 1 after each request; an awaitable it returns is awaited before
            the next request (a callback that must wait, e.g. for a server it restarts, waits
            without blocking the loop the tiers run on).

    Raises:
        ConfigError: the GPU cache cannot hold the longest request.
    """
    longest = max((len(r.hash_ids) for r in trace), default=0)
    if longest > config.gpu_blocks:
        raise ConfigError(
            f"gpu_blocks={config.gpu_blocks} cannot hold the longest request ({longest} blocks); "
            f"give gpu_blocks {longest} or more"
        )
    report = ReplayReport(config=_describe(config))
    report.hit_blocks = {
        "gpu": 0,
        "cpu": 0,
        **{tier_name(t): 0 for t in config.secondary_tiers},
    }
    report.hit_series = {tier: [] for tier in report.hit_blocks}
    start = time.perf_counter()
    async with open_cascade(config) as cascade:  # allocates (and checks) the device first
        gpu = GPUPrefixCache(config.gpu_blocks)
        for request in trace:
            await _step(cascade, gpu, request, report)
            if progress is not None and (waiting := progress(1)) is not None:
                await waiting
        _collect(cascade, gpu, report)
    report.wall_s = time.perf_counter() - start
    return report


async def _step(
    cascade: Cascade, gpu: GPUPrefixCache, request: TraceRequest, report: ReplayReport
) -> None:
    ids = request.hash_ids
    keys = [block_key(h) for h in ids]
    ctx = ReqContext(f"req-{request.index}")
    cascade.coordinator.on_new_request(ctx)
    report.requests += 1
    report.block_instances += len(ids)
    hits = dict.fromkeys(report.hit_blocks, 0)

    g = gpu.leading_hits(ids)
    gpu.touch(ids[:g])
    hits["gpu"] = g
    cascade.touch(keys, ctx)
    started = time.perf_counter()
    found = await cascade.lookup_prefix(keys[g:], ctx)
    gpu_ids = gpu.allocate(ids[g:], protected=ids[:g])
    loaded = 0
    result = None
    if found.num_hits:
        result = await cascade.load(found.keys, ctx, gpu_ids[: found.num_hits])
    report.load_latency_s.append(time.perf_counter() - started)
    if result is not None:
        loaded = _verify(cascade, ids[g : g + result.loaded], gpu_ids[: result.loaded], report)
        for tier in found.tiers[:loaded]:
            hits[tier] += 1
    for tier, n in hits.items():
        report.hit_blocks[tier] += n
        report.hit_series[tier].append(n)
    report.instance_series.append(len(ids))
    new_ids = ids[g + loaded :]
    new_gpu = gpu_ids[loaded:]
    if new_ids:
        kv = cascade.device.kv
        rows = torch.from_numpy(expected_bytes(new_ids, kv.shape[1]).view(np.int8))
        kv.index_copy_(
            0, torch.as_tensor(new_gpu, dtype=torch.int64, device=kv.device), rows.to(kv.device)
        )
        # Like an engine storing chunk by chunk across steps: a prompt larger than the primary
        # tier still reaches it (and the cascade) in pieces that fit.
        piece = max(1, cascade.primary.num_blocks)
        new_keys = keys[g + loaded :]
        for i in range(0, len(new_keys), piece):
            await cascade.store(new_keys[i : i + piece], ctx, new_gpu[i : i + piece])
    cascade.finish_request(ctx)
    await cascade.wait_cascades()
    for link, n in _link_bytes(cascade).items():
        report.bytes_series.setdefault(link, []).append(n)


def _verify(
    cascade: Cascade, ids: Sequence[int], gpu_ids: Sequence[int], report: ReplayReport
) -> int:
    """Compare loaded GPU blocks with the expected bytes; return the verified leading count."""
    if not ids:
        return 0
    kv = cascade.device.kv
    got = kv.index_select(0, torch.as_tensor(gpu_ids, dtype=torch.int64, device=kv.device)).cpu()
    ok = np.all(got.numpy().view(np.uint8) == expected_bytes(ids, kv.shape[1]), axis=1)
    good = len(ids) if ok.all() else int(np.argmin(ok))
    report.verified_blocks += good
    report.mismatched_blocks += int((~ok).sum())
    return good


def _link_bytes(cascade: Cascade) -> dict[str, int]:
    """Bytes moved so far on each link: ``gpu_to_cpu``, ``cpu_to_<tier>``, ``<tier>_to_cpu``,
    ``cpu_to_gpu``."""
    device = cascade.device
    out = {"gpu_to_cpu": device.bytes_stored}
    for tier in cascade.tiers:
        out[f"cpu_to_{tier.name}"] = tier.counters["store_bytes"]
        out[f"{tier.name}_to_cpu"] = tier.counters["load_bytes"]
    out["cpu_to_gpu"] = device.bytes_loaded
    return out


def _tier_failures(cascade: Cascade, tier_idx: int) -> dict[str, int]:
    """What went wrong with secondary tier ``tier_idx`` during the run.

    * ``dropped_store_blocks``: cascade blocks never written to it — refused by back-pressure
      (:mod:`kvcascade.backpressure`, ``dropped_by_backpressure``) or by the tier itself while
      it was down or full (its ``counters["store_dropped_blocks"]``);
    * ``failed_store_jobs`` / ``failed_load_jobs``: jobs that failed (stores refused by a full
      queue included), ``timed_out_jobs``: jobs past their deadline, ``failed_jobs``: all of
      them and the jobs that raised an unexpected error;
    * ``corrupt_blocks``: blocks its integrity check caught (deleted, recomputed).
    """
    tier = cascade.tiers[tier_idx]
    c = tier.counters
    backpressure = int(cascade.coordinator.metrics.value("cascade_dropped_blocks", tier_idx))
    failed_stores = c["store_failures"] + c["store_rejected"]
    return {
        "dropped_store_blocks": backpressure + c["store_dropped_blocks"],
        "dropped_by_backpressure": backpressure,
        "failed_jobs": failed_stores + c["load_failures"] + c["timeouts"] + c["errors"],
        "failed_store_jobs": failed_stores,
        "failed_load_jobs": c["load_failures"],
        "timed_out_jobs": c["timeouts"],
        "corrupt_blocks": c["corrupt_blocks"],
    }


def _collect(cascade: Cascade, gpu: GPUPrefixCache, report: ReplayReport) -> None:
    report.bytes = _link_bytes(cascade)
    report.evictions = {"gpu": gpu.evictions, "cpu": cascade.primary.total_evictions}
    for idx, tier in enumerate(cascade.tiers):
        report.evictions[tier.name] = tier.counters["evictions"]
        report.tiers[tier.name] = _tier_failures(cascade, idx)
    report.corrupt_blocks = sum(rows["corrupt_blocks"] for rows in report.tiers.values())
    report.dropped_store_blocks = cascade.counters["store_dropped_blocks"]


def _describe(config: CascadeConfig) -> dict[str, Any]:
    return {
        "block_bytes": config.block_bytes,
        "gpu_blocks": config.gpu_blocks,
        "cpu_blocks": config.num_cpu_blocks,
        "eviction_policy": config.eviction_policy,
        "secondary_tiers": [redact(t) for t in config.secondary_tiers],
    }


def write_plot(report: ReplayReport, path: str) -> None:
    """Write a PNG of ``report`` to ``path``: top, the hit ratio of each tier over the run
    (hit blocks / block instances over a sliding window of ``max(1, requests // 50)``
    requests); bottom, the MiB moved on each link up to each request.

    Needs matplotlib (the ``plot`` extra: ``pip install 'kvcascade[plot]'``); drawn on a
    :class:`matplotlib.figure.Figure` of its own (no pyplot state, no display needed).

    Raises:
        ImportError: matplotlib is not installed.
        OSError: ``path`` cannot be written.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 7), layout="constrained")
    hit_ax, bytes_ax = fig.subplots(2, 1, sharex=True)
    window = max(1, report.requests // 50)
    kernel = np.ones(window)
    instances = np.convolve(report.instance_series, kernel, mode="valid")
    x = np.arange(window, report.requests + 1)
    for tier, series in report.hit_series.items():
        hits = np.convolve(series, kernel, mode="valid")
        ratio = np.divide(hits, instances, out=np.zeros_like(hits), where=instances > 0)
        hit_ax.plot(x, ratio, label=tier)
    hit_ax.set_ylabel(f"hit ratio ({window}-request window)")
    hit_ax.set_ylim(0, 1)
    hit_ax.legend(loc="upper left")
    requests = np.arange(1, report.requests + 1)
    for link, series in report.bytes_series.items():
        bytes_ax.plot(requests, np.asarray(series) / (1 << 20), label=link.replace("_to_", " → "))
    bytes_ax.set_xlabel("request")
    bytes_ax.set_ylabel("MiB moved (cumulative)")
    bytes_ax.legend(loc="upper left")
    fig.suptitle(f"kvcascade replay: {report.requests:,} requests")
    fig.savefig(path, format="png")


_TMP_PREFIX = "kvcascade-replay-"


def remove_stale_replay_dirs(parent: str | None = None) -> list[str]:
    """Remove the temporary fs-tier directories of replays whose process is gone.

    Args:
        parent: where to look (default: :func:`tempfile.gettempdir`).

    Returns:
        the directories removed. A directory whose owner process still runs, or whose name
        carries no process id (``kvcascade-replay-<pid>-…``), is left alone.
    """
    parent = parent or tempfile.gettempdir()
    removed = []
    for path in Path(parent).glob(f"{_TMP_PREFIX}*"):
        pid_text = path.name[len(_TMP_PREFIX) :].split("-", 1)[0]
        if not path.is_dir() or not pid_text.isdigit() or _alive(int(pid_text)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(str(path))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def run_replay(
    trace: Sequence[TraceRequest],
    config: CascadeConfig,
    progress: Callable[[int], None] | None = None,
) -> ReplayReport:
    """Synchronous wrapper of :func:`replay` (runs its own event loop)."""
    return asyncio.run(replay(trace, config, progress))


@contextlib.contextmanager
def temporary_fs_root() -> Iterator[str]:
    """A temporary directory for the replay's fs tier, ``kvcascade-replay-<pid>-*``, removed on
    exit; those left by replays that were killed (SIGKILL, a crash) are removed first
    (:func:`remove_stale_replay_dirs`)."""
    remove_stale_replay_dirs()
    with tempfile.TemporaryDirectory(prefix=f"{_TMP_PREFIX}{os.getpid()}-") as tmp:
        yield tmp
