"""Waiting for a key to appear in the coordination store, by watching it.

A watch wakes the waiter at the write, with no poll interval to pay. Watches may
miss an event (Redis's pub/sub is at-most-once across a reconnect), so the waiter
also reads the key again every ``REREAD`` seconds: a missed event costs that much
latency, never a hang.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pdps.core.errors import Timeout
from pdps.ports.coordination import CoordinationStore, EventType, WatchEvent

log = logging.getLogger(__name__)

#: Seconds between reads of the key while waiting (the safety net under the watch).
REREAD = 0.5
#: A waiter says what it waits for at most this often.
LOG_EVERY = 5.0


def wait_for_key(
    store: CoordinationStore, key: str, what: str, timeout: float, *, unless: Callable[[], bool] | None = None
) -> bytes | None:
    """The value of ``key`` once it exists; ``None`` if ``unless()`` turns true first
    (it is asked at least every ``REREAD`` seconds). Raises :class:`Timeout` after
    ``timeout`` seconds, naming ``what`` and the key."""
    appeared = threading.Event()

    def on_event(event: WatchEvent) -> None:
        if event.key == key and event.type is EventType.PUT:
            appeared.set()

    watch = store.watch(key, on_event)
    try:
        start = logged = time.monotonic()
        while True:
            kv = store.get(key)  # after the watch is set up: a write in between is seen
            if kv is not None:
                return kv.value
            if unless is not None and unless():
                return None
            now = time.monotonic()
            if now - start > timeout:
                raise Timeout(f"gave up after {timeout:.0f}s waiting for {what} ({key})")
            if now - logged > LOG_EVERY:
                logged = now
                log.warning("waiting %.0fs for %s (%s)", now - start, what, key)
            appeared.wait(min(REREAD, max(0.0, start + timeout - now) + 0.01))
            appeared.clear()
    finally:
        watch.cancel()
