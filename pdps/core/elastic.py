"""Resizing a running job: the resize record, its state machine, and the rules a
resize obeys (one at a time, bounds, the fewest slots moved).

A resize is one record in the store (``resize``), written by whoever asks
(``pdps scale``, :func:`pdps.scale`, an operator), driven by the master, and read by
every role:

* ``requested``: the desired counts are stored; nothing has moved.
* ``growing``: more pservers are wanted; the master waits until every new index is
  claimed (``ps/<i>``) by a pserver that serves.
* ``migrating``: ``to_map`` (the current map rebalanced onto the new count) is decided.
  Async jobs switch to it at once (the master writes ``slotmap`` with the record);
  sync jobs at a round boundary (the pserver that closes the next round writes
  ``slotmap`` in the transaction of its close marker). Each pserver that receives
  slots fetches them from their old owners and says so (``resize_got/<version>/<i>``).
* ``done``: every pserver holds its slots of ``to_map``; departing pservers and
  trainers leave; a new resize may begin.

Everything here is pure: the roles do the reading, writing and waiting.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

import attrs

from pdps.core import machine
from pdps.core.errors import ConfigError, CorruptRecord
from pdps.core.slots import Layout, SlotMap


class ResizeState(str, enum.Enum):
    REQUESTED = "requested"
    GROWING = "growing"
    MIGRATING = "migrating"
    DONE = "done"

    def __str__(self) -> str:
        return self.value


class ResizeEvent(str, enum.Enum):
    GROW = "grow"  # more pservers are wanted: wait for them to claim their indexes
    PLAN = "plan"  # the new map is decided (the old pservers, or the new ones too, are there)
    FINISH = "finish"  # every pserver holds its slots of the new map, or nothing had to move

    def __str__(self) -> str:
        return self.value


RESIZE_TRANSITIONS: Mapping[tuple[ResizeState, ResizeEvent], frozenset[ResizeState]] = {
    (ResizeState.REQUESTED, ResizeEvent.GROW): frozenset({ResizeState.GROWING}),
    (ResizeState.REQUESTED, ResizeEvent.PLAN): frozenset({ResizeState.MIGRATING}),
    (ResizeState.REQUESTED, ResizeEvent.FINISH): frozenset({ResizeState.DONE}),
    (ResizeState.GROWING, ResizeEvent.PLAN): frozenset({ResizeState.MIGRATING}),
    (ResizeState.MIGRATING, ResizeEvent.FINISH): frozenset({ResizeState.DONE}),
}


def check_counts(pservers: int | None, trainers: int | None, num_slots: int, replicas: int = 1) -> None:
    """Refuse counts no job can run with (ConfigError naming the bound). ``replicas``:
    the copies of each slot (the slot map's), each on its own pserver."""
    if pservers is None and trainers is None:
        raise ConfigError("a resize names --pservers, --trainers, or both")
    if pservers is not None and pservers < 1:
        raise ConfigError(f"a job needs at least 1 pserver, asked for {pservers}")
    if pservers is not None and pservers < replicas:
        raise ConfigError(
            f"the job keeps {replicas} replicas of each slot on distinct pservers, so it needs at least {replicas} pservers; asked for {pservers}"
        )
    if pservers is not None and pservers > num_slots:
        raise ConfigError(f"the job has {num_slots} slots, so at most {num_slots} pservers; asked for {pservers}")
    if trainers is not None and trainers < 1:
        raise ConfigError(f"a job needs at least 1 trainer, asked for {trainers}")


@attrs.frozen
class Resize:
    """The job's resize record (``resize``): the newest resize, in progress or done."""

    id: str
    state: ResizeState
    pservers: int  # the pserver count it ends with
    trainers: int | None  # the trainer count it asks for (None: unchanged)
    requested: float  # when it was asked for (time.time() of the asker)
    by: str = ""
    from_map: SlotMap | None = None  # set once migrating
    to_map: SlotMap | None = None

    @property
    def active(self) -> bool:
        return self.state is not ResizeState.DONE

    def _to(self, event: ResizeEvent, **changes: object) -> Resize:
        state = machine.move(RESIZE_TRANSITIONS, f"resize {self.id}", self.state, event)
        return attrs.evolve(self, state=state, **changes)

    def grow(self) -> Resize:
        return self._to(ResizeEvent.GROW)

    def plan(self, current: SlotMap) -> Resize:
        """Decide the new map: ``current`` rebalanced onto :attr:`pservers`, with its
        replicas, moving the fewest copies a balanced map allows
        (:meth:`SlotMap.rebalance`)."""
        return self._to(ResizeEvent.PLAN, from_map=current, to_map=current.rebalance(self.pservers))

    def replenish(self, current: SlotMap, live: set[int], *, balance: bool = False) -> Resize:
        """Decide the new map of a re-replication: ``current`` with every slot back to
        its replicas, the missing copies made on ``live`` pservers (the emptiest first:
        a replacement at a dead pserver's index takes them all), nothing else moved
        (:meth:`SlotMap.replenish`). With ``balance`` (every pserver live), the primaries
        are spread again too, as a rebalance onto the same count spreads them: the
        replacement takes back its share of them, which moves no further copy."""
        to_map = current.replenish(live)
        if balance and set(live) == set(range(current.num_pservers)):
            to_map = attrs.evolve(to_map.rebalance(current.num_pservers), version=to_map.version)
        return self._to(ResizeEvent.PLAN, from_map=current, to_map=to_map)

    def finish(self) -> Resize:
        return self._to(ResizeEvent.FINISH)

    def without_receiver(self, live: SlotMap, pserver: int) -> SlotMap | None:
        """A re-replication whose only receiver died (or restarted without what it had
        received) is dropped: the live map without ``pserver`` (its new copies, and any
        primaries it was handed, go back to the copies they came from, which moves
        nothing), to be written with :meth:`finish`, after which the missing copies are
        planned again. None when that does not apply: this is not a migrating resize
        that made ``live`` with the same pserver count (a death during a resize that
        changes the count rolls back), ``pserver`` held some slot before it, or other
        pservers receive too."""
        if (
            self.state is not ResizeState.MIGRATING or self.from_map is None or self.to_map is None
            or self.to_map.version != live.version or self.from_map.num_pservers != live.num_pservers
            or self.from_map.held_by(pserver) or self.receivers() != [pserver] or live.lost_with(pserver)
        ):
            return None
        return live.without(pserver)

    def moves(self) -> list[tuple[int, int, int]]:
        """``(slot, from, to)`` of every copy made anew (none before the plan)."""
        if self.from_map is None or self.to_map is None:
            return []
        return self.from_map.moves(self.to_map)

    def receivers(self) -> list[int]:
        """The pservers that receive slots, each of which reports once it holds them."""
        return sorted({to for _, _, to in self.moves()})

    def incoming(self, pserver: int) -> dict[int, list[int]]:
        """For ``pserver``: source pserver -> the slots it receives from there."""
        out: dict[int, list[int]] = {}
        for slot, src, dst in self.moves():
            if dst == pserver:
                out.setdefault(src, []).append(slot)
        return out

    def to_json(self) -> dict:
        out: dict = {"id": self.id, "state": self.state.value, "pservers": self.pservers, "trainers": self.trainers, "requested": self.requested, "by": self.by}
        if self.from_map is not None and self.to_map is not None:
            out["from_map"], out["to_map"] = self.from_map.to_json(), self.to_map.to_json()
        return out

    @classmethod
    def from_json(cls, d: Mapping) -> Resize:
        try:
            trainers = d.get("trainers")
            return cls(
                id=str(d["id"]),
                state=ResizeState(d["state"]),
                pservers=int(d["pservers"]),
                trainers=None if trainers is None else int(trainers),
                requested=float(d.get("requested", 0.0)),
                by=str(d.get("by", "")),
                from_map=SlotMap.from_json(d["from_map"]) if "from_map" in d else None,
                to_map=SlotMap.from_json(d["to_map"]) if "to_map" in d else None,
            )
        except (KeyError, TypeError, ValueError, ConfigError) as exc:
            raise CorruptRecord(f"resize record is not one pdps wrote: {exc}") from exc


def minimum_bytes(layout: Layout, to_map: SlotMap, state_copies: int = 1) -> int:
    """The fewest bytes any resize from ``layout``'s map to ``to_map`` must send: every
    block of each copy ``to_map`` places on a pserver that held no copy of its slot
    (with replicas, each such copy counts), with its optimizer state
    (``state_copies`` tensors of its size: 1 for plain SGD, 3 for Adam)."""
    sizes = layout.slot_bytes(state_copies)
    return sum(sizes[s] for s, _, _ in layout.slot_map.moves(to_map))


def describe(resize: Resize, got: Sequence[int] = ()) -> str:
    """One line for logs and errors: what the resize does and how far it is."""
    trainers = "" if resize.trainers is None else f", {resize.trainers} trainers"
    line = f"resize {resize.id} to {resize.pservers} pservers{trainers} ({resize.state}"
    if resize.state is ResizeState.MIGRATING:
        receivers = resize.receivers()
        line += f": {len(resize.moves())} slots moving, {len(set(got) & set(receivers))} of {len(receivers)} receiving pservers done"
    return line + ")"
