"""Offload key layout (vLLM's ``make_offload_key`` in ``vllm/v1/kv_offload/base.py``)."""

import pytest

import kvcascade as kc


def test_key_is_hash_then_group_big_endian() -> None:
    """Raw block-hash bytes followed by the group index as 4 bytes big-endian unsigned."""
    key = kc.make_offload_key(b"\xab\xcd", 258)
    assert key == b"\xab\xcd\x00\x00\x01\x02"
    assert kc.split_offload_key(key) == (b"\xab\xcd", 258)


@pytest.mark.parametrize("group", [0, 1, 7, 2**32 - 1])
def test_round_trip(group: int) -> None:
    block_hash = bytes(range(32))
    assert kc.split_offload_key(kc.make_offload_key(block_hash, group)) == (block_hash, group)


def test_bad_inputs_name_the_value() -> None:
    with pytest.raises(ValueError, match="2\\*\\*32"):
        kc.make_offload_key(b"h", 2**32)
    with pytest.raises(ValueError, match="-1"):
        kc.make_offload_key(b"h", -1)
    with pytest.raises(TypeError, match="str"):
        kc.make_offload_key("abc", 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bool"):
        kc.make_offload_key(b"h", True)
    with pytest.raises(ValueError, match="empty"):
        kc.make_offload_key(b"", 0)
    with pytest.raises(ValueError, match="too short"):
        kc.split_offload_key(b"\x00\x00\x00\x01")
