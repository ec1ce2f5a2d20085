"""The built wheel ships the bundled trace and the kernel sources, and a kernel builds from it
(shape.md: install the wheel, not the source tree, into a fresh virtualenv)."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "-q",
            "-w",
            str(out),
            str(ROOT),
        ],
        check=True,
    )
    (path,) = out.glob("kvcascade-*.whl")
    return path


def test_wheel_contents(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in (
        "kvcascade/data/mooncake_conversation_trace.jsonl",
        "kvcascade/data/NOTICE.md",
        "kvcascade/_kernels/swap_blocks.cpp",
        "kvcascade/_kernels/fs_io.cpp",
        "kvcascade/_kernels/kvc_result.h",
        "kvcascade/_kernels/third_party/xxhash/xxhash.h",
        "kvcascade/_kernels/third_party/xxhash/LICENSE",
        "kvcascade/_kernels/swap_blocks_cuda.cu",
        "kvcascade/_kernels/triton_swap.py",
    ):
        assert needed in names, needed


def test_kernel_builds_from_installed_wheel(wheel: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "-q",
            "--no-deps",
            str(wheel),
        ],
        check=True,
    )
    script = (
        "import kvcascade, torch, numpy as np\n"
        "from kvcascade.ops import swap_blocks, _build\n"
        "assert '/venv/' in kvcascade.__file__, kvcascade.__file__\n"
        "assert _build.kernels_dir().name == '_kernels', _build.kernels_dir()\n"
        "src = torch.arange(64, dtype=torch.int8).reshape(8, 8)\n"
        "dst = torch.zeros_like(src)\n"
        "swap_blocks(src, dst, np.array([1, 2]), np.array([5, 0]), kernel='cpp')\n"
        "assert _build.extension_error() is None, _build.extension_error()\n"
        "assert dst[5].tolist() == src[1].tolist() and dst[0].tolist() == src[2].tolist()\n"
        "print('ok')\n"
    )
    env = {**os.environ, "KVCASCADE_BUILD_DIR": str(tmp_path / "build")}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [str(python), "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "ok"
