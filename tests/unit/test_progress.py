"""The progress record: exactly once per record, with two attempts racing for a task."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from pdps.core.errors import CorruptRecord, StalePush
from pdps.core.progress import NO_PROGRESS, TaskProgress


def test_records_without_a_race_encode_as_before_and_old_records_decode():
    old = b'{"attempt": 3, "applied": 10, "fenced": false}'
    assert TaskProgress(3, 10).encode() == old
    assert TaskProgress.decode(old, "progress/1") == TaskProgress(3, 10)
    assert TaskProgress.decode(b'{"attempt": 3, "applied": 10}', "progress/1") == TaskProgress(3, 10)
    raced = TaskProgress(3, 10, race=(3, 4), beaten=2)
    assert TaskProgress.decode(raced.encode(), "progress/1") == raced


@pytest.mark.parametrize("raw", [b'{"attempt": 1, "applied": 0, "race": [4, 3]}', b'{"attempt": 1, "applied": 0, "race": 4}', b'{"attempt": 1, "applied": 0, "beaten": -1}'])
def test_a_bad_race_or_beaten_is_a_corrupt_record_naming_the_key(raw):
    with pytest.raises(CorruptRecord, match="progress/7"):
        TaskProgress.decode(raw, "progress/7")


def test_without_a_race_an_attempt_advances_and_takes_over_as_before():
    p = NO_PROGRESS.advance(1, 0, 10)
    assert p == TaskProgress(1, 10)
    assert p.advance(1, 10, 20) == TaskProgress(1, 20)
    assert p.advance(2, 10, 15) == TaskProgress(2, 15)  # a later attempt takes over
    with pytest.raises(StalePush):
        TaskProgress(2, 15).advance(1, 15, 20)
    fenced = p.fence(1, 0)
    assert fenced == TaskProgress(1, 10, fenced=True)
    with pytest.raises(StalePush):
        fenced.advance(1, 10, 20)
    assert fenced.advance(2, 10, 20) == TaskProgress(2, 20)


def test_the_first_commit_of_a_raced_range_wins_and_fences_the_loser():
    race = TaskProgress(3, 10).open_race(3, 4)
    won = race.advance(4, 10, 15)  # the backup first
    assert won == TaskProgress(4, 15, beaten=4)
    with pytest.raises(StalePush, match="advanced by attempt 4"):
        won.advance(3, 10, 20)
    # the primary first: the backup is beaten, for good
    won = race.advance(3, 10, 20)
    assert won == TaskProgress(3, 20, beaten=4)
    with pytest.raises(StalePush, match="lost its race"):
        won.advance(4, 10, 15)
    assert won.advance(3, 20, 30) == TaskProgress(3, 30, beaten=4)
    assert not won.advance(3, 20, 30).allows(4)
    assert won.advance(5, 20, 30).allows(5)


def test_in_a_race_a_step_must_start_where_the_record_stands():
    race = TaskProgress(3, 10).open_race(3, 4)
    with pytest.raises(StalePush, match=r"records up to 10 were committed by attempt 3"):
        race.advance(4, 5, 15)


def test_fencing_a_backup_ends_the_race_and_the_primary_goes_on():
    race = TaskProgress(3, 10).open_race(3, 4)
    ended = race.fence(4, 10)
    assert ended == TaskProgress(3, 10, beaten=4)
    assert ended.advance(3, 10, 12) == TaskProgress(3, 12, beaten=4)
    with pytest.raises(StalePush):
        ended.advance(4, 10, 12)


def test_fencing_the_primary_ends_the_race_and_the_backup_goes_on_from_applied():
    race = TaskProgress(2, 10, fenced=True).open_race(3, 4)  # attempt 3 has not committed yet
    ended = race.fence(3, 0)
    assert ended == TaskProgress(3, 10, fenced=True)
    assert ended.advance(4, 10, 20) == TaskProgress(4, 20)


def test_fencing_an_attempt_already_over_changes_nothing():
    p = TaskProgress(5, 30, beaten=4)
    assert p.fence(3, 0) is p  # superseded
    assert TaskProgress(3, 20, beaten=4).fence(4, 10) == TaskProgress(3, 20, beaten=4)  # beaten


def test_a_race_opens_only_for_a_live_primary_and_a_fresh_backup():
    p = TaskProgress(3, 10)
    assert p.open_race(3, 4).open_race(3, 4) == p.open_race(3, 4)  # a master retrying
    with pytest.raises(StalePush):
        TaskProgress(3, 10, fenced=True).open_race(3, 4)
    with pytest.raises(ValueError):
        p.open_race(3, 3)
    with pytest.raises(ValueError):
        TaskProgress(3, 10, beaten=5).open_race(3, 5)
    with pytest.raises(ValueError):
        p.open_race(3, 4).open_race(3, 5)


# --- two racers and a fencer, in any order ----------------------------------------------


class Racer:
    """A trainer's attempt: it advances the stored record by compare-and-set on the
    value it last read, reading again after a lost compare-and-set, as the trainer does."""

    def __init__(self, attempt: int, at: int, store: list[TaskProgress]) -> None:
        self.attempt, self.at, self.store = attempt, at, store
        self.seen = store[0]
        self.over = False

    def step(self, size: int, records: int, committed: list[tuple[int, int, int]]) -> None:
        if self.over or self.at >= records:
            return
        end = min(records, self.at + size)
        for _ in range(2):  # the compare-and-set loop: at most one retry after a refresh
            try:
                new = self.seen.advance(self.attempt, self.at, end)
            except StalePush:
                self.over = True
                return
            if self.store[0] == self.seen:
                self.store[0] = self.seen = new
                committed.append((self.attempt, self.at, end))
                self.at = end
                return
            self.seen = self.store[0]


@settings(max_examples=300, deadline=None)
@given(
    records=st.integers(1, 40),
    before=st.integers(0, 40),
    moves=st.lists(st.tuples(st.sampled_from(["a", "b", "fence a", "fence b", "peek a", "peek b"]), st.integers(1, 7)), max_size=40),
)
def test_racing_attempts_commit_every_record_at_most_once_in_order(records, before, moves):
    """Attempt 3 trains records [0, X), the master opens a race with backup attempt 4 at
    X, and the two racers and a fencer act in any order: the committed ranges always
    tile [0, applied) exactly, with no record committed twice."""
    x = min(before, records - 1)
    store = [TaskProgress(3, x) if x else TaskProgress(2, 0, fenced=True)]
    committed = [(3, 0, x)] if x else []
    store[0] = store[0].open_race(3, 4)
    racers = {"a": Racer(3, x, store), "b": Racer(4, x, store)}
    offsets = {"a": 0, "b": x}
    raced = len(committed)  # the commits before this one came before the race
    for move, size in moves:
        who = move[-1]
        if move.startswith("fence"):
            store[0] = store[0].fence(racers[who].attempt, offsets[who])
        elif move.startswith("peek"):
            racers[who].seen = store[0]  # a racer that read the record at another moment
        else:
            racers[who].step(size, records, committed)
        applied = store[0].applied
        tiles = sorted((s, e) for _, s, e in committed if e > s)
        assert [s for s, _ in tiles] == [0, *(e for _, e in tiles)][: len(tiles)]  # contiguous, no overlap
        assert (tiles[-1][1] if tiles else 0) == applied
        # one attempt wins the race: the other commits nothing from the race on
        assert len({a for a, _, _ in committed[raced:]}) <= 1
