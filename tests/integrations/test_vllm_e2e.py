"""KVCascadeConnector inside a real vLLM engine (CPU backend, in-process, tiny random Llama).

Skipped when vLLM is not importable (the main environment has none). CI runs it from the vLLM
virtualenv (``.ci/run``:
``$VENV/bin/python -m pytest tests/integrations/test_vllm_e2e.py -q -p no:cacheprovider``).
The model is written with ``transformers.LlamaConfig`` into a temporary directory and loaded
with dummy (random) weights: no network access.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
with warnings.catch_warnings():  # vLLM's and torch's import-time deprecations are not ours
    warnings.simplefilter("ignore")
    vllm = pytest.importorskip("vllm", reason="vLLM is not installed in this environment")
    pytest.importorskip("transformers", reason="transformers is not installed")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm_offline import write_tiny_llama

    import kvcascade
    from kvcascade.integrations import vllm as kcv

# vLLM's own warnings are not this project's to fix.
pytestmark = pytest.mark.filterwarnings("default")

PROMPT = [(i * 7) % 997 + 1 for i in range(100)]  # 3 full blocks of 32 tokens + 4
OTHER = [(i * 13) % 991 + 3 for i in range(70)]
THIRD = [(i * 11) % 983 + 5 for i in range(70)]  # 2 full blocks
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    write_tiny_llama(str(path))
    return path


def make_llm(
    model_dir: Path, kv_transfer_config: dict[str, Any] | None = None, **engine_args: Any
) -> LLM:
    return LLM(
        model=str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=32,
        dtype=engine_args.pop("dtype", "bfloat16"),
        kv_cache_memory_bytes=64 << 20,
        seed=0,
        max_model_len=512,
        distributed_executor_backend="uni",
        enable_prefix_caching=False,
        kv_transfer_config=kv_transfer_config,
        **engine_args,
    )


def fs_config(root: Path | str, **extra: Any) -> dict[str, Any]:
    """A kv_transfer_config for kvcascade with a CPU tier of 4 MiB and an fs tier at ``root``."""
    return {
        "kv_connector": "KVCascadeConnector",
        "kv_connector_module_path": "kvcascade.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": 4 << 20,
            "secondary_tiers": [{"type": "fs", "root_dir": str(root)}],
            **extra,
        },
    }


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
    llm = make_llm(model_dir, fs_config(tmp_path_factory.mktemp("fs-tier")))
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


def test_scheduler_seconds_counts_the_hooks_time(offload_llm: LLM) -> None:
    """``transfer_stats()["scheduler_seconds"]`` grows with each generate (the connector's
    scheduler hooks ran) and stays below that generate's wall time (it is part of it)."""
    connector = scheduler_connector(offload_llm)
    before = connector.transfer_stats()["scheduler_seconds"]
    start = time.perf_counter()
    generate(offload_llm, [(i * 5) % 977 + 2 for i in range(70)])  # a prompt of its own
    wall = time.perf_counter() - start
    spent = connector.transfer_stats()["scheduler_seconds"] - before
    assert 0.0 < spent < wall


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
    """vLLM test_aggregate_sums_counts / test_aggregate_disjoint_jobs /
    test_aggregate_multiple_workers / test_aggregate_transfer_stats
    (``offloading_connector/test_worker_metadata.py``): counts summed per job id, disjoint ids
    united, three workers, failures united and transfer totals summed."""
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


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"cpu_bytes_to_use": 4 << 20, "blocks_per_chunk": 0}, "greater than 0"),
        (
            {"cpu_bytes_to_use": 4 << 20, "block_size": 64, "blocks_per_chunk": 2},
            "Specify only one",
        ),
        ({"blocks_per_chunk": 1}, "cpu_bytes_to_use"),
        # cast before its check: int('abc')'s bare ValueError named no key (a break-it run)
        (
            {"cpu_bytes_to_use": 4 << 20, "store_threshold": "abc"},
            "store_threshold must be an integer, got 'abc'",
        ),
        ({"cpu_bytes_to_use": 4 << 20, "secondary_tiers": {"type": "fs"}}, "must be a list"),
    ],
)
def test_engine_refuses_bad_connector_config(
    model_dir: Path, extra: dict[str, Any], message: str
) -> None:
    """vLLM's ``tests/v1/kv_connector/unit/offloading_connector/test_config.py``
    (``build_offloading_config``): the connector validates kv_connector_extra_config with vLLM's
    rules and the engine fails to start with the rule's message."""
    config = {
        "kv_connector": "KVCascadeConnector",
        "kv_connector_module_path": "kvcascade.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
    with pytest.raises(Exception, match=message):
        make_llm(model_dir, config)
    gc.collect()


def test_engine_takes_an_out_of_tree_policy_class(
    model_dir: Path, baseline: dict[str, list[int]], tmp_path: Path
) -> None:
    """vLLM's ``cache_policy_module_path`` (docs/vllm.md): ``eviction_policy`` names a class of
    that module. The key used to pass the connector's check and be dropped by the config, so
    the engine failed to start ("Unknown cache policy 'LRUCachePolicy'")."""
    from kvcascade.policies.lru import LRUCachePolicy

    config = fs_config(
        tmp_path / "fs",
        eviction_policy="LRUCachePolicy",
        cache_policy_module_path="kvcascade.policies.lru",
    )
    llm = make_llm(model_dir, config)
    try:
        assert type(scheduler_connector(llm).coordinator.primary.policy) is LRUCachePolicy
        assert generate(llm, PROMPT)[0] == baseline["prompt"]
    finally:
        del llm
        gc.collect()


# -- engines in their own processes: restarts, tenants, exit without close (issue #15) ---------
def run_job(job_path: str) -> None:
    """Entry point of an engine process (``python -c``; see :func:`engine_job`): start the
    job's engines one after the other, run each one's ``generate`` calls and write
    ``[[tokens, num_cached_tokens], ...]`` per engine to ``job["out"]`` as it goes. An engine
    with ``"close"`` is deleted (vLLM's engine shutdown); the last one is left open, as an
    offline script leaves it, for the interpreter's exit."""
    job = json.loads(Path(job_path).read_text())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if job["multiprocess"] else "0"
    results: list[list[tuple[list[int], int]]] = []
    llm = None
    for engine in job["engines"]:
        config = fs_config(job["fs_root"], **engine.get("extra", {}))
        llm = make_llm(Path(job["model_dir"]), config, **engine.get("engine_args", {}))
        runs = []
        for prompts in engine["generates"]:
            outs = llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in prompts], GREEDY, use_tqdm=False
            )
            runs += [(list(o.outputs[0].token_ids), int(o.num_cached_tokens or 0)) for o in outs]
        results.append(runs)
        Path(job["out"]).write_text(json.dumps({"engines": results, "kvcascade": kcv.__file__}))
        if engine.get("close"):
            del llm
            gc.collect()


_JOB = "import sys, test_vllm_e2e; test_vllm_e2e.run_job(sys.argv[1])"


def child_pythonpath() -> str:
    """``PYTHONPATH`` of a child process that imports these test modules: this checkout's
    ``kvcascade``, this folder, the examples (``write_tiny_llama``), then the caller's."""
    root = Path(kvcascade.__file__).resolve().parents[1]
    here = Path(__file__).resolve().parent
    paths = [str(root), str(here), str(root / "examples"), os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(p for p in paths if p)


def engine_job(tmp_path: Path, name: str, **job: Any) -> dict[str, Any]:
    """Run :func:`run_job` in a fresh Python process with this checkout's ``kvcascade``; return
    its results and stderr. The process must exit 0."""
    spec = tmp_path / f"{name}.json"
    out = tmp_path / f"{name}.out.json"
    spec.write_text(json.dumps({**job, "out": str(out)}))
    env = {**os.environ, "PYTHONPATH": child_pythonpath()}
    proc = subprocess.run(
        [sys.executable, "-c", _JOB, str(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert (
        Path(result["kvcascade"]).resolve().parents[2]
        == Path(kvcascade.__file__).resolve().parents[1]
    )  # this checkout's package
    return {**result, "stderr": proc.stderr}


def block_files(fs_root: Path) -> dict[str, int]:
    """Block files per namespace, keyed by the namespace's ``cache_salt`` and RoPE theta."""
    counts: dict[str, int] = {}
    for config in fs_root.glob("*/config.json"):
        identity = json.loads(config.read_text())
        label = f"{identity.get('cache_salt')}/{identity['rope'].get('rope_theta')}"
        data = config.parent.with_name(config.parent.name + "_r0")
        counts[label] = len(list(data.rglob("*.bin")))
    return counts


def assert_no_kvcascade_error(stderr: str) -> None:
    """Nothing failed in kvcascade while the process ran or exited."""
    assert "cannot schedule new futures" not in stderr
    bad = [
        line
        for line in stderr.splitlines()
        if line.startswith("Traceback") or ("kvcascade" in line and "failed" in line)
    ]
    assert not bad, bad


@pytest.fixture(scope="module")
def restarts(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two processes on one fs root. First an offline job of tenant A on vLLM's default
    multiprocess engine: one ``generate`` over two prompts, then the script ends without
    closing anything. Then, in a fresh process, in-process engines one after the other:
    tenant B, tenant A with ``rope_theta`` changed through ``hf_overrides``, and tenant A again
    (its first request repeats the first prompt; then a new prompt, and the script ends)."""
    tmp = tmp_path_factory.mktemp("restarts")
    root = tmp / "fs"
    root.mkdir()
    common = {"model_dir": str(model_dir), "fs_root": str(root)}
    a = {"cache_salt": "tenant-A"}
    first = engine_job(
        tmp,
        "offline-a",
        multiprocess=True,
        engines=[{"extra": a, "generates": [[PROMPT, OTHER]]}],
        **common,
    )
    after_first = block_files(root)
    second = engine_job(
        tmp,
        "tenants",
        multiprocess=False,
        engines=[
            {"extra": {"cache_salt": "tenant-B"}, "generates": [[PROMPT]], "close": True},
            {
                "extra": a,
                "engine_args": {
                    "hf_overrides": {"rope_parameters": {"rope_theta": 2e4, "rope_type": "default"}}
                },
                "generates": [[PROMPT]],
                "close": True,
            },
            {"extra": a, "generates": [[PROMPT], [THIRD]]},
        ],
        **common,
    )
    return {"first": first, "after_first": after_first, "second": second, "root": root}


def test_offline_job_exit_without_close_persists_every_block(
    restarts: dict[str, Any], baseline: dict[str, list[int]]
) -> None:
    """An offline script's engine (vLLM's default multiprocess engine) that ends without close
    leaves all 5 chunks of its two prompts in the fs tier, nothing logged; a fresh engine (new
    process) serves its first request from disk: 96 cached tokens, the tokens of a run without
    kvcascade. The in-process engine the second script leaves open persists the 2 chunks of
    its last prompt at interpreter exit. (Issue #15 part 2: 0 block files in 6 of 7 runs.)"""
    (first_runs,) = restarts["first"]["engines"]
    assert [cached for _, cached in first_runs] == [0, 0]
    assert [tokens for tokens, _ in first_runs] == [baseline["prompt"], baseline["other"]]
    assert restarts["after_first"] == {"tenant-A/10000.0": 5}
    a_again = restarts["second"]["engines"][2]
    assert a_again[0] == [baseline["prompt"], 96]
    assert block_files(restarts["root"])["tenant-A/10000.0"] == 5 + 2
    assert_no_kvcascade_error(restarts["first"]["stderr"])
    assert_no_kvcascade_error(restarts["second"]["stderr"])


def test_tenants_and_changed_rope_never_share_kv(
    restarts: dict[str, Any], baseline: dict[str, list[int]]
) -> None:
    """On one fs root, tenant B and tenant A with another ``rope_theta`` get 0 cached tokens
    from tenant A's files (B's tokens are a run without kvcascade's), each writes its own
    namespace (3 chunks, persisted at engine shutdown), and tenant A again gets hits.
    (Issue #15 part 1: B was served 96 tokens from A's files.)"""
    tenant_b, rope_a, _ = restarts["second"]["engines"]
    assert tenant_b == [[baseline["prompt"], 0]]
    assert rope_a[0][1] == 0
    files = block_files(restarts["root"])
    assert files["tenant-B/10000.0"] == 3 and files["tenant-A/20000.0"] == 3
    assert len(files) == 3
