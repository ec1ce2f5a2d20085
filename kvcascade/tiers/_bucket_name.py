"""S3's naming rule for buckets, checked before any request (docs/s3-tier.md, Configuration).

A bucket name outside the rule used to reach the endpoint, which answered ``400`` or, for some
names, ``404`` (as a bucket that does not exist), only at start-up. Checked here, with no import
of aiobotocore (seconds to import), so that :class:`~kvcascade.CascadeConfig` refuses such a
name when it is built (``kvcascade/tiers/registry.py``, ``check_tier_config``) and the s3 tier
when it is constructed.
"""

from __future__ import annotations

import re
from typing import Any

from .._errors import ConfigError
from .._validate import http_endpoint, is_int
from ._block_format import file_size

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


def check_s3_bucket_config(cfg: dict[str, Any], block_bytes: int) -> None:
    """The check of an s3 ``secondary_tiers`` entry at :class:`~kvcascade.CascadeConfig`
    construction, before any tier exists (an fs tier before it would have created its
    directories): its ``bucket``, ``region``, ``endpoint_url`` and a ``max_bytes`` below one
    block object, when given (a missing bucket and the other keys are refused by the tier's
    factory).

    Raises:
        ConfigError: see :func:`check_bucket_name` and
            :func:`kvcascade._validate.http_endpoint`; ``max_bytes`` (an int) cannot hold one
            block object, which made every store to the tier fail.
    """
    if cfg.get("bucket") is not None:
        check_bucket_name(cfg["bucket"])
    check_region(cfg.get("region"))
    if isinstance(cfg.get("endpoint_url"), str):
        http_endpoint(cfg["endpoint_url"], "s3 tier endpoint_url")
    limit, size = cfg.get("max_bytes"), file_size(block_bytes)
    if is_int(limit) and 0 < limit < size:
        raise ConfigError(
            f"s3 tier max_bytes={limit} cannot hold one block object ({size} B for "
            f"{block_bytes} B blocks)"
        )
