"""Just-in-time build of the ``kernels/`` C++ (and, with CUDA, ``.cu``) extension.

:func:`load_extension` builds once per process with :func:`torch.utils.cpp_extension.load` into
``$KVCASCADE_BUILD_DIR`` or ``~/.cache/kvcascade/torch_extensions/<name>``, where ``<name>`` hashes
the sources and their directory, the torch version and location, the interpreter
(``sys.executable``, ``sys.prefix``, Python version) and the CUDA flag. torch's ``build.ninja``
records the source paths and the environment's include and library paths, so two virtualenvs
(or two checkouts) sharing one directory would rebuild each other's extension on every start;
keyed this way each environment builds once and reuses its build across processes
(an exclusive ``flock`` makes concurrent processes of one environment wait for one build). The
CUDA source is compiled in only when torch was built with CUDA and a device is available. If the
build fails, one warning is logged and ``None`` is returned; callers fall back to the pure-torch
path.

No build ever sits on the serving path (issue #15): the copy paths call
:func:`extension_if_ready`, which starts the build in a process of its own (watched by a
background thread) and returns ``None`` until the extension has loaded; meanwhile they copy with the
fallbacks of :func:`kvcascade.ops.batch_copy`. A build that completed writes
:data:`BUILT_STAMP` (the library's size and mtime); while the library matches it, it is
imported directly, with no child process and no ninja run. A build that runs is not a
descendant of the process that wants it (:func:`_build_in_child`): vLLM's shutdown without
``--shutdown-timeout`` kills its engine core's process tree (``kill_process_tree`` in vLLM's
``vllm/utils/system_utils.py``) and fails on a descendant that exits while it walks the tree
(ninja's and the compiler's short-lived processes would be such descendants), leaving the API
server running (docs/vllm.md, *Exit and shutdown*).

Sources are found in ``kvcascade/_kernels`` (installed wheel, hatchling force-include) or
``<repo>/kernels`` (source checkout); ``KVCASCADE_KERNELS_DIR`` overrides both.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("kvcascade.ops")

CPP_SOURCE = "swap_blocks.cpp"
FS_IO_SOURCE = "fs_io.cpp"
CUDA_SOURCE = "swap_blocks_cuda.cu"
TRITON_SOURCE = "triton_swap.py"
#: Written in a build directory once a build completed: the library's size and mtime.
BUILT_STAMP = "kvcascade.built"

_lock = threading.Lock()
_extension: ModuleType | None = None
_attempted = False
_error: str | None = None
_triton: ModuleType | None = None
_triton_attempted = False
_triton_lock = threading.Lock()  # not _lock: a C++ build holds that for a minute
_background: threading.Thread | None = None
_start_lock = threading.Lock()


def kernels_dir() -> Path | None:
    """The directory holding the kernel sources, or ``None`` if none is found."""
    env = os.environ.get("KVCASCADE_KERNELS_DIR")
    package = Path(__file__).resolve().parent.parent
    candidates = [Path(env)] if env else []
    candidates += [package / "_kernels", package.parent / "kernels"]
    for c in candidates:
        if (c / CPP_SOURCE).is_file():
            return c
    return None


def cuda_wanted() -> bool:
    """Whether the CUDA source should be compiled in (torch built with CUDA, a device present)."""
    return torch.version.cuda is not None and torch.cuda.is_available()


def build_dir(name: str) -> Path:
    """The build directory for extension ``name`` (created)."""
    root = os.environ.get("KVCASCADE_BUILD_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "kvcascade" / "torch_extensions"
    path = base / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def _hashed_files(src_dir: Path, sources: list[Path]) -> list[Path]:
    """The sources plus every header and included C file under ``src_dir`` (vendored code too),
    so that a change to any of them gives a new build name."""
    included = [p for p in sorted(src_dir.rglob("*")) if p.suffix in (".h", ".c") and p.is_file()]
    return sources + [p for p in included if p not in sources]


def extension_spec() -> tuple[str, list[Path], bool]:
    """``(name, sources, with_cuda)`` of this environment's build.

    ``name`` hashes every source and header, the CUDA flag, the sources' directory, the torch
    version and directory, the interpreter (resolved ``sys.executable``) and ``sys.prefix`` —
    every path ``build.ninja`` records — so it is one name per environment and checkout.

    Raises:
        FileNotFoundError: no kernel sources (see :func:`kernels_dir`).
    """
    src_dir = kernels_dir()
    if src_dir is None:
        raise FileNotFoundError("kernel sources not found (kvcascade/_kernels or <repo>/kernels)")
    with_cuda = cuda_wanted()
    sources = [src_dir / CPP_SOURCE, src_dir / FS_IO_SOURCE]
    sources += [src_dir / CUDA_SOURCE] if with_cuda else []
    h = hashlib.sha256()
    for src in _hashed_files(src_dir, sources):
        h.update(src.relative_to(src_dir).as_posix().encode())
        h.update(src.read_bytes())
    env = (
        str(src_dir.resolve()),
        torch.__version__,
        str(Path(torch.__file__).resolve().parent),
        os.path.realpath(sys.executable),
        sys.prefix,
        sys.version_info[:2],
        with_cuda,
    )
    h.update(repr(env).encode())
    return f"kvcascade_swap_{h.hexdigest()[:12]}", sources, with_cuda


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (released by the OS if the process dies)."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _stamp(library: Path) -> str:
    """Size and mtime of a built library: what :data:`BUILT_STAMP` records of it."""
    st = library.stat()
    return f"{st.st_size} {st.st_mtime_ns}\n"


def _built_library(name: str) -> Path | None:
    """The library of build ``name`` if that build completed and the library is still the one
    it linked (:data:`BUILT_STAMP`), else ``None``."""
    directory = build_dir(name)
    library = directory / f"{name}.so"
    try:
        return library if (directory / BUILT_STAMP).read_text() == _stamp(library) else None
    except OSError:
        return None


def _import_library(name: str, library: Path) -> ModuleType:
    """Import a built library as module ``name``, as torch's ``cpp_extension.load`` does."""
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build() -> ModuleType:
    name, sources, with_cuda = extension_spec()
    library = _built_library(name)
    if library is not None:  # no ninja run, no process started (module docstring)
        return _import_library(name, library)
    from torch.utils import cpp_extension

    cflags = ["-O3", "-std=c++17", "-pthread"] + (["-DKVCASCADE_WITH_CUDA"] if with_cuda else [])
    directory = build_dir(name)
    with (
        _exclusive(directory / "kvcascade.flock"),
        warnings.catch_warnings(record=True) as caught,
    ):
        # torch guards a build with a plain ``lock`` file and waits on it forever; a process
        # killed (or exiting) mid-build leaves it behind. Our flock dies with its process, so
        # holding it proves no build is running here and any ``lock`` left is stale.
        (directory / "lock").unlink(missing_ok=True)
        warnings.simplefilter("always")
        module = cpp_extension.load(
            name=name,
            sources=[str(s) for s in sources],
            extra_cflags=cflags,
            extra_cuda_cflags=["-O3"] if with_cuda else None,
            extra_ldflags=["-pthread"],
            build_directory=str(directory),
            with_cuda=with_cuda,
            verbose=False,
        )
        stamp = directory / f"{BUILT_STAMP}.tmp"
        stamp.write_text(_stamp(directory / f"{name}.so"))
        stamp.replace(directory / BUILT_STAMP)
    for w in caught:
        log.debug("kernel build: %s", w.message)
    return module


def load_extension() -> ModuleType | None:
    """The compiled extension module (built on first call), or ``None`` if it cannot be built.

    The module has ``batch_copy(src_ptrs, dst_ptrs, sizes)``, ``has_cuda() -> bool`` and, when
    CUDA was compiled in, ``batch_copy_cuda(src_ptrs, dst_ptrs, sizes, stream, src_access_any)``;
    both return ``(bytes, error kind, message)`` instead of raising (kind 0: ok, 1: bad value,
    2: CUDA error) — use :func:`kvcascade.ops.batch_copy`, which raises.
    Set ``KVCASCADE_DISABLE_EXTENSION=1`` to skip the build.
    """
    global _extension, _attempted, _error
    if _attempted:
        return _extension
    with _lock:
        if _attempted:
            return _extension
        if os.environ.get("KVCASCADE_DISABLE_EXTENSION") == "1":
            _error = "disabled by KVCASCADE_DISABLE_EXTENSION=1"
        else:
            try:
                _extension = _build()
            except Exception as exc:  # any compiler / loader failure → pure-torch fallback
                _error = f"{type(exc).__name__}: {exc}"
                log.warning(
                    "kvcascade: building the copy kernels failed, using the pure-torch path (%s)",
                    _error,
                )
        _attempted = True
    return _extension


_CHILD_BUILD = (
    "import os, sys\n"
    "if os.fork():\n"  # the builder leaves the caller's process tree (_build_in_child)
    "    os._exit(0)\n"
    "sys.path.insert(0, sys.argv[1])\n"
    "from kvcascade.ops import _build\n"
    "if _build.load_extension() is None:\n"
    "    sys.exit(_build.extension_error())\n"
    "print('built')\n"
)


def _build_in_child() -> str | None:
    """Build in a process of its own session, outside this process's tree; ``None`` on
    success, else its error.

    The builder holds the build directory's ``flock`` until ninja is done, even if this process
    exits meanwhile (a build thread's ninja would outlive its process and the lock with it, and
    race the next process's ninja on the same object files). It is the grandchild of a
    launcher that exits at once, so neither it nor ninja and the compiler are descendants of
    this process: vLLM's shutdown without ``--shutdown-timeout`` kills the engine core's tree
    and fails on a descendant that exits while it walks it (module docstring). The result
    comes through the builder's pipes, which stay open until it exits."""
    root = str(Path(__file__).resolve().parents[2])
    with subprocess.Popen(
        [sys.executable, "-c", _CHILD_BUILD, root],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as launcher:
        launcher.wait()  # at once: reaped, no process of the build is left in this tree
        out, err = launcher.communicate()  # until the builder exits (EOF on its pipes)
    if out.split()[-1:] == ["built"]:
        return None
    lines = err.strip().splitlines()
    return lines[-1] if lines else f"build process exited with status {launcher.returncode}"


def _background_load() -> None:
    global _attempted, _error
    if os.environ.get("KVCASCADE_DISABLE_EXTENSION") != "1" and not _is_built():
        error = _build_in_child()
        if error is not None:
            with _lock:
                if not _attempted:
                    _error, _attempted = error, True
                    log.warning(
                        "kvcascade: building the copy kernels failed, using the pure-torch path "
                        "(%s)",
                        error,
                    )
            return
    load_extension()  # built (or disabled): loads in about a second


def _is_built() -> bool:
    try:
        return _built_library(extension_spec()[0]) is not None
    except OSError:  # no sources: load_extension says so
        return False


def extension_if_ready() -> ModuleType | None:
    """The extension if it is already loaded; otherwise start building and loading it in the
    background (a build takes 1–2 min on 2 cores, in a child process; a cached build loads in
    about a second) and return ``None`` at once, so a hot path never waits for the compiler."""
    global _background
    if _attempted:
        return _extension
    if _background is not None:
        return None
    with _start_lock:  # not _lock: load_extension holds that for the whole build
        if _background is None:
            _background = threading.Thread(
                target=_background_load, name="kvcascade-kernel-build", daemon=True
            )
            _background.start()
    return None


def extension_error() -> str | None:
    """Why :func:`load_extension` returned ``None`` (``None`` if it succeeded or was not tried)."""
    return _error


def load_triton() -> ModuleType | None:
    """The ``triton_swap`` kernel module, or ``None`` when Triton or the source is unavailable."""
    global _triton, _triton_attempted
    if _triton_attempted:
        return _triton
    with _triton_lock:
        if _triton_attempted:
            return _triton
        _triton_attempted = True
        src_dir = kernels_dir()
        path = src_dir / TRITON_SOURCE if src_dir is not None else None
        if path is None or not path.is_file() or importlib.util.find_spec("triton") is None:
            return None
        name = "kvcascade._kernels_triton_swap"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            return None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(name, None)
            log.warning(
                "kvcascade: loading the Triton kernel failed (%s: %s)", type(exc).__name__, exc
            )
            return None
        _triton = module
    return _triton
