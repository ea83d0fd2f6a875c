"""What ``pdps bench`` writes: the results JSON, ``docs/performance.md``, the ``--check`` lines.

All three are made from one results dict (:func:`assemble`), whose verdicts come from
:func:`pdps.shell.benchmark.targets.evaluate`. The markdown is a pure function of the
results and the hand-written notes of ``bench/notes.toml`` (target id -> markdown,
shown under that target when it is missed).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pdps.shell.benchmark import targets as tg
from pdps.shell.benchmark.curves import FLAT_UP_TO, SUPERLINEAR_ABOVE, Panel, scale_panels, verdicts
from pdps.shell.benchmark.suites import SUITE_SPECS, suite_config

SCHEMA = 1
DOC = Path("docs") / "performance.md"
PLOT_DIR = Path("docs") / "performance"
CURVES = "scale-curves"  # the scale suite's second plot: its costs against the sizes
BREAKDOWN_ORDER = ("compute", "serialize", "network", "update", "barrier")


def load_notes(path: Path) -> dict[str, str]:
    """``bench/notes.toml``: target id -> markdown (an absent file: no notes)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - the core dependency tomli stands in before 3.11
        import tomli as tomllib
    if not path.is_file():
        return {}
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise tg.BenchError(f"{path} is not valid TOML: {exc}") from exc
    known = {t.id for t in tg.TARGETS} | {tg.stability_id(t) for t in tg.TARGETS if t.is_ratio}
    bad = [k for k, v in data.items() if not isinstance(v, str)]
    unknown = sorted(set(data) - known)
    if bad or unknown:
        raise tg.BenchError(
            f"{path}: every key must be a target id with a markdown string as value; "
            f"not strings: {bad}, unknown ids: {unknown} (known: {sorted(known)})"
        )
    return dict(data)


def assemble(
    *,
    command: str,
    machine: Mapping[str, Any],
    quick: bool,
    runs: int,
    suite_runs: Mapping[str, Sequence[Mapping[str, Any]]],
    commands: Mapping[str, str],
    started: str,
    finished: str,
) -> dict[str, Any]:
    """The results dict: the run's settings, each suite's runs and figures, the verdicts.

    ``suite_runs[suite]`` holds what :func:`pdps.shell.benchmark.suites.run_suite` returned
    for each run, in order.
    """
    suites: dict[str, Any] = {}
    reports: dict[str, list[Mapping[str, Any] | None]] = {}
    for name, results in suite_runs.items():
        spec = SUITE_SPECS[name]
        entries = []
        config: dict[str, Any] | None = None
        for i, r in enumerate(results, 1):
            entry: dict[str, Any] = {"run": i, "ok": bool(r.get("ok")), "seconds": r.get("seconds")}
            report = r.get("report")
            if report is not None:
                config = config or suite_config(spec, dict(report))
                try:
                    entry["figures"] = [{"name": n, "value": v, "unit": u} for n, v, u in tg.suite_figures(name, report)]
                except tg.SuiteOutputError as exc:
                    entry["figures"] = []
                    entry["figures_error"] = str(exc)
                if name == "end-to-end":
                    try:
                        entry["breakdown_ms"] = dict(tg.e2e_breakdown(report))
                    except tg.SuiteOutputError as exc:
                        entry["figures_error"] = str(exc)
                entry["report"] = report
            if not entry["ok"]:
                entry["error"] = r.get("error", "no report")
                entry["returncode"] = r.get("returncode")
                entry["stderr_tail"] = r.get("stderr_tail", "")
            entries.append(entry)
            reports.setdefault(name, []).append(report)
        suites[name] = {
            "program": f"bench/{spec.program}",
            "about": spec.about,
            "command": commands.get(name, ""),
            "args": spec.args(quick),
            "config": config or {},
            "runs": entries,
        }
    return {
        "schema": SCHEMA,
        "generated_by": "pdps bench",
        "command": command,
        "started": started,
        "finished": finished,
        "quick": quick,
        "runs": runs,
        "machine": dict(machine),
        "suites": suites,
        "targets": tg.evaluate(reports),
        "stability_tolerance": tg.STABILITY,
    }


def failed_runs(results: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    return [(name, r) for name, s in results["suites"].items() for r in s["runs"] if not r["ok"]]


def exit_code(results: Mapping[str, Any], *, check: bool) -> int:
    """1 when a suite failed to run, or with ``check`` when a target is not met; else 0."""
    if failed_runs(results):
        return 1
    if check and tg.failing(results["targets"]):
        return 1
    return 0


def write_json(results: Mapping[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)
    return path


def check_lines(results: Mapping[str, Any]) -> list[str]:
    """One line per target (MET / MISSED / ...) with its figures and threshold, then each failed run."""
    lines = []
    width = max((len(v["id"]) for v in results["targets"]), default=0)
    for v in results["targets"]:
        figures = ", ".join(tg.format_value(x, v["unit"]) for x in v["values"])
        line = f"{v['status']:<11} {v['id']:<{width}}  {figures}  (threshold {tg.format_threshold(v)})"
        if v["errors"]:
            line += f": {v['errors'][0]}"
        elif v.get("not_run"):
            line += f": {v['not_run'][0]}"
        elif v["status"] == tg.NOT_CHECKED:
            line += ": needs 2 or more runs (--runs)"
        lines.append(line)
    for name, r in failed_runs(results):
        tail = "\n".join("    " + s for s in (r.get("stderr_tail") or "").rstrip().splitlines()[-15:])
        lines.append(f"FAILED      suite {name}, run {r['run']}: {r['error']}" + (f"\n  stderr (last lines):\n{tail}" if tail else ""))
    return lines


# --- markdown ----------------------------------------------------------------------------


def _cell(x: Any) -> str:
    return str(x).replace("|", "\\|").replace("\n", " ")


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    out = ["| " + " | ".join(_cell(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return out


def _num(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "x":
        return f"{value:.3f}" if value < 100 else f"{value:,.0f}"
    if unit == "fraction":  # a bubble, a relative error: four places, as the pipeline suite prints them
        return f"{value:.4f}"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.2f}" if abs(value) < 100 else f"{value:,.1f}"


def _machine_rows(m: Mapping[str, Any]) -> list[tuple[str, str]]:
    rows = [
        ("CPU", f"{m.get('cpu_model', 'unknown')} x {m.get('cpu_count', '?')}"),
        ("Memory", f"{m['memory_gib']:.1f} GiB" if isinstance(m.get("memory_gib"), (int, float)) else "unknown"),
    ]
    names = {"python": "Python", "platform": "Platform", "torch": "torch", "numpy": "numpy", "grpcio": "grpcio",
             "protobuf": "protobuf", "etcd": "etcd", "redis_server": "redis-server", "redis": "redis-py",
             "etcd_sdk_python": "etcd-sdk-python", "isal": "isal", "pdps": "pdps", "git_commit": "git commit"}
    rows += [(label, str(m[key])) for key, label in names.items() if key in m]
    rows += [(k, str(v)) for k, v in m.items() if k not in names and k not in ("cpu_model", "cpu_count", "memory_gib")]
    return rows


def render_markdown(results: Mapping[str, Any], notes: Mapping[str, str], *, results_link: str = "") -> str:
    """docs/performance.md for ``results`` (links to the plots are relative to docs/)."""
    runs = results["runs"]
    run_cols = [f"run {i}" for i in range(1, runs + 1)]
    verdicts = results["targets"]
    met = sum(v["status"] == tg.MET for v in verdicts)
    out = [
        "# Performance",
        "",
        "<!-- Generated by `pdps bench` from its results JSON: do not edit by hand. The explanations of missed "
        "targets live in bench/notes.toml. -->",
        "",
        "**Generated by `pdps bench`: do not edit by hand.** Run it again to refresh this page; explanations "
        "of missed targets come from `bench/notes.toml`.",
        "",
        f"- Command: `{results['command']}`",
        f"- Date: {results['finished']} (started {results['started']})",
        f"- Runs: {runs} consecutive run{'s' if runs != 1 else ''} of each suite",
        f"- Targets: {met} of {len(verdicts)} met ([targets](#targets))",
    ]
    if results_link:
        out.append(f"- Results JSON: `{results_link}`")
    if results["quick"]:
        out += ["", "> **Quick mode** (`--quick`): every suite ran a small configuration. The figures show that the "
                "suites run; they are not comparable with the targets, which are set for the full configurations."]
    out += ["", "## Machine", "", *_table(("", ""), _machine_rows(results["machine"]))]
    out += ["", "Benchmarks are programs in `bench/`; each prints its figures and ratios against a baseline measured "
            "in the same run, and asserts nothing. Other processes on the machine show up as noise: compare the runs."]

    for name, s in results["suites"].items():
        out += ["", f"## {name}", "", s["about"], "", f"Command: `{s['command']}`"]
        if s["config"]:
            out += ["", "Configuration (as the suite reports it):", "",
                    *_table(("setting", "value"), [(k, v if isinstance(v, str) else json.dumps(v)) for k, v in s["config"].items()])]
        names: list[tuple[str, str]] = []
        per_run: list[dict[str, float]] = []
        for r in s["runs"]:
            values = {}
            for f in r.get("figures", []):
                if (f["name"], f["unit"]) not in names:
                    names.append((f["name"], f["unit"]))
                values[(f["name"], f["unit"])] = f["value"]
            per_run.append(values)
        out += [""]
        failed = [r for r in s["runs"] if not r["ok"] or r.get("figures_error")]
        for r in failed:
            out += [f"**Run {r['run']} failed:** {r.get('error') or r.get('figures_error')}", ""]
        if names:
            rows = [(n, u, *(_num(v.get((n, u)), u) for v in per_run)) for n, u in names]
            out += _table(("figure", "unit", *run_cols), rows)
            secs = ", ".join(f"{r['seconds']:.0f} s" if isinstance(r.get("seconds"), (int, float)) else "-" for r in s["runs"])
            out += ["", f"Run time: {secs}.", "", f"![{name}](performance/{_plot_name(name)})"]
        if name == "end-to-end":
            out += _breakdown(s["runs"])
        if name == "scale":
            out += _curves(s["runs"])

    out += ["", "## Targets", "",
            f"A target is MET when every run meets it. Stability: consecutive runs must agree on each ratio within "
            f"{100 * results['stability_tolerance']:g}% (|a-b|/max(a,b), the worst pair).", ""]
    rows = []
    for v in verdicts:
        vals = list(v["values"]) + [None] * (runs - len(v["values"]))
        if _is_stability(v):  # one value, under the last run
            cells = [""] * (runs - 1) + [tg.format_value(v["values"][0], v["unit"])]
        else:
            cells = [tg.format_value(x, v["unit"]) for x in vals[:runs]]
        rows.append((f"`{v['id']}`: {v['description']}", tg.format_threshold(v), *cells, f"**{v['status']}**"))
    out += _table(("target", "threshold", *run_cols, "verdict"), rows)
    for v in verdicts:
        if v["status"] == tg.MET or v["status"] == tg.NOT_CHECKED:
            continue
        out += ["", f"### {v['status']}: `{v['id']}`", ""]
        if v["best"] is not None:
            out += [f"Measured: {tg.format_value(v['best'], v['unit'])} at best ({'lowest spread' if _is_stability(v) else 'best run'}), "
                    f"threshold {tg.format_threshold(v)}."]
        for i, d in enumerate(v["details"], 1):
            out += [f"- {d}" if _is_stability(v) else f"- run {i}: {d}"]
        for e in v["errors"]:
            out += [f"- error: {e}"]
        for r in v.get("not_run", ()):
            out += [f"- {r}"]
        note = notes.get(v["id"])
        out += ["", note.strip() if note else "_No explanation yet: add one to `bench/notes.toml` under this target's id._"]
    return "\n".join(out) + "\n"


def _is_stability(verdict: Mapping[str, Any]) -> bool:
    return str(verdict["id"]).startswith("stability.")


def _breakdown(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    keys: list[str] = []
    rows = []
    for r in runs:
        for config, parts in (r.get("breakdown_ms") or {}).items():
            for k in parts:
                if k not in keys:
                    keys.append(k)
            rows.append((r["run"], config, parts))
    if not rows:
        return []
    first_seen = list(keys)
    keys.sort(key=lambda k: (BREAKDOWN_ORDER.index(k) if k in BREAKDOWN_ORDER else len(BREAKDOWN_ORDER), first_seen.index(k)))
    table = [(config, run, *(f"{parts[k]:.2f}" if k in parts else "-" for k in keys)) for run, config, parts in rows]
    return ["", "Per-step breakdown, ms per step (compute / serialize / network / pserver update / barrier wait):", "",
            *_table(("configuration", "run", *keys), table)]


def _curve_run(runs: Sequence[Mapping[str, Any]]) -> tuple[int, list[Panel]] | None:
    """The last run of the scale suite whose report has a cost measured at some size, and its panels."""
    for r in reversed(runs):
        report = r.get("report")
        panels = scale_panels(report) if isinstance(report, Mapping) else []
        if panels:
            return r["run"], panels
    return None


def _curves(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    found = _curve_run(runs)
    if found is None:
        return []
    run, panels = found
    judged = verdicts(panels)
    out = ["", f"Each cost against the size it should follow (run {run}, log-log): markers at the measured sizes, dashed "
           "through the smallest point the linear growth a cost per step may have and the flat line a cost per task "
           "should keep. A slope is the least-squares fit of log(cost) on log(size), and with three sizes or more also "
           f"the slope between the two largest, the steeper of the two judged: above {SUPERLINEAR_ABOVE} a cost per step "
           f"is superlinear, above {FLAT_UP_TO} a cost per task is not flat. A log axis cannot show zero: zeros are left "
           "out of the plot and the slope, and named.",
           "", f"![scale curves](performance/{_plot_name(CURVES)})", ""]
    out += [f"- {v.line}" for v in judged]
    bad = [f"{v.series.label} ({v.shape})" for v in judged if v.ok is False]
    out += ["", f"**Not flat or linear in its size:** {'; '.join(bad)}." if bad
            else "Every cost with a slope is flat or linear in its size."]
    return out


def _plot_name(suite: str) -> str:
    return f"{suite}.png"


def write_docs(results: dict[str, Any], root: Path, notes: Mapping[str, str], *, results_link: str = "") -> list[Path]:
    """Draw every suite's plot into docs/performance/ and write docs/performance.md; returns the paths."""
    from pdps.shell.benchmark.plots import plot_curves, plot_suite

    written = []
    plots: dict[str, str] = {}
    for name, s in results["suites"].items():
        figures = [r.get("figures", []) for r in s["runs"]]  # by run: a failed run's is empty
        if any(figures):
            path = plot_suite(name, figures, root / PLOT_DIR / _plot_name(name))
            plots[name] = str(path.relative_to(root))
            written.append(path)
        found = _curve_run(s["runs"]) if name == "scale" else None
        if found is not None:
            run, panels = found
            title = f"Scale: each cost against its size, run {run} (log-log; dashed: linear per step, flat per task)"
            path = plot_curves(panels, root / PLOT_DIR / _plot_name(CURVES), title=title)
            plots[CURVES] = str(path.relative_to(root))
            written.append(path)
    results["plots"] = plots
    doc = root / DOC
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(render_markdown(results, notes, results_link=results_link))
    written.append(doc)
    return written
