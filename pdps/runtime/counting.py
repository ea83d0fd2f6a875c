"""Counting what a job asks of its coordination store: a wrapper that measures, for
the scale benchmark (``bench/scale.py``) and for anyone asking what a role costs.

:class:`CountingStore` implements the :class:`~pdps.ports.coordination.CoordinationStore`
port around another store and changes nothing it does: every call goes through to
the inner store, and is counted on the way back. It counts

* calls by method (``get``, ``range``, ``commit``, ``put``, ``keep_alive``, ...);
* reads and writes by *key family*: the first path element after ``root`` (for a job's
  keys, ``Keys(job).root``: ``rounds``, ``tasks``, ``progress``, ``trainers``, ``audit``,
  ...). A ``get`` or a ``range`` is one read of its key's family; each Put or Delete of
  a transaction (or a plain ``put``/``delete``) is one write of its key's family;
* bytes written (key + value of a Put, the key of a Delete: the transaction's ``success``
  ops when it succeeded, its ``failure`` ops when not; a ``delete_prefix`` counts one
  write of the prefix per key it deleted) and bytes read (key + value of
  every key a read returned, and of every watch event delivered), by family;
* transactions whose compares failed (a compare-and-set that lost a race), by the
  family of the transaction's first compare: the key it guarded;
* watch events delivered, by family.

A call that raises counts as a call and nothing else (its effect is unknown).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from pdps.ports.coordination import Compare, CoordinationStore, Delete, Fence, KeyValue, Put, TxnOp, TxnResult, WatchEvent

OUTSIDE = "(outside)"  # the family of a key that does not start with ``root``


@dataclasses.dataclass(frozen=True)
class StoreCounts:
    """What a :class:`CountingStore` counted (a copy: it does not move on)."""

    calls: Mapping[str, int]
    reads: Mapping[str, int]  # family -> gets and ranges
    writes: Mapping[str, int]  # family -> Puts and Deletes applied
    bytes_written: Mapping[str, int]
    bytes_read: Mapping[str, int]
    conflicts: Mapping[str, int]  # family -> transactions whose compares failed
    events: Mapping[str, int]  # family -> watch events delivered

    @property
    def ops(self) -> int:
        """Store operations: every call, plus every watch event delivered."""
        return sum(self.calls.values()) + sum(self.events.values())

    def total(self, what: str) -> int:
        """The sum over families of ``reads``, ``writes``, ``bytes_written``, ... ."""
        return sum(getattr(self, what).values())

    def minus(self, before: StoreCounts) -> StoreCounts:
        """What was counted since ``before`` was taken."""
        fields = _FIELDS
        return StoreCounts(**{f: _sub(getattr(self, f), getattr(before, f)) for f in fields})

    def to_json(self) -> dict[str, dict[str, int]]:
        return {f: dict(sorted(getattr(self, f).items())) for f in _FIELDS}


_FIELDS = tuple(f.name for f in dataclasses.fields(StoreCounts))


def _sub(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
    out = {k: v - b.get(k, 0) for k, v in a.items()}
    return {k: v for k, v in out.items() if v}


class CountingStore:
    """A :class:`CoordinationStore` that counts what is asked of ``inner`` (see the module)."""

    def __init__(self, inner: CoordinationStore, *, root: str = "") -> None:
        self.inner = inner
        self.root = root
        self._lock = threading.Lock()
        self._counters: dict[str, Counter[str]] = {f: Counter() for f in _FIELDS}

    @property
    def url(self) -> str:
        return self.inner.url

    def family(self, key: str) -> str:
        """The first path element of ``key`` after ``root``."""
        if not key.startswith(self.root):
            return OUTSIDE
        return key[len(self.root) :].lstrip("/").split("/", 1)[0]

    def counts(self) -> StoreCounts:
        with self._lock:
            return StoreCounts(**{f: dict(c) for f, c in self._counters.items()})

    def reset(self) -> None:
        with self._lock:
            for c in self._counters.values():
                c.clear()

    # --- counting ---------------------------------------------------------------------

    def _count(self, method: str, *, read: str | None = None, got: Iterable[KeyValue] = (), written: Sequence[TxnOp] = (), conflict: str | None = None) -> None:
        with self._lock:
            c = self._counters
            c["calls"][method] += 1
            if read is not None:
                c["reads"][self.family(read)] += 1
            for kv in got:
                c["bytes_read"][self.family(kv.key)] += len(kv.key.encode()) + len(kv.value)
            for op in written:
                family = self.family(op.key)
                c["writes"][family] += 1
                c["bytes_written"][family] += len(op.key.encode()) + (len(op.value) if isinstance(op, Put) else 0)
            if conflict is not None:
                c["conflicts"][self.family(conflict)] += 1

    def _called(self, method: str) -> None:
        self._count(method)

    def _delivered(self, event: WatchEvent) -> None:
        family = self.family(event.key)
        with self._lock:
            self._counters["events"][family] += 1
            self._counters["bytes_read"][family] += len(event.key.encode()) + len(event.value or b"")

    # --- the port -----------------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        try:
            kv = self.inner.get(key)
        except BaseException:
            self._called("get")
            raise
        self._count("get", read=key, got=() if kv is None else (kv,))
        return kv

    def range(self, prefix: str) -> list[KeyValue]:
        try:
            kvs = self.inner.range(prefix)
        except BaseException:
            self._called("range")
            raise
        self._count("range", read=prefix, got=kvs)
        return kvs

    def put(self, key: str, value: bytes, *, lease: int | None = None) -> int:
        try:
            revision = self.inner.put(key, value, lease=lease)
        except BaseException:
            self._called("put")
            raise
        self._count("put", written=(Put(key, value, lease),))
        return revision

    def delete(self, key: str) -> bool:
        try:
            existed = self.inner.delete(key)
        except BaseException:
            self._called("delete")
            raise
        self._count("delete", written=(Delete(key),) if existed else ())
        return existed

    def delete_prefix(self, prefix: str) -> int:
        try:
            n = self.inner.delete_prefix(prefix)
        except BaseException:
            self._called("delete_prefix")
            raise
        self._count("delete_prefix", written=(Delete(prefix),) * n)  # a write per key gone, weighed as its prefix
        return n

    def commit(
        self,
        compares: Sequence[Compare],
        success: Sequence[TxnOp],
        failure: Sequence[TxnOp] = (),
        *,
        fence: Fence | None = None,
    ) -> TxnResult:
        try:
            result = self.inner.commit(compares, success, failure, fence=fence)
        except BaseException:
            self._called("commit")
            raise
        conflict = None if result.succeeded or not compares else compares[0].key
        self._count("commit", written=success if result.succeeded else failure, conflict=conflict)
        return result

    def grant_lease(self, ttl: float) -> int:
        try:
            return self.inner.grant_lease(ttl)
        finally:
            self._called("grant_lease")

    def keep_alive(self, lease: int) -> None:
        try:
            self.inner.keep_alive(lease)
        finally:
            self._called("keep_alive")

    def revoke_lease(self, lease: int) -> None:
        try:
            self.inner.revoke_lease(lease)
        finally:
            self._called("revoke_lease")

    def watch(self, prefix: str, callback: Callable[[WatchEvent], None]) -> Any:
        def counted(event: WatchEvent) -> None:
            self._delivered(event)
            callback(event)

        try:
            return self.inner.watch(prefix, counted)
        finally:
            self._called("watch")

    def acquire_lock(self, name: str, lease: int, owner: bytes) -> Fence | None:
        try:
            fence = self.inner.acquire_lock(name, lease, owner)
        except BaseException:
            self._called("acquire_lock")
            raise
        self._count("acquire_lock", written=(Put(name, owner, lease),) if fence is not None else (), conflict=None if fence is not None else name)
        return fence

    def close(self) -> None:
        self.inner.close()
