"""KVCascadeConnector inside a real vLLM engine (CPU backend, in-process, tiny random Llama).

Skipped when vLLM is not importable (the main environment has none). CI runs it from the vLLM
virtualenv: ``/work/vllm-venv/bin/python -m pytest tests/test_vllm_e2e.py -q -p no:cacheprovider``.
The model is written with ``transformers.LlamaConfig`` into a temporary directory and loaded
with dummy (random) weights: no network access.
"""

from __future__ import annotations

import gc
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
with warnings.catch_warnings():  # vLLM's and torch's import-time deprecations are not ours
    warnings.simplefilter("ignore")
    vllm = pytest.importorskip("vllm", reason="vLLM is not installed in this environment")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvcascade.integrations import vllm as kcv

# vLLM's own warnings are not this project's to fix.
pytestmark = pytest.mark.filterwarnings("default")

PROMPT = [(i * 7) % 997 + 1 for i in range(100)]  # 3 full blocks of 32 tokens + 4
OTHER = [(i * 13) % 991 + 3 for i in range(70)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        max_position_embeddings=512,
    ).save_pretrained(path)
    return path


def make_llm(model_dir: Path, kv_transfer_config: dict[str, Any] | None = None) -> LLM:
    return LLM(
        model=str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=32,
        dtype="bfloat16",
        kv_cache_memory_bytes=64 << 20,
        seed=0,
        max_model_len=512,
        distributed_executor_backend="uni",
        enable_prefix_caching=False,
        kv_transfer_config=kv_transfer_config,
    )


def generate(llm: LLM, prompt: list[int]) -> tuple[list[int], int]:
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], GREEDY, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)


@pytest.fixture(scope="module")
def baseline(model_dir: Path) -> dict[str, list[int]]:
    llm = make_llm(model_dir)
    tokens = {"prompt": generate(llm, PROMPT)[0], "other": generate(llm, OTHER)[0]}
    del llm
    gc.collect()
    return tokens


@pytest.fixture(scope="module")
def offload_llm(
    model_dir: Path, baseline: dict[str, list[int]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LLM]:
    fs_root = tmp_path_factory.mktemp("fs-tier")
    config = {
        "kv_connector": "KVCascadeConnector",
        "kv_connector_module_path": "kvcascade.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": 4 << 20,
            "secondary_tiers": [{"type": "fs", "root_dir": str(fs_root)}],
        },
    }
    llm = make_llm(model_dir, config)
    yield llm
    del llm
    gc.collect()


def scheduler_connector(llm: LLM) -> kcv.KVCascadeConnector:
    connector = llm.llm_engine.engine_core.engine_core.scheduler.get_kv_connector()
    assert isinstance(connector, kcv.KVCascadeConnector)
    return connector


def worker_connector() -> kcv.KVCascadeConnector:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group()
    assert isinstance(connector, kcv.KVCascadeConnector)
    return connector


def tier_hits(connector: kcv.KVCascadeConnector) -> dict[str, float]:
    stats = connector.call_on_loop(connector.coordinator.get_stats)
    return {k: v for k, v in stats.items() if k.startswith("kvcascade_block_hits_total")}


def test_tokens_equal_and_cpu_reload(
    offload_llm: LLM, baseline: dict[str, list[int]], capsys: pytest.CaptureFixture[str]
) -> None:
    """(a) tokens with the connector equal those without; (b) with GPU prefix caching off, the
    repeated prompt loads 96 tokens (3 blocks) from the CPU tier and yields the same tokens."""
    first, cached_first = generate(offload_llm, PROMPT)
    assert first == baseline["prompt"]
    assert cached_first == 0
    again, cached = generate(offload_llm, PROMPT)
    assert cached == 96
    assert again == baseline["prompt"]
    stats = scheduler_connector(offload_llm).transfer_stats()
    assert stats["loaded_chunks"] == 3 and stats["load_bytes"] > 0
    with capsys.disabled():
        print(
            f"\nwithout offload: {baseline['prompt']}\nwith offload:    {again} "
            f"(num_cached_tokens={cached})"
        )


def test_blocks_come_back_from_fs_after_cpu_reset(
    offload_llm: LLM, baseline: dict[str, list[int]]
) -> None:
    """(c) after the CPU tier is reset, the blocks are promoted from the fs tier: same tokens."""
    connector = scheduler_connector(offload_llm)
    generate(offload_llm, PROMPT)  # make sure the fs cascade of the prompt's chunks finished
    assert offload_llm.reset_prefix_cache(reset_connector=True)
    fs_before = tier_hits(connector).get("kvcascade_block_hits_total:1:fs", 0.0)
    tokens, cached = generate(offload_llm, PROMPT)
    assert cached == 96
    assert tokens == baseline["prompt"]
    assert tier_hits(connector)["kvcascade_block_hits_total:1:fs"] >= fs_before + 3


def test_failed_load_is_recomputed(offload_llm: LLM, baseline: dict[str, list[int]]) -> None:
    """A transfer failure never raises out of a hook: the failed load is reported through
    ``failed_recving`` and vLLM recomputes the request, with the same tokens."""
    worker = worker_connector()._worker
    original = worker._copy

    def broken(spec: Any, store: bool, ready: Any) -> Any:
        if not store:
            raise RuntimeError("injected load failure")
        return original(spec, store, ready)

    worker._copy = broken  # type: ignore[method-assign]
    try:
        generate(offload_llm, OTHER)
        tokens, _ = generate(offload_llm, OTHER)
    finally:
        worker._copy = original  # type: ignore[method-assign]
    assert tokens == baseline["other"]
    assert scheduler_connector(offload_llm).transfer_stats()["failed_loads"] >= 1


def test_overwritten_kv_changes_tokens(offload_llm: LLM, baseline: dict[str, list[int]]) -> None:
    """(d) the loaded KV is really used: overwrite the stored bytes, and the tokens change."""
    import torch

    tokens, cached = generate(offload_llm, PROMPT)
    assert cached == 96 and tokens == baseline["prompt"]
    region = scheduler_connector(offload_llm)._sched_side.region  # type: ignore[union-attr]
    view = region.tensor()
    view.copy_(torch.randint(-100, 100, view.shape, dtype=torch.int8))
    corrupted, cached = generate(offload_llm, PROMPT)
    assert cached == 96
    assert corrupted != baseline["prompt"]


def test_worker_metadata_aggregates_across_workers() -> None:
    """§9.14 348–351: counts summed per job id, disjoint ids united, three workers, failures
    united and transfer totals summed."""
    meta = kcv.KVCascadeWorkerMetadata
    a = meta({42: 1, 7: 1}, {9}, load_bytes=10, store_bytes=1, load_seconds=0.5)
    b = meta({42: 1, 7: 1, 5: 1}, set(), load_bytes=20, store_bytes=2, store_seconds=0.25)
    c = meta({5: 1}, {8}, load_bytes=0, store_bytes=3)
    total = a.aggregate(b).aggregate(c)
    assert total.completed == {42: 2, 7: 2, 5: 2}
    assert total.failed == {8, 9}
    assert (total.load_bytes, total.store_bytes) == (30, 6)
    assert (total.load_seconds, total.store_seconds) == (0.5, 0.25)
    assert a.completed == {42: 1, 7: 1}  # inputs untouched


def test_unsupported_vllm_version_is_a_clear_error() -> None:
    """The adapter refuses vLLM outside the supported range, naming it."""
    kcv.check_vllm_version("0.32.0")
    kcv.check_vllm_version("0.32.5.dev3")
    for version in ("0.31.9", "0.33.0"):
        with pytest.raises(RuntimeError, match=r"vllm>=0\.32,<0\.33"):
            kcv.check_vllm_version(version)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"cpu_bytes_to_use": 4 << 20, "blocks_per_chunk": 0}, "greater than 0"),
        (
            {"cpu_bytes_to_use": 4 << 20, "block_size": 64, "blocks_per_chunk": 2},
            "Specify only one",
        ),
        ({"blocks_per_chunk": 1}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": 4 << 20, "secondary_tiers": {"type": "fs"}}, "must be a list"),
    ],
)
def test_engine_refuses_bad_connector_config(
    model_dir: Path, extra: dict[str, Any], message: str
) -> None:
    """§9.15 / §1.9: the connector validates kv_connector_extra_config with vLLM's rules and the
    engine fails to start with the rule's message."""
    config = {
        "kv_connector": "KVCascadeConnector",
        "kv_connector_module_path": "kvcascade.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
    with pytest.raises(Exception, match=message):
        make_llm(model_dir, config)
    gc.collect()
