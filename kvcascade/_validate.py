"""Type guards for configuration values and arguments: one copy each.

``True`` is an ``int`` in Python, so "an int" always means "an int that is not a bool"
(``io_threads=True`` must be refused, not read as 1).
"""

from __future__ import annotations

import math
import urllib.parse
from collections.abc import Mapping
from typing import Any, TypeGuard

from ._errors import ConfigError


def is_int(value: object) -> TypeGuard[int]:
    """True for an ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    """True for an ``int`` or a ``float`` that is not a ``bool``."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def finite_number(value: object) -> float | None:
    """``value`` as a finite float if it is a JSON number (an int or float, not a bool), else
    None: NaN, infinities, integers beyond a float's range (``10**400``), anything else."""
    if not is_number(value):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def check_int(name: str, value: object, low: int) -> int:
    """``value``, an int ``>= low``.

    Raises:
        ConfigError: another value; the message names ``name`` and the value.
    """
    if not is_int(value) or value < low:
        raise ConfigError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def check_number(name: str, value: object, low: float, *, above: bool = False) -> float:
    """``value``, a finite number ``>= low`` (``> low`` with ``above``), as a float.

    Raises:
        ConfigError: another value (NaN, an infinity, a bool, a string, …); the message names
            ``name`` and the value.
    """
    number = finite_number(value)
    if number is None or number < low or (above and number == low):
        bound = f"> {low:g}" if above else f">= {low:g}"
        raise ConfigError(f"{name} must be a finite number {bound}, got {value!r:.40}")
    return number


def config_int(cfg: Mapping[str, Any], key: str, default: int, what: str) -> int:
    """``cfg[key]`` (``default`` when absent), an int ``>= 1``.

    Raises:
        ConfigError: another value; the message names ``what`` (e.g. ``"fs tier"``), the key
            and the value.
    """
    return check_int(f"{what} {key}", cfg.get(key, default), 1)


def config_seconds(cfg: Mapping[str, Any], key: str, default: float, what: str) -> float:
    """``cfg[key]`` (``default`` when absent), a finite number of seconds ``> 0``, as a float
    (every such key is a deadline: an infinite one is none, and ``10**400`` raised a bare
    ``OverflowError``).

    Raises:
        ConfigError: another value (NaN, an infinity, ``0``, a bool, …); the message names
            ``what``, the key and the value.
    """
    return check_number(f"{what} {key}", cfg.get(key, default), 0, above=True)


def config_name(cfg: Mapping[str, Any], default: str, what: str) -> str:
    """``cfg["name"]`` (``default`` when absent), a tier's name: a non-empty string.

    Raises:
        ConfigError: another value (``""``, None, a number); the message names ``what`` (e.g.
            ``"s3 tier"``) and the value.
    """
    name = cfg.get("name", default)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{what} name must be a non-empty string, got {name!r}")
    return name


def display_url(url: str, what: str) -> str:
    """``url`` without user-info or query (never a credential), for messages and reports.

    Raises:
        ConfigError: ``url`` does not parse (``redis://[::1``) or its port is not a number in
            0–65535 (``redis://host:abc``), naming ``what`` and the URL without what precedes
            an ``@``; ``urllib`` raised a bare ``ValueError`` naming neither.
    """
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"{what} {url.rpartition('@')[2]!r} is not a valid URL ({exc})") from None
    host = parts.hostname or ""
    if port is not None:
        host = f"{host}:{port}"
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, "", ""))


def http_endpoint(url: str, what: str) -> str:
    """:func:`display_url` of an ``http://`` or ``https://`` endpoint with a host:
    ``http(s)://HOST[:PORT]``, a trailing ``/`` allowed, nothing else.

    Raises:
        ConfigError: as :func:`display_url`; another scheme or no host (``127.0.0.1:9000``:
            botocore's bare ``ValueError: Invalid endpoint``); user-info (``user:pw@``:
            credentials are ``access_key`` / ``secret_key``; the message shows neither part);
            a path, a query (only its parameter names are shown) or a fragment: none is part
            of an S3 endpoint (the bucket is its own key, a key prefix is ``prefix``), and
            botocore put the bucket after the path (an existing bucket answered ``404``) or
            failed on the query as an unreachable endpoint.
    """
    shown = display_url(url, what)
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{what} must be http:// or https://HOST[:PORT], got {shown!r}")
    if "@" in parts.netloc:
        raise ConfigError(
            f"{what} {shown!r} holds user-info before '@' (left out here): give credentials "
            "as access_key and secret_key, not in the URL"
        )
    extra = ""
    if parts.path not in ("", "/"):
        extra = f"a path ({parts.path!r})"
    elif parts.query:
        names = sorted({name for name, _ in urllib.parse.parse_qsl(parts.query, True)})
        extra = f"a query (parameters {names})"
    elif parts.fragment:
        extra = f"a fragment ({'#' + parts.fragment!r})"
    if extra:
        raise ConfigError(
            f"{what} {shown!r} has {extra}: an S3 endpoint is http(s)://HOST[:PORT] only "
            "(the bucket is its own key, 'bucket'; a key prefix is 'prefix')"
        )
    return shown
