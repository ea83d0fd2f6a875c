"""The one retry loop of pdps: try, and after a failure pause by a :class:`Backoff`.

Two shapes of the same loop:

* :func:`retry` calls a function until it stops raising one of the given errors, or
  until the deadline or the number of tries is spent;
* :class:`Retry` is the loop's state, for call sites whose loop does more than call one
  function (a watch stream that reconnects, a poll that waits for a key): they call
  :meth:`Retry.failed` after each failure and get whether to go on, the pause already
  taken.

The deadline counts from the first failure of a run of failures, so a call that keeps
succeeding never runs out of it; :meth:`Retry.succeeded` starts a new run.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from pdps.core.backoff import Backoff

T = TypeVar("T")

_draws = random.Random()


class Retry:
    """The state of one retry loop.

    ``deadline`` bounds the seconds since the first failure, ``attempts`` the failures
    in a row (None: no bound). ``stop``, when set, ends the loop at once, waking a pause.
    """

    def __init__(
        self,
        policy: Backoff,
        *,
        deadline: float | None = None,
        attempts: int | None = None,
        stop: threading.Event | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self.deadline = deadline
        self.attempts = attempts
        self._stop = stop
        self._clock = clock
        self.failures = 0
        self._since: float | None = None

    @property
    def elapsed(self) -> float:
        """Seconds since the first failure of the current run (0.0 with none)."""
        return 0.0 if self._since is None else self._clock() - self._since

    @property
    def spent(self) -> bool:
        """True once the deadline or the attempts are used up, or ``stop`` is set."""
        if self._stop is not None and self._stop.is_set():
            return True
        if self.attempts is not None and self.failures >= self.attempts:
            return True
        return self.deadline is not None and self.failures > 0 and self.elapsed >= self.deadline

    def failed(self) -> bool:
        """Count a failure; pause as the policy says and return True to try again, or
        return False at once when the loop is spent."""
        return self.note() and self.pause()

    def note(self) -> bool:
        """Count a failure without pausing; False when the loop is spent."""
        if self._since is None:
            self._since = self._clock()
        self.failures += 1
        return not self.spent

    def pause(self) -> bool:
        """Sleep the policy's pause for the failures so far (cut short by the deadline);
        False if ``stop`` was set meanwhile."""
        pause = self.policy.pause(self.failures, _draws.random())
        if self.deadline is not None:
            pause = min(pause, max(0.0, self.deadline - self.elapsed))
        if self._stop is not None:
            return not self._stop.wait(pause) if pause > 0 else not self._stop.is_set()
        if pause > 0:
            time.sleep(pause)
        return True

    def succeeded(self) -> None:
        """The thing worked: the next failure starts a new run (fresh deadline, first pause)."""
        self.failures = 0
        self._since = None


def retry(
    fn: Callable[[], T],
    *,
    on: type[BaseException] | tuple[type[BaseException], ...],
    policy: Backoff,
    deadline: float | None = None,
    attempts: int | None = None,
    stop: threading.Event | None = None,
    waiting: Callable[[BaseException, Retry], None] | None = None,
    giving_up: Callable[[BaseException, Retry], BaseException] | None = None,
    recovered: Callable[[Retry], None] | None = None,
) -> T:
    """Call ``fn`` until it returns, retrying after the errors ``on``.

    ``waiting(exc, state)`` runs after each failure that will be retried (to log);
    when the loop is spent the last error is raised, or ``giving_up(exc, state)``'s
    error raised from it. ``recovered(state)`` runs when a call succeeds after failures.
    """
    state = Retry(policy, deadline=deadline, attempts=attempts, stop=stop)
    while True:
        try:
            result = fn()
        except on as exc:
            if not state.note():
                if giving_up is None:
                    raise
                raise giving_up(exc, state) from exc
            if waiting is not None:
                waiting(exc, state)
            if not state.pause():
                raise
            continue
        if state.failures and recovered is not None:
            recovered(state)
        return result
