"""Where a block lives in a file or object namespace (spec §4.1, shared by fs and s3).

The namespace directory is ``<root>/<model>_<digest12>_r<rank>`` where ``digest12`` is the first 12
hex digits of SHA-256 over the identity fields serialised as JSON with sorted keys and compact
separators. A block of key ``(hash, group)`` lives at
``<namespace>/<hhh>/<hh>_g<group>/<hex>.bin`` with ``hex`` the lowercase hex of the block hash.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from .._errors import ConfigError
from .._keys import split_offload_key

FORMAT_VERSION = 1


class FileMapper:
    """Maps offload keys to relative paths inside one namespace.

    Args:
        identity: the identity fields (model, dtype, block geometry, parallelism, salt, …); any
            JSON-serialisable dict. Two configurations share files iff their identities are equal.
        rank: the worker rank written after the digest (``_r<rank>``).

    Raises:
        ConfigError: ``identity`` is not JSON-serialisable or has no ``model_name``.
    """

    def __init__(self, identity: dict[str, Any], rank: int = 0) -> None:
        if not isinstance(identity.get("model_name"), str) or not identity["model_name"]:
            raise ConfigError(f"namespace identity needs a non-empty model_name: {identity!r}")
        try:
            blob = json.dumps(identity, sort_keys=True, separators=(",", ":"))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"namespace identity is not JSON-serialisable: {exc}") from exc
        self.identity = dict(identity)
        self.digest = hashlib.sha256(blob.encode()).hexdigest()[:12]
        self.rank = rank
        self.base_name = f"{identity['model_name'].replace('/', '_')}_{self.digest}"
        self.namespace = f"{self.base_name}_r{rank}"

    def relative_path(self, key: bytes) -> str:
        """``<namespace>/<hhh>/<hh>_g<group>/<hex>.bin`` for ``key`` (no leading slash)."""
        block_hash, group = split_offload_key(key)
        h = block_hash.hex()
        return f"{self.namespace}/{h[0:3]}/{h[3:5]}_g{group}/{h}.bin"

    def config_relative_path(self) -> str:
        """``<model>_<digest12>/config.json``: a sibling of the ``_r<rank>`` data directory."""
        return f"{self.base_name}/config.json"


def default_identity(
    model_name: str = "kvcascade-replay",
    dtype: str = "int8",
    tokens_per_block: int = 512,
    blocks_per_chunk: int = 1,
    cache_salt: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The identity fields of a single-group, single-rank configuration.

    ``dtype`` must be the resolved dtype (never ``"auto"``).

    Raises:
        ConfigError: ``dtype`` is ``"auto"``.
    """
    if dtype == "auto":
        raise ConfigError("namespace dtype must be resolved, not 'auto'")
    identity: dict[str, Any] = {
        "model_name": model_name,
        "dtype": dtype,
        "tokens_per_hash": tokens_per_block,
        "blocks_per_file": blocks_per_chunk,
        "tp_size": 1,
        "pp_size": 1,
        "pcp_size": 1,
        "dcp_size": 1,
        "kv_cache_groups": [{"tokens_per_block": tokens_per_block, "layer_names": []}],
        "inference_engine": "kvcascade",
        "format_version": FORMAT_VERSION,
    }
    if cache_salt:
        identity["cache_salt"] = cache_salt
    identity.update(extra)
    return identity
