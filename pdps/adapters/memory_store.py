"""``memory://`` coordination store: the whole contract in one process.

It behaves like a single etcd node: one store-wide revision, leases that delete
their keys on expiry, watches delivered in revision order on a dispatcher thread.
Lease expiry is driven by an injectable ``clock``; expired leases are reaped at the
start of every operation, by :meth:`MemoryStore.tick`, and (when ``reap_every`` is
set, as the in-process simulation does) by a background thread.

``memory://name`` returns the same store to everyone in the process who asks for
that name, so in-process roles share it; ``memory://`` is a fresh private store.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

import attrs

from pdps.core.errors import FencingError, LeaseExpired, StoreError
from pdps.ports.coordination import (
    Compare,
    Delete,
    EventType,
    Fence,
    KeyValue,
    Put,
    TxnOp,
    TxnResult,
    WatchEvent,
)

log = logging.getLogger(__name__)

_named: dict[str, MemoryStore] = {}
_named_lock = threading.Lock()


def open_memory_store(url: str) -> MemoryStore:
    name = url.split("://", 1)[1].strip("/") if "://" in url else ""
    if not name:
        return MemoryStore(url="memory://", reap_every=0.05)
    with _named_lock:
        store = _named.get(name)
        if store is None or store.closed:
            store = _named[name] = MemoryStore(url=f"memory://{name}", reap_every=0.05)
        return store


def _directory(key: str) -> str:
    return key[: key.rfind("/") + 1]


@attrs.define
class _Lease:
    id: int
    ttl: float
    expires_at: float
    keys: set[str] = attrs.field(factory=set)


@attrs.define(eq=False)
class _Watch:
    prefix: str
    callback: Callable[[WatchEvent], None]
    start_revision: int  # events at or before it happened before the watch existed
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


class MemoryStore:
    """In-process :class:`~pdps.ports.coordination.CoordinationStore`."""

    def __init__(
        self,
        url: str = "memory://",
        *,
        clock: Callable[[], float] = time.monotonic,
        reap_every: float | None = None,
    ) -> None:
        self.url = url
        self._clock = clock
        self._lock = threading.RLock()
        self._data: dict[str, KeyValue] = {}
        # key's directory (up to its last "/") -> its keys: a range visits the directories
        # under its prefix, not every key (a 1M-task job holds millions; trainers/ a thousand)
        self._dirs: dict[str, set[str]] = {}
        self._revision = 0
        self._leases: dict[int, _Lease] = {}
        self._lease_ids = itertools.count(1)
        self._watches: list[_Watch] = []
        self._events: queue.SimpleQueue[WatchEvent | None] = queue.SimpleQueue()
        self._dispatcher: threading.Thread | None = None
        self._closed = threading.Event()
        self._reaper: threading.Thread | None = None
        if reap_every:
            self._reaper = threading.Thread(target=self._reap_loop, args=(reap_every,), name="pdps-memstore-reaper", daemon=True)
            self._reaper.start()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    # --- reads ------------------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        with self._lock:
            self._check_open()
            self._expire()
            return self._data.get(key)

    def range(self, prefix: str) -> list[KeyValue]:
        with self._lock:
            self._check_open()
            self._expire()
            keys: list[str] = []
            for directory, names in self._dirs.items():
                if directory.startswith(prefix):
                    keys.extend(names)
                elif prefix.startswith(directory):  # the prefix ends inside this directory's names
                    keys.extend(k for k in names if k.startswith(prefix))
            return [self._data[k] for k in sorted(keys)]

    # --- writes -----------------------------------------------------------------------

    def put(self, key: str, value: bytes, *, lease: int | None = None) -> int:
        return self.commit((), (Put(key, value, lease),)).revision

    def delete(self, key: str) -> bool:
        with self._lock:
            existed = self.get(key) is not None
            if existed:
                self.commit((), (Delete(key),))
            return existed

    def delete_prefix(self, prefix: str) -> int:
        with self._lock:
            keys = [kv.key for kv in self.range(prefix)]
            if keys:
                self.commit((), tuple(Delete(k) for k in keys))
            return len(keys)

    def commit(
        self,
        compares: Sequence[Compare],
        success: Sequence[TxnOp],
        failure: Sequence[TxnOp] = (),
        *,
        fence: Fence | None = None,
    ) -> TxnResult:
        with self._lock:
            self._check_open()
            self._expire()
            if fence is not None and not all(c.holds(self._data.get(c.key)) for c in fence.compares()):
                raise FencingError(f"lock {fence.key!r} is no longer held by {fence.owner!r}; write refused")
            ok = all(c.holds(self._data.get(c.key)) for c in compares)
            ops = success if ok else failure
            for op in ops:
                if isinstance(op, Put) and op.lease is not None and op.lease not in self._leases:
                    raise LeaseExpired(f"lease {op.lease} has expired or was never granted (writing {op.key!r})")
                if not isinstance(op.key, str) or (isinstance(op, Put) and not isinstance(op.value, bytes)):
                    raise StoreError(f"keys must be str and values bytes (got {op!r})")
            if ops:
                self._revision += 1
                for op in ops:
                    self._apply(op)
            return TxnResult(ok, self._revision)

    # --- leases -----------------------------------------------------------------------

    def grant_lease(self, ttl: float) -> int:
        if not ttl > 0:
            raise StoreError(f"lease TTL must be > 0 seconds, got {ttl}")
        with self._lock:
            self._check_open()
            lease_id = next(self._lease_ids)
            self._leases[lease_id] = _Lease(lease_id, ttl, self._clock() + ttl)
            return lease_id

    def keep_alive(self, lease: int) -> None:
        with self._lock:
            self._check_open()
            self._expire()
            entry = self._leases.get(lease)
            if entry is None:
                raise LeaseExpired(f"lease {lease} has expired or was never granted")
            entry.expires_at = self._clock() + entry.ttl

    def revoke_lease(self, lease: int) -> None:
        with self._lock:
            self._check_open()
            entry = self._leases.pop(lease, None)
            if entry is not None:
                self._drop_lease_keys(entry)

    def lease_ttl_left(self, lease: int) -> float | None:
        """Seconds until expiry, or ``None`` if the lease is gone (for tests and status)."""
        with self._lock:
            self._expire()
            entry = self._leases.get(lease)
            return None if entry is None else max(0.0, entry.expires_at - self._clock())

    def tick(self) -> None:
        """Reap leases that have expired by the clock's current time."""
        with self._lock:
            self._expire()

    # --- watches and locks ------------------------------------------------------------

    def watch(self, prefix: str, callback: Callable[[WatchEvent], None]) -> _Watch:
        with self._lock:
            self._check_open()
            w = _Watch(prefix, callback, self._revision)
            self._watches.append(w)
            if self._dispatcher is None:
                self._dispatcher = threading.Thread(target=self._dispatch_loop, name="pdps-memstore-watch", daemon=True)
                self._dispatcher.start()
            return w

    def acquire_lock(self, name: str, lease: int, owner: bytes) -> Fence | None:
        key = name
        with self._lock:
            result = self.commit((Compare.absent(key),), (Put(key, owner, lease),))
            if not result.succeeded:
                return None
            return Fence(key=key, owner=owner, revision=result.revision)

    def close(self) -> None:
        self._closed.set()
        self._events.put(None)

    # --- internals --------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise StoreError(f"store {self.url} is closed")

    def _apply(self, op: TxnOp) -> None:
        old = self._data.get(op.key)
        if old is not None and old.lease is not None and old.lease in self._leases:
            self._leases[old.lease].keys.discard(op.key)
        if isinstance(op, Put):
            if old is None:
                self._dirs.setdefault(_directory(op.key), set()).add(op.key)
            self._data[op.key] = KeyValue(op.key, op.value, self._revision, op.lease)
            if op.lease is not None:
                self._leases[op.lease].keys.add(op.key)
            self._emit(WatchEvent(EventType.PUT, op.key, op.value, self._revision))
        elif old is not None:
            del self._data[op.key]
            names = self._dirs[_directory(op.key)]
            names.discard(op.key)
            if not names:
                del self._dirs[_directory(op.key)]
            self._emit(WatchEvent(EventType.DELETE, op.key, None, self._revision))

    def _expire(self) -> None:
        now = self._clock()
        for entry in [e for e in self._leases.values() if e.expires_at <= now]:
            del self._leases[entry.id]
            log.debug("lease %d expired; deleting %d keys", entry.id, len(entry.keys))
            self._drop_lease_keys(entry)

    def _drop_lease_keys(self, entry: _Lease) -> None:
        keys = sorted(k for k in entry.keys if k in self._data)
        if keys:
            self._revision += 1
            for k in keys:
                self._apply(Delete(k))

    def _emit(self, event: WatchEvent) -> None:
        if any(not w.cancelled and event.key.startswith(w.prefix) for w in self._watches):
            self._events.put(event)

    def _dispatch_loop(self) -> None:
        while True:
            event = self._events.get()
            if event is None or self._closed.is_set():
                return
            with self._lock:
                self._watches = [w for w in self._watches if not w.cancelled]
                targets = [w for w in self._watches if event.key.startswith(w.prefix) and event.revision > w.start_revision]
            for w in targets:
                if w.cancelled:
                    continue
                try:
                    w.callback(event)
                except Exception:  # a broken callback must not stop delivery to the others
                    log.exception("watch callback for prefix %r failed on %r", w.prefix, event.key)

    def _reap_loop(self, every: float) -> None:
        while not self._closed.wait(every):
            with self._lock:
                self._expire()
