"""What kvcascade buys a real engine: vLLM 0.32 (CPU backend) on a scaled Mooncake conversation
workload, alone and with kvcascade's tiers, each configuration in its own engine process
(issue #17, part 1).

Engine: a dummy-weight Llama (``load_format="dummy"``, config written with ``transformers``;
no model hub) sized so prefill is compute-bound on this machine's cores; GPU prefix caching on,
the engine's KV cache (``--engine-blocks`` blocks of 32 tokens) smaller than the workload's
working set. Driven in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, vLLM's ``LLMEngine``
``add_request`` / ``step``), so each step is timed and the scheduler-side connector is read
between steps.

Workload: the bundled Mooncake conversation trace (``kvcascade/data``, read by
``kvcascade.replay.trace.read_trace``), scaled down with its structure intact: the first
multi-turn conversations (a conversation = the requests sharing ``hash_ids[1]``; ``hash_ids[0]``
is the system prompt every request shares) in trace order, up to ``--requests`` requests;
each hash id becomes the same deterministic run of ``512 * scale`` token ids wherever it occurs;
input and output lengths are scaled by ``--scale``; arrival order kept, time compressed by
``--speedup``, and a conversation's next turn arrives no earlier than its previous turn's end
(a chat user reads the answer first). Probe, before the workload: the TTFT of a 2k-token
prompt no other configuration sends (recompute), then of one shared 2k-token prompt, sent again
after the GPU prefix cache is reset (``LLM.reset_prefix_cache()``, kvcascade's tiers kept): from
kvcascade's CPU tier in ``kvc-cpu``; from the fs tier, first time, in ``kvc-fs-restart``. Each
cached TTFT is a ratio to the recompute in the same engine, seconds before.

Configurations (same engine settings, one process each, in this order):

* ``vllm``: vLLM alone (its GPU prefix cache only): the baseline of every ratio;
* ``kvc-cpu``: + kvcascade's CPU tier (``CPUOffloadingSpec``);
* ``kvc-cpu-fs``: + CPU and fs tiers (``TieringOffloadingSpec``, fs on ``--fs-dir``);
* ``kvc-fs-restart``: a fresh engine on the fs tier ``kvc-cpu-fs`` left (its CPU tier empty);
* ``vllm-offloading`` / ``vllm-simple-cpu``: vLLM's own ``OffloadingConnector`` and
  ``SimpleCPUOffloadConnector`` with the same CPU bytes; on the CPU backend both refuse to
  start (the error is printed and kept in ``benchmarks/README.md``).

Figures: TTFT p50/p90/p99 (first token time − the request's arrival), requests/s and output
tokens/s over the run's makespan, prompt tokens served from the GPU prefix cache, kvcascade's
CPU tier and fs tier (connector ``transfer_stats()`` and the coordinator's per-tier read bytes),
the connector's scheduler-side time per engine step (``transfer_stats()["scheduler_seconds"]``
across each ``step()``, µs p50/p99) and its share of step time, and the lag p99 of kvcascade's
loop thread (a ``call_later(1 ms)`` sampler put on it through ``connector.call_on_loop``, as
``benchmarks/loop_lag.py``). Every figure is also a ratio to ``vllm``.

    python benchmarks/serving.py [--quick] [--json PATH] [--plot PATH] [--requests N]
        [--scale 0.0625] [--vllm-python /tmp/kvcascade-vllm-venv/bin/python]

The parent process only schedules the engines and writes the report (``--plot`` needs
matplotlib in *its* python); each engine runs in ``--vllm-python`` with this checkout's
kvcascade on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _rows import Row, rows_path, write_rows

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 32  # tokens per vLLM block (the CPU backend needs a multiple of 32)
TRACE_BLOCK = 512  # tokens per hash id in the Mooncake trace
PROBE_TOKENS = 2048
VOCAB = 4096
CONFIGS = ("vllm", "kvc-cpu", "kvc-cpu-fs", "kvc-fs-restart", "vllm-offloading", "vllm-simple-cpu")
PEERS = {"vllm-offloading": "OffloadingConnector", "vllm-simple-cpu": "SimpleCPUOffloadConnector"}


@dataclass(frozen=True)
class Size:
    """A model and workload size: Llama dimensions and the default request count."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    requests: int
    engine_blocks: int  # the engine's KV cache, blocks of BLOCK tokens

    def block_bytes(self) -> int:
        """Bytes of one block over all layers (K and V, float32)."""
        return self.layers * 2 * self.kv_heads * BLOCK * (self.hidden // self.heads) * 4


#: float32: this machine's cores have AVX2 only, where vLLM's CPU kernels run bf16 about 3x
#: slower than fp32 (2k-token prefill of the ``full`` model: 8.4 s bf16, 2.7 s fp32). A hidden
#: 1024 × 8-layer model would take ~8x longer per token than ``full``.
DTYPE = "float32"
SIZES = {
    "tiny": Size(128, 2, 4, 2, 256, 8, 72),
    "quick": Size(256, 4, 4, 2, 768, 16, 120),
    "full": Size(512, 4, 8, 2, 1024, 32, 160),
}


# -- workload -------------------------------------------------------------------------------------
def _block_tokens(hash_id: int, n: int) -> list[int]:
    """The ``n`` token ids of trace block ``hash_id`` (deterministic; ids in [5, VOCAB))."""
    x = (hash_id + 1) * 0x9E3779B97F4A7C15 & (1 << 64) - 1
    out = []
    for _ in range(n):
        x = (x * 6364136223846793005 + 1442695040888963407) & (1 << 64) - 1
        out.append(5 + (x >> 33) % (VOCAB - 5))
    return out


def conversation_workload(requests: int, scale: float) -> list[dict[str, Any]]:
    """The first multi-turn conversations of the bundled trace, ``requests`` requests in trace
    order: ``{"id", "session", "arrival_ms", "prompt", "max_tokens"}`` (prompt: token ids).

    Raises:
        ValueError: ``requests < 1`` or ``512 * scale`` not a whole number of tokens >= 1.
    """
    from kvcascade.replay.trace import bundled_trace, read_trace

    per_block = TRACE_BLOCK * scale
    if requests < 1 or per_block < 1 or per_block != int(per_block):
        raise ValueError(
            f"need requests >= 1 and 512 * scale a whole number >= 1, got requests={requests}, "
            f"scale={scale}"
        )
    trace = read_trace(bundled_trace())
    turns: dict[int, int] = {}
    for r in trace:
        if len(r.hash_ids) > 1:
            turns[r.hash_ids[1]] = turns.get(r.hash_ids[1], 0) + 1
    order = list(dict.fromkeys(r.hash_ids[1] for r in trace if turns.get(r.hash_ids[1], 0) > 1))
    chosen: list[Any] = []
    for k in range(1, len(order) + 1):  # the first k conversations, all their turns
        sessions = set(order[:k])
        chosen = [r for r in trace if len(r.hash_ids) > 1 and r.hash_ids[1] in sessions]
        if len(chosen) >= requests:
            break
    out = []
    for r in chosen[:requests]:
        prompt = [t for h in r.hash_ids for t in _block_tokens(h, int(per_block))]
        length = max(1, min(len(prompt), round(r.input_length * scale)))
        out.append(
            {
                "id": f"r{r.index}",
                "session": r.hash_ids[1],
                "arrival_ms": r.timestamp_ms,
                "prompt": prompt[:length],
                "max_tokens": max(1, round(r.output_length * scale)),
            }
        )
    return out


# -- one engine (child process) -------------------------------------------------------------------
def _write_model(path: Path, size: Size, max_len: int) -> None:
    import transformers

    transformers.LlamaConfig(
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        vocab_size=VOCAB,
        max_position_embeddings=max_len,
    ).save_pretrained(path)


def _transfer_config(config: str, cpu_bytes: int, fs_dir: str) -> dict[str, Any] | None:
    if config == "vllm":
        return None
    if config in PEERS:
        return {
            "kv_connector": PEERS[config],
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes},
        }
    extra: dict[str, Any] = {"cpu_bytes_to_use": cpu_bytes}
    if config != "kvc-cpu":
        extra["spec_name"] = "TieringOffloadingSpec"
        extra["secondary_tiers"] = [{"type": "fs", "root_dir": fs_dir}]
    return {
        "kv_connector": "KVCascadeConnector",
        "kv_connector_module_path": "kvcascade.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


class _LagSampler:
    """On kvcascade's loop thread: how late a ``call_later(interval)`` callback runs (s)."""

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.lags: list[float] = []
        self._handle: Any = None

    def start(self) -> None:  # called on the loop (connector.call_on_loop)
        import asyncio

        self._tick(asyncio.get_running_loop(), None)

    def _tick(self, loop: Any, due: float | None) -> None:
        now = loop.time()
        if due is not None:
            self.lags.append(max(0.0, now - due))
        self._handle = loop.call_later(self.interval, self._tick, loop, now + self.interval)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()


def _percentile(values: list[float], q: float) -> float:
    """``numpy.percentile`` (linear, ``q`` in [0, 100], as ``benchmarks/loop_lag.py``); NaN for
    no values."""
    import numpy as np

    return float(np.percentile(values, q)) if values else float("nan")


def _engine_main(spec: dict[str, Any]) -> dict[str, Any]:
    """Start one engine, run the probe and the workload, return the figures (JSON-able)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import gc
    import warnings

    warnings.simplefilter("ignore")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    size = Size(**spec["size"])
    config = spec["config"]
    started = time.perf_counter()
    try:
        llm = LLM(
            model=spec["model"],
            load_format="dummy",
            skip_tokenizer_init=True,
            enforce_eager=True,
            block_size=BLOCK,
            dtype=DTYPE,
            kv_cache_memory_bytes=size.engine_blocks * size.block_bytes(),
            seed=0,
            max_model_len=spec["max_len"],
            distributed_executor_backend="uni",
            enable_prefix_caching=True,
            kv_transfer_config=_transfer_config(config, spec["cpu_bytes"], spec["fs_dir"]),
        )
    except Exception as exc:  # a peer that refuses this backend: the error is the result
        return {"config": config, "error": f"{type(exc).__name__}: {exc}"}
    start_s = time.perf_counter() - started
    gc.freeze()  # as a serving process after start-up (benchmarks/loop_lag.py)
    engine = llm.llm_engine
    sched = engine.engine_core.engine_core.scheduler
    connector = sched.get_kv_connector() if config.startswith("kvc") else None

    def stats() -> dict[str, float]:
        if connector is None:
            return {}
        tiers = connector.call_on_loop(connector.coordinator.get_stats)
        return {**connector.transfer_stats(), **tiers}

    steps: list[tuple[float, float]] = []  # (step seconds, connector scheduler seconds)

    def step() -> list[Any]:
        before = connector.transfer_stats()["scheduler_seconds"] if connector else 0.0
        t = time.perf_counter()
        outs = engine.step()
        took = time.perf_counter() - t
        after = connector.transfer_stats()["scheduler_seconds"] if connector else 0.0
        steps.append((took, after - before))
        return outs

    def ttft(rid: str, prompt: list[int]) -> float:
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        t = time.perf_counter()
        engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
        while engine.has_unfinished_requests():
            step()
        return time.perf_counter() - t

    ttft("warmup", _block_tokens(1 << 40, 256))
    own = 1 << 42 | sum(config.encode())  # a prompt no other configuration sends
    recompute = ttft("recompute", _block_tokens(own, PROBE_TOKENS))
    probe = _block_tokens(1 << 41, PROBE_TOKENS)
    probe_first = ttft("probe-1", probe)
    llm.reset_prefix_cache()  # the GPU prefix cache only: kvcascade's tiers keep the probe
    probe_again = ttft("probe-2", probe)
    steps.clear()

    sampler = _LagSampler()
    if connector is not None:
        connector.call_on_loop(sampler.start)
    before = stats()
    result = _drive(engine, spec["workload"], spec["speedup"], step)
    after = stats()
    if connector is not None:
        connector.call_on_loop(sampler.stop)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    chunk_bytes = delta["load_bytes"] / delta["loaded_chunks"] if delta.get("loaded_chunks") else 0
    connector_tokens = delta.get("loaded_chunks", 0.0) * BLOCK
    fs_bytes = delta.get("kvcascade_read_bytes_total:1:fs", 0.0)
    fs_tokens = fs_bytes / chunk_bytes * BLOCK if chunk_bytes else 0.0
    cached = sum(r["cached"] for r in result["requests"])
    step_s = [s for s, _ in steps]
    conn_s = [c for _, c in steps]
    return {
        "config": config,
        "start_s": start_s,
        "recompute_s": recompute,
        "probe_first_s": probe_first,
        "probe_again_s": probe_again,
        **result,
        "tokens_gpu_cache": cached - connector_tokens,
        "tokens_cpu_tier": connector_tokens - fs_tokens,
        "tokens_fs_tier": fs_tokens,
        "failed_loads": delta.get("failed_loads", 0.0),
        "steps": len(steps),
        "step_us_p50": _percentile(step_s, 50) * 1e6,
        "connector_us_p50": _percentile(conn_s, 50) * 1e6 if connector else None,
        "connector_us_p99": _percentile(conn_s, 99) * 1e6 if connector else None,
        "connector_share": sum(conn_s) / sum(step_s) if connector and step_s else None,
        "loop_lag_p99_ms": _percentile(sampler.lags, 99) * 1e3 if connector else None,
        "loop_lag_samples": len(sampler.lags),
    }


def _drive(engine: Any, workload: list[dict[str, Any]], speedup: float, step: Any) -> dict:
    """Submit each request at its compressed arrival (and after its conversation's previous
    turn ended), step the engine until all finish; per-request TTFT, tokens, cached tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    waiting = list(workload)
    session_free: dict[int, float] = {}  # conversation → when its previous turn ended
    busy: set[int] = set()
    arrival: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, dict[str, Any]] = {}
    t0 = time.perf_counter()
    while len(done) < len(workload):
        now = time.perf_counter() - t0
        for req in list(waiting):
            due = max(req["arrival_ms"] / 1000 / speedup, session_free.get(req["session"], 0.0))
            if req["session"] in busy or due > now:
                continue
            waiting.remove(req)
            busy.add(req["session"])
            arrival[req["id"]] = due
            params = SamplingParams(temperature=0, max_tokens=req["max_tokens"], ignore_eos=True)
            engine.add_request(req["id"], TokensPrompt(prompt_token_ids=req["prompt"]), params)
        if not engine.has_unfinished_requests():
            time.sleep(0.001)
            continue
        for out in step():
            now = time.perf_counter() - t0
            rid = out.request_id
            if rid not in first and out.outputs and out.outputs[0].token_ids:
                first[rid] = now
            if out.finished:
                req = next(r for r in workload if r["id"] == rid)
                busy.discard(req["session"])
                session_free[req["session"]] = now
                done[rid] = {
                    "id": rid,
                    "prompt": len(req["prompt"]),
                    "cached": int(out.num_cached_tokens or 0),
                    "tokens": list(out.outputs[0].token_ids),
                    "ttft_s": first[rid] - arrival[rid],
                    "end_s": now,
                }
    makespan = max(r["end_s"] for r in done.values()) - min(arrival.values())
    reqs = [done[r["id"]] for r in workload]
    return {
        "requests": reqs,
        "makespan_s": makespan,
        "requests_per_s": len(reqs) / makespan,
        "output_tokens_per_s": sum(len(r["tokens"]) for r in reqs) / makespan,
        "ttft_p50_s": _percentile([r["ttft_s"] for r in reqs], 50),
        "ttft_p90_s": _percentile([r["ttft_s"] for r in reqs], 90),
        "ttft_p99_s": _percentile([r["ttft_s"] for r in reqs], 99),
    }


# -- the run (parent process) ---------------------------------------------------------------------
def _run_engine(python: str, spec: dict[str, Any], workdir: Path) -> dict[str, Any]:
    spec_path = workdir / f"{spec['config']}.spec.json"
    out_path = workdir / f"{spec['config']}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    log = workdir / f"{spec['config']}.log"
    with log.open("wb") as fh:
        proc = subprocess.run(
            [python, __file__, "--_engine", str(spec_path), str(out_path)],
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            check=False,
        )
    if proc.returncode != 0 or not out_path.exists():
        tail = log.read_text(errors="replace")[-3000:]
        return {
            "config": spec["config"],
            "error": f"engine process exited {proc.returncode}: {tail}",
        }
    return json.loads(out_path.read_text())


def _rows(results: dict[str, dict[str, Any]]) -> list[Row]:
    base = results["vllm"]
    rows = [Row.of("probe 2k TTFT, recompute (vllm)", base["recompute_s"] * 1e3, None, None, "ms")]
    # Cached vs recompute in the same engine, seconds apart (the machine's load drifts).
    for config, key, tier, goal in (
        ("kvc-cpu", "probe_again_s", "CPU tier", "<= 0.1"),
        ("kvc-fs-restart", "probe_first_s", "fs tier (restart)", "<= 0.2"),
    ):
        r = results.get(config, {"error": "not run"})
        if "error" not in r:
            name = f"probe 2k TTFT cached from {tier} / recompute"
            rows.append(Row.of(name, r[key] * 1e3, r["recompute_s"] * 1e3, goal, "ms"))
    for name, r in results.items():
        if "error" in r:
            continue
        b = None if name == "vllm" else base
        rows += [
            Row.of(f"{name} TTFT p50", r["ttft_p50_s"] * 1e3, b and b["ttft_p50_s"] * 1e3,
                   b and "<= 0.5", "ms"),
            Row.of(f"{name} TTFT p90", r["ttft_p90_s"] * 1e3, b and b["ttft_p90_s"] * 1e3,
                   None, "ms"),
            Row.of(f"{name} TTFT p99", r["ttft_p99_s"] * 1e3, b and b["ttft_p99_s"] * 1e3,
                   None, "ms"),
            Row.of(f"{name} requests/s", r["requests_per_s"], b and b["requests_per_s"],
                   b and ">= 1.5", "req/s"),
            Row.of(f"{name} output tokens/s", r["output_tokens_per_s"],
                   b and b["output_tokens_per_s"], None, "tok/s"),
            Row.of(f"{name} prompt tokens from GPU prefix cache", r["tokens_gpu_cache"],
                   b and b["tokens_gpu_cache"], None, "tokens"),
        ]  # fmt: skip
        if r["connector_share"] is None:
            continue
        rows += [
            Row.of(f"{name} prompt tokens from CPU tier", r["tokens_cpu_tier"], None, None,
                   "tokens"),
            Row.of(f"{name} prompt tokens from fs tier", r["tokens_fs_tier"], None, None,
                   "tokens"),
            Row.of(f"{name} connector time/step p50", r["connector_us_p50"], None, None, "us"),
            Row.of(f"{name} connector time/step p99", r["connector_us_p99"], None, None, "us"),
            Row.of(f"{name} connector share of step time", r["connector_share"], None,
                   "<= 0.02", "fraction"),
            Row.of(f"{name} loop lag p99", r["loop_lag_p99_ms"], None, "< 2", "ms"),
        ]  # fmt: skip
    return rows


def _table(rows: list[Row]) -> str:
    lines = [f"{'figure':58} {'measured':>12} {'vllm':>12} {'ratio':>7}  goal   met"]
    for r in rows:
        base = "" if r.baseline is None else f"{r.baseline:12.4g}"
        ratio = "" if r.ratio is None else f"{r.ratio:7.3f}"
        met = "" if r.met is None else ("yes" if r.met else "NO")
        lines.append(
            f"{r.name:58} {r.measured:12.4g} {base:>12} {ratio:>7}  {r.goal or '':6} {met}"
            f"  {r.unit}"
        )
    return "\n".join(lines)


def _plot(results: dict[str, dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, (cdf, share) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in results.items():
        if "error" in r:
            continue
        ttfts = sorted(q["ttft_s"] for q in r["requests"])
        cdf.step(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], where="post",
                 label=name)  # fmt: skip
        by_end = sorted(r["requests"], key=lambda q: q["end_s"])
        cached = prompt = 0
        xs, ys = [], []
        for q in by_end:
            cached += q["cached"]
            prompt += q["prompt"]
            xs.append(q["end_s"])
            ys.append(cached / prompt)
        share.plot(xs, ys, label=name)
    cdf.set(xscale="log", xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT CDF")
    cdf.xaxis.set_minor_formatter(NullFormatter())
    share.set(xlabel="time since the first arrival (s)", ylabel="cached prompt tokens / prompt "
              "tokens (cumulative)", title="Cached-token share over time")  # fmt: skip
    cdf.legend()
    share.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_engine"]:
        spec = json.loads(Path(argv[1]).read_text())
        Path(argv[2]).write_text(json.dumps(_engine_main(spec)))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the quick size (~4 minutes)")
    parser.add_argument("--size", choices=sorted(SIZES), help="model size (default: full)")
    parser.add_argument("--requests", type=int, help="conversation requests (default: by size)")
    parser.add_argument("--scale", type=float, default=1 / 16, help="token scale (512*scale/id)")
    parser.add_argument("--speedup", type=float, default=1000.0, help="trace time compression")
    parser.add_argument("--cpu-mib", type=int, default=1024, help="kvcascade's CPU tier, MiB")
    parser.add_argument(
        "--configs", help="comma-separated subset (default: all; --quick: all but the peers)"
    )
    parser.add_argument("--fs-dir", help="fs tier root (default: a temporary directory)")
    parser.add_argument("--vllm-python", default=sys.executable, help="python with vLLM 0.32")
    parser.add_argument(
        "--json", type=rows_path, help="write the ratio rows (benchmarks/_rows.py) here"
    )
    parser.add_argument("--details", help="write every configuration's full figures here")
    parser.add_argument("--plot", help="write the TTFT CDF / cached-share PNG here")
    args = parser.parse_args(argv)
    size_name = args.size or ("quick" if args.quick else "full")
    size = SIZES[size_name]
    default = [c for c in CONFIGS if not (args.quick and c in PEERS)]
    configs = [c.strip() for c in args.configs.split(",")] if args.configs else default
    bad = [c for c in configs if c not in CONFIGS]
    if bad or "vllm" not in configs:
        parser.error(f"--configs must include 'vllm' and name only {CONFIGS}, got {args.configs!r}")
    if args.speedup <= 0 or args.cpu_mib <= 0:
        parser.error(f"--speedup and --cpu-mib must be > 0, got {args.speedup}, {args.cpu_mib}")
    if args.fs_dir and Path(args.fs_dir).exists() and any(Path(args.fs_dir).iterdir()):
        parser.error(f"--fs-dir {args.fs_dir!r} is not empty (the run starts on an empty fs tier)")
    try:
        workload = conversation_workload(args.requests or size.requests, args.scale)
    except ValueError as exc:
        parser.error(str(exc))
    longest = max(len(r["prompt"]) + r["max_tokens"] for r in workload)
    max_len = max(longest, PROBE_TOKENS + 1)
    max_len = -(-max_len // BLOCK) * BLOCK
    # The engine's KV cache: the size's blocks, or the longest request's (+ vLLM's null block
    # and one spare: with exactly max_len vLLM refuses to start) when that is more.
    size = replace(size, engine_blocks=max(size.engine_blocks, max_len // BLOCK + 2))
    with tempfile.TemporaryDirectory(prefix="kvc-serving-") as tmp:
        work = Path(tmp)
        _write_model(work / "model", size, max_len)
        fs_dir = args.fs_dir or str(work / "fs")
        common = {
            "size": size.__dict__,
            "model": str(work / "model"),
            "max_len": max_len,
            "cpu_bytes": args.cpu_mib << 20,
            "fs_dir": fs_dir,
            "workload": workload,
            "speedup": args.speedup,
        }
        print(
            f"size {size_name} ({size}); {len(workload)} requests, "
            f"{sum(len(r['prompt']) for r in workload)} prompt tokens, "
            f"{sum(r['max_tokens'] for r in workload)} output tokens; max_model_len {max_len}; "
            f"engine KV {size.engine_blocks} blocks ({size.engine_blocks * BLOCK} tokens)",
            flush=True,
        )
        results: dict[str, dict[str, Any]] = {}
        for config in configs:
            t = time.perf_counter()
            results[config] = _run_engine(args.vllm_python, {**common, "config": config}, work)
            r = results[config]
            took = time.perf_counter() - t
            if "error" in r:
                print(f"{config}: refused/failed in {took:.0f} s: {r['error'][:600]}", flush=True)
                if config == "vllm":
                    print("the vllm baseline failed; no report", file=sys.stderr)
                    return 1
            else:
                print(f"{config}: {took:.0f} s (engine start {r['start_s']:.0f} s)", flush=True)
    base_tokens = [q["tokens"] for q in results["vllm"]["requests"]]
    for r in results.values():
        if "error" not in r:
            r["outputs_equal_vllm"] = sum(
                q["tokens"] == t for q, t in zip(r["requests"], base_tokens, strict=True)
            )
    rows = _rows(results)
    print(_table(rows))
    for name, r in results.items():
        if "error" not in r:
            print(
                f"{name}: {r['outputs_equal_vllm']}/{len(r['requests'])} outputs equal vllm's; "
                f"{r['steps']} steps, step p50 {r['step_us_p50']:.0f} us; "
                f"2k TTFT: recompute {r['recompute_s'] * 1e3:.0f} ms, probe "
                f"{r['probe_first_s'] * 1e3:.0f} ms, again {r['probe_again_s'] * 1e3:.0f} ms"
            )
    if args.json:
        write_rows(args.json, "serving", rows)
    if args.details:
        Path(args.details).write_text(json.dumps(results, indent=1) + "\n")
    if args.plot:
        _plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
