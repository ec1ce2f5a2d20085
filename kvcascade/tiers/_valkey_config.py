"""The valkey tier's configuration, checked before any tier exists (docs/valkey-tier.md,
Configuration).

Every key of a valkey ``secondary_tiers`` entry is checked here, with no I/O and no import of
redis-py (an optional extra): :class:`~kvcascade.CascadeConfig` calls
:func:`valkey_tier_options` when it is built (``kvcascade/tiers/registry.py``,
``check_tier_config``), so a bad value is refused before a tier listed before the valkey tier
(an fs tier) has created its directories; the tier's factory
(:func:`kvcascade.tiers.valkey.valkey_tier_from_config`) builds the tier from what it returns.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Callable
from typing import Any

from .._errors import ConfigError
from .._validate import config_int, config_name, config_seconds, display_url
from ._block_format import SECRET_KEYS, check_secret_config
from .base import PROBE_TIMEOUT_S

_SCHEMES = {"redis": "redis", "rediss": "rediss", "valkey": "redis", "valkeys": "rediss"}
"""URL schemes accepted → the scheme the client reads (``unix://`` for one local server)."""


CONFIG_KEYS = frozenset(
    {
        "url",
        "cluster",
        "prefix",
        "username",
        "password",
        "max_concurrency",
        "connect_timeout_s",
        "timeout_s",
        "max_attempts",
        "cache_salt",
        "name",
        "io_timeout_s",
        "max_queued_jobs",
        *SECRET_KEYS,
        "probe_timeout_s",
    }
)
"""The keys of a valkey ``secondary_tiers`` entry (``type`` removed)."""
_WHAT = "valkey tier"


_QUERY_RULES: dict[str, tuple[Callable[[str], bool], str]] = {
    "db": (lambda v: v.isascii() and v.isdigit(), "a database number (0, 1, ...)"),
    "protocol": (lambda v: v in ("2", "3"), "2 or 3 (RESP2 or RESP3)"),
    "ssl_cert_reqs": (
        lambda v: v in ("none", "optional", "required"),
        "none, optional or required",
    ),
    "ssl_check_hostname": (lambda v: v.lower() in ("true", "false"), "true or false"),
    "ssl_ca_certs": (bool, "a file path"),
    "ssl_certfile": (bool, "a file path"),
    "ssl_keyfile": (bool, "a file path"),
}
"""The query parameters of ``url`` the tier passes on (redis-py's ``parse_url``) → a check of
the value and its rule; the ``ssl_`` ones only over TLS (``rediss://``, ``valkeys://``). Any
other reached redis-py as a keyword its connection does not take (a bare ``TypeError`` at
start-up) or was read silently (``?db=abc`` a bare ``ValueError``)."""
_TIER_KEY_OF = {
    "socket_connect_timeout": "connect_timeout_s",
    "socket_timeout": "timeout_s",
    "timeout": "io_timeout_s",
    "max_connections": "max_concurrency",
    "retry_on_timeout": "max_attempts",
    "retry_on_error": "max_attempts",
    "username": "username",
}
"""Query parameters redis-py reads that the tier sets from its own keys (the URL's would win)."""


def _check_query(parts: urllib.parse.SplitResult, shown: str) -> None:
    """Refuse a query parameter or path of ``url`` the client would not take as meant.

    Raises:
        ConfigError: naming the parameter (the value only for a parameter of
            :data:`_QUERY_RULES`): another parameter, one given twice, an ``ssl_`` one without
            TLS, a value outside its rule; a path that is not a database number (redis-py
            ignored ``/abc`` and read ``/1/2`` as 12); a database in both path and query.
    """
    tls = parts.scheme in ("rediss", "valkeys")
    seen: set[str] = set()
    for name, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
        where = f"valkey tier url {shown!r}: query parameter {name!r}"
        if name in _TIER_KEY_OF:
            raise ConfigError(f"{where} is set by the tier's key {_TIER_KEY_OF[name]!r}: use it")
        if name not in _QUERY_RULES:
            accepted = ", ".join(_QUERY_RULES)
            raise ConfigError(f"{where} is not accepted; accepted: {accepted}")
        if name in seen:
            raise ConfigError(f"{where} is given twice")
        seen.add(name)
        if name.startswith("ssl_") and not tls:
            raise ConfigError(f"{where} is a TLS option: only with rediss:// or valkeys://")
        check, rule = _QUERY_RULES[name]
        if not check(value):
            raise ConfigError(f"{where} must be {rule}, got {value!r}")
    if parts.scheme == "unix":
        return
    if not re.fullmatch("(/[0-9]*)?", parts.path):
        raise ConfigError(
            f"valkey tier url {shown!r}: the path must be a database number (/0, /1, ...), "
            f"got {parts.path!r}"
        )
    if parts.path.strip("/") and "db" in seen:
        raise ConfigError(f"valkey tier url {shown!r}: give the database once, path or ?db=")


def client_url(url: str) -> str:
    """``url`` in the scheme the client reads.

    Raises:
        ConfigError: an unknown scheme, no host, a password in the URL (give it as
            ``password``: the URL is copied into replay reports and logs), or a query or path
            the client would not take as meant (:func:`_check_query`).
    """
    if not isinstance(url, str) or not url:
        raise ConfigError(f"valkey tier url must be a non-empty string, got {url!r}")
    shown = display_url(url, "valkey tier url")
    parts = urllib.parse.urlsplit(url)
    if parts.password is not None or "password" in urllib.parse.parse_qs(parts.query):
        raise ConfigError(f"valkey tier url {shown!r} holds a password: give it as 'password'")
    scheme = _SCHEMES.get(parts.scheme)
    if parts.scheme != "unix" and (scheme is None or not parts.hostname):
        raise ConfigError(
            f"valkey tier url must be redis://, rediss://, valkey://, valkeys:// HOST[:PORT] "
            f"or unix://PATH, got {shown!r}"
        )
    _check_query(parts, shown)
    return url if scheme is None else urllib.parse.urlunsplit((scheme, *parts[1:]))


def valkey_tier_options(cfg: dict[str, Any], block_bytes: int) -> dict[str, Any]:
    """The checked values of a valkey ``secondary_tiers`` entry (``type`` removed) as the
    keyword arguments of :class:`kvcascade.tiers.valkey.ValkeyTier` other than ``auth`` (the
    factory reads the block secret of ``auth_secret_env`` or ``auth_secret_file``); defaults
    filled in (docs/valkey-tier.md, Configuration).

    Args:
        cfg: the entry's keys.
        block_bytes: the primary tier's block size (bytes); a value holds any size, so it is
            not checked (every tier's check takes it: ``kvcascade/tiers/registry.py``).

    Raises:
        ConfigError: naming the key and the value (never the password): an unknown key, a
            missing ``url`` or a bad one (:func:`client_url`), a cluster over ``unix://``, a
            value of the wrong type or range (counts ``>= 1``, seconds ``> 0``, ``name``
            non-empty), both secret keys.
    """
    unknown = sorted(set(cfg) - CONFIG_KEYS)
    if unknown:
        raise ConfigError(f"unknown {_WHAT} keys {unknown}; known: {sorted(CONFIG_KEYS)}")
    for key in ("url", "prefix", "username", "password", "cache_salt"):
        if cfg.get(key) is not None and not isinstance(cfg[key], str):
            shown = "a secret" if key == "password" else repr(cfg[key])
            raise ConfigError(f"{_WHAT} {key} must be a string, got {shown}")
    if not cfg.get("url"):
        raise ConfigError(f"{_WHAT} needs 'url' (e.g. redis://127.0.0.1:6379)")
    cluster = cfg.get("cluster", False)
    if not isinstance(cluster, bool):
        raise ConfigError(f"{_WHAT} cluster must be true or false, got {cluster!r}")
    if client_url(cfg["url"]).startswith("unix:") and cluster:
        raise ConfigError("a valkey cluster is reached over TCP, not unix://")
    check_secret_config(cfg, _WHAT)
    name = config_name(cfg, "valkey", _WHAT)

    def integer(key: str, default: int) -> int:
        return config_int(cfg, key, default, _WHAT)

    def seconds(key: str, default: float) -> float:
        return config_seconds(cfg, key, default, _WHAT)

    return {
        "url": cfg["url"],
        "cluster": cluster,
        "prefix": cfg.get("prefix") or "",
        "username": cfg.get("username"),
        "password": cfg.get("password"),
        "max_concurrency": integer("max_concurrency", 16),
        "connect_timeout_s": seconds("connect_timeout_s", 2.0),
        "timeout_s": seconds("timeout_s", 5.0),
        "max_attempts": integer("max_attempts", 3),
        "name": name,
        "io_timeout_s": seconds("io_timeout_s", 30.0),
        "max_queued_jobs": integer("max_queued_jobs", 1024),
        "probe_timeout_s": seconds("probe_timeout_s", PROBE_TIMEOUT_S),
    }
