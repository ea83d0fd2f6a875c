"""The performance targets, the figures each suite reports, and the verdicts. No I/O.

Everything ``pdps bench`` says about a suite's output is read here, from the JSON
object the suite's program prints: the figures of the report's tables
(:func:`suite_figures`), the figure behind each target (:data:`TARGETS`), and the
verdicts (:func:`evaluate`). The results JSON, ``docs/performance.md`` and
``--check`` all take the verdicts from :func:`evaluate`, so they cannot disagree.

A target is MET when every run meets its threshold (at least it, or with ``at_most`` at
most it: a cost that must not grow faster than its size). Each ratio target also gets a
stability verdict: consecutive runs must agree within :data:`STABILITY`
(``|a - b| / max(a, b)``, the worst consecutive pair). A figure that cannot be read
from a suite's JSON (a renamed key) is an ERROR naming the key, never a silent pass.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from pdps.core.errors import PdpsError

MET, MISSED, ERROR, NOT_RUN, NOT_CHECKED = "MET", "MISSED", "ERROR", "NOT RUN", "NOT CHECKED"
STABILITY = 0.15  # two consecutive runs agree on each ratio within 15%
SUITES = ("transport", "master", "checkpoint", "end-to-end", "scale", "elastic", "replicas", "online", "sparse", "pipeline", "graph")


class BenchError(PdpsError):
    """``pdps bench`` cannot do what it was asked (no bench/ directory, a bad option)."""

    code = "bench"


class SuiteOutputError(BenchError):
    """A suite's JSON lacks a key pdps bench reads, or holds something else than expected."""

    code = "bench_output"


class FigureNotRun(BenchError):
    """A suite ran but says it could not measure a figure, and why (e.g. a configuration
    this version refuses): the target is NOT RUN, with the reason."""

    code = "bench_not_run"


Report = Mapping[str, Any]


@attrs.frozen
class Target:
    """One target: ``figure(report)`` of ``suite``'s JSON must be at least ``threshold``
    (with ``at_most``: at most).

    ``unit`` is ``"x"`` for a ratio (the stability rule applies to it) or the unit of an
    absolute figure. ``detail(report)`` names the figures behind the value (the
    measured ceiling and baseline), shown under a missed target.
    """

    id: str
    suite: str
    description: str
    threshold: float
    figure: Callable[[Report], float]
    detail: Callable[[Report], str]
    unit: str = "x"
    at_most: bool = False

    @property
    def is_ratio(self) -> bool:
        return self.unit == "x"

    @property
    def comparison(self) -> str:
        return "<=" if self.at_most else ">="

    def meets(self, value: float) -> bool:
        return meets(value, self.threshold, at_most=self.at_most)


def meets(value: float, threshold: float, *, at_most: bool) -> bool:
    """Whether ``value`` meets ``threshold`` (at most it, or at least it): a Target's rule,
    also for a verdict read back from results JSON (``comparison`` "<=": at most)."""
    return value <= threshold if at_most else value >= threshold


# --- reading a suite's JSON -------------------------------------------------------------


def get(report: Any, *path: str | int, suite: str) -> Any:
    """``report[path[0]][path[1]]...``, or a SuiteOutputError naming the missing key."""
    node = report
    for i, key in enumerate(path):
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            where = "".join(f"[{k!r}]" for k in path[:i]) or "the top level"
            have = sorted(node)[:20] if isinstance(node, Mapping) else type(node).__name__
            raise SuiteOutputError(f"{suite} suite JSON: no {key!r} under {where} (it has: {have})") from None
    return node


def number(value: Any, what: str, *, suite: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SuiteOutputError(f"{suite} suite JSON: {what} is {value!r}, not a number")
    return float(value)


def _first(report: Report, paths: Sequence[tuple[str | int, ...]], *, suite: str) -> Any:
    """The first of ``paths`` present in ``report``; the error names the first (the expected one)."""
    for path in paths:
        try:
            return get(report, *path, suite=suite)
        except SuiteOutputError:
            continue
    return get(report, *paths[0], suite=suite)


def _one(rows: Any, what: str, suite: str, **match: Any) -> Mapping[str, Any]:
    if not isinstance(rows, list):
        raise SuiteOutputError(f"{suite} suite JSON: expected a list of {what}, got {type(rows).__name__}")
    for row in rows:
        if isinstance(row, Mapping) and all(row.get(k) == v for k, v in match.items()):
            return row
    have = [{k: r.get(k) for k in match} for r in rows if isinstance(r, Mapping)]
    raise SuiteOutputError(f"{suite} suite JSON: no {what} with {match} (rows: {have})")


# end-to-end: {"torch": {"samples_per_s"}, "runs": [{"transport", "mode", "trainers", "pservers", ...}]}


def e2e_row(report: Report, transport: str, mode: str = "async", trainers: int = 1, pservers: int = 2) -> Mapping[str, Any]:
    rows = get(report, "runs", suite="end-to-end")
    return _one(rows, "run", "end-to-end", transport=transport, mode=mode, trainers=trainers, pservers=pservers)


def e2e_torch(report: Report) -> float:
    return number(get(report, "torch", "samples_per_s", suite="end-to-end"), "torch.samples_per_s", suite="end-to-end")


def e2e_ratio(transport: str) -> Callable[[Report], float]:
    def figure(report: Report) -> float:
        row = e2e_row(report, transport)
        if "ratio_vs_torch" in row:
            return number(row["ratio_vs_torch"], f"{transport} ratio_vs_torch", suite="end-to-end")
        return number(get(row, "samples_per_s", suite="end-to-end"), "samples_per_s", suite="end-to-end") / e2e_torch(report)

    return figure


def e2e_detail(transport: str) -> Callable[[Report], str]:
    def detail(report: Report) -> str:
        row = e2e_row(report, transport)
        return f"pdps {transport} async 1x2: {float(row['samples_per_s']):,.0f} samples/s; torch: {e2e_torch(report):,.0f} samples/s"

    return detail


def e2e_label(row: Mapping[str, Any]) -> str:
    return f"{row.get('transport')} {row.get('mode')} {row.get('trainers')}x{row.get('pservers')}"


# transport: {"ratios": {"grpc_vs_tcp": {"value", "row", "baseline"}}, "results": [{"label", "kind", "gbps"}]}


def transport_ratio(name: str) -> Callable[[Report], float]:
    def figure(report: Report) -> float:
        return number(get(report, "ratios", name, "value", suite="transport"), f"ratios.{name}.value", suite="transport")

    return figure


def transport_detail(name: str) -> Callable[[Report], str]:
    def detail(report: Report) -> str:
        r = get(report, "ratios", name, suite="transport")
        rows = {x.get("label"): x for x in get(report, "results", suite="transport") if isinstance(x, Mapping)}
        mine, base = rows.get(r.get("row"), {}), rows.get(r.get("baseline"), {})
        return f"{r.get('row')}: {float(mine.get('gbps', float('nan'))):.2f} GB/s; {r.get('baseline')}: {float(base.get('gbps', float('nan'))):.2f} GB/s"

    return detail


# master: {"tasks", "results": [{"backend", "pdps": {"per_s"}, "baseline": {"per_s"}, "ratio_transitions_per_s"}]}

MASTER_RATE = (("pdps", "per_s"), ("pdps", "transitions_per_s"), ("transitions_per_s",))
MASTER_BASELINE_RATE = (("baseline", "per_s"), ("baseline", "transitions_per_s"), ("baseline_transitions_per_s",))


def master_row(report: Report, backend: str) -> Mapping[str, Any]:
    return _one(get(report, "results", suite="master"), "backend", "master", backend=backend)


def master_rate(backend: str) -> Callable[[Report], float]:
    def figure(report: Report) -> float:
        return number(_first(master_row(report, backend), MASTER_RATE, suite="master"), f"{backend} transitions/s", suite="master")

    return figure


def master_baseline_rate(backend: str) -> Callable[[Report], float]:
    def figure(report: Report) -> float:
        row = master_row(report, backend)
        return number(_first(row, MASTER_BASELINE_RATE, suite="master"), f"{backend} baseline transitions/s", suite="master")

    return figure


def master_ratio(backend: str) -> Callable[[Report], float]:
    def figure(report: Report) -> float:
        row = master_row(report, backend)
        if "ratio_transitions_per_s" in row:
            return number(row["ratio_transitions_per_s"], f"{backend} ratio_transitions_per_s", suite="master")
        return master_rate(backend)(report) / master_baseline_rate(backend)(report)

    return figure


def master_detail(backend: str) -> Callable[[Report], str]:
    def detail(report: Report) -> str:
        tasks = report.get("tasks")
        queue = f", {tasks:,} tasks" if isinstance(tasks, int) else ""
        return (
            f"{backend}{queue}: pdps {master_rate(backend)(report):,.0f} transitions/s; "
            f"whole-snapshot baseline {master_baseline_rate(backend)(report):,.1f} transitions/s"
        )

    return detail


# checkpoint: {"ratios": [{"name", "value", "row", "baseline"}], "results": [{"label", "gbps"}]}


def checkpoint_ratio(name: str) -> Callable[[Report], float]:
    def figure(report: Report) -> float:
        row = _one(get(report, "ratios", suite="checkpoint"), "ratio", "checkpoint", name=name)
        return number(get(row, "value", suite="checkpoint"), f"ratio {name!r}", suite="checkpoint")

    return figure


def checkpoint_detail(name: str) -> Callable[[Report], str]:
    def detail(report: Report) -> str:
        r = _one(get(report, "ratios", suite="checkpoint"), "ratio", "checkpoint", name=name)
        rows = {x.get("label"): x for x in get(report, "results", suite="checkpoint") if isinstance(x, Mapping)}
        mine, base = rows.get(r.get("row"), {}), rows.get(r.get("baseline"), {})
        return (
            f"{r.get('row')}: {float(mine.get('gbps', float('nan'))):.2f} GB/s; {r.get('baseline')}: "
            f"{float(base.get('gbps', float('nan'))):.2f} GB/s (best rounds: {float(r.get('best', float('nan'))):.3f})"
        )

    return detail


# scale: {"ratios": {name: {"value", "figure", "axis", "from", "to", "size_growth"}}, "steps": [...], "tasks": [...],
#         "master_bytes_per_task"}


def scale_ratio(name: str) -> Callable[[Report], float]:
    def figure(report: Report) -> float:
        return number(get(report, "ratios", name, "value", suite="scale"), f"ratios.{name}.value", suite="scale")

    return figure


def scale_detail(name: str) -> Callable[[Report], str]:
    def detail(report: Report) -> str:
        r = get(report, "ratios", name, suite="scale")
        return (
            f"{r.get('figure')} at {r.get('axis')} {r.get('from')} -> {r.get('to')} (size x{r.get('size_growth')}): "
            f"{float(r.get('value', float('nan'))):.2f}x"
        )

    return detail


def scale_memory(report: Report) -> float:
    return number(get(report, "master_bytes_per_task", suite="scale"), "master_bytes_per_task", suite="scale")


def scale_memory_detail(report: Report) -> str:
    rows = get(report, "tasks", suite="scale")
    return "; ".join(f"{r.get('tasks'):,} tasks: {float(r.get('master_bytes_per_task', float('nan'))):,.0f} B/task" for r in rows)


def _scale(id: str, description: str, threshold: float) -> Target:
    return Target(f"scale.{id}", "scale", description, threshold, scale_ratio(id), scale_detail(id), at_most=True)


# elastic: {"runs": [{"mib", "mode", "resizes": [{"from", "to", "wall_s", "pause_s", "bytes_moved", "bytes_minimum",
#           "restart": {"pause_s"}, ...}]}], "ratios": {name: {"value", "mib", "mode", "resize"}}}


def elastic_ratio(name: str) -> Callable[[Report], float]:
    def figure(report: Report) -> float:
        return number(get(report, "ratios", name, "value", suite="elastic"), f"ratios.{name}.value", suite="elastic")

    return figure


def elastic_detail(name: str) -> Callable[[Report], str]:
    def detail(report: Report) -> str:
        r = get(report, "ratios", name, suite="elastic")
        where = f"{r.get('mib')} MiB, {r.get('mode')}, {r.get('resize')}"
        for run in get(report, "runs", suite="elastic"):
            for x in run.get("resizes", ()) if run.get("mib") == r.get("mib") and run.get("mode") == r.get("mode") else ():
                if f"{x.get('from')}->{x.get('to')}" == r.get("resize"):
                    if name == "pause_vs_restart":
                        return f"{where}: live pause {float(x['pause_s']):.3f} s; stop, checkpoint, restart {float(x['restart']['pause_s']):.2f} s"
                    return f"{where}: moved {int(x['bytes_moved']):,} B; minimum {int(x['bytes_minimum']):,} B"
        return where

    return detail


# replicas: {"failover": {"lease_ttl_etcd_s", "runs": [{"replicas", "resumed_s", "kills_s", "rounds_retrained", ...}]},
#            "throughput": [{"mode", "replicas", "samples_per_s"} | {"mode", "replicas", "not_run"}],
#            "ratios": {name: {"value", ...} | {"value": None, "not_run"}}}


def replicas_ratio(name: str) -> Callable[[Report], float]:
    def figure(report: Report) -> float:
        r = get(report, "ratios", name, suite="replicas")
        if isinstance(r, Mapping) and r.get("not_run"):
            raise FigureNotRun(f"replicas suite: {name} not run: {r['not_run']}")
        return number(get(r, "value", suite="replicas"), f"ratios.{name}.value", suite="replicas")

    return figure


def replicas_detail(name: str) -> Callable[[Report], str]:
    def detail(report: Report) -> str:
        r = get(report, "ratios", name, suite="replicas")
        if r.get("not_run"):
            return f"not run: {r['not_run']}"
        if name == "resumed_beyond_ttl":
            return f"replicas = 2: resumed {float(r['resumed_s']):.2f} s after the kill (median); lease TTL {float(r['lease_ttl_s']):g} s"
        if name == "resumed_r1_vs_r2":
            return f"kill -> resumed, medians: replicas = 1 (rollback) {float(r['r1_s']):.2f} s; replicas = 2 (failover) {float(r['r2_s']):.2f} s"
        return f"{r.get('mode')}: replicas = 2 {float(r['r2_samples_per_s']):,.0f} samples/s; replicas = 1 {float(r['r1_samples_per_s']):,.0f} samples/s"

    return detail


def _replicas(id: str, description: str, threshold: float, **kw: Any) -> Target:
    return Target(f"replicas.{id}", "replicas", description, threshold, replicas_ratio(id), replicas_detail(id), **kw)


# online: {"throughput": [{"source", "records", "records_per_s", "records_exactly_once"}],
#          "speculation": [{"speculation", "records", "seconds", "records_exactly_once"}],
#          "ratios": {"stream_vs_parquet": {"value", ...}, "speculation_on_vs_off": {"value", "on_s", "off_s"}}}


def online_ratio(name: str) -> Callable[[Report], float]:
    def figure(report: Report) -> float:
        return number(get(report, "ratios", name, "value", suite="online"), f"ratios.{name}.value", suite="online")

    return figure


def online_speculation_detail(report: Report) -> str:
    rows = get(report, "speculation", suite="online")
    off, on = (_one(rows, "speculation row", "online", speculation=s) for s in (False, True))
    return (
        f"one 10x straggler, median job time: speculation on {float(on['seconds']):.2f} s, off {float(off['seconds']):.2f} s; "
        f"records trained exactly once: {on['records_exactly_once']:,} and {off['records_exactly_once']:,} of {on['records']:,}"
    )


# sparse: {"throughput": [{"route", "label", "rows_per_s", "step_s", ...}], "memory": [{"rule", "pserver", "rows", "ratio",
#          "bytes_per_row", "row_bytes", "store_bytes_per_row", ...}], "ctr": {"pdps": {"samples_per_s"}, "torch": {"samples_per_s"}} | None,
#          "ratios": {"grpc_vs_tcp" | "inproc_vs_local": {"value", "rows_per_s", "baseline_rows_per_s", "row", "baseline"},
#                     "memory": {"value", "rule", "pserver", "bytes_per_row", "row_bytes"}, "ctr_vs_torch": {"value", ...}}}


def sparse_ratio(name: str) -> Callable[[Report], float]:
    def figure(report: Report) -> float:
        return number(get(report, "ratios", name, "value", suite="sparse"), f"ratios.{name}.value", suite="sparse")

    return figure


def sparse_detail(name: str) -> Callable[[Report], str]:
    def detail(report: Report) -> str:
        r = get(report, "ratios", name, suite="sparse")
        if name == "memory":
            return (
                f"worst: {r.get('rule')} pserver {r.get('pserver')}, {float(r['bytes_per_row']):,.0f} B of RSS a row against "
                f"{r.get('row_bytes')} B of row and optimizer state"
            )
        return f"{r.get('row')}: {float(r['rows_per_s']):,.0f} rows/s; {r.get('baseline')}: {float(r['baseline_rows_per_s']):,.0f} rows/s"

    return detail


# pipeline: {"bubble": [{"schedule", "stages", "microbatches", "theory", "simulated", "measured", "error", "makespan_s",
#            "peak_activations", "peak_expected", ...}], "p2p": [{"route", "label", "mib", "gbps", "round_s", ...}],
#            "ratios": {"bubble_gpipe" | "bubble_1f1b": {"value", "measured", "theory"},
#                       "p2p_grpc_vs_tcp": {"value", "mib", "gbps", "baseline_gbps", "each"}}}

PIPELINE_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B"}


def pipeline_ratio(name: str) -> Callable[[Report], float]:
    def figure(report: Report) -> float:
        return number(get(report, "ratios", name, "value", suite="pipeline"), f"ratios.{name}.value", suite="pipeline")

    return figure


# graph: {"update": [{"route", "label", "step_s", "steps_s"}], "conversion": {"first_s", "hit_s", "pserver_build_s", "traced", "hits", ...},
#         "ratios": {"graph_vs_eager" | "named_vs_eager": {"value", "step_s", "baseline_step_s", "row", "baseline"}}}


def graph_ratio(name: str) -> Callable[[Report], float]:
    def figure(report: Report) -> float:
        return number(get(report, "ratios", name, "value", suite="graph"), f"ratios.{name}.value", suite="graph")

    return figure


def pipeline_detail(name: str) -> Callable[[Report], str]:
    def detail(report: Report) -> str:
        r = get(report, "ratios", name, suite="pipeline")
        if name.startswith("bubble_"):
            return (
                f"{PIPELINE_SCHEDULES.get(name.removeprefix('bubble_'), name)}, {r.get('stages')} stages x {r.get('microbatches')} "
                f"microbatches: measured bubble {float(r['measured']):.4f}; theory (P-1)/(M+P-1) {float(r['theory']):.4f}"
            )
        return f"{float(r['mib']):g} MiB activations: p2p over gRPC {float(r['gbps']):.2f} GB/s; raw TCP echo {float(r['baseline_gbps']):.2f} GB/s"

    return detail


def graph_detail(name: str) -> Callable[[Report], str]:
    def detail(report: Report) -> str:
        r = get(report, "ratios", name, suite="graph")
        return (
            f"{r.get('row')}: {float(r['step_s']) * 1000:,.1f} ms a step; {r.get('baseline')}: {float(r['baseline_step_s']) * 1000:,.1f} ms "
            f"(median steps, the routes interleaved)"
        )

    return detail


# --- the table ---------------------------------------------------------------------------

TARGETS: tuple[Target, ...] = (
    Target("e2e.grpc", "end-to-end", "async-SGD, 1 trainer + 2 pservers over gRPC / single-process torch, samples/s",
           0.5, e2e_ratio("grpc"), e2e_detail("grpc")),
    Target("e2e.inproc", "end-to-end", "async-SGD, 1 trainer + 2 pservers over inproc / single-process torch, samples/s",
           0.8, e2e_ratio("inproc"), e2e_detail("inproc")),
    Target("transport.grpc_vs_tcp", "transport", "gRPC push + pull of 64 MiB / raw loopback TCP, GB/s",
           0.75, transport_ratio("grpc_vs_tcp"), transport_detail("grpc_vs_tcp")),
    Target("transport.grpc_vs_torch_rpc", "transport", "gRPC push + pull of 64 MiB / torch.distributed.rpc, GB/s",
           1.0, transport_ratio("grpc_vs_torch_rpc"), transport_detail("grpc_vs_torch_rpc")),
    Target("master.etcd_rate", "master", "master transitions/s on etcd with 100k tasks",
           5000.0, master_rate("etcd"), master_detail("etcd"), unit="transitions/s"),
    Target("master.etcd_vs_snapshot", "master", "master transitions/s on etcd / the whole-snapshot baseline",
           50.0, master_ratio("etcd"), master_detail("etcd")),
    Target("checkpoint.save", "checkpoint", "checkpoint save (write_part) / raw sequential write, time",
           0.8, checkpoint_ratio("save / raw write"), checkpoint_detail("save / raw write")),
    Target("checkpoint.restore_warm", "checkpoint", "checkpoint restore (read_part) / raw sequential read, page cache warm",
           0.8, checkpoint_ratio("restore / raw read, warm"), checkpoint_detail("restore / raw read, warm")),
    Target("checkpoint.restore_cold", "checkpoint", "checkpoint restore (read_part) / raw sequential read, page cache dropped",
           0.8, checkpoint_ratio("restore / raw read, cold"), checkpoint_detail("restore / raw read, cold")),
    _scale("step_ops_trainers", "store operations per sync step at 10x the trainers / at 1x (linear: 10x)", 12.0),
    _scale("step_writes_trainers", "keys written per sync step at 10x the trainers / at 1x (linear: 10x)", 12.0),
    _scale("step_bytes_trainers", "store bytes written + read per sync step at 10x the trainers / at 1x (linear: 10x)", 12.0),
    _scale("step_conflicts_trainers", "compare-and-set conflicts per sync step at 10x the trainers / at 1x (linear: 10x)", 12.0),
    _scale("step_messages_trainers", "messages per sync step at 10x the trainers / at 1x (linear: 10x)", 12.0),
    _scale("step_ops_pservers", "store operations per sync step at 4x the pservers / at 1x (linear: 4x)", 4.8),
    _scale("task_ops_tasks", "master store operations per task at 10x the tasks / at 1x (flat: 1x)", 1.2),
    _scale("task_bytes_tasks", "master store bytes written per task at 10x the tasks / at 1x (flat: 1x)", 1.2),
    # the queue's dicts and sets grow by doubling: their slack per task swings with where N falls between two sizes
    _scale("task_memory_tasks", "master memory per task at 10x the tasks / at 1x (flat: 1x; hash tables grow by doubling)", 1.5),
    Target("scale.master_memory", "scale", "master memory per task (task specs + queue), the largest queue",
           1024.0, scale_memory, scale_memory_detail, unit="B/task", at_most=True),
    Target("elastic.pause_vs_restart", "elastic", "stop, checkpoint, restart with the new count, restore / the longest "
           "trainer pause of a live resize, 1 GiB model, the worst of 2->3->4->2 pservers",
           10.0, elastic_ratio("pause_vs_restart"), elastic_detail("pause_vs_restart")),
    Target("elastic.bytes_vs_minimum", "elastic", "bytes a resize moved / the minimum from its two slot maps, the worst resize",
           1.05, elastic_ratio("bytes_vs_minimum"), elastic_detail("bytes_vs_minimum"), at_most=True),
    _replicas("resumed_beyond_ttl", "SIGKILL of a pserver -> training resumed with replicas = 2, beyond the lease TTL (2 s); "
              "sync, 2 pservers, gRPC + etcd, median of the kills", 0.5, unit="s", at_most=True),
    _replicas("resumed_r1_vs_r2", "kill -> resumed with replicas = 1 (rollback to a checkpoint) / with replicas = 2 (failover)", 2.0),
    _replicas("sync_r2_vs_r1", "training samples/s with replicas = 2 / replicas = 1, sync, 10M-parameter MLP, 2 trainers + 2 pservers over gRPC", 0.8),
    _replicas("async_r2_vs_r1", "training samples/s with replicas = 2 / replicas = 1, async, 10M-parameter MLP, 2 trainers + 2 pservers over gRPC", 0.8),
    Target("online.speculation_on_vs_off", "online", "job time with one trainer slowed 10x, speculation on / off, async, 3 trainers, "
           "8 tasks, median of the repeats", 0.6, online_ratio("speculation_on_vs_off"), online_speculation_detail, at_most=True),
    Target("sparse.grpc_vs_tcp", "sparse", "pull + push of 64k distinct rows x 64 float32 a step, 10M-row table, 2 pserver processes "
           "over gRPC / raw loopback TCP echo of the same bytes, rows/s", 0.5, sparse_ratio("grpc_vs_tcp"), sparse_detail("grpc_vs_tcp")),
    Target("sparse.inproc_vs_local", "sparse", "pull + push of 64k distinct rows x 64 float32 a step, 10M-row table, 2 pservers over "
           "inproc / local index_select + index_add_ on a [10M, 64] tensor, rows/s", 0.5, sparse_ratio("inproc_vs_local"),
           sparse_detail("inproc_vs_local")),
    Target("sparse.memory", "sparse", "pserver RSS growth over filling 10M rows, settled (6 s after the fill, its allocator trimmer "
           "on) / the raw bytes of its rows and their optimizer state, the worst pserver of SGD and Adagrad", 1.5, sparse_ratio("memory"), sparse_detail("memory"), at_most=True),
    Target("pipeline.bubble_gpipe", "pipeline", "GPipe bubble, 4 stages x 8 microbatches (sleep compute, StageRunners over inproc p2p): "
           "|measured - theory| / theory, theory (P-1)/(M+P-1)", 0.10, pipeline_ratio("bubble_gpipe"), pipeline_detail("bubble_gpipe"),
           unit="fraction", at_most=True),
    Target("pipeline.bubble_1f1b", "pipeline", "1F1B bubble, 4 stages x 8 microbatches (sleep compute, StageRunners over inproc p2p): "
           "|measured - theory| / theory, theory (P-1)/(M+P-1)", 0.10, pipeline_ratio("bubble_1f1b"), pipeline_detail("bubble_1f1b"),
           unit="fraction", at_most=True),
    Target("pipeline.p2p_grpc_vs_tcp", "pipeline", "p2p activation there and back between 2 processes over gRPC / raw loopback TCP "
           "echo of the same bytes, GB/s, the worst of 4 and 16 MiB", 0.75, pipeline_ratio("p2p_grpc_vs_tcp"),
           pipeline_detail("p2p_grpc_vs_tcp")),
    Target("graph.update_vs_eager", "graph", "a pserver shard's Adam step (10M float32 in 10 blocks) run from the graph rule "
           "/ eager torch.optim.Adam on the same blocks, median step", 1.5, graph_ratio("graph_vs_eager"), graph_detail("graph_vs_eager"),
           at_most=True),
)


def stability_id(target: Target) -> str:
    return f"stability.{target.id}"


# --- the figures of each suite's table ---------------------------------------------------


def suite_figures(suite: str, report: Report) -> list[tuple[str, float, str]]:
    """(name, value, unit) rows of a suite's table in the report, in the suite's order."""
    out: list[tuple[str, float, str]] = []
    if suite == "transport":
        for r in get(report, "results", suite=suite):
            out.append((f"{r['label']}", number(r.get("gbps"), f"{r.get('label')} gbps", suite=suite), "GB/s"))
        for name, r in get(report, "ratios", suite=suite).items():
            out.append((name.replace("_vs_", " / ").replace("_", "-"), number(r.get("value"), f"ratios.{name}", suite=suite), "x"))
    elif suite == "master":
        for r in get(report, "results", suite=suite):
            b = r.get("backend")
            out.append((f"{b}: pdps", master_rate(b)(report), "transitions/s"))
            out.append((f"{b}: whole-snapshot baseline", master_baseline_rate(b)(report), "transitions/s"))
            out.append((f"{b}: pdps / baseline", master_ratio(b)(report), "x"))
    elif suite == "checkpoint":
        for r in get(report, "results", suite=suite):
            out.append((f"{r['label']}", number(r.get("gbps"), f"{r.get('label')} gbps", suite=suite), "GB/s"))
        for r in get(report, "ratios", suite=suite):
            out.append((f"{r['name']}", number(r.get("value"), f"ratio {r.get('name')}", suite=suite), "x"))
    elif suite == "end-to-end":
        out.append(("torch, single process", e2e_torch(report), "samples/s"))
        for r in get(report, "runs", suite=suite):
            label = e2e_label(r)
            out.append((label, number(r.get("samples_per_s"), f"{label} samples_per_s", suite=suite), "samples/s"))
            out.append((f"{label} / torch", number(r.get("ratio_vs_torch"), f"{label} ratio_vs_torch", suite=suite), "x"))
    elif suite == "scale":
        for r in get(report, "steps", suite=suite):
            label = f"{r['trainers']} trainers x {r['pservers']} pservers"
            out.append((f"{label}: store ops / step", number(r.get("store_ops_per_step"), f"{label} store_ops_per_step", suite=suite), "ops"))
            out.append((f"{label}: bytes / step", number(r.get("bytes_per_step"), f"{label} bytes_per_step", suite=suite), "B"))
        for r in get(report, "tasks", suite=suite):
            label = f"master, {r['tasks']:,} tasks"
            out.append((f"{label}: memory / task", number(r.get("master_bytes_per_task"), f"{label} memory", suite=suite), "B"))
            out.append((f"{label}: store ops / task", number(r.get("store_ops_per_task"), f"{label} ops", suite=suite), "ops"))
        for name, r in get(report, "ratios", suite=suite).items():
            out.append((name, number(r.get("value"), f"ratios.{name}", suite=suite), "x"))
    elif suite == "elastic":
        for r in get(report, "runs", suite=suite):
            for x in get(r, "resizes", suite=suite):
                label = f"{r['mib']} MiB {r['mode']}, {x['from']}->{x['to']}"
                out.append((f"{label}: resize wall time", number(x.get("wall_s"), f"{label} wall_s", suite=suite), "s"))
                out.append((f"{label}: longest trainer pause", number(x.get("pause_s"), f"{label} pause_s", suite=suite), "s"))
                restart = number(get(x, "restart", "pause_s", suite=suite), f"{label} restart.pause_s", suite=suite)
                out.append((f"{label}: stop, checkpoint, restart", restart, "s"))
                out.append((f"{label}: bytes moved", number(x.get("bytes_moved"), f"{label} bytes_moved", suite=suite), "B"))
                out.append((f"{label}: bytes minimum", number(x.get("bytes_minimum"), f"{label} bytes_minimum", suite=suite), "B"))
        for name, r in get(report, "ratios", suite=suite).items():
            out.append((name, number(r.get("value"), f"ratios.{name}", suite=suite), "x"))
    elif suite == "replicas":
        failover = get(report, "failover", suite=suite)
        out.append(("lease TTL", number(get(failover, "lease_ttl_etcd_s", suite=suite), "failover.lease_ttl_etcd_s", suite=suite), "s"))
        for r in get(failover, "runs", suite=suite):
            label = f"replicas = {r['replicas']}"
            out.append((f"{label}: kill -> resumed", number(r.get("resumed_s"), f"{label} resumed_s", suite=suite), "s"))
            retrained = get(r, "rounds_retrained", suite=suite)
            out.append((f"{label}: rounds retrained per kill", sum(retrained) / max(1, len(retrained)), "rounds"))
        for r in get(report, "throughput", suite=suite):
            if not r.get("not_run"):  # a configuration not run shows under its target
                label = f"{r['mode']}, replicas = {r['replicas']}"
                out.append((label, number(r.get("samples_per_s"), f"{label} samples_per_s", suite=suite), "samples/s"))
        for name, r in get(report, "ratios", suite=suite).items():
            if name == "resumed_beyond_ttl":
                out.append(("replicas = 2: resumed beyond the lease TTL", replicas_ratio(name)(report), "s"))
            elif not r.get("not_run"):
                out.append((name, number(r.get("value"), f"ratios.{name}", suite=suite), "x"))
    elif suite == "online":
        for r in get(report, "throughput", suite=suite):
            label = {"parquet": "Parquet", "redis-stream": "Redis stream"}.get(r.get("source"), str(r.get("source")))
            out.append((f"{label}: records/s", number(r.get("records_per_s"), f"{label} records_per_s", suite=suite), "records/s"))
        out.append(("Redis stream / Parquet, records/s", online_ratio("stream_vs_parquet")(report), "x"))
        for r in get(report, "speculation", suite=suite):
            label = f"speculation {'on' if r.get('speculation') else 'off'}"
            out.append((f"{label}: job time", number(r.get("seconds"), f"{label} seconds", suite=suite), "s"))
            once = number(r.get("records_exactly_once"), f"{label} records_exactly_once", suite=suite)
            out.append((f"{label}: records trained exactly once", once, "records"))
        out.append(("speculation on / off, job time", online_ratio("speculation_on_vs_off")(report), "x"))
    elif suite == "sparse":
        for r in get(report, "throughput", suite=suite):
            label = str(r.get("label"))
            out.append((label, number(r.get("rows_per_s"), f"{label} rows_per_s", suite=suite), "rows/s"))
        for r in get(report, "memory", suite=suite):
            label = f"{r.get('rule')}, pserver {r.get('pserver')}: RSS a row"
            out.append((label, number(r.get("bytes_per_row"), f"{label} bytes_per_row", suite=suite), "B"))
            if "store_bytes_per_row" in r:  # what the row store says it holds (table_stats)
                label = f"{r.get('rule')}, pserver {r.get('pserver')}: row store a row"
                out.append((label, number(r["store_bytes_per_row"], f"{label} store_bytes_per_row", suite=suite), "B"))
        ctr = report.get("ctr")
        if isinstance(ctr, Mapping):
            out.append(("CTR: pdps, 2 trainers x 2 pservers", number(get(ctr, "pdps", "samples_per_s", suite=suite), "ctr.pdps.samples_per_s", suite=suite), "samples/s"))
            out.append(("CTR: torch, single process", number(get(ctr, "torch", "samples_per_s", suite=suite), "ctr.torch.samples_per_s", suite=suite), "samples/s"))
        names = {"grpc_vs_tcp": "grpc / raw TCP, rows/s", "inproc_vs_local": "inproc / local, rows/s", "memory": "pserver RSS / raw bytes, worst",
                 "ctr_vs_torch": "CTR pdps / torch, samples/s"}  # fmt: skip
        for name, r in get(report, "ratios", suite=suite).items():
            out.append((names.get(name, name), number(r.get("value"), f"ratios.{name}.value", suite=suite), "x"))
    elif suite == "pipeline":
        for r in get(report, "bubble", suite=suite):
            label = PIPELINE_SCHEDULES.get(r.get("schedule"), str(r.get("schedule")))
            out.append((f"{label}: bubble, theory", number(r.get("theory"), f"{label} theory", suite=suite), "fraction"))
            out.append((f"{label}: bubble, measured", number(r.get("measured"), f"{label} measured", suite=suite), "fraction"))
            out.append((f"{label}: step makespan", number(r.get("makespan_s"), f"{label} makespan_s", suite=suite), "s"))
            peaks = get(r, "peak_activations", suite=suite)
            if not isinstance(peaks, list) or not peaks:
                raise SuiteOutputError(f"{suite} suite JSON: {label} peak_activations is {peaks!r}, not a list of one count per stage")
            for s, held in enumerate(peaks):
                out.append((f"{label}: peak activations held, stage {s}", number(held, f"{label} peak_activations[{s}]", suite=suite), "microbatches"))
        for r in get(report, "p2p", suite=suite):
            label = f"{r.get('label')}, {float(r.get('mib', 0)):g} MiB"
            out.append((label, number(r.get("gbps"), f"{label} gbps", suite=suite), "GB/s"))
        names = {"bubble_gpipe": "GPipe: |measured - theory| / theory", "bubble_1f1b": "1F1B: |measured - theory| / theory",
                 "p2p_grpc_vs_tcp": "p2p over gRPC / raw TCP, GB/s, worst size"}  # fmt: skip
        for name, r in get(report, "ratios", suite=suite).items():
            unit = "fraction" if name.startswith("bubble_") else "x"
            out.append((names.get(name, name), number(r.get("value"), f"ratios.{name}.value", suite=suite), unit))
    elif suite == "graph":
        for r in get(report, "update", suite=suite):
            label = str(r.get("label"))
            out.append((label, number(r.get("step_s"), f"{label} step_s", suite=suite) * 1000, "ms"))
        conv = get(report, "conversion", suite=suite)
        out.append(("conversion, first (traced)", number(get(conv, "first_s", suite=suite), "conversion.first_s", suite=suite), "s"))
        out.append(("conversion, cached", number(get(conv, "hit_s", suite=suite), "conversion.hit_s", suite=suite) * 1000, "ms"))
        out.append(("pserver check + runner build", number(get(conv, "pserver_build_s", suite=suite), "conversion.pserver_build_s", suite=suite) * 1000, "ms"))
        out.append(("conversions traced", number(get(conv, "traced", suite=suite), "conversion.traced", suite=suite), "conversions"))
        out.append(("cache hits", number(get(conv, "hits", suite=suite), "conversion.hits", suite=suite), "conversions"))
        names = {"graph_vs_eager": "graph rule / eager Adam, step", "named_vs_eager": "named Adam / eager Adam, step"}
        for name, r in get(report, "ratios", suite=suite).items():
            out.append((names.get(name, name), number(r.get("value"), f"ratios.{name}.value", suite=suite), "x"))
    else:
        raise BenchError(f"unknown suite {suite!r}; choose from {', '.join(SUITES)}")
    return out


def e2e_breakdown(report: Report) -> list[tuple[str, dict[str, float]]]:
    """(configuration, {step part: ms per step}) of every end-to-end run that reports a breakdown."""
    out = []
    torch_parts = report.get("torch", {}).get("breakdown_ms") if isinstance(report.get("torch"), Mapping) else None
    if isinstance(torch_parts, Mapping):
        out.append(("torch, single process", {str(k): float(v) for k, v in torch_parts.items() if isinstance(v, (int, float))}))
    for r in get(report, "runs", suite="end-to-end"):
        parts = r.get("breakdown_ms")
        if isinstance(parts, Mapping):
            out.append((e2e_label(r), {str(k): float(v) for k, v in parts.items() if isinstance(v, (int, float))}))
    return out


# --- verdicts ----------------------------------------------------------------------------


def spread(values: Sequence[float]) -> float:
    """The worst disagreement of consecutive values, |a - b| / max(a, b)."""
    worst = 0.0
    for a, b in zip(values, values[1:]):
        top = max(abs(a), abs(b))
        worst = max(worst, abs(a - b) / top if top else 0.0)
    return worst


def evaluate(reports: Mapping[str, Sequence[Report | None]], targets: Sequence[Target] = TARGETS) -> list[dict[str, Any]]:
    """The verdict on every target of the suites in ``reports``, then the stability verdicts.

    ``reports[suite]`` holds each run's JSON in order (None for a run that failed). A
    target of a suite that was not run is left out; one whose suite failed, or whose
    suite says it could not measure its figure (:class:`FigureNotRun`, the reason under
    ``not_run``), is NOT RUN.
    """
    verdicts: list[dict[str, Any]] = []
    stability: list[dict[str, Any]] = []
    for t in targets:
        if t.suite not in reports:
            continue
        runs = list(reports[t.suite])
        values: list[float | None] = []
        errors: list[str] = []
        details: list[str] = []
        not_run: list[str] = []  # why a run that worked did not measure the figure
        for report in runs:
            if report is None:
                values.append(None)
                continue
            try:
                values.append(t.figure(report))
            except FigureNotRun as exc:
                values.append(None)
                not_run.append(str(exc))
                continue
            except SuiteOutputError as exc:
                values.append(None)
                errors.append(str(exc))
                continue
            try:
                details.append(t.detail(report))
            except (SuiteOutputError, KeyError, TypeError, ValueError) as exc:
                details.append(f"(figures unavailable: {exc})")
        if errors:
            status = ERROR
        elif not runs or any(v is None for v in values):
            status = NOT_RUN
        else:
            status = MET if all(t.meets(v) for v in values) else MISSED  # type: ignore[arg-type]
        got = [v for v in values if v is not None]
        verdicts.append(
            {
                "id": t.id,
                "suite": t.suite,
                "description": t.description,
                "comparison": t.comparison,
                "threshold": t.threshold,
                "unit": t.unit,
                "values": values,
                "best": (min(got) if t.at_most else max(got)) if got else None,
                "status": status,
                "details": details,
                "errors": errors,
                "not_run": not_run,
            }
        )
        if t.is_ratio:
            if status in (ERROR, NOT_RUN):
                s_status, value = status, None
            elif len(values) < 2:
                s_status, value = NOT_CHECKED, None
            else:
                value = spread(got)
                s_status = MET if value <= STABILITY + 1e-12 else MISSED  # 15% exactly is within 15%
            stability.append(
                {
                    "id": stability_id(t),
                    "suite": t.suite,
                    "description": f"consecutive runs agree on {t.id} (|a-b|/max(a,b))",
                    "comparison": "<=",
                    "threshold": STABILITY,
                    "unit": "fraction",
                    "values": [value],
                    "best": value,
                    "status": s_status,
                    "details": [f"{t.id} per run: " + ", ".join("-" if v is None else f"{v:.3f}" for v in values)],
                    "errors": [],
                    "not_run": [],
                }
            )
    return verdicts + stability


def failing(verdicts: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The verdicts that make ``--check`` fail: MISSED, ERROR and NOT RUN (NOT CHECKED does not)."""
    return [v for v in verdicts if v["status"] in (MISSED, ERROR, NOT_RUN)]


def format_value(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "fraction":
        return f"{100 * value:.1f}%"
    if unit == "x":
        return f"{value:.3f}x" if value < 100 else f"{value:,.0f}x"
    return f"{value:,.0f} {unit}" if abs(value) >= 100 else f"{value:.3g} {unit}"


def format_threshold(verdict: Mapping[str, Any]) -> str:
    value, unit = verdict["threshold"], verdict["unit"]
    shown = f"{100 * value:g}%" if unit == "fraction" else f"{value:g}x" if unit == "x" else f"{value:,g} {unit}"
    return f"{verdict['comparison']} {shown}"
