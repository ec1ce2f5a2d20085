"""A bounded queue of KV events (the primary tier's and each secondary tier's).

Events wait in their queue until someone takes them (``take_events``, ``Cascade.events()``;
vLLM's connector takes them every step). Nobody has to: an embedder with the default
``enable_events=True`` that never takes them kept every stored/removed event of a long-running
server in memory (found by a break-it run: 24 000 keys after 6 000 stored blocks, growing).
So a queue holds at most :data:`MAX_QUEUED_EVENTS` events; beyond that the oldest go, counted in
:attr:`EventQueue.dropped`, and the first drop is logged as a warning that says how to take them
or turn them off. A consumer that takes events at least every few thousand jobs loses none.
"""

from __future__ import annotations

import collections
import logging
import threading

from ._types import OffloadingEvent

log = logging.getLogger("kvcascade")

MAX_QUEUED_EVENTS = 10_000
"""Events a queue holds before it drops the oldest (each holds the keys of one job, store or
eviction: about 40 bytes per key)."""


class EventQueue:
    """Events in order, at most ``limit`` of them (the oldest dropped beyond); thread-safe
    (tier I/O threads announce removals).

    Args:
        owner: named in the warning (``"the cpu tier"``, ``"tier 'fs'"``).
        limit: events kept, ``>= 1`` (default :data:`MAX_QUEUED_EVENTS`).
        enabled: False: :meth:`append` keeps nothing (``enable_events=False``).

    Attributes:
        enabled: whether events are kept (settable: the coordinator gives its secondary tiers
            the primary tier's setting).
        dropped: events dropped so far because nobody took them.
    """

    def __init__(self, owner: str, limit: int | None = None, enabled: bool = True) -> None:
        self.owner = owner
        self.enabled = enabled
        self.dropped = 0
        self._events: collections.deque[OffloadingEvent] = collections.deque()
        self._limit = MAX_QUEUED_EVENTS if limit is None else limit
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._events)

    def append(self, event: OffloadingEvent) -> None:
        """Queue ``event`` (when enabled), dropping the oldest beyond the limit."""
        if not self.enabled:
            return
        with self._lock:
            events = self._events
            events.append(event)
            if len(events) <= self._limit:
                return
            events.popleft()
            self.dropped += 1
            first = self.dropped == 1
        if first:
            log.warning(
                "kvcascade: %s queued %d KV events nobody took; the oldest are dropped from now "
                "on (take them with Cascade.events() or take_events(), or set "
                "enable_events=False)",
                self.owner,
                self._limit,
            )

    def take(self) -> list[OffloadingEvent]:
        """Every queued event, oldest first; the queue is empty afterwards."""
        with self._lock:
            out = list(self._events)
            self._events.clear()
        return out
