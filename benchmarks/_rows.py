"""The ratio rows every benchmark writes with ``--json PATH`` (read by ``benchmarks/run_all.py``).

A file is ``{"benchmark": "<script stem>", "command": "<argv joined>", "rows": [ROW, ...]}``,
each ROW ``{"name", "measured", "baseline", "ratio", "goal", "met", "unit"}``: ``ratio`` is
``measured / baseline`` (null without a baseline), ``goal`` a short comparison such as
``">= 1.0"`` or ``"<= 0.5"`` applied to the ratio (to ``measured`` when there is no baseline),
``met`` whether it holds (null without a goal). ``unit`` names what ``measured`` and
``baseline`` are in (``"GB/s"``, ``"us/key"``).
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

_COMPARE = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}


def _holds(goal: str, value: float) -> bool:
    """Whether ``value`` meets ``goal`` (``"<op> <number>"``, op one of >=, <=, >, <).

    Raises:
        ValueError: ``goal`` is not of that form.
    """
    op, _, number = goal.strip().partition(" ")
    try:
        return _COMPARE[op](value, float(number))
    except (KeyError, ValueError):
        raise ValueError(f"bad goal {goal!r} (expected e.g. '>= 1.0' or '<= 0.5')") from None


@dataclass(frozen=True)
class Row:
    """One measured figure, its baseline from the same run, and the goal on their ratio."""

    name: str
    measured: float
    baseline: float | None
    ratio: float | None
    goal: str | None
    met: bool | None
    unit: str

    @classmethod
    def of(
        cls,
        name: str,
        measured: float,
        baseline: float | None,
        goal: str | None,
        unit: str,
    ) -> Row:
        """A row with ``ratio = measured / baseline`` and ``met`` computed from ``goal``.

        Raises:
            ValueError: ``goal`` is malformed (see :func:`_holds`).
        """
        ratio = measured / baseline if baseline else None
        judged = ratio if baseline is not None else measured
        met = None if goal is None or judged is None else _holds(goal, judged)
        return cls(name, float(measured), baseline, ratio, goal, met, unit)


def rows_path(text: str) -> str:
    """``--json``'s argparse type: ``text`` if a file can be written there, checked before the
    benchmark runs (a directory, or a missing or read-only parent, failed only at its end).

    Raises:
        argparse.ArgumentTypeError: empty, a directory, or its parent is not a writable
            directory.
    """
    path = Path(text)
    if not text or path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a file path")
    parent = path.resolve().parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text}: directory {parent} is not writable")
    return text


def write_rows(path: str | Path, benchmark: str, rows: list[Row]) -> None:
    """Write ``rows`` as the JSON document above to ``path``; ``command`` is ``sys.argv``."""
    doc = {
        "benchmark": benchmark,
        "command": " ".join(sys.argv),
        "rows": [asdict(row) for row in rows],
    }
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")
