"""Reading request traces (Mooncake JSONL: one request per line, chained block ids)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TextIO

from .._errors import TraceError
from .._validate import finite_number, is_int

TOKENS_PER_BLOCK = 512
_MAX_ID = 1 << 64  # block ids become 8-byte block hashes


@dataclass(frozen=True)
class TraceRequest:
    """One request: arrival ``timestamp_ms``, ``input_length`` tokens, chained ``hash_ids``,
    ``output_length`` generated tokens (0 when the line has none)."""

    index: int
    timestamp_ms: int
    input_length: int
    hash_ids: tuple[int, ...]
    output_length: int = 0


def bundled_trace() -> Path:
    """Path of the bundled Mooncake conversation trace (Apache-2.0; see ``data/NOTICE.md``)."""
    return Path(str(resources.files("kvcascade") / "data" / "mooncake_conversation_trace.jsonl"))


#: Longest trace line accepted, in characters (a request of a million blocks fits): a file
#: without line ends (``/dev/zero``, a binary file) ends in a clear error, not a MemoryError.
_MAX_LINE = 64 << 20


def _lines(handle: TextIO, path: Path) -> Iterator[tuple[int, str]]:
    lineno = 0
    try:
        while line := handle.readline(_MAX_LINE + 1):
            lineno += 1
            if len(line) > _MAX_LINE:
                raise TraceError(
                    f"{path}:{lineno}: line longer than {_MAX_LINE} characters (not a JSONL trace?)"
                )
            yield lineno, line
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}:{lineno + 1}: not UTF-8 text ({exc.reason})") from exc


def read_trace(path: str | os.PathLike[str], limit: int | None = None) -> list[TraceRequest]:
    """Parse a JSONL trace; each line needs ``hash_ids`` (a list of non-negative ints).

    Args:
        path: the trace file.
        limit: read at most this many requests (None: all).

    Raises:
        TraceError: the file is missing, unreadable or empty, or a line is malformed (the
            message names the file, the line number and the bad value).
    """
    return list(_iter_trace(Path(path), limit))


def _iter_trace(path: Path, limit: int | None) -> Iterator[TraceRequest]:
    try:
        handle = path.open("r", encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"cannot read trace {str(path)!r}: {exc.strerror or exc}") from exc
    count = 0
    with handle:
        for lineno, line in _lines(handle, path):
            if limit is not None and count >= limit:
                return
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
            if not isinstance(record, dict):
                raise TraceError(
                    f"{path}:{lineno}: expected a JSON object, got {line.strip()[:60]!r}"
                )
            ids = record.get("hash_ids")
            if not isinstance(ids, list) or not all(is_int(h) and 0 <= h < _MAX_ID for h in ids):
                raise TraceError(
                    f"{path}:{lineno}: 'hash_ids' must be a list of integers in [0, 2**64), "
                    f"got {str(ids)[:60]}"
                )
            ts = record.get("timestamp", 0)
            length = record.get("input_length", len(ids) * TOKENS_PER_BLOCK)
            output = record.get("output_length", 0)
            if finite_number(ts) is None:
                raise TraceError(f"{path}:{lineno}: bad timestamp {ts!r:.40}")
            if not is_int(length) or length < 0:
                raise TraceError(f"{path}:{lineno}: bad input_length {length!r:.40}")
            if not is_int(output) or output < 0:
                raise TraceError(f"{path}:{lineno}: bad output_length {output!r}")
            yield TraceRequest(count, int(ts), length, tuple(ids), output)
            count += 1
    if count == 0:
        raise TraceError(f"trace {str(path)!r} has no requests")
