"""Keeping a lease alive on a thread, and noticing when it is lost."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pdps.core.errors import LeaseExpired, StoreError
from pdps.ports.coordination import CoordinationStore

log = logging.getLogger(__name__)


class LeaseKeeper:
    """Grants a lease and refreshes it every ``ttl / 3`` seconds until stopped.

    ``on_lost`` runs once, on the keeper's thread, when the store says the lease is
    gone (the role must then stop writing: its keys, lock included, are deleted).

    :attr:`held` is what the role can know without asking the store: a lease whose
    last refresh was *sent* ``ttl`` seconds ago or more may have run out there (a
    process stopped, a store out of reach), so a role that must not act on a lost
    lease (a pserver whose place a backup may have taken) checks it before each act.
    """

    def __init__(self, store: CoordinationStore, ttl: float, *, name: str, on_lost: Callable[[], None] | None = None) -> None:
        self._store = store
        self._ttl = ttl
        self._on_lost = on_lost
        self._stop = threading.Event()
        asked = time.monotonic()
        self.lease = store.grant_lease(ttl)
        self.lost = False
        self._renewed = asked  # when the last refresh that succeeded was sent
        self._thread = threading.Thread(target=self._run, name=f"pdps-lease-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._ttl / 3):
            try:
                sent = time.monotonic()
                self._store.keep_alive(self.lease)
                self._renewed = sent
            except LeaseExpired:
                self.lost = True
                log.warning("lease %d expired", self.lease)
                if self._on_lost is not None:
                    self._on_lost()
                return
            except StoreError as exc:  # transient: the next tick retries until the TTL runs out
                log.warning("keep-alive of lease %d failed: %s", self.lease, exc)

    @property
    def held(self) -> bool:
        """Whether the lease is surely still held: not lost, and refreshed less than a
        TTL ago (counted from when that refresh was sent, so never later than the
        store's own count)."""
        return not self.lost and time.monotonic() - self._renewed < self._ttl

    def stop(self, *, revoke: bool = True) -> None:
        """Stop refreshing; with ``revoke`` delete the lease and its keys now (graceful exit).
        Without it the lease simply runs out, as it does when a process dies."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        if revoke and not self.lost:
            try:
                self._store.revoke_lease(self.lease)
            except StoreError as exc:
                log.warning("could not revoke lease %d: %s", self.lease, exc)
