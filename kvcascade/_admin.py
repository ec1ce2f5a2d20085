"""``kvcascade inspect`` and ``kvcascade purge``: what an fs tier's root directory holds, and
removing it by namespace and age (issue #21 item 6).

An fs tier's ``root_dir`` holds one namespace per engine configuration (``docs/fs-tier.md``,
Layout): ``<model>_<digest12>/config.json`` records the identity, and the block files live in
the sibling ``<model>_<digest12>_r<rank>/`` directories. ``max_bytes`` bounds only the namespace
of the tier that runs, so namespaces of old configurations accumulate; these commands show and
remove them. Neither imports torch; neither reads a block file's payload.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._errors import ConfigError

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_age(text: str) -> float:
    """Seconds of an age such as ``"90s"``, ``"30m"``, ``"12h"``, ``"7d"``, ``"2w"``.

    Raises:
        ConfigError: not a number followed by one of s, m, h, d, w (the value is named).
    """
    number, unit = text[:-1], text[-1:]
    try:
        seconds = float(number) * _UNITS[unit]
    except (KeyError, ValueError):
        raise ConfigError(
            f"an age is a number and a unit (s, m, h, d, w), e.g. 7d; got {text!r}"
        ) from None
    if not seconds >= 0:
        raise ConfigError(f"an age must be >= 0, got {text!r}")
    return seconds


@dataclass
class NamespaceUsage:
    """One namespace of an fs root: its identity and its files.

    ``bytes`` are file sizes (header and padding included); ``oldest`` / ``newest`` are block
    file modification times (seconds since the epoch), None without blocks.
    """

    name: str
    identity: dict[str, Any] | None
    blocks: int = 0
    bytes: int = 0
    temp_files: int = 0
    oldest: float | None = None
    newest: float | None = None
    ranks: list[str] = field(default_factory=list)


def _block_files(data_dir: Path) -> Iterator[tuple[os.DirEntry[str], os.stat_result]]:
    """Every file under a ``_r<rank>`` directory (``<hhh>/<hh>_g<group>/…``) with its
    ``lstat``. A running engine renames its temp files and evicts blocks while the walk goes on
    (and another purge removes directories): a file or directory gone by the time it is
    reached is skipped, as the engine itself treats it (a miss)."""
    stack = [data_dir]
    while stack:
        try:
            with os.scandir(stack.pop()) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(Path(entry.path))
                    elif entry.is_file(follow_symlinks=False):
                        try:
                            st = entry.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue
                        yield entry, st
        except FileNotFoundError:
            continue


def _rank_dirs(base: Path, name: str) -> list[Path]:
    """The block directories ``<name>_r<rank>`` of namespace ``name`` under ``base``
    (``kvcascade/tiers/_file_mapper.py``'s ``namespace``), sorted. Matched by name, not by a
    glob pattern: a model name may hold ``[``, ``]``, ``?`` or ``*``, which a pattern would
    read as wildcards (``org/model[v2]``'s blocks were found by neither command)."""
    prefix = f"{name}_r"
    with os.scandir(base) as it:
        return sorted(
            base / e.name
            for e in it
            if e.name.startswith(prefix) and e.name[len(prefix) :].isdigit() and e.is_dir()
        )


def inspect_root(root: str | os.PathLike[str]) -> list[NamespaceUsage]:
    """The namespaces under ``root`` (those with a ``config.json``), sorted by name.

    Raises:
        ConfigError: ``root`` does not exist or is not a directory.
    """
    base = Path(root)
    if not base.exists():
        raise ConfigError(f"{str(root)!r} does not exist")
    if not base.is_dir():
        raise ConfigError(f"{str(root)!r} is not a directory")
    out = []
    for ident in sorted(base.glob("*/config.json")):
        ns = ident.parent
        try:  # not a regular file (a FIFO would block the read for ever): no identity
            identity = json.loads(ident.read_text()) if ident.is_file() else None
        except (OSError, ValueError):
            identity = None
        usage = NamespaceUsage(ns.name, identity)
        for data_dir in _rank_dirs(base, ns.name):
            usage.ranks.append(data_dir.name)
            for entry, st in _block_files(data_dir):
                if entry.name.endswith(".tmp"):
                    usage.temp_files += 1
                    continue
                usage.blocks += 1
                usage.bytes += st.st_size
                usage.oldest = min(usage.oldest or st.st_mtime, st.st_mtime)
                usage.newest = max(usage.newest or st.st_mtime, st.st_mtime)
        out.append(usage)
    return out


@dataclass
class PurgeResult:
    """What :func:`purge_root` removed: files (blocks and temp files), their bytes, and the
    namespaces removed whole."""

    files: int = 0
    bytes: int = 0
    namespaces: list[str] = field(default_factory=list)


def purge_root(
    root: str | os.PathLike[str],
    namespaces: list[str] | None = None,
    older_than_s: float | None = None,
    now: float | None = None,
) -> PurgeResult:
    """Remove block files under ``root``.

    Args:
        root: an fs tier's ``root_dir``.
        namespaces: only these namespaces (names as :func:`inspect_root` lists them); None: all.
        older_than_s: only files not modified for this many seconds; None: every file, and the
            namespace directories themselves (``config.json`` and learned policy state too).
        now: the reference time (default: the clock).

    A running engine may share the directory: a block it finds gone is a miss, never an error
    (``docs/fs-tier.md``, Rules that keep it correct).

    Raises:
        ConfigError: ``root`` does not exist or is not a directory, or a named namespace does
            not exist there.
    """
    known = {u.name for u in inspect_root(root)}
    chosen = sorted(known) if namespaces is None else namespaces
    missing = sorted(set(chosen) - known)
    if missing:
        raise ConfigError(f"no namespace {missing} under {str(root)!r}; there are {sorted(known)}")
    base = Path(root)
    limit = (now if now is not None else time.time()) - (older_than_s or 0.0)
    result = PurgeResult()
    for name in chosen:
        for data_dir in _rank_dirs(base, name):
            for entry, st in _block_files(data_dir):
                if older_than_s is not None and st.st_mtime > limit:
                    continue
                try:
                    os.unlink(entry.path)
                except FileNotFoundError:  # removed meanwhile (an engine evicted it)
                    continue
                result.files += 1
                result.bytes += st.st_size
            if older_than_s is None:
                shutil.rmtree(data_dir, ignore_errors=True)
        if older_than_s is None:
            shutil.rmtree(base / name, ignore_errors=True)
            result.namespaces.append(name)
    return result


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def format_inspection(usages: list[NamespaceUsage]) -> str:
    """The ``kvcascade inspect`` table: one row per namespace (the name ``purge --namespace``
    takes), then the directories it is on disk (``<name>/config.json`` and the block
    directories ``<name>_r<rank>/``), then its identity."""
    if not usages:
        return "no kvcascade namespaces here"
    lines = [f"{'namespace':<40}{'blocks':>9}{'bytes':>16}{'temp':>6}  oldest / newest"]
    for u in usages:
        lines.append(
            f"{u.name:<40}{u.blocks:>9,}{u.bytes:>16,}{u.temp_files:>6}  "
            f"{_when(u.oldest)} / {_when(u.newest)}"
        )
        blocks = ", ".join(f"{rank}/" for rank in u.ranks) or "no block directory"
        lines.append(f"    on disk: {u.name}/config.json, blocks in {blocks}")
        ident = u.identity
        if ident is None:
            lines.append("    identity: config.json unreadable")
            continue
        shown = {k: ident[k] for k in sorted(ident) if k not in ("kv_cache_groups",)}
        lines.append("    " + ", ".join(f"{k}={v}" for k, v in shown.items()))
    return "\n".join(lines)
