"""Every Python code block of the README and of docs/ runs as pasted, and prints what its
comments promise (issue #21 item 2)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [
    (page, i, code)
    for page in PAGES
    for i, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S))
]


def _promised(code: str) -> list[str]:
    """Outputs promised in ``print(...)  # <output>`` comments (text up to a colon)."""
    return [m.split(":")[0].strip() for m in re.findall(r"print\(.*\)\s+#\s*(.*)", code)]


@pytest.mark.parametrize(
    ("page", "index", "code"), BLOCKS, ids=[f"{p.name}-{i}" for p, i, _ in BLOCKS]
)
def test_code_block_runs_as_pasted(page: Path, index: int, code: str, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{page.name} block {index}:\n{proc.stderr[-3000:]}"
    promised = _promised(code)
    assert proc.stdout.splitlines()[: len(promised)] == promised


def test_every_python_block_is_collected() -> None:
    assert {p.name for p, _, _ in BLOCKS} >= {"README.md", "coordinator.md"}
