"""Finding the other roles of a job through the store: waiting for a key to appear,
saying whom a role waits for (``waits/<who>``), and whether the job is done."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence

from pdps.core.errors import StoreError
from pdps.core.job import Keys, decode_json
from pdps.ports.coordination import CoordinationStore
from pdps.runtime import watching

log = logging.getLogger(__name__)

#: How long a role waits for another to appear in the store before giving up.
DISCOVERY_TIMEOUT = 120.0


def wait_for_key(
    store: CoordinationStore, key: str, what: str, timeout: float = DISCOVERY_TIMEOUT, *, unless: Callable[[], bool] | None = None
) -> bytes | None:
    """The value of ``key`` once it exists; ``None`` if ``unless()`` turns true first."""
    return watching.wait_for_key(store, key, what, timeout, unless=unless)


#: A trainer waiting longer than this (at the barrier, for a pserver) says whom it waits for.
WAIT_LOG_EVERY = 5.0


class Waits:
    """Say, in the log and under ``waits/<who>`` in the store, whom a role has been
    waiting for and since when (``pdps status`` shows these records)."""

    def __init__(self, store: CoordinationStore, keys: Keys, who: str, lease: Callable[[], int | None]) -> None:
        self._store, self._keys, self._who, self._lease = store, keys, who, lease
        self._posted: str | None = None

    def waiting(self, what: str, whom: Sequence[str], since: float) -> None:
        """Log and record a wait that has lasted since ``since`` (``time.time()``)."""
        seconds = time.time() - since
        log.warning("%s: waiting %.0fs for %s (%s) since %s", self._who, seconds, ", ".join(whom) or "nobody known", what, time.strftime("%H:%M:%S", time.localtime(since)))
        record = json.dumps({"who": self._who, "what": what, "for": list(whom), "since": since}).encode()
        if record.decode() == self._posted:  # the same wait, recorded already
            return
        try:
            self._store.put(self._keys.wait(self._who), record, lease=self._lease())
            self._posted = record.decode()
        except StoreError as exc:  # the log line said it already
            log.debug("could not record the wait: %s", exc)

    def done(self) -> None:
        if self._posted is None:
            return
        self._posted = None
        try:
            self._store.delete(self._keys.wait(self._who))
        except StoreError as exc:
            log.debug("could not clear the wait record: %s", exc)


def job_done(store: CoordinationStore, keys: Keys) -> bool:
    """True once the job's ``state`` says its last pass is done."""
    kv = store.get(keys.state)
    if kv is None:
        return False
    state = decode_json(kv.value, kv.key)
    return isinstance(state, dict) and state.get("state") == "done"
