"""``kvcascade replay`` on slices of the bundled Mooncake trace (issue #2)."""

from __future__ import annotations

import collections
import fcntl
import json
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from valkey_fixtures import Server, needs_server

from kvcascade import CascadeConfig, ConfigError, TraceError
from kvcascade.replay.cli import REPLAY_MODEL_NAME, _parser, build_replay_config, main
from kvcascade.replay.run import block_key, expected_bytes, run_replay
from kvcascade.replay.trace import TraceRequest, bundled_trace, read_trace
from kvcascade.tiers._block_format import HEADER_BYTES, check_block, encode_header
from kvcascade.tiers._file_mapper import FileMapper, default_identity


@pytest.fixture(scope="module")
def trace() -> list[TraceRequest]:
    return read_trace(bundled_trace(), limit=400)


def ideal_hits(trace: Sequence[TraceRequest]) -> int:
    """Block instances whose id was seen before, within the request's leading run of seen ids."""
    seen: set[int] = set()
    hits = 0
    for request in trace:
        for h in request.hash_ids:
            if h not in seen:
                break
            hits += 1
        seen.update(request.hash_ids)
    return hits


def two_level_lru(
    trace: Sequence[TraceRequest], gpu_blocks: int, cpu_blocks: int
) -> dict[str, int]:
    """A plain simulation of the replay's GPU LRU prefix cache over a CPU LRU tier (no fs).

    CPU recency follows vLLM's LRU (``kv_offload/cpu/policies/lru.py``): touch of all the request's
    keys in reverse order, loaded keys re-enter at the most-recent end in order, stores skip present
    keys, evict least-recent keys not in the store call, and append the new keys in order.
    """
    gpu: collections.OrderedDict[int, None] = collections.OrderedDict()
    cpu: collections.OrderedDict[int, None] = collections.OrderedDict()
    hits = {"gpu": 0, "cpu": 0}
    for request in trace:
        ids = request.hash_ids
        g = 0
        while g < len(ids) and ids[g] in gpu:
            g += 1
        for h in ids[:g]:
            gpu.move_to_end(h)
        for h in reversed(ids):
            if h in cpu:
                cpu.move_to_end(h)
        c = 0
        while g + c < len(ids) and ids[g + c] in cpu:
            c += 1
        for h in ids[g : g + c]:
            cpu.move_to_end(h)
        for h in ids[g:]:
            gpu.pop(h, None)
        while len(gpu) + len(ids) - g > gpu_blocks:
            victim = next(h for h in gpu if h not in ids[:g])
            del gpu[victim]
        for h in ids[g:]:
            gpu[h] = None
        new = ids[g + c :]
        for i in range(0, len(new), cpu_blocks):
            piece = new[i : i + cpu_blocks]
            to_store = [h for h in dict.fromkeys(piece) if h not in cpu]
            need = len(to_store) - (cpu_blocks - len(cpu))
            if need > 0:
                victims = [h for h in cpu if h not in piece][:need]
                if len(victims) < need:
                    continue
                for h in victims:
                    del cpu[h]
            for h in to_store:
                cpu[h] = None
        hits["gpu"] += g
        hits["cpu"] += c
    return hits


def test_unbounded_capacity_reaches_the_trace_ideal(trace: list[TraceRequest]) -> None:
    """Nothing evicted → prefix_hit_ratio equals the trace's ideal (issue #2)."""
    config = CascadeConfig(block_bytes=64, gpu_blocks=256, cpu_blocks=20_000)
    report = run_replay(trace, config)
    instances = sum(len(r.hash_ids) for r in trace)
    assert report.block_instances == instances
    assert sum(report.hit_blocks.values()) == ideal_hits(trace)
    assert report.prefix_hit_ratio == pytest.approx(ideal_hits(trace) / instances)
    assert report.evictions["cpu"] == 0
    assert report.verified_blocks == report.hit_blocks["cpu"] > 0
    assert report.corrupt_blocks == 0


@pytest.mark.parametrize(("gpu_blocks", "cpu_blocks"), [(256, 64), (300, 700)])
def test_two_level_lru_matches_plain_simulation(
    trace: list[TraceRequest], gpu_blocks: int, cpu_blocks: int
) -> None:
    """Small GPU, no fs: per-tier hits equal an independent two-level LRU simulation."""
    config = CascadeConfig(block_bytes=64, gpu_blocks=gpu_blocks, cpu_blocks=cpu_blocks)
    report = run_replay(trace, config)
    expected = two_level_lru(trace, gpu_blocks, cpu_blocks)
    assert report.hit_blocks == expected
    assert report.evictions["cpu"] > 0
    assert report.verified_blocks == expected["cpu"]


def test_fs_tier_serves_what_the_cpu_tier_evicted(
    trace: list[TraceRequest], tmp_path: Path
) -> None:
    """With a tiny CPU tier the fs tier supplies the hits, byte-exact, and bytes add up."""
    config = CascadeConfig(
        block_bytes=256,
        gpu_blocks=256,
        cpu_blocks=250,
        secondary_tiers=[{"type": "fs", "root_dir": str(tmp_path)}],
        model_name=REPLAY_MODEL_NAME,
    )
    report = run_replay(trace[:200], config)
    assert report.hit_blocks["fs"] > 0
    assert report.bytes["fs_to_cpu"] == 256 * report.hit_blocks["fs"]
    assert report.bytes["cpu_to_gpu"] == 256 * (report.hit_blocks["fs"] + report.hit_blocks["cpu"])
    assert report.bytes["cpu_to_fs"] == report.bytes["gpu_to_cpu"]
    assert report.verified_blocks == report.hit_blocks["fs"] + report.hit_blocks["cpu"]
    assert report.corrupt_blocks == 0


def test_corrupt_block_file_is_detected_and_recomputed(
    trace: list[TraceRequest], tmp_path: Path
) -> None:
    """A byte flipped in a block file is caught before use: counted corrupt, treated as a miss."""
    tiers = [{"type": "fs", "root_dir": str(tmp_path)}]
    config = CascadeConfig(
        block_bytes=256,
        gpu_blocks=256,
        cpu_blocks=8,
        secondary_tiers=tiers,
        model_name=REPLAY_MODEL_NAME,
    )
    first = run_replay(trace[:50], config)
    assert first.corrupt_blocks == 0
    mapper = FileMapper(default_identity(REPLAY_MODEL_NAME, block_bytes=256))
    first_key = block_key(trace[1].hash_ids[0])
    path = tmp_path / mapper.relative_path(first_key)
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES + 17] ^= 0x01
    path.write_bytes(bytes(data))

    second = run_replay(trace[1:2], config)  # a fresh cascade on the same directory
    assert second.corrupt_blocks == second.tiers["fs"]["corrupt_blocks"] == 1
    assert second.mismatched_blocks == 0
    assert second.hit_blocks["fs"] == 0  # the corrupt first block ends the prefix
    repaired = path.read_bytes()  # recomputed and stored again
    payload = memoryview(repaired)[HEADER_BYTES : HEADER_BYTES + 256]
    check_block(first_key, repaired[:HEADER_BYTES], payload, str(path))


def test_json_report_fields(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    code = main(
        [
            "replay",
            "--requests",
            "30",
            "--block-bytes",
            "128",
            "--cpu-blocks",
            "16",
            "--fs-dir",
            str(tmp_path / "fs"),
            "--json",
            str(out),
            "--quiet",
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    for field in (
        "requests",
        "block_instances",
        "hit_blocks",
        "prefix_hit_ratio",
        "bytes",
        "verified_blocks",
        "corrupt_blocks",
        "evictions",
        "wall_s",
    ):
        assert field in report
    assert report["requests"] == 30
    assert set(report["hit_blocks"]) == {"gpu", "cpu", "fs"}
    assert set(report["bytes"]) == {"gpu_to_cpu", "cpu_to_fs", "fs_to_cpu", "cpu_to_gpu"}
    assert "prefix hit ratio" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["replay", "/nonexistent/trace.jsonl"], "/nonexistent/trace.jsonl"),
        (["replay", "--requests", "2", "--config", '{"cpu_bytes": 1}'], "cpu_bytes"),
        (["replay", "--requests", "2", "--config", "{not json"], "not valid JSON"),
        (  # said "cannot read --config file '': Is a directory"
            ["replay", "--requests", "2", "--config", "@"],
            "--config @ needs a file name after the @ (--config @config.json)",
        ),
        (
            ["replay", "--requests", "2", "--config", '{"spec_name": "Tiering"}'],
            "Unsupported spec type 'Tiering'",
        ),
        (["replay", "--requests", "2", "--eviction-policy", "nope"], "nope"),
        (
            ["replay", "--requests", "2", "--gpu-blocks", "3"],
            "gpu_blocks=3 cannot hold the longest request (15 blocks); give gpu_blocks 15 or more",
        ),
        (  # said "use --gpu-blocks 5", an option not used
            ["replay", "--requests", "2", "--config", '{"gpu_blocks": 3}'],
            "gpu_blocks=3 cannot hold the longest request (15 blocks); give gpu_blocks 15 or more",
        ),
        (
            ["replay", "--requests", "2", "--config", '{"secondary_tiers": [{"type": "tape"}]}'],
            "tape",
        ),
        (
            ["replay", "--requests", "2", "--hints", "oracle:0.1", "--no-free-rules"],
            "--hints, --no-free-rules: only meaningful with --compare-policies",
        ),
        (["replay", "--requests", "2", "--capacities", "0"], "--capacities: only meaningful"),
        (["replay", "--compare-policies", "lru", "--hints", "oracle:2"], "within [0, 1], got 2"),
        (  # printed a row of a 0-block cache
            ["replay", "--requests", "20", "--compare-policies", "lru", "--capacities", "1e-05"],
            "capacity fraction 1e-05 of the trace's 560 unique blocks is 0 blocks; give at least "
            "1/560",
        ),
        (["replay", "--requests", "2", "--fs-dir", "/dev/null"], "exists and is not a directory"),
    ],
)
def test_bad_input_is_one_clear_error(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "argv",
    [
        ["--compare-policies", ""],  # ran the whole byte-exact replay
        ["--fs-dir", ""],  # used a temporary directory
        ["--config", ""],  # ran without the configuration
        ["--valkey", ""],  # ran without the valkey tier
        [""],  # the trace: replayed the bundled one
    ],
)
def test_an_empty_option_value_is_refused_naming_the_option(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """An empty value (an unset shell variable) was read as the option not given."""
    with pytest.raises(SystemExit) as exit_:
        main(["replay", "--requests", "2", "--quiet", *argv])
    assert exit_.value.code == 2
    name = argv[0] if argv[0] else "trace"
    assert f"kvcascade replay: error: argument {name}: expected a value, got ''" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--fs-dir", "X"], "--fs-dir: only meaningful without --compare-policies"),
        (
            ["--valkey", "redis://127.0.0.1:1", "--no-fs"],
            "--valkey, --no-fs: only meaningful without --compare-policies",
        ),
        (
            ["--cpu-blocks", "8", "--config", "{}", "--eviction-policy", "arc"],
            "--cpu-blocks, --eviction-policy, --config: only meaningful without",
        ),
        (["--plot", "p.png"], "--plot: only meaningful without --compare-policies"),
    ],
)
def test_replay_options_are_refused_with_compare_policies(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The comparison simulates one cache level of its own: the tier and size options of the
    byte-exact replay were silently ignored (as ``--hints`` without it is refused)."""
    assert main(["replay", "--requests", "2", "--quiet", "--compare-policies", "lru", *argv]) == 2
    out = capsys.readouterr()
    assert f"kvcascade: error: {message}" in out.err and out.out == ""


def test_malformed_trace_line_names_line(tmp_path: Path) -> None:
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"hash_ids": [1, 2]}\n{"hash_ids": [3, -4]}\n')
    with pytest.raises(TraceError, match=r"t.jsonl:2: 'hash_ids'"):
        read_trace(bad)


def test_output_length_is_read_and_checked(tmp_path: Path) -> None:
    assert read_trace(bundled_trace(), limit=2)[1].output_length == 490  # the file's 2nd line
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"hash_ids": [1]}\n')
    assert read_trace(trace)[0].output_length == 0
    trace.write_text('{"hash_ids": [1], "output_length": -3}\n')
    with pytest.raises(TraceError, match=r"t.jsonl:1: bad output_length -3"):
        read_trace(trace)


def test_negative_size_exits_nonzero_without_traceback() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvcascade.replay.cli", "replay", "--cpu-blocks", "-5"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 2
    assert "-5" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_interrupted_replay_removes_its_temporary_fs_tier(
    tmp_path: Path, signum: signal.Signals
) -> None:
    """Ctrl-C, SIGTERM or SIGHUP during ``kvcascade replay`` (fs tier in a temporary
    directory): exit status 130, "interrupted", and the temporary directory with its block files
    is gone (a SIGTERM used to leave hundreds of MB behind)."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcascade.replay.cli", "replay", "--quiet"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        # a shell's background job starts with SIGINT ignored, and so would the replay: the
        # test stands for a user's Ctrl-C, so the replay gets the default disposition back
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        until = time.monotonic() + 120
        while time.monotonic() < until and not any(
            p.rglob("*.bin") for p in tmp_path.glob("kvcascade-replay-*")
        ):
            time.sleep(0.05)
        assert list(tmp_path.glob("kvcascade-replay-*")), "the replay never wrote a block"
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()  # reaped: no "still running" warning in a later test
        if proc.stderr is not None:
            proc.stderr.close()
    assert proc.returncode == 130, err
    assert "kvcascade: interrupted" in err
    assert list(tmp_path.iterdir()) == []


def test_the_next_replay_removes_the_directory_a_killed_replay_left(tmp_path: Path) -> None:
    """Issue #21 item 9: SIGKILL leaves the temporary fs tier behind; the next replay removes
    it (its owner process is gone) and leaves a live replay's directory alone."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "kvcascade.replay.cli", "replay", "--quiet"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        until = time.monotonic() + 120
        while time.monotonic() < until and not any(
            p.rglob("*.bin") for p in tmp_path.glob("kvcascade-replay-*")
        ):
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
    [left] = tmp_path.glob("kvcascade-replay-*")
    live = tmp_path / f"kvcascade-replay-{os.getpid()}-live"
    live.mkdir()
    subprocess.run([*cmd, "--requests", "2"], env=env, check=True, capture_output=True)
    assert sorted(tmp_path.iterdir()) == [live]
    assert not left.exists()


def test_fs_max_bytes_bounds_the_fs_tier(tmp_path: Path) -> None:
    """--fs-max-bytes: the fs tier evicts its least recently used files to stay in budget."""
    out = tmp_path / "r.json"
    budget = 64 * (4096 + 4096)  # 64 files of a 4 KiB header + a 4 KiB payload
    code = main(
        [
            "replay",
            "--requests",
            "40",
            "--block-bytes",
            "4096",
            "--cpu-blocks",
            "16",
            "--fs-dir",
            str(tmp_path / "fs"),
            "--fs-max-bytes",
            str(budget),
            "--json",
            str(out),
            "--quiet",
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    assert report["evictions"]["fs"] > 0
    files = list((tmp_path / "fs").rglob("*.bin"))
    assert 0 < len(files) <= 64
    assert report["corrupt_blocks"] == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--no-fs", "--fs-max-bytes", "100"],
            "--fs-max-bytes and --no-fs both given; give one of them",
        ),
        (
            ["--config", '{"secondary_tiers": [{"type": "memory"}]}', "--fs-dir", "X"],
            "--fs-dir given but --config's secondary_tiers has no fs tier; add one "
            '({"type": "fs"}) or drop --fs-dir',
        ),
        (  # the configured fs tier was silently dropped
            ["--config", '{"secondary_tiers": [{"type": "fs", "root_dir": "X"}]}', "--no-fs"],
            "--no-fs and an fs tier in --config's secondary_tiers both given; give one of them",
        ),
    ],
)
def test_fs_options_need_an_fs_tier(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each message says what is true: it used to say "drop --no-fs" without --no-fs given."""
    assert main(["replay", "--requests", "2", "--quiet", *argv]) == 2
    out = capsys.readouterr()
    assert out.err == f"kvcascade: error: {message}\n" and out.out == ""


def test_credentials_never_reach_reports_or_reprs() -> None:
    """S3 credentials given in config are redacted in the config repr and the replay report."""
    from kvcascade.replay.run import _describe

    config = CascadeConfig(cpu_blocks=1, secondary_tiers=[{"type": "memory"}])
    config.secondary_tiers.append({"type": "s3", "secret_key": "hunter2", "access_key": "AK"})
    assert "hunter2" not in repr(config) and "AK'" not in repr(config)
    assert "hunter2" not in json.dumps(_describe(config))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"hash_ids": [18446744073709551616]}\n', "[0, 2**64)"),
        (b"\xff\xfe{}\n", "not UTF-8"),
        (b'{"hash_ids": [1], "timestamp": Infinity}\n', "bad timestamp inf"),
        (b'{"hash_ids": [1], "timestamp": 1' + b"0" * 400 + b"}\n", "bad timestamp 1000"),
        (b'{"hash_ids": [1], "input_length": -5}\n', "bad input_length -5"),
    ],
)
def test_malformed_traces_are_one_clear_error(
    tmp_path: Path, content: bytes, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "t.jsonl"
    bad.write_bytes(content)
    assert main(["replay", str(bad), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_trace_without_line_ends_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue #21 item 10: an endless file without line ends (``/dev/zero``) ends with one clear
    error naming the line, not a MemoryError."""
    monkeypatch.setattr("kvcascade.replay.trace._MAX_LINE", 1 << 20)  # reach the bound sooner
    assert main(["replay", "/dev/zero", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "/dev/zero:1: line longer than 1048576 characters" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpu-blocks", "99999999999999"], "lower gpu_blocks"),
        (
            ["--no-fs", "--gpu-blocks", str(10**20)],
            f"gpu_blocks={10**20} × block_bytes=4096 = {4096 * 10**20:,} B of device KV cache "
            "is beyond any device (2**63 B); lower gpu_blocks or block_bytes",
        ),
        (["--cpu-blocks", "99999999999999"], "lower cpu_blocks"),
        (["--config", '{"secondary_tiers": [{"type": "memory", "bogus": 1}]}'], "bogus"),
    ],
)
def test_impossible_sizes_and_tier_keys_are_clear_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", "--requests", "2", "--quiet", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--config", '{"blocks_per_chunk": 0}'], "greater than 0"),
        (["--config", '{"block_size": 32, "blocks_per_chunk": 2}'], "Specify only one"),
        (["--config", '{"store_threshold": 5}'], "store_threshold=5"),
        (["--config", '{"enable_events": "no"}'], "enable_events"),
        (["--config", '{"cpu_bytes_to_use": 100}'], "cpu_bytes_to_use=100"),
        (["--fs-max-bytes", "100"], "max_bytes=100"),
        (["--json", "/nonexistent-dir/r.json"], "/nonexistent-dir"),
    ],
)
def test_config_values_are_checked_before_running(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM's own key checks (``build_offloading_config``) and ours, before any work is done."""
    assert main(["replay", "--requests", "2", "--quiet", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--cpu-blocks", "16", "--config", '{"cpu_bytes_to_use": 1048576}'],
            "--cpu-blocks 16 and cpu_bytes_to_use=1048576 in --config both size the CPU tier",
        ),
        (
            ["--config", '{"cpu_blocks": 16, "cpu_bytes_to_use": 1048576}'],
            "cpu_blocks=16 and cpu_bytes_to_use=1048576 in --config both size the CPU tier",
        ),
    ],
)
def test_two_sizes_of_the_cpu_tier_are_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--cpu-blocks`` used to win silently over ``--config``'s ``cpu_bytes_to_use``."""
    assert main(["replay", "--requests", "2", "--quiet", "--no-fs", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            [
                "--fs-dir",
                "/tmp/b",
                "--config",
                '{"secondary_tiers": [{"type": "fs", "root_dir": "/tmp/a"}]}',
            ],
            "--fs-dir /tmp/b and root_dir='/tmp/a' in --config's fs tier both set root_dir",
        ),
        (
            [
                "--fs-max-bytes",
                "99999",
                "--config",
                '{"secondary_tiers": [{"type": "fs", "max_bytes": 88888}]}',
            ],
            "--fs-max-bytes 99999 and max_bytes=88888 in --config's fs tier both set max_bytes",
        ),
        (
            ["--no-fs", "--cpu-blocks", "16", "--config", '{"cpu_blocks": 32}'],
            "--cpu-blocks 16 and cpu_blocks=32 in --config both set cpu_blocks",
        ),
        (
            ["--no-fs", "--gpu-blocks", "16", "--config", '{"gpu_blocks": 32}'],
            "--gpu-blocks 16 and gpu_blocks=32 in --config both set gpu_blocks",
        ),
        (
            ["--no-fs", "--eviction-policy", "arc", "--config", '{"eviction_policy": "lru"}'],
            "--eviction-policy arc and eviction_policy='lru' in --config both set eviction_policy",
        ),
        (
            [
                "--no-fs",
                "--valkey",
                "redis://127.0.0.1:1",
                "--config",
                '{"secondary_tiers": [{"type": "valkey", "url": "redis://127.0.0.1:2"}]}',
            ],
            "--valkey redis://127.0.0.1:1 and url='redis://127.0.0.1:2' in --config's valkey "
            "tier both set url",
        ),
    ],
)
def test_an_option_and_the_same_config_key_are_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--fs-dir`` / ``--cpu-blocks`` (and every option that sets a ``--config`` key) used to
    win silently over the same key in ``--config``: both given is refused, naming both, before
    anything runs (as two sizes of the CPU tier are)."""
    assert main(["replay", "--requests", "2", "--quiet", *argv]) == 2
    out = capsys.readouterr()
    assert f"kvcascade: error: {message}; give one of them" in out.err and out.out == ""


@pytest.mark.parametrize("root", ['""', "false", "0", "null"])
def test_an_fs_root_dir_given_empty_in_config_is_refused_not_replaced(
    root: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by a break-it run: ``"root_dir": ""`` (or ``false``, ``0``) in ``--config`` was
    replaced by a temporary directory and the replay ran, although ``CascadeConfig`` refuses
    it and so does ``--fs-dir ''``. Only an fs tier without the key gets one."""
    config = json.dumps({"secondary_tiers": [{"type": "fs", "root_dir": json.loads(root)}]})
    assert main(["replay", "--requests", "2", "--quiet", "--config", config]) == 2
    out = capsys.readouterr()
    assert "kvcascade: error: fs tier " in out.err and "root_dir" in out.err and out.out == ""


def test_s3_endpoint_fills_the_s3_tier_of_config() -> None:
    """Found by a break-it run: ``--s3-endpoint`` with the bucket in ``--config``'s s3 tier was
    refused as needing ``--s3-bucket``, and ``--s3-bucket`` then as setting the bucket twice:
    no combination worked. Alone (no s3 tier anywhere) it is still refused."""
    tiers = {"secondary_tiers": [{"type": "s3", "bucket": "kv-blocks"}]}
    argv = ["replay", "--no-fs", "--s3-endpoint", "http://127.0.0.1:9"]
    args = _parser().parse_args([*argv, "--config", json.dumps(tiers)])
    config = build_replay_config(args)
    assert config.secondary_tiers == [
        {"type": "s3", "bucket": "kv-blocks", "endpoint_url": "http://127.0.0.1:9"}
    ]
    with pytest.raises(ConfigError, match="--s3-endpoint needs --s3-bucket, or an s3 tier"):
        build_replay_config(_parser().parse_args(argv))


def test_options_fill_in_what_config_leaves_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An option for a key ``--config`` does not set fills it in: ``--fs-dir`` gives the
    directory of the fs tier of ``--config`` (with its ``max_bytes``), ``--cpu-blocks`` the
    size beside ``--config``'s ``gpu_blocks``."""
    fs_dir = tmp_path / "kv"
    fs_dir.mkdir()
    config = {"gpu_blocks": 64, "secondary_tiers": [{"type": "fs", "max_bytes": 1 << 22}]}
    argv = ["replay", "--requests", "2", "--quiet", "--cpu-blocks", "32", "--fs-dir", str(fs_dir)]
    assert main([*argv, "--config", json.dumps(config)]) == 0
    rows = _rows(capsys.readouterr().out)
    assert (rows["gpu blocks"], rows["cpu blocks"]) == ("64", "32")
    assert list(fs_dir.glob("kvcascade-replay_*_r0/*/*/*.bin"))


def test_cpu_bytes_to_use_from_config_sizes_the_cpu_tier(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["replay", "--requests", "2", "--quiet", "--no-fs"]
    assert main([*argv, "--config", '{"cpu_bytes_to_use": 1048576}']) == 0
    assert _rows(capsys.readouterr().out)["cpu blocks"] == "256"  # 1 MiB / 4096 B


def test_a_missing_fs_dir_is_created_with_a_warning_and_named_for_the_replay(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``--fs-dir`` naming a directory that does not exist: the fs tier creates it and warns,
    naming it (a mistyped path must not fill another disk unseen); an existing one is used
    without a warning. The namespace is the replay's model name unless ``--config`` gives one."""
    fs_dir = tmp_path / "new" / "kv"
    argv = ["replay", "--requests", "2", "--quiet", "--fs-dir", str(fs_dir)]
    assert main(argv) == 0
    created = [r.getMessage() for r in caplog.records if "did not exist" in r.getMessage()]
    assert created == [
        f"fs tier fs: root_dir {fs_dir} did not exist; created it (check the path if an "
        "existing directory was meant)"
    ]
    assert [r.levelname for r in caplog.records if "did not exist" in r.getMessage()] == ["WARNING"]
    caplog.clear()
    assert main([*argv, "--config", '{"model_name": "org/model"}']) == 0
    assert not [r for r in caplog.records if "did not exist" in r.getMessage()]
    models = sorted({re.sub(r"_[0-9a-f]{12}(_r\d+)?$", "", p.name) for p in fs_dir.iterdir()})
    assert models == ["kvcascade-replay", "org_model"]


def _rows(table: str) -> dict[str, str]:
    """The report table's ``label  value`` rows (label: everything before the last field)."""
    rows = {}
    for line in table.splitlines():
        label, _, value = line.rstrip().rpartition(" ")
        if label.strip():
            rows[label.strip()] = value
    return rows


def test_summary_echoes_the_configuration_and_reports_each_tier(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue #21 item 7: the table starts with the configuration (sizes, tiers and their
    directories, a ``~`` expanded as the fs tier expands it), gives the lookup+load latency
    percentiles, per tier dropped / failed / corrupt rows, and "served wrong" on its own line;
    the JSON carries the same."""
    monkeypatch.setenv("HOME", str(tmp_path))
    out = tmp_path / "r.json"
    fs_dir = tmp_path / "fs"
    argv = ["replay", "--requests", "40", "--block-bytes", "128", "--cpu-blocks", "16"]
    argv += ["--fs-dir", "~/fs", "--fs-max-bytes", "300000", "--json", str(out), "--quiet"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    head, config, body = table.split("\n" + "-" * len(table.splitlines()[1]) + "\n")
    assert head == "kvcascade replay"
    assert f"tier fs: root_dir={fs_dir}, max_bytes=300000" in config.splitlines()
    rows = _rows(config) | _rows(body)
    assert rows["block bytes"] == "128" and rows["cpu blocks"] == "16"
    assert rows["cpu bytes"] == "2,048" and rows["gpu blocks"] == "1,024"
    report = json.loads(out.read_text())
    assert rows["served wrong (blocks)"] == "0" == str(report["mismatched_blocks"])
    assert body.splitlines()[-1].startswith("served wrong (blocks)")
    fs = report["tiers"]["fs"]
    assert fs == {
        "dropped_store_blocks": 0,
        "dropped_by_backpressure": 0,
        "failed_jobs": 0,
        "failed_store_jobs": 0,
        "failed_load_jobs": 0,
        "timed_out_jobs": 0,
        "corrupt_blocks": 0,
    }
    for label in ("fs: dropped stores (blocks)", "fs: failed jobs", "fs: corrupt blocks (caught)"):
        assert rows[label] == "0"
    assert rows["cpu: dropped stores (blocks)"] == str(report["dropped_store_blocks"])
    latency = report["load_latency_ms"]
    assert list(latency) == ["p50", "p90", "p99", "max"]
    assert 0 < latency["p50"] <= latency["p90"] <= latency["p99"] <= latency["max"]
    assert rows["lookup+load p99 (ms)"] == f"{latency['p99']:.3f}"
    assert report["config"]["secondary_tiers"] == [
        {"type": "fs", "root_dir": str(fs_dir), "max_bytes": 300000}
    ]


def test_a_block_served_wrong_has_its_own_line_and_fails_the_run(
    trace: list[TraceRequest], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A block file forged with a valid header and checksum but another block's bytes passes
    the tier's check; the replay's byte comparison catches it: "served wrong" 1, corrupt
    (caught) 0, exit status 1."""
    fs_dir = tmp_path / "fs"
    first = run_replay(
        trace[:50],
        CascadeConfig(
            block_bytes=256,
            gpu_blocks=256,
            cpu_blocks=8,
            secondary_tiers=[{"type": "fs", "root_dir": str(fs_dir)}],
            model_name=REPLAY_MODEL_NAME,  # the command's, read back below
        ),
    )
    assert first.mismatched_blocks == 0
    victim, donor = trace[1].hash_ids[0], trace[2].hash_ids[-1]
    path = fs_dir / FileMapper(default_identity(REPLAY_MODEL_NAME, block_bytes=256)).relative_path(
        block_key(victim)
    )
    payload = expected_bytes([donor], 256)[0].tobytes()
    forged = bytearray(path.read_bytes())
    encode_header(block_key(victim), payload, memoryview(forged)[:HEADER_BYTES])
    forged[HEADER_BYTES : HEADER_BYTES + 256] = payload
    path.write_bytes(bytes(forged))
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"hash_ids": list(trace[1].hash_ids)}) + "\n")
    argv = ["replay", str(one), "--block-bytes", "256", "--gpu-blocks", "256"]
    assert main([*argv, "--cpu-blocks", "8", "--fs-dir", str(fs_dir), "--quiet"]) == 1
    captured = capsys.readouterr()
    rows = _rows(captured.out)
    assert rows["served wrong (blocks)"] == "1"
    assert rows["fs: corrupt blocks (caught)"] == "0" and rows["hit blocks: fs"] == "0"
    assert "1 loaded blocks were served wrong" in captured.err


@needs_server
def test_a_tier_killed_mid_run_shows_in_its_own_rows(
    trace: list[TraceRequest], tmp_path: Path
) -> None:
    """Issue #21 item 7: the shared tier's server is killed after 40 of 120 requests; its
    stores then fail and are dropped, and the report says so in the tier's rows (the primary
    tier's own drop count stays what it was), with nothing served wrong."""
    srv = Server(tmp_path / "valkey").start()
    done = [0]

    def progress(n: int) -> None:
        done[0] += n
        if done[0] == 40:
            srv.kill()

    try:
        config = CascadeConfig(
            block_bytes=256,
            gpu_blocks=256,
            cpu_blocks=64,
            secondary_tiers=[{"type": "valkey", "url": srv.url, "io_timeout_s": 5.0}],
            model_name=REPLAY_MODEL_NAME,
        )
        report = run_replay(trace[:120], config, progress)
    finally:
        srv.stop()
    valkey = report.tiers["valkey"]
    assert report.requests == 120 and report.mismatched_blocks == 0
    assert valkey["failed_store_jobs"] > 0 and valkey["dropped_store_blocks"] > 0
    assert valkey["failed_jobs"] >= valkey["failed_store_jobs"] + valkey["failed_load_jobs"]
    assert valkey["corrupt_blocks"] == 0 and report.dropped_store_blocks == 0
    assert report.bytes["cpu_to_valkey"] > 0  # it stored before it died


def test_plot_writes_a_png(tmp_path: Path) -> None:
    """``--plot PATH``: a PNG of the hit ratio per tier and the bytes per link (10 × 7 in at
    matplotlib's default 100 dpi)."""
    pytest.importorskip("matplotlib", reason="matplotlib not installed (kvcascade[plot])")
    png = tmp_path / "replay.png"
    argv = ["replay", "--requests", "30", "--block-bytes", "128", "--cpu-blocks", "16"]
    assert main([*argv, "--fs-dir", str(tmp_path / "fs"), "--plot", str(png), "--quiet"]) == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert struct.unpack(">II", data[16:24]) == (1000, 700)


def test_plot_without_matplotlib_is_a_clear_error_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    argv = ["replay", "--requests", "2", "--fs-dir", str(tmp_path / "fs")]
    assert main([*argv, "--plot", str(tmp_path / "p.png"), "--quiet"]) == 2
    assert "--plot needs matplotlib: pip install 'kvcascade[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "fs").exists() and not (tmp_path / "p.png").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--plot", "/nonexistent-dir/p.png"], "--plot /nonexistent-dir/p.png: directory"),
        (["--json", "/tmp"], "--json /tmp: is a directory"),
    ],
)
def test_report_paths_are_checked_before_running(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", "--requests", "2", "--quiet", *argv]) == 2
    assert message in capsys.readouterr().err


def test_compare_policies_shows_a_progress_bar_on_a_terminal() -> None:
    """Issue #21 item 7: ``--compare-policies`` on a terminal draws a progress bar counting
    every simulated request (requests × policies × capacities) on stderr, a real pty."""
    parent, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # 120 columns
    cmd = [sys.executable, "-m", "kvcascade.replay.cli", "replay", "--compare-policies", "lru,arc"]
    proc = subprocess.Popen(
        [*cmd, "--requests", "50", "--capacities", "0.1"], stdout=subprocess.PIPE, stderr=child
    )
    os.close(child)
    err = b""
    while True:
        try:
            chunk = os.read(parent, 4096)
        except OSError:  # the child closed its side
            break
        if not chunk:
            break
        err += chunk
    out, _ = proc.communicate(timeout=120)
    os.close(parent)
    assert proc.returncode == 0, err
    assert b"compare: 100%" in err and b"100/100" in err
    assert b"prefix-level hit ratio" in out
