"""The compiled extension "still building": a fixture shared by the kernel and device-tier tests."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from kvcascade.ops import _build


@pytest.fixture
def build_in_progress(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """The extension is "still compiling": the load state is reset and the build step (the
    compiler, not the code under test) blocks until the yielded gate is set, then returns the
    extension this process already built. A build still blocked proves nobody waited for it."""
    ext = _build.load_extension()
    if ext is None:
        pytest.skip(f"extension not built: {_build.extension_error()}")
    gate = threading.Event()

    def compiling() -> object:
        gate.wait(30)
        return ext

    for name, value in (("_extension", None), ("_attempted", False), ("_background", None)):
        monkeypatch.setattr(_build, name, value)
    monkeypatch.setattr(_build, "_build_in_child", lambda: None)  # "built"; loading blocks
    monkeypatch.setattr(_build, "_build", compiling)
    yield gate
    gate.set()
    if _build._background is not None:
        _build._background.join(35)


def still_building() -> bool:
    return _build._background is not None and _build._background.is_alive()
