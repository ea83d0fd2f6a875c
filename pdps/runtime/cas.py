"""The one compare-and-set loop: read, decide (a pure function), commit, read again.

Every read-modify-write of pdps goes through :func:`read_modify_write`, as torch
elastic's rendezvous applies its state changes through one op executor. The decision
is pure (:class:`~pdps.core.txn.Write` or :class:`~pdps.core.txn.Done`, usually from a
rule in core); this module owns the rest: reading, the commit, going round again when
another writer got there first, pacing a contended key, and giving up after a bound.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, Union

from pdps.core.backoff import Backoff
from pdps.core.errors import Contended
from pdps.core.txn import Decision, Done, Fence, Write
from pdps.ports.coordination import CoordinationStore
from pdps.runtime.retry import Retry

S = TypeVar("S")

#: A lost race is retried at once twice, then with short jittered pauses: a key that
#: many writers want (a record a thousand trainers race for) is not hammered.
CONTENDED = Backoff(first=0.001, longest=0.05, immediate=2, jitter=0.5)
#: How many lost races in a row before giving up. Each loss means another writer
#: succeeded, so a loop that loses this often is not contended but broken.
MAX_CONFLICTS = 10_000


def read_modify_write(
    store: CoordinationStore,
    read: Union[str, Callable[[], S]],
    decide: Callable[[Any], Decision],
    *,
    what: str,
    fence: Fence | None = None,
    policy: Backoff = CONTENDED,
    attempts: int = MAX_CONFLICTS,
    on_conflict: Callable[[], None] | None = None,
) -> Any:
    """Apply ``decide`` to what ``read`` returns until its writes commit.

    ``read`` is a key (what is read is then its :class:`KeyValue`, or None) or a
    function reading whatever the decision needs. ``decide`` returns :class:`Done`
    (nothing to write: its result is returned) or :class:`Write` (commit its ops if its
    guards hold, with ``fence`` if given; on success its result is returned). When a
    guard fails, ``on_conflict`` runs (to drop what the caller cached) and the loop
    reads again, pausing by ``policy`` after the first few losses; after ``attempts``
    losses in a row it raises :class:`Contended` naming ``what``. Store errors
    (and ``FencingError``) propagate: they are not races.
    """
    get: Callable[[], Any] = (lambda: store.get(read)) if isinstance(read, str) else read
    races = Retry(policy, attempts=attempts)
    while True:
        decision = decide(get())
        if isinstance(decision, Done):
            return decision.result
        if not isinstance(decision, Write):
            raise TypeError(f"{what}: a decision must be Write or Done, got {decision!r}")
        if store.commit(tuple(decision.guards), tuple(decision.ops), fence=fence).succeeded:
            return decision.result
        if on_conflict is not None:
            on_conflict()
        if not races.failed():
            raise Contended(f"{what}: lost the compare-and-set race {races.failures} times in a row; giving up")

