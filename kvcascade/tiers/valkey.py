"""The Valkey / Redis tier (``type: "valkey"``): one string value per block on a shared server.

A DRAM pool on a Redis-protocol server (Valkey, Redis OSS, their managed variants), single
server or cluster, shared by every engine pointed at it (docs/valkey-tier.md).

Key of a block: ``<prefix>/`` + the fs tier's relative path
(:meth:`~kvcascade.tiers._file_mapper.FileMapper.relative_path`), exactly the s3 tier's object
key, so the namespace identity (model, dtype, geometry, ``cache_salt``) separates instances the
same way. Value: the block file format of :mod:`kvcascade.tiers._block_format` (the 4096-byte
header: magic, version, payload length, xxh3 of the payload and of the key; the payload; zeros
up to a multiple of 4096 bytes) — the bytes of an fs block file or an s3 object. Header and
payload are one value under one key, so a cluster (keys spread over its 16384 slots by the key's
CRC16) never holds one without the other, and a reader sees the whole value or none (``SET`` is
atomic).

Transport: the asyncio client of ``redis`` (redis-py; docs/valkey-tier.md says why this one and
not ``valkey``), created in the actor's start-up and closed at its end: a
``BlockingConnectionPool`` of ``max_concurrency`` connections for one server, a
``RedisCluster`` with ``max_concurrency`` connections per node for a cluster (routing by the
key specs of only the commands it sends: :class:`_KeySpecs`). An
:class:`asyncio.Semaphore` of ``max_concurrency`` bounds the commands in flight. Every command
has a deadline: ``connect_timeout_s`` to connect, ``timeout_s`` per socket read or write (one
server's ``SET`` and ``GET``: per attempt, :meth:`ValkeyTier._roundtrip`), retried by the
client (``max_attempts`` in all, exponential backoff) on connection errors and timeouts; the
job as a whole is bounded by ``io_timeout_s`` (:class:`SecondaryTier`).

* **Store** (per block, concurrently): on one server the header, the primary row itself and
  the zero padding are sent as separate buffers of one ``SET`` (:meth:`ValkeyTier._set_parts`:
  no copy of ours, only the xxh3 pass); a cluster's client routes a ``SET`` of one argument, so
  there the value is assembled in one buffer (one copy of the payload; buffers are reused, at
  most ``max_concurrency`` of them).
  A key another engine already wrote is rewritten with the same bytes (a cascade only carries
  blocks the primary tier did not have, so rewrites are rare, and a rewrite refreshes the
  server's LRU clock).
* **Load** (per block, concurrently): ``GET``; length, header, key digest and checksum are
  verified on the received value (:func:`~kvcascade.tiers._block_format.check_block`) before
  one copy into the primary row, so a corrupt value never reaches a row. On one server the
  value is received into a reused buffer (:class:`_ValueReads`), not into fresh ``bytes``. A
  missing value (evicted by the server, never stored, deleted) fails its block as a miss
  (``counters["missing_blocks"]``); a corrupt or foreign one is deleted and counted
  (``counters["corrupt_blocks"]``).
* **Lookup**: RETRY-then-verdict lookups (docs/coordinator.md) over one pipeline of
  ``EXISTS`` per probe batch (split per node by the cluster client). kvcascade keeps no index
  of the server's keys: the server owns capacity (``maxmemory`` and its eviction policy), so
  only it knows what is there.
* **Degradation**: no answer (refused, reset, timed out, loading, ``CLUSTERDOWN``; classified in
  one place, :data:`_MEANINGS`) marks the server down for :data:`DOWN_RETRY_S` seconds: probes
  answer ``MISS``, stores are dropped (``counters["store_dropped_blocks"]``) and loads fail, all
  without a command; the first command after the window tries again and any answer marks it up.
  ``OOM command not allowed`` (``maxmemory`` reached under ``noeviction``) marks the server full
  for the same window: stores are dropped, loads and probes go on. Each state change is logged
  once. No restart is needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import mmap
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis._parsers import _AsyncRESP2Parser, _AsyncRESP3Parser
from redis._parsers.commands import AsyncCommandsParser
from redis._parsers.socket import SERVER_CLOSED_CONNECTION_ERROR
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.utils import check_protocol_version

from .._errors import (
    CorruptBlockError,
    KVCascadeError,
    TierUnavailableError,
    TransferError,
)
from .._validate import display_url
from ._backend import Backend, Meaning, NotFoundError
from ._block_format import (
    HEADER_BYTES,
    BlockAuth,
    block_auth,
    check_block,
    encode_header,
    file_size,
)
from ._file_mapper import FileMapper
from ._valkey_config import client_url, valkey_tier_options
from .base import PROBE_TIMEOUT_S, SecondaryTier, gather_blocks
from .cpu import HostBuffer

log = logging.getLogger(__name__)

DOWN_RETRY_S = 1.0
"""Seconds an unreachable (or full) server is left alone before the next try."""
_MEANINGS: tuple[tuple[type[BaseException], Meaning], ...] = (
    # Answered, but no: wrong password or ACL (a configuration error, not an outage).
    (rexc.AuthenticationError, Meaning.ANSWERED),
    (rexc.NoPermissionError, Meaning.ANSWERED),
    # A client-side bound (never reached: the semaphore bounds commands in flight).
    (rexc.MaxConnectionsError, Meaning.ANSWERED),
    # maxmemory reached under noeviction: "OOM command not allowed when used memory > ...".
    (rexc.OutOfMemoryError, Meaning.FULL),
    # Refused, reset, closed, server loading its data after a restart (BusyLoadingError is a
    # ConnectionError), socket timeouts after the client's retries.
    (rexc.ConnectionError, Meaning.DOWN),
    (rexc.TimeoutError, Meaning.DOWN),
    # A cluster without a master for the slot (failover under way, too few nodes).
    (rexc.ClusterDownError, Meaning.DOWN),
    (rexc.MasterDownError, Meaning.DOWN),
    (rexc.SlotNotCoveredError, Meaning.DOWN),
    (OSError, Meaning.DOWN),
    (TimeoutError, Meaning.DOWN),
    # Anything else the server answered (READONLY replica, TRYAGAIN, a wrong type, ...).
    (rexc.RedisError, Meaning.ANSWERED),
)
"""Client exception type → what it means to the tier, first match wins; read only by the
tier's :class:`~kvcascade.tiers._backend.Backend` (the s3 tier declares its own table)."""


#: The keyed commands the tier sends to a cluster (keyless ones, ``PING`` and ``CONFIG GET``,
#: are routed by the client's node flags).
_KEYED = ("SET", "GET", "DEL", "EXISTS")


class _KeySpecs(AsyncCommandsParser):
    """The cluster client's table of where each command has its keys, for :data:`_KEYED` only.

    ``RedisCluster`` fills the table with ``COMMAND`` at start-up and routes a keyed command by
    it. The full reply (about 240 commands, some 12,000 nested elements) is parsed by redis-py's
    pure-Python RESP parser in one or two steps of the tier's task: measured 0.08 s on an idle
    2-core machine, 0.57 s in asyncio debug mode (a coroutine per element) and over 1 s under
    load (tests/conftest.py's loop guard). ``COMMAND INFO`` of the keyed commands this tier
    sends answers in a few milliseconds; any other keyed command fails with redis-py's
    ``RedisError`` "... command doesn't exist in Redis commands".
    """

    async def initialize(self, node: ClusterNode | None = None) -> None:
        if node is not None:
            self.node = node
        answer = await self.node.execute_command("COMMAND", "INFO", *_KEYED)
        self.commands = {name.lower(): spec for name, spec in answer.items()}


class _ValueReads:
    """What the tier's RESP parsers add to redis-py's: a bulk reply of exactly ``len(into)``
    bytes, ``into`` set on the parser while a ``GET`` is read (:meth:`ValkeyTier._roundtrip`),
    is read into ``into`` and answered as that memoryview.

    redis-py's own ``_AsyncRESPBase._read`` waits with ``StreamReader.readexactly`` until the
    whole value is in the stream's buffer (which grows to the value's size, chunk by chunk),
    copies it out into one ``bytes`` and slices the CRLF off into another: three passes over
    fresh, value-sized allocations, the page faults of each included. Here the value is
    copied from each chunk the stream received (``StreamReader.read``) into ``into``, a
    buffer the tier reuses, page-aligned (so that the copy into a primary row runs at full
    speed). Any other reply, or one of another length (a corrupt value), is redis-py's.
    A read cut short is not resumed: the connection's ``read_response`` disconnects on any
    exception (``redis.asyncio.connection.Connection.read_response``), and the parser, reset
    on connect, starts afresh.

    Raises:
        redis.exceptions.ConnectionError: the server closed the connection mid-value.
    """

    into: memoryview | None = None
    # redis-py's parser state (``_AsyncRESPBase``): the stream, the bytes of a resumed reply.
    _stream: asyncio.StreamReader
    _buffer: bytes
    _pos: int

    async def _read(self, length: int) -> Any:
        into = self.into
        if into is None or length != into.nbytes or len(self._buffer) > self._pos:
            return await super()._read(length)  # type: ignore[misc]
        stream = self._stream
        filled = 0
        while filled < length:
            chunk = await stream.read(length - filled)
            if not chunk:
                raise rexc.ConnectionError(SERVER_CLOSED_CONNECTION_ERROR)
            into[filled : filled + len(chunk)] = chunk
            filled += len(chunk)
        try:
            await stream.readexactly(2)  # the reply's CRLF
        except asyncio.IncompleteReadError as exc:
            raise rexc.ConnectionError(SERVER_CLOSED_CONNECTION_ERROR) from exc
        self._pos += length + 2
        return into


class _RESP2Values(_ValueReads, _AsyncRESP2Parser):
    """redis-py's RESP2 parser with :class:`_ValueReads`."""


class _RESP3Values(_ValueReads, _AsyncRESP3Parser):
    """redis-py's RESP3 parser with :class:`_ValueReads`."""


def _value_buffer(nbytes: int) -> memoryview:
    """A zeroed, page-aligned buffer of ``nbytes`` bytes (an anonymous mapping).

    Page-aligned, a value's payload (at :data:`HEADER_BYTES`) has the page offset of a primary
    row: a 64 KiB copy whose destination sat 16 bytes past its source's page offset ran 17×
    slower on the AMD EPYC VM of docs/valkey-tier.md, Performance."""
    return memoryview(mmap.mmap(-1, nbytes))


class ValkeyTier(SecondaryTier):
    """Secondary tier storing one value per block on a Valkey / Redis server (module docstring).

    Args:
        host: the primary tier's buffer.
        mapper: the namespace (:class:`FileMapper`, shared with the fs and s3 tiers).
        url: ``redis://host:port[/db]`` (also ``valkey://``; ``rediss://``/``valkeys://`` for
            TLS; ``unix:///path`` for one local server); for a cluster, any one node.
        cluster: the server is a cluster (Redis Cluster / Valkey cluster protocol).
        prefix: key prefix (slashes at either end are ignored); ``""`` = none.
        username, password: ACL user and password; None = none.
        max_concurrency: commands in flight and connections (per node in a cluster), ``>= 1``;
            also the number of jobs running at once.
        connect_timeout_s: deadline of one connect, seconds.
        timeout_s: deadline of one socket read or write, seconds.
        max_attempts: attempts per command on connection errors and timeouts, ``>= 1``.
        name: tier name in metrics and events (default ``"valkey"``).
        io_timeout_s: per-job deadline in seconds from submission.
        max_queued_jobs: jobs allowed to wait; stores beyond it are refused.
        auth: authenticate blocks (:class:`~kvcascade.tiers._block_format.BlockAuth`, docs/
            fs-tier.md "Authenticated blocks"); None = checksums only.
        probe_timeout_s: deadline of one existence probe in seconds; past it the probe answers
            MISS (:class:`~kvcascade.tiers.base.SecondaryTier`).

    The values are those :func:`~kvcascade.tiers._valkey_config.valkey_tier_options` checked:
    build the tier with :func:`valkey_tier_from_config` (or through a ``CascadeConfig``), not
    directly.
    """

    def __init__(
        self,
        host: HostBuffer,
        mapper: FileMapper,
        url: str,
        *,
        cluster: bool = False,
        prefix: str = "",
        username: str | None = None,
        password: str | None = None,
        max_concurrency: int = 16,
        connect_timeout_s: float = 2.0,
        timeout_s: float = 5.0,
        max_attempts: int = 3,
        name: str = "valkey",
        io_timeout_s: float = 30.0,
        max_queued_jobs: int = 1024,
        auth: BlockAuth | None = None,
        probe_timeout_s: float = PROBE_TIMEOUT_S,
    ) -> None:
        super().__init__(
            name,
            host,
            io_threads=max_concurrency,
            io_timeout_s=io_timeout_s,
            max_queued_jobs=max_queued_jobs,
            probe_timeout_s=probe_timeout_s,
        )
        self.mapper = mapper
        self._auth = auth
        self.url = display_url(url, "valkey tier url")
        self.cluster = cluster
        self.prefix = prefix.strip("/")
        self.value_bytes = file_size(host.block_bytes)
        self._client_url = client_url(url)
        self._options: dict[str, Any] = {
            "username": username,
            "password": password,
            "socket_connect_timeout": connect_timeout_s,
            "socket_timeout": timeout_s,
            "retry": Retry(ExponentialBackoff(cap=0.5, base=0.02), max_attempts - 1),
        }
        self.max_concurrency = max_concurrency
        self._sem = asyncio.Semaphore(max_concurrency)
        # Value buffers free for reuse (:func:`_value_buffer`), at most max_concurrency: a
        # cluster's stores assemble values in them, one server's loads receive values into them.
        self._values: list[memoryview] = []
        self._padding = bytes(self.value_bytes - HEADER_BYTES - host.block_bytes)
        self._client: Any = None
        self._backend = Backend(name, "valkey", "server", self.url, _MEANINGS, DOWN_RETRY_S)

    def __repr__(self) -> str:
        return f"ValkeyTier(name={self.name!r}, url={self.url!r}, cluster={self.cluster})"

    def object_key(self, key: bytes) -> str:
        """The server key of ``key``: ``<prefix>/<relative path>`` (no ``//``, no leading ``/``)."""
        path = self.mapper.relative_path(key)
        return f"{self.prefix}/{path}" if self.prefix else path

    # -- life cycle ----------------------------------------------------------------------
    def _make_client(self) -> Any:
        if self.cluster:
            client = RedisCluster.from_url(
                self._client_url,
                max_connections=self.max_concurrency,
                **self._options,
            )
            client.commands_parser = _KeySpecs()
            return client
        pool = aioredis.BlockingConnectionPool.from_url(
            self._client_url,
            max_connections=self.max_concurrency,
            timeout=self.io_timeout_s,
            **self._options,
        )
        # The protocol the connections speak (RESP3 unless the URL says ?protocol=2), and the
        # parser for it; no connection is made before the first command.
        resp3 = check_protocol_version(pool.connection_kwargs.get("protocol"), 3)
        pool.connection_kwargs["parser_class"] = _RESP3Values if resp3 else _RESP2Values
        return aioredis.Redis.from_pool(pool)

    async def _startup(self) -> None:
        """Create the client and check the server answers (``PING``); warn when its eviction
        policy cannot evict (``maxmemory`` with ``noeviction``: a full server refuses stores);
        a server that does not answer ``CONFIG GET`` (managed services) is not checked.

        Raises:
            TierUnavailableError: the server cannot be reached, refused the credentials, or
                answered the connection's set-up with another error (``SELECT`` of a database
                it does not have: ``DB index is out of range``, its words in the message); the
                message names the URL (without credentials) and the error's type.
        """
        self._client = self._make_client()
        try:
            with self._backend.translate("PING"):
                await self._client.ping()
        except (TierUnavailableError, TransferError) as exc:
            if isinstance(exc.__cause__, (rexc.AuthenticationError, rexc.NoPermissionError)):
                what = "refused the credentials"
            elif isinstance(exc, TransferError):  # it answered, with an error
                what = f"refused the connection: {exc.__cause__}"
            else:
                what = "is not reachable"
            raise TierUnavailableError(
                f"valkey tier {self.name!r}: server {self.url} {what} ({exc})"
            ) from exc
        with contextlib.suppress(KVCascadeError), self._backend.translate("CONFIG GET"):
            config = await self._client.config_get("maxmemory*")
            if config.get("maxmemory", "0") == "0":
                log.info(
                    "valkey tier %s: %s has no maxmemory: it grows until the host runs out of "
                    "memory (docs/valkey-tier.md, Capacity)",
                    self.name,
                    self.url,
                )
            elif config.get("maxmemory-policy") == "noeviction":
                log.warning(
                    "valkey tier %s: %s has maxmemory-policy noeviction: once full it refuses "
                    "stores; set allkeys-lru to let it evict (docs/valkey-tier.md)",
                    self.name,
                    self.url,
                )

    async def _cleanup(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.aclose()
            self._client = None

    # -- commands (through the Backend boundary) ----------------------------------------
    async def _command(self, op: str, fn: Callable[[], Awaitable[Any]]) -> Any:
        """One command under the semaphore: :meth:`_call`."""
        async with self._sem:
            return await self._call(op, fn)

    async def _call(self, op: str, fn: Callable[[], Awaitable[Any]]) -> Any:
        """One command (the caller holds the semaphore) through :meth:`Backend.translate`,
        refused without a command while the server is marked down.

        Raises:
            TierUnavailableError: the server is marked down, or was found unreachable now.
            TransferError: the server answered with an error, or is full.
        """
        self._backend.check_available()
        with self._backend.translate(op):
            return await fn()

    # -- movers (coroutines on the event loop) -------------------------------------------
    async def _store_blocks(self, keys: Sequence[bytes], rows: Sequence[memoryview]) -> int:
        state = self._backend.refusing_writes()
        if state is not None:
            self.counters["store_dropped_blocks"] += len(keys)
            raise TransferError(
                f"valkey server {self.url} is {state}; store dropped", reported=state == "full"
            )
        written = await gather_blocks(self._store_one, "valkey store", keys, rows)
        self._backend.stored()
        return written

    async def _load_blocks(self, keys: Sequence[bytes], rows: Sequence[memoryview]) -> int:
        if not self._backend.available():
            raise TransferError(f"valkey server {self.url} is down")
        return await gather_blocks(self._load_one, "valkey load", keys, rows)

    async def _store_one(self, key: bytes, row: memoryview) -> int:
        name = self.object_key(key)
        if not self.cluster:
            header = memoryview(bytearray(HEADER_BYTES))
            encode_header(key, row, header, self._auth)
            parts = (header, row, self._padding) if self._padding else (header, row)
            await self._command("SET", lambda: self._set_parts(name, parts))
            return row.nbytes
        async with self._sem:
            # A value buffer of a finished store is reused: its header beyond the 32 bytes
            # encode_header writes and its padding are still zero; a fresh one costs page faults.
            value = self._values.pop() if self._values else _value_buffer(self.value_bytes)
            payload = value[HEADER_BYTES : HEADER_BYTES + row.nbytes]
            payload[:] = row
            encode_header(key, payload, value[:HEADER_BYTES], self._auth)
            await self._call("SET", lambda: self._client.set(name, value))
        self._values.append(value)  # not after a failure: a cancelled send may still hold it
        return row.nbytes

    async def _set_parts(self, name: str, parts: Sequence[memoryview | bytes]) -> None:
        """``SET name <the parts, concatenated>`` on one server, the parts sent as they are
        (RESP: ``*3``, ``$3 SET``, ``$len name``, ``$len`` and the value's parts, ``CRLF``):
        the client's own ``SET`` takes one argument per value, so the value would have to be
        assembled in a buffer of ours. A send cut short (deadline, cancellation) disconnects
        the connection; were the row's bytes to change under such a send, the value stored
        would fail its checksum on load (a miss), never be served.

        Raises:
            the client's exceptions (:meth:`_roundtrip`), and :class:`TransferError` for an
            answer other than ``OK``.
        """
        key = name.encode()
        length = sum(memoryview(p).nbytes for p in parts)
        command = [b"*3\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n" % (len(key), key, length)]
        answer = await self._roundtrip([*command, *parts, b"\r\n"])
        if answer != b"OK":
            raise TransferError(f"valkey SET {name}: answered {answer!r}, not OK")

    async def _get(self, name: str, into: memoryview | None) -> bytes | memoryview | None:
        """``GET name``: the value, None when there is none. On one server a value of
        ``len(into)`` bytes is received into ``into`` (:class:`_ValueReads`) and answered as
        ``into``; any other length, and a cluster's (its client routes the ``GET``), as
        ``bytes``.

        Raises:
            the client's exceptions (:meth:`_roundtrip`).
        """
        if into is None:
            return await self._client.get(name)
        key = name.encode()
        return await self._roundtrip([b"*2\r\n$3\r\nGET\r\n$%d\r\n%b\r\n" % (len(key), key)], into)

    async def _roundtrip(
        self, command: list[bytes | memoryview], into: memoryview | None = None
    ) -> Any:
        """Send one RESP-packed ``command`` (a list of buffers, sent as they are) on a pooled
        connection of the one server and answer its reply; ``into``: where a bulk reply of
        its length is received (:class:`_ValueReads`).

        Connection, retries and reply parsing are the client's (``get_connection``, the
        connection's ``retry``, ``send_packed_command``, ``read_response``), as in
        ``redis.asyncio.Redis.execute_command``, so its errors reach :meth:`_backend`
        unchanged; ``into`` is set on the connection's parser only while its reply is read.
        Deadline: ``timeout_s`` per attempt, send and reply together, under one
        ``asyncio.timeout``; the connection's own socket timeout is lifted meanwhile (with it
        redis-py sends through ``asyncio.wait_for``, a task, and reads under a second timer:
        15-25 % of the tier's CPU per 64 KiB block, docs/valkey-tier.md). A command
        cut short disconnects its connection (redis-py's ``send_packed_command`` and
        ``read_response`` do on any exception) and is tried again like any timeout.

        Raises:
            the client's exceptions: connection errors and timeouts
            (``redis.exceptions.TimeoutError``) after its retries, the server's error replies.
        """
        timeout_s = self._options["socket_timeout"]

        async def attempt() -> Any:
            try:
                async with asyncio.timeout(timeout_s):
                    await conn.send_packed_command(command)  # connects first if need be
                    return await reply()
            except TimeoutError as exc:  # asyncio's; the client retries its own kind
                raise rexc.TimeoutError(f"no answer within {timeout_s:g} s") from exc

        async def reply() -> Any:
            # The parser of the connection as it is now (connecting may replace it); redis-py
            # has no public handle on it.
            parser = conn._parser
            if not isinstance(parser, _ValueReads):
                return await conn.read_response(disable_decoding=True)
            parser.into = into
            try:
                return await conn.read_response(disable_decoding=True)
            finally:
                parser.into = None

        pool = self._client.connection_pool
        conn = await pool.get_connection()
        conn.socket_timeout = None
        try:
            return await conn.retry.call_with_retry(attempt, lambda _: conn.disconnect())
        finally:
            conn.socket_timeout = timeout_s
            await pool.release(conn)

    async def _load_one(self, key: bytes, row: memoryview) -> int:
        name = self.object_key(key)
        try:
            async with self._sem:
                # One server: the value is received into a reused buffer (:meth:`_get`), free
                # again once checked and copied; after a failed command it is dropped.
                into = None
                if not self.cluster:
                    into = self._values.pop() if self._values else _value_buffer(self.value_bytes)
                value = await self._call("GET", lambda: self._get(name, into))
                try:
                    row[:] = self._payload(key, name, value, row.nbytes)
                finally:
                    if into is not None:
                        self._values.append(into)
        except CorruptBlockError as exc:
            await self._corrupt(exc, functools.partial(self._discard, name))
            raise
        return row.nbytes

    def _payload(
        self, key: bytes, name: str, value: bytes | memoryview | None, nbytes: int
    ) -> memoryview:
        """The payload (``nbytes`` bytes) of ``value``, the value under ``name``, once its
        length, header, key digest and checksum (and MAC) are verified
        (:func:`~kvcascade.tiers._block_format.check_block`).

        Raises:
            NotFoundError: there is no value (``counters["missing_blocks"]`` += 1).
            CorruptBlockError: the value is not ``key``'s block, intact.
        """
        if value is None:
            self.counters["missing_blocks"] += 1
            raise NotFoundError(f"valkey GET: no value under {name}")
        if len(value) != self.value_bytes:
            raise CorruptBlockError(
                f"{name}: value is {len(value)} bytes, expected {self.value_bytes}"
            )
        view = memoryview(value)
        payload = view[HEADER_BYTES : HEADER_BYTES + nbytes]
        check_block(key, view[:HEADER_BYTES], payload, name, self._auth)
        return payload

    async def _discard(self, name: str) -> None:
        """Delete the value under ``name`` (a failed delete is left to the next load)."""
        with contextlib.suppress(TierUnavailableError, TransferError):
            await self._command("DEL", lambda: self._client.delete(name))

    async def _probe(self, keys: Sequence[bytes]) -> list[bool]:
        if not self._backend.available():
            return [False] * len(keys)

        async def exists() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self.object_key(key))
            return list(await pipe.execute(raise_on_error=False))

        try:
            answers = await self._command("EXISTS", exists)
        except (TierUnavailableError, TransferError) as exc:
            self.counters["probe_errors"] += len(keys)
            log.warning(
                "valkey tier %s: %d existence probes failed (%s); answering MISS",
                self.name,
                len(keys),
                exc,
            )
            return [False] * len(keys)
        errors = [a for a in answers if isinstance(a, BaseException)]
        if errors:
            self.counters["probe_errors"] += len(errors)
            log.warning(
                "valkey tier %s: %d of %d existence probes failed (%s); answering MISS",
                self.name,
                len(errors),
                len(keys),
                type(errors[0]).__name__,
            )
        return [a == 1 for a in answers]

    async def _remove(self, keys: Sequence[bytes]) -> list[bool]:
        """``DEL`` each key's value (one pipeline; per key in a cluster); True where it existed.

        Raises:
            TierUnavailableError / TransferError: the server did not answer or refused.
        """

        async def delete() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.delete(self.object_key(key))
            return list(await pipe.execute())

        return [a == 1 for a in await self._command("DEL", delete)]


def valkey_tier_from_config(
    host: HostBuffer, mapper: FileMapper, cfg: dict[str, Any]
) -> ValkeyTier:
    """Build a valkey tier from a ``secondary_tiers`` entry (``type`` already removed).

    Keys: ``url`` (required), ``cluster`` (false), ``prefix`` (none), ``username`` /
    ``password`` (none), ``max_concurrency`` (16), ``connect_timeout_s`` (2), ``timeout_s`` (5),
    ``max_attempts`` (3), ``cache_salt`` (tenant salt folded into the namespace), ``name``
    (``"valkey"``), ``io_timeout_s`` (30 s per job), ``max_queued_jobs`` (1024),
    ``probe_timeout_s`` (0.5 s per existence probe), ``auth_secret_env`` or
    ``auth_secret_file`` (secret of authenticated blocks,
    :func:`~kvcascade.tiers._block_format.block_auth`; default none).

    Raises:
        ConfigError: see :func:`~kvcascade.tiers._valkey_config.valkey_tier_options` (every key
            and value, checked again here for a tier built without a ``CascadeConfig``), or a
            secret that cannot be read (:func:`~kvcascade.tiers._block_format.block_auth`).
    """
    options = valkey_tier_options(cfg, host.block_bytes)
    if cfg.get("cache_salt"):
        mapper = mapper.with_salt(cfg["cache_salt"])
    auth = block_auth(cfg, "valkey tier", mapper.namespace)
    return ValkeyTier(host, mapper, auth=auth, **options)
