"""The follower's decisions (pdps.core.headcount): whom to start given the desired count,
those started and those that left; which exit 0 frees a place; what a pserver with a
fixed index does before it claims it."""

from __future__ import annotations

import pytest

from pdps.core.elastic import Resize, ResizeState
from pdps.core.errors import CorruptRecord
from pdps.core.headcount import Desired, Entry, free_indexes, leaves, parse_count, pserver_entry, to_start
from pdps.core.slots import SlotMap


@pytest.mark.parametrize(
    "desired, started, left, expected",
    [
        (3, 3, 0, ()),  # as configured: nothing
        (4, 3, 0, ("trainer-3",)),  # grow: the numbering goes on
        (5, 3, 0, ("trainer-3", "trainer-4")),
        (2, 3, 0, ()),  # shrink: the surplus leaves by itself, nobody is stopped
        (2, 3, 1, ()),  # ... and once it has left, nobody replaces it
        (3, 3, 1, ("trainer-3",)),  # back up after a shrink: a new name, never the one that left
        (3, 4, 1, ()),
    ],
)
def test_to_start_counts_those_that_left_as_free_places(desired, started, left, expected):
    assert to_start("trainer", desired, started, left) == expected


def test_to_start_names_pservers_by_their_kind():
    assert to_start("pserver", 3, 2, 0) == ("pserver-2",)


@pytest.mark.parametrize(
    "desired, taking_part, expected",
    [
        (2, 3, True),  # a resize removed one: its exit 0 frees its place
        (3, 3, False),  # nobody is surplus: a trainer done with the job, or a pserver that died
        (4, 3, False),
    ],
)
def test_an_exit_0_is_a_leaving_only_while_more_take_part_than_are_wanted(desired, taking_part, expected):
    assert leaves(desired, taking_part) is expected


def test_two_trainers_exiting_with_one_surplus_free_one_place():
    desired, taking_part = 2, 3
    first = leaves(desired, taking_part)
    second = leaves(desired, taking_part - first)
    assert (first, second) == (True, False)


def test_free_indexes_are_the_lowest_not_held():
    assert free_indexes([0, 1], 1) == [2]
    assert free_indexes([0, 2, 3], 2) == [1, 4]
    assert free_indexes([], 0) == []


def test_desired_of_a_kind():
    assert (Desired(2, 5).of("pserver"), Desired(2, 5).of("trainer")) == (2, 5)


@pytest.mark.parametrize("raw", [b"", b"x", b"-1", b"0", b"2.5", b'{"n": 2}'])
def test_a_desired_count_that_is_no_whole_number_is_a_corrupt_record(raw):
    with pytest.raises(CorruptRecord, match="/pdps/j/ps_desired") as info:
        parse_count(raw, "/pdps/j/ps_desired")
    assert info.value.key == "/pdps/j/ps_desired"


def test_a_desired_count_reads_as_written():
    assert parse_count(b"12", "k") == 12


def resize(pservers: int, from_pservers: int | None, state: ResizeState = ResizeState.DONE) -> Resize:
    before = None if from_pservers is None else SlotMap.initial(from_pservers, 128)
    return Resize(
        id="r", state=state, pservers=pservers, trainers=None, requested=0.0,
        from_map=before, to_map=None if before is None else before.rebalance(pservers),
    )  # fmt: skip


@pytest.mark.parametrize(
    "index, desired, map_pservers, latest, expected",
    [
        (1, 2, 2, None, Entry.CLAIM),  # one of the job's
        (2, 3, 2, resize(3, None, ResizeState.REQUESTED), Entry.CLAIM),  # pdps scale first: the grow is asked for
        (2, 2, 2, None, Entry.ASK),  # kubectl scale first: ask for the grow
        (3, 2, 2, None, Entry.ASK),  # asks for index + 1, the pods below come in with it
        (2, 2, 3, resize(2, None, ResizeState.REQUESTED), Entry.CLAIM),  # a departing pserver restarted mid-handoff
        (2, 2, 2, resize(2, 3), Entry.WAIT),  # the shrink removed it: its pod restarted before the scale-down
        (3, 2, 2, resize(2, 4), Entry.WAIT),
        (4, 2, 2, resize(2, 4), Entry.ASK),  # beyond what the shrink removed: a pod added later
        (2, 2, 2, resize(2, 2), Entry.ASK),  # the newest resize removed no pserver
    ],
)
def test_a_pserver_with_a_fixed_index(index, desired, map_pservers, latest, expected):
    assert pserver_entry(index, desired, map_pservers, latest) is expected


def test_the_surplus_trainers_are_the_last_in_natural_order():
    from pdps.core.headcount import surplus

    live = ["trainer-10", "trainer-9", "trainer-2", "trainer-0", "trainer-1"]
    assert surplus(live, 3) == {"trainer-9", "trainer-10"}
    assert surplus(live, 5) == set() and surplus(live, 9) == set()
    assert surplus(["b", "a"], 1) == {"b"}
