"""Waiting for a key to appear in the coordination store (or for the keys under a
prefix to say what the waiter needs: :func:`watch_until`), by watching it.

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
from typing import TypeVar

from pdps.core.errors import Timeout
from pdps.ports.coordination import CoordinationStore, WatchEvent

log = logging.getLogger(__name__)

T = TypeVar("T")

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

    def look() -> tuple[bytes | None] | None:
        kv = store.get(key)
        if kv is not None:
            return (kv.value,)
        return (None,) if unless is not None and unless() else None

    return watch_until(store, key, look, timeout, lambda: f"{what} ({key})")[0]


def watch_until(store: CoordinationStore, prefix: str, look: Callable[[], T | None], timeout: float, what: Callable[[], str]) -> T:
    """What ``look()`` returns once it is not None. ``look`` runs once the watch on
    ``prefix`` is up (so a write in between is seen), after every write or delete
    under it, and at least every ``REREAD`` seconds. Past ``timeout`` seconds raises
    :class:`Timeout` naming ``what()`` (called then, so it can say what is still missing)."""
    moved = threading.Event()

    def on_event(event: WatchEvent) -> None:
        if event.key.startswith(prefix):
            moved.set()

    watch = store.watch(prefix, on_event)
    try:
        start = logged = time.monotonic()
        while True:
            found = look()
            if found is not None:
                return found
            now = time.monotonic()
            if now - start > timeout:
                raise Timeout(f"gave up after {timeout:.0f}s waiting for {what()}")
            if now - logged > LOG_EVERY:
                logged = now
                log.warning("waiting %.0fs for %s", now - start, what())
            moved.wait(min(REREAD, max(0.0, start + timeout - now) + 0.01))
            moved.clear()
    finally:
        watch.cancel()
