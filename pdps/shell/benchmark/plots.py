"""The report's plots: one PNG per suite, bars of its figures by run, baselines as lines;
for the scale suite also its curves (:mod:`pdps.shell.benchmark.curves`), cost against size on log-log.

matplotlib (the ``bench`` extra) is imported only here and only when a plot is
drawn, with the Agg backend (no display needed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from pdps.core.errors import MissingExtraError
from pdps.shell.benchmark.curves import LINEAR, Panel


@attrs.frozen
class PlotSpec:
    """Which figures of a suite become bars (``unit``), which become lines (``lines``)."""

    title: str
    unit: str
    ylabel: str
    lines: tuple[str, ...] = ()
    log: bool = False


PLOTS: dict[str, PlotSpec] = {
    "end-to-end": PlotSpec("End to end: training samples/s by configuration", "samples/s", "samples/s",
                           lines=("torch, single process",)),
    "transport": PlotSpec("Transport: push + pull throughput by route", "GB/s", "GB/s (log scale)",
                          lines=("tcp", "torch-rpc"), log=True),
    "master": PlotSpec("Master: task transitions/s by backend", "transitions/s", "transitions/s (log scale)", log=True),
    "checkpoint": PlotSpec("Checkpoint: save and restore throughput vs raw I/O", "GB/s", "GB/s"),
    "scale": PlotSpec("Scale: each cost at the largest size / at the smallest (linear in trainers: 10x; flat in tasks: 1x)",
                      "x", "growth (log scale)", log=True),
    "elastic": PlotSpec("Elastic: each resize's wall time and longest trainer pause vs stop, checkpoint, restart",
                        "s", "seconds (log scale)", log=True),
    "replicas": PlotSpec("Replicas: SIGKILL of a pserver -> training resumed, replicas = 2 (failover) vs 1 (rollback)",
                         "s", "seconds after the kill", lines=("lease TTL",)),
    "online": PlotSpec("Online: records/s from a Redis stream / from Parquet; job time with one 10x straggler, speculation on / off",
                       "x", "ratio (target: speculation on / off <= 0.6)"),
    "sparse": PlotSpec("Sparse tables: pull + push rows/s against their baselines; pserver RSS a row against its raw bytes",
                       "x", "ratio (targets: rows/s >= 0.5x the baseline; RSS <= 1.5x the raw bytes)"),
    "pipeline": PlotSpec("Pipeline: p2p activation throughput over gRPC against raw loopback TCP", "GB/s", "GB/s"),
    "graph": PlotSpec("Graph update rules: a 10M-parameter shard's Adam step from the graph / eager torch", "x",
                      "ratio (target: graph / eager <= 1.5)"),
}


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise MissingExtraError(
            f"pdps bench draws its plots with matplotlib, which is not installed ({exc}): pip install 'pdps[bench]' "
            "(or pass --no-docs to skip the plots and docs/performance.md)"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_suite(suite: str, runs: Sequence[Sequence[Mapping[str, Any]]], path: Path) -> Path:
    """Draw ``suite``'s figures (one list of ``{"name", "value", "unit"}`` per run, empty for a
    run that failed) to ``path``."""
    spec = PLOTS[suite]
    plt = _pyplot()
    names: list[str] = []
    for figures in runs:
        for f in figures:
            if f["unit"] == spec.unit and f["name"] not in spec.lines and f["name"] not in names:
                names.append(f["name"])
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(names) + 2), 4.5), dpi=100)
    width = 0.8 / max(1, len(runs))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, figures in enumerate(runs):
        if not figures:  # that run failed
            continue
        values = {f["name"]: f["value"] for f in figures if f["unit"] == spec.unit}
        xs = [j + (i - (len(runs) - 1) / 2) * width for j in range(len(names))]
        ax.bar(xs, [values.get(n, 0.0) for n in names], width, label=f"run {i + 1}", color=colors[i % len(colors)])
        for k, line in enumerate(spec.lines):
            if line in values:
                ax.axhline(values[line], color=colors[(len(runs) + k) % len(colors)], linestyle=("--", ":", "-.")[i % 3],
                           linewidth=1.2, label=f"{line}, run {i + 1} ({values[line]:,.4g} {spec.unit})")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(spec.ylabel)
    ax.set_title(spec.title, fontsize=10)
    if spec.log:
        ax.set_yscale("log")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


def plot_curves(panels: Sequence[Panel], path: Path, *, title: str) -> Path:
    """Draw each panel on log-log axes to ``path``: markers at the measured points, and beside each
    series a dashed reference through its smallest point (slope 1 for a cost that should be linear,
    0 for one that should be flat). Zeros cannot be shown on a log axis and are left out."""
    plt = _pyplot()
    cols = min(4, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.4 * cols, 3.8 * rows), dpi=100, squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, panel in zip(axes.flat, panels):
        zeros = any(y <= 0 for s in panel.series for _, y in s.points)
        ax.set_title(panel.title + ("\n(zeros left out)" if zeros else ""), fontsize=9)
        if not any(s.positive for s in panel.series):
            ax.text(0.5, 0.5, "zero at every size measured", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        drawn: list[tuple[float, float]] = []
        for i, s in enumerate(panel.series):
            points = list(s.positive)
            if not points:
                continue
            color = colors[i % len(colors)]
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o", color=color, label=s.legend)
            (x0, y0), x1 = points[0], points[-1][0]
            ref = (x1, y0 * x1 / x0 if s.expect == LINEAR else y0)
            ax.plot([x0, ref[0]], [y0, ref[1]], linestyle="--", linewidth=1, color=color, alpha=0.6)
            drawn += [*points, ref]
        ax.plot([], [], linestyle="--", color="gray", label="linear" if panel.series[0].expect == LINEAR else "flat")
        ax.set_xscale("log")
        ax.set_yscale("log")
        sizes = sorted({x for x, _ in drawn})
        ax.set_xticks(sizes, [f"{x:,.0f}" for x in sizes])
        ax.set_xticks([], minor=True)
        low, high = min(y for _, y in drawn), max(y for _, y in drawn)
        if high < 10 * low:  # at least a decade, or the log axis zooms a flat line into a steep one
            middle = (low * high) ** 0.5
            ax.set_ylim(middle / 4, middle * 4)
        ax.set_xlabel(panel.xlabel, fontsize=8)
        ax.set_ylabel(panel.ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(which="both", alpha=0.25)
        ax.legend(fontsize=7)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    plt.close(fig)
    return path
