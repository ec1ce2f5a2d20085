"""``kvcascade inspect`` / ``kvcascade purge`` on fs tier directories written by real replays
(issue #21 item 6)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvcascade._admin import inspect_root, parse_age, purge_root
from kvcascade.replay.cli import main

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two namespaces (two block sizes) written by two short replays."""
    out = tmp_path_factory.mktemp("fs")
    for block_bytes in ("4096", "8192"):
        args = ["replay", "--requests", "20", "--fs-dir", str(out), "--quiet"]
        assert main([*args, "--block-bytes", block_bytes, "--cpu-blocks", "16"]) == 0
    return out


@pytest.fixture
def root(written: Path, tmp_path: Path) -> Path:
    """A fresh copy of the two namespaces for each test."""
    return Path(shutil.copytree(written, tmp_path / "root"))


def blocks_on_disk(root: Path, namespace: str) -> list[Path]:
    return [p for p in root.glob(f"{namespace}_r*/**/*.bin")]


def test_inspect_lists_each_namespace_with_its_files(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    assert main(["inspect", str(root), "--json", str(root / "ls.json")]) == 0
    out = capsys.readouterr().out
    usages = inspect_root(root)
    assert len(usages) == 2
    for u in usages:
        files = blocks_on_disk(root, u.name)
        assert u.blocks == len(files) > 0
        assert u.bytes == sum(f.stat().st_size for f in files)
        assert u.identity is not None and u.identity["model_name"] == "kvcascade-replay"
        assert u.name in out and f"{u.blocks:,}" in out
        # The directories as they are on disk: the block files sit in <name>_r0/, not <name>/.
        assert u.ranks == [f"{u.name}_r0"] and (root / u.ranks[0]).is_dir()
        assert f"    on disk: {u.name}/config.json, blocks in {u.name}_r0/\n" in out
    rows = json.loads((root / "ls.json").read_text())
    assert [r["name"] for r in rows] == [u.name for u in usages]


def test_purge_one_namespace_leaves_the_other(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gone, kept = (u.name for u in inspect_root(root))
    kept_files = sorted(blocks_on_disk(root, kept))
    n = len(blocks_on_disk(root, gone))
    assert main(["purge", str(root), "--namespace", gone]) == 0
    assert f"removed {n:,} files" in capsys.readouterr().out
    assert [u.name for u in inspect_root(root)] == [kept]
    assert not list(root.glob(f"{gone}*"))
    assert sorted(blocks_on_disk(root, kept)) == kept_files


def test_purge_older_than_removes_only_old_blocks(root: Path) -> None:
    name = inspect_root(root)[0].name
    files = sorted(blocks_on_disk(root, name))
    old = files[: len(files) // 2]
    week_ago = time.time() - 8 * 86400
    for path in old:
        os.utime(path, (week_ago, week_ago))
    assert main(["purge", str(root), "--older-than", "7d", "--all"]) == 0
    assert sorted(blocks_on_disk(root, name)) == files[len(old) :]
    assert len(inspect_root(root)) == 2  # namespaces stay; only old blocks went


def test_purge_refuses_without_a_filter_and_names_bad_values(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = {u.name: u.blocks for u in inspect_root(root)}
    for argv, message in [
        ([], "give --namespace, --older-than or --all"),
        (["--namespace", "nope"], "no namespace ['nope']"),
        (["--older-than", "7 days"], "got '7 days'"),
    ]:
        assert main(["purge", str(root), *argv]) == 2
        assert message in capsys.readouterr().err
    assert {u.name: u.blocks for u in inspect_root(root)} == before
    assert main(["inspect", str(root / "missing")]) == 2  # said "is not a directory"
    assert f"kvcascade: error: '{root / 'missing'}' does not exist" in capsys.readouterr().err
    (root / "file").write_text("")
    assert main(["purge", str(root / "file"), "--all"]) == 2
    assert f"kvcascade: error: '{root / 'file'}' is not a directory" in capsys.readouterr().err


def test_an_empty_age_is_refused_not_read_as_no_filter(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``purge --all --older-than "$AGE"`` with AGE unset removed every block."""
    before = {u.name: u.blocks for u in inspect_root(root)}
    with pytest.raises(SystemExit):
        main(["purge", str(root), "--all", "--older-than", ""])
    assert "argument --older-than: expected a value, got ''" in capsys.readouterr().err
    assert {u.name: u.blocks for u in inspect_root(root)} == before


def test_inspect_into_a_closed_pipe_exits_quietly(root: Path) -> None:
    """``kvcascade inspect DIR | head -2`` ended with ``kvcascade: error: [Errno 32] Broken
    pipe``: a reader gone away ends the command without a word, status 128 + SIGPIPE as a
    command killed by the signal. The pipe's read end is closed before the command starts."""
    read, write = os.pipe()
    os.close(read)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "kvcascade.replay.cli", "inspect", str(root)],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": path},
            timeout=120,
        )
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (128 + signal.SIGPIPE, "")


def test_inspect_and_purge_beside_a_running_engine(tmp_path: Path) -> None:
    """An operator's ``kvcascade purge DIR --all`` while an engine stored into DIR failed with
    ``kvcascade: error: [Errno 2] No such file or directory: '…/<hex>.bin_<pid>_<n>.tmp'`` and
    left most files: the engine renamed a temp file between the listing and its ``stat``. Here
    a real replay (a small CPU tier: every block goes to the fs tier) runs while inspect and
    purge walk its namespace in a loop — a purge of old blocks (none is old: it stats every
    file and removes nothing) and, once, of everything. None may raise; the engine creates
    its namespace again, serves no wrong byte and leaves no temp file (docs/fs-tier.md,
    *Inspecting and purging a root*)."""
    root = tmp_path / "root"
    report = tmp_path / "replay.json"
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    args = ["--requests", "800", "--cpu-blocks", "64", "--fs-dir", str(root), "--quiet"]
    replay = subprocess.Popen(
        [sys.executable, "-m", "kvcascade.replay.cli", "replay", *args, "--json", str(report)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
    )
    walks = 0
    purged: list[int] = []
    try:
        while replay.poll() is None:
            usages = inspect_root(root) if root.is_dir() else []
            if not usages:
                time.sleep(0.01)  # the engine has not written its namespace yet
                continue
            assert purge_root(root, older_than_s=3600.0).files == 0
            walks += 1
            if not purged and usages[0].blocks > 500:
                purged.append(purge_root(root).files)
    finally:
        if replay.poll() is None:
            replay.kill()
        _, err = replay.communicate(timeout=120)
    assert replay.returncode == 0, err
    assert walks > 0 and purged and purged[0] > 500, (walks, purged)
    assert "was removed while the tier ran (kvcascade purge?); created it again" in err, err
    assert "could not save cache-policy state" not in err, err  # beside the new config.json
    result = json.loads(report.read_text())
    assert (result["mismatched_blocks"], result["corrupt_blocks"]) == (0, 0)
    hits = result["hit_blocks"]
    assert result["verified_blocks"] == hits["cpu"] + hits["fs"] > 0  # every load checked
    assert inspect_root(root)[0].blocks > 0  # stored again after the purge
    assert not list(root.rglob("*.tmp"))


def test_a_model_name_with_glob_characters_is_found_and_purged(tmp_path: Path) -> None:
    # [, ], ?, * in a model name are characters of a directory name, not a pattern: with a
    # glob, inspect saw no blocks of "org/model[v2]" and purge --all left them all on disk.
    config = json.dumps({"model_name": "org/model[v2]*?"})
    args = ["replay", "--requests", "20", "--fs-dir", str(tmp_path), "--quiet"]
    assert main([*args, "--config", config, "--cpu-blocks", "16"]) == 0
    (usage,) = inspect_root(tmp_path)
    files = [p for p in tmp_path.rglob("*.bin")]
    assert usage.blocks == len(files) > 0
    assert usage.ranks == [f"{usage.name}_r0"]
    result = purge_root(tmp_path, older_than_s=0, now=time.time() + 60)
    assert result.files == len(files) and not list(tmp_path.rglob("*.bin"))
    assert inspect_root(tmp_path)[0].blocks == 0
    assert main(["replay", *args[1:], "--config", config, "--cpu-blocks", "16"]) == 0
    result = purge_root(tmp_path)
    assert result.files > 0 and result.namespaces == [usage.name]
    assert not list(tmp_path.iterdir())


def test_a_config_json_that_is_not_a_file_is_not_read(root: Path) -> None:
    """Found by a break-it run: a FIFO in place of a namespace's ``config.json`` blocked
    ``kvcascade inspect`` and ``purge`` for ever (the tier refuses one already). It is now a
    namespace of unknown identity, its blocks still counted and purged."""
    first, second = inspect_root(root)
    fifo = root / first.name / "config.json"
    fifo.unlink()
    os.mkfifo(fifo)
    found: list[object] = []
    worker = threading.Thread(target=lambda: found.append(inspect_root(root)))
    worker.start()
    worker.join(30)
    if worker.is_alive():  # blocked in the read: release it, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join()
        pytest.fail("inspect_root blocked reading a FIFO config.json")
    (usages,) = found
    assert [(u.name, u.identity is None, u.blocks) for u in usages] == [
        (first.name, True, first.blocks),
        (second.name, False, second.blocks),
    ]
    assert purge_root(root, [first.name]).files == first.blocks


def test_parse_age() -> None:
    assert [parse_age(t) for t in ("90s", "30m", "12h", "7d", "2w")] == [
        90,
        1800,
        43200,
        604800,
        1209600,
    ]
