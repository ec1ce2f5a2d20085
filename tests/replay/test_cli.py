"""The ``kvcascade`` command's own options and output (issue #21 item 10)."""

from __future__ import annotations

import logging
import subprocess
import sys

from kvcascade.replay import cli


def test_version_and_help_start_without_torch() -> None:
    code = (
        "import sys\n"
        "from kvcascade.replay.cli import main\n"
        "for argv in (['--version'], ['--help'], ['replay', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as exc:\n"
        "        assert exc.code == 0, exc.code\n"
        "print('torch' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = proc.stdout.splitlines()
    assert lines[0] == "kvcascade 0.1.0"
    assert "--compare-policies" in proc.stdout
    assert lines[-1] == "False"


def test_log_lines_carry_one_kvcascade_prefix() -> None:
    formatter = cli._Formatter("kvcascade: %(levelname)s: %(message)s")
    for message in ("kvcascade: tier 'fs' is full", "tier 'fs' is full"):
        record = logging.LogRecord("kvcascade.tiers.fs", logging.WARNING, "", 0, message, (), None)
        assert formatter.format(record) == "kvcascade: WARNING: tier 'fs' is full"
