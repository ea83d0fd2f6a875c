"""Faults a simulated job suffers while it trains: ``pdps.simulate(..., faults=Faults(...))``.

:class:`Faults` says what to kill; :meth:`Faults.plan` draws from its seed alone who
dies and at which moment of the pass (a share of the pass's tasks done), so the same
seed and job shape give the same plan. :class:`Injector` keeps the job's master and
pservers and strikes each planned :class:`Fault` from simulate's driver loop once the
serving master's queue reaches its moment, the way the process would die:

* a trainer dies at its next step, as ``kill`` has it: it reports nothing, its lease
  runs out and the master re-queues its task;
* a pserver crashes (calls fail at once, its claim lives until its lease runs out) and
  a replacement starts at its index: a restart, which rolls the job back to its latest
  checkpoint (async with ``restore="lost"``: reloads only its own slots);
* the master stops serving and leaves its lease (its lock, its address) to run out, as
  a process killed between two calls would; a standby master then takes the lock and
  restores the queue from the store.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from pdps.core.errors import ConfigError, StoreUnavailable
from pdps.core.job import JobConfig, require_whole_number, shown
from pdps.core.tasks import Counts
from pdps.ports.coordination import CoordinationStore

if TYPE_CHECKING:
    from pdps.roles.master import Master
    from pdps.roles.pserver import Pserver
    from pdps.roles.trainer import TrainerContext

log = logging.getLogger(__name__)

TRAINER, PSERVER, MASTER = "trainer", "pserver", "master"
#: Seconds between the driver's looks at the queue while faults are still to strike, and
#: the most of its time a look may hold the master's lock (counting is O(tasks): a 1M-task
#: queue is looked at less often).
FAULT_POLL, LOOK_SHARE = 0.02, 0.05


def _whole_number(_inst: object, attr: attrs.Attribute, value: Any) -> None:
    require_whole_number(f"faults.{attr.name}", value, 0)


def _share(_inst: object, attr: attrs.Attribute, value: Any) -> None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and 0 <= value < 1):  # NaN fails the comparison
        raise ConfigError(f"faults.{attr.name} must be a share of the trainers, 0 <= share < 1 (0.01 kills 1%), got {shown(value)}")


def _flag(_inst: object, attr: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"faults.{attr.name} must be True or False, got {shown(value)}")


def _window(_inst: object, attr: attrs.Attribute, value: Any) -> None:
    numbers = isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    if not (numbers and 0 <= value[0] <= value[1] < 1):
        raise ConfigError(
            f"faults.{attr.name} must be a pair (earliest, latest) of shares of the pass's tasks done, "
            f"0 <= earliest <= latest < 1, got {shown(value)}"
        )


@attrs.frozen
class Fault:
    """One planned fault: trainer or pserver ``index`` (``None`` for the master) dies
    once the share ``at`` of its pass's tasks is done."""

    role: str  # TRAINER, PSERVER or MASTER
    index: int | None
    at: float

    @property
    def target(self) -> str:
        """``trainer-3``, ``pserver-1`` or ``master``: whom it kills."""
        return self.role if self.index is None else f"{self.role}-{self.index}"


@attrs.frozen
class Injected:
    """A fault as it struck: in which pass, with how many of that pass's tasks done, and
    how many seconds after the trainers started."""

    fault: Fault
    pass_no: int
    done: int
    seconds: float


@attrs.frozen(kw_only=True)
class Faults:
    """What to kill in a simulated job, at moments of pass ``pass_no`` drawn from ``seed``.

    ``trainers``: the share of the trainers to kill (0.01: 1%; at least one when above
    0, and never all of them); ``pservers``: how many pservers to kill (each is
    replaced); ``master``: kill the master (a standby takes over). Each fault gets its
    own moment, drawn uniformly from ``window``: shares of the pass's tasks done.
    """

    seed: int = attrs.field(default=0, validator=_whole_number)
    trainers: float = attrs.field(default=0.0, validator=_share)
    pservers: int = attrs.field(default=0, validator=_whole_number)
    master: bool = attrs.field(default=False, validator=_flag)
    pass_no: int = attrs.field(default=0, validator=_whole_number)
    window: tuple[float, float] = attrs.field(default=(0.2, 0.8), validator=_window)

    def plan(self, config: JobConfig) -> tuple[Fault, ...]:
        """The faults for ``config``'s job, earliest first: the same for the same seed,
        fields and job shape. ConfigError for faults the job cannot survive or does not have."""
        killed = max(1, round(self.trainers * config.trainers)) if self.trainers else 0
        if killed >= config.trainers:
            raise ConfigError(
                f"faults.trainers={self.trainers!r} kills {killed} of the job's {config.trainers} trainers: "
                "at least one must live to finish the pass"
            )
        if self.pservers > config.pservers:
            raise ConfigError(f"faults.pservers={self.pservers} kills more pservers than the job's {config.pservers}")
        if self.pass_no >= config.passes:
            raise ConfigError(f"faults.pass_no={self.pass_no} is no pass of the job: it runs passes 0..{config.passes - 1}")
        rng = random.Random(self.seed)
        lo, hi = self.window
        faults = [Fault(TRAINER, i, rng.uniform(lo, hi)) for i in sorted(rng.sample(range(config.trainers), killed))]
        faults += [Fault(PSERVER, i, rng.uniform(lo, hi)) for i in sorted(rng.sample(range(config.pservers), self.pservers))]
        if self.master:
            faults.append(Fault(MASTER, None, rng.uniform(lo, hi)))
        return tuple(sorted(faults, key=lambda f: f.at))


class MortalStore:
    """One role's way to the store, which dies with it: after :meth:`die` its leases are
    neither kept alive nor revoked, so they run out as a killed process's do."""

    def __init__(self, inner: CoordinationStore) -> None:
        self._inner = inner
        self._dead = False

    def die(self) -> None:
        self._dead = True

    def keep_alive(self, lease: int) -> None:
        self._alive()
        self._inner.keep_alive(lease)

    def revoke_lease(self, lease: int) -> None:
        self._alive()
        self._inner.revoke_lease(lease)

    def _alive(self) -> None:
        if self._dead:
            raise StoreUnavailable(f"{self._inner.url} is out of reach of a killed role")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class Injector:
    """The job's master and pservers, with the faults planned for them (see the module).

    ``master`` is the master in charge (a standby once the first one is killed);
    ``pservers`` the current pservers (a replacement in place of a killed one).
    """

    def __init__(
        self,
        plan: Sequence[Fault],
        pass_no: int,
        store: CoordinationStore,
        contexts: Sequence[TrainerContext],
        new_master: Callable[[CoordinationStore], Master],
        new_pserver: Callable[[int | None], Pserver],
        pservers: int,
    ) -> None:
        self._plan = list(plan)
        self._pass_no = pass_no
        self._store = store
        self._contexts = contexts
        self._new_master = new_master
        self._new_pserver = new_pserver
        # only a master that is to be killed needs a way to the store that can die
        self._mortal = MortalStore(store) if any(f.role == MASTER for f in plan) else None
        self.master = new_master(self._mortal or store)
        self.pservers = [new_pserver(None) for _ in range(pservers)]
        self.struck: list[Injected] = []
        self.error: BaseException | None = None  # a replacement that could not start
        self.poll = FAULT_POLL  # seconds between the looks at the queue (time_the_looks)
        self._threads: list[threading.Thread] = []

    @property
    def pending(self) -> bool:
        """Whether faults are still to strike."""
        return bool(self._plan)

    def counts(self) -> Counts | None:
        """The serving master's queue counts; None while a standby takes over."""
        return self.master.counts() if self.master.leading.is_set() else None

    def time_the_looks(self) -> None:
        """Set :attr:`poll` from one count of the queue, taken before the trainers start:
        timed while they run, it would include waiting for the master's lock."""
        began = time.perf_counter()
        self.master.counts()
        self.poll = max(FAULT_POLL, (time.perf_counter() - began) / LOOK_SHARE)

    def strike(self, counts: Counts, seconds: float) -> None:
        """Strike every fault whose moment ``counts`` (the serving master's) has reached."""
        total = counts.todo + counts.pending + counts.done + counts.failed
        while total and self._plan and (counts.pass_no > self._pass_no or (counts.pass_no == self._pass_no and counts.done >= self._plan[0].at * total)):
            fault = self._plan.pop(0)
            log.warning("simulate kills %s (%d of %d tasks of pass %d done)", fault.target, counts.done, total, counts.pass_no)
            {TRAINER: self._kill_trainer, PSERVER: self._kill_pserver, MASTER: self._kill_master}[fault.role](fault.index)
            self.struck.append(Injected(fault, counts.pass_no, counts.done, seconds))

    def _kill_trainer(self, index: int) -> None:
        ctx = self._contexts[index]
        ctx.kill_after(ctx.steps)  # its next step raises Killed, as kill= has it

    def _kill_pserver(self, index: int) -> None:
        old = next(ps for ps in self.pservers if ps.index == index)
        old.crash()
        replacement = self._new_pserver(index)
        self.pservers[self.pservers.index(old)] = replacement
        self._in_background(replacement.start, f"pserver {index}'s replacement")

    def add_pserver(self) -> None:
        """Start one more pserver (a resize wants it): it claims the first free index."""
        ps = self._new_pserver(None)
        self.pservers.append(ps)
        self._in_background(ps.start, "a new pserver")

    def _kill_master(self, _index: None) -> None:
        assert self._mortal is not None
        self._mortal.die()
        self.master.stop()
        standby = self.master = self._new_master(self._store)
        self._in_background(lambda: standby.start(standby=True), "the standby master")

    def _in_background(self, start: Callable[[], None], what: str) -> None:
        """Start a role without holding up the driver: it waits for its predecessor's
        lease to run out (a claim, the master's lock)."""

        def run() -> None:
            try:
                start()
            except BaseException as exc:  # the driver raises it
                log.error("%s could not start: %r", what, exc)
                self.error = self.error or exc

        t = threading.Thread(target=run, name=f"pdps-sim-{what}", daemon=True)
        t.start()
        self._threads.append(t)

    def stop(self, timeout: float) -> None:
        """Stop the pservers and the master, and wait up to ``timeout`` seconds for a
        replacement still starting."""
        for ps in self.pservers:
            ps.stop()
        self.master.stop()
        for t in self._threads:
            t.join(timeout)
