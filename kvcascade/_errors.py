"""kvcascade's exception tree.

::

    KVCascadeError
    ├── ConfigError (also ValueError)      bad configuration value or unknown key
    ├── TraceError  (also ValueError)      missing or malformed trace file
    ├── CorruptBlockError                  a stored block failed its checksum or length check
    ├── TierUnavailableError               a tier is not running or its backing store is unreachable
    ├── DeadlineExceededError (also TimeoutError)  a job, call or wait passed its deadline
    ├── InsufficientSpaceError (also RuntimeError)  no room for the shared primary-tier region
    ├── BlockUnavailableError (also KeyError)  prepare_load of a key no longer readable
    └── TransferError                      a transfer job failed; carries the keys that did succeed

Expected outcomes (a miss, a block no longer available) are typed results, not exceptions.
"""

from __future__ import annotations

from collections.abc import Sequence


class KVCascadeError(Exception):
    """Base class of every error raised by kvcascade."""


class ConfigError(KVCascadeError, ValueError):
    """A configuration value is missing, of the wrong type or out of range."""


class TraceError(KVCascadeError, ValueError):
    """A trace file is missing or malformed."""


class CorruptBlockError(KVCascadeError):
    """A stored block failed its integrity check (checksum, length or header)."""


class TierUnavailableError(KVCascadeError):
    """The tier (or the cascade holding it) cannot serve at all: it is not running (not started
    yet, or closed) or its backing store cannot be reached (an S3 endpoint or a valkey server
    that does not answer). Never a per-block outcome: a block that is missing, corrupt or being
    evicted fails its job with :class:`TransferError`."""


class DeadlineExceededError(KVCascadeError, TimeoutError):
    """kvcascade's own timeout: a tier's job or call passed its deadline (``io_timeout_s``
    seconds after submission, in its queue or on a worker: ``kvcascade/tiers/_pool.py``), or a
    wait of the shared region for its creator did (``wait_timeout_s``,
    ``kvcascade/tiers/shm.py``).

    Attributes:
        rows_in_use: the call was still running inside its access to the primary rows (or, for a
            coroutine call, had not unwound yet) when it was given up: those rows stay out of
            use until it returns (the job's ``abandoned`` result).
    """

    def __init__(self, message: str, rows_in_use: bool = False) -> None:
        super().__init__(message)
        self.rows_in_use = rows_in_use


class InsufficientSpaceError(KVCascadeError, RuntimeError):
    """The file system of the shared primary-tier region (``kvcascade/tiers/shm.py``) has less
    free space than the region needs; the message names requested bytes, available bytes and
    the path."""


class BlockUnavailableError(KVCascadeError, KeyError):
    """``prepare_load`` of keys that are no longer readable (evicted since the lookup, or never
    found). Nothing was pinned.

    Attributes:
        keys: the unavailable keys.
    """

    def __init__(self, keys: Sequence[bytes]) -> None:
        super().__init__(f"{len(keys)} keys are no longer available: {list(keys)[:4]!r}")
        self.keys = list(keys)


class TransferError(KVCascadeError):
    """A transfer job failed.

    Attributes:
        succeeded: the keys of the job that were transferred before the failure.
        transferred_bytes: bytes actually moved before the failure, when the tier knows them
            (a store hit moves none); None: ``len(succeeded)`` blocks.
        reported: the tier has warned about the cause already (a full disk or server: one
            warning per episode), so the job's failure is not warned about again.
    """

    def __init__(
        self,
        message: str,
        succeeded: Sequence[bytes] = (),
        transferred_bytes: int | None = None,
        reported: bool = False,
    ) -> None:
        super().__init__(message)
        self.succeeded = list(succeeded)
        self.transferred_bytes = transferred_bytes
        self.reported = reported
