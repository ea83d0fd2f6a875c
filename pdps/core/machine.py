"""The one check every state machine of pdps makes against its transition table.

A machine's legal moves live in one explicit table, ``(state, event) -> targets``,
next to the machine (tasks: :mod:`pdps.core.tasks`; sync rounds: :mod:`pdps.core.sgd`;
the pserver's lifecycle: :mod:`pdps.core.lifecycle`; group commit:
:mod:`pdps.core.group_commit`). Where an event may lead to several states, the
machine picks one of the table's targets; a move the table does not list raises
:class:`~pdps.core.errors.InvalidTransition` naming the machine, its state and the
event, and changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from pdps.core.errors import InvalidTransition

S = TypeVar("S")

Table = Mapping[tuple[S, object], frozenset[S]]


def move(table: Table[S], subject: object, state: S, event: object, target: S | None = None, detail: str = "") -> S:
    """The state ``subject`` moves to from ``state`` on ``event``: ``target``, or the
    table's only target when ``target`` is None. Raises :class:`InvalidTransition`
    when the table does not allow the move."""
    allowed = table.get((state, event))
    if allowed is None or (target is None and len(allowed) != 1) or (target is not None and target not in allowed):
        raise InvalidTransition(subject, state, event, detail)
    return next(iter(allowed)) if target is None else target
