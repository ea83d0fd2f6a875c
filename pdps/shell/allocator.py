"""Giving the C allocator's freed memory back to the system in a pserver process.

A pserver's row pushes and pulls make buffers of 1-35 MB a call (gradients, gathered
rows, index arrays) and free them at once. glibc serves such a buffer from mmap only
until it has freed one: its mmap threshold then rises to that size (up to 32 MB), and
later buffers come from heaps it gives back only from the top. A long-lived pserver
then holds freed memory it keeps for itself: 1.4-1.7x the raw bytes of its rows and
their optimizer state where the rows alone are 1.05-1.1x (bench/notes.toml
"sparse.memory"). ``malloc_trim(0)`` returns the free pages of every arena.

:class:`Trimmer` calls it on a background thread of the pserver process, never on a
request's path, once at least ``min_bytes`` of row or slot data went through the
pserver (its ``row_bytes`` and migration counters) since the last trim: when that
traffic pauses (a look, every ``every`` seconds, finds no bytes moved since the one
before: a fill or a migration is over), and while it goes on, every ``busy_every``
seconds. A trim itself takes milliseconds, but the next pushes fault in again the
pages it gave back (tens of ms on a loaded 2-core VM for a 32k-row push): rare trims
while traffic flows keep that cost small, where a fixed low mmap threshold
(``MALLOC_MMAP_THRESHOLD_``) would pay it on every large buffer.

Only where the process runs on glibc (``gnu_get_libc_version`` resolves); elsewhere
the trimmer logs once that it has nothing to call and does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

#: Seconds between looks at the pserver's counters.
TRIM_EVERY = 2.0
#: While row traffic goes on, a trim every this many looks at most.
BUSY_LOOKS = 15
#: Bytes that must have gone through the pserver since the last trim for the next one.
TRIM_MIN_BYTES = 32 << 20


def glibc_malloc_trim() -> Callable[[], int] | None:
    """glibc's ``malloc_trim(0)`` of this process (returns 1 if it gave memory back),
    or None where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(None)  # the symbols of the process itself: its C library
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: musl and macOS have no such symbol
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: int(trim(0))


class Trimmer:
    """Calls ``trim`` (default :func:`glibc_malloc_trim`) once ``moved()`` (a byte
    counter that only grows) has grown by at least ``min_bytes`` since the last call,
    at a look that finds it unchanged since the look before (the traffic paused), or
    ``busy_every`` (default ``BUSY_LOOKS * every``) seconds after the last call.
    :meth:`tick` is one look (the thread's body, every ``every`` seconds); :meth:`start`
    runs it on a daemon thread until :meth:`stop`."""

    def __init__(
        self,
        moved: Callable[[], int],
        *,
        every: float = TRIM_EVERY,
        min_bytes: int = TRIM_MIN_BYTES,
        busy_every: float | None = None,
        trim: Callable[[], int] | None = None,
        clock: Callable[[], float] = time.monotonic,
        name: str = "pdps-trim",
    ) -> None:
        if every <= 0 or min_bytes < 0:
            raise ValueError(f"Trimmer needs every > 0 and min_bytes >= 0, got every={every!r}, min_bytes={min_bytes!r}")
        self._moved, self.every, self.min_bytes, self._name, self._clock = moved, every, min_bytes, name, clock
        self.busy_every = BUSY_LOOKS * every if busy_every is None else busy_every
        self._trim = trim if trim is not None else glibc_malloc_trim()
        self._at = self._seen = moved()  # the counter at the last trim, and at the last look
        self._last = clock()  # when it last trimmed (or was made)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.trims = 0  # calls made
        self.seconds = 0.0  # ... and the time they took

    @property
    def active(self) -> bool:
        """False where there is nothing to call (not glibc)."""
        return self._trim is not None

    def tick(self) -> bool:
        """One look: trim if enough bytes moved since the last trim and either none
        since the last look or ``busy_every`` passed; whether it did."""
        if self._trim is None:
            return False
        moved = self._moved()
        paused = moved == self._seen
        self._seen = moved
        if moved - self._at < self.min_bytes:
            return False
        now = self._clock()
        if not paused and now - self._last < self.busy_every:
            return False
        self._at, self._last = moved, now
        began = time.perf_counter()
        self._trim()
        took = time.perf_counter() - began
        self.trims += 1
        self.seconds += took
        log.debug("%s: malloc_trim(0) took %.1f ms (%d so far)", self._name, 1000 * took, self.trims)
        return True

    def start(self) -> Trimmer:
        if self._trim is None:
            log.info("%s: the C library is not glibc: freed memory is left to the allocator (no malloc_trim)", self._name)
            return self
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - a counter read failing must not end the process's housekeeping silently
                log.exception("%s: a trim failed; trimming stops", self._name)
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
