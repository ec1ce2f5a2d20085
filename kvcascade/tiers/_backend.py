"""The one boundary between a network backend's exceptions and kvcascade's (s3, valkey tiers).

httpx's ``map_httpcore_exceptions`` is the model: each tier declares one table, backend
exception type → :class:`Meaning` (first match wins), and every request runs inside
:meth:`Backend.translate`, which turns an exception of the table into kvcascade's own and keeps
the backend's availability (docs/s3-tier.md and docs/valkey-tier.md, "Failure behaviour"):

* ``DOWN`` (no answer: refused, timed out, connection closed): the backend is marked down for
  ``retry_s`` seconds, during which the tier sends nothing (probes miss, stores are dropped,
  loads fail); :class:`TierUnavailableError`;
* ``FULL`` (it answered that it refuses writes, e.g. valkey's ``maxmemory``): marked up, and
  full for ``retry_s`` (stores are dropped); :class:`TransferError`, ``reported``: one warning
  per episode, which lasts until a store succeeds again (:meth:`Backend.stored`);
* ``ANSWERED`` (any other error answer): marked up; :class:`NotFoundError` when the answer
  says the object is not there, else :class:`TransferError`;
* ``FAILED`` (the request broke off after an answer began, or the client failed): no change;
  :class:`TransferError`.

A request that succeeds marks the backend up. Going down is a warning (lookups miss, stores
are dropped until it answers) only once the backend has answered: one never reached fails the
tier's start instead. Messages name the operation and a short code
(the S3 error code or the exception's type), never the backend's own text (it may quote
request URLs or a command's arguments). Any other exception (a bug) passes unchanged. Each
change of state is logged once.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from collections.abc import Callable, Iterator, Sequence

from .._errors import TierUnavailableError, TransferError

log = logging.getLogger(__name__)


class Meaning(enum.Enum):
    """What a backend exception says about the backend (module docstring)."""

    ANSWERED = "the backend answered with an error"
    FULL = "the backend answered that it refuses writes: it is full"
    DOWN = "the backend could not be reached"
    FAILED = "this request failed; the backend is not known to be down"


class NotFoundError(TransferError):
    """The backend answered that the object is not there (a 404, ``NoSuchKey``,
    ``NoSuchUpload``, a missing value): a miss."""


class Backend:
    """Availability of one backend and the translation of its exceptions (module docstring).

    Args:
        tier: the tier's name (log lines).
        kind: the tier type, first word of every message (``"s3"``, ``"valkey"``).
        noun: what the backend is (``"endpoint"``, ``"server"``).
        where: the backend in messages, without credentials (an endpoint URL).
        meanings: backend exception type → :class:`Meaning`, first match wins.
        code: the short code of an exception for messages; default its type's name.
        not_found: whether an ``ANSWERED`` exception says the object is not there.
        retry_s: seconds a down or full backend is left alone.
    """

    def __init__(
        self,
        tier: str,
        kind: str,
        noun: str,
        where: str,
        meanings: Sequence[tuple[type[BaseException], Meaning]],
        retry_s: float,
        code: Callable[[BaseException], str] = lambda exc: type(exc).__name__,
        not_found: Callable[[BaseException], bool] = lambda exc: False,
    ) -> None:
        self.tier = tier
        self.kind = kind
        self.noun = noun
        self.where = where
        self.meanings = tuple(meanings)
        self.retry_s = retry_s
        self.code = code
        self.not_found = not_found
        self._down_until = 0.0
        self._full_until = 0.0
        self._full_warned = False  # in an episode of refused writes (warned once)
        self._answered = False  # ever: one never reached fails the tier's start, not degrades

    def available(self) -> bool:
        """False while the backend is marked down (send nothing)."""
        return time.monotonic() >= self._down_until

    def check_available(self) -> None:
        """Raises :class:`TierUnavailableError` while the backend is marked down."""
        if not self.available():
            raise TierUnavailableError(f"{self.kind} {self.noun} {self.where} is down")

    def refusing_writes(self) -> str | None:
        """``"down"`` or ``"full"`` while stores must be dropped without a request, else None
        (after a full window, the first call logs that stores are tried again)."""
        now = time.monotonic()
        if now < self._down_until:
            return "down"
        if now < self._full_until:
            return "full"
        if self._full_until:
            log.info("%s tier %s: trying stores on %s again", self.kind, self.tier, self.where)
            self._full_until = 0.0
        return None

    @contextlib.contextmanager
    def translate(self, op: str) -> Iterator[None]:
        """Run one request ``op`` (e.g. ``"get_object"``, ``"SET"``) of the backend.

        Raises:
            TierUnavailableError: ``DOWN``: the backend was found unreachable now.
            NotFoundError: ``ANSWERED`` that the object is not there.
            TransferError: another exception of the table.
        """
        try:
            yield
        except Exception as exc:
            meaning = next((m for kind, m in self.meanings if isinstance(exc, kind)), None)
            if meaning is None:
                raise
            code = self.code(exc)
            if meaning is Meaning.DOWN:
                self._mark_down()
                raise TierUnavailableError(
                    f"{self.kind} {op}: {self.noun} {self.where} unreachable ({code})"
                ) from exc
            if meaning is not Meaning.FAILED:
                self._mark_up()
            if meaning is Meaning.FULL:
                self._mark_full()
                raise TransferError(
                    f"{self.kind} {op}: {self.noun} {self.where} is full ({code})", reported=True
                ) from exc
            if meaning is Meaning.ANSWERED and self.not_found(exc):
                raise NotFoundError(f"{self.kind} {op}: {code}") from exc
            raise TransferError(f"{self.kind} {op} failed ({code})") from exc
        self._mark_up()

    def _mark_down(self) -> None:
        if not self._down_until and self._answered:
            log.warning(
                "%s tier %s: %s %s unreachable; lookups miss and stores are dropped until it "
                "answers",
                self.kind,
                self.tier,
                self.noun,
                self.where,
            )
        self._down_until = time.monotonic() + self.retry_s

    def _mark_up(self) -> None:
        if self._down_until:
            # A warning only after the "unreachable" one (_mark_down: not before a first answer)
            log.log(
                logging.WARNING if self._answered else logging.INFO,
                "%s tier %s: %s %s answers %s",
                self.kind,
                self.tier,
                self.noun,
                self.where,
                "again" if self._answered else "(its first answer)",
            )
            self._down_until = 0.0
        self._answered = True

    def stored(self) -> None:
        """A store succeeded: an episode of refused writes is over (the next refusal warns)."""
        if self._full_warned:
            log.info(
                "%s tier %s: %s %s takes stores again", self.kind, self.tier, self.noun, self.where
            )
            self._full_warned = False

    def _mark_full(self) -> None:
        if not self._full_warned:
            log.warning(
                "%s tier %s: %s %s is out of memory (it refused a write); stores are dropped "
                "until it takes one again",
                self.kind,
                self.tier,
                self.noun,
                self.where,
            )
            self._full_warned = True
        self._full_until = time.monotonic() + self.retry_s
