"""The prefix walk of both lookup fronts (``kvcascade/_prefix_walk.py``); the synchronous
front's cases are vLLM's ``TestMaximalPrefixLookup`` (tests/test_scheduler.py), the asyncio
front's through ``lookup_prefix`` (tests/test_coordinator.py)."""

from __future__ import annotations

from collections.abc import Callable

import kvcascade as kc
from kvcascade._prefix_walk import walk_prefix

H, P, T, M = (
    kc.LookupResult.HIT,
    kc.LookupResult.HIT_PENDING,
    kc.LookupResult.RETRY,
    kc.LookupResult.MISS,
)


def _lookup(
    answers: dict[bytes, kc.LookupResult], asked: list[bytes]
) -> Callable[[bytes], kc.LookupResult]:
    def lookup(key: bytes) -> kc.LookupResult:
        asked.append(key)
        return answers[key]

    return lookup


def test_synchronous_front_walks_past_retry_to_the_first_miss() -> None:
    """Without ``needs_probe`` a RETRY is recorded and the walk goes on (every unknown key
    joins the step's probe batch); the first MISS ends it."""
    answers = {b"a": H, b"b": T, b"c": P, b"d": M, b"e": H}
    asked: list[bytes] = []
    walk = walk_prefix(list(answers), _lookup(answers, asked))
    assert (walk.results, walk.probe, walk.num_hits, walk.deferred) == ([H, T, P], None, 2, True)
    assert asked == [b"a", b"b", b"c", b"d"]


def test_asyncio_front_stops_before_a_key_that_needs_a_probe() -> None:
    """With ``needs_probe`` the walk stops before such a key without asking ``lookup``, and a
    RETRY ends it as a MISS does."""
    answers = {b"a": H, b"b": P, b"c": H}
    asked: list[bytes] = []
    walk = walk_prefix(list(answers), _lookup(answers, asked), lambda key: key == b"c")
    assert (walk.results, walk.probe, walk.num_hits) == ([H, P], b"c", 2)
    assert asked == [b"a", b"b"]
    answers = {b"a": H, b"b": T, b"c": H}
    asked.clear()
    walk = walk_prefix(list(answers), _lookup(answers, asked), lambda key: False)
    assert (walk.results, walk.probe, walk.deferred) == ([H], None, False)
    assert asked == [b"a", b"b"]
