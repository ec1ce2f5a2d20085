"""``kvcascade calibrate``'s crossover rule and its CPU measurement (issue #6)."""

from __future__ import annotations

import torch

from kvcascade.ops.calibrate import Measurement, calibrate, crossover


def m(kernel: str, page: int, count: int, seconds: float) -> Measurement:
    return Measurement(kernel, page, count, seconds)


def test_crossover_picks_the_page_where_triton_stops_winning() -> None:
    results = []
    for page in (4096, 16384, 65536):
        for count in (4, 16, 128):
            cpp = 1.0
            triton = 0.5 if (page < 65536 and count >= 16) else 2.0
            results += [m("cpp", page, count, cpp), m("triton", page, count, triton)]
    settings = crossover(results, "test")
    assert settings.triton_max_page_bytes == 65536
    assert settings.triton_min_descriptors == 16
    assert settings.triton_max_store_page_bytes == 0  # no store measurements: the default
    assert settings.provenance == "test"


def test_crossover_per_direction() -> None:
    """Stores get their own page threshold (H200 shape: Triton wins below 256 KiB both ways)."""
    results = []
    for direction, last_win in (("load", 65536), ("store", 262144)):
        for page in (4096, 65536, 262144, 1048576):
            for count in (16, 128):
                triton = 0.5 if page <= last_win else 1.5
                results += [
                    Measurement("cpp", page, count, 1.0, direction),
                    Measurement("triton", page, count, triton, direction),
                ]
    settings = crossover(results, "t")
    assert settings.triton_max_page_bytes == 262144  # first page where Triton loses loads
    assert settings.triton_max_store_page_bytes == 1048576
    assert settings.triton_min_descriptors == 16


def test_crossover_when_triton_never_wins() -> None:
    results = [
        m(k, p, c, 1.0 if k == "cpp" else 3.0)
        for k in ("cpp", "triton")
        for p in (4096, 8192)
        for c in (16, 32)
    ]
    settings = crossover(results, "t")
    assert settings.triton_max_page_bytes == 4096  # Triton is never chosen (pages < 4096 only)
    assert settings.triton_min_descriptors == 33


def test_cpu_calibration_measures_and_writes_nothing(tmp_path) -> None:
    if torch.cuda.is_available():
        return
    results, written = calibrate(tmp_path / "k.json", reps=2)
    assert written is None and not (tmp_path / "k.json").exists()
    assert {r.kernel for r in results} == {"cpp", "torch"}
    assert {r.page_bytes for r in results} == {4096, 65536}
    assert all(r.gbps > 0 for r in results)
