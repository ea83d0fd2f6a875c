"""What ``pdps bench`` writes: the results JSON, ``docs/performance.md``, the ``--check`` lines.

All three are made from one results dict (:func:`assemble`), whose verdicts come from
:func:`pdps.shell.benchmark.targets.evaluate`. The markdown is a pure function of the
results and the hand-written notes of ``bench/notes.toml`` (target id -> markdown,
shown under that target when it is missed).

A run of some suites merges into the results it finds (:func:`earlier_results`,
:func:`merge`): its suites replace theirs, the others are kept as they were, each suite
saying under ``measured`` which command, commit and date its figures come from, and the
targets are judged again over them all.
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
# the machine fields that tell one benchmark machine from another: figures of two machines
# are never merged (versions and the commit may differ: each suite records its own commit)
MACHINE_IDENTITY = ("hostname", "cpu_model", "cpu_count")
MEMORY_TOLERANCE = 0.02  # MemTotal moves by a few MiB across kernels on one machine


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
    measured: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The results dict: the run's settings, each suite's runs and figures, the verdicts.

    ``suite_runs[suite]`` holds what :func:`pdps.shell.benchmark.suites.run_suite` returned
    for each run, in order. Each suite's ``measured`` says where its figures come from:
    ``command``, ``started``, ``finished``, ``git_commit`` (the machine's) and ``runs``;
    ``measured[suite]`` may give the suite's own ``started`` and ``finished``.
    """
    suites: dict[str, Any] = {}
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
        suites[name] = {
            "program": f"bench/{spec.program}",
            "about": spec.about,
            "command": commands.get(name, ""),
            "args": spec.args(quick),
            "config": config or {},
            "measured": {
                "command": command,
                "started": started,
                "finished": finished,
                "git_commit": machine.get("git_commit"),
                "runs": len(entries),
                **(measured or {}).get(name, {}),
            },
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
        "suites_run": list(suites),
        "suites_kept": [],
        "suites": suites,
        "targets": tg.evaluate(suite_reports(suites)),
        "stability_tolerance": tg.STABILITY,
    }


def suite_reports(suites: Mapping[str, Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any] | None]]:
    """Each suite's report per run (None for a run without one), as :func:`targets.evaluate` takes them."""
    return {name: [r.get("report") for r in s["runs"]] for name, s in suites.items()}


def _suite_problem(name: str, s: Any) -> str | None:
    """Why the earlier results' entry of suite ``name`` cannot be kept (None: it can)."""
    if not isinstance(s, Mapping):
        return f"suite {name!r} is a {type(s).__name__}, not an object"
    for key, kind in (("about", str), ("command", str), ("config", dict), ("runs", list)):
        if not isinstance(s.get(key), kind):
            return f"suite {name!r} has no {key!r} {kind.__name__}"
    for r in s["runs"]:
        if not isinstance(r, Mapping) or not isinstance(r.get("run"), int) or not isinstance(r.get("ok"), bool):
            return f"suite {name!r} has a run without 'run' and 'ok': {r!r:.80}"
        if not isinstance(r.get("figures", []), list) or not isinstance(r.get("report", {}), Mapping):
            return f"suite {name!r} run {r['run']} has malformed 'figures' or 'report'"
    measured = s.get("measured")
    if measured is not None and not isinstance(measured, Mapping):
        return f"suite {name!r} has a 'measured' that is not an object"
    return None


def earlier_results(path: Path) -> tuple[dict[str, Any] | None, str]:
    """The results JSON at ``path`` to merge into, or None and why there is none to merge into."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None, f"no earlier results at {path}"
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"the earlier {path} is unreadable ({exc})"
    try:
        data = json.loads(text)
    except ValueError as exc:
        return None, f"the earlier {path} is not JSON ({exc})"
    if not isinstance(data, dict):
        return None, f"the earlier {path} holds a {type(data).__name__}, not a results object"
    if data.get("schema") != SCHEMA:
        return None, f"the earlier {path} has schema {data.get('schema')!r}, not {SCHEMA}"
    if not isinstance(data.get("suites"), dict) or not isinstance(data.get("machine"), dict):
        return None, f"the earlier {path} has no 'suites' or 'machine' object"
    for name, s in data["suites"].items():
        problem = _suite_problem(name, s)
        if problem:
            return None, f"the earlier {path} is malformed: {problem}"
    return data, ""


def same_machine(a: Mapping[str, Any], b: Mapping[str, Any]) -> str | None:
    """None when the machine descriptions ``a`` and ``b`` are of one machine, else the field that differs.

    Compares :data:`MACHINE_IDENTITY` where both name it (older results have no hostname)
    and the memory within :data:`MEMORY_TOLERANCE`.
    """
    for key in MACHINE_IDENTITY:
        if key in a and key in b and a[key] != b[key]:
            return f"{key} {a[key]!r} against {b[key]!r}"
    ma, mb = a.get("memory_gib"), b.get("memory_gib")
    if isinstance(ma, (int, float)) and isinstance(mb, (int, float)) and abs(ma - mb) > MEMORY_TOLERANCE * max(ma, mb):
        return f"memory_gib {ma:.1f} against {mb:.1f}"
    return None


def why_not_merge(results: Mapping[str, Any], earlier: Mapping[str, Any]) -> str | None:
    """Why ``results`` must not be merged into the readable ``earlier`` results (None: it may)."""
    if bool(earlier.get("quick")) != bool(results["quick"]):
        kinds = {True: "--quick", False: "full"}
        return (f"the earlier results are {kinds[bool(earlier.get('quick'))]} runs and this is {kinds[bool(results['quick'])]}: "
                "their figures are not comparable")
    differs = same_machine(results["machine"], earlier["machine"])
    if differs:
        return f"the earlier results come from another machine ({differs})"
    return None


def merge(results: Mapping[str, Any], earlier: Mapping[str, Any]) -> tuple[dict[str, Any], list[str], list[str]]:
    """``results`` with the suites of ``earlier`` it did not run, and the targets judged over them all.

    Returns the merged results, the suites kept from ``earlier`` and those dropped from it
    (no longer a suite). The suites run now replace theirs; a kept suite is kept as it was,
    with a ``measured`` made from ``earlier``'s own settings when it has none (results
    written before suites recorded it). Suites are in :data:`targets.SUITES` order. The
    caller has checked :func:`why_not_merge`.
    """
    ran = dict(results["suites"])
    kept: dict[str, Any] = {}
    dropped = []
    for name, s in earlier["suites"].items():
        if name in ran:
            continue
        if name not in SUITE_SPECS:
            dropped.append(name)
            continue
        kept[name] = dict(s)
        if "measured" not in s:
            kept[name]["measured"] = {
                "command": earlier.get("command", "unknown"),
                "started": earlier.get("started"),
                "finished": earlier.get("finished"),
                "git_commit": earlier["machine"].get("git_commit"),
                "runs": len(s["runs"]),
            }
    every = {**ran, **kept}
    suites = {name: every[name] for name in tg.SUITES if name in every}
    merged = dict(results)
    merged["suites_run"] = list(results.get("suites_run", ran))
    merged["suites_kept"] = [name for name in suites if name in kept]
    merged["suites"] = suites
    merged["targets"] = tg.evaluate(suite_reports(suites))
    return merged, merged["suites_kept"], dropped


def failed_runs(results: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    return [(name, r) for name, s in results["suites"].items() for r in s["runs"] if not r["ok"]]


def _judged(results: Mapping[str, Any]) -> set[str]:
    """The suites this invocation ran: the only ones its exit status and ``--check`` lines judge."""
    return set(results.get("suites_run", results["suites"]))


def exit_code(results: Mapping[str, Any], *, check: bool) -> int:
    """1 when a suite run now failed to run, or with ``check`` when one of its targets is not met; else 0.

    Suites kept from earlier results are shown in the docs, not judged again here.
    """
    judged = _judged(results)
    if any(name in judged for name, _ in failed_runs(results)):
        return 1
    if check and tg.failing([v for v in results["targets"] if v["suite"] in judged]):
        return 1
    return 0


def write_json(results: Mapping[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)
    return path


def check_lines(results: Mapping[str, Any]) -> list[str]:
    """One line per target of the suites run now (MET / MISSED / ...) with its figures and threshold,
    then each of their failed runs."""
    judged = _judged(results)
    targets = [v for v in results["targets"] if v["suite"] in judged]
    lines = []
    width = max((len(v["id"]) for v in targets), default=0)
    for v in targets:
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
        if name not in judged:
            continue
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
    """docs/performance.md for ``results`` (links to the plots are relative to docs/).

    Suites may differ in their number of runs (some kept from earlier results): each suite's
    table has its own runs, the targets table as many run columns as the suite with the most.
    """
    runs = results["runs"]
    suite_runs = {name: len(s["runs"]) for name, s in results["suites"].items()}
    columns = max([runs, *suite_runs.values()])
    verdicts = results["targets"]
    kept = [name for name in results.get("suites_kept", ()) if name in results["suites"]]
    ran = [name for name in results.get("suites_run", results["suites"]) if name in results["suites"]]
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
    ]
    if kept:
        out += [
            f"- Suites it ran: {', '.join(ran) or 'none'}, {runs} consecutive run{'s' if runs != 1 else ''} of each",
            f"- Kept from earlier runs: {', '.join(kept)} (each suite's heading says which command, date and commit "
            "measured it)",
        ]
    else:
        out += [f"- Runs: {runs} consecutive run{'s' if runs != 1 else ''} of each suite"]
    out += [f"- Targets: {met} of {len(verdicts)} met ([targets](#targets))"]
    if results_link:
        out.append(f"- Results JSON: `{results_link}`")
    if results["quick"]:
        out += ["", "> **Quick mode** (`--quick`): every suite ran a small configuration. The figures show that the "
                "suites run; they are not comparable with the targets, which are set for the full configurations."]
    out += ["", "## Machine", "", *_table(("", ""), _machine_rows(results["machine"]))]
    out += ["", "Benchmarks are programs in `bench/`; each prints its figures and ratios against a baseline measured "
            "in the same run, and asserts nothing. Other processes on the machine show up as noise: compare the runs."]

    for name, s in results["suites"].items():
        out += ["", f"## {name}", ""]
        if isinstance(s.get("measured"), Mapping):
            out += [_measured_line(s["measured"], kept=name in kept), ""]
        out += [s["about"], "", f"Command: `{s['command']}`"]
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
            out += _table(("figure", "unit", *(f"run {i}" for i in range(1, len(per_run) + 1))), rows)
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
        if _is_stability(v):  # one value, under its suite's last run
            last = min(max(suite_runs.get(v["suite"], runs), 1), columns)
            cells = [""] * (last - 1) + [tg.format_value(v["values"][0], v["unit"])]
        else:
            cells = [tg.format_value(x, v["unit"]) for x in v["values"][:columns]]
        cells += [""] * (columns - len(cells))  # a suite with fewer runs than the most
        rows.append((f"`{v['id']}`: {v['description']}", tg.format_threshold(v), *cells, f"**{v['status']}**"))
    out += _table(("target", "threshold", *(f"run {i}" for i in range(1, columns + 1)), "verdict"), rows)
    for v in verdicts:
        if v["status"] == tg.MET or v["status"] == tg.NOT_CHECKED:
            continue
        out += ["", f"### {v['status']}: `{v['id']}`", ""]
        if v["best"] is not None:
            at_most = v["comparison"] == "<="
            got = [x for x in v["values"] if x is not None]
            worst = (max(got) if at_most else min(got)) if got else v["best"]
            if _is_stability(v) or not tg.meets(v["best"], v["threshold"], at_most=at_most):
                out += [f"Measured: {tg.format_value(v['best'], v['unit'])} at best ({'lowest spread' if _is_stability(v) else 'best run'}), "
                        f"threshold {tg.format_threshold(v)}."]
            else:  # the best run met it and another did not: say so, or the figure reads as a contradiction
                out += [f"Measured: {tg.format_value(v['best'], v['unit'])} at best (best run), {tg.format_value(worst, v['unit'])} at worst; "
                        f"every run must meet the threshold, {tg.format_threshold(v)}."]
        for i, d in enumerate(v["details"], 1):
            out += [f"- {d}" if _is_stability(v) else f"- run {i}: {d}"]
        for e in v["errors"]:
            out += [f"- error: {e}"]
        for r in v.get("not_run", ()):
            out += [f"- {r}"]
        note = notes.get(v["id"])
        out += ["", note.strip() if note else "_No explanation yet: add one to `bench/notes.toml` under this target's id._"]
    return "\n".join(out) + "\n"


def _measured_line(m: Mapping[str, Any], *, kept: bool) -> str:
    """Where a suite's figures come from: "Measured by `pdps bench ...` on DATE, N runs, commit C"."""
    n = m.get("runs")
    parts = [f"Measured by `{m.get('command', 'unknown')}` on {m.get('finished') or 'an unknown date'}"]
    if isinstance(n, int):
        parts.append(f"{n} run{'s' if n != 1 else ''}")
    parts.append(f"commit {m.get('git_commit') or 'unknown'}")
    return ", ".join(parts) + (" (kept from an earlier run)." if kept else ".")


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
