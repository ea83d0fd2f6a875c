"""Pipeline schedules as data: what each rank of a pipeline computes, in which order.

A *schedule* is a list, one entry per rank, of :class:`Action` lists. An action names an
operation, a microbatch and a *stage* (the model chunk it runs on: stage ``s`` of ``S``;
with one chunk per rank the stage is the rank, interleaved schedules give a rank
several). Schedules are plain data so new ones are added by writing a function that
returns such lists; :func:`check_schedule` decides whether any list can run.

Rules, in a few lines:

* The generators (:func:`gpipe`, :func:`one_f_one_b`, :func:`interleaved_1f1b`) list
  compute actions only (``F`` and ``B``). :func:`lower` inserts the communication the
  stage runner does around them: ``RECV_ACT`` right before an ``F`` whose previous stage
  lives on another rank, ``SEND_ACT`` right after an ``F`` whose next stage does,
  ``RECV_GRAD`` right before such a ``B``, ``SEND_GRAD`` right after. Two stages on one
  rank hand over locally, without communication.
* Dependencies: ``F(mb, s)`` needs ``F(mb, s-1)``; ``B(mb, s)`` needs ``F(mb, s)`` and
  ``B(mb, s+1)``; a receive needs its matching send. A send never waits for its receive
  (the p2p link is a mailbox, design/pipeline.md §2), so a schedule deadlocks only when
  receives wait on each other in a cycle; :func:`check_schedule` finds that by running it.
* :func:`simulate` is a discrete-event simulation of a checked schedule: every rank runs
  its actions in order, an action starts once the rank is free and what it needs is done.
  ``F``/``B`` take the given times, a send occupies its sender ``p2p_s`` seconds (the
  call returns once the receiver's mailbox holds the message), a receive takes no time of
  its own beyond waiting.

The *bubble fraction* is the GPipe paper's (Huang et al. 2019, §2.3): the share of the
makespan a rank spends not computing, averaged over ranks,
``mean_r (makespan - busy_r) / makespan`` with ``busy_r`` the rank's ``F`` and ``B`` time
(sends and receives count as idle). With equal stage times and no communication cost it
is ``(P - 1) / (M + P - 1)`` for GPipe and 1F1B, :func:`bubble_theory`.
(torch.distributed.pipelining draws schedules but reports no bubble figure.)

Pure: stdlib and attrs; no clock, no torch.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence

import attrs

from pdps.core.errors import ConfigError

__all__ = [
    "Action", "Op", "Schedule", "ScheduleError", "SimResult", "Span", "bubble_theory",
    "check_rank", "check_schedule", "gpipe", "interleaved_1f1b", "lower", "lower_rank", "one_f_one_b",
    "simulate",
]


class ScheduleError(ConfigError):
    """A pipeline schedule that cannot run: an action missing or twice, a ``B`` before
    its ``F``, a receive without its send, a stage on two ranks, or an order in which the
    ranks would wait on each other forever. The message names the action and the rank."""

    code = "schedule"


class Op(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    SEND_ACT = "send_act"    # after F(mb, s): the output of stage s to stage s+1
    RECV_ACT = "recv_act"    # before F(mb, s): the input of stage s from stage s-1
    SEND_GRAD = "send_grad"  # after B(mb, s): the gradient of stage s's input to stage s-1
    RECV_GRAD = "recv_grad"  # before B(mb, s): the gradient of stage s's output from stage s+1


COMPUTE = frozenset({Op.FORWARD, Op.BACKWARD})


@attrs.frozen
class Action:
    """One thing a rank does: ``op`` on microbatch ``microbatch`` of stage ``stage``."""

    op: Op
    microbatch: int
    stage: int

    def __str__(self) -> str:
        return f"{self.op.name} of microbatch {self.microbatch} on stage {self.stage}"


Schedule = list[list[Action]]


def F(mb: int, stage: int) -> Action:
    return Action(Op.FORWARD, mb, stage)


def B(mb: int, stage: int) -> Action:
    return Action(Op.BACKWARD, mb, stage)


def _check_counts(**counts: int) -> None:
    for name, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"a pipeline schedule needs {name} >= 1, got {value!r}")


# -- the schedules ---------------------------------------------------------------------------


def gpipe(stages: int, microbatches: int) -> Schedule:
    """GPipe (all forwards, then all backwards, both in microbatch order, as
    ``torch.distributed.pipelining.ScheduleGPipe``): every rank holds all ``M``
    microbatches' activations at its peak."""
    _check_counts(stages=stages, microbatches=microbatches)
    return [[F(m, s) for m in range(microbatches)] + [B(m, s) for m in range(microbatches)] for s in range(stages)]


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """1F1B (PipeDream-Flush, Megatron's and torch's ``Schedule1F1B``): stage ``s`` runs
    ``min(M, P - s - 1)`` warm-up forwards, then alternates one forward and one backward,
    then drains the backwards. Same bubble as GPipe; stage ``s`` holds at most
    ``min(M, P - s)`` microbatches' activations."""
    _check_counts(stages=stages, microbatches=microbatches)
    out: Schedule = []
    for s in range(stages):
        warmup = min(stages - s - 1, microbatches)
        actions = [F(m, s) for m in range(warmup)]
        for m in range(microbatches - warmup):
            actions += [F(warmup + m, s), B(m, s)]
        actions += [B(m, s) for m in range(microbatches - warmup, microbatches)]
        out.append(actions)
    return out


def interleaved_1f1b(ranks: int, chunks: int, microbatches: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, "virtual pipeline"), ordered as
    ``torch.distributed.pipelining.ScheduleInterleaved1F1B``: rank ``r`` holds the
    ``chunks`` stages ``r, r + ranks, r + 2 ranks, ...`` of ``ranks * chunks``.
    Microbatches go in rounds of ``M // max(1, M // ranks)``, which must divide ``M``
    (torch's relaxation of Megatron's ``M % ranks == 0``). Its bubble shrinks about
    ``chunks`` times against 1F1B's, for more communication."""
    _check_counts(ranks=ranks, chunks=chunks, microbatches=microbatches)
    rounds = max(1, microbatches // ranks)
    per_round = microbatches // rounds
    if microbatches % rounds:
        raise ConfigError(
            f"interleaved 1F1B runs microbatches in {rounds} rounds of {per_round}: {microbatches} "
            f"microbatches are not a multiple of {rounds}; use a multiple of {ranks} microbatches"
        )
    ops = chunks * microbatches
    out: Schedule = []
    for r in range(ranks):
        warmup = min((chunks - 1) * per_round + 2 * (ranks - 1 - r), ops)
        f_next = [0] * chunks
        b_next = [0] * chunks

        def forward(op: int) -> Action:
            chunk = (op // per_round) % chunks
            f_next[chunk] += 1
            return F(f_next[chunk] - 1, chunk * ranks + r)

        def backward(op: int) -> Action:
            chunk = chunks - 1 - ((op - warmup) // per_round) % chunks
            b_next[chunk] += 1
            return B(b_next[chunk] - 1, chunk * ranks + r)

        actions = [forward(op) for op in range(warmup)]
        for op in range(warmup, ops):
            actions += [forward(op), backward(op)]
        actions += [backward(op) for op in range(ops, ops + warmup)]
        out.append(actions)
    return out


def bubble_theory(stages: int, microbatches: int) -> float:
    """GPipe's (and 1F1B's) bubble fraction with equal stage times: ``(P-1)/(M+P-1)``."""
    _check_counts(stages=stages, microbatches=microbatches)
    return (stages - 1) / (microbatches + stages - 1)


# -- communication ---------------------------------------------------------------------------


def _comms(action: Action, stages: int, local: Callable[[int], bool]) -> tuple[list[Action], list[Action]]:
    """The receives before ``action`` and the sends after it (compute actions only)."""
    mb, s = action.microbatch, action.stage
    if action.op is Op.FORWARD:
        before = [Action(Op.RECV_ACT, mb, s)] if s > 0 and not local(s - 1) else []
        after = [Action(Op.SEND_ACT, mb, s)] if s < stages - 1 and not local(s + 1) else []
    else:
        before = [Action(Op.RECV_GRAD, mb, s)] if s < stages - 1 and not local(s + 1) else []
        after = [Action(Op.SEND_GRAD, mb, s)] if s > 0 and not local(s - 1) else []
    return before, after


def lower_rank(actions: Iterable[Action], stages: int, held: Iterable[int] | None = None) -> list[Action]:
    """One rank's compute actions with the communication around them, as the stage
    runner performs it. ``held``: the stages this rank holds (default: those its actions
    name); a neighbour stage it holds is handed over locally. Actions that already hold
    communication are returned as they are."""
    actions = list(actions)
    if any(a.op not in COMPUTE for a in actions):
        return actions
    mine = set(held) if held is not None else {a.stage for a in actions}
    out: list[Action] = []
    for a in actions:
        before, after = _comms(a, stages, mine.__contains__)
        out += before + [a] + after
    return out


def lower(schedule: Sequence[Sequence[Action]]) -> Schedule:
    """Every rank's actions with their communication (:func:`lower_rank`)."""
    stages = 1 + max((a.stage for actions in schedule for a in actions), default=-1)
    held = [{a.stage for a in actions} for actions in schedule]
    return [lower_rank(actions, stages, held[r]) for r, actions in enumerate(schedule)]


# -- checking ------------------------------------------------------------------------------


def _needs(a: Action, stages: int, rank_of: Sequence[int]) -> list[Action]:
    """The actions ``a`` waits for, in a lowered schedule."""
    mb, s = a.microbatch, a.stage
    if a.op is Op.FORWARD:
        if s == 0:
            return []
        return [Action(Op.RECV_ACT, mb, s) if rank_of[s - 1] != rank_of[s] else F(mb, s - 1)]
    if a.op is Op.BACKWARD:
        if s == stages - 1:
            return [F(mb, s)]
        return [F(mb, s), Action(Op.RECV_GRAD, mb, s) if rank_of[s + 1] != rank_of[s] else B(mb, s + 1)]
    if a.op is Op.SEND_ACT:
        return [F(mb, s)]
    if a.op is Op.SEND_GRAD:
        return [B(mb, s)]
    if a.op is Op.RECV_ACT:
        return [Action(Op.SEND_ACT, mb, s - 1)]
    return [Action(Op.SEND_GRAD, mb, s + 1)]  # RECV_GRAD


def _rank_of(schedule: Sequence[Sequence[Action]], stages: int, microbatches: int) -> list[int]:
    """Validate every action's fields and return the rank holding each stage."""
    if isinstance(schedule, (str, bytes)) or not isinstance(schedule, Sequence) or not schedule:
        raise ScheduleError(f"a schedule is a non-empty list of action lists, one per rank; got {type(schedule).__name__}")
    owner: dict[int, int] = {}
    for r, actions in enumerate(schedule):
        if isinstance(actions, (str, bytes)) or not isinstance(actions, Sequence):
            raise ScheduleError(f"rank {r}'s actions are not a list of Action: {type(actions).__name__}")
        for i, a in enumerate(actions):
            if not isinstance(a, Action) or not isinstance(a.op, Op):
                raise ScheduleError(f"action {i} of rank {r} is not an Action with an Op: {a!r}")
            for field, value, bound in (("microbatch", a.microbatch, microbatches), ("stage", a.stage, stages)):
                if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < bound:
                    raise ScheduleError(f"action {i} of rank {r} ({a.op.name}) has {field} {value!r}, outside [0, {bound})")
            if owner.setdefault(a.stage, r) != r:
                raise ScheduleError(f"stage {a.stage} has actions on rank {owner[a.stage]} and on rank {r} ({a}): a stage lives on one rank")
    missing = sorted(set(range(stages)) - set(owner))
    if missing:
        raise ScheduleError(f"stage {missing[0]} has no action on any rank: every stage runs F and B of every microbatch")
    return [owner[s] for s in range(stages)]


def check_schedule(schedule: Sequence[Sequence[Action]], stages: int, microbatches: int) -> None:
    """Refuse (:class:`ScheduleError`) a schedule that cannot run ``stages`` stages over
    ``microbatches`` microbatches: an action outside those ranges or of unknown shape, a
    stage on two ranks, an ``F`` or ``B`` missing or present twice, an action before one
    of the same rank it needs (a ``B`` before its ``F``, a send before its compute), a
    receive with no matching send (or communication missing, in a schedule that lists
    it), or an order in which ranks wait on each other forever. Returns None."""
    _check_counts(stages=stages, microbatches=microbatches)
    rank_of = _rank_of(schedule, stages, microbatches)
    where: dict[Action, tuple[int, int]] = {}
    for r, actions in enumerate(schedule):
        for i, a in enumerate(actions):
            if a in where:
                first = f"position {where[a][1]}" if where[a][0] == r else f"rank {where[a][0]}"
                raise ScheduleError(f"{a} is listed twice on rank {r} (also at {first}): each action runs once")
            where[a] = (r, i)
    for s in range(stages):
        for m in range(microbatches):
            for a in (F(m, s), B(m, s)):
                if a not in where:
                    raise ScheduleError(f"{a} is missing from rank {rank_of[s]}: every microbatch runs F and B on every stage once")
    lowered = [list(a) for a in schedule] if any(a.op not in COMPUTE for a in where) else lower(schedule)
    where = {a: (r, i) for r, actions in enumerate(lowered) for i, a in enumerate(actions)}
    expected: set[Action] = set()
    for s in range(stages):
        for m in range(microbatches):
            for a in (F(m, s), B(m, s)):
                before, after = _comms(a, stages, lambda t, s=s: rank_of[t] == rank_of[s])
                expected.update(before + after)
    for a, (r, _) in where.items():
        if a.op not in COMPUTE and a not in expected:
            raise ScheduleError(f"{a} on rank {r} has no peer: its neighbour stage is on the same rank or does not exist")
    # Every expected send or receive is needed by a compute action or a receive, so
    # this also finds any the schedule leaves out.
    for a, (r, i) in where.items():
        for need in _needs(a, stages, rank_of):
            if need not in where:
                raise ScheduleError(f"{a} on rank {r} needs {need}, which rank {rank_of[need.stage]} does not list")
            nr, ni = where[need]
            if nr == r and ni > i:
                raise ScheduleError(f"{a} comes before {need} on rank {r} (positions {i} and {ni}), which it needs")
    _, pos = _run(lowered, stages, rank_of, lambda a: 0.0)
    stuck = [r for r, actions in enumerate(lowered) if pos[r] < len(actions)]
    if stuck:
        waits = "; ".join(
            f"rank {r} waits at {lowered[r][pos[r]]} for "
            + ", ".join(str(n) for n in _needs(lowered[r][pos[r]], stages, rank_of))
            for r in stuck
        )
        raise ScheduleError(f"the ranks wait on each other forever: {waits}")


def check_rank(actions: Sequence[Action], stage: int, stages: int) -> int:
    """Refuse (:class:`ScheduleError`) one rank's actions that cannot run stage ``stage``
    of ``stages`` on their own (a stage runner's check; :func:`check_schedule` sees the
    whole pipeline): an action of another stage, an ``F`` or ``B`` missing or twice, a
    ``B`` before its ``F``; lowered actions also with their sends and receives each once,
    after (sends) or before (receives) their compute. Returns the number of microbatches."""
    _check_counts(stages=stages)
    for i, a in enumerate(actions):
        if not isinstance(a, Action) or not isinstance(a.op, Op):
            raise ScheduleError(f"action {i} of stage {stage} is not an Action with an Op: {a!r}")
        if a.stage != stage:
            raise ScheduleError(f"action {i} for stage {stage} is {a}: one rank's list names one stage here")
        if not isinstance(a.microbatch, int) or a.microbatch < 0:
            raise ScheduleError(f"action {i} of stage {stage} has microbatch {a.microbatch!r}: microbatches count from 0")
    compute = [a for a in actions if a.op in COMPUTE]
    microbatches = 1 + max((a.microbatch for a in compute), default=-1)
    if microbatches < 1:
        raise ScheduleError(f"stage {stage} was given no F or B to run")
    lowered = lower_rank(actions, stages, {stage})
    where: dict[Action, int] = {}
    for i, a in enumerate(lowered):
        if where.setdefault(a, i) != i:
            raise ScheduleError(f"{a} is listed twice (positions {where[a]} and {i}): each action runs once")
    expected = lower_rank([a for m in range(microbatches) for a in (F(m, stage), B(m, stage))], stages, {stage})
    for a in sorted(expected, key=lambda a: a.op not in COMPUTE):  # a missing F or B first: its sends are gone too
        if a not in where:
            raise ScheduleError(f"{a} is missing: every microbatch runs F and B on every stage once, with its sends and receives")
    known = set(expected)
    for a in lowered:
        if a not in known:
                raise ScheduleError(f"{a} has no peer: stage {stage} of {stages} sends and receives nothing there")
    for a, i in where.items():
        for need in _needs(a, stages, range(stages)):
            if need.stage == stage and where[need] > i:
                raise ScheduleError(f"{a} comes before {need} (positions {i} and {where[need]}), which it needs")
    return microbatches


# -- simulation ------------------------------------------------------------------------------


@attrs.frozen
class Span:
    """An action of the simulated timeline, from ``start`` to ``end`` seconds."""

    rank: int
    action: Action
    start: float
    end: float


@attrs.frozen
class SimResult:
    """What :func:`simulate` found: ``makespan`` seconds for the step, per rank its
    ``busy`` seconds of ``F``/``B`` and ``peak_activations`` (the most microbatches whose
    ``F`` was done and ``B`` not yet, over the rank's stages), the ``bubble`` fraction
    (module docstring) and every action's :class:`Span`, ranks in order."""

    makespan: float
    busy: tuple[float, ...]
    bubble: float
    peak_activations: tuple[int, ...]
    timeline: tuple[Span, ...]


def _run(
    lowered: Sequence[Sequence[Action]], stages: int, rank_of: Sequence[int], duration: Callable[[Action], float]
) -> tuple[dict[Action, Span], list[int]]:
    """Run every rank in order as far as it can go: the spans of what ran and each
    rank's position (its length when it finished). The start of an action is the latest
    of its rank's clock and the ends of what it needs, whatever order ranks are visited in."""
    spans: dict[Action, Span] = {}
    pos = [0] * len(lowered)
    clock = [0.0] * len(lowered)
    progress = True
    while progress:
        progress = False
        for r, actions in enumerate(lowered):
            while pos[r] < len(actions):
                a = actions[pos[r]]
                needs = _needs(a, stages, rank_of)
                if any(n not in spans for n in needs):
                    break
                start = max([clock[r], *(spans[n].end for n in needs)])
                spans[a] = Span(r, a, start, start + duration(a))
                clock[r] = spans[a].end
                pos[r] += 1
                progress = True
    return spans, pos


def _per_stage(value: float | Sequence[float], name: str, stages: int) -> list[float]:
    values = [value] * stages if isinstance(value, (int, float)) else list(value)
    if len(values) != stages:
        raise ConfigError(f"{name} has {len(values)} times for {stages} stages: give one number or one per stage")
    for v in values:
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0:
            raise ConfigError(f"{name} holds {v!r}: times are numbers >= 0 (seconds)")
    return [float(v) for v in values]


def simulate(
    schedule: Sequence[Sequence[Action]],
    forward_s: float | Sequence[float],
    backward_s: float | Sequence[float],
    p2p_s: float = 0.0,
) -> SimResult:
    """Simulate one step of ``schedule`` (checked first with :func:`check_schedule`,
    stage and microbatch counts taken from its actions). ``forward_s``/``backward_s``:
    the seconds of one microbatch's ``F``/``B`` on a stage, one number or one per stage;
    ``p2p_s``: the seconds a send occupies its sender before the message is there."""
    stages = 1 + max((a.stage for actions in schedule for a in actions), default=-1)
    microbatches = 1 + max((a.microbatch for actions in schedule for a in actions), default=-1)
    if stages < 1 or microbatches < 1:
        raise ScheduleError("an empty schedule cannot be simulated")
    check_schedule(schedule, stages, microbatches)
    fwd, bwd = _per_stage(forward_s, "forward_s", stages), _per_stage(backward_s, "backward_s", stages)
    (p2p,) = _per_stage(p2p_s, "p2p_s", 1)
    rank_of = _rank_of(schedule, stages, microbatches)
    lowered = lower(schedule)

    def duration(a: Action) -> float:
        if a.op is Op.FORWARD:
            return fwd[a.stage]
        if a.op is Op.BACKWARD:
            return bwd[a.stage]
        return p2p if a.op in (Op.SEND_ACT, Op.SEND_GRAD) else 0.0

    spans, _ = _run(lowered, stages, rank_of, duration)
    makespan = max((s.end for s in spans.values()), default=0.0)
    busy = tuple(sum(duration(a) for a in actions if a.op in COMPUTE) for actions in lowered)
    bubble = sum((makespan - b) / makespan for b in busy) / len(busy) if makespan > 0 else 0.0
    peaks = []
    for actions in lowered:
        held = peak = 0
        for a in actions:
            held += 1 if a.op is Op.FORWARD else -1 if a.op is Op.BACKWARD else 0
            peak = max(peak, held)
        peaks.append(peak)
    timeline = tuple(spans[a] for actions in lowered for a in actions)
    return SimResult(makespan=makespan, busy=busy, bubble=bubble, peak_activations=tuple(peaks), timeline=timeline)
