"""The report's plots: one PNG per suite, bars of its figures by run, baselines as lines.

matplotlib (the ``bench`` extra) is imported only here and only when a plot is
drawn, with the Agg backend (no display needed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from pdps.core.errors import MissingExtraError


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
