"""``pdps bench``: run the suites, judge the targets, write the results JSON and the docs."""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib.util
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pdps.shell.benchmark import report as rp
from pdps.shell.benchmark.suites import SUITE_SPECS, SUITE_TIMEOUT_S, bench_dir, command_of, display_command, run_suite
from pdps.shell.benchmark.targets import SUITES, BenchError

VERSION_TIMEOUT_S = 10.0


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat()


def _program_version(argv: Sequence[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=VERSION_TIMEOUT_S).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "not installed"
    return out.splitlines()[0] if out else "unknown"


def _memory_gib() -> float | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    return None


def describe_machine(bench: Path) -> dict[str, Any]:
    """bench/machine.py's ``describe`` with the versions the suites depend on, the memory, the host's
    name and the commit (the hostname, CPU and memory tell whether earlier results are of this machine)."""
    path = bench / "machine.py"
    spec = importlib.util.spec_from_file_location("_pdps_bench_machine", path)
    if spec is None or spec.loader is None or not path.is_file():
        raise BenchError(f"{path} is missing: the checkout's bench/ directory is incomplete")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    commit = _program_version(["git", "-C", str(bench.parent), "rev-parse", "--short", "HEAD"])
    return module.describe(
        "torch", "numpy", "grpcio", "protobuf", "redis", "etcd-sdk-python", "isal", "pdps",
        hostname=platform.node() or "unknown",
        memory_gib=_memory_gib(),
        etcd=_program_version(["etcd", "--version"]),
        redis_server=_program_version(["redis-server", "--version"]),
        git_commit=commit,
    )


def run_bench(
    *,
    suites: Sequence[str] = SUITES,
    runs: int = 2,
    quick: bool = False,
    check: bool = False,
    out_dir: Path | None = None,
    docs: bool = True,
    argv: Sequence[str] = (),
    timeout: float = SUITE_TIMEOUT_S,
    echo: Callable[[str], None] = say,
    package_file: str | None = None,
    fresh: bool = False,
) -> int:
    """Run ``suites`` ``runs`` times each (consecutively), write the results and, with ``docs``,
    docs/performance.md and its plots; print the verdicts. Returns the exit status.

    The results merge into the ``results.json`` already in ``out_dir`` (:func:`report.merge`):
    the suites run now replace theirs, the others are kept as they were and the targets are
    judged over all of them. A fresh file instead, with a line on ``echo`` saying why, with
    ``fresh``, or when the earlier file is unreadable, of another schema, of the other
    ``quick`` setting or of another machine. The exit status and the verdict lines printed
    judge only the suites run now.
    """
    unknown = [s for s in suites if s not in SUITE_SPECS]
    if unknown:
        raise BenchError(f"unknown suite(s) {unknown}; choose from {', '.join(SUITES)}")
    if runs < 1:
        raise BenchError(f"--runs must be at least 1, got {runs}")
    bench = bench_dir(package_file)
    root = bench.parent
    # beside the plots when the docs are written (the report links the figures it shows);
    # a development run with --no-docs leaves the docs and writes outside them
    out_dir = out_dir if out_dir is not None else root / ("docs/performance" if docs else "bench-results")
    notes = rp.load_notes(bench / "notes.toml")  # a bad notes file fails now, not after the runs
    if docs:
        from pdps.shell.benchmark.plots import _pyplot

        _pyplot()  # a missing matplotlib fails now, not after the runs
    order = list(dict.fromkeys(suites))
    command = "pdps " + shlex.join(argv)
    started = _now()
    machine = describe_machine(bench)
    echo(f"pdps bench: {', '.join(order)}; {runs} run(s) each{' (quick)' if quick else ''}; results to {out_dir}")

    suite_runs: dict[str, list[dict[str, Any]]] = {}
    commands: dict[str, str] = {}
    measured: dict[str, dict[str, str]] = {}
    for name in order:
        spec = SUITE_SPECS[name]
        commands[name] = display_command(command_of(spec, bench, quick), root)
        measured[name] = {"started": _now()}
        for i in range(1, runs + 1):
            echo(f"pdps bench: {name} run {i}/{runs}: {commands[name]}")
            result = run_suite(spec, bench, quick=quick, label=f"{name} {i}/{runs}", echo=echo, timeout=timeout)
            status = "done" if result["ok"] else f"FAILED: {result['error']}"
            echo(f"pdps bench: {name} run {i}/{runs} {status} ({result['seconds']:.0f} s)")
            suite_runs.setdefault(name, []).append(result)
        measured[name]["finished"] = _now()

    results = rp.assemble(
        command=command, machine=machine, quick=quick, runs=runs, suite_runs=suite_runs, commands=commands,
        started=started, finished=_now(), measured=measured,
    )
    json_path = out_dir / "results.json"
    results = _merge_earlier(results, json_path, fresh=fresh, echo=echo)
    written = [rp.write_json(results, json_path)]  # first: the figures survive a failure to draw
    if docs:
        link = os.path.relpath(json_path, root) if json_path.is_relative_to(root) else str(json_path)
        written += rp.write_docs(results, root, notes, results_link=link)
        rp.write_json(results, json_path)  # again, with the plots' paths
    for line in rp.check_lines(results):
        print(line, flush=True)
    for path in written:
        echo(f"pdps bench: wrote {path}")
    return rp.exit_code(results, check=check)


def _merge_earlier(results: dict[str, Any], json_path: Path, *, fresh: bool, echo: Callable[[str], None]) -> dict[str, Any]:
    """``results`` merged into the earlier ``json_path`` where it may be, saying what was kept or why nothing was."""
    if fresh:
        echo("pdps bench: --fresh: writing only this run's suites, none kept from earlier results")
        return results
    earlier, why = rp.earlier_results(json_path)
    if earlier is not None:
        why = rp.why_not_merge(results, earlier) or ""
    if earlier is None or why:
        echo(f"pdps bench: writing only this run's suites: {why}")
        return results
    merged, kept, dropped = rp.merge(results, earlier)
    if kept:
        echo(f"pdps bench: kept {len(kept)} suite{'s' if len(kept) != 1 else ''} from the earlier results "
             f"({', '.join(kept)}); --fresh would write only this run's")
    if dropped:
        echo(f"pdps bench: dropped {', '.join(dropped)} from the earlier results: no such suite any more")
    return merged
