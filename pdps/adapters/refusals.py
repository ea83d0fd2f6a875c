"""Warnings about the peers a server refuses, rate-limited.

A server refuses connections and calls it will not serve: a wrong token, a malformed
request, too many connections. Each one is worth a line in the log, but a scanner or
a misconfigured client refuses hundreds a minute and would bury everything else. So
one :class:`RefusalLog` per server (its gRPC calls and its bulk connections share it)
logs the first few refusals of each interval in full and counts the rest, then sums
them up in one line when the interval ends. The counted ones are logged at DEBUG.
"""

from __future__ import annotations

import logging
import threading
import time

#: Refusals logged in full per interval, and the interval's length in seconds.
FIRST = 5
INTERVAL = 60.0
#: Peers named in a summary line (the rest are counted).
NAMED_PEERS = 3


class RefusalLog:
    """The refusal warnings of the server at ``where``, through ``logger``; thread-safe."""

    def __init__(self, logger: logging.Logger, where: str, *, first: int = FIRST, interval: float = INTERVAL) -> None:
        self._log = logger
        self._where = where
        self._first = first
        self._interval = interval
        self._lock = threading.Lock()
        self._window_end = 0.0  # time.monotonic() when the current interval ends
        self._told = 0  # refusals logged in full in the current interval
        self._counted = 0  # ... and the ones only counted, since the last summary
        self._peers: dict[str, None] = {}  # hosts of the counted ones, in order
        self._last = ""
        self._timer: threading.Timer | None = None

    def refused(self, what: str, peer: str, reason: str) -> None:
        """Log "<what> from <peer> at <server>: <reason>", or count it."""
        now = time.monotonic()
        with self._lock:
            if now >= self._window_end:
                self._window_end, self._told = now + self._interval, 0
            tell = self._told < self._first
            if tell:
                self._told += 1
            else:
                self._counted += 1
                self._peers[_host(peer)] = None
                self._last = f"{what}: {reason}"
                if self._timer is None:
                    self._timer = threading.Timer(self._window_end - now, self.flush)
                    self._timer.daemon = True
                    self._timer.start()
        (self._log.warning if tell else self._log.debug)("%s from %s at %s: %s", what, peer, self._where, reason, stacklevel=2)

    def flush(self) -> None:
        """Log the summary of the refusals counted so far, if any (at the end of an
        interval, and when the server closes)."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            counted, peers, last = self._counted, list(self._peers), self._last
            self._counted, self._peers = 0, {}
        if not counted:
            return
        named = ", ".join(peers[:NAMED_PEERS]) + (f" and {len(peers) - NAMED_PEERS} other hosts" if len(peers) > NAMED_PEERS else "")
        self._log.warning(
            "%d more refusals at %s in the last %g s, from %s (the last: %s); the first %d of each %g s are logged in full",
            counted,
            self._where,
            self._interval,
            named,
            last,
            self._first,
            self._interval,
        )


def _host(peer: str) -> str:
    """The host of a peer as gRPC (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``) or a socket (``1.2.3.4:5``) names it."""
    for prefix in ("ipv4:", "ipv6:"):
        peer = peer.removeprefix(prefix)
    host = peer.rsplit(":", 1)[0] if ":" in peer else peer
    return host.strip("[]")
