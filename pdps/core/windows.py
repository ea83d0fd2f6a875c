"""Windows of a streaming job: what a pass is to a finite dataset.

Rules, in a few lines:

* Tasks of a streaming job get ids in arrival order; a window is a contiguous range
  of them, ``[first, end)``. It opens with its first task (no empty windows), takes
  the tasks added after it, and is *sealed* once it holds ``records`` records or has
  been open ``seconds`` seconds (either limit 0: not by that measure). The master
  caps the tasks it cuts by :meth:`Windows.room`, so a window by records holds exactly
  that many where the source can split its data.
* A sealed window is *closed* once every one of its tasks is done or failed; windows
  close in order (a window whose tasks finished waits for the one before it), so
  post-window work (an export, a checkpoint) always covers every earlier window.
* A rollback to a checkpoint re-opens what the checkpoint does not hold: a window
  closed after it is sealed again (:meth:`Windows.rolled_back`).

Everything here is pure: ``now`` is the caller's wall clock (seconds since the epoch,
since ``opened_at`` is persisted and read by other processes), and the tasks' states
come from the caller.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs

from pdps.core.tasks import State, TaskSpec


@attrs.frozen
class Window:
    """One window as the job stores it (``windows/<no>``)."""

    no: int
    first: int  # its first task id
    end: int  # one past its last task id so far
    records: int
    opened_at: float
    sealed_at: float | None = None
    closed_at: float | None = None
    done: int = 0  # tasks done, once closed
    failed: tuple[int, ...] = ()  # tasks failed, once closed

    @property
    def state(self) -> str:
        return "closed" if self.closed_at is not None else "sealed" if self.sealed_at is not None else "open"

    @property
    def tasks(self) -> range:
        return range(self.first, self.end)

    def to_json(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d["failed"] = list(self.failed)
        d["state"] = self.state
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Window:
        opt = lambda k: None if d.get(k) is None else float(d[k])  # noqa: E731
        w = cls(
            no=int(d["no"]),
            first=int(d["first"]),
            end=int(d["end"]),
            records=int(d["records"]),
            opened_at=float(d["opened_at"]),
            sealed_at=opt("sealed_at"),
            closed_at=opt("closed_at"),
            done=int(d.get("done", 0)),
            failed=tuple(int(t) for t in d.get("failed", ())),
        )
        if w.no < 0 or not 0 <= w.first <= w.end or w.records < 0:
            raise ValueError(f"not a window: {dict(d)!r}")
        return w

    def encode(self) -> bytes:
        return json.dumps(self.to_json()).encode()


@attrs.frozen
class WindowChanged:
    """Persist this window (``windows/<no>``)."""

    window: Window


@attrs.frozen
class WindowClosed:
    """Every task of the window finished: persist it, then run the post-window work."""

    window: Window


@attrs.define
class Windows:
    """The windows of one streaming job that are not closed yet, plus the count of
    closed ones. Build it with :meth:`restore` (a new job: no windows)."""

    records: int  # seal after this many records; 0: not by count
    seconds: float  # seal after this many seconds open; 0: not by time
    _live: list[Window] = attrs.field(factory=list)  # not closed, oldest first; the open one last
    _closed: int = 0  # windows closed so far: 0.._closed-1

    @classmethod
    def restore(cls, windows: Iterable[Window], *, records: int, seconds: float) -> Windows:
        """From the stored windows (closed ones count, the others are kept)."""
        ws = sorted(windows, key=lambda w: w.no)
        for i, w in enumerate(ws):
            if w.no != i:
                raise ValueError(f"the stored windows are not 0..{len(ws) - 1}: window {i} is missing")
        closed = 0
        while closed < len(ws) and ws[closed].closed_at is not None:
            closed += 1
        return cls(records, seconds, ws[closed:], closed)

    # --- reading ----------------------------------------------------------------------

    @property
    def closed(self) -> int:
        """The number of closed windows (they are 0..closed-1)."""
        return self._closed

    @property
    def sealed(self) -> int:
        """The number of sealed or closed windows."""
        return self._closed + sum(w.sealed_at is not None for w in self._live)

    def live(self) -> list[Window]:
        return list(self._live)

    def open_window(self) -> Window | None:
        return self._live[-1] if self._live and self._live[-1].sealed_at is None else None

    def room(self) -> int | None:
        """Records the open window (or the next one) still takes; None: no limit by count."""
        if not self.records:
            return None
        w = self.open_window()
        return self.records - (w.records if w is not None else 0)

    def first_live_task(self, next_id: int) -> int:
        """The first task id of a window not closed (``next_id`` when there is none)."""
        return self._live[0].first if self._live else next_id

    # --- events -----------------------------------------------------------------------

    def added(self, specs: Sequence[TaskSpec], now: float) -> list[WindowChanged]:
        """Tasks appended to the queue: into the open window, opening one if need be;
        seal it once it holds its records."""
        changed: dict[int, Window] = {}
        for spec in specs:
            w = self.open_window()
            if w is None:
                no = self._closed + len(self._live)
                w = Window(no=no, first=spec.id, end=spec.id, records=0, opened_at=now)
                self._live.append(w)
            if spec.id != w.end:
                raise ValueError(f"task {spec.id} does not follow window {w.no}'s last task {w.end - 1}")
            w = attrs.evolve(w, end=spec.id + 1, records=w.records + spec.records)
            if self.records and w.records >= self.records:
                w = attrs.evolve(w, sealed_at=now)
            self._live[-1] = changed[w.no] = w
        return [WindowChanged(w) for w in changed.values()]

    def due(self, now: float) -> bool:
        """The open window has been open its ``seconds``."""
        w = self.open_window()
        return w is not None and bool(self.seconds) and now - w.opened_at >= self.seconds

    def seal(self, now: float) -> list[WindowChanged]:
        """Seal the open window, if there is one (its time is up, or the stream ended)."""
        w = self.open_window()
        if w is None:
            return []
        self._live[-1] = w = attrs.evolve(w, sealed_at=now)
        return [WindowChanged(w)]

    def settle(self, state_of: Callable[[int], State | None], now: float) -> list[WindowClosed]:
        """Close the oldest sealed windows whose every task is done or failed, in order.
        ``state_of(task)``: the task's state, None for one finished and forgotten (done)."""
        out = []
        while self._live and self._live[0].sealed_at is not None:
            w = self._live[0]
            failed = []
            for tid in w.tasks:
                st = state_of(tid)
                if st is State.FAILED:
                    failed.append(tid)
                elif st is not None and st is not State.DONE:
                    return out
            w = attrs.evolve(w, closed_at=now, done=len(w.tasks) - len(failed), failed=tuple(failed))
            self._live.pop(0)
            self._closed += 1
            out.append(WindowClosed(w))
        return out

    def rolled_back(self, closed_then: int, stored: Mapping[int, Window]) -> list[WindowChanged]:
        """A rollback to a checkpoint taken when ``closed_then`` windows were closed:
        the windows closed since are sealed again (``stored``: them, by number)."""
        if closed_then >= self._closed:
            return []
        reopened = [attrs.evolve(stored[no], closed_at=None, done=0, failed=()) for no in range(closed_then, self._closed)]
        self._live[:0] = reopened
        self._closed = closed_then
        return [WindowChanged(w) for w in reopened]
