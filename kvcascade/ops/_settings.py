"""Tuned constants of the copy kernels, as named settings with their provenance.

Defaults come from vLLM's CPU offload worker (``kv_offload/cpu/gpu_worker.py``), **tuned by vLLM on
an H100 over PCIe Gen5**; other machines may prefer other values. A JSON file can override any of
them::

    {"triton_max_page_bytes": 262144, "triton_max_store_page_bytes": 262144,
     "triton_min_descriptors": 16, "triton_num_programs": 12,
     "provenance": "kvcascade calibrate on NVIDIA H200, 2026-11-29"}

The file is ``$KVCASCADE_KERNEL_SETTINGS`` if set, else ``~/.cache/kvcascade/kernel_settings.json``
(the place ``kvcascade calibrate`` writes). Unknown keys are ignored
except ``provenance``, which is kept for display; a malformed file raises :class:`ValueError`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from .._validate import is_int

#: CPU→GPU loads use the Triton kernel only when the largest page is below this many bytes.
TRITON_MAX_PAGE_BYTES = 28 * 1024
#: GPU→CPU stores use the Triton kernel only for pages below this many bytes; 0 (vLLM's rule):
#: never — stores stay on the copy engines and leave every SM to the forward pass. On one H200
#: (benchmarks/gpu_check.sh, 2026-11-29) Triton stored 4 KiB pages at 38 GB/s against the batch
#: op's 5.5 GB/s, and both reached ~50 GB/s from 256 KiB: `kvcascade calibrate` measures it.
TRITON_MAX_STORE_PAGE_BYTES = 0
#: … and only when the batch has at least this many descriptors (fewer → the C++ batch op).
TRITON_MIN_DESCRIPTORS = 16
#: Number of Triton programs (vLLM's ``NUM_SMS``); program p copies descriptors p, p+N, …
TRITON_NUM_PROGRAMS = 12

DEFAULT_PROVENANCE = "vLLM kv_offload defaults, tuned on H100 PCIe Gen5"


@dataclasses.dataclass(frozen=True)
class KernelSettings:
    """Dispatch thresholds of :func:`kvcascade.ops.swap_blocks` (all sizes in bytes)."""

    triton_max_page_bytes: int = TRITON_MAX_PAGE_BYTES
    triton_max_store_page_bytes: int = TRITON_MAX_STORE_PAGE_BYTES
    triton_min_descriptors: int = TRITON_MIN_DESCRIPTORS
    triton_num_programs: int = TRITON_NUM_PROGRAMS
    provenance: str = DEFAULT_PROVENANCE


def settings_path() -> Path:
    """Where the override file is looked for (it need not exist)."""
    env = os.environ.get("KVCASCADE_KERNEL_SETTINGS")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "kvcascade" / "kernel_settings.json"


def load_settings(path: Path | str | None = None) -> KernelSettings:
    """Defaults overridden by the JSON file at ``path`` (default :func:`settings_path`), if any.

    Raises:
        ValueError: the file is not a JSON object, or a value is not a positive int (the store
            threshold may be 0).
    """
    p = Path(path) if path is not None else settings_path()
    if not p.is_file():
        return KernelSettings()
    try:
        raw = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read kernel settings {p}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"kernel settings {p} must hold a JSON object, got {type(raw).__name__}")
    values: dict[str, object] = {}
    for field in dataclasses.fields(KernelSettings):
        if field.name not in raw:
            continue
        value = raw[field.name]
        if field.name == "provenance":
            values[field.name] = str(value)
        elif not is_int(value) or value < (0 if field.name == "triton_max_store_page_bytes" else 1):
            kind = "a non-negative" if field.name == "triton_max_store_page_bytes" else "a positive"
            raise ValueError(f"kernel setting {field.name} in {p} must be {kind} int: {value!r}")
        else:
            values[field.name] = value
    values.setdefault("provenance", f"{p}")
    return KernelSettings(**values)  # type: ignore[arg-type]
