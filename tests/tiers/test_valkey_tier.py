"""The valkey tier (issue #20) against real Redis-protocol servers on loopback
(``redis-server`` / ``valkey-server`` child processes, :mod:`valkey_fixtures`): round trip,
the key layout and value format shared with the fs and s3 tiers, large values over RESP2 and
RESP3, corruption, eviction by the server, a full server, restart, a paused server, a 3-master
cluster (round trip, corruption, eviction, failover), back-pressure from a throttled server,
and ``kvcascade replay --valkey``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import tier_helpers
import valkey_fixtures
from tier_helpers import BLOCK, job, key, load, lookups, pattern, running, store
from valkey_fixtures import Cluster, Server, ThrottleProxy, free_port, needs_server

import kvcascade as kc
from kvcascade import LookupResult as R
from kvcascade.backpressure import CascadeAdmission
from kvcascade.coordinator import TieringCoordinator
from kvcascade.index.cpu import CPUOffloadingManager
from kvcascade.metrics import TieringMetrics
from kvcascade.replay.cli import main
from kvcascade.tiers import valkey as valkey_module
from kvcascade.tiers._block_format import HEADER_BYTES, encode_header, file_size
from kvcascade.tiers._file_mapper import FileMapper, default_identity
from kvcascade.tiers.fs import FileSystemTier
from kvcascade.tiers.registry import TierContext, create_secondary_tier
from kvcascade.tiers.valkey import ValkeyTier, valkey_tier_from_config

pytestmark = needs_server
server = valkey_fixtures.server  # the module's redis-server process
cluster = valkey_fixtures.cluster  # the module's 3-master cluster (+1 replica)
_prefixes = iter(range(1 << 30))

PASSWORD = "kvcascade-valkey-secret"  # a test asserts it never shows up


def make_tier(url: str, host: kc.HostBuffer, **kw: Any) -> ValkeyTier:
    """A tier on ``url`` with a fresh key prefix (tests share one server)."""
    kw.setdefault("prefix", f"t{next(_prefixes)}")
    return valkey_tier_from_config(
        host, FileMapper(default_identity("test-model")), {"url": url, **kw}
    )


def sync_client(url: str, cluster: bool = False) -> Any:
    """A synchronous client for set-up and assertions."""
    if cluster:
        return redis.RedisCluster.from_url(url)
    return redis.Redis.from_url(url)


def fs_block_file(k: bytes, payload: bytes) -> bytes:
    """The fs block file format v2 of ``payload`` under ``k``, built from its definition
    (docs/fs-tier.md): the header, the payload, zeros up to a multiple of 4096 bytes."""
    value = bytearray(file_size(len(payload)))
    encode_header(k, payload, memoryview(value)[:HEADER_BYTES])
    value[HEADER_BYTES : HEADER_BYTES + len(payload)] = payload
    return bytes(value)


@pytest.fixture
def host() -> Iterator[kc.HostBuffer]:
    buf = kc.HostBuffer(16, BLOCK)
    yield buf
    buf.close()


# -- configuration ----------------------------------------------------------------------
def test_config_errors_name_the_bad_value_and_never_the_password(
    host: kc.HostBuffer, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """Unknown keys, a missing or bad url, a password inside the url, bad types and ranges are
    ConfigErrors naming the value, from the factory and when the CascadeConfig is built; the
    password never shows in repr or messages."""
    ctx = TierContext(host, default_identity("test-model"))
    tier = create_secondary_tier(
        {"type": "valkey", "url": "valkey://h:1/0", "password": PASSWORD}, ctx
    )
    assert isinstance(tier, ValkeyTier) and tier.name == "valkey"
    assert tier.object_key(key(1)) == FileMapper(default_identity("test-model")).relative_path(
        key(1)
    )
    assert PASSWORD not in repr(tier)
    mapper = FileMapper(default_identity("test-model"))
    for cfg, message in [
        ({"url": "redis://h:1", "pasword": "x"}, r"unknown valkey tier keys \['pasword'\]"),
        ({}, "needs 'url'"),
        ({"url": "http://h:1"}, "must be redis://.*got 'http://h:1'"),
        ({"url": "redis://"}, "must be redis://.*got 'redis:'"),
        ({"url": f"redis://u:{PASSWORD}@h:1"}, "'redis://h:1' holds a password"),
        ({"url": f"redis://h:1/0?password={PASSWORD}"}, "'redis://h:1/0' holds a password"),
        ({"url": "redis://h:1", "password": 5}, "password must be a string, got a secret"),
        ({"url": "redis://h:1", "cluster": "yes"}, "cluster must be true or false, got 'yes'"),
        ({"url": "unix:///tmp/s", "cluster": True}, "over TCP"),
        ({"url": "redis://h:1", "max_concurrency": 0}, "max_concurrency must be .*got 0"),
        ({"url": "redis://h:1", "timeout_s": -1}, "timeout_s must be .*got -1"),
        ({"url": "redis://h:1", "max_attempts": True}, "max_attempts must be .*got True"),
        # urllib's bare ValueErrors, which named neither the tier, the key nor the URL
        ({"url": "redis://h:abc"}, r"url 'redis://h:abc' is not a valid URL \(Port could not"),
        ({"url": "redis://h:99999"}, r"url 'redis://h:99999' is not a valid URL \(Port out"),
        ({"url": "redis://[::1"}, r"url 'redis://\[::1' is not a valid URL \(Invalid IPv6"),
        ({"url": f"redis://u:{PASSWORD}@h:abc"}, r"url 'h:abc' is not a valid URL"),
    ]:
        with pytest.raises(kc.ConfigError, match=message) as info:
            valkey_tier_from_config(host, mapper, cfg)
        assert PASSWORD not in str(info.value)
        # the same error when the CascadeConfig is built, before an fs tier listed first has
        # created its directories (a bad url or max_concurrency 0 were refused only by the
        # factory, at open_cascade)
        fs = tmp_path / "fs"
        with pytest.raises(kc.ConfigError, match=message) as info:
            kc.CascadeConfig(
                block_bytes=4096,
                cpu_blocks=4,
                model_name="test-model",
                secondary_tiers=[{"type": "fs", "root_dir": str(fs)}, {"type": "valkey", **cfg}],
            )
        assert PASSWORD not in str(info.value) and not fs.exists()
    assert PASSWORD not in caplog.text


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis://h:1?foo=1", "query parameter 'foo' is not accepted; accepted: db, protocol, "),
        ("redis://h:1?db=abc", "query parameter 'db' must be a database number (0, 1, ...), "),
        ("redis://h:1?protocol=4", "query parameter 'protocol' must be 2 or 3 (RESP2 or RESP3)"),
        (
            "redis://h:1?socket_timeout=9",
            "query parameter 'socket_timeout' is set by the tier's key 'timeout_s': use it",
        ),
        ("redis://h:1?db=1&db=2", "query parameter 'db' is given twice"),
        (
            "redis://h:1?ssl_cert_reqs=none",
            "query parameter 'ssl_cert_reqs' is a TLS option: only with rediss:// or valkeys://",
        ),
        ("redis://h:1/abc", "the path must be a database number (/0, /1, ...), got '/abc'"),
        ("redis://h:1/1/2", "the path must be a database number (/0, /1, ...), got '/1/2'"),
        ("redis://h:1/1?db=2", "give the database once, path or ?db="),
    ],
)
def test_a_url_query_or_path_the_client_would_misread_is_refused_naming_it(
    host: kc.HostBuffer, tmp_path: Path, url: str, message: str
) -> None:
    """``?foo=1`` passed the CascadeConfig and open_cascade raised redis-py's bare TypeError
    (``AbstractConnection.__init__() got an unexpected keyword argument 'foo'``), ``?db=abc`` its
    bare ValueError, after an fs tier listed first had created its directory; ``/abc`` was
    ignored (database 0) and ``/1/2`` read as 12 (found by a break-it run). Now each is a
    ConfigError naming the parameter, before anything exists; the parameters redis-py reads
    and the tier does not set itself are accepted."""
    fs = tmp_path / "fs"
    with pytest.raises(kc.ConfigError) as err:
        kc.CascadeConfig(
            block_bytes=4096,
            cpu_blocks=4,
            model_name="test-model",
            secondary_tiers=[{"type": "fs", "root_dir": str(fs)}, {"type": "valkey", "url": url}],
        )
    shown = url.partition("?")[0]
    assert str(err.value).startswith(f"valkey tier url {shown!r}: {message}")
    assert not fs.exists()
    for good in (
        "redis://h:1/2",
        "valkey://h:1/?db=3&protocol=2",
        "unix:///tmp/kv.sock?db=1",
        "valkeys://h:1?ssl_cert_reqs=none&ssl_check_hostname=false&ssl_ca_certs=/ca.pem",
    ):
        tier = valkey_tier_from_config(host, FileMapper(default_identity("m")), {"url": good})
        assert tier._client_url == good.replace("valkey", "redis", 1)


async def test_startup_with_a_database_the_server_lacks_says_the_server_refused_it(
    server: Server, host: kc.HostBuffer
) -> None:
    """``/99`` on a server of 16 databases: start-up said the server "is not reachable", though
    it answered (found by a break-it run). Now it says the server refused the connection, in
    the server's words."""
    tier = make_tier(f"{server.url}/99", host, max_attempts=1)
    with pytest.raises(kc.TierUnavailableError) as err:
        await asyncio.wait_for(tier.serve(), 10)
    assert str(err.value) == (
        f"valkey tier 'valkey': server {server.url}/99 refused the connection: DB index is out "
        "of range (valkey PING failed (ResponseError))"
    )
    assert tier._client is None


async def test_startup_fails_naming_the_server_when_unreachable(
    host: kc.HostBuffer, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing listening: the actor's start-up raises TierUnavailableError naming the URL, and
    logs nothing first (it warned that lookups miss and stores are dropped until the server
    answers: a degraded service that a failed start never gives)."""
    caplog.set_level(logging.DEBUG, logger="kvcascade")
    url = f"redis://127.0.0.1:{free_port()}"
    tier = make_tier(url, host, max_attempts=1, connect_timeout_s=0.5)
    with pytest.raises(kc.TierUnavailableError, match=f"{url}.*ConnectionError"):
        await asyncio.wait_for(tier.serve(), 10)
    assert tier._client is None
    assert tier_helpers.kvcascade_warnings(caplog.records) == []


async def test_startup_with_a_wrong_password_says_the_credentials_were_refused(
    tmp_path: Path, host: kc.HostBuffer
) -> None:
    """A server with ``requirepass`` and the wrong password: start-up fails saying the server
    refused the credentials (not that it is unreachable), and shows neither password."""
    srv = Server(tmp_path / "auth", password=PASSWORD)
    srv.start()
    try:
        tier = make_tier(srv.url, host, password="not-the-" + PASSWORD, max_attempts=1)
        with pytest.raises(kc.TierUnavailableError) as err:
            await asyncio.wait_for(tier.serve(), 10)
        assert f"server {srv.url} refused the credentials" in str(err.value)
        assert "AuthenticationError" in str(err.value) and PASSWORD not in str(err.value)
    finally:
        srv.stop()


# -- single server ------------------------------------------------------------------------
async def test_roundtrip_layout_and_value_are_the_fs_block_file(
    server: Server, host: kc.HostBuffer, tmp_path: Path
) -> None:
    """MISS, store, HIT (a second tier asks the server), byte-exact load; the key is the s3
    object key (``prefix/`` + the fs relative path) and the value is the fs block file byte for
    byte, in both directions (fs serves a value copied out, valkey serves a file copied in)."""
    mapper = FileMapper(default_identity("test-model"))
    tier = make_tier(server.url, host, prefix="/team/kv/")
    other = make_tier(server.url, host, prefix="team/kv")
    fs = FileSystemTier(host, tmp_path, mapper)
    client = sync_client(server.url)
    async with running(tier, other, fs):
        assert await lookups(tier, [key(0)], kc.ReqContext("a")) == [R.MISS]
        assert (await store(tier, host, [1, 2], [0, 1])).success
        assert await lookups(other, [key(1), key(2), key(3)], kc.ReqContext("b")) == [
            R.HIT,
            R.HIT,
            R.MISS,
        ]
        result = await load(other, [1], [5])
        assert result.success and result.transfer_size == BLOCK
        assert bytes(host.row(5)) == pattern(1)
        name = f"team/kv/{mapper.relative_path(key(1))}"
        assert tier.object_key(key(1)) == name
        blob = client.get(name)  # sent as header, row and padding: one value all the same
        assert blob == fs_block_file(key(1), pattern(1))
        path = Path(fs.path_of(key(1)))
        path.parent.mkdir(parents=True)
        path.write_bytes(blob)
        assert (await fs.submit_load(job([key(1)], [9], True))).success
        assert bytes(host.row(9)) == pattern(1)
        host.row(2)[:] = pattern(8)
        assert (await fs.submit_store(job([key(8)], [2], False))).success
        client.set(tier.object_key(key(8)), Path(fs.path_of(key(8))).read_bytes())
        assert (await load(tier, [8], [10])).success
        assert bytes(host.row(10)) == pattern(8)
        assert list(tier.take_events()) == [
            kc.OffloadingEvent([key(1), key(2)], kc.Medium.STORAGE, False, "valkey")
        ]
    client.close()


@pytest.mark.parametrize("protocol", [2, 3])
async def test_large_values_load_byte_exact_over_either_protocol(
    server: Server, protocol: int
) -> None:
    """Blocks of 1 MiB (each value arrives in many socket chunks) store and load byte-exact over
    RESP2 and RESP3 (``?protocol=``), several loads on each of two connections; the loads
    receive into two reused value buffers, one per command in flight (``max_concurrency``)."""
    block = 1 << 20
    big = kc.HostBuffer(12, block)
    try:
        tier = make_tier(f"{server.url}?protocol={protocol}", big, max_concurrency=2)
        async with running(tier):
            assert (await store(tier, big, list(range(6)), list(range(6)))).success
            big.tensor()[6:].zero_()
            result = await load(tier, list(range(6)), list(range(6, 12)))
            assert result.success and result.transfer_size == 6 * block
            assert [bytes(big.row(6 + i)) == pattern(i, block) for i in range(6)] == [True] * 6
            assert len(tier._values) == 2
    finally:
        big.close()


async def test_invalidate_deletes_the_values(server: Server, host: kc.HostBuffer) -> None:
    """Issue #21 item 6: invalidate deletes the values on the server, answers how many existed
    and turns cached HIT verdicts into MISS."""
    tier = make_tier(server.url, host)
    async with running(tier):
        assert (await store(tier, host, [0, 1], [0, 1])).success
        ctx = kc.ReqContext("r")
        assert await lookups(tier, [key(0)], ctx) == [R.HIT]
        assert await tier.invalidate([key(0), key(1), key(2)]) == 2
        assert await tier.contains([key(0), key(1)]) == [False, False]
        assert await lookups(tier, [key(0)], ctx) == [R.MISS]


async def test_missing_block_is_a_clean_miss_and_the_batch_reports_what_loaded(
    server: Server, host: kc.HostBuffer
) -> None:
    """A load batch with a never-stored block fails that block only: the others land, the
    missing one is counted (``missing_blocks``) and becomes a MISS for the request."""
    tier = make_tier(server.url, host)
    async with running(tier):
        assert (await store(tier, host, [0, 2], [0, 1])).success
        ctx = kc.ReqContext("r")
        assert await lookups(tier, [key(0), key(1), key(2)], ctx) == [R.HIT, R.MISS, R.HIT]
        result = await load(tier, [0, 1, 2], [5, 6, 7])
        assert not result.success and set(result.successful_keys or ()) == {key(0), key(2)}
        assert bytes(host.row(5)) == pattern(0) and bytes(host.row(7)) == pattern(2)
        assert tier.counters["missing_blocks"] == 1 and tier.counters["errors"] == 0


async def test_value_gone_between_lookup_and_load_is_a_debug_miss_errors_stay_warnings(
    server: Server, host: kc.HostBuffer, caplog: pytest.LogCaptureFixture
) -> None:
    """A value the server dropped after the lookup said HIT (``DEL`` on the server, as its
    eviction does) fails its load as a miss: counted (``missing_blocks``), a debug line, no
    warning (it used to be the tier's first-failure warning). A real error after it, a value
    of the wrong type (``WRONGTYPE``), is still the warning of the first failed load; in a job
    with both, the error is the one named."""
    caplog.set_level(logging.DEBUG, logger="kvcascade")
    tier = make_tier(server.url, host)
    client = sync_client(server.url)
    async with running(tier):
        assert (await store(tier, host, [0, 1, 2], [0, 1, 2])).success
        ctx = kc.ReqContext("r")
        assert await lookups(tier, [key(0), key(1), key(2)], ctx) == [R.HIT] * 3
        client.delete(tier.object_key(key(0)))  # evicted between lookup and load
        assert not (await load(tier, [0], [5])).success
        assert tier.counters["missing_blocks"] == 1 and tier.counters["load_failures"] == 1
        records = [r for r in caplog.records if "load_failures so far" in r.getMessage()]
        assert [r.levelname for r in records] == ["DEBUG"]
        assert "valkey GET: no value under" in records[0].getMessage()
        assert tier_helpers.kvcascade_warnings(caplog.records) == []

        client.delete(tier.object_key(key(1)), tier.object_key(key(2)))
        client.rpush(tier.object_key(key(2)), b"not a block")  # WRONGTYPE for GET
        caplog.clear()
        assert not (await load(tier, [1, 2], [6, 7])).success
        [message] = tier_helpers.kvcascade_warnings(caplog.records)
        assert "valkey load of block 1 failed: valkey GET failed (ResponseError)" in message
        assert message.endswith("(load_failures so far: 2)")
        assert tier.counters["missing_blocks"] == 2
    client.close()


async def test_corrupt_foreign_or_short_value_is_a_miss_and_deleted(
    server: Server, host: kc.HostBuffer
) -> None:
    """A flipped payload byte, another key's value, a truncated value: each load fails, the
    primary row is left untouched, the value is deleted and counted (``corrupt_blocks``)."""
    tier = make_tier(server.url, host)
    client = sync_client(server.url)
    async with running(tier):
        assert (await store(tier, host, [0, 1, 2], [0, 1, 2])).success
        names = [tier.object_key(key(i)) for i in range(3)]
        blob = bytearray(client.get(names[0]))
        blob[HEADER_BYTES + 10] ^= 1
        client.set(names[0], bytes(blob))
        client.set(names[1], client.get(names[2]))  # a foreign block (key digest differs)
        client.set(names[2], client.get(names[2])[:-4096])
        for i in range(3):
            host.row(8)[:] = b"\x55" * BLOCK
            assert not (await load(tier, [i], [8])).success
            assert bytes(host.row(8)) == b"\x55" * BLOCK
        assert tier.counters["corrupt_blocks"] == 3
        assert client.exists(*names) == 0
        assert await lookups(tier, [key(0)], kc.ReqContext("x")) == [R.MISS]
    client.close()


async def test_block_evicted_by_the_server_is_a_clean_miss(
    tmp_path: Path, host: kc.HostBuffer
) -> None:
    """A server with ``maxmemory`` and ``allkeys-lru``: storing far more than fits evicts the
    oldest blocks on the server; those are MISS at lookup and a clean failed block at load
    (``missing_blocks``, no error), the newest load byte-exact, stores never fail."""
    srv = Server(tmp_path / "lru", "--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru")
    srv.start()
    try:
        tier = make_tier(srv.url, host)
        async with running(tier):
            for i in range(0, 160, 8):  # 160 values of 12 KiB: ~2 MiB of payload alone
                assert (await store(tier, host, list(range(i, i + 8)), list(range(8)))).success
            got = await lookups(tier, [key(i) for i in range(160)], kc.ReqContext("r"))
            # The server's LRU is sampled (approximate): some old block is gone, not always 0.
            evicted = got.index(R.MISS)
            assert evicted < 80 and got[-1] == R.HIT
            assert (await load(tier, [159], [9])).success
            assert bytes(host.row(9)) == pattern(159)
            assert not (await load(tier, [evicted], [10])).success
            assert tier.counters["missing_blocks"] == 1
            assert tier.counters["errors"] == tier.counters["store_failures"] == 0
    finally:
        srv.stop()


async def test_full_server_refuses_stores_logs_once_and_recovers(
    tmp_path: Path, host: kc.HostBuffer, caplog: pytest.LogCaptureFixture
) -> None:
    """``maxmemory`` with ``noeviction``: the start-up warns, a store past the limit fails with
    the server's OOM answer, stores are then dropped without a command for ``DOWN_RETRY_S``,
    loads keep working; once the server has room, stores succeed again (no restart)."""
    caplog.set_level(logging.INFO, logger="kvcascade")
    srv = Server(tmp_path / "oom", "--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    srv.start()
    try:
        tier = make_tier(srv.url, host)
        async with running(tier):
            assert "noeviction" in caplog.text
            assert (await store(tier, host, [0])).success
            failed = None
            for i in range(1, 400, 4):
                result = await store(tier, host, list(range(i, i + 4)), [1, 2, 3, 4])
                if not result.success:
                    failed = result
                    break
            assert failed is not None and "full (OutOfMemoryError)" in (failed.error or "")
            dropped = await store(tier, host, [1000], [5])
            assert not dropped.success and "full; store dropped" in (dropped.error or "")
            assert tier.counters["store_dropped_blocks"] == 1
            assert (await load(tier, [0], [9])).success and bytes(host.row(9)) == pattern(0)
            oom = (
                f"valkey tier {tier.name}: server {srv.url} is out of memory (it refused a "
                "write); stores are dropped until it takes one again"
            )

            def warnings() -> list[str]:
                return tier_helpers.kvcascade_warnings(caplog.records)

            assert warnings()[1:] == [oom]  # after the noeviction one; no job-failure warning
            # Past the window the server still refuses: the same episode, no second warning
            # (there was one per DOWN_RETRY_S window: 8 in a replay). Still refusing is made
            # certain: once the refused command's buffers are freed, a server filled to just
            # past 2 MB may fit one more small block (it did, on every run on one machine).
            srv.cli("CONFIG", "SET", "maxmemory", "1")
            await asyncio.sleep(valkey_module.DOWN_RETRY_S + 0.1)
            again = await store(tier, host, [1001], [5])
            assert not again.success and "full (OutOfMemoryError)" in (again.error or "")
            assert warnings()[1:] == [oom]
            srv.cli("CONFIG", "SET", "maxmemory", "0")
            await asyncio.sleep(valkey_module.DOWN_RETRY_S + 0.1)
            assert (await store(tier, host, [2000], [6])).success
            assert f"server {srv.url} takes stores again" in caplog.text
            srv.cli("CONFIG", "SET", "maxmemory", "1")  # full again: a new episode
            refused = await store(tier, host, [3000], [7])
            assert not refused.success and "full (OutOfMemoryError)" in (refused.error or "")
            assert warnings()[1:] == [oom, oom]
    finally:
        srv.stop()


async def test_server_restart_degrades_then_recovers_without_restart(
    tmp_path: Path, host: kc.HostBuffer, caplog: pytest.LogCaptureFixture
) -> None:
    """The server killed: the first command fails and marks it down (one warning), then
    lookups MISS, stores are dropped and loads fail without a command; restarted empty on the
    same port, the tier answers again after ``DOWN_RETRY_S`` (one warning line): old blocks are
    misses, new ones round-trip."""
    caplog.set_level(logging.INFO, logger="kvcascade")
    srv = Server(tmp_path / "restart")
    srv.start()
    try:
        tier = make_tier(srv.url, host, max_attempts=1, timeout_s=1)
        async with running(tier):
            assert (await store(tier, host, [0])).success
            srv.kill()
            first = await store(tier, host, [1])
            assert not first.success and "unreachable" in (first.error or "")
            assert not (await store(tier, host, [2])).success
            assert tier.counters["store_dropped_blocks"] == 1
            assert await lookups(tier, [key(0)], kc.ReqContext("a")) == [R.MISS]
            assert not (await load(tier, [0], [9])).success
            srv.start()
            await asyncio.sleep(valkey_module.DOWN_RETRY_S + 0.1)
            assert await lookups(tier, [key(0)], kc.ReqContext("b")) == [R.MISS]
            assert (await store(tier, host, [3])).success
            assert (await load(tier, [3], [10])).success and bytes(host.row(10)) == pattern(3)
        assert caplog.text.count("unreachable; lookups miss") == 1
        assert caplog.text.count("answers again") == 1
    finally:
        srv.stop()


async def test_paused_server_times_out_per_attempt_then_recovers(
    tmp_path: Path, host: kc.HostBuffer
) -> None:
    """A server paused (SIGSTOP) accepts connections but answers nothing: a load and a store
    each fail by ``timeout_s`` on every attempt (the job's own ``io_timeout_s`` never passes),
    the server is marked down, the row is untouched; resumed (SIGCONT), the tier answers again
    after ``DOWN_RETRY_S`` and the block stored before loads byte-exact."""
    srv = Server(tmp_path / "paused")
    srv.start()
    try:
        tier = make_tier(srv.url, host, timeout_s=0.3, max_attempts=2, io_timeout_s=60)
        async with running(tier):
            assert (await store(tier, host, [0])).success
            srv.signal(signal.SIGSTOP)
            try:
                host.row(9)[:] = b"\x55" * BLOCK
                failed = await load(tier, [0], [9])
                assert not failed.success and "unreachable (TimeoutError)" in (failed.error or "")
                assert bytes(host.row(9)) == b"\x55" * BLOCK
                assert not (await store(tier, host, [1])).success  # marked down: dropped
                assert tier.counters["store_dropped_blocks"] == 1
                await asyncio.sleep(valkey_module.DOWN_RETRY_S + 0.1)
                again = await store(tier, host, [2], [2])
                assert not again.success and "unreachable (TimeoutError)" in (again.error or "")
            finally:
                srv.signal(signal.SIGCONT)
            await asyncio.sleep(valkey_module.DOWN_RETRY_S + 0.1)
            assert (await load(tier, [0], [9])).success and bytes(host.row(9)) == pattern(0)
            assert tier.counters["timeouts"] == 0
    finally:
        srv.stop()


# -- replay --------------------------------------------------------------------------------
def replay_argv(tmp_path: Path, url: str, out: Path) -> list[str]:
    """``kvcascade replay`` arguments for a trace of 6 conversations served round-robin, each
    turn one block longer, through GPU and CPU tiers too small to keep them: the returning
    turns are served by the valkey tier at ``url``."""
    trace = tmp_path / "trace.jsonl"
    lines = []
    for i in range(48):
        chat, turn = i % 6, i // 6
        lines.append(json.dumps({"hash_ids": [chat * 1000 + j for j in range(turn + 2)]}))
    trace.write_text("\n".join(lines) + "\n")
    argv = ["replay", str(trace), "--block-bytes", "4096", "--cpu-blocks", "8"]
    return [*argv, "--gpu-blocks", "16", "--no-fs", "--valkey", url, "--json", str(out)]


def test_cli_replay_with_valkey(
    server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvcascade replay --no-fs --valkey URL``: conversations that come back after the small
    GPU and CPU tiers dropped them are served by the valkey tier, byte-exact (the replay checks
    every loaded byte); hits and traffic are in the table and the JSON report."""
    out = tmp_path / "r.json"
    assert main([*replay_argv(tmp_path, server.url, out), "--quiet"]) == 0
    report = json.loads(out.read_text())
    assert report["hit_blocks"]["valkey"] > 0 and report["mismatched_blocks"] == 0
    assert report["bytes"]["cpu_to_valkey"] > 0 and report["bytes"]["valkey_to_cpu"] > 0
    assert report["config"]["secondary_tiers"] == [{"type": "valkey", "url": server.url}]
    table = capsys.readouterr().out
    assert "hit blocks: valkey" in table and "bytes cpu → valkey" in table


def test_replay_report_hides_the_valkey_password(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A server with ``requirepass``: ``replay --valkey URL --config`` with the tier's
    ``password`` authenticates (hits), and the JSON report and the table show ``***`` instead
    of the password."""
    srv = Server(tmp_path / "auth", password=PASSWORD)
    srv.start()
    try:
        out = tmp_path / "r.json"
        cfg = {"secondary_tiers": [{"type": "valkey", "password": PASSWORD}]}
        argv = [*replay_argv(tmp_path, srv.url, out), "--config", json.dumps(cfg)]
        assert main([*argv, "--quiet"]) == 0
        report = json.loads(out.read_text())
        assert report["hit_blocks"]["valkey"] > 0
        assert report["config"]["secondary_tiers"][0]["password"] == "***"
        assert PASSWORD not in out.read_text() and PASSWORD not in capsys.readouterr().out
    finally:
        srv.stop()


# -- back-pressure ------------------------------------------------------------------------
def test_admission_budget_follows_the_measured_rate(host: kc.HostBuffer) -> None:
    """The admission rule of kvcascade/backpressure.py on its own clock: before any rate a tier
    may queue up to the cap; a stalled window drops it to the floor; one job always goes when
    nothing is queued; a fast window raises the budget back (bounded by the cap); drops are
    counted on the tier's metric."""
    now = [0.0]
    tiers = [kc.MemoryTier(host, name="slow")]
    metrics = TieringMetrics(["slow"])
    adm = CascadeAdmission(tiers, 100, metrics, floor_blocks=4, clock=lambda: now[0])
    assert adm.cap == 50 and adm.budget(0) == 50
    assert all(adm.admit(0, 10) for _ in range(5)) and not adm.admit(0, 1)
    now[0] = 1.0  # a window of 1 s with nothing finished: live rate 0 → floor
    assert adm.budget(0) == 4
    adm.finished(0, 10)  # closes the window: 10 blocks in 1 s
    assert adm.budget(0) == 10 and not adm.admit(0, 2)
    for _ in range(4):
        adm.finished(0, 10)
    assert metrics.value("cascade_queued_blocks", 0) == 0
    assert adm.admit(0, 70)  # nothing queued: one job always goes
    now[0] = 1.1
    adm.finished(0, 70)  # 70 blocks in 0.1 s: 700 blocks/s, averaged with 10: budget = cap
    assert adm.budget(0) == 50
    assert metrics.value("cascade_dropped_blocks", 0) == 3
    assert metrics.value("cascade_throughput_bytes", 0) == pytest.approx(355 * BLOCK)
    with pytest.raises(ValueError, match="max_lag_s out of range: 0"):
        CascadeAdmission(tiers, 100, metrics, max_lag_s=0)


BP_BLOCK = 64 * 1024
BP_SLOTS = 48


async def test_slow_server_back_pressure_keeps_primary_stores_and_recovers(
    server: Server, tmp_path: Path
) -> None:
    """An engine storing 2 new blocks per step through the synchronous hooks while the valkey
    server is throttled to 1 MiB/s by a proxy (an fs tier beside it keeps up): no GPU→CPU store
    is refused for want of a primary slot, the cascades the slow tier cannot take are dropped
    and counted for that tier only, every block the valkey tier reports stored loads back
    byte-exact, the fs tier has every block; throttle lifted, the valkey tier takes every store
    again."""
    host = kc.HostBuffer(BP_SLOTS, BP_BLOCK)
    primary = CPUOffloadingManager(BP_SLOTS)
    mapper = FileMapper(default_identity("test-model"))
    fs = FileSystemTier(host, tmp_path / "fs", mapper)
    payloads: dict[bytes, bytes] = {}

    def step(coord: TieringCoordinator, i: int) -> None:
        ctx = kc.ReqContext(f"r{i}")
        coord.on_new_request(ctx)
        keys = [key(10_000 + 2 * i), key(10_001 + 2 * i)]
        out = coord.prepare_store(keys, ctx)
        assert out is not None, f"step {i}: the primary tier refused a store (all pinned)"
        for k, slot in zip(out.keys_to_store, out.store_spec.block_ids, strict=True):
            payloads[k] = pattern(int.from_bytes(k[:4], "big"), BP_BLOCK)
            host.row(int(slot))[:] = payloads[k]
        coord.complete_store(out.keys_to_store, ctx)
        coord.on_request_finished(ctx)
        coord.on_schedule_end()

    try:
        async with ThrottleProxy(server.port, rate=1 << 20) as proxy:
            vk = make_tier(proxy.url, host, timeout_s=20, io_timeout_s=60)
            async with running(vk, fs):
                coord = TieringCoordinator(primary, [vk, fs])
                for i in range(150):
                    step(coord, i)
                    await asyncio.sleep(0.005)
                dropped = coord.metrics.value("cascade_dropped_blocks", 0)
                assert dropped > 0 and coord.metrics.value("cascade_dropped_blocks", 1) == 0
                assert coord.metrics.value("cascade_queued_blocks", 0) <= BP_SLOTS // 2
                proxy.rate = None
                await vk.drain()
                await fs.drain()
                coord.poll_now()
                admitted_run, i = 0, 150
                while admitted_run < 30 and i < 600:  # until 30 steps in a row were admitted
                    before = coord.metrics.value("cascade_dropped_blocks", 0)
                    step(coord, i)
                    await vk.drain()
                    coord.poll_now()
                    same = coord.metrics.value("cascade_dropped_blocks", 0) == before
                    admitted_run = admitted_run + 1 if same else 0
                    i += 1
                assert admitted_run == 30
                assert coord.metrics.value("cascade_throughput_bytes", 0) > 0
                await fs.drain()
                coord.poll_now()
                stored = [k for e in vk.take_events() for k in e.keys]
                assert len(stored) + dropped == len(payloads) == 2 * i
                assert await fs.contains(list(payloads)) == [True] * len(payloads)
                # nothing lost or corrupted: every stored block loads back byte-exact
                for tier, keys in ((vk, stored), (fs, list(payloads))):
                    for n in range(0, len(keys), BP_SLOTS):
                        part = keys[n : n + BP_SLOTS]
                        slots = list(range(len(part)))
                        assert (await tier.submit_load(job(part, slots, True))).success
                        for k, slot in zip(part, slots, strict=True):
                            assert bytes(host.row(slot)) == payloads[k]
    finally:
        host.close()


# -- cluster --------------------------------------------------------------------------------
async def test_cluster_roundtrip_spreads_blocks_over_every_master(
    cluster: Cluster, host: kc.HostBuffer
) -> None:
    """On a 3-master cluster the blocks of one job land on every master (one key per block:
    value and header never split across slots); a probe batch spanning slots answers per key;
    loads are byte-exact; a corrupt value is deleted on whichever node holds it."""
    tier = make_tier(cluster.url, host, cluster=True)
    client = sync_client(cluster.url, cluster=True)
    async with running(tier):
        assert (await store(tier, host, list(range(12)), list(range(12)))).success
        assert all(int(m.cli("DBSIZE")) > 0 for m in cluster.masters)
        got = await lookups(tier, [key(i) for i in range(16)], kc.ReqContext("r"))
        assert got == [R.HIT] * 12 + [R.MISS] * 4
        for slot in range(12):
            host.row(slot)[:] = bytes(BLOCK)
        assert (await load(tier, list(range(12)), list(range(12)))).success
        assert all(bytes(host.row(i)) == pattern(i) for i in range(12))
        name = tier.object_key(key(5))
        blob = bytearray(client.get(name))
        assert blob == fs_block_file(key(5), pattern(5))
        blob[-1 - (file_size(BLOCK) - HEADER_BYTES - BLOCK)] ^= 0xFF  # last payload byte
        client.set(name, bytes(blob))
        assert not (await load(tier, [5], [13])).success
        assert tier.counters["corrupt_blocks"] == 1 and client.exists(name) == 0
    client.close()


async def test_cluster_eviction_by_the_masters_is_a_clean_miss(cluster: Cluster) -> None:
    """Each master with ``allkeys-lru`` and 4 MiB of room: storing ~6.8 MiB of values per master
    evicts old blocks on the masters; those are MISS at lookup and a clean failed block at load
    (``missing_blocks``, no error), the newest load byte-exact, no store fails. (With 1 MiB of
    room a master sometimes answered OOM: its clients' buffers alone can take that much.) The
    masters' limits are lifted afterwards (the module's cluster is shared)."""
    block = 64 << 10
    big = kc.HostBuffer(16, block)
    for master in cluster.masters:
        used = int(master.cli("INFO", "memory").split("used_memory:")[1].split()[0])
        master.cli("CONFIG", "SET", "maxmemory-policy", "allkeys-lru")
        master.cli("CONFIG", "SET", "maxmemory", str(used + (4 << 20)))
    try:
        tier = make_tier(cluster.url, big, cluster=True)
        async with running(tier):
            for i in range(0, 300, 8):  # 300 values of 68 KiB over 3 masters
                ids = list(range(i, min(i + 8, 300)))
                assert (await store(tier, big, ids, list(range(len(ids))))).success
            got = await lookups(tier, [key(i) for i in range(300)], kc.ReqContext("r"))
            evicted = got.index(R.MISS)
            assert evicted < 150 and got[-1] == R.HIT
            assert (await load(tier, [299], [9])).success
            assert bytes(big.row(9)) == pattern(299, block)
            assert not (await load(tier, [evicted], [10])).success
            assert tier.counters["missing_blocks"] == 1
            assert tier.counters["errors"] == tier.counters["store_failures"] == 0
    finally:
        for master in cluster.masters:
            master.cli("CONFIG", "SET", "maxmemory", "0")
        big.close()


async def test_cluster_failover_degrades_then_serves_the_replicated_blocks(
    cluster: Cluster, host: kc.HostBuffer
) -> None:
    """The first master (which has a replica) killed: while the cluster fails over the tier
    degrades (failed or dropped stores, misses), never raises; once the replica is master the
    same tier, not restarted, loads every block byte-exact (those of the killed master from its
    replica) and stores again. Runs last: it changes the module's cluster."""
    tier = make_tier(cluster.url, host, cluster=True, timeout_s=1, max_attempts=2)
    master, replica = cluster.masters[0], cluster.replica
    client = sync_client(cluster.url, cluster=True)
    on_master = [
        n
        for n in range(100, 200)
        if client.get_node_from_key(tier.object_key(key(n))).port == master.port
    ][:3]
    client.close()
    async with running(tier):
        assert (await store(tier, host, list(range(12)), list(range(12)))).success
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the replica has every write of its master
            offset = master.cli("INFO", "replication").split("master_repl_offset:")[1].split()[0]
            if f"offset={offset}," in master.cli("INFO", "replication"):
                break
            await asyncio.sleep(0.05)
        master.kill()
        results = [await store(tier, host, [n], [12]) for n in on_master]
        assert not all(r.success for r in results)  # degraded, reported as failed results
        deadline = time.monotonic() + 20
        while "role:master" not in replica.cli("INFO", "replication") or cluster.state() != "ok":
            assert time.monotonic() < deadline, "the replica did not take over"
            await asyncio.sleep(0.2)
        for slot in range(12):
            host.row(slot)[:] = bytes(BLOCK)
        deadline = time.monotonic() + 20
        while not (result := await load(tier, list(range(12)), list(range(12)))).success:
            assert time.monotonic() < deadline, f"no recovery after the failover: {result}"
            await asyncio.sleep(0.3)
        assert all(bytes(host.row(i)) == pattern(i) for i in range(12))
        assert (await store(tier, host, [200, 201], [12, 13])).success
        assert await lookups(tier, [key(200), key(201)], kc.ReqContext("f")) == [R.HIT, R.HIT]


# -- authenticated blocks (issue #21 item 5) ------------------------------------------------
BLOCK_SECRET = "kvcascade-valkey-block-secret-0123456789"  # tests assert it never shows up


async def test_authenticated_values_forged_refused_shared_by_the_same_secret(
    server: Server,
    host: kc.HostBuffer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With a secret: a value forged with valid checksums (:func:`fs_block_file`) fails its
    load, leaves the row untouched and is deleted; a tier with the same secret loads the
    writer's values, one with another secret fails the MAC and deletes them. The secret is in
    no log record."""
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("KVC_VK_SECRET", BLOCK_SECRET)
    monkeypatch.setenv("KVC_VK_OTHER", BLOCK_SECRET[::-1])
    prefix = f"t{next(_prefixes)}"
    writer = make_tier(server.url, host, prefix=prefix, auth_secret_env="KVC_VK_SECRET")
    reader = make_tier(server.url, host, prefix=prefix, auth_secret_env="KVC_VK_SECRET")
    other = make_tier(server.url, host, prefix=prefix, auth_secret_env="KVC_VK_OTHER")
    client = sync_client(server.url)
    async with running(writer, reader, other):
        assert (await store(writer, host, [1, 2])).success
        assert (await load(reader, [1], [8])).success and bytes(host.row(8)) == pattern(1)
        failed = await load(other, [2], [9])
        assert not failed.success and "MAC mismatch" in failed.error
        client.set(reader.object_key(key(3)), fs_block_file(key(3), pattern(99)))
        host.row(9)[:] = b"\x55" * BLOCK
        failed = await load(reader, [3], [9])
        assert not failed.success and "not authenticated" in failed.error
        assert bytes(host.row(9)) == b"\x55" * BLOCK
        names = [writer.object_key(key(i)) for i in (1, 2, 3)]
        assert [client.exists(n) for n in names] == [1, 0, 0]
    client.close()
    assert BLOCK_SECRET not in caplog.text and BLOCK_SECRET[::-1] not in caplog.text
