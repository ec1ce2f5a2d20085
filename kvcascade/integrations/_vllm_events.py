"""kvcascade's tier events as vLLM KV-cache events (``vllm/distributed/kv_events.py``).

The scheduler side drains the coordinator's stored/removed events each engine step
(:meth:`kvcascade.scheduler.OffloadScheduler.take_events`, one
:class:`~kvcascade.scheduler.BlockEvent` per tier event and KV-cache group); the connector's
``take_events`` hands them to vLLM, which publishes them with its own GPU events on its KV-event
stream (``--kv-events-config``, e.g. the ZMQ publisher) as msgpack ``KVEventBatch`` es.

Each event becomes vLLM's ``BlockStored`` / ``BlockRemoved`` in the placeholder form vLLM's own
OffloadingConnector publishes (``_placeholder_stored`` in
``vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py``): ``block_hashes`` are
vLLM's block hashes (the chunk's last block hash;
the block's own hash with the default ``blocks_per_chunk`` 1), converted by vLLM's
``maybe_convert_block_hash`` (ints with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``),
``parent_block_hash`` None, ``token_ids`` empty, ``block_size`` 0, ``group_idx`` the KV-cache
group. ``medium`` is ``"CPU"`` for the primary tier and ``"STORAGE"`` for a secondary tier, whose
name (``"fs"``, ``"s3"``, ...) is in ``ownership`` (vLLM: "secondary offloading tier identifier");
``ownership`` is None for the CPU tier. Order: the order of the changes within each tier, and
across engine steps; within one step the CPU tier's events come before the secondary tiers'
(``TieringCoordinator.take_events``). See ``docs/vllm.md`` (*KV events*).
"""

from __future__ import annotations

from collections.abc import Iterable

from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

from ..scheduler import BlockEvent


def vllm_kv_events(events: Iterable[BlockEvent]) -> list[KVCacheEvent]:
    """vLLM KV-cache events for kvcascade's block events, in the same order.

    Args:
        events: the scheduler's drained events (``block_hashes`` raw ``bytes``; ``medium``
            ``"CPU"`` or ``"STORAGE"``).

    Returns:
        One ``BlockStored`` (``removed`` False) or ``BlockRemoved`` per event.
    """
    out: list[KVCacheEvent] = []
    for event in events:
        hashes = [maybe_convert_block_hash(BlockHash(h)) for h in event.block_hashes]
        ownership = None if event.medium == MEDIUM_CPU else event.tier
        if event.removed:
            out.append(
                BlockRemoved(
                    block_hashes=hashes,
                    medium=event.medium,
                    group_idx=event.group_idx,
                    ownership=ownership,
                )
            )
        else:
            out.append(
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=0,
                    lora_id=None,
                    medium=event.medium,
                    lora_name=None,
                    group_idx=event.group_idx,
                    ownership=ownership,
                )
            )
    return out
