"""Riding out store outages: a bounded connect at startup, pause-and-retry mid-job.

Adapters raise :class:`~pdps.core.errors.StoreUnavailable` at once when the server
cannot be reached; deciding how long to wait is the roles' business, and lives here.

* :func:`wait_until_answers` proves a store answers, retrying with exponential
  backoff for a bounded time; then it fails with an error that names the URL, so a
  typo or a server that is not up is obvious at once
  (:func:`pdps.registry.connect_store` opens a store by URL and waits so).
* :class:`ResilientStore` wraps a store for a running role: every call that meets
  an outage pauses and retries with backoff, logging as it waits, until the outage
  has lasted ``deadline`` seconds; then the role gets a ``StoreUnavailable`` that
  says so and exits.

A write whose call failed may still have been applied (the reply was lost). The
retried write is safe where the roles use it: master writes are idempotent puts of
whole records; claims and lock acquisitions check afterwards whether the key
already holds their own unique value (see :meth:`ResilientStore.acquire_lock`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from pdps.core.backoff import Backoff
from pdps.core.errors import StoreUnavailable
from pdps.ports.coordination import Compare, CoordinationStore, Fence, KeyValue, TxnOp, TxnResult, WatchEvent
from pdps.runtime.retry import Retry, retry

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Default for how long a role rides out an outage (``JobConfig.store_outage_deadline``).
OUTAGE_DEADLINE = 60.0
#: Default for how long :func:`wait_until_answers` keeps trying before it gives up.
CONNECT_TIMEOUT = 10.0
#: A waiting role logs at most this often.
LOG_EVERY = 5.0


#: How a role paces its retries through an outage.
OUTAGE_BACKOFF = Backoff(first=0.05, longest=2.0)


def _retry(url: str, what: str, fn: Callable[[], T], deadline: float, *, giving_up: str) -> T:
    """Run ``fn``; on StoreUnavailable back off until ``deadline`` seconds have passed
    since the first failure, logging at most every ``LOG_EVERY`` seconds."""
    logged = 0.0

    def waiting(exc: BaseException, state: Retry) -> None:
        nonlocal logged
        if state.failures == 1:
            log.warning("coordination store %s unreachable (%s); retrying for up to %.0f s: %s", url, what, deadline, exc)
        elif state.elapsed - logged >= LOG_EVERY:
            logged = state.elapsed
            log.warning("coordination store %s still unreachable after %.0f s (%s); retrying", url, state.elapsed, what)

    def gave_up(exc: BaseException, state: Retry) -> BaseException:
        return StoreUnavailable(
            f"{giving_up}: coordination store {url} unreachable for {state.elapsed:.1f} s (limit {deadline:g} s); last error: {exc}"
        )

    def back(state: Retry) -> None:
        log.warning("coordination store %s is back after %.1f s", url, state.elapsed)

    return retry(fn, on=StoreUnavailable, policy=OUTAGE_BACKOFF, deadline=deadline, waiting=waiting, giving_up=gave_up, recovered=back)


def wait_until_answers(store: CoordinationStore, *, timeout: float = CONNECT_TIMEOUT) -> CoordinationStore:
    """Check that ``store`` answers, retrying for up to ``timeout`` s; close it and raise
    :class:`StoreUnavailable` naming its URL when it never does."""
    try:
        _retry(store.url, "connect", lambda: store.get("/pdps/"), timeout, giving_up="cannot start")
    except StoreUnavailable:
        store.close()
        raise
    return store


class ResilientStore:
    """A :class:`CoordinationStore` that pauses and retries through outages up to ``deadline``."""

    def __init__(self, store: CoordinationStore, *, deadline: float = OUTAGE_DEADLINE) -> None:
        if isinstance(store, ResilientStore):
            store = store.inner
        self.inner = store
        self.deadline = deadline

    @property
    def url(self) -> str:
        return self.inner.url

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        return _retry(self.inner.url, what, fn, self.deadline, giving_up=f"giving up on {what}")

    def get(self, key: str) -> KeyValue | None:
        return self._call(f"get {key}", lambda: self.inner.get(key))

    def range(self, prefix: str) -> list[KeyValue]:
        return self._call(f"range {prefix}", lambda: self.inner.range(prefix))

    def put(self, key: str, value: bytes, *, lease: int | None = None) -> int:
        return self._call(f"put {key}", lambda: self.inner.put(key, value, lease=lease))

    def delete(self, key: str) -> bool:
        return self._call(f"delete {key}", lambda: self.inner.delete(key))

    def delete_prefix(self, prefix: str) -> int:
        return self._call(f"delete {prefix}*", lambda: self.inner.delete_prefix(prefix))

    def commit(
        self,
        compares: Sequence[Compare],
        success: Sequence[TxnOp],
        failure: Sequence[TxnOp] = (),
        *,
        fence: Fence | None = None,
    ) -> TxnResult:
        what = "transaction on " + (", ".join(op.key for op in success[:3]) or "nothing")
        return self._call(what, lambda: self.inner.commit(compares, success, failure, fence=fence))

    def grant_lease(self, ttl: float) -> int:
        return self._call("grant lease", lambda: self.inner.grant_lease(ttl))

    def keep_alive(self, lease: int) -> None:
        self._call(f"keep lease {lease} alive", lambda: self.inner.keep_alive(lease))

    def revoke_lease(self, lease: int) -> None:
        self._call(f"revoke lease {lease}", lambda: self.inner.revoke_lease(lease))

    def watch(self, prefix: str, callback: Callable[[WatchEvent], None]) -> Any:
        return self._call(f"watch {prefix}", lambda: self.inner.watch(prefix, callback))

    def acquire_lock(self, name: str, lease: int, owner: bytes) -> Fence | None:
        """Take the lock; if an earlier try's reply was lost, recognise our own win."""
        tried = False

        def attempt() -> Fence | None:
            nonlocal tried
            if tried:
                kv = self.inner.get(name)
                if kv is not None and kv.value == owner and kv.lease == lease:
                    return Fence(key=name, owner=owner, revision=kv.mod_revision)
            tried = True
            return self.inner.acquire_lock(name, lease, owner)

        return self._call(f"lock {name}", attempt)

    def close(self) -> None:
        self.inner.close()
