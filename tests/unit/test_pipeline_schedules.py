"""Pipeline schedules as data (pdps.core.pipeline): each generated schedule runs, its
simulated bubble matches the theory, its activation peaks are the known ones, and broken
schedules are refused with a message naming what is wrong."""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from pdps.core.errors import ConfigError
from pdps.core.pipeline import (
    Action,
    Op,
    ScheduleError,
    bubble_theory,
    check_rank,
    check_schedule,
    gpipe,
    interleaved_1f1b,
    lower,
    one_f_one_b,
    simulate,
)

PM = st.tuples(st.integers(1, 8), st.integers(1, 16))
FAST = settings(max_examples=60, deadline=None)


def F(m, s):
    return Action(Op.FORWARD, m, s)


def B(m, s):
    return Action(Op.BACKWARD, m, s)


@FAST
@given(PM)
def test_gpipe_and_1f1b_run_and_their_bubble_is_the_theory(pm):
    P, M = pm
    theory = bubble_theory(P, M)
    assert theory == (P - 1) / (M + P - 1)
    for make in (gpipe, one_f_one_b):
        schedule = make(P, M)
        check_schedule(schedule, P, M)
        check_schedule(lower(schedule), P, M)
        for stage, (actions, lowered) in enumerate(zip(schedule, lower(schedule))):
            assert check_rank(actions, stage, P) == M
            assert check_rank(lowered, stage, P) == M
        sim = simulate(schedule, 1.0, 1.0)
        assert sim.makespan == pytest.approx(2.0 * (M + P - 1))
        assert sim.busy == pytest.approx([2.0 * M] * P)
        assert sim.bubble == pytest.approx(theory, abs=1e-12)


@FAST
@given(PM, st.sampled_from([(1.0, 2.0), (3.0, 1.0), (0.5, 0.5)]))
def test_1f1b_has_gpipes_makespan_for_any_forward_and_backward_times(pm, times):
    P, M = pm
    f, b = times
    g, o = simulate(gpipe(P, M), f, b), simulate(one_f_one_b(P, M), f, b)
    assert g.makespan == pytest.approx((M + P - 1) * (f + b))
    assert o.makespan == pytest.approx(g.makespan)
    assert o.bubble == pytest.approx(g.bubble)


@FAST
@given(PM)
def test_activation_peaks_gpipe_holds_every_microbatch_1f1b_at_most_the_stages_left(pm):
    P, M = pm
    assert simulate(gpipe(P, M), 1.0, 1.0).peak_activations == (M,) * P
    peaks = simulate(one_f_one_b(P, M), 1.0, 1.0).peak_activations
    assert peaks == tuple(min(M, P - s) for s in range(P))
    assert max(peaks) <= P


def test_communication_cost_lengthens_the_step_by_the_hops():
    # One microbatch through 4 stages: 3 hops forward and 3 back, each p2p_s long.
    sim = simulate(gpipe(4, 1), 1.0, 2.0, p2p_s=0.25)
    assert sim.makespan == pytest.approx(4 * 3.0 + 6 * 0.25)
    assert sim.busy == (3.0,) * 4


def test_per_stage_times_a_slow_stage_sets_the_pace():
    sim = simulate(one_f_one_b(3, 8), [1.0, 3.0, 1.0], [1.0, 3.0, 1.0])
    assert sim.makespan == pytest.approx(1.0 + 8 * 6.0 + 1.0)  # stage 0's first F, the slow stage busy throughout, stage 0's last B
    with pytest.raises(ConfigError, match="forward_s has 2 times for 3 stages"):
        simulate(one_f_one_b(3, 2), [1.0, 1.0], 1.0)
    with pytest.raises(ConfigError, match="p2p_s holds -1"):
        simulate(one_f_one_b(3, 2), 1.0, 1.0, p2p_s=-1)


def test_the_timeline_respects_every_dependency():
    sim = simulate(one_f_one_b(4, 6), 1.0, 2.0, p2p_s=0.1)
    at = {span.action: span for span in sim.timeline}
    for s in range(4):
        for m in range(6):
            assert at[B(m, s)].start >= at[F(m, s)].end
            if s:
                assert at[F(m, s)].start >= at[F(m, s - 1)].end + 0.1 - 1e-12
            if s < 3:
                assert at[B(m, s)].start >= at[B(m, s + 1)].end + 0.1 - 1e-12
    for r in range(4):
        mine = [span for span in sim.timeline if span.rank == r]
        assert all(a.end <= b.start + 1e-12 for a, b in zip(mine, mine[1:]))  # a rank does one thing at a time


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 3), st.integers(1, 16))
def test_interleaved_1f1b_runs_and_cuts_the_bubble_by_the_chunks(ranks, chunks, microbatches):
    rounds = max(1, microbatches // ranks)
    if microbatches % rounds:
        with pytest.raises(ConfigError, match="not a multiple"):
            interleaved_1f1b(ranks, chunks, microbatches)
        return
    schedule = interleaved_1f1b(ranks, chunks, microbatches)
    assert len(schedule) == ranks
    assert {a.stage for a in schedule[0]} == {c * ranks for c in range(chunks)}
    check_schedule(schedule, ranks * chunks, microbatches)
    # Each chunk is 1/chunks of a rank's model: times scaled so a rank's work is 1F1B's.
    sim = simulate(schedule, 1.0 / chunks, 1.0 / chunks)
    flat = simulate(one_f_one_b(ranks, microbatches), 1.0, 1.0)
    assert sim.bubble <= flat.bubble + 1e-12
    if microbatches >= ranks:
        assert sim.bubble == pytest.approx((ranks - 1) / (chunks * microbatches + ranks - 1), abs=1e-12)


def test_interleaved_with_one_rank_hands_chunks_over_locally():
    schedule = interleaved_1f1b(1, 3, 4)
    assert all(a.op in (Op.FORWARD, Op.BACKWARD) for a in lower(schedule)[0])
    assert simulate(schedule, 1.0, 1.0).bubble == 0.0


# -- refusals --------------------------------------------------------------------------------


SCHEDULES = st.sampled_from([gpipe, one_f_one_b])


def _copy(schedule):
    return [list(actions) for actions in schedule]


@FAST
@given(PM, SCHEDULES, st.data())
def test_a_missing_action_is_refused(pm, make, data):
    P, M = pm
    s = _copy(make(P, M))
    r = data.draw(st.integers(0, P - 1))
    gone = s[r].pop(data.draw(st.integers(0, len(s[r]) - 1)))
    with pytest.raises(ScheduleError, match=f"{gone.op.name} of microbatch {gone.microbatch} on stage {gone.stage} is missing"):
        check_schedule(s, P, M)


@FAST
@given(PM, SCHEDULES, st.data())
def test_an_action_twice_is_refused(pm, make, data):
    P, M = pm
    s = _copy(make(P, M))
    r = data.draw(st.integers(0, P - 1))
    twice = data.draw(st.sampled_from(s[r]))
    s[r].insert(data.draw(st.integers(0, len(s[r]))), twice)
    with pytest.raises(ScheduleError, match="listed twice"):
        check_schedule(s, P, M)


@FAST
@given(PM, SCHEDULES, st.data())
def test_a_backward_before_its_forward_is_refused(pm, make, data):
    P, M = pm
    s = _copy(make(P, M))
    r, m = data.draw(st.integers(0, P - 1)), data.draw(st.integers(0, M - 1))
    s[r].remove(B(m, r))
    s[r].insert(s[r].index(F(m, r)), B(m, r))
    with pytest.raises(ScheduleError, match=f"BACKWARD of microbatch {m} on stage {r} comes before FORWARD of microbatch {m} on stage {r}"):
        check_schedule(s, P, M)


@FAST
@given(PM, SCHEDULES, st.data())
def test_an_action_on_another_ranks_stage_or_out_of_range_is_refused(pm, make, data):
    P, M = pm
    s = _copy(make(P, M))
    r = data.draw(st.integers(0, P - 1))
    i = data.draw(st.integers(0, len(s[r]) - 1))
    a = s[r][i]
    if P > 1:
        other = data.draw(st.integers(0, P - 1).filter(lambda x: x != r))
        moved = _copy(s)
        moved[other].append(moved[r].pop(i))
        with pytest.raises(ScheduleError, match=f"stage {r} has actions on rank"):
            check_schedule(moved, P, M)
    s[r][i] = Action(a.op, M, a.stage)
    with pytest.raises(ScheduleError, match=rf"microbatch {M}, outside \[0, {M}\)"):
        check_schedule(s, P, M)
    s[r][i] = Action(a.op, a.microbatch, P)
    with pytest.raises(ScheduleError, match=rf"stage {P}, outside \[0, {P}\)"):
        check_schedule(s, P, M)


def test_orders_in_which_ranks_wait_on_each_other_are_refused():
    # Rank 0 backs microbatch 0 before it forwards microbatch 1; rank 1 insists on
    # forwarding 1 before backing 0: each waits for the other.
    s = [[F(0, 0), B(0, 0), F(1, 0), B(1, 0)], [F(1, 1), F(0, 1), B(0, 1), B(1, 1)]]
    with pytest.raises(ScheduleError, match="wait on each other forever: rank 0 waits at RECV_GRAD of microbatch 0 on stage 0"):
        check_schedule(s, 2, 2)
    with pytest.raises(ScheduleError, match="wait on each other forever"):
        simulate(s, 1.0, 1.0)
    # The same orders with the microbatches agreeing run.
    check_schedule([[F(0, 0), B(0, 0), F(1, 0), B(1, 0)], [F(0, 1), B(0, 1), F(1, 1), B(1, 1)]], 2, 2)


def test_lowered_schedules_need_every_send_for_their_receives():
    s = lower(one_f_one_b(3, 2))
    check_schedule(s, 3, 2)
    no_send = _copy(s)
    no_send[0].remove(Action(Op.SEND_ACT, 1, 0))
    with pytest.raises(ScheduleError, match="RECV_ACT of microbatch 1 on stage 1 on rank 1 needs SEND_ACT of microbatch 1 on stage 0, which rank 0 does not list"):
        check_schedule(no_send, 3, 2)
    no_recv = _copy(s)
    no_recv[2].remove(Action(Op.RECV_ACT, 0, 2))
    with pytest.raises(ScheduleError, match="FORWARD of microbatch 0 on stage 2 on rank 2 needs RECV_ACT"):
        check_schedule(no_recv, 3, 2)
    early = _copy(s)
    early[1].remove(Action(Op.SEND_GRAD, 0, 1))
    early[1].insert(0, Action(Op.SEND_GRAD, 0, 1))
    with pytest.raises(ScheduleError, match="SEND_GRAD of microbatch 0 on stage 1 comes before BACKWARD of microbatch 0 on stage 1"):
        check_schedule(early, 3, 2)
    stray = _copy(s)
    stray[0].append(Action(Op.RECV_ACT, 0, 0))
    with pytest.raises(ScheduleError, match="RECV_ACT of microbatch 0 on stage 0 on rank 0 has no peer"):
        check_schedule(stray, 3, 2)


def test_bad_counts_and_shapes_are_refused():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="stages >= 1"):
            gpipe(bad, 2)
        with pytest.raises(ConfigError, match="microbatches >= 1"):
            one_f_one_b(2, bad)
    with pytest.raises(ConfigError, match="stages >= 1"):
        bubble_theory(0, 4)
    with pytest.raises(ScheduleError, match="non-empty list"):
        check_schedule([], 1, 1)
    with pytest.raises(ScheduleError, match="not an Action"):
        check_schedule([[("F", 0, 0)]], 1, 1)
    with pytest.raises(ScheduleError, match="stage 1 has no action on any rank"):
        check_schedule(gpipe(1, 2), 2, 2)
    assert math.isclose(bubble_theory(1, 5), 0.0)


def test_one_ranks_actions_are_checked_on_their_own():
    stage1 = lower(one_f_one_b(3, 2))[1]
    assert check_rank(stage1, 1, 3) == 2
    with pytest.raises(ScheduleError, match="BACKWARD of microbatch 1 on stage 1 comes before FORWARD of microbatch 1 on stage 1"):
        check_rank([F(0, 1), B(0, 1), B(1, 1), F(1, 1)], 1, 3)
    with pytest.raises(ScheduleError, match="FORWARD of microbatch 1 on stage 1 is missing"):
        check_rank([F(0, 1), B(0, 1), B(1, 1)], 1, 3)
    with pytest.raises(ScheduleError, match="listed twice"):
        check_rank([F(0, 1), F(0, 1), B(0, 1)], 1, 3)
    with pytest.raises(ScheduleError, match="action 1 for stage 1 is BACKWARD of microbatch 0 on stage 2"):
        check_rank([F(0, 1), B(0, 2)], 1, 3)
    no_recv = [a for a in stage1 if a != Action(Op.RECV_GRAD, 1, 1)]
    with pytest.raises(ScheduleError, match="RECV_GRAD of microbatch 1 on stage 1 is missing"):
        check_rank(no_recv, 1, 3)
    late = [a for a in stage1 if a != Action(Op.RECV_ACT, 0, 1)] + [Action(Op.RECV_ACT, 0, 1)]
    with pytest.raises(ScheduleError, match="FORWARD of microbatch 0 on stage 1 comes before RECV_ACT of microbatch 0 on stage 1"):
        check_rank(late, 1, 3)
    with pytest.raises(ScheduleError, match="SEND_GRAD of microbatch 0 on stage 0 has no peer"):
        check_rank(lower(gpipe(2, 1))[0] + [Action(Op.SEND_GRAD, 0, 0)], 0, 2)
