"""How many pservers and trainers a running job wants, and what whoever starts its
processes does about it: ``pdps launch``, :func:`pdps.simulate`, a pserver pod.

The desired counts live in the store (``ps_desired``; ``trainers_desired`` once a
resize named a trainer count, the configured count until then), written by
``pdps scale`` (:func:`pdps.runtime.resizing.request_resize`). Following them only
ever *starts* roles: a departing pserver or trainer leaves by itself and exits 0, and
its place is free from then on (:func:`leaves`); a role that crashed keeps its place
(it is restarted, or the job ends), and so does one that exits 0 when no fewer are
wanted (a trainer done with the job). Nothing here reads the store or a clock.
"""

from __future__ import annotations

import enum
import itertools
import re
from collections.abc import Iterable

import attrs

from pdps.core.elastic import Resize
from pdps.core.errors import CorruptRecord


@attrs.frozen
class Desired:
    """The counts the job wants now."""

    pservers: int
    trainers: int

    def of(self, kind: str) -> int:
        """The count of ``kind`` (``pserver`` or ``trainer``)."""
        return {"pserver": self.pservers, "trainer": self.trainers}[kind]


def parse_count(raw: bytes, key: str) -> int:
    """A desired count as stored (a whole number >= 1 in ASCII); CorruptRecord naming ``key``."""
    text = raw.decode("ascii", errors="replace").strip()
    if not text.isdigit() or int(text) < 1:
        raise CorruptRecord(f"{key} must hold a whole number of at least 1 in ASCII, holds {raw[:40]!r}; write it again with pdps scale", key)
    return int(text)


def leaves(desired: int, taking_part: int) -> bool:
    """Whether a role that exited 0 on its own, one of ``taking_part`` of its kind (itself
    included), left because a resize removed it: only while more take part than are
    wanted. Its place is then free and it is not restarted; otherwise it ended as before
    resizing existed (a trainer finished, a pserver died)."""
    return taking_part > desired


def to_start(kind: str, desired: int, started: int, left: int) -> tuple[str, ...]:
    """The names of the ``kind`` children to start so that ``desired`` of them take part.

    ``started``: how many were ever started (named ``<kind>-0`` onwards, so new names
    go on from there); ``left``: how many of them exited 0 on their own (their places
    are free; they are never restarted). More than ``desired`` taking part starts none:
    the surplus leaves by itself.
    """
    return tuple(f"{kind}-{started + k}" for k in range(max(0, desired - (started - left))))


def free_indexes(held: Iterable[int], count: int) -> list[int]:
    """The ``count`` lowest pserver indexes not in ``held`` (for new pservers that start
    with a fixed index, as a StatefulSet's pods do)."""
    taken = set(held)
    return list(itertools.islice((i for i in itertools.count() if i not in taken), count))


class Entry(str, enum.Enum):
    """What a pserver with a fixed index does before it claims it."""

    CLAIM = "claim"  # the index is one the job has (or one a migration still needs)
    ASK = "ask"  # beyond the job's pservers: ask for a resize to index + 1 first
    WAIT = "wait"  # the newest resize removed this index: wait until one wants it again

    def __str__(self) -> str:
        return self.value


def claimable(desired: int, map_pservers: int, latest: Resize | None) -> int:
    """How many pserver indexes may be claimed: those desired, those the live map names,
    and, while a resize is in progress, those of the map it leaves (a departing pserver
    restarted in the middle of its handoff takes its index back)."""
    leaving = latest.from_map.num_pservers if latest is not None and latest.active and latest.from_map is not None else 0
    return max(desired, map_pservers, leaving)


def pserver_entry(index: int, desired: int, map_pservers: int, latest: Resize | None) -> Entry:
    """Whether a pserver with fixed ``index`` (a StatefulSet pod's ordinal) may claim it.

    An index below ``desired`` or below the live map's pserver count (``map_pservers``:
    a departing pserver restarted in the middle of its handoff) is claimed. One beyond
    both is a pod the operator added (``kubectl scale`` first): it asks for the grow
    itself, unless the newest resize (``latest``) removed this very index; then it is a
    departed pod its StatefulSet restarted before being scaled down, and asking would
    undo the shrink, so it waits (to add the index back, ``pdps scale``).
    """
    if index < claimable(desired, map_pservers, latest):
        return Entry.CLAIM
    removed = latest is not None and latest.from_map is not None and latest.pservers <= index < latest.from_map.num_pservers
    return Entry.WAIT if removed else Entry.ASK


def _natural(name: str) -> tuple:
    """``trainer-10`` after ``trainer-9``: digit runs compare as numbers."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def surplus(live: Iterable[str], desired: int) -> set[str]:
    """The trainers that leave when ``desired`` are wanted and ``live`` run: the last
    ones in natural order of their ids (the newest a launcher numbered), so every
    trainer that asks computes the same set from the same membership."""
    ordered = sorted(set(live), key=_natural)
    return set(ordered[max(desired, 0) :])
