"""Every state machine's transition table: each listed move is taken, any other is
refused with an :class:`InvalidTransition` naming the machine, its state and the event."""

from __future__ import annotations

import itertools

import pytest

from pdps.core import group_commit, lifecycle, tasks
from pdps.core.errors import InvalidTransition, StalePush
from pdps.core.group_commit import CommitEvent, CommitState
from pdps.core.lifecycle import PserverEvent, PserverState
from pdps.core.machine import move
from pdps.core.sgd import ROUND_TRANSITIONS, Contribution, RoundEvent, RoundRecord, RoundState

MACHINES = {
    "task": (tasks.TRANSITIONS, tasks.State, tasks.Event),
    "sync round": (ROUND_TRANSITIONS, RoundState, RoundEvent),
    "pserver": (lifecycle.TRANSITIONS, PserverState, PserverEvent),
    "group commit": (group_commit.TRANSITIONS, CommitState, CommitEvent),
}


def allowed_moves():
    for name, (table, _, _) in MACHINES.items():
        for (state, event), targets in table.items():
            for target in sorted(targets):
                yield pytest.param(name, state, event, target, id=f"{name}:{state}-{event}->{target}")


def refused_moves():
    for name, (table, states, events) in MACHINES.items():
        for state, event in itertools.product(states, events):
            if (state, event) not in table:
                yield pytest.param(name, state, event, id=f"{name}:{state}-{event}")


@pytest.mark.parametrize(("name", "state", "event", "target"), list(allowed_moves()))
def test_every_move_the_table_lists_is_taken(name, state, event, target):
    table = MACHINES[name][0]
    assert move(table, name, state, event, target) is target
    if len(table[state, event]) == 1:
        assert move(table, name, state, event) is target  # the only target needs no pick


@pytest.mark.parametrize(("name", "state", "event"), list(refused_moves()))
def test_a_move_the_table_does_not_list_is_refused_naming_machine_state_and_event(name, state, event):
    with pytest.raises(InvalidTransition) as err:
        move(MACHINES[name][0], f"{name} 7", state, event)
    assert (err.value.subject, err.value.state, err.value.event) == (f"{name} 7", state, event)
    assert f"{name} 7" in str(err.value) and str(state) in str(err.value) and str(event) in str(err.value)


def test_an_event_with_several_targets_needs_the_machines_pick():
    with pytest.raises(InvalidTransition):
        group_commit.next_state(CommitState.COMMITTING, CommitEvent.COMMITTED)
    with pytest.raises(InvalidTransition):  # a target the table does not list for the event
        group_commit.next_state(CommitState.COMMITTING, CommitEvent.COMMITTED, CommitState.BROKEN)


def test_each_machine_names_itself_in_a_refusal():
    with pytest.raises(InvalidTransition, match="'pserver 2' in state serving cannot take event start"):
        lifecycle.next_state("pserver 2", PserverState.SERVING, PserverEvent.START)
    with pytest.raises(InvalidTransition, match="'group commit' in state broken cannot take event lead"):
        group_commit.next_state(CommitState.BROKEN, CommitEvent.LEAD)
    with pytest.raises(InvalidTransition, match="'round 4' in state closed cannot take event close"):
        RoundRecord(4, {"t": Contribution(1)}).close().close()


def test_a_halted_pserver_stays_as_it_ended():
    for halted in lifecycle.HALTED:
        for event in (PserverEvent.STOP, PserverEvent.CRASH):
            assert lifecycle.next_state("pserver 0", halted, event) is halted
    for live in set(PserverState) - lifecycle.HALTED:
        assert lifecycle.next_state("pserver 0", live, PserverEvent.CRASH) is PserverState.CRASHED


def test_a_round_moves_through_its_table():
    record = RoundRecord(3).contribute("a", Contribution(2)).contribute("b", Contribution(6))
    assert record.state is RoundState.OPEN and not record.closed
    with pytest.raises(InvalidTransition) as err:
        record.weights_to_apply()  # an open record may still grow: nothing is applied from it
    assert (err.value.subject, err.value.state, err.value.event) == ("round 3", RoundState.OPEN, RoundEvent.APPLY)
    closed = record.close("ckpt")
    assert closed.state is RoundState.CLOSED and closed.closed and closed.checkpoint == "ckpt"
    assert closed.weights_to_apply() == [("a", 0.25), ("b", 0.75)]
    with pytest.raises(StalePush):  # the table refuses it; a trainer reads it as "pull and compute again"
        closed.contribute("c", Contribution(1))
    assert RoundRecord.from_stored(3, closed.contributions, closed.marker_json()) == closed
