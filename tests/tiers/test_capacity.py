"""The byte-bounded LRU index shared by the fs and s3 tiers (``kvcascade/tiers/_capacity.py``)."""

from __future__ import annotations

from kvcascade.tiers._capacity import CapacityIndex


def k(i: int) -> bytes:
    return bytes([i])


def test_reserve_evicts_least_recently_used_first_skipping_readers() -> None:
    index = CapacityIndex(max_bytes=300)
    for i in (1, 2, 3):
        index.record(k(i), 100)
    index.touch([k(1)])  # order now 2, 3, 1
    assert index.begin_reads([k(2)]) == 1  # 2 is being read: never a victim
    assert index.reserve(100) == [k(3)]
    assert k(3) not in index and index.used == 300  # 2 + 1 + the reservation
    assert index.begin_reads([k(1), k(3)]) == 1  # 3 is being evicted: reads stop before it
    index.end_reads([k(1), k(2)])
    index.evicted([k(3)])
    assert index.begin_reads([k(3)]) == 1
    index.end_reads([k(3)])
    index.record(k(4), 100, reserved=True)
    assert index.used == 300 and index.present([k(4), k(3), k(2)]) == [k(4), k(2)]


def test_reserve_that_cannot_fit_chooses_nothing() -> None:
    """When the blocks not being read cannot make room, nothing is evicted or reserved."""
    index = CapacityIndex(max_bytes=200)
    index.record(k(1), 100)
    index.record(k(2), 100)
    index.begin_reads([k(1)])
    assert index.reserve(150) is None
    assert index.present([k(1), k(2)]) == [k(1), k(2)] and index.used == 200
    assert index.reserve(201) is None


def test_unreserve_forget_and_a_store_of_a_present_key() -> None:
    index = CapacityIndex(max_bytes=1000)
    assert index.reserve(100) == [] and index.used == 100
    index.unreserve(100)
    assert index.used == 0
    index.record(k(1), 100)
    assert index.reserve(100) == []
    index.record(k(1), 100, reserved=True)  # stored meanwhile: the reservation is returned
    assert index.used == 100
    assert index.forget(k(1)) == 100 and index.forget(k(1)) is None and index.used == 0


def test_touch_of_a_set_refreshes_in_key_order() -> None:
    index = CapacityIndex(max_bytes=300)
    for i in (3, 2, 1):
        index.record(k(i), 100)
    index.touch({k(3), k(1), k(2)})
    assert index.reserve(100) == [k(1)]


def test_unbounded_index_accounts_nothing_and_keeps_at_most_max_keys() -> None:
    index = CapacityIndex(max_bytes=None, max_keys=2)
    for i in (1, 2, 3):
        index.record(k(i), 100)
    assert index.used == 0 and index.present([k(1), k(2), k(3)]) == [k(2), k(3)]
    assert index.reserve(10**12) == []
    index.clear()
    assert len(index) == 0
