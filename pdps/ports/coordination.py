"""Coordination store port: the job's shared, consistent key-value state.

Keys are ``str`` (pdps namespaces them as ``/pdps/<job>/...``), values are
``bytes``. Every successful write bumps one store-wide *revision*; each key records
the revision of its last write (``mod_revision``), which is what compare-and-set
compares, so a key deleted and re-created never looks unchanged (no ABA).

Contract (every adapter passes ``tests/unit/contract_store.py``):

* ``get`` of a missing key returns ``None``; ``range(prefix)`` returns the live keys
  starting with ``prefix`` sorted by key.
* ``commit`` is atomic: either every compare holds and every ``success`` op is
  applied with one new revision, or none is (then ``failure`` ops run instead).
* A lease is granted with a TTL in seconds (a backend may round it up: etcd uses
  whole seconds and has a minimum). Keys written with a lease are deleted when it
  expires or is revoked. ``keep_alive`` on an expired or unknown lease raises
  :class:`~pdps.core.errors.LeaseExpired`; writing with one does too.
* ``watch(prefix, callback)`` delivers every later PUT and DELETE under the prefix
  (expiry deletions included) in revision order (the ops of one transaction in op
  order), on a thread of the adapter's; callbacks must not block for long.
  ``Watch.cancel()`` stops delivery. Backends differ at the edges (see
  docs/coordination.md): Redis delivers at most once across a reconnect and gives an
  expiry the revision of the write before it, so roles re-read what they must not miss.
* The fenced lock: ``acquire_lock(name, lease)`` takes the lock key if it is free
  (tied to the lease, so it vanishes with its holder) and returns a :class:`Fence`.
  ``commit(..., fence=f)`` adds "the lock key still holds this owner, at this
  revision" to the compares and raises :class:`~pdps.core.errors.FencingError`
  when it does not hold: a master that lost its lock can never write.
* Failures of the backend raise :class:`~pdps.core.errors.StoreError`; a server
  that cannot be reached raises :class:`~pdps.core.errors.StoreUnavailable` promptly
  (adapters do not retry; :mod:`pdps.runtime.resilient` does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from pdps.core.txn import (  # the port's values, defined in core and re-exported here
    Compare,
    Delete,
    EventType,
    Fence,
    KeyValue,
    Op,
    Put,
    TxnOp,
    TxnResult,
    WatchEvent,
)


__all__ = [
    "Compare", "CoordinationStore", "Delete", "EventType", "Fence", "KeyValue", "Op", "Put", "TxnOp", "TxnResult",
    "Watch", "WatchEvent",
]


class Watch(Protocol):
    def cancel(self) -> None: ...


@runtime_checkable
class CoordinationStore(Protocol):
    url: str

    def get(self, key: str) -> KeyValue | None: ...

    def range(self, prefix: str) -> list[KeyValue]: ...

    def put(self, key: str, value: bytes, *, lease: int | None = None) -> int:
        """Write unconditionally; returns the new revision."""
        ...

    def delete(self, key: str) -> bool:
        """Returns whether the key existed."""
        ...

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under ``prefix`` in one revision; returns how many."""
        ...

    def commit(
        self,
        compares: Sequence[Compare],
        success: Sequence[TxnOp],
        failure: Sequence[TxnOp] = (),
        *,
        fence: Fence | None = None,
    ) -> TxnResult:
        """Atomic compare-then-write. With ``fence``, raises FencingError if the lock is lost
        (nothing is written, not even ``failure``)."""
        ...

    def grant_lease(self, ttl: float) -> int: ...

    def keep_alive(self, lease: int) -> None: ...

    def revoke_lease(self, lease: int) -> None:
        """Delete the lease and its keys; revoking an unknown lease is a no-op."""
        ...

    def watch(self, prefix: str, callback: Callable[[WatchEvent], None]) -> Watch: ...

    def acquire_lock(self, name: str, lease: int, owner: bytes) -> Fence | None:
        """Take lock ``name`` for ``owner`` if free; ``None`` if someone else holds it."""
        ...

    def close(self) -> None: ...
