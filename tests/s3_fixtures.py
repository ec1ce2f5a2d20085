"""A real S3 server on loopback for the s3-tier tests: ``moto_server`` in its own process, and a
small fault-injecting HTTP proxy in front of it.

Nothing here mocks botocore: the tier speaks HTTP to a separate process (moto's server mode), as
it would to MinIO or AWS. The proxy (asyncio, 127.0.0.1 only, bounded in connections and body
size) forwards each request on a fresh upstream connection and can, per matching request, answer
``503 SlowDown``, answer another error, hold the request back, drop the connection unanswered,
delay the response, reset the connection half way through the response body, or stall there.
:func:`blackhole` makes a port where connecting times out.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import struct
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest

ACCESS_KEY = "AKIAKVCASCADETEST"
SECRET_KEY = "kvcascade-secret-do-not-log"  # a test asserts it never shows up
START_TIMEOUT_S = 30.0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class MotoServer:
    """``moto_server`` as a child process on ``127.0.0.1:port``; state lives in that process
    (a kill loses every bucket, as a real crash of an in-memory store would)."""

    def __init__(self, log_path: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the server and wait until it answers HTTP.

        Raises:
            RuntimeError: it exited or did not answer within ``START_TIMEOUT_S``.
        """
        with open(self._log_path, "ab") as log:
            self._proc = subprocess.Popen(
                ["moto_server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self._proc.returncode}")
            try:
                with urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=1):
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"moto_server did not answer on {self.endpoint}")

    def kill(self) -> None:
        """SIGKILL the server (no clean shutdown) and reap it."""
        if self._proc is not None and self._proc.poll() is None:
            os.kill(self._proc.pid, signal.SIGKILL)
            self._proc.wait()

    def stop(self) -> None:
        """Terminate the server (kill after 5 s)."""
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()

    def client(self) -> Any:
        """A synchronous boto3 S3 client of this server (test set-up and assertions)."""
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
        )


@pytest.fixture(scope="session")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """One moto server for the session (tests use their own buckets)."""
    server = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def bucket(moto: MotoServer) -> str:
    """A fresh, empty bucket on the session's server."""
    name = f"kvc-{uuid.uuid4().hex[:12]}"
    moto.client().create_bucket(Bucket=name)
    return name


# -- the fault proxy --------------------------------------------------------------------------
@dataclass
class Fault:
    """What the proxy does to requests accepted by ``match(method, target)``.

    ``kind``: ``"slowdown"`` (503 SlowDown), ``"error"`` (500 InternalError), ``"hold"``
    (``seconds`` before forwarding the request; a client hanging up meanwhile drops it, so the
    server never sees it), ``"drop"`` (close the connection without an answer, the request
    not forwarded), ``"delay"`` (``seconds`` before forwarding the response), ``"reset"`` (half
    the response body, then a TCP reset), ``"stall"`` (half the response body, then silence
    until the client hangs up).
    ``times``: how many matching requests it applies to (None: all).
    """

    kind: str
    match: Callable[[str, str], bool] = lambda method, target: True
    times: int | None = None
    seconds: float = 0.0
    hits: int = 0


_ERRORS = {
    "slowdown": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    "error": (500, "Internal Server Error", "InternalError", "Injected failure."),
}
MAX_BODY = 64 * 1024 * 1024
MAX_CONNECTIONS = 256
STALL_LIMIT_S = 60.0


class FaultProxy:
    """HTTP/1.1 proxy on ``127.0.0.1`` forwarding to ``upstream_port`` with injected faults.

    Use as ``async with FaultProxy(port) as proxy``; ``proxy.endpoint`` is its URL and
    ``proxy.faults`` the active faults (first match wins). ``port``: the port to listen on
    (0: a free one).
    """

    def __init__(self, upstream_port: int, port: int = 0) -> None:
        self.upstream_port = upstream_port
        self.faults: list[Fault] = []
        self.requests: list[tuple[str, str]] = []
        self._server: asyncio.Server | None = None
        self._slots = asyncio.Semaphore(MAX_CONNECTIONS)
        self._handlers: set[asyncio.Task[None]] = set()
        self.port = port

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> FaultProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._handlers):
            task.cancel()
        if self._handlers:
            await asyncio.wait(list(self._handlers))
        await self._server.wait_closed()

    def _fault_for(self, method: str, target: str) -> Fault | None:
        for fault in self.faults:
            if (fault.times is None or fault.hits < fault.times) and fault.match(method, target):
                fault.hits += 1
                return fault
        return None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            async with self._slots:
                while await self._one_request(reader, writer):
                    pass
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            self._handlers.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError, asyncio.CancelledError):
                await writer.wait_closed()

    async def _one_request(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Serve one request; False when the connection is to be closed."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return False
        lines = head.decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        headers = [line for line in lines[1:] if line]
        length = 0
        for line in headers:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        if length > MAX_BODY:
            return False
        body = await reader.readexactly(length)
        self.requests.append((method, target))
        fault = self._fault_for(method, target)
        if fault is not None and fault.kind in _ERRORS:
            status, reason, code, message = _ERRORS[fault.kind]
            xml = (
                f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code>"
                f"<Message>{message}</Message></Error>"
            ).encode()
            writer.write(
                f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
                f"Content-Length: {len(xml)}\r\n\r\n".encode()
                + xml
            )
            await writer.drain()
            return True
        if fault is not None and fault.kind == "drop":
            return False
        if fault is not None and fault.kind == "hold":
            with contextlib.suppress(asyncio.TimeoutError):
                if not await asyncio.wait_for(reader.read(1), fault.seconds):
                    return False  # the client hung up: the request is not forwarded
        kept = [h for h in headers if h.partition(":")[0].strip().lower() != "connection"]
        upstream = "\r\n".join([lines[0], *kept, "Connection: close", "", ""]).encode() + body
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        try:
            up_writer.write(upstream)
            await up_writer.drain()
            response = await up_reader.read(MAX_BODY)
            while chunk := await up_reader.read(MAX_BODY):
                response += chunk
        finally:
            up_writer.close()
            with contextlib.suppress(ConnectionError):
                await up_writer.wait_closed()
        resp_head, _, resp_body = response.partition(b"\r\n\r\n")
        resp_lines = [
            line
            for line in resp_head.split(b"\r\n")
            if line.partition(b":")[0].strip().lower() != b"connection"
        ]
        out_head = b"\r\n".join(resp_lines) + b"\r\n\r\n"
        if fault is not None and fault.kind == "delay":
            await asyncio.sleep(fault.seconds)
        if fault is not None and fault.kind in ("reset", "stall") and len(resp_body) > 1:
            writer.write(out_head + resp_body[: len(resp_body) // 2])
            await writer.drain()
            if fault.kind == "stall":
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(reader.read(), STALL_LIMIT_S)
                return False
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
            return False
        writer.write(out_head + resp_body)
        await writer.drain()
        return True


@contextlib.contextmanager
def blackhole(port: int) -> Iterator[None]:
    """A listener on ``127.0.0.1:port`` whose accept queue is full and never accepted from, so a
    new connection gets no answer to its SYN (Linux drops SYNs to a full queue) and a client's
    connect times out, as towards an unreachable host.

    Raises:
        RuntimeError: the queue could not be filled (16 connections got through).
    """
    fillers: list[socket.socket] = []
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(0)
        try:
            for _ in range(16):
                filler = socket.socket()
                fillers.append(filler)
                filler.settimeout(0.5)
                try:
                    filler.connect(("127.0.0.1", port))
                except TimeoutError:
                    break
            else:
                raise RuntimeError(f"the accept queue of port {port} did not fill")
            yield
        finally:
            for filler in fillers:
                filler.close()
