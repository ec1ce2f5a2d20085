"""The s3/valkey error boundary (``kvcascade/tiers/_backend.py``): one table, one translation,
the backend's availability. Real exceptions raised inside the boundary; the tiers' own tables
are exercised against real servers in tests/tiers/test_s3_tier.py and
tests/tiers/test_valkey_tier.py."""

from __future__ import annotations

import logging
import time

import pytest

import kvcascade as kc
from kvcascade.tiers._backend import Backend, Meaning, NotFoundError


class Answered(Exception):
    def __init__(self, code: str) -> None:
        super().__init__(f"secret text of the backend: {code}")
        self.code = code


def make(retry_s: float = 60.0) -> Backend:
    return Backend(
        "t",
        "kv",
        "server",
        "kv://host:1",
        [
            (ConnectionRefusedError, Meaning.DOWN),
            (MemoryError, Meaning.FULL),
            (Answered, Meaning.ANSWERED),
            (BrokenPipeError, Meaning.FAILED),
        ],
        retry_s,
        code=lambda exc: exc.code if isinstance(exc, Answered) else type(exc).__name__,
        not_found=lambda exc: isinstance(exc, Answered) and exc.code == "404",
    )


def test_down_then_up(caplog: pytest.LogCaptureFixture) -> None:
    backend = make()
    caplog.set_level(logging.INFO, logger="kvcascade")
    with backend.translate("GET"):
        pass  # it answered once: a later outage is warned about
    unreachable = r"kv GET: server kv://host:1 unreachable"
    with pytest.raises(kc.TierUnavailableError, match=unreachable), backend.translate("GET"):
        raise ConnectionRefusedError
    assert not backend.available() and backend.refusing_writes() == "down"
    with pytest.raises(kc.TierUnavailableError, match="is down"):
        backend.check_available()
    with backend.translate("GET"):
        pass  # an answer marks it up
    assert backend.available() and backend.refusing_writes() is None
    assert caplog.text.count("unreachable; lookups miss") == 1
    assert caplog.text.count("answers again") == 1


def test_down_before_a_first_answer_then_up_is_no_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A server that has never answered is not warned about as down (a tier's start-up says
    whether it is reachable), so its first answer is no "answers again" warning either."""
    backend = make()
    caplog.set_level(logging.INFO, logger="kvcascade")
    with pytest.raises(kc.TierUnavailableError, match="unreachable"), backend.translate("GET"):
        raise ConnectionRefusedError
    with backend.translate("GET"):
        pass
    assert backend.available()
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "kv tier t: server kv://host:1 answers (its first answer)")
    ]


def test_answers_never_quote_the_backend_text() -> None:
    backend = make()
    with pytest.raises(NotFoundError) as info, backend.translate("HEAD"):
        raise Answered("404")
    assert str(info.value) == "kv HEAD: 404" and isinstance(info.value, kc.TransferError)
    with pytest.raises(kc.TransferError) as other, backend.translate("PUT"):
        raise Answered("AccessDenied")
    assert str(other.value) == "kv PUT failed (AccessDenied)"
    assert "secret" not in str(other.value) and isinstance(other.value.__cause__, Answered)


def test_full_refuses_writes_for_the_window_then_retries() -> None:
    backend = make(retry_s=0.05)
    with pytest.raises(kc.TransferError, match="is full"), backend.translate("SET"):
        raise MemoryError
    assert backend.available() and backend.refusing_writes() == "full"
    time.sleep(0.06)
    assert backend.refusing_writes() is None


def test_failed_request_changes_nothing_and_other_exceptions_pass() -> None:
    backend = make()
    failed = r"kv GET body failed \(BrokenPipeError\)"
    with pytest.raises(kc.TransferError, match=failed), backend.translate("GET body"):
        raise BrokenPipeError
    assert backend.available()
    with pytest.raises(KeyError), backend.translate("GET"):
        raise KeyError("a bug, not the backend")
