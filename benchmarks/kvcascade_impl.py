"""Adapter for ``/work/shared/bench/bookkeeping.py --impl kvcascade_impl:make_manager``.

That script drives any object with vLLM's OffloadingManager method names; this factory returns
kvcascade's :class:`~kvcascade.CPUOffloadingManager` in its ``--impl`` format. Run it from the
repository's ``benchmarks/`` directory (or with it on ``sys.path``), with a Python that has both
vLLM and kvcascade::

    cd benchmarks && /work/vllm-venv/bin/python /work/shared/bench/bookkeeping.py \\
        --configs lru,arc --impl kvcascade_impl:make_manager
"""

from __future__ import annotations

from typing import Any

from kvcascade import CPUOffloadingManager, LookupResult, ReqContext

_HIT = LookupResult.HIT


def is_hit(result: LookupResult) -> bool:
    """True for a ``HIT`` answer."""
    return result is _HIT


def make_manager(kind: str, policy: str, capacity: int) -> dict[str, Any] | None:
    """``--impl`` factory: kvcascade's CPU manager for ``kind == "single"``; None otherwise.

    The tiering configuration is kvcascade's coordinator with asynchronous tiers, which does not
    have vLLM's synchronous manager shape, so it is not offered here.
    """
    if kind != "single":
        return None
    return {
        "manager": CPUOffloadingManager(capacity, policy),
        "make_ctx": ReqContext,
        "is_hit": is_hit,
    }
