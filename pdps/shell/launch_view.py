"""What ``pdps launch`` shows on stderr while a job runs.

On a terminal, a live table (:class:`LiveView`, drawn with rich): the pass (a
streaming job's window), a bar of the pass's tasks, samples/s over the trainers, and a
row per role with its state, restarts, steps, samples/s and metrics address; the
roles' log lines scroll above it.
Anywhere else (a pipe, a file, a CI log), plain lines (:class:`PlainView`): the log
lines as they come and ``pass 2/5  tasks 31/40`` (a streaming job: ``window 2/4  tasks
31/40``, the tasks cut so far) whenever that changes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import IO, Any

import attrs

from pdps.core.job import JobConfig


@attrs.frozen
class RoleRow:
    """One role's line of the live table."""

    name: str
    state: str  # running, finished, restarting, exited ...
    restarts: int = 0
    steps: int | None = None  # trainers, from their metrics
    samples_per_second: float | None = None
    metrics: str | None = None  # where its metrics are served


@attrs.frozen
class Snapshot:
    """The job as the launcher last saw it."""

    pass_no: int  # 0 is the first
    done: int  # tasks of the pass done or failed
    tasks: int | None  # tasks of a pass (None: not known yet)
    extra: str = ""  # pdps.simulate's trainers' metrics, in process
    roles: Sequence[RoleRow] = ()
    samples_per_second: float | None = None  # over the trainers
    windows_closed: int = 0  # a streaming job's


def position(config: JobConfig, s: Snapshot) -> str:
    """``pass 2/5``, or for a streaming job the window being trained: ``window 2/4``
    (``window 7`` when the job has no end)."""
    if config.window_records or config.window_seconds:  # a stream's job has windows, not passes
        no = s.windows_closed + 1 if not config.windows else min(s.windows_closed + 1, config.windows)
        return f"window {no}" + (f"/{config.windows}" if config.windows else "")
    return f"pass {min(s.pass_no + 1, config.passes)}/{config.passes}"


def open_view(config: JobConfig, err: IO[str]) -> PlainView | LiveView:
    """A live table when ``err`` is a terminal, else plain lines."""
    isatty = getattr(err, "isatty", None)
    return LiveView(config, err) if isatty is not None and isatty() else PlainView(config, err)


class PlainView:
    """Lines: the logs as they come, a progress line when it changes."""

    live = False  # the launcher reads the trainers' metrics only for a live view

    def __init__(self, config: JobConfig, err: IO[str]) -> None:
        self._config = config
        self._err = err
        self._last = ""

    def log(self, line: str) -> None:
        self._err.write(line + "\n")
        self._err.flush()

    def show(self, s: Snapshot) -> None:
        line = f"{position(self._config, s)}  tasks {s.done}/{'?' if s.tasks is None else s.tasks}"
        if s.extra:
            line += f"  {s.extra}"
        if line != self._last:
            self.log(line)
            self._last = line

    def close(self) -> None:
        pass


class LiveView:
    """A table redrawn in place at the bottom of the terminal; log lines scroll above it.

    While it is shown, the launcher's own log records (the root logger's handlers that
    write to the same stream) are printed above the table too, not through it.
    """

    live = True

    def __init__(self, config: JobConfig, err: IO[str]) -> None:
        from rich.console import Console
        from rich.file_proxy import FileProxy
        from rich.live import Live

        self._config = config
        self._console = Console(file=err, highlight=False)
        self._snapshot = Snapshot(0, 0, None)
        self._live = Live(self._render(), console=self._console, refresh_per_second=4, redirect_stdout=False, redirect_stderr=False, transient=False)
        self._live.start()
        proxy = FileProxy(self._console, err)
        self._handlers: list[tuple[logging.StreamHandler, Any]] = []
        for h in logging.getLogger().handlers:
            if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) is err:
                self._handlers.append((h, h.setStream(proxy)))

    def log(self, line: str) -> None:
        from rich.text import Text

        self._console.print(Text(line), soft_wrap=True)

    def show(self, s: Snapshot) -> None:
        self._snapshot = s
        self._live.update(self._render())

    def close(self) -> None:
        for h, stream in self._handlers:
            h.setStream(stream)
        self._live.update(self._render())
        self._live.stop()

    def _render(self) -> Any:
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        s = self._snapshot
        head = f"job {self._config.name}  {position(self._config, s)}  tasks {s.done}/{'?' if s.tasks is None else s.tasks}"
        if s.samples_per_second is not None:
            head += f"  {s.samples_per_second:,.0f} samples/s"
        if s.extra:
            head += f"  {s.extra}"
        parts: list[Any] = [Text(head, style="bold"), ProgressBar(total=float(s.tasks or 1), completed=float(s.done if s.tasks else 0), width=60)]
        if s.roles:
            table = Table(box=None, pad_edge=False)
            for column, justify in (("role", "left"), ("state", "left"), ("restarts", "right"), ("steps", "right"), ("samples/s", "right"), ("metrics", "left")):
                table.add_column(column, justify=justify)  # type: ignore[arg-type]
            for r in s.roles:
                rate = "" if r.samples_per_second is None else f"{r.samples_per_second:,.0f}"
                table.add_row(r.name, r.state, str(r.restarts), "" if r.steps is None else str(r.steps), rate, r.metrics or "")
            parts.append(table)
        return Group(*parts)


def rates(before: Mapping[str, tuple[float, float]], now: float, samples: Mapping[str, float]) -> dict[str, float]:
    """Samples/s per trainer since its previous reading in ``before`` (time, samples)."""
    out = {}
    for name, total in samples.items():
        if name in before:
            then, previous = before[name]
            if now > then:
                out[name] = max(0.0, total - previous) / (now - then)
    return out
