"""The S3 tier (issue #8) against a real S3 server on loopback (``moto_server`` in its own process,
:mod:`s3_fixtures`): the scenarios of vLLM's ``tests/v1/kv_offload/tiering/test_obj_tier.py`` in S3
terms, the object layout and format shared with the fs tier, faults injected by an HTTP proxy
(throttling, latency, resets, stalls), pool hygiene, multipart clean-up, degradation and recovery,
sharing between processes, and ``kvcascade replay`` with fs and s3 tiers.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import json
import logging
import math
import os
import re
import sys
import textwrap
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import s3_fixtures
from s3_fixtures import (
    ACCESS_KEY,
    SECRET_KEY,
    Fault,
    FaultProxy,
    MotoServer,
    blackhole,
    free_port,
)
from tier_helpers import BLOCK, job, key, load, lookups, pattern, running, store

import kvcascade as kc
from kvcascade import LookupResult as R
from kvcascade.replay.cli import main
from kvcascade.replay.run import replay
from kvcascade.replay.trace import TraceRequest
from kvcascade.tiers import s3 as s3_tier_module
from kvcascade.tiers._block_format import HEADER_BYTES, file_size
from kvcascade.tiers._file_mapper import FileMapper, default_identity
from kvcascade.tiers.fs import FileSystemTier
from kvcascade.tiers.registry import TierContext, create_secondary_tier
from kvcascade.tiers.s3 import S3Tier, s3_tier_from_config

moto = s3_fixtures.moto  # the session's moto_server process
bucket = s3_fixtures.bucket  # a fresh bucket on it

REPO = Path(__file__).resolve().parents[2]

# botocore's service models and aiobotocore's clients make the heap large enough that one full
# garbage collection inside a loop callback can pass the conftest's 1 s loop guard on a loaded
# machine (five tests of this file at once, with three other test runs beside it): every test
# of the file runs with the heap before it frozen (tests/conftest.py, frozen_heap).
pytestmark = pytest.mark.usefixtures("frozen_heap")


def tier_config(endpoint: str, bucket: str, **kw: Any) -> dict[str, Any]:
    return {
        "bucket": bucket,
        "endpoint_url": endpoint,
        "region": "us-east-1",
        "access_key": ACCESS_KEY,
        "secret_key": SECRET_KEY,
        "addressing_style": "path",
        # moto on a busy 2-core machine sometimes answers a HEAD after the 0.5 s default; the
        # probe deadline has its own tests (tests/tiers/test_slow_tier.py)
        "probe_timeout_s": 5.0,
        **kw,
    }


def make_tier(
    endpoint: str, bucket: str, host: kc.HostBuffer, fields: dict[str, Any] | None = None, **kw: Any
) -> S3Tier:
    mapper = FileMapper(default_identity(**{"model_name": "test-model", **(fields or {})}))
    return s3_tier_from_config(host, mapper, tier_config(endpoint, bucket, **kw))


@pytest.fixture
def host() -> Iterator[kc.HostBuffer]:
    buf = kc.HostBuffer(16, BLOCK)
    yield buf
    buf.close()


def fresh(tier: S3Tier) -> S3Tier:
    """Forget what the tier knows, so the next lookup asks the bucket."""
    tier._known.clear()
    return tier


# -- vLLM tests/v1/kv_offload/tiering/test_obj_tier.py in S3 terms ---------------------------
async def test_lookup_store_roundtrip_and_unrelated_key(
    moto: MotoServer, bucket: str, host: kc.HostBuffer
) -> None:
    """vLLM TestMockObjTierBasic test_lookup_empty_tier / test_store_and_lookup /
    test_lookup_unrelated_key_returns_false / test_store_then_load_roundtrip: empty tier MISS; store
    then HIT (also for a fresh tier asking the bucket); another key MISS; the load returns the
    stored bytes."""
    tier = make_tier(moto.endpoint, bucket, host)
    async with running(tier):
        assert await lookups(tier, [key(0)], kc.ReqContext("a")) == [R.MISS]
        assert (await store(tier, host, [1])).success
        assert await lookups(tier, [key(1), key(2)], kc.ReqContext("b")) == [R.HIT, R.MISS]
        assert await fresh(tier).contains([key(1), key(2)]) == [True, False]
        result = await load(tier, [1], [5])
        assert result.success and result.transfer_size == BLOCK
        assert bytes(host.row(5)) == pattern(1)


async def test_invalidate_deletes_the_objects(
    moto: MotoServer, bucket: str, host: kc.HostBuffer
) -> None:
    """Issue #21 item 6: invalidate deletes the objects (a fresh tier asking the bucket finds
    none), answers how many existed, and turns cached HIT verdicts into MISS."""
    tier = make_tier(moto.endpoint, bucket, host)
    async with running(tier):
        assert (await store(tier, host, [1, 2])).success
        assert await lookups(tier, [key(1)], kc.ReqContext("a")) == [R.HIT]
        assert await tier.invalidate([key(1), key(2), key(3)]) == 2
        assert await fresh(tier).contains([key(1), key(2)]) == [False, False]
        assert await lookups(tier, [key(1)], kc.ReqContext("a")) == [R.MISS]
        assert [e.removed for e in tier.take_events()][-1:] == [True]


async def test_independent_jobs_multi_block_and_partial_lookup(
    moto: MotoServer, bucket: str, host: kc.HostBuffer
) -> None:
    """vLLM TestMockObjTierBasic.test_multiple_jobs_tracked_independently, TestMockObjTierMultiBlock
    test_store_multiple_blocks / test_partial_block_lookup: two jobs both succeed; an 8-block store
    makes all 8 HIT; a lookup over stored and unstored keys answers per key."""
    tier = make_tier(moto.endpoint, bucket, host)
    async with running(tier):
        a, b = await asyncio.gather(store(tier, host, [0, 1], [0, 1]), store(tier, host, [2], [2]))
        assert a.success and b.success and a.job_id != b.job_id
        assert (await store(tier, host, list(range(10, 18)), list(range(3, 11)))).success
        fresh(tier)
        got = await lookups(tier, [key(i) for i in range(10, 20)], kc.ReqContext("r"))
        assert got == [R.HIT] * 8 + [R.MISS] * 2
        assert {r.job_id for r in tier.get_finished_jobs()} >= {a.job_id, b.job_id}


async def test_object_key_and_format_are_the_fs_tiers(
    moto: MotoServer, bucket: str, host: kc.HostBuffer, tmp_path: Path
) -> None:
    """Object key = ``prefix/`` + the fs relative path (no ``//``); the object is the fs block
    file byte for byte: an fs tier serves a downloaded object, the s3 tier an uploaded file."""
    fields = {"tp_size": 2, "parallel_agnostic": True, "config_replicated": True}
    mapper = FileMapper(default_identity(**{"model_name": "test-model", **fields}))
    tier = make_tier(moto.endpoint, bucket, host, fields=fields, prefix="/team/kv/")
    fs = FileSystemTier(host, tmp_path, mapper)
    client = moto.client()
    async with running(tier, fs):
        assert (await store(tier, host, [7])).success
        name = f"team/kv/{mapper.relative_path(key(7))}"
        assert tier.object_key(key(7)) == name and "//" not in name
        assert [o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]] == [name]
        blob = client.get_object(Bucket=bucket, Key=name)["Body"].read()
        assert len(blob) == file_size(BLOCK) and blob[HEADER_BYTES:][:BLOCK] == pattern(7)
        path = Path(fs.path_of(key(7)))
        path.parent.mkdir(parents=True)
        path.write_bytes(blob)
        assert (await fs.submit_load(job([key(7)], [9], True))).success
        assert bytes(host.row(9)) == pattern(7)
        # and the other way: an fs block file uploaded under the object key is served by s3
        host.row(1)[:] = pattern(8)
        assert (await fs.submit_store(job([key(8)], [1], False))).success
        client.put_object(
            Bucket=bucket, Key=tier.object_key(key(8)), Body=Path(fs.path_of(key(8))).read_bytes()
        )
        assert (await fresh(tier).submit_load(job([key(8)], [10], True))).success
        assert bytes(host.row(10)) == pattern(8)


async def test_failed_load_is_reported_and_marks_the_verdict_negative(
    moto: MotoServer, bucket: str, host: kc.HostBuffer
) -> None:
    """vLLM TestMockObjTierBasic test_failed_load_marks_verdict_negative /
    test_failed_transfer_reported: a cached HIT, the object deleted behind the tier's back: the
    promotion fails and the same request now sees MISS; a load of a never-stored key fails."""
    tier = make_tier(moto.endpoint, bucket, host)
    async with running(tier):
        assert (await store(tier, host, [1])).success
        ctx = kc.ReqContext("r")
        assert await lookups(tier, [key(1)], ctx) == [R.HIT]
        moto.client().delete_object(Bucket=bucket, Key=tier.object_key(key(1)))
        result = await load(tier, [1], [3])
        assert not result.success and "NoSuchKey" in (result.error or "")
        assert tier.lookup(key(1), ctx) == R.MISS
        assert not (await load(tier, [99], [4])).success
        assert tier.counters["load_failures"] == 2


async def test_partial_batch_reports_the_keys_that_loaded(
    moto: MotoServer, bucket: str, host: kc.HostBuffer
) -> None:
    """A load batch with a missing block fails and lists exactly the keys that did load."""
    tier = make_tier(moto.endpoint, bucket, host)
    async with running(tier):
        assert (await store(tier, host, [0, 2], [0, 1])).success
        result = await load(tier, [0, 1, 2], [5, 6, 7])
        assert not result.success
        assert set(result.successful_keys or ()) == {key(0), key(2)}
        assert bytes(host.row(5)) == pattern(0) and bytes(host.row(7)) == pattern(2)


async def test_pending_job_not_reported_until_done_and_drain_waits(
    moto: MotoServer, bucket: str, host: kc.HostBuffer
) -> None:
    """vLLM TestMockObjTierBasic test_pending_transfer_not_returned_until_done /
    test_drain_jobs_polls_until_transfers_complete: a job in flight is not in get_finished_jobs;
    drain waits for it and its result is kept for the next get_finished_jobs."""
    async with FaultProxy(moto.port) as proxy:
        proxy.faults.append(Fault("delay", lambda m, t: m == "PUT", seconds=0.3))
        tier = make_tier(proxy.endpoint, bucket, host)
        async with running(tier):
            for i in range(2):
                host.row(i)[:] = pattern(i)
            tier.submit_store(job([key(0), key(1)], [0, 1], False))
            assert tier.has_pending_work() and tier.get_finished_jobs() == []
            await tier.drain()
            assert not tier.has_pending_work()
            assert [r.success for r in tier.get_finished_jobs()] == [True]
            assert tier.get_finished_jobs() == []


async def test_submission_failures_and_successes_are_both_reported(
    moto: MotoServer, bucket: str, host: kc.HostBuffer
) -> None:
    """vLLM TestMockObjTierFailures
    test_submit_store_register_memory_failure_reported_in_get_finished /
    test_submit_load_register_memory_failure_reported_in_get_finished /
    test_submit_store_make_prepped_xfer_failure_reported_in_get_finished /
    test_failure_and_success_both_returned_by_get_finished: a job that cannot start (slot outside
    the primary tier) fails at once; it and an in-flight success are both reported, once each."""
    tier = make_tier(moto.endpoint, bucket, host)
    async with running(tier):
        bad_store = tier.submit_store(job([key(0)], [host.num_blocks], False))
        bad_load = tier.submit_load(job([key(0)], [host.num_blocks + 3], True))
        good = await store(tier, host, [1])
        assert good.success and not (await bad_store).success and not (await bad_load).success
        results = tier.get_finished_jobs()
        assert sorted(r.success for r in results) == [False, False, True]


async def test_shutdown_with_jobs_in_flight_and_idempotent_close(
    moto: MotoServer, bucket: str, host: kc.HostBuffer
) -> None:
    """vLLM TestMockObjTierShutdown test_shutdown_clears_in_flight_transfers /
    test_shutdown_idempotent: closing with a store in flight lets it finish, fails queued work,
    closes the client; closing again is harmless and later submits raise TierUnavailableError."""
    async with FaultProxy(moto.port) as proxy:
        proxy.faults.append(Fault("delay", lambda m, t: m == "PUT", seconds=0.3))
        tier = make_tier(proxy.endpoint, bucket, host, max_concurrency=1)
        started = asyncio.Event()
        actor = asyncio.create_task(tier.serve(started.set))
        await started.wait()
        host.row(0)[:] = pattern(0)
        first = tier.submit_store(job([key(0)], [0], False))
        queued = tier.submit_store(job([key(1)], [1], False))
        await asyncio.sleep(0.05)
        tier.close()
        tier.close()
        await asyncio.wait_for(actor, 10)
        assert (await first).success and not (await queued).success
        assert tier._client is None
        with pytest.raises(kc.TierUnavailableError):
            tier.submit_store(job([key(2)], [2], False))


async def test_events_only_for_successful_stores(
    moto: MotoServer, bucket: str, host: kc.HostBuffer
) -> None:
    """vLLM TestObjTierKVEvents test_successful_store_emits_stored_event /
    test_store_event_uses_configured_locality /
    test_mixed_job_results_emit_event_only_for_successful_job / test_load_job_emits_no_event /
    test_failed_transfer_emits_no_event / test_submission_failure_emits_no_event: a successful store
    emits one stored event (STORAGE, tier name, the job's keys); loads, failed stores and submission
    failures emit none."""
    async with FaultProxy(moto.port) as proxy:
        tier = make_tier(proxy.endpoint, bucket, host, name="bucket", max_attempts=1)
        async with running(tier):
            assert (await store(tier, host, [0, 1])).success
            assert (await load(tier, [0], [5])).success
            proxy.faults.append(Fault("error", lambda m, t: m == "PUT"))
            assert not (await store(tier, host, [2])).success
            assert not (await tier.submit_store(job([key(3)], [99], False))).success
            events = list(tier.take_events())
            assert events == [
                kc.OffloadingEvent([key(0), key(1)], kc.Medium.STORAGE, False, "bucket")
            ]


def test_config_keys_aliases_and_no_secret_anywhere(
    host: kc.HostBuffer, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """vLLM TestObjStoreConfig in kvcascade terms: ``obj`` is an alias; unknown keys, a missing
    bucket, a half credential pair and bad values are ConfigErrors, from the factory and when
    the CascadeConfig is built; no secret in repr or messages."""
    ctx = TierContext(host, default_identity("test-model"))
    tier = create_secondary_tier({"type": "obj", **tier_config("http://x:1", "bkt")}, ctx)
    assert isinstance(tier, S3Tier) and tier.name == "obj"
    assert SECRET_KEY not in repr(tier) and SECRET_KEY not in repr(vars(tier))
    mapper = FileMapper(default_identity("test-model"))
    for cfg, message in [
        ({"bucket": "bkt", "secret": "x"}, "unknown s3 tier keys \\['secret'\\]"),
        ({}, "needs 'bucket'"),
        ({"bucket": "My_Bucket"}, "s3 tier bucket 'My_Bucket' is not a valid bucket name"),
        ({"bucket": "bkt", "secret_key": SECRET_KEY}, "both access_key and secret_key"),
        ({"bucket": "bkt", "max_concurrency": 0}, "max_concurrency"),
        ({"bucket": "bkt", "read_timeout_s": -1}, "read_timeout_s"),
        ({"bucket": "bkt", "addressing_style": "sideways"}, "addressing_style"),
        ({"bucket": "bkt", "access_key": "a", "secret_key": 5}, "must be a string, got a secret"),
        ({"bucket": "bkt", "orphan_upload_age_s": -1}, "orphan_upload_age_s .*got -1"),
        ({"bucket": "bkt", "orphan_upload_age_s": float("nan")}, "orphan_upload_age_s .*got nan"),
        ({"bucket": "bkt", "orphan_upload_age_s": "1h"}, "orphan_upload_age_s .*got '1h'"),
    ]:
        with pytest.raises(kc.ConfigError, match=message) as info:
            s3_tier_from_config(host, mapper, cfg)
        assert SECRET_KEY not in str(info.value)
        # the same error when the CascadeConfig is built, before an fs tier listed first has
        # created its directories (max_concurrency 0 and addressing_style 'sideways' were
        # refused only by the factory, at open_cascade)
        fs = tmp_path / "fs"
        with pytest.raises(kc.ConfigError, match=message) as info:
            kc.CascadeConfig(
                block_bytes=BLOCK,
                cpu_blocks=4,
                model_name="test-model",
                secondary_tiers=[{"type": "fs", "root_dir": str(fs)}, {"type": "s3", **cfg}],
            )
        assert SECRET_KEY not in str(info.value) and not fs.exists()
    assert SECRET_KEY not in caplog.text


async def test_startup_probe_names_bucket_endpoint_and_code(
    moto: MotoServer, host: kc.HostBuffer, caplog: pytest.LogCaptureFixture
) -> None:
    """A missing bucket or a dead endpoint stops the tier at start with an error naming the
    bucket, the endpoint and the S3 error code — never the secret."""
    caplog.set_level(logging.DEBUG, logger="kvcascade")
    dead = f"http://127.0.0.1:{free_port()}"
    for endpoint, code, problem in [
        (moto.endpoint, "404", "bucket does not exist"),
        (dead, "EndpointConnectionError", "not reachable"),
    ]:
        tier = make_tier(endpoint, "no-such-bucket", host, max_attempts=1)
        with pytest.raises(kc.TierUnavailableError) as info:
            await asyncio.wait_for(tier.serve(), 20)
        text = str(info.value)
        assert "no-such-bucket" in text and endpoint in text and code in text
        assert f"{endpoint}: {problem} (" in text
        assert SECRET_KEY not in text and tier._client is None
    assert SECRET_KEY not in caplog.text


@pytest.mark.parametrize(
    ("name", "credentials", "problem"),
    [
        ("no-such-bucket", True, ": bucket does not exist (s3 head_bucket: 404)"),
        ("kvcascade-any", False, ": no credentials: give access_key and secret_key, or set"),
    ],
)
async def test_startup_error_says_what_is_wrong(
    moto: MotoServer,
    host: kc.HostBuffer,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    credentials: bool,
    problem: str,
) -> None:
    """Issue #21 item 10: against the real server the start-up error says "bucket does not
    exist" or "no credentials" (botocore's default chain finds none), not "not reachable" (a
    name outside S3's rules never gets there: the next test)."""
    for var in [v for v in os.environ if v.startswith("AWS_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    cfg = tier_config(moto.endpoint, name, max_attempts=1)
    if not credentials:
        del cfg["access_key"], cfg["secret_key"]
    tier = s3_tier_from_config(host, FileMapper(default_identity("test-model")), cfg)
    with pytest.raises(kc.TierUnavailableError) as info:
        await asyncio.wait_for(tier.serve(), 20)
    text = str(info.value)
    assert text.startswith(f"s3 tier 's3': bucket {name!r} at {moto.endpoint}{problem}")
    assert "not reachable" not in text and SECRET_KEY not in text


@pytest.mark.parametrize(
    "name", ["ab", "a" * 64, "Bad-Name", "bad_name", "Bad/Name", "-start", "end-", ".dot", ""]
)
def test_bad_bucket_name_is_refused_when_the_config_is_built(
    host: kc.HostBuffer, name: str
) -> None:
    """A bucket name outside S3's rules (3-63 lowercase letters, digits, dots, hyphens;
    alphanumeric at both ends) is a ConfigError naming it when the CascadeConfig is built and
    when the tier is constructed, before any request: the endpoint is a port where nothing
    listens, and nothing is asked of it."""
    rule = "is not a valid bucket name (3-63 lowercase letters, digits, dots or hyphens"
    cfg = tier_config(f"http://127.0.0.1:{free_port()}", name)
    with pytest.raises(kc.ConfigError, match=re.escape(f"s3 tier bucket {name!r} {rule}")):
        kc.CascadeConfig(
            block_bytes=BLOCK,
            cpu_blocks=4,
            model_name="test-model",
            secondary_tiers=[{"type": "s3", **cfg}],
        )
    with pytest.raises(kc.ConfigError, match=re.escape(f"s3 tier bucket {name!r} {rule}")):
        s3_tier_from_config(host, FileMapper(default_identity("test-model")), cfg)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"endpoint_url": "http://127.0.0.1:abc"}, "'http://127.0.0.1:abc' is not a valid URL"),
        ({"endpoint_url": "http://127.0.0.1:99999"}, "is not a valid URL (Port out of range"),
        ({"endpoint_url": "127.0.0.1:9000"}, "must be http:// or https://HOST[:PORT], got '127"),
        ({"max_bytes": 4096}, "max_bytes=4096 cannot hold one block object (8192 B for 4096 B"),
        ({"region": "us east 1"}, "region 'us east 1' is not a region name"),  # botocore's own
    ],
)
def test_bad_endpoint_or_max_bytes_is_refused_when_the_config_is_built(
    tmp_path, extra: dict, message: str
) -> None:
    """A malformed ``endpoint_url`` reached open_cascade as urllib's or botocore's bare
    ``ValueError`` (naming neither the tier nor the key), and a ``max_bytes`` below one block
    object was accepted and failed every store; an fs tier before the s3 tier had created its
    directories by then (found by a break-it run). Now the CascadeConfig refuses both, naming
    the value, before anything exists."""
    cfg = {"type": "s3", **tier_config("http://127.0.0.1:9", "kv-bucket"), **extra}
    with pytest.raises(kc.ConfigError, match=re.escape(message)):
        kc.CascadeConfig(
            block_bytes=4096,
            cpu_blocks=4,
            model_name="test-model",
            secondary_tiers=[{"type": "fs", "root_dir": str(tmp_path / "fs")}, cfg],
        )
    assert not (tmp_path / "fs").exists()


@pytest.mark.parametrize(
    ("endpoint", "message"),
    [
        ("http://127.0.0.1:9/path", "'http://127.0.0.1:9/path' has a path ('/path'): "),
        (
            "http://127.0.0.1:9?x=1&y=2",
            "'http://127.0.0.1:9' has a query (parameters ['x', 'y']): ",
        ),
        ("http://127.0.0.1:9#frag", "'http://127.0.0.1:9' has a fragment ('#frag'): "),
        (
            "http://user:pw@127.0.0.1:9",
            "'http://127.0.0.1:9' holds user-info before '@' (left out here): give credentials "
            "as access_key and secret_key, not in the URL",
        ),
    ],
)
def test_an_endpoint_with_more_than_host_and_port_is_refused_when_the_config_is_built(
    tmp_path: Path, host: kc.HostBuffer, endpoint: str, message: str
) -> None:
    """A path, a query, a fragment or user-info in ``endpoint_url`` passed the CascadeConfig
    and failed at start-up with a misleading message (an existing bucket "does not exist", a
    live endpoint "not reachable"), after an fs tier listed first had created its directory
    (found by a break-it run). Now each is a ConfigError naming the value (never the user-info)
    before anything exists; a trailing ``/`` is still an endpoint."""
    if "user-info" not in message:
        message += "an S3 endpoint is http(s)://HOST[:PORT] only (the bucket is its own key, "
        message += "'bucket'; a key prefix is 'prefix')"
    cfg = {"type": "s3", **tier_config(endpoint, "kv-bucket")}
    with pytest.raises(kc.ConfigError) as err:
        kc.CascadeConfig(
            block_bytes=4096,
            cpu_blocks=4,
            model_name="test-model",
            secondary_tiers=[{"type": "fs", "root_dir": str(tmp_path / "fs")}, cfg],
        )
    assert str(err.value) == f"s3 tier endpoint_url {message}"
    assert "user:" not in str(err.value) and "pw" not in str(err.value)
    assert not (tmp_path / "fs").exists()
    with pytest.raises(kc.ConfigError) as err:
        s3_tier_from_config(host, FileMapper(default_identity("m")), tier_config(endpoint, "kvb"))
    assert str(err.value) == f"s3 tier endpoint_url {message}"
    kc.CascadeConfig(
        cpu_blocks=4,
        model_name="m",
        secondary_tiers=[{"type": "s3", **tier_config("http://127.0.0.1:9/", "kv-bucket")}],
    )


def test_an_infinite_connect_timeout_is_refused_naming_it(host: kc.HostBuffer) -> None:
    """``connect_timeout_s=inf`` passed the ``> 0`` check, and a healthy endpoint was then
    reported ``not reachable`` at start-up (found by a break-it run)."""
    cfg = tier_config("http://127.0.0.1:9", "kv-bucket", connect_timeout_s=math.inf)
    message = "connect_timeout_s must be a finite number > 0, got inf"
    with pytest.raises(kc.ConfigError, match=message):
        s3_tier_from_config(host, FileMapper(default_identity("m")), cfg)


@pytest.mark.parametrize("name", ["abc", "a" * 63, "my.bucket-2", "0kv"])
def test_good_bucket_names_are_accepted(name: str) -> None:
    cfg = tier_config("http://127.0.0.1:9", name)
    config = kc.CascadeConfig(
        block_bytes=BLOCK, cpu_blocks=4, model_name="m", secondary_tiers=[{"type": "obj", **cfg}]
    )
    assert config.secondary_tiers[0]["bucket"] == name


async def test_corrupt_object_is_deleted_and_counted(
    moto: MotoServer, bucket: str, host: kc.HostBuffer
) -> None:
    """A flipped payload byte fails the checksum: block failed, object deleted, counted; a
    truncated object fails its length check the same way."""
    tier = make_tier(moto.endpoint, bucket, host)
    client = moto.client()
    async with running(tier):
        assert (await store(tier, host, [0, 1], [0, 1])).success
        for i, damage in [(0, "flip"), (1, "truncate")]:
            name = tier.object_key(key(i))
            blob = bytearray(client.get_object(Bucket=bucket, Key=name)["Body"].read())
            if damage == "flip":
                blob[HEADER_BYTES + 10] ^= 1
            else:
                del blob[-4096:]
            client.put_object(Bucket=bucket, Key=name, Body=bytes(blob))
            assert not (await load(tier, [i], [5])).success
        assert tier.counters["corrupt_blocks"] == 2
        assert client.list_objects_v2(Bucket=bucket).get("KeyCount") == 0


async def test_max_bytes_evicts_least_recently_used_objects(
    moto: MotoServer, bucket: str, host: kc.HostBuffer
) -> None:
    """With room for 3 objects, a 4th store deletes the LRU one (a load refreshed another);
    the removal is an event and counted."""
    tier = make_tier(moto.endpoint, bucket, host, max_bytes=3 * file_size(BLOCK))
    async with running(tier):
        for i in range(3):
            assert (await store(tier, host, [i], [i])).success
        assert (await load(tier, [0], [8])).success  # 0 becomes most recent: 1 is the LRU
        assert (await store(tier, host, [3], [3])).success
        names = {o["Key"] for o in moto.client().list_objects_v2(Bucket=bucket)["Contents"]}
        assert names == {tier.object_key(key(i)) for i in (0, 2, 3)}
        assert tier.counters["evictions"] == 1 and tier.used_bytes == 3 * file_size(BLOCK)
        removed = [e for e in tier.take_events() if e.removed]
        assert removed == [kc.OffloadingEvent([key(1)], kc.Medium.STORAGE, True, "s3")]


# -- faults through the proxy ---------------------------------------------------------------
async def test_slowdown_is_retried_then_succeeds(
    moto: MotoServer, bucket: str, host: kc.HostBuffer
) -> None:
    """503 SlowDown twice on the PUT and once on the GET: botocore's retries absorb them."""
    async with FaultProxy(moto.port) as proxy:
        tier = make_tier(proxy.endpoint, bucket, host, max_attempts=3)
        async with running(tier):
            proxy.faults.append(Fault("slowdown", lambda m, t: m == "PUT", times=2))
            proxy.faults.append(Fault("slowdown", lambda m, t: m == "GET", times=1))
            assert (await store(tier, host, [0])).success
            assert (await load(tier, [0], [3])).success and bytes(host.row(3)) == pattern(0)
            moves = [m for m, t in proxy.requests if m in ("PUT", "GET") and "uploads" not in t]
            assert moves == ["PUT"] * 3 + ["GET"] * 2


async def test_latency_beyond_the_read_timeout_fails_at_the_deadline(
    moto: MotoServer, bucket: str, host: kc.HostBuffer
) -> None:
    """A GET answered after 5 s with a 0.3 s read timeout and a 1 s job deadline: the job fails
    at its deadline (abandoned), then its rows are released; the next load works."""
    async with FaultProxy(moto.port) as proxy:
        tier = make_tier(proxy.endpoint, bucket, host, read_timeout_s=0.3, io_timeout_s=1.0)
        async with running(tier):
            assert (await store(tier, host, [0])).success
            proxy.faults.append(Fault("delay", lambda m, t: m == "GET", times=3, seconds=5))
            start = time.monotonic()
            result = await load(tier, [0], [3])
            assert not result.success and result.abandoned
            assert 0.9 < time.monotonic() - start < 2.5
            assert tier.counters["timeouts"] == 1
            for _ in range(100):
                if any(r.released for r in tier.get_finished_jobs()):
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError("no released result")
            assert tier.counters["stuck_threads"] == 0
            proxy.faults.clear()
            assert (await load(tier, [0], [4])).success


async def test_connection_reset_mid_body_fails_the_load_cleanly(
    moto: MotoServer, bucket: str, host: kc.HostBuffer
) -> None:
    """A TCP reset half way through the GET body: the load fails (not abandoned: its rows are
    free), the same request then sees MISS, a new request HIT, and a retry loads the block."""
    async with FaultProxy(moto.port) as proxy:
        tier = make_tier(proxy.endpoint, bucket, host, max_attempts=1)
        async with running(tier):
            assert (await store(tier, host, [0])).success
            ctx = kc.ReqContext("r")
            assert await lookups(tier, [key(0)], ctx) == [R.HIT]
            proxy.faults.append(Fault("reset", lambda m, t: m == "GET", times=1))
            result = await load(tier, [0], [3])
            assert not result.success and not result.abandoned
            assert tier.lookup(key(0), ctx) == R.MISS
            tier.on_request_finished(ctx)
            assert await lookups(tier, [key(0)], kc.ReqContext("s")) == [R.HIT]
            assert (await load(tier, [0], [4])).success and bytes(host.row(4)) == pattern(0)


async def test_cancelled_half_read_bodies_do_not_exhaust_the_pool(
    moto: MotoServer, bucket: str, host: kc.HostBuffer
) -> None:
    """10 × max_concurrency loads stall half way through their bodies and are cancelled at their
    deadline; every connection is closed, and a normal load still completes in time."""
    concurrency = 2
    async with FaultProxy(moto.port) as proxy:
        tier = make_tier(
            proxy.endpoint, bucket, host, max_concurrency=concurrency, io_timeout_s=0.5
        )
        async with running(tier):
            assert (await store(tier, host, [0, 1], [0, 1])).success
            stalled = tier.object_key(key(0))
            proxy.faults.append(Fault("stall", lambda m, t: m == "GET" and stalled in t))
            for _ in range(10):
                wave = [load(tier, [0], [2 + i]) for i in range(concurrency)]
                assert not any(r.success for r in await asyncio.gather(*wave))
            # Each load that reached the server stalled there; on a loaded machine a load can
            # pass its 0.5 s deadline before its GET is sent, so not every one arrives.
            assert concurrency <= proxy.faults[0].hits <= 10 * concurrency
            result = await load(tier, [1], [12])  # success: within its 0.5 s deadline
            assert result.success and bytes(host.row(12)) == pattern(1)


async def test_multipart_failure_after_the_first_part_leaves_no_upload(
    moto: MotoServer, bucket: str
) -> None:
    """A 6 MiB block goes up in two parts; part 2 failing (500, no retry) or stalling past the
    deadline (cancellation) aborts the upload: ListMultipartUploads stays empty; without faults
    the object arrives whole."""
    block = 6 * 1024 * 1024
    big = kc.HostBuffer(2, block)
    client = moto.client()
    try:
        async with FaultProxy(moto.port) as proxy:
            tier = make_tier(
                proxy.endpoint,
                bucket,
                big,
                max_attempts=1,
                io_timeout_s=2.0,
                multipart_threshold_bytes=1024 * 1024,
            )
            async with running(tier):
                part2 = "partNumber=2"
                proxy.faults.append(Fault("error", lambda m, t: m == "PUT" and part2 in t, times=1))
                assert not (await store(tier, big, [0], [0])).success
                assert client.list_multipart_uploads(Bucket=bucket).get("Uploads") is None
                proxy.faults.append(Fault("delay", lambda m, t: part2 in t, times=1, seconds=4))
                result = await store(tier, big, [1], [0])
                assert not result.success and result.abandoned
                while not any(r.released for r in tier.get_finished_jobs()):
                    await asyncio.sleep(0.05)
                assert client.list_multipart_uploads(Bucket=bucket).get("Uploads") is None
                assert (await store(tier, big, [2], [0])).success
                assert (await load(tier, [2], [1])).success
                assert bytes(big.row(1)) == pattern(2, block)
        assert client.list_objects_v2(Bucket=bucket)["KeyCount"] == 1
    finally:
        big.close()


async def test_cancelled_store_does_not_cancel_its_multipart_abort(
    moto: MotoServer, bucket: str
) -> None:
    """Defect 7 (aioboto3 #209): a store task cancelled during part 2, and cancelled again while
    its AbortMultipartUpload is on the way (held 0.5 s by the proxy, which drops a request whose
    client hangs up): the abort still reaches the server, so no incomplete upload is left."""
    block = 6 * 1024 * 1024  # two parts of max(threshold, 5 MiB)
    big = kc.HostBuffer(1, block)
    client = moto.client()
    try:
        async with FaultProxy(moto.port) as proxy:
            tier = make_tier(
                proxy.endpoint, bucket, big, max_attempts=1, multipart_threshold_bytes=1 << 20
            )
            proxy.faults.append(Fault("hold", lambda m, t: "partNumber=2" in t, seconds=30))
            proxy.faults.append(Fault("hold", lambda m, t: m == "DELETE", seconds=0.5))

            async def seen(method: str, part: str) -> None:
                while not any(m == method and part in t for m, t in proxy.requests):
                    await asyncio.sleep(0.01)

            async with running(tier):
                big.row(0)[:] = pattern(0, block)
                task = asyncio.create_task(tier._store_blocks([key(0)], [big.row(0)]))
                await seen("PUT", "partNumber=2")
                task.cancel()
                await seen("DELETE", "uploadId=")
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            assert client.list_multipart_uploads(Bucket=bucket).get("Uploads") is None
    finally:
        big.close()


async def test_startup_aborts_orphan_multipart_uploads_of_its_namespace_only(
    moto: MotoServer, bucket: str, host: kc.HostBuffer
) -> None:
    """Defect 7: uploads a killed process left under the tier's ``<prefix>/<namespace>/`` are
    aborted at start-up once older than ``orphan_upload_age_s`` (0 here: moto dates every upload
    2010-11-10, so an age cannot be told apart on it); an upload outside the prefix, or of
    another namespace, is untouched."""
    client = moto.client()
    mine = make_tier(moto.endpoint, bucket, host, prefix="kv").object_key(key(0))
    other_model = make_tier(
        moto.endpoint, bucket, host, fields={"model_name": "other"}, prefix="kv"
    ).object_key(key(0))
    outside = "elsewhere/" + mine.removeprefix("kv/")
    for name in (mine, other_model, outside):
        upload = client.create_multipart_upload(Bucket=bucket, Key=name)
        client.upload_part(
            Bucket=bucket, Key=name, UploadId=upload["UploadId"], PartNumber=1, Body=b"x" * 100
        )

    def incomplete() -> set[str]:
        return {u["Key"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])}

    assert incomplete() == {mine, other_model, outside}
    tier = make_tier(moto.endpoint, bucket, host, prefix="kv", orphan_upload_age_s=0)
    async with running(tier):
        assert tier.counters["orphan_uploads_aborted"] == 1
    assert incomplete() == {other_model, outside}


# -- degradation, sharing, replay -----------------------------------------------------------
@pytest.fixture
def killable(tmp_path: Path) -> Iterator[MotoServer]:
    """A moto server of its own, to be killed and restarted on the same port."""
    server = MotoServer(tmp_path / "moto.log")
    server.start()
    yield server
    server.stop()


def restart(server: MotoServer, bucket: str) -> None:
    """Start a killed server again on its port and recreate the (lost) bucket."""
    server.start()
    server.client().create_bucket(Bucket=bucket)


async def test_endpoint_down_degrades_then_resumes_without_restart(
    killable: MotoServer, host: kc.HostBuffer
) -> None:
    """Server killed: lookups MISS, stores dropped and counted, loads fail — all quickly;
    server back: the same tier stores and loads again."""
    killable.client().create_bucket(Bucket="kvc-down")
    tier = make_tier(killable.endpoint, "kvc-down", host, max_attempts=2, io_timeout_s=5.0)
    async with running(tier):
        assert (await store(tier, host, [0])).success
        killable.kill()
        start = time.monotonic()
        assert not (await store(tier, host, [1], [1])).success
        assert await fresh(tier).contains([key(0)]) == [False]
        assert not (await store(tier, host, [2], [2])).success
        assert not (await load(tier, [0], [3])).success
        assert time.monotonic() - start < 4.0
        assert tier.counters["store_dropped_blocks"] >= 1
        await asyncio.to_thread(restart, killable, "kvc-down")
        await asyncio.sleep(1.1)  # the endpoint is left alone for DOWN_RETRY_S
        assert (await store(tier, host, [4], [4])).success
        assert await fresh(tier).contains([key(4)]) == [True]
        assert (await load(tier, [4], [5])).success and bytes(host.row(5)) == pattern(4)


async def test_connect_timeout_degrades_the_tier_like_a_refused_connection(
    moto: MotoServer, bucket: str, host: kc.HostBuffer
) -> None:
    """Defect 8: the tier's port turns into a blackhole (connects time out, botocore's
    ConnectTimeoutError): the failed store marks the endpoint down, so the next store is dropped
    without a request, lookups miss and loads fail; nothing is treated as a data error: once the
    endpoint answers again the block stored before is still found and loads byte-exact."""
    port = free_port()
    tier = make_tier(
        f"http://127.0.0.1:{port}", bucket, host, connect_timeout_s=0.2, max_attempts=2
    )
    proxy = FaultProxy(moto.port, port=port)
    await proxy.__aenter__()
    async with running(tier):
        assert (await store(tier, host, [0])).success
        await proxy.__aexit__(None, None, None)
        with blackhole(port):
            first = await store(tier, host, [1], [1])
            assert not first.success and "ConnectTimeoutError" in (first.error or "")
            assert not (await store(tier, host, [2], [2])).success
            assert tier.counters["store_dropped_blocks"] == 1
            assert await lookups(tier, [key(0), key(3)], kc.ReqContext("r")) == [R.MISS] * 2
            assert not (await load(tier, [0], [4])).success
        async with FaultProxy(moto.port, port=port):
            await asyncio.sleep(1.1)  # the endpoint is left alone for DOWN_RETRY_S
            assert await fresh(tier).contains([key(0)]) == [True]
            assert (await load(tier, [0], [5])).success and bytes(host.row(5)) == pattern(0)
    assert tier.counters["corrupt_blocks"] == 0


@pytest.mark.parametrize(
    ("fault", "code"), [("hold", "ReadTimeoutError"), ("drop", "ConnectionClosedError")]
)
async def test_read_timeout_or_closed_connection_degrades_the_tier(
    moto: MotoServer, bucket: str, host: kc.HostBuffer, fault: str, code: str
) -> None:
    """Defect 8: a PUT unanswered past ``read_timeout_s`` (ReadTimeoutError) or a connection
    closed without an answer (ConnectionClosedError) on every attempt marks the endpoint down:
    the next store is dropped without a request."""
    async with FaultProxy(moto.port) as proxy:
        tier = make_tier(proxy.endpoint, bucket, host, read_timeout_s=0.3, max_attempts=1)
        async with running(tier):
            proxy.faults.append(Fault(fault, lambda m, t: m == "PUT", seconds=5))
            first = await store(tier, host, [0])
            assert not first.success and code in (first.error or "")
            puts = sum(m == "PUT" for m, _ in proxy.requests)
            assert not (await store(tier, host, [1], [1])).success
            assert tier.counters["store_dropped_blocks"] == 1
            assert sum(m == "PUT" for m, _ in proxy.requests) == puts


def conversations(requests: int, chats: int = 6) -> list[TraceRequest]:
    """A small multi-turn trace: ``chats`` conversations served round-robin, each turn one block
    longer than the last, so that a conversation comes back after the small GPU, CPU and fs
    tiers of :func:`replay_config` have dropped its blocks and only s3 still holds them."""
    out = []
    for i in range(requests):
        chat, turn = i % chats, i // chats
        ids = tuple(chat * 1000 + j for j in range(turn + 2))
        out.append(TraceRequest(i, i, len(ids) * 512, ids))
    return out


def replay_config(s3: dict[str, Any], fs_dir: Path) -> kc.CascadeConfig:
    return kc.CascadeConfig(
        block_bytes=4096,
        gpu_blocks=16,
        cpu_blocks=8,
        secondary_tiers=[
            {"type": "fs", "root_dir": str(fs_dir), "max_bytes": 4 * file_size(4096)},
            {"type": "s3", **s3},
        ],
        pending_write_timeout_s=30.0,
        model_name="test-model",
    )


async def test_server_killed_and_restarted_during_a_replay(
    killable: MotoServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replay through fs + s3, the server killed after 30 requests and started again (empty)
    after 50: the replay never hangs and every loaded block is byte-exact; s3 stores are dropped
    while it is down, and after the restart s3 stores again and serves hits (blocks stored since
    the restart: the killed server lost the others). The synchronous botocore client that
    creates the bucket (built once: its set-up holds the GIL for a second on a loaded machine)
    and the restart (seconds) run on threads; the replay waits for the restart before its next
    request."""
    admin = await asyncio.to_thread(killable.client)
    await asyncio.to_thread(admin.create_bucket, Bucket="kvc-replay")
    # Retry the endpoint soon after a failure: the 40 requests after the restart may take less
    # than the default second on a quiet machine.
    monkeypatch.setattr(s3_tier_module, "DOWN_RETRY_S", 0.05)
    s3 = tier_config(killable.endpoint, "kvc-replay", max_attempts=2, io_timeout_s=5.0)
    tiers: list[S3Tier] = []
    build = kc.Cascade.__init__

    def capture(self: kc.Cascade, config: kc.CascadeConfig, **kwargs: object) -> None:
        build(self, config, **kwargs)
        tiers.extend(t for t in self.tiers if isinstance(t, S3Tier))

    monkeypatch.setattr(kc.Cascade, "__init__", capture)
    marks: dict[str, collections.Counter[str]] = {}
    done = 0

    async def progress(n: int) -> None:
        nonlocal done
        done += n
        if done == 30:
            killable.kill()
            marks["killed"] = collections.Counter(tiers[0].counters)
        elif done == 50:
            marks["down"] = collections.Counter(tiers[0].counters)
            # the restart is over before the "back" mark, or a slow start would make it flaky
            await asyncio.to_thread(killable.start)
            await asyncio.to_thread(admin.create_bucket, Bucket="kvc-replay")
        elif done == 60:
            marks["back"] = collections.Counter(tiers[0].counters)

    report = await asyncio.wait_for(
        replay(conversations(90), replay_config(s3, tmp_path), progress), 60
    )
    assert report.requests == 90 and report.mismatched_blocks == 0
    killed, down, back, end = marks["killed"], marks["down"], marks["back"], tiers[0].counters
    assert down["store_dropped_blocks"] > killed["store_dropped_blocks"]
    # (store bytes may still grow a little after the kill: replies already on their way)
    assert end["store_bytes"] > back["store_bytes"] and end["load_bytes"] > back["load_bytes"]
    assert report.hit_blocks["s3"] > 0


_SHARE_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys
    import torch
    import kvcascade as kc

    async def main():
        config = kc.CascadeConfig(**json.loads(sys.argv[1]))
        keys = [bytes.fromhex(k) for k in json.loads(sys.argv[2])]
        payload = bytearray.fromhex(sys.argv[3])
        async with kc.open_cascade(config) as cascade:
            kv = cascade.device.kv
            kv[: len(keys)] = torch.frombuffer(payload, dtype=torch.int8).view(len(keys), -1)
            ctx = kc.ReqContext("a")
            cascade.coordinator.on_new_request(ctx)
            stored = await cascade.store(keys, ctx, list(range(len(keys))))
            cascade.finish_request(ctx)
            await cascade.wait_cascades()
            ok = all(t.counters["store_jobs"] and not t.counters["store_failures"]
                     for t in cascade.tiers)
        sys.exit(0 if ok and len(stored.stored) == len(keys) else 1)

    asyncio.run(main())
    """
)


async def test_two_processes_share_blocks_unless_namespace_or_salt_differ(
    moto: MotoServer, bucket: str, tmp_path: Path
) -> None:
    """Process A stores 3 blocks through its own coordinator-side tier; in this process a cascade
    with the same namespace finds them in s3 and loads them byte-exact; another model name or a
    cache_salt sees none of them."""
    ids = [101, 102, 103]
    payload = b"".join(pattern(i) for i in ids)
    base = {
        "block_bytes": BLOCK,
        "gpu_blocks": 8,
        "cpu_blocks": 8,
        "secondary_tiers": [{"type": "s3", **tier_config(moto.endpoint, bucket)}],
        "model_name": "test-model",
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _SHARE_SCRIPT,
        json.dumps(base),
        json.dumps([key(i).hex() for i in ids]),
        payload.hex(),
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert await asyncio.wait_for(proc.wait(), 60) == 0

    async def found(**identity: Any) -> tuple[int, list[str]]:
        config = kc.CascadeConfig(**{**json.loads(json.dumps(base)), **identity})
        async with kc.open_cascade(config) as cascade:
            ctx = kc.ReqContext("b")
            hits = await cascade.lookup_prefix([key(i) for i in ids], ctx)
            if hits.num_hits:
                result = await cascade.load(hits.keys, ctx, list(range(hits.num_hits)))
                assert result.loaded == 3
                got = cascade.device.kv[:3].cpu().numpy().view(np.uint8).tobytes()
                assert got == payload
            cascade.finish_request(ctx)
            return hits.num_hits, hits.tiers

    assert (await found())[:2] == (3, ["s3"] * 3)
    assert (await found(model_name="another-model"))[0] == 0
    assert (await found(cache_salt="tenant-b"))[0] == 0


def test_cli_replay_with_fs_and_s3(
    moto: MotoServer,
    bucket: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``kvcascade replay --s3-endpoint … --s3-bucket …`` (credentials from the environment)
    runs fs + s3 and reports s3 hits and traffic in the table and the JSON."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "".join(json.dumps({"hash_ids": list(r.hash_ids)}) + "\n" for r in conversations(48))
    )
    out = tmp_path / "r.json"
    fs_small = {"secondary_tiers": [{"type": "fs", "max_bytes": 4 * file_size(4096)}]}
    code = main(
        [
            "replay",
            str(trace),
            "--block-bytes",
            "4096",
            "--cpu-blocks",
            "8",
            "--gpu-blocks",
            "16",
            "--fs-dir",
            str(tmp_path / "fs"),
            "--config",
            json.dumps(fs_small),
            "--s3-endpoint",
            moto.endpoint,
            "--s3-bucket",
            bucket,
            "--json",
            str(out),
            "--quiet",
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    assert report["hit_blocks"]["s3"] > 0
    assert report["bytes"]["cpu_to_s3"] > 0 and report["bytes"]["s3_to_cpu"] > 0
    assert report["mismatched_blocks"] == 0
    table = capsys.readouterr().out
    assert "hit blocks: s3" in table and "bytes cpu → s3" in table
    assert SECRET_KEY not in out.read_text() and SECRET_KEY not in table


# -- authenticated blocks (issue #21 item 5) ------------------------------------------------
BLOCK_SECRET = "kvcascade-s3-block-secret-0123456789"  # tests assert it never shows up


async def test_authenticated_objects_forged_refused_shared_by_the_same_secret(
    moto: MotoServer,
    bucket: str,
    host: kc.HostBuffer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With a secret: an object forged with valid checksums (as a tier without a secret writes
    it) fails its load and is deleted; a tier with the same secret loads the writer's objects,
    one with another secret fails the MAC and deletes them. The secret is in no log record."""
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("KVC_S3_SECRET", BLOCK_SECRET)
    monkeypatch.setenv("KVC_S3_OTHER", BLOCK_SECRET[::-1])
    writer = make_tier(moto.endpoint, bucket, host, auth_secret_env="KVC_S3_SECRET")
    reader = make_tier(moto.endpoint, bucket, host, auth_secret_env="KVC_S3_SECRET")
    other = make_tier(moto.endpoint, bucket, host, auth_secret_env="KVC_S3_OTHER")
    plain = make_tier(moto.endpoint, bucket, host)
    client = moto.client()
    async with running(writer, reader, other, plain):
        assert (await store(writer, host, [1, 2])).success
        assert (await load(reader, [1], [8])).success and bytes(host.row(8)) == pattern(1)
        failed = await load(other, [2], [9])
        assert not failed.success and "MAC mismatch" in failed.error
        assert (await store(plain, host, [3])).success  # valid checksums, no MAC: a forgery
        failed = await load(reader, [3], [9])
        assert not failed.success and "not authenticated" in failed.error
        assert reader.counters["corrupt_blocks"] == 1 and other.counters["corrupt_blocks"] == 1
        left = {o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]}
        assert left == {writer.object_key(key(1))}
    assert BLOCK_SECRET not in caplog.text and BLOCK_SECRET[::-1] not in caplog.text


async def test_puts_and_parts_carry_the_crc32_of_their_body(
    moto: MotoServer, bucket: str, host: kc.HostBuffer
) -> None:
    """Issue #21 item 5: a PutObject carries ``x-amz-checksum-crc32`` of its body (moto keeps
    the value sent and returns it with ``ChecksumMode``), equal to the CRC32 of the object's
    bytes; a multipart upload is created for CRC32 and each part carries its own. (moto does
    not verify the value, so a corrupted body is not refused here; S3 and MinIO answer
    ``BadDigest``.)"""
    single = make_tier(moto.endpoint, bucket, host, prefix="single")
    parts = make_tier(moto.endpoint, bucket, host, prefix="multi", multipart_threshold_bytes=1)
    client = moto.client()
    # moto keeps the value a client sends (it does not verify it): what head_object returns
    # below is what the tier sent, not a value moto computed.
    client.put_object(
        Bucket=bucket, Key="probe", Body=b"x", ChecksumAlgorithm="CRC32", ChecksumCRC32="AAAAAA=="
    )
    probe = client.head_object(Bucket=bucket, Key="probe", ChecksumMode="ENABLED")
    assert probe["ChecksumCRC32"] == "AAAAAA=="
    async with running(single, parts):
        assert (await store(single, host, [1])).success
        assert (await store(parts, host, [2], [1])).success
        for tier, i in [(single, 1), (parts, 2)]:
            name = tier.object_key(key(i))
            blob = client.get_object(Bucket=bucket, Key=name)["Body"].read()
            assert blob[HEADER_BYTES:][:BLOCK] == pattern(i)
            crc = base64.b64encode(zlib.crc32(blob).to_bytes(4, "big")).decode()
            head = client.head_object(Bucket=bucket, Key=name, ChecksumMode="ENABLED")
            if tier is single:
                assert head["ChecksumCRC32"] == crc
            else:  # S3's composite checksum: the CRC32 of the parts' CRC32s (AWS adds "-1")
                composite = zlib.crc32(base64.b64decode(crc)).to_bytes(4, "big")
                assert head["ChecksumCRC32"].split("-")[0] == base64.b64encode(composite).decode()
            assert (await load(tier, [i], [5])).success and bytes(host.row(5)) == pattern(i)
