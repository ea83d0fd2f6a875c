"""The consistency rules: when a pserver applies an update, and with what weight.

* **Sync-SGD.** Updates happen in numbered *rounds*, each decided once in the
  coordination store (:class:`RoundRecord`): a round applies on every pserver the
  contributions its closed record names, and nothing else, so a step is atomic
  across pservers. Every participant must contribute (a trainer with no task
  contributes zero samples, so idle trainers never stall the barrier); a
  participant whose lease expires stops being waited for. The update is the sample-weighted mean of the
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
from collections.abc import Iterable, Mapping

import attrs

from pdps.core.errors import ConfigError, InvalidTransition, StalePush
from pdps.core.machine import move


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
class Contribution:
    """One trainer's part of a sync round, as committed under its own key of the round.

    ``samples`` weights its gradient; ``task``/``attempt`` and ``start``..``offset`` say
    which records it trained (records ``[start, offset)`` of the task: ``offset`` counts
    the task's records consumed through this batch), so a checkpoint taken at this
    round can resume each task exactly where it was, and a replay knows each round's
    data.
    """

    samples: int
    task: int | None = None
    attempt: int | None = None
    offset: int = 0
    last: bool = False  # the batch was its task's last
    start: int = 0

    def to_json(self) -> dict:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Contribution:
        task = d.get("task")
        attempt = d.get("attempt")
        return cls(
            samples=int(d["samples"]),
            task=None if task is None else int(task),
            attempt=None if attempt is None else int(attempt),
            offset=int(d.get("offset", 0)),
            last=bool(d.get("last", False)),
            start=int(d.get("start", 0)),
        )


class RoundState(str, enum.Enum):
    OPEN = "open"  # trainers commit their contributions
    CLOSED = "closed"  # decided: the record never changes again

    def __str__(self) -> str:
        return self.value


class RoundEvent(str, enum.Enum):
    CONTRIBUTE = "contribute"  # a trainer commits its contribution
    CLOSE = "close"  # a pserver closes the round, every participant having committed
    APPLY = "apply"  # a pserver applies what the closed record names

    def __str__(self) -> str:
        return self.value


#: The sync round's legal moves. A pserver's own place in the rounds is its open
#: round number: applying round ``r`` moves it to ``r + 1``.
ROUND_TRANSITIONS: Mapping[tuple[RoundState, RoundEvent], frozenset[RoundState]] = {
    (RoundState.OPEN, RoundEvent.CONTRIBUTE): frozenset({RoundState.OPEN}),
    (RoundState.OPEN, RoundEvent.CLOSE): frozenset({RoundState.CLOSED}),
    (RoundState.CLOSED, RoundEvent.APPLY): frozenset({RoundState.CLOSED}),  # by every pserver, once each
}


@attrs.frozen
class RoundRecord:
    """One sync round as the coordination store holds it: the *decision point* of the
    transactional step.

    A trainer pushes its gradient to every pserver (each stages it, nothing applied),
    and only then commits its :class:`Contribution`, under its own key of the round
    (written once, in a transaction that holds only while the round has no close
    marker). A pserver closes the round once every participant has committed, by
    writing the round's close marker (once). No contribution commits after the marker,
    so from then on the round never changes, and every pserver applies exactly the
    contributions stored under it. A trainer that died between its pushes never
    committed, so its staged gradient is dropped everywhere: all pservers or none.
    No key is written by two trainers: a round costs the store one small write per
    trainer and one per close, whatever the number of trainers.

    The participants of round ``r`` are the live trainers that contributed to round
    ``r - 1``; for the first round of an epoch, every live trainer. A trainer that
    joins later is waited for from the round after its first contribution (it joins
    with a zero-sample one), so a newcomer still loading its model never stalls the
    job. A trainer without a task contributes zero samples.
    """

    round_no: int
    contributions: dict[str, Contribution] = attrs.field(factory=dict)
    state: RoundState = RoundState.OPEN  # moved only through ROUND_TRANSITIONS
    checkpoint: str | None = None  # the checkpoint taken right after this round, if any
    #: the slot map version the job switches to right after this round (a resize), if any
    map_version: int | None = None

    @property
    def closed(self) -> bool:
        return self.state is RoundState.CLOSED

    @property
    def total(self) -> int:
        return sum(c.samples for c in self.contributions.values())

    @property
    def applies_update(self) -> bool:
        return self.total > 0

    def weights(self) -> list[tuple[str, float]]:
        """``(trainer, samples / total)`` for every contributor with samples, sorted by
        trainer id: the one summation order every pserver and any replay uses."""
        total = self.total
        return [(t, c.samples / total) for t, c in sorted(self.contributions.items()) if c.samples]

    def contribute(self, trainer: str, contribution: Contribution) -> RoundRecord:
        """The record with ``trainer``'s contribution added.

        Raises :class:`StalePush` once the round is closed. Committing the same
        contribution again (a retry whose reply was lost) returns the record unchanged;
        a different one is an :class:`InvalidTransition`.
        """
        if contribution.samples < 0:
            raise ConfigError(f"trainer {trainer!r} reported {contribution.samples} samples")
        if self.closed:  # the table refuses it too; for the trainer it means "pull and compute again"
            raise StalePush(f"round {self.round_no} is closed: pull and compute again")
        self._move(RoundEvent.CONTRIBUTE)
        prior = self.contributions.get(trainer)
        if prior is not None:
            if prior == contribution:
                return self
            raise InvalidTransition(f"trainer {trainer}", f"round {self.round_no}", "commit", "already contributed")
        return attrs.evolve(self, contributions={**self.contributions, trainer: contribution})

    def waiting_for(self, participants: Iterable[str]) -> set[str]:
        return {p for p in participants if p not in self.contributions}

    def ready(self, participants: Iterable[str]) -> bool:
        """The round can close: someone contributed, and no participant is missing."""
        return bool(self.contributions) and not self.waiting_for(participants)

    def close(self, checkpoint: str | None = None, map_version: int | None = None) -> RoundRecord:
        """The record closed: from now on it never changes. Refused for a round nobody
        contributed to (it would apply nothing and wait for nobody). ``map_version``:
        the slot map every pserver switches to once it has applied this round."""
        state = self._move(RoundEvent.CLOSE)
        if not self.contributions:
            raise InvalidTransition(f"round {self.round_no}", self.state, RoundEvent.CLOSE, "nobody contributed")
        return attrs.evolve(self, state=state, checkpoint=checkpoint, map_version=map_version)

    def weights_to_apply(self) -> list[tuple[str, float]]:
        """:meth:`weights`, for a pserver applying the round: refused while it is open
        (what an open record names may still grow)."""
        self._move(RoundEvent.APPLY)
        return self.weights()

    def _move(self, event: RoundEvent) -> RoundState:
        return move(ROUND_TRANSITIONS, f"round {self.round_no}", self.state, event)

    def marker_json(self) -> dict:
        """The close marker as stored (``rounds/<e>/<r>/closed``); each contribution is
        stored under its own key (:meth:`Contribution.to_json`)."""
        out: dict = {"round": self.round_no, "checkpoint": self.checkpoint}
        if self.map_version is not None:
            out["map"] = self.map_version
        return out

    @classmethod
    def from_stored(cls, round_no: int, contributions: Mapping[str, Contribution], marker: Mapping | None) -> RoundRecord:
        """The record a round's keys make: its contributions, and its close marker if
        one was written (the round is closed, and names every contribution stored)."""
        checkpoint = None if marker is None else marker.get("checkpoint")
        map_version = None if marker is None else marker.get("map")
        if marker is not None and int(marker["round"]) != round_no:
            raise ValueError(f"the close marker of round {round_no} names round {marker['round']}")
        return cls(
            round_no=round_no,
            contributions=dict(contributions),
            state=RoundState.OPEN if marker is None else RoundState.CLOSED,
            checkpoint=None if checkpoint is None else str(checkpoint),
            map_version=None if map_version is None else int(map_version),
        )


def participants(live: Iterable[str], previous: Iterable[str] | None) -> set[str]:
    """Whom round ``r`` waits for: the live contributors of round ``r - 1``
    (``previous``), or every live trainer when ``r`` opens an epoch (``previous`` is None)."""
    live = set(live)
    return live if previous is None else live & set(previous)
