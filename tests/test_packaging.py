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


@pytest.fixture(scope="module")
def wheel_venv(
    wheel: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, str]]:
    """A fresh virtualenv with the wheel installed, seeing this interpreter's packages (torch).

    Not ``system_site_packages=True``: that inherits the *base* interpreter's packages, so run
    from inside a virtualenv the child had no torch (issue #15). The package directories on this
    interpreter's ``sys.path`` are appended as plain paths (a ``.pth``; their own ``.pth`` hooks
    — e.g. an editable kvcascade — are not run), after the venv's own site-packages, so the
    installed wheel wins.
    Returns (python, env with an empty kernel cache directory for the child)."""
    tmp = tmp_path_factory.mktemp("wheel-venv")
    env_dir = tmp / "venv"
    venv.EnvBuilder(system_site_packages=False, with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    child_site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    outer = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]
    (Path(child_site) / "outer_site.pth").write_text("".join(f"{p}\n" for p in outer))
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
    env = {**os.environ, "KVCASCADE_BUILD_DIR": str(tmp / "build")}
    env.pop("PYTHONPATH", None)
    return python, env


BUILD_SCRIPT = (
    "import kvcascade, torch, numpy as np\n"
    "from kvcascade.ops import swap_blocks, _build\n"
    "assert '/venv/' in kvcascade.__file__, kvcascade.__file__\n"
    "assert _build.kernels_dir().name == '_kernels', _build.kernels_dir()\n"
    "src = torch.arange(64, dtype=torch.int8).reshape(8, 8)\n"
    "dst = torch.zeros_like(src)\n"
    "swap_blocks(src, dst, np.array([1, 2]), np.array([5, 0]), kernel='cpp')\n"
    "assert _build.extension_error() is None, _build.extension_error()\n"
    "assert dst[5].tolist() == src[1].tolist() and dst[0].tolist() == src[2].tolist()\n"
    "print(_build.extension_spec()[0], _build.kernels_dir())\n"
)


def _run_build_script(python: Path, env: dict[str, str], cwd: Path) -> tuple[str, str]:
    """Run :data:`BUILD_SCRIPT`; returns (extension name, kernel sources directory)."""
    proc = subprocess.run(
        [str(python), "-c", BUILD_SCRIPT], cwd=cwd, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    name, sources = proc.stdout.split()
    return name, sources


def _built_libraries(build_root: Path) -> dict[str, int]:
    return {str(p.relative_to(build_root)): p.stat().st_mtime_ns for p in build_root.rglob("*.so")}


def test_kernel_builds_from_installed_wheel(
    wheel_venv: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    python, env = wheel_venv
    name, _ = _run_build_script(python, env, tmp_path)
    assert name.startswith("kvcascade_swap_")
    assert list(_built_libraries(Path(env["KVCASCADE_BUILD_DIR"]))) == [f"{name}/{name}.so"]


def test_each_virtualenv_builds_its_kernels_once(
    wheel_venv: tuple[Path, dict[str, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue #15 defect 3: ``build.ninja`` records the environment's paths, so environments
    sharing a build directory rebuilt each other's extension every start. The directory is keyed
    by the environment: this interpreter's name for the very same sources differs from the
    virtualenv's, and the virtualenv's second start reuses its own build."""
    from kvcascade.ops import _build

    python, env = wheel_venv
    root = Path(env["KVCASCADE_BUILD_DIR"])
    first, sources = _run_build_script(python, env, tmp_path)
    built = _built_libraries(root)
    assert _run_build_script(python, env, tmp_path) == (first, sources)
    assert _built_libraries(root) == built  # not rebuilt
    monkeypatch.setenv("KVCASCADE_KERNELS_DIR", sources)
    assert _build.kernels_dir() == Path(sources)
    assert first != _build.extension_spec()[0]
