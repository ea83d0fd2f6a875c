"""The consistency rules: the sync round record, the staleness bound, the async cadence."""

from __future__ import annotations

import json

import pytest

from pdps.core.errors import ConfigError, InvalidTransition, StalePush
from pdps.core.sgd import Cadence, Contribution, Mode, RoundRecord, check_staleness, participants

# --- RoundRecord: the transactional sync round --------------------------------------


def C(samples: int, **kw) -> Contribution:
    return Contribution(samples, **kw)


def test_round_closes_once_every_participant_committed():
    r = RoundRecord(0)
    parts = {"a", "b", "c"}
    assert not r.ready(parts)
    r = r.contribute("a", C(32, task=1, attempt=1, offset=32)).contribute("b", C(16))
    assert r.waiting_for(parts) == {"c"}
    assert not r.ready(parts)
    r = r.contribute("c", C(0))  # an idle trainer contributes zero samples
    assert r.ready(parts)
    closed = r.close("ckpt-x")
    assert closed.closed and closed.checkpoint == "ckpt-x"
    assert closed.total == 48 and closed.applies_update
    assert closed.weights() == [("a", 32 / 48), ("b", 16 / 48)]  # sorted, zero-sample ones left out


def stored(r: RoundRecord) -> RoundRecord:
    """``r`` written as the store holds it (one JSON value per contribution, and the close
    marker once closed) and read back."""
    contributions = {t: Contribution.from_json(json.loads(json.dumps(c.to_json()))) for t, c in r.contributions.items()}
    return RoundRecord.from_stored(r.round_no, contributions, json.loads(json.dumps(r.marker_json())) if r.closed else None)


def test_record_is_immutable_and_round_trips_through_its_stored_form():
    r = RoundRecord(7).contribute("b", C(3, task=4, attempt=2, offset=9, last=True)).contribute("a", C(0))
    assert RoundRecord(7).contributions == {}
    again = stored(r)
    assert again == r
    assert stored(again.close("ckpt-7")) == r.close("ckpt-7") and stored(r.close()).closed


def test_a_close_marker_must_name_its_round():
    with pytest.raises(ValueError, match="round 3"):
        RoundRecord.from_stored(4, {}, {"round": 3, "checkpoint": None})


def test_a_closed_round_takes_no_more_commits():
    r = RoundRecord(3).contribute("a", C(4)).close()
    with pytest.raises(StalePush, match="round 3 is closed"):
        r.contribute("b", C(8))
    with pytest.raises(InvalidTransition):
        r.close()


def test_participant_leaving_by_lease_is_no_longer_waited_for():
    r = RoundRecord(5).contribute("a", C(8))
    assert not r.ready(participants({"a"}, {"a", "b"}) | {"b"})
    assert r.ready(participants({"a"}, {"a", "b"}))  # b's lease expired: not live
    assert r.close().weights() == [("a", 1.0)]


def test_contribution_of_a_trainer_that_died_after_committing_still_counts():
    r = RoundRecord(0).contribute("a", C(8)).contribute("b", C(4))
    assert r.ready(participants({"b"}, None))
    assert dict(r.close().weights()) == {"a": 8 / 12, "b": 4 / 12}


def test_participants_are_last_rounds_contributors_or_everyone_at_an_epoch_start():
    assert participants({"a", "b", "c"}, None) == {"a", "b", "c"}
    prev = RoundRecord(0).contribute("a", C(1)).contribute("b", C(0))
    # c joined after round 0: not waited for until it contributes; d contributed and died
    assert participants({"a", "b", "c"}, set(prev.contributions) | {"d"}) == {"a", "b"}


def test_nobody_committed_is_never_ready_and_cannot_close():
    r = RoundRecord(0)
    assert not r.ready([])
    with pytest.raises(InvalidTransition, match="nobody contributed"):
        r.close()


def test_zero_sample_round_closes_but_applies_no_update():
    r = RoundRecord(0).contribute("a", C(0)).contribute("b", C(0))
    closed = r.close()
    assert closed.total == 0 and not closed.applies_update and closed.weights() == []


def test_committing_the_same_contribution_again_is_a_no_op_and_another_is_refused():
    r = RoundRecord(0).contribute("a", C(10))
    assert r.contribute("a", C(10)) is r  # a retry whose reply was lost
    with pytest.raises(InvalidTransition, match="already contributed"):
        r.contribute("a", C(99))


def test_negative_samples_are_rejected_before_any_change():
    with pytest.raises(ConfigError):
        RoundRecord(0).contribute("a", C(-1))


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
