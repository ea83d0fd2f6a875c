"""The scale suite's curves: each control-plane cost per sync step and per task against the
size it should follow, and whether its slope on log-log is flat, linear or worse.

Pure (no matplotlib, no files): it reads bench/scale.py's report by its row keys (``steps``
rows by ``trainers`` and ``pservers``, ``tasks`` rows by ``tasks``); the sizes, and any rows
or keys it does not know, are whatever the report holds. :mod:`pdps.shell.benchmark.plots`
draws the panels, :mod:`pdps.shell.benchmark.report` prints the verdicts under them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

#: a cost per step may grow at most this fast in its size (slope on log-log) to count as linear
SUPERLINEAR_ABOVE = 1.15
#: a per-task cost may grow at most this fast in the tasks to count as flat
FLAT_UP_TO = 0.1
#: below this a cost per step grows slower than its size
LINEAR_FROM = 0.85

STEP_FIGURES = (
    ("store_ops_per_step", "store ops per step"),
    ("writes_per_step", "keys written per step"),
    ("bytes_per_step", "bytes per step (written + read)"),
    ("messages_per_step", "messages per step"),
    ("conflicts_per_step", "conflicts per step"),
)
TASK_FIGURES = (
    ("store_ops_per_task", "store ops per task"),
    ("writes_per_task", "keys written per task"),
    ("bytes_written_per_task", "bytes written per task"),
)
MEMORY_FIGURE = ("master_bytes_per_task", "master memory per task")

LINEAR = "linear"
FLAT = "flat"


@attrs.frozen
class Series:
    """One cost measured at several sizes; ``expect`` is how it should grow (LINEAR or FLAT)."""

    label: str
    legend: str  # its name within its panel
    figure: str
    variable: str
    expect: str
    points: tuple[tuple[float, float], ...]  # (size, cost), by size, zeros included

    @property
    def positive(self) -> tuple[tuple[float, float], ...]:
        """The points a log-log axis can show."""
        return tuple(p for p in self.points if p[0] > 0 and p[1] > 0)


@attrs.frozen
class Panel:
    title: str
    xlabel: str
    ylabel: str
    series: tuple[Series, ...]


@attrs.frozen
class Verdict:
    """What a series' slope says: ``ok`` is None when there are too few positive points to tell."""

    series: Series
    slope: float | None
    tail: float | None  # between the two largest sizes, with three or more
    shape: str
    ok: bool | None

    @property
    def line(self) -> str:
        s = self.series
        if self.slope is None:
            return f"{s.label}: {self.shape}"
        measured = f"slope {_slope_text(self.slope)}"
        if self.tail is not None:
            measured += f" overall, {_slope_text(self.tail)} between the two largest sizes"
        zeros = [x for x, y in s.points if y <= 0]
        if zeros:
            measured += f"; zero at {s.variable} {', '.join(f'{x:,.0f}' for x in zeros)} (not plotted)"
        return f"{s.label}: {measured} ({self.shape})"


def _slope_text(value: float) -> str:
    return f"{round(value, 2) + 0.0:.2f}"  # + 0.0: no "-0.00" for a flat cost that dips by a byte


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _series(
    rows: Sequence[Mapping[str, Any]], size_key: str, figure: tuple[str, str], expect: str, fixed: str = "", legend: str = ""
) -> Series | None:
    """``figure``'s (key, name) against ``size_key`` over ``rows``; ``fixed`` names what the rows
    share, ``legend`` the series in its panel (default: the figure's name)."""
    key, name = figure
    points = sorted(
        (x, y) for x, y in ((_number(r.get(size_key)), _number(r.get(key))) for r in rows) if x is not None and y is not None
    )
    if not points:
        return None
    label = f"{name} vs {size_key}" + (f", {fixed}" if fixed else "")
    return Series(label=label, legend=legend or name, figure=name, variable=size_key, expect=expect, points=tuple(points))


def _rows(report: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    rows = report.get(key)
    return [r for r in rows if isinstance(r, Mapping)] if isinstance(rows, list) else []


def scale_panels(report: Mapping[str, Any]) -> list[Panel]:
    """The panels of the scale report: each cost per step against the trainers (a line per
    pserver count), against the pservers at the largest trainer count measured with two or more,
    and each per-task cost against the tasks. Panels with nothing measured are left out."""
    steps, tasks = _rows(report, "steps"), _rows(report, "tasks")
    panels: list[Panel] = []
    pservers = sorted({p for p in (_number(r.get("pservers")) for r in steps) if p is not None})
    for figure in STEP_FIGURES:
        series = [
            _series([r for r in steps if _number(r.get("pservers")) == p], "trainers", figure, LINEAR, f"{p:,.0f} pservers",
                    legend=f"{p:,.0f} pservers")
            for p in pservers
        ]
        panels.append(Panel(f"{figure[1]} vs trainers", "trainers", figure[1], tuple(s for s in series if s)))
    by_trainers: dict[float, list[Mapping[str, Any]]] = {}
    for r in steps:
        t = _number(r.get("trainers"))
        if t is not None:
            by_trainers.setdefault(t, []).append(r)
    wide = [t for t, rows in by_trainers.items() if len({_number(r.get("pservers")) for r in rows} - {None}) >= 2]
    if wide:
        t = max(wide)
        series = [_series(by_trainers[t], "pservers", figure, LINEAR, f"{t:,.0f} trainers") for figure in STEP_FIGURES]
        panels.append(Panel(f"cost per step vs pservers, {t:,.0f} trainers", "pservers", "per step", tuple(s for s in series if s)))
    series = [_series(tasks, "tasks", figure, FLAT) for figure in TASK_FIGURES]
    panels.append(Panel("master's store costs per task vs tasks", "tasks", "per task", tuple(s for s in series if s)))
    memory = _series(tasks, "tasks", MEMORY_FIGURE, FLAT)
    panels.append(Panel("master memory per task vs tasks", "tasks", "B per task", (memory,) if memory else ()))
    return [p for p in panels if p.series]


def slope(points: Sequence[tuple[float, float]]) -> float | None:
    """The least-squares slope of log(cost) on log(size); None with fewer than two sizes."""
    logs = [(math.log(x), math.log(y)) for x, y in points if x > 0 and y > 0]
    if len({lx for lx, _ in logs}) < 2:
        return None
    mx = sum(lx for lx, _ in logs) / len(logs)
    my = sum(ly for _, ly in logs) / len(logs)
    return sum((lx - mx) * (ly - my) for lx, ly in logs) / sum((lx - mx) ** 2 for lx, _ in logs)


def shape(value: float, expect: str) -> tuple[str, bool]:
    """The word for a slope and whether a cost expected to grow as ``expect`` may have it."""
    if expect == FLAT:
        if value > FLAT_UP_TO:
            return "not flat", False
        return ("flat" if value >= -FLAT_UP_TO else "falling"), True
    if value > SUPERLINEAR_ABOVE:
        return "superlinear", False
    if value >= LINEAR_FROM:
        return "linear", True
    if value > FLAT_UP_TO:
        return "sublinear", True
    return ("flat" if value >= -FLAT_UP_TO else "falling"), True


def judge(series: Series) -> Verdict:
    """The series' slope over every positive point and, with three or more, between the two
    largest: a cost that turns superlinear only at the largest sizes is named by the latter."""
    points = series.positive
    overall = slope(points)
    if overall is None:
        if len({x for x, _ in series.points}) < 2:
            why = "measured at one size only: no slope"
        elif not points:
            why = "zero at every size measured (not plotted)"
        else:
            why = f"positive at {len(points)} of {len(series.points)} sizes only: no slope"
        return Verdict(series, None, None, why, None)
    tail = slope(points[-2:]) if len(points) >= 3 else None
    word, ok = shape(max(overall, tail) if tail is not None else overall, series.expect)
    return Verdict(series, overall, tail, word, ok)


def verdicts(panels: Sequence[Panel]) -> list[Verdict]:
    return [judge(s) for p in panels for s in p.series]
