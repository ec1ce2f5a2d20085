"""Suite-wide guards: a blocking call on an asyncio test's loop fails that test; no test hangs.

* Asyncio tests run their loop in debug mode (``asyncio_debug = true`` in pyproject.toml, a
  pytest-asyncio option). In debug mode asyncio logs ``Executing <handle> took N seconds`` for
  every callback or task step that held the loop at least ``slow_callback_duration`` (0.1 s); a
  test during which one held it :data:`SLOW_CALLBACK_S` or longer fails, naming the handle. A test
  that blocks its loop on purpose (to show that work proceeds without the loop) says so with
  ``@pytest.mark.blocks_loop``.
* Every test runs under a wall-clock bound (:data:`TEST_TIMEOUT_S`, setup and teardown of its
  function-scoped fixtures included): at the bound every thread's stack is written to stderr and
  the test fails with :class:`TestTimeout` raised in the main thread (``SIGALRM``, the way
  pytest-timeout's ``signal`` method works).
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import signal
import sys
from collections.abc import Iterator
from types import FrameType

import pytest

#: Seconds a callback may hold an asyncio test's loop: a blocking call of a second fails the test.
#: On a shared 2-core machine (load average ~7) steps of tests/tiers/test_fs_tier.py measured
#: 0.3-1.0 s in one whole-suite run and at most 0.23 s in another (the test's reader threads
#: competing for the GIL with the loop); everything else stayed under 0.11 s. The bound sits above
#: that noise.
SLOW_CALLBACK_S = 1.0

#: Seconds one test may take, fixtures included: about three times the slowest test of a
#: whole-suite run on a shared 2-core machine (188 s, test_kernels' kernel build).
TEST_TIMEOUT_S = 600


class TestTimeout(Exception):
    """A test ran past :data:`TEST_TIMEOUT_S`."""

    __test__ = False  # not a test class


def _timed_out(signum: int, frame: FrameType | None) -> None:
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    raise TestTimeout(f"test ran past {TEST_TIMEOUT_S} s (every thread's stack is on stderr)")


@pytest.fixture(autouse=True)
def _test_timeout() -> Iterator[None]:
    previous = signal.signal(signal.SIGALRM, _timed_out)
    signal.setitimer(signal.ITIMER_REAL, TEST_TIMEOUT_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def frozen_heap() -> Iterator[None]:
    """The objects that exist before the test (torch, botocore's service models, moto's
    clients: some 260,000 objects in tests/tiers/test_slow_tier.py) left out of garbage
    collection during it (``gc.collect()`` then ``gc.freeze()``; ``gc.unfreeze()`` after).

    A full collection walks every tracked object and runs inside whichever loop callback
    allocated when it triggered: measured 0.25-0.30 s per full collection in that heap at load
    average 2.6 on the shared 2-core machine (a ``gc.callbacks`` timer around each loop handle),
    0.378 s of a 0.385 s step of ``S3Tier._head``, so under a heavier load one collection alone
    passes :data:`SLOW_CALLBACK_S` in a callback that did nothing slow (the flakes of an
    aiobotocore ``head_object`` step at 1.8 s and of the fault proxy's ``_accept_connection`` at
    1.014 s, which accepted at most 4 connections per call, 7 ms at most). Frozen objects are
    not walked, so a collection during the test costs what the test itself allocated. For tests
    whose heap is that large; the loop guard still fails a callback that blocks."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class _SlowCallbacks(logging.Handler):
    """Collects asyncio's debug-mode reports of callbacks that held the loop too long."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.found: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if not (isinstance(record.msg, str) and record.msg.startswith("Executing ")):
            return
        args = record.args if isinstance(record.args, tuple) else ()
        if args and isinstance(args[-1], float) and args[-1] >= SLOW_CALLBACK_S:
            self.found.append(record.getMessage())


@pytest.fixture(autouse=True)
def _no_blocking_on_the_loop(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.get_closest_marker("blocks_loop") is not None:
        yield
        return
    handler = _SlowCallbacks()
    asyncio_logger = logging.getLogger("asyncio")
    asyncio_logger.addHandler(handler)
    try:
        yield
    finally:
        asyncio_logger.removeHandler(handler)
    if handler.found:
        pytest.fail(
            f"a callback held the event loop >= {SLOW_CALLBACK_S} s (a blocking call on the "
            "loop?):\n" + "\n".join(handler.found),
            pytrace=False,
        )
