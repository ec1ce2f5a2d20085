"""Where a block lives in a file or object namespace (vLLM's ``kv_offload/file_mapper.py``).

Same contract as vLLM's ``FileMapper``: the namespace directory is
``<root>/<model>_<digest12>_r<rank>`` where ``<model>`` is the model name with ``/`` replaced by
``_`` and ``digest12`` is the first 12 hex digits of SHA-256 over the identity fields serialised
as JSON with sorted keys and compact separators (``","`` and ``":"``). A block of key
``(hash, group)`` lives at ``<namespace>/<hhh>/<hh>_g<group>/<hex>.bin`` with ``hex`` the
lowercase hex of the block-hash bytes; ``config.json`` (the identity, pretty-printed) lives in
``<root>/<model>_<digest12>/``, a sibling of the data directory. The rank is outside the digest.

The identity holds vLLM's fields (``model_name``, ``dtype``, ``tokens_per_hash``,
``blocks_per_file``, ``tp_size``/``pp_size``/``pcp_size``/``dcp_size``, ``kv_cache_groups``,
``inference_engine`` and the conditional ``parallel_agnostic``/``replicated_layout``/
``canonical_format``) plus kvcascade's: ``kv_layout``, ``format_version`` (the on-disk block
format), ``model_revision`` and ``cache_salt`` when given; the vLLM connector adds the engine's
own configuration (``docs/vllm.md`` "Namespaces"). ``inference_engine`` is
``"kvcascade"`` and ``format_version`` is always present, so a kvcascade namespace never
collides with a vLLM one (vLLM files carry no header; the two must not read each other's files).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from .._errors import ConfigError
from .._keys import split_offload_key
from ._block_format import FORMAT_VERSION

#: The most bytes (UTF-8, ``/`` counted as the ``_`` it becomes) of a model name: the namespace
#: directory ``<model_name>_<digest12>_r<rank>`` must fit a file name (255 bytes on Linux).
MAX_MODEL_NAME_BYTES = 200


def check_model_name(name: object) -> str:
    """``name`` if it can name a namespace directory.

    Raises:
        ConfigError: ``name`` is not a non-empty string, holds a NUL character or text that is
            not valid Unicode, or is longer than :data:`MAX_MODEL_NAME_BYTES` in UTF-8.
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"model_name must be a non-empty string, got {name!r}")
    if "\0" in name:
        raise ConfigError(f"model_name {name!r} holds a NUL character, which no file name may")
    try:
        size = len(name.encode())
    except UnicodeEncodeError:
        raise ConfigError(f"model_name {name!r} is not valid Unicode text") from None
    if size > MAX_MODEL_NAME_BYTES:
        raise ConfigError(
            f"model_name is {size} bytes in UTF-8, more than {MAX_MODEL_NAME_BYTES}: the "
            f"namespace directory <model_name>_<digest>_r<rank> must fit a 255-byte file name "
            f"(got {name[:60]!r}...)"
        )
    return name


class FileMapper:
    """Maps offload keys to relative paths inside one namespace.

    Args:
        identity: the identity fields (see :func:`default_identity`); any JSON-serialisable dict
            with a non-empty ``model_name``. Two configurations share files iff their identities
            are equal.
        rank: the worker rank written after the digest (``_r<rank>``); 0 whatever is given
            when the identity is parallel-agnostic (it has no ``parallel_agnostic: False``
            field, as vLLM's ``FileMapper``), so every rank shares ``_r0``.

    Raises:
        ConfigError: ``identity`` is not JSON-serialisable, its ``model_name`` cannot name a
            directory (:func:`check_model_name`), or its ``dtype`` is ``"auto"`` (the namespace
            needs the resolved dtype).
    """

    def __init__(self, identity: dict[str, Any], rank: int = 0) -> None:
        check_model_name(identity.get("model_name"))
        if identity.get("dtype") == "auto":
            raise ConfigError("namespace dtype must be resolved, not 'auto'")
        try:
            blob = json.dumps(identity, sort_keys=True, separators=(",", ":"))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"namespace identity is not JSON-serialisable: {exc}") from exc
        self.identity = dict(identity)
        self.digest = hashlib.sha256(blob.encode()).hexdigest()[:12]
        self.rank = rank if identity.get("parallel_agnostic", True) is False else 0
        self.base_name = f"{identity['model_name'].replace('/', '_')}_{self.digest}"
        self.namespace = f"{self.base_name}_r{self.rank}"

    def with_salt(self, cache_salt: str) -> FileMapper:
        """The same namespace with ``cache_salt`` (a tier's tenant salt) folded into the
        identity: ``cache_salt`` becomes ``[top-level salt, tier salt]`` when the identity
        already has a salt (a tier salt refines the top-level one, never replaces it), else
        the tier salt."""
        top = self.identity.get("cache_salt")
        salt: str | list[str] = [top, cache_salt] if top else cache_salt
        return FileMapper({**self.identity, "cache_salt": salt}, self.rank)

    def relative_path(self, key: bytes) -> str:
        """``<namespace>/<hhh>/<hh>_g<group>/<hex>.bin`` for ``key`` (no leading slash)."""
        block_hash, group = split_offload_key(key)
        h = block_hash.hex()
        return f"{self.namespace}/{h[0:3]}/{h[3:5]}_g{group}/{h}.bin"

    def config_relative_path(self) -> str:
        """``<model>_<digest12>/config.json``: a sibling of the ``_r<rank>`` data directory."""
        return f"{self.base_name}/config.json"

    def run_config(self) -> dict[str, Any]:
        """A copy of the identity fields (what ``config.json`` records)."""
        return json.loads(json.dumps(self.identity))


def default_identity(
    model_name: str | None,
    dtype: str = "int8",
    tokens_per_block: int | Sequence[int] = 512,
    *,
    tokens_per_hash: int | None = None,
    blocks_per_chunk: int = 1,
    layer_names: Sequence[Sequence[str]] | None = None,
    tp_size: int = 1,
    pp_size: int = 1,
    pcp_size: int = 1,
    dcp_size: int = 1,
    kv_layout: str = "NHD",
    model_revision: str | None = None,
    cache_salt: str | None = None,
    parallel_agnostic: bool = False,
    config_parallelism_agnostic: bool = False,
    config_replicated: bool = False,
    canonical_layout: bool = False,
    **extra: Any,
) -> dict[str, Any]:
    """The identity fields of a namespace (vLLM's FileMapper fields plus kvcascade's).

    Args:
        model_name: model id (e.g. ``"meta-llama/Llama-3.1-8B"``); None only for a
            configuration without persistent tiers (:class:`FileMapper` refuses it).
        dtype: the resolved KV dtype (never ``"auto"``).
        tokens_per_block: tokens per block, one int for every group or one per KV-cache group.
        tokens_per_hash: tokens covered by one block hash; required when groups differ in
            ``tokens_per_block`` (the caller resolves it), else defaults to ``tokens_per_block``.
        blocks_per_chunk: blocks per offloaded chunk (vLLM's ``blocks_per_file`` for fs).
        layer_names: per group, the layer names (default: empty lists).
        tp_size, pp_size, pcp_size, dcp_size: parallel sizes.
        kv_layout: the KV-cache layout name (e.g. ``"NHD"``, ``"HND"``).
        model_revision: model revision (commit or tag) when known.
        cache_salt: optional tenant salt; different salts never share files.
        parallel_agnostic: the caller opts in to a parallel-agnostic namespace (vLLM's fs and
            obj tiers do); it collapses only when ``config_parallelism_agnostic`` or
            ``config_replicated`` holds.
        config_parallelism_agnostic: the configuration's KV bytes do not depend on tp/pp/pcp/dcp.
        config_replicated: every rank holds the same (replicated) KV layout.
        canonical_layout: the canonical layout is on (adds ``canonical_format``).
        extra: further fields (e.g. ``block_bytes``) recorded as given.

    Raises:
        ConfigError: ``dtype`` is ``"auto"``; groups differ in tokens per block and no
            ``tokens_per_hash`` was given; ``layer_names`` does not match the group count.
    """
    if dtype == "auto":
        raise ConfigError("namespace dtype must be resolved, not 'auto'")
    if isinstance(tokens_per_block, int):
        per_group = [tokens_per_block]
    else:
        per_group = [int(t) for t in tokens_per_block]
    names = [list(n) for n in layer_names] if layer_names is not None else [[] for _ in per_group]
    if len(names) != len(per_group):
        raise ConfigError(f"{len(names)} layer-name lists for {len(per_group)} KV-cache groups")
    if tokens_per_hash is None:
        if len(set(per_group)) != 1:
            raise ConfigError(
                f"groups differ in tokens per block {per_group}: pass the resolved tokens_per_hash"
            )
        tokens_per_hash = per_group[0]
    collapse = parallel_agnostic and (config_parallelism_agnostic or config_replicated)
    identity: dict[str, Any] = {
        "model_name": model_name,
        "tokens_per_hash": tokens_per_hash,
        "blocks_per_file": blocks_per_chunk,
        "tp_size": 1 if collapse else tp_size,
        "pp_size": 1 if collapse else pp_size,
        "pcp_size": 1 if collapse else pcp_size,
        "dcp_size": 1 if collapse else dcp_size,
        "dtype": dtype,
        "kv_cache_groups": [
            {"tokens_per_block": t, "layer_names": n} for t, n in zip(per_group, names, strict=True)
        ],
        "inference_engine": "kvcascade",
        "kv_layout": kv_layout,
        "format_version": FORMAT_VERSION,
    }
    if not collapse:
        identity["parallel_agnostic"] = False
    if parallel_agnostic and config_replicated:
        identity["replicated_layout"] = True
    if canonical_layout:
        identity["canonical_format"] = f"v1-{kv_layout.lower()}"
    if model_revision:
        identity["model_revision"] = model_revision
    if cache_salt:
        identity["cache_salt"] = cache_salt
    identity.update(extra)
    return identity
