"""The s3 tier's configuration, checked before any tier exists (docs/s3-tier.md, Configuration).

Every key of an s3 ``secondary_tiers`` entry is checked here, with no I/O and no import of
aiobotocore (seconds to import): :class:`~kvcascade.CascadeConfig` calls
:func:`s3_tier_options` when it is built (``kvcascade/tiers/registry.py``,
``check_tier_config``), so a bad value is refused before a tier listed before the s3 tier (an
fs tier) has created its directories; the tier's factory
(:func:`kvcascade.tiers.s3.s3_tier_from_config`) builds the tier from what it returns. A bucket
name outside S3's rule used to reach the endpoint, which answered ``400`` or, for some names,
``404`` (as a bucket that does not exist), only at start-up.
"""

from __future__ import annotations

import re
from typing import Any

from .._errors import ConfigError
from .._validate import check_number, config_int, config_name, config_seconds, http_endpoint
from ._block_format import SECRET_KEYS, check_secret_config, file_size
from .base import PROBE_TIMEOUT_S

BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
"""A bucket name S3 accepts: 3–63 lowercase letters, digits, dots and hyphens, starting and
ending with a letter or a digit (AWS's "General purpose bucket naming rules")."""
BUCKET_RULE = "3-63 lowercase letters, digits, dots or hyphens, starting and ending alphanumeric"


def check_bucket_name(bucket: object) -> str:
    """``bucket`` when it is a bucket name S3 accepts (:data:`BUCKET_NAME`).

    Raises:
        ConfigError: ``bucket`` is not a string, or breaks the rule (the value is named).
    """
    if not isinstance(bucket, str) or not BUCKET_NAME.fullmatch(bucket):
        raise ConfigError(f"s3 tier bucket {bucket!r} is not a valid bucket name ({BUCKET_RULE})")
    return bucket


REGION_NAME = re.compile(r"[a-zA-Z0-9](?:[a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?")
"""A region name botocore accepts (its ``InvalidRegionError`` rule)."""


def check_region(region: object) -> None:
    """Refuse a ``region`` botocore would refuse at client creation with its own
    ``InvalidRegionError`` (not a kvcascade error, escaping ``open_cascade``).

    Raises:
        ConfigError: ``region`` is not None and not a region name (the value is named).
    """
    if region is not None and not (isinstance(region, str) and REGION_NAME.fullmatch(region)):
        raise ConfigError(f"s3 tier region {region!r} is not a region name (e.g. us-east-1)")


CREDENTIAL_KEYS = ("access_key", "secret_key", "session_token")
"""The keys of explicit credentials (never shown in a message)."""
CONFIG_KEYS = frozenset(
    {
        "bucket",
        "endpoint_url",
        "region",
        "prefix",
        *CREDENTIAL_KEYS,
        "addressing_style",
        "max_concurrency",
        "connect_timeout_s",
        "read_timeout_s",
        "max_attempts",
        "multipart_threshold_bytes",
        "max_bytes",
        "orphan_upload_age_s",
        "cache_salt",
        "name",
        "io_timeout_s",
        "max_queued_jobs",
        *SECRET_KEYS,
        "probe_timeout_s",
    }
)
"""The keys of an s3 ``secondary_tiers`` entry (``type`` removed)."""
_WHAT = "s3 tier"


def s3_tier_options(cfg: dict[str, Any], block_bytes: int) -> dict[str, Any]:
    """The checked values of an s3 ``secondary_tiers`` entry (``type`` removed) as the keyword
    arguments of :class:`kvcascade.tiers.s3.S3Tier` other than ``credentials`` and ``auth``
    (the factory makes those: the credentials from ``access_key`` / ``secret_key`` /
    ``session_token``, the block secret by reading ``auth_secret_env`` or
    ``auth_secret_file``); defaults filled in (docs/s3-tier.md, Configuration).

    Args:
        cfg: the entry's keys.
        block_bytes: the primary tier's block size (bytes), for ``max_bytes``.

    Raises:
        ConfigError: naming the key and the value (never a credential's): an unknown key,
            a missing ``bucket`` or one outside S3's rule (:func:`check_bucket_name`), a
            ``region`` botocore refuses (:func:`check_region`), an ``endpoint_url`` that is no
            ``http(s)://HOST[:PORT]`` (:func:`kvcascade._validate.http_endpoint`), a value of
            the wrong type or range (counts ``>= 1``, seconds finite and ``> 0``,
            ``orphan_upload_age_s`` finite and ``>= 0``, ``name`` non-empty), only one of
            ``access_key`` / ``secret_key``, both secret keys, or a ``max_bytes`` below one
            block object (every store to the tier failed).
    """
    unknown = sorted(set(cfg) - CONFIG_KEYS)
    if unknown:
        raise ConfigError(f"unknown {_WHAT} keys {unknown}; known: {sorted(CONFIG_KEYS)}")
    for key in (
        "bucket",
        "endpoint_url",
        "region",
        "prefix",
        "addressing_style",
        "cache_salt",
        *CREDENTIAL_KEYS,
    ):
        if cfg.get(key) is not None and not isinstance(cfg[key], str):
            shown = "a secret" if key in CREDENTIAL_KEYS else repr(cfg[key])
            raise ConfigError(f"{_WHAT} {key} must be a string, got {shown}")
    if cfg.get("bucket") is None:
        raise ConfigError(f"{_WHAT} needs 'bucket' (the bucket name)")
    check_bucket_name(cfg["bucket"])
    check_region(cfg.get("region"))
    if cfg.get("endpoint_url") is not None:
        http_endpoint(cfg["endpoint_url"], f"{_WHAT} endpoint_url")
    style = cfg.get("addressing_style") or "auto"
    if style not in ("auto", "path", "virtual"):
        raise ConfigError(f"s3 addressing_style must be auto, path or virtual, not {style!r}")
    if bool(cfg.get("access_key")) != bool(cfg.get("secret_key")):
        raise ConfigError(f"{_WHAT} needs both access_key and secret_key, or neither")
    check_secret_config(cfg, _WHAT)
    name = config_name(cfg, "s3", _WHAT)

    def integer(key: str, default: int) -> int:
        return config_int(cfg, key, default, _WHAT)

    def seconds(key: str, default: float) -> float:
        return config_seconds(cfg, key, default, _WHAT)

    max_bytes = integer("max_bytes", 0) if cfg.get("max_bytes") is not None else None
    size = file_size(block_bytes)
    if max_bytes is not None and max_bytes < size:
        raise ConfigError(
            f"{_WHAT} max_bytes={max_bytes} cannot hold one block object ({size} B for "
            f"{block_bytes} B blocks)"
        )
    age = check_number(f"{_WHAT} orphan_upload_age_s", cfg.get("orphan_upload_age_s", 3600.0), 0)
    return {
        "bucket": cfg["bucket"],
        "endpoint_url": cfg.get("endpoint_url"),
        "region": cfg.get("region"),
        "prefix": cfg.get("prefix") or "",
        "addressing_style": style,
        "max_concurrency": integer("max_concurrency", 16),
        "connect_timeout_s": seconds("connect_timeout_s", 5.0),
        "read_timeout_s": seconds("read_timeout_s", 30.0),
        "max_attempts": integer("max_attempts", 3),
        "multipart_threshold_bytes": integer("multipart_threshold_bytes", 8 * 1024 * 1024),
        "max_bytes": max_bytes,
        "orphan_upload_age_s": age,
        "name": name,
        "io_timeout_s": seconds("io_timeout_s", 30.0),
        "max_queued_jobs": integer("max_queued_jobs", 1024),
        "probe_timeout_s": seconds("probe_timeout_s", PROBE_TIMEOUT_S),
    }
