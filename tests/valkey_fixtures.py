"""Real Redis-protocol servers on loopback for the valkey-tier tests: ``redis-server`` (or
``valkey-server``) from the OS packages in child processes, a 3-master cluster with one replica,
and a throttling TCP proxy.

Nothing here mocks the client: the tier speaks RESP over TCP to separate server processes. Each
server runs on ``127.0.0.1`` on a free port in its own temporary directory with persistence off
(``--save '' --appendonly no``), so a kill or restart comes back empty, as a crashed DRAM pool
would. The proxy (asyncio, 127.0.0.1 only) forwards bytes both ways and, while ``rate`` is set,
lets the client→server direction through at most ``rate`` bytes per second (one budget shared by
all connections): a slow shared server as seen from the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

START_TIMEOUT_S = 15.0
SERVER = shutil.which("valkey-server") or shutil.which("redis-server")
CLI = shutil.which("valkey-cli") or shutil.which("redis-cli")

needs_server = pytest.mark.skipif(
    SERVER is None or CLI is None,
    reason="redis-server / valkey-server not installed (apt-get install redis-server)",
)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (below 55535: a cluster bus port is +10000)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port < 55535:
            return port


class Server:
    """One ``redis-server`` child process on ``127.0.0.1:port`` in directory ``workdir``
    (``password``: started with ``--requirepass``, which :meth:`cli` then sends)."""

    def __init__(
        self, workdir: Path, *args: str, port: int | None = None, password: str | None = None
    ) -> None:
        self.port = port or free_port()
        self.workdir = workdir
        self.args = (*args, "--requirepass", password) if password else args
        self.password = password
        self.url = f"redis://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Server:
        """Start it and wait until it answers ``PING``.

        Raises:
            RuntimeError: it exited or did not answer within ``START_TIMEOUT_S``.
        """
        assert SERVER is not None
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.workdir / "server.log", "ab") as log:
            self.proc = subprocess.Popen(
                [
                    SERVER,
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--dir",
                    str(self.workdir),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    *self.args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{SERVER} exited with {self.proc.returncode}")
            with contextlib.suppress(subprocess.SubprocessError):
                if self.cli("PING").strip() == "PONG":
                    return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{SERVER} did not answer on port {self.port}")

    def cli(self, *args: str) -> str:
        """``redis-cli -p port ARGS`` (raw output).

        Raises:
            subprocess.CalledProcessError / TimeoutExpired: the call failed.
        """
        assert CLI is not None
        auth = ["--no-auth-warning", "-a", self.password] if self.password else []
        return subprocess.run(
            [CLI, "-h", "127.0.0.1", "-p", str(self.port), *auth, *args],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the server (SIGSTOP pauses it, SIGCONT resumes it)."""
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL the server (no clean shutdown) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        """Terminate the server (kill after 5 s)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server for the module, ``maxmemory`` unset (tests use their own key prefixes)."""
    srv = Server(tmp_path_factory.mktemp("redis")).start()
    yield srv
    srv.stop()


class Cluster:
    """Three masters (all 16384 slots) and one replica of the first, ``cluster-node-timeout``
    ``node_timeout_ms``: a killed master's replica takes over within a few seconds."""

    def __init__(self, workdir: Path, node_timeout_ms: int = 1000) -> None:
        args = (
            "--cluster-enabled",
            "yes",
            "--cluster-node-timeout",
            str(node_timeout_ms),
            "--cluster-config-file",
            "nodes.conf",
        )
        self.nodes = [Server(workdir / f"n{i}", *args) for i in range(4)]
        self.masters = self.nodes[:3]
        self.replica = self.nodes[3]

    @property
    def url(self) -> str:
        return self.masters[0].url

    def start(self) -> Cluster:
        """Start the nodes, create the cluster, attach the replica, wait until it is ``ok``.

        Raises:
            RuntimeError: the cluster did not become ``ok`` with its replica in time.
        """
        for node in self.nodes:
            node.start()
        hosts = [f"127.0.0.1:{n.port}" for n in self.masters]
        self.masters[0].cli(
            "--cluster", "create", *hosts, "--cluster-replicas", "0", "--cluster-yes"
        )
        master_id = self.masters[0].cli("CLUSTER", "MYID").strip()
        self.replica.cli(
            "--cluster",
            "add-node",
            f"127.0.0.1:{self.replica.port}",
            hosts[0],
            "--cluster-slave",
            "--cluster-master-id",
            master_id,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            info = self.replica.cli("INFO", "replication")
            if "master_link_status:up" in info and self.state() == "ok":
                return self
            time.sleep(0.1)
        raise RuntimeError("the cluster did not become ok with its replica")

    def state(self, node: Server | None = None) -> str:
        """``cluster_state`` as seen by ``node`` (default: the replica)."""
        info = (node or self.replica).cli("CLUSTER", "INFO")
        line = next(ln for ln in info.splitlines() if ln.startswith("cluster_state:"))
        return line.split(":", 1)[1].strip()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One cluster for the module (its failover test runs last: it changes the topology)."""
    c = Cluster(tmp_path_factory.mktemp("cluster")).start()
    yield c
    c.stop()


class ThrottleProxy:
    """TCP proxy on ``127.0.0.1`` to ``upstream_port``; client→server bytes limited to ``rate``
    bytes per second (all connections together) while ``rate`` is not None.

    Use as ``async with ThrottleProxy(port) as proxy``; ``proxy.url`` is its ``redis://`` URL.
    """

    CHUNK = 16 * 1024

    def __init__(self, upstream_port: int, rate: float | None = None) -> None:
        self.upstream_port = upstream_port
        self.rate = rate
        self.port = 0
        self.forwarded = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._next_send = 0.0  # monotonic time the shared budget allows the next chunk

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    async def __aenter__(self) -> ThrottleProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks))
        await self._server.wait_closed()

    async def _throttle(self, nbytes: int) -> None:
        if self.rate is None:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        start = max(now, self._next_send)
        self._next_send = start + nbytes / self.rate
        if start > now:
            await asyncio.sleep(start - now)

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, throttled: bool
    ) -> None:
        try:
            while chunk := await reader.read(self.CHUNK):
                if throttled:
                    await self._throttle(len(chunk))
                    self.forwarded += len(chunk)
                writer.write(chunk)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
            try:
                await asyncio.gather(
                    self._pump(reader, up_writer, True), self._pump(up_reader, writer, False)
                )
            finally:
                up_writer.close()
        except (ConnectionError, OSError):
            pass
        finally:
            self._tasks.discard(task)
            writer.close()
