"""The namespace of kvcascade's persistent tiers under vLLM: built from the engine's own
configuration (issue #15 part 1; ``docs/vllm.md`` "Namespaces").

The vLLM configurations are real ones (``EngineArgs.create_engine_config`` over a tiny Llama
config on disk, no weights, no engine start) and the identity is the one the connector's
``_setup`` derives. The salt rule of :class:`~kvcascade.tiers._file_mapper.FileMapper` needs no
vLLM and runs everywhere.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

from kvcascade.tiers._file_mapper import FileMapper, default_identity


def test_tier_salt_refines_the_top_level_salt() -> None:
    """Tenants A and B whose fs tiers carry the same ``cache_salt`` keep apart: a tier's salt
    is folded in next to the top-level one (it replaced it, so both tenants shared one
    namespace)."""
    a = FileMapper(default_identity("org/m", "bfloat16", 16, cache_salt="tenant-A"))
    b = FileMapper(default_identity("org/m", "bfloat16", 16, cache_salt="tenant-B"))
    assert a.with_salt("ssd").namespace != b.with_salt("ssd").namespace
    assert a.with_salt("ssd").identity["cache_salt"] == ["tenant-A", "ssd"]
    assert a.with_salt("ssd").namespace != a.namespace
    unsalted = FileMapper(default_identity("org/m", "bfloat16", 16))
    assert unsalted.with_salt("ssd").identity["cache_salt"] == "ssd"


try:
    with warnings.catch_warnings():  # vLLM's and torch's import-time deprecations are not ours
        warnings.simplefilter("ignore")
        import transformers  # noqa: F401 - write_tiny_llama needs it
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
        from vllm_offline import write_tiny_llama

        from kvcascade.integrations import vllm as kcv
except ImportError:  # the main environment has no vLLM: only the salt rule runs there
    kcv = None

needs_vllm = pytest.mark.skipif(kcv is None, reason="vLLM is not installed in this environment")

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    write_tiny_llama(str(path))
    return path


def namespace(
    model_dir: Path, layout: str = "LBHNC", extra: dict[str, Any] | None = None, **args: Any
) -> FileMapper:
    """The fs namespace the connector's ``_setup`` derives for an engine with these args."""
    engine = {
        "model": str(model_dir),
        "skip_tokenizer_init": True,
        "load_format": "dummy",
        "max_model_len": 512,
        "block_size": 32,
        "dtype": "bfloat16",
        **args,
    }
    engine["kv_transfer_config"] = {
        "kv_connector": "KVCascadeConnector",
        "kv_connector_module_path": "kvcascade.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 4 << 20, **(extra or {})},
    }
    config = EngineArgs(**engine).create_engine_config()
    config.cache_config.kv_cache_layout = layout  # what the engine core resolves
    spec = FullAttentionSpec(
        block_size=32, num_kv_heads=2, head_size=32, dtype=config.model_config.dtype
    )
    kv_cache_config = get_kv_cache_config_from_groups(
        config, [KVCacheGroupSpec(LAYERS, spec)], spec.page_size_bytes * 2 * 16
    )
    return FileMapper(kcv._setup(config, kv_cache_config).identity)


@needs_vllm
def test_same_engine_config_same_namespace(model_dir: Path) -> None:
    """Two engines built from the same arguments share one namespace (hits across restarts
    and instances), and it records what the engine runs."""
    first, second = namespace(model_dir), namespace(model_dir)
    assert first.namespace == second.namespace
    identity = first.identity
    assert identity["model"] == str(model_dir) and identity["model_dtype"] == "bfloat16"
    assert identity["dtype"] == "bfloat16" and identity["kv_cache_dtype"] == "auto"
    assert identity["kv_layout"] == "LBHNC" and identity["blocks_per_file"] == 1
    assert identity["rope"] == {"rope_theta": 10000.0, "rope_type": "default"}
    assert identity["max_position_embeddings"] == 512
    assert identity["kv_cache_groups"] == [{"tokens_per_block": 32, "layer_names": LAYERS}]
    assert (identity["tp_size"], identity["pp_size"], identity["world_size"]) == (1, 1, 1)
    assert "cache_salt" not in identity


@needs_vllm
@pytest.mark.parametrize(
    ("change", "args"),
    [
        ("dtype", {"dtype": "float16"}),
        (
            "rope",
            {"hf_overrides": {"rope_parameters": {"rope_theta": 2e4, "rope_type": "default"}}},
        ),
        ("max position", {"hf_overrides": {"max_position_embeddings": 1024}}),
        ("layout", {"layout": "LBNHC"}),
        ("blocks_per_chunk", {"extra": {"blocks_per_chunk": 2}}),
        ("top-level cache_salt", {"extra": {"cache_salt": "tenant-B"}}),
        ("model_name", {"extra": {"model_name": "other"}}),
    ],
)
def test_a_changed_field_is_another_namespace(
    model_dir: Path, change: str, args: dict[str, Any]
) -> None:
    """Every field that changes the KV bytes (or the tenant) gives another namespace: the
    tiers never serve one engine's KV to the other. (The connector recorded none of these but
    dtype and blocks_per_chunk, and ``kv_layout="NHD"`` whatever vLLM registered.)"""
    assert namespace(model_dir, **args).namespace != namespace(model_dir).namespace, change


@needs_vllm
@pytest.mark.parametrize("key", ["cpu_blocks", "gpu_blocks", "block_bytes"])
def test_a_key_the_engine_sets_itself_is_refused(model_dir: Path, key: str) -> None:
    """``cpu_blocks: 100000`` next to ``cpu_bytes_to_use`` was replaced by the slots
    ``cpu_bytes_to_use`` gives, without a word (user trial)."""
    with pytest.raises(kcv.ConfigError) as err:
        namespace(model_dir, extra={key: 100000})
    assert str(err.value) == (
        f"kv_connector_extra_config keys ['{key}'] are derived by the connector from the "
        "engine (the CPU tier's size from cpu_bytes_to_use, the block from the KV cache "
        "geometry); remove them"
    )
