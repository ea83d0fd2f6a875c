"""The consistency rules: when a pserver applies an update, and with what weight.

* **Sync-SGD.** Updates happen in numbered *rounds*. Every trainer that is a member
  of the job when the round closes must contribute to it (a trainer with no task
  contributes zero samples, so idle trainers never stall the barrier). The round
  closes when all current members have contributed; a member whose lease expires
  stops being waited for. The update is the sample-weighted mean of the
  contributions, ``sum(b_i * g_i) / sum(b_i)``, where ``g_i`` is the gradient of
  trainer i's *mean*-reduced loss over its ``b_i`` samples: exactly the gradient of
  the mean loss over the concatenated batch, ragged batches included. A round with
  no samples applies nothing. A push for a round that is already closed is stale:
  the trainer pulls and computes again.
* **Async-SGD (Downpour).** Each push is applied on arrival. A trainer sums its
  gradients over ``push_every`` mini-batches and pushes them, and pulls every
  ``pull_every`` mini-batches; in between its local copy does not change.
  With a staleness bound ``s``, a push computed on parameters more than ``s``
  pserver versions old is dropped and the trainer is told to pull.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import attrs

from pdps.core.errors import ConfigError, InvalidTransition, StalePush


class Mode(str, enum.Enum):
    SYNC = "sync"
    ASYNC = "async"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: str | Mode) -> Mode:
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"mode must be 'sync' or 'async', got {value!r}") from None


@attrs.frozen
class Cadence:
    """Async push/pull cadence, counted in mini-batches (Downpour's n and m)."""

    push_every: int = 1
    pull_every: int = 1

    def __attrs_post_init__(self) -> None:
        if self.push_every < 1 or self.pull_every < 1:
            raise ConfigError(f"push_every and pull_every must be >= 1, got n={self.push_every} m={self.pull_every}")

    def push_due(self, batch_no: int) -> bool:
        """After the ``batch_no``-th mini-batch (1-based), is a push due?"""
        return batch_no % self.push_every == 0

    def pull_due(self, batch_no: int) -> bool:
        return batch_no % self.pull_every == 0


def check_staleness(base_version: int, current_version: int, bound: int | None) -> None:
    """Raise :class:`StalePush` when a push on ``base_version`` is too old to apply."""
    if bound is not None and current_version - base_version > bound:
        raise StalePush(
            f"push computed on version {base_version} is {current_version - base_version} versions behind "
            f"(bound {bound}); pull and continue"
        )


@attrs.frozen
class RoundResult:
    """A closed sync round: who contributed how many samples, and each one's weight."""

    round_no: int
    samples: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.samples.values())

    @property
    def applies_update(self) -> bool:
        return self.total > 0


@attrs.define
class Barrier:
    """The sync barrier of one pserver: which trainers have contributed to the open round."""

    round_no: int = 0
    _samples: dict[str, int] = attrs.field(factory=dict)

    def contribute(self, trainer: str, round_no: int, samples: int) -> None:
        """Record ``trainer``'s contribution of ``samples`` to ``round_no``.

        Raises :class:`StalePush` for a closed round, :class:`InvalidTransition` for a
        future round or a second contribution to the open one.
        """
        if samples < 0:
            raise ConfigError(f"trainer {trainer!r} reported {samples} samples")
        if round_no < self.round_no:
            raise StalePush(f"round {round_no} is closed; the open round is {self.round_no}: pull and compute again")
        if round_no > self.round_no:
            raise InvalidTransition(f"trainer {trainer}", f"round {self.round_no}", f"push for round {round_no}", "pull first")
        if trainer in self._samples:
            raise InvalidTransition(f"trainer {trainer}", f"round {self.round_no}", "push", "already contributed")
        self._samples[trainer] = samples

    def contributed(self, trainer: str) -> bool:
        return trainer in self._samples

    def waiting_for(self, members: Iterable[str]) -> set[str]:
        return {m for m in members if m not in self._samples}

    def ready(self, members: Iterable[str]) -> bool:
        """The round can close: someone contributed, and no current member is missing."""
        return bool(self._samples) and not self.waiting_for(members)

    def close(self) -> RoundResult:
        if not self._samples:
            raise InvalidTransition(f"round {self.round_no}", "open", "close", "nobody contributed")
        result = RoundResult(self.round_no, dict(self._samples))
        self.round_no += 1
        self._samples = {}
        return result
