"""The consistency rules: the sync barrier, the staleness bound, the async cadence."""

from __future__ import annotations

import pytest

from pdps.core.errors import ConfigError, InvalidTransition, StalePush
from pdps.core.sgd import Barrier, Cadence, Mode, RoundResult, check_staleness

# --- Barrier ------------------------------------------------------------------------


def test_round_closes_once_every_member_contributed():
    b = Barrier()
    members = {"a", "b", "c"}
    assert not b.ready(members)
    b.contribute("a", 0, 32)
    b.contribute("b", 0, 16)
    assert b.contributed("a") and not b.contributed("c")
    assert b.waiting_for(members) == {"c"}
    assert not b.ready(members)
    b.contribute("c", 0, 0)  # an idle trainer contributes zero samples
    assert b.waiting_for(members) == set()
    assert b.ready(members)
    result = b.close()
    assert result == RoundResult(0, {"a": 32, "b": 16, "c": 0})
    assert result.total == 48 and result.applies_update


def test_close_advances_the_round_and_forgets_contributions():
    b = Barrier()
    b.contribute("a", 0, 4)
    b.close()
    assert b.round_no == 1
    assert not b.contributed("a")
    assert not b.ready({"a"})
    b.contribute("a", 1, 2)  # the same trainer, the next round
    assert b.close() == RoundResult(1, {"a": 2})
    assert b.round_no == 2


def test_member_leaving_is_no_longer_waited_for():
    b = Barrier(round_no=5)
    b.contribute("a", 5, 8)
    assert not b.ready(["a", "b"])
    assert b.ready(["a"])  # b's lease expired: it left the members
    assert b.close() == RoundResult(5, {"a": 8})


def test_contribution_of_a_member_that_left_still_counts():
    b = Barrier()
    b.contribute("a", 0, 8)
    b.contribute("b", 0, 4)
    assert b.ready(["b"])
    assert b.close().samples == {"a": 8, "b": 4}


def test_no_contribution_is_never_ready_even_without_members():
    b = Barrier()
    assert not b.ready([])
    with pytest.raises(InvalidTransition, match="nobody contributed"):
        b.close()
    assert b.round_no == 0


def test_zero_sample_round_closes_but_applies_no_update():
    b = Barrier()
    b.contribute("a", 0, 0)
    b.contribute("b", 0, 0)
    assert b.ready({"a", "b"})
    result = b.close()
    assert result.total == 0
    assert not result.applies_update
    assert b.round_no == 1


def test_push_for_a_closed_round_is_stale():
    b = Barrier(round_no=3)
    with pytest.raises(StalePush, match="round 2 is closed"):
        b.contribute("a", 2, 10)
    assert not b.contributed("a")


def test_push_for_a_future_round_is_an_invalid_transition():
    b = Barrier(round_no=3)
    with pytest.raises(InvalidTransition) as ei:
        b.contribute("a", 4, 10)
    assert ei.value.subject == "trainer a"
    assert "pull first" in str(ei.value)
    assert not b.contributed("a")


def test_second_contribution_to_the_open_round_is_refused_and_keeps_the_first():
    b = Barrier()
    b.contribute("a", 0, 10)
    with pytest.raises(InvalidTransition, match="already contributed"):
        b.contribute("a", 0, 99)
    assert b.close().samples == {"a": 10}


def test_negative_samples_are_rejected_before_any_change():
    b = Barrier()
    with pytest.raises(ConfigError):
        b.contribute("a", 0, -1)
    assert not b.contributed("a")
    # even for a stale round, the bad value is what is reported
    b.round_no = 2
    with pytest.raises(ConfigError):
        b.contribute("a", 0, -1)


# --- staleness ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("base", "current", "bound"),
    [(10, 10, 0), (8, 10, 2), (0, 1_000, None), (12, 10, 0)],
)
def test_fresh_enough_push_passes(base, current, bound):
    assert check_staleness(base, current, bound) is None


@pytest.mark.parametrize(("base", "current", "bound"), [(9, 10, 0), (7, 10, 2), (0, 100, 50)])
def test_too_old_push_is_stale(base, current, bound):
    with pytest.raises(StalePush) as ei:
        check_staleness(base, current, bound)
    assert f"{current - base} versions behind" in str(ei.value)


# --- cadence ------------------------------------------------------------------------


def test_cadence_counts_minibatches():
    c = Cadence(push_every=2, pull_every=3)
    assert [n for n in range(1, 13) if c.push_due(n)] == [2, 4, 6, 8, 10, 12]
    assert [n for n in range(1, 13) if c.pull_due(n)] == [3, 6, 9, 12]
    every = Cadence()
    assert all(every.push_due(n) and every.pull_due(n) for n in range(1, 6))


@pytest.mark.parametrize(("n", "m"), [(0, 1), (1, 0), (-1, 2)])
def test_cadence_rejects_non_positive_counts(n, m):
    with pytest.raises(ConfigError, match="push_every and pull_every"):
        Cadence(push_every=n, pull_every=m)


# --- mode ---------------------------------------------------------------------------


def test_mode_parse():
    assert Mode.parse("sync") is Mode.SYNC
    assert Mode.parse("async") is Mode.ASYNC
    assert Mode.parse(Mode.ASYNC) is Mode.ASYNC
    assert str(Mode.SYNC) == "sync"


@pytest.mark.parametrize("bad", ["SYNC", "", "hogwild", None, 1])
def test_mode_parse_errors(bad):
    with pytest.raises(ConfigError) as ei:
        Mode.parse(bad)
    assert repr(bad) in str(ei.value)
    assert isinstance(ei.value, ValueError)
