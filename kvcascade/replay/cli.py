"""The ``kvcascade`` command line."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._errors import ConfigError, KVCascadeError

if TYPE_CHECKING:  # imported when a command runs: --help and --version never import torch
    from .._config import CascadeConfig
    from .run import ReplayReport

DEFAULT_GPU_BLOCKS = 1024
DEFAULT_CPU_BLOCKS = 8192
DEFAULT_BLOCK_BYTES = 4096
#: The replay's ``model_name`` (its namespace in the fs, s3 and valkey tiers) unless ``--config``
#: names one.
REPLAY_MODEL_NAME = "kvcascade-replay"


def _int(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
    return value


def _nonneg_int(text: str) -> int:
    return _int(text, 0)


def _positive_int(text: str) -> int:
    return _int(text, 1)


def _nonempty(text: str) -> str:
    """A string option's value: an empty one (``--fs-dir ''``, an unset shell variable) is
    refused rather than read as "not given"."""
    if not text:
        raise argparse.ArgumentTypeError("expected a value, got ''")
    return text


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcascade", description="Three-tier KV cache tools.")
    parser.add_argument("--version", action="version", version=f"kvcascade {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    rp = sub.add_parser(
        "replay",
        help="run a serving trace through GPU → CPU → fs tiers and verify every loaded byte",
        description="Replay a Mooncake-format trace through the cascade (default: the bundled "
        "Mooncake conversation trace).",
    )
    rp.add_argument(
        "trace", nargs="?", type=_nonempty, help="JSONL trace (default: bundled Mooncake trace)"
    )
    rp.add_argument("--requests", type=_positive_int, help="replay only the first N requests")
    rp.add_argument(
        "--gpu-blocks",
        type=_positive_int,
        help=f"GPU prefix-cache blocks (default {DEFAULT_GPU_BLOCKS})",
    )
    rp.add_argument(
        "--cpu-blocks",
        type=_positive_int,
        help=f"CPU primary-tier blocks (default {DEFAULT_CPU_BLOCKS})",
    )
    rp.add_argument(
        "--block-bytes",
        type=_positive_int,
        help=f"KV bytes per block (default {DEFAULT_BLOCK_BYTES})",
    )
    rp.add_argument(
        "--fs-dir",
        type=_nonempty,
        help="fs tier directory, created with a warning if missing (default: a temporary "
        "directory)",
    )
    rp.add_argument("--no-fs", action="store_true", help="no fs tier (GPU and CPU only)")
    rp.add_argument(
        "--fs-max-bytes",
        type=_positive_int,
        help="capacity of the fs tier in bytes; least recently used files are evicted "
        "(default: unbounded)",
    )
    rp.add_argument(
        "--s3-bucket",
        type=_nonempty,
        help="add an s3 tier on this bucket, after the fs tier (credentials: the AWS default "
        "chain, e.g. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)",
    )
    rp.add_argument(
        "--s3-endpoint",
        type=_nonempty,
        metavar="URL",
        help="S3 endpoint of the s3 tier, e.g. http://127.0.0.1:9000 for MinIO (default: AWS)",
    )
    rp.add_argument(
        "--valkey",
        type=_nonempty,
        metavar="URL",
        help="add a valkey tier on this Valkey / Redis server, e.g. redis://127.0.0.1:6379, "
        "after the other tiers (a password goes in --config's 'password'; docs/valkey-tier.md)",
    )
    rp.add_argument(
        "--eviction-policy",
        type=_nonempty,
        help="CPU tier eviction policy (default adaptive; lru, arc, turn_aware, …)",
    )
    rp.add_argument(
        "--config",
        type=_nonempty,
        help="JSON object (or @file) of kv_connector_extra_config keys",
    )
    rp.add_argument(
        "--json", dest="json_path", type=_nonempty, help="write the report as JSON to this path"
    )
    rp.add_argument(
        "--plot",
        type=_nonempty,
        metavar="PATH",
        help="write a PNG: hit ratio over the run per tier, bytes moved per link (needs "
        "matplotlib: pip install 'kvcascade[plot]')",
    )
    rp.add_argument("--quiet", action="store_true", help="no progress bar")
    rp.add_argument(
        "--compare-policies",
        type=_nonempty,
        metavar="P1,P2,…",
        help="instead of the byte-exact replay, compare eviction policies (bookkeeping only) "
        "against Belady's OPT, e.g. lru,arc,turn_aware; see docs/policies.md",
    )
    rp.add_argument(
        "--capacities",
        type=_nonempty,
        default=None,
        help="with --compare-policies: cache sizes as fractions of the trace's unique blocks "
        "(default 0.01,0.05,0.1)",
    )
    rp.add_argument(
        "--hints",
        type=_nonempty,
        default=None,
        help="with --compare-policies: 'none' or 'oracle[:noise]' — continues-hints read off "
        "the trace, a fraction 'noise' of them flipped (seeded by --seed)",
    )
    rp.add_argument(
        "--no-free-rules",
        action="store_true",
        help="with --compare-policies: store partial last blocks and skip the closing touch "
        "(the plain cache model of docs/policies.md's baseline columns)",
    )
    rp.add_argument(
        "--seed", type=_nonneg_int, default=None, help="seed of --hints noise (default 0)"
    )
    rp.add_argument(
        "--policy-state",
        type=_nonempty,
        metavar="PATH",
        help="with --compare-policies: the policies that learn (turn_aware, adaptive) start "
        "from this saved state (the turn_aware_state.json a cascade with an fs tier keeps "
        "beside its config.json) instead of cold",
    )
    cal = sub.add_parser(
        "calibrate",
        help="measure the copy kernels on this machine and write the kernel-choice thresholds",
        description="Time the C++ batch copy and the Triton kernel for CPU→GPU loads per page "
        "size and write the crossover to the settings file the library reads (CUDA only; on a "
        "machine without a GPU it reports the host copy rate and writes nothing).",
    )
    cal.add_argument("--output", help="settings file (default: the library's settings path)")
    cal.add_argument("--reps", type=_positive_int, default=20, help="timed repetitions per point")
    ins = sub.add_parser(
        "inspect",
        help="list the namespaces of an fs tier directory: identity, blocks, bytes, ages",
        description="Show every kvcascade namespace under an fs tier's root_dir: its identity "
        "(config.json), block files, bytes, oldest/newest block and leftover temp files.",
    )
    ins.add_argument("root", type=_nonempty, help="the fs tier's root_dir")
    ins.add_argument(
        "--json", dest="json_path", type=_nonempty, help="also write the listing as JSON here"
    )
    pur = sub.add_parser(
        "purge",
        help="remove block files of an fs tier directory by namespace and age",
        description="Remove kvcascade block files under an fs tier's root_dir. Without "
        "--older-than whole namespaces go (config.json included). An engine running on the "
        "directory treats a removed block as a miss.",
    )
    pur.add_argument("root", type=_nonempty, help="the fs tier's root_dir")
    pur.add_argument(
        "--namespace",
        action="append",
        type=_nonempty,
        help="only this namespace (as `kvcascade inspect` lists it); repeat for several",
    )
    pur.add_argument(
        "--older-than",
        type=_nonempty,
        metavar="AGE",
        help="only blocks not written for AGE (e.g. 90m, 12h, 7d)",
    )
    pur.add_argument(
        "--all", action="store_true", help="every namespace (needed when no filter is given)"
    )
    return parser


def _load_config_arg(text: str | None) -> dict[str, Any]:
    if text is None:
        return {}
    source = "--config"
    if text.startswith("@"):
        source = text[1:]
        if not source:
            raise ConfigError("--config @ needs a file name after the @ (--config @config.json)")
        try:
            text = Path(source).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read --config file {source!r}: {exc.strerror}") from exc
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{source} is not valid JSON: {exc.msg} at position {exc.pos}") from exc
    if not isinstance(value, dict):
        raise ConfigError(f"{source} must be a JSON object, got {type(value).__name__}")
    return value


def build_replay_config(
    args: argparse.Namespace, temporary_root: Callable[[], str] | None = None
) -> CascadeConfig:
    """Merge ``--config`` keys with the command-line options: an option fills in its key (an
    fs, s3 or valkey option that of the first tier of its type, added if ``--config`` has
    none, except fs and ``--s3-endpoint`` alone); an fs tier without ``root_dir`` (the key
    absent) gets ``temporary_root()`` (a directory
    removed after the replay), a ``root_dir`` starting with ``~`` is expanded as the fs tier
    expands it (the report names the directory used); ``model_name`` is
    :data:`REPLAY_MODEL_NAME` unless ``--config`` names one.

    An option whose key ``--config`` sets too is refused rather than letting one win: the
    report is read as the run of the configuration given, and a file edited to say one thing
    while a flag in a shell history says another would be measured as neither (the same rule
    as two sizes of the CPU tier).

    Raises:
        ConfigError: a bad ``--config``, an option that needs a tier not configured, an option
            whose key ``--config`` sets too (both named), ``--no-fs`` with an fs tier in
            ``--config``, or two sizes of the CPU tier
            (``--cpu-blocks`` or ``cpu_blocks`` with ``cpu_bytes_to_use``), besides what
            :class:`~kvcascade.CascadeConfig` refuses.
    """
    from .._config import CascadeConfig

    extra = _load_config_arg(args.config)
    tiers = extra.get("secondary_tiers")
    if tiers is None:
        tiers = [] if args.no_fs else [{"type": "fs"}]
    elif (
        args.no_fs
        and isinstance(tiers, list)
        and any(isinstance(t, dict) and t.get("type") == "fs" for t in tiers)
    ):
        raise ConfigError(
            "--no-fs and an fs tier in --config's secondary_tiers both given; give one of them"
        )
    if "cpu_bytes_to_use" in extra and (args.cpu_blocks is not None or "cpu_blocks" in extra):
        given = (
            f"--cpu-blocks {args.cpu_blocks}"
            if args.cpu_blocks is not None
            else f"cpu_blocks={extra['cpu_blocks']!r}"
        )
        raise ConfigError(
            f"{given} and cpu_bytes_to_use={extra['cpu_bytes_to_use']!r} in --config both size "
            "the CPU tier; give one of them"
        )
    if isinstance(tiers, list):
        _fill_tier_options(args, tiers)
    for tier in tiers if isinstance(tiers, list) else []:
        if isinstance(tier, dict) and tier.get("type") == "fs":
            root = tier.get("root_dir")
            if isinstance(root, str) and root:
                tier["root_dir"] = os.path.expanduser(root)
            elif temporary_root is not None and "root_dir" not in tier:
                tier["root_dir"] = temporary_root()  # "", 0, false: CascadeConfig refuses
    extra["secondary_tiers"] = tiers
    extra.setdefault("model_name", REPLAY_MODEL_NAME)
    for flag, key in _CONFIG_OPTIONS:
        _fill(extra, key, getattr(args, key), flag, "")
    extra.setdefault("gpu_blocks", DEFAULT_GPU_BLOCKS)
    extra.setdefault("block_bytes", DEFAULT_BLOCK_BYTES)
    if "cpu_bytes_to_use" not in extra:
        extra.setdefault("cpu_blocks", DEFAULT_CPU_BLOCKS)
    return CascadeConfig.from_extra_config(extra)


#: The options that set a top-level ``--config`` key of the same name (the option's dest).
_CONFIG_OPTIONS = (
    ("--gpu-blocks", "gpu_blocks"),
    ("--cpu-blocks", "cpu_blocks"),
    ("--block-bytes", "block_bytes"),
    ("--eviction-policy", "eviction_policy"),
)


def _fill(entry: dict[str, Any], key: str, value: Any, flag: str, where: str) -> None:
    """Set ``entry[key]`` to the option ``flag``'s ``value`` (None: not given).

    Raises:
        ConfigError: ``--config`` sets ``key`` too (``where``: which tier, or ``""``).
    """
    if value is None:
        return
    if key in entry:
        raise ConfigError(
            f"{flag} {value} and {key}={entry[key]!r} in --config{where} both set {key}; "
            "give one of them"
        )
    entry[key] = value


def _fill_tier_options(args: argparse.Namespace, tiers: list[Any]) -> None:
    """The fs, s3 and valkey options into the first tier of their type (:func:`_fill`).

    Raises:
        ConfigError: an fs option with ``--no-fs`` or without an fs tier in ``--config``'s
            ``secondary_tiers``, ``--s3-endpoint`` without ``--s3-bucket`` or an s3 tier in
            ``--config``, or an option whose key the tier's entry sets too.
    """

    def first(types: tuple[str, ...], add: bool) -> dict[str, Any] | None:
        found = [t for t in tiers if isinstance(t, dict) and t.get("type") in types]
        if not found and add:
            found = [{"type": types[0]}]
            tiers.append(found[0])
        return found[0] if found else None

    for flag, key, value in (
        ("--fs-dir", "root_dir", args.fs_dir),
        ("--fs-max-bytes", "max_bytes", args.fs_max_bytes),
    ):
        if value is None:
            continue
        fs = first(("fs",), add=False)
        if fs is None and args.no_fs:
            raise ConfigError(f"{flag} and --no-fs both given; give one of them")
        if fs is None:
            raise ConfigError(
                f"{flag} given but --config's secondary_tiers has no fs tier; add one "
                '({"type": "fs"}) or drop ' + flag
            )
        _fill(fs, key, value, flag, "'s fs tier")
    if args.s3_bucket or args.s3_endpoint:
        # --s3-endpoint alone fills --config's s3 tier; it adds none (a tier needs a bucket)
        s3 = first(("s3", "obj"), add=bool(args.s3_bucket))
        if s3 is None:
            raise ConfigError(
                "--s3-endpoint needs --s3-bucket, or an s3 tier in --config's secondary_tiers"
            )
        _fill(s3, "bucket", args.s3_bucket, "--s3-bucket", "'s s3 tier")
        _fill(s3, "endpoint_url", args.s3_endpoint, "--s3-endpoint", "'s s3 tier")
    if args.valkey:
        valkey = first(("valkey",), add=True)
        assert valkey is not None
        _fill(valkey, "url", args.valkey, "--valkey", "'s valkey tier")


def _row(label: str, value: str) -> str:
    return f"{label:<34}{value:>16}"


def _describe_tier(tier: dict[str, Any]) -> str:
    """``name (type): key=value, …`` of a (redacted) tier entry."""
    from ..tiers.registry import tier_name

    name = tier_name(tier)
    kind = f" ({tier['type']})" if name != tier["type"] else ""
    rest = ", ".join(f"{k}={v}" for k, v in tier.items() if k not in ("type", "name"))
    return f"{name}{kind}: {rest}" if rest else f"{name}{kind}"


def format_report(report: ReplayReport) -> str:
    """The replay's closing table: the configuration, then hits, latency, bytes, and per tier
    what was dropped, failed or caught corrupt; blocks served wrong on a line of their own."""
    cfg = report.config
    config_lines = [
        _row("block bytes", f"{cfg['block_bytes']:,}"),
        _row("gpu blocks", f"{cfg['gpu_blocks']:,}"),
        _row("cpu blocks", f"{cfg['cpu_blocks']:,}"),
        _row("cpu bytes", f"{cfg['cpu_blocks'] * cfg['block_bytes']:,}"),
        _row("eviction policy", str(cfg["eviction_policy"])),
        *(f"tier {_describe_tier(t)}" for t in cfg["secondary_tiers"]),
    ]
    lines = [
        _row("requests", f"{report.requests:,}"),
        _row("block instances", f"{report.block_instances:,}"),
    ]
    for tier, n in report.hit_blocks.items():
        lines.append(_row("hit blocks: " + tier, f"{n:,}"))
    lines.append(_row("prefix hit ratio", f"{report.prefix_hit_ratio:.4f}"))
    for name, ms in report.latency_percentiles_ms().items():
        lines.append(_row(f"lookup+load {name} (ms)", f"{ms:.3f}"))
    for direction, n in report.bytes.items():
        lines.append(_row("bytes " + direction.replace("_to_", " → "), f"{n:,}"))
    lines.append(_row("verified blocks", f"{report.verified_blocks:,}"))
    for tier, n in report.evictions.items():
        lines.append(_row("evictions: " + tier, f"{n:,}"))
    lines.append(_row("cpu: dropped stores (blocks)", f"{report.dropped_store_blocks:,}"))
    for tier, rows in report.tiers.items():
        lines.append(_row(f"{tier}: dropped stores (blocks)", f"{rows['dropped_store_blocks']:,}"))
        lines.append(_row(f"{tier}: failed jobs", f"{rows['failed_jobs']:,}"))
        lines.append(_row(f"{tier}: corrupt blocks (caught)", f"{rows['corrupt_blocks']:,}"))
    lines.append(_row("wall time (s)", f"{report.wall_s:.2f}"))
    lines.append(_row("served wrong (blocks)", f"{report.mismatched_blocks:,}"))
    width = max(len(line) for line in [*config_lines, *lines])
    rule = "-" * width
    return "\n".join(["kvcascade replay", rule, *config_lines, rule, *lines])


def _check_writable(path: str | None, flag: str = "--json") -> None:
    if path is None:
        return
    if Path(path).is_dir():
        raise ConfigError(f"{flag} {path}: is a directory")
    parent = Path(path).resolve().parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ConfigError(f"{flag} {path}: directory {parent} does not exist or is not writable")


def _progress(
    stack: contextlib.ExitStack, args: argparse.Namespace, total: int, desc: str
) -> Callable[[int], object] | None:
    """A tqdm progress bar on stderr (closed with ``stack``) when stderr is a terminal and
    ``--quiet`` was not given; its ``update``, or None."""
    if args.quiet or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    bar = stack.enter_context(tqdm(total=total, unit="req", desc=desc, file=sys.stderr))
    return bar.update


_COMPARE_ONLY = {
    "capacities": "--capacities",
    "hints": "--hints",
    "seed": "--seed",
    "policy_state": "--policy-state",
}
#: The byte-exact replay's options: the comparison simulates one cache level of its own
#: (docs/policies.md), with no tiers, sizes, policy option or plot of the replay.
_REPLAY_ONLY = {
    "gpu_blocks": "--gpu-blocks",
    "cpu_blocks": "--cpu-blocks",
    "block_bytes": "--block-bytes",
    "fs_dir": "--fs-dir",
    "fs_max_bytes": "--fs-max-bytes",
    "s3_bucket": "--s3-bucket",
    "s3_endpoint": "--s3-endpoint",
    "valkey": "--valkey",
    "eviction_policy": "--eviction-policy",
    "config": "--config",
    "plot": "--plot",
}


def _replay(args: argparse.Namespace) -> int:
    given = [flag for name, flag in _COMPARE_ONLY.items() if getattr(args, name) is not None]
    given += ["--no-free-rules"] if args.no_free_rules else []
    if given:
        raise ConfigError(f"{', '.join(given)}: only meaningful with --compare-policies")
    _check_writable(args.json_path)
    _check_writable(args.plot, "--plot")
    if args.plot:
        try:
            import matplotlib  # noqa: F401 - checked before the run, used by write_plot
        except ImportError:
            raise ConfigError("--plot needs matplotlib: pip install 'kvcascade[plot]'") from None
    from .run import run_replay, temporary_fs_root, write_plot
    from .trace import bundled_trace, read_trace

    with contextlib.ExitStack() as stack:
        config = build_replay_config(args, lambda: stack.enter_context(temporary_fs_root()))
        trace = read_trace(args.trace or bundled_trace(), limit=args.requests)
        report = run_replay(trace, config, _progress(stack, args, len(trace), "replay"))
    print(format_report(report))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report.to_json(), indent=2) + "\n")
    if args.plot:
        write_plot(report, args.plot)
    if report.mismatched_blocks:
        print(
            f"kvcascade: error: {report.mismatched_blocks} loaded blocks were served wrong "
            "(did not match the bytes stored)",
            file=sys.stderr,
        )
        return 1
    return 0


def _compare(args: argparse.Namespace) -> int:
    given = [flag for name, flag in _REPLAY_ONLY.items() if getattr(args, name) is not None]
    given += ["--no-fs"] if args.no_fs else []
    if given:
        raise ConfigError(f"{', '.join(given)}: only meaningful without --compare-policies")
    _check_writable(args.json_path)
    from .compare import compare, format_comparison
    from .trace import bundled_trace, read_trace

    args.capacities = args.capacities or "0.01,0.05,0.1"
    args.hints = args.hints or "none"
    args.seed = args.seed or 0
    try:
        fractions = [float(x) for x in args.capacities.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(
            f"--capacities must be comma-separated numbers, got {args.capacities!r}"
        ) from None
    policies = [p.strip() for p in args.compare_policies.split(",") if p.strip()]
    for flag, entries, text in (
        ("--compare-policies", policies, args.compare_policies),
        ("--capacities", fractions, args.capacities),
    ):
        if not entries:
            raise ConfigError(f"{flag} needs at least one entry, got {text!r}")
    policy_state = None if args.policy_state is None else _read_policy_state(args.policy_state)
    trace = read_trace(args.trace or bundled_trace(), limit=args.requests)
    runs = len(trace) * len(policies) * len(fractions)
    try:
        with contextlib.ExitStack() as stack:
            progress = _progress(stack, args, runs, "compare")
            free_rules = not args.no_free_rules
            result = compare(
                trace,
                policies,
                fractions,
                free_rules,
                args.hints,
                args.seed,
                progress,
                policy_state,
                args.policy_state,
            )
    except ValueError as exc:
        if isinstance(exc, KVCascadeError):
            raise
        raise ConfigError(str(exc)) from exc
    print(format_comparison(result))
    if args.json_path:
        rows = [
            {
                "policy": name,
                "fraction": fraction,
                "capacity": run.capacity,
                "hits": run.hits,
                "instances": run.instances,
                "hit_ratio": run.hit_ratio,
                "policy_state": args.policy_state,
            }
            for (name, fraction), run in result.runs.items()
        ]
        Path(args.json_path).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def _read_policy_state(path: str) -> dict[str, Any]:
    """The JSON object of ``--policy-state PATH`` (:func:`kvcascade.policies.turn_aware.
    read_state_file`; its contents are checked by the policies, in ``compare``).

    Raises:
        ConfigError: no regular file, unreadable, too large or not a JSON object; naming the
            path.
    """
    from ..policies.turn_aware import read_state_file

    try:
        return read_state_file(path)
    except OSError as exc:
        raise ConfigError(f"--policy-state {path!r}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ConfigError(f"--policy-state {path!r}: {exc}") from None


def _calibrate(args: argparse.Namespace) -> int:
    from ..ops import _build
    from ..ops.calibrate import calibrate

    if _build.extension_if_ready() is None:  # starts the build in the background
        print(
            "kvcascade: building the copy kernels on first use (about a minute)…", file=sys.stderr
        )
    results, written = calibrate(Path(args.output) if args.output else None, reps=args.reps)
    print(f"{'dir':<6}{'kernel':<8}{'page B':>10}{'count':>7}{'GB/s':>9}")
    for m in results:
        print(f"{m.direction:<6}{m.kernel:<8}{m.page_bytes:>10}{m.count:>7}{m.gbps:>9.2f}")
    print(f"settings written to {written}" if written else "no CUDA device: nothing written")
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvcascade")
    except PackageNotFoundError:  # run from a source tree that was never installed
        from .. import __version__

        return __version__


class _Formatter(logging.Formatter):
    """``kvcascade: LEVEL: message``, without a second ``kvcascade:`` where the message
    already starts with one."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = record.message.removeprefix("kvcascade: ")
        return super().formatMessage(record)


def _inspect(args: argparse.Namespace) -> int:
    from .._admin import format_inspection, inspect_root

    _check_writable(args.json_path)
    usages = inspect_root(args.root)
    print(format_inspection(usages))
    if args.json_path:
        rows = [vars(u) for u in usages]
        Path(args.json_path).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def _purge(args: argparse.Namespace) -> int:
    from .._admin import parse_age, purge_root

    if not (args.namespace or args.older_than or args.all):
        raise ConfigError(
            "purge removes everything without a filter: give --namespace, --older-than or --all"
        )
    age = parse_age(args.older_than) if args.older_than else None
    result = purge_root(args.root, args.namespace, age)
    print(f"removed {result.files:,} files ({result.bytes:,} bytes)")
    for name in result.namespaces:
        print(f"removed namespace {name}")
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvcascade`` command; returns the exit code."""
    handler = logging.StreamHandler()
    handler.setFormatter(_Formatter("kvcascade: %(levelname)s: %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    args = _parser().parse_args(argv)
    # SIGTERM and SIGHUP unwind like Ctrl-C: the replay's temporary fs tier directory is removed.
    main_thread = threading.current_thread() is threading.main_thread()
    signums = (signal.SIGTERM, signal.SIGHUP) if main_thread else ()
    previous = {signum: signal.signal(signum, _interrupt) for signum in signums}
    try:
        return _run(args)
    finally:
        for signum, earlier in previous.items():
            signal.signal(signum, earlier)


def _run(args: argparse.Namespace) -> int:
    commands = {"replay": _replay, "calibrate": _calibrate, "inspect": _inspect, "purge": _purge}
    command = commands[args.command]
    if command is _replay and args.compare_policies is not None:
        command = _compare
    try:
        code = command(args)
        sys.stdout.flush()  # a reader gone away (`| head`) shows here, not at exit
        return code
    except BrokenPipeError:
        # Quiet, as CLIs are when their reader goes away; stdout to /dev/null so that the
        # interpreter's flush at exit does not fail a second time.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except KVCascadeError as exc:
        print(f"kvcascade: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvcascade: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvcascade: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
