"""pdps bench: the target verdicts, the stability rule, --check's exit status, the results
JSON, docs/performance.md and its plots, from fake suite JSON (no benchmark runs here)."""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

from pdps.shell.benchmark import curves
from pdps.shell.benchmark import report as rp
from pdps.shell.benchmark import targets as tg
from pdps.shell.benchmark.runner import run_bench
from pdps.shell.benchmark.suites import SUITE_SPECS, bench_dir, parse_json_line, run_suite

REPO = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"


# --- fake suite JSON, shaped like each program's --json -----------------------------------


def transport_json(grpc=3.0, tcp=3.2, rpc=1.2):
    rows = [
        {"label": "tcp", "kind": "tcp", "gbps": tcp},
        {"label": "torch-rpc", "kind": "torch-rpc", "gbps": rpc},
        {"label": "inproc, 1 block", "kind": "inproc", "gbps": 700.0},
        {"label": "grpc, chunk default, 1 block", "kind": "grpc", "gbps": grpc},
    ]
    ratios = {
        "grpc_vs_tcp": {"value": grpc / tcp, "row": "grpc, chunk default, 1 block", "baseline": "tcp"},
        "grpc_vs_torch_rpc": {"value": grpc / rpc, "row": "grpc, chunk default, 1 block", "baseline": "torch-rpc"},
    }
    return {"bench": "transport", "mib": 64.0, "repeats": 7, "blocks": [1, 4], "machine": {}, "results": rows, "ratios": ratios}


def master_json(etcd=6000.0, base=20.0):
    def row(backend, rate):
        return {"backend": backend, "pdps": {"per_s": rate}, "baseline": {"per_s": base}, "ratio_transitions_per_s": rate / base}

    return {"bench": "master_transitions", "tasks": 100_000, "clients": 4, "results": [row("etcd", etcd), row("memory", 30000.0)]}


def checkpoint_json(save=0.9, warm=0.85, cold=0.95):
    rows = [
        {"label": "raw write", "gbps": 1.5},
        {"label": "write_part (crc32 inline) *", "gbps": 1.5 * save},
        {"label": "raw read, warm", "gbps": 9.0},
        {"label": "read_part (crc32 inline) *, warm", "gbps": 9.0 * warm},
        {"label": "raw read, cold", "gbps": 2.5},
        {"label": "read_part (crc32 inline) *, cold", "gbps": 2.5 * cold},
    ]
    ratios = [
        {"name": "save / raw write", "value": save, "best": save, "row": "write_part (crc32 inline) *", "baseline": "raw write"},
        {"name": "restore / raw read, warm", "value": warm, "best": warm, "row": "read_part (crc32 inline) *, warm", "baseline": "raw read, warm"},
        {"name": "restore / raw read, cold", "value": cold, "best": cold, "row": "read_part (crc32 inline) *, cold", "baseline": "raw read, cold"},
    ]
    return {"size_bytes": 1 << 30, "repeats": 3, "crc32": "isal.isal_zlib.crc32", "machine": {}, "results": rows, "ratios": ratios}


def e2e_json(grpc=0.6, inproc=0.9, torch=1000.0):
    def row(transport, ratio, pservers=2):
        return {
            "transport": transport, "mode": "async", "trainers": 1, "pservers": pservers,
            "samples_per_s": ratio * torch, "ratio_vs_torch": ratio,
            "breakdown_ms": {"compute": 30.0, "serialize": 2.5, "network": 4.0, "update": 3.0, "barrier": 0.0, "loop_total": 40.0},
        }

    return {
        "bench": "end_to_end",
        "config": {"model": "784-2048-2048-2048-10", "batch_size": 64, "trainers": [1, 2]},
        "machine": {},
        "torch": {"samples_per_s": torch, "breakdown_ms": {"forward": 10.0, "backward": 20.0, "optimizer": 5.0}},
        "runs": [row("grpc", grpc / 2, pservers=1), row("inproc", inproc), row("grpc", grpc)],
    }


def scale_json(step_ops=11.0, memory=600.0):
    def r(name, value, figure, axis, small, large, **fixed):
        return {name: {"value": value, "figure": figure, "axis": axis, "from": small, "to": large, "size_growth": large / small, **fixed}}

    ratios = {
        **r("step_ops_trainers", step_ops, "store_ops_per_step", "trainers", 10, 100, pservers=4),
        **r("step_writes_trainers", 9.6, "writes_per_step", "trainers", 10, 100, pservers=4),
        **r("step_bytes_trainers", 9.0, "bytes_per_step", "trainers", 10, 100, pservers=4),
        **r("step_conflicts_trainers", 9.0, "conflicts_per_step", "trainers", 10, 100, pservers=4),
        **r("step_messages_trainers", 10.0, "messages_per_step", "trainers", 10, 100, pservers=4),
        **r("step_ops_pservers", 2.0, "store_ops_per_step", "pservers", 4, 16, trainers=100),
        **r("task_ops_tasks", 1.0, "store_ops_per_task", "tasks", 10_000, 100_000),
        **r("task_bytes_tasks", 1.05, "bytes_written_per_task", "tasks", 10_000, 100_000),
        **r("task_memory_tasks", 1.0, "master_bytes_per_task", "tasks", 10_000, 100_000),
    }
    steps = [{"trainers": t, "pservers": 4, "store_ops_per_step": 30.0 * t, "bytes_per_step": 900.0 * t} for t in (10, 100)]
    tasks = [{"tasks": n, "master_bytes_per_task": memory, "store_ops_per_task": 4.0} for n in (10_000, 100_000)]
    return {"bench": "scale", "config": {"trainers": [10, 100]}, "steps": steps, "tasks": tasks, "master_bytes_per_task": memory, "ratios": ratios}


def elastic_json(pause=0.2, restart=6.0, moved=1.0):
    def resize(a, b):
        return {"from": a, "to": b, "wall_s": 0.5, "step_s": 1.0, "longest_gap_s": 1.0 + pause, "pause_s": pause,
                "bytes_moved": int(moved * 2**28), "bytes_minimum": 2**28, "bytes_vs_minimum": moved, "rollbacks": 0,
                "restart": {"pause_s": restart}, "pause_vs_restart": restart / pause}

    worst = {"mib": 1024, "mode": "sync", "resize": "2->3"}
    return {
        "config": {"mib": [1024], "resizes": [2, 3, 4, 2]},
        "runs": [{"mib": 1024, "mode": "sync", "resizes": [resize(2, 3), resize(3, 4), resize(4, 2)]}],
        "ratios": {"pause_vs_restart": {"value": restart / pause, **worst}, "bytes_vs_minimum": {"value": moved, **worst}},
    }


def replicas_json(r1=5.0, r2=2.2, sync=0.9, async_=0.85, ttl=2.0, async_refused=None):
    def row(mode, replicas, rate):
        return {"mode": mode, "replicas": replicas, "trainers": 2, "pservers": 2, "samples_per_s": rate, "steps_per_s": rate / 64}

    throughput = [row("sync", 1, 400.0), row("sync", 2, 400.0 * sync), row("async", 1, 500.0)]
    if async_refused:
        throughput.append({"mode": "async", "replicas": 2, "trainers": 2, "pservers": 2, "not_run": async_refused})
        async_ratio = {"value": None, "mode": "async", "not_run": f"async, replicas = 2: {async_refused}"}
    else:
        throughput.append(row("async", 2, 500.0 * async_))
        async_ratio = {"value": async_, "mode": "async", "r1_samples_per_s": 500.0, "r2_samples_per_s": 500.0 * async_}
    return {
        "config": {"lease_ttl": ttl, "repeats": 3, "roles": "processes"},
        "failover": {"lease_ttl_s": ttl, "lease_ttl_etcd_s": ttl, "runs": [
            {"replicas": 1, "resumed_s": r1, "kills_s": [r1] * 3, "rounds_retrained": [2, 4, 3], "rollbacks": 3},
            {"replicas": 2, "resumed_s": r2, "kills_s": [r2] * 3, "rounds_retrained": [0, 0, 0], "rollbacks": 0},
        ]},
        "throughput": throughput,
        "ratios": {
            "resumed_beyond_ttl": {"value": r2 - ttl, "resumed_s": r2, "lease_ttl_s": ttl},
            "resumed_r1_vs_r2": {"value": r1 / r2, "r1_s": r1, "r2_s": r2},
            "sync_r2_vs_r1": {"value": sync, "mode": "sync", "r1_samples_per_s": 400.0, "r2_samples_per_s": 400.0 * sync},
            "async_r2_vs_r1": async_ratio,
        },
    }


def online_json(on=4.0, off=10.0, stream=30_000.0, parquet=80_000.0):
    return {
        "config": {"records": 200_000, "repeats": 3, "spec_tasks": 8, "spec_steps": 100},
        "throughput": [
            {"source": "parquet", "records": 200_000, "records_per_s": parquet, "records_per_s_each": [parquet] * 3, "records_exactly_once": 200_000},
            {"source": "redis-stream", "records": 200_000, "records_per_s": stream, "records_per_s_each": [stream] * 3, "records_exactly_once": 200_000},
        ],
        "speculation": [
            {"speculation": False, "records": 6400, "seconds": off, "seconds_each": [off] * 3, "records_exactly_once": 6400, "beaten_each": [0] * 3},
            {"speculation": True, "records": 6400, "seconds": on, "seconds_each": [on] * 3, "records_exactly_once": 6400, "beaten_each": [1] * 3},
        ],
        "ratios": {
            "stream_vs_parquet": {"value": stream / parquet, "stream_records_per_s": stream, "parquet_records_per_s": parquet},
            "speculation_on_vs_off": {"value": on / off, "on_s": on, "off_s": off},
        },
    }


def sparse_json(grpc=2.4e6, tcp=4.0e6, inproc=1.8e6, local=2.0e6, rss_per_row=(300.0, 290.0, 560.0, 550.0), ctr=True):
    def route(route, label, rate):
        return {"route": route, "label": label, "ids_per_step": 65536, "rows_per_s": rate, "step_s": 65536 / rate, "steps_s": [65536 / rate] * 7}

    memory = [{"rule": rule, "pserver": p, "rows": 5_000_000, "row_bytes": raw, "bytes_per_row": b, "ratio": b / raw, "store_bytes_per_row": raw + 40}
              for (rule, p, raw), b in zip((("SGD", 0, 256), ("SGD", 1, 256), ("Adagrad", 0, 512), ("Adagrad", 1, 512)), rss_per_row)]
    worst = max(memory, key=lambda r: r["ratio"])
    labels = {"grpc": "grpc (pdps)", "tcp": "raw TCP echo", "inproc": "inproc (pdps)", "local": "local index_select + index_add_"}
    rows = [route(k, labels[k], v) for k, v in (("inproc", inproc), ("local", local), ("grpc", grpc), ("tcp", tcp))]
    ratios = {
        "grpc_vs_tcp": {"value": grpc / tcp, "rows_per_s": grpc, "baseline_rows_per_s": tcp, "row": labels["grpc"], "baseline": labels["tcp"]},
        "inproc_vs_local": {"value": inproc / local, "rows_per_s": inproc, "baseline_rows_per_s": local, "row": labels["inproc"], "baseline": labels["local"]},
        "memory": {"value": worst["ratio"], "rule": worst["rule"], "pserver": worst["pserver"], "bytes_per_row": worst["bytes_per_row"], "row_bytes": worst["row_bytes"]},
    }
    ctr_row = None
    if ctr:
        ctr_row = {"samples": 20_000, "passes": 2, "pdps": {"samples_per_s": 3_000.0}, "torch": {"samples_per_s": 12_000.0}}
        ratios["ctr_vs_torch"] = {"value": 0.25, "pdps_samples_per_s": 3_000.0, "torch_samples_per_s": 12_000.0}
    return {"config": {"rows": 10_000_000, "ids": 65536}, "throughput": rows, "memory": memory, "ctr": ctr_row, "ratios": ratios}


def pipeline_json(gpipe=0.29, one_f_one_b=0.28, grpc=(1.6, 1.8), tcp=(2.0, 2.0)):
    theory = 3 / 11  # 4 stages x 8 microbatches

    def bubble(schedule, measured, peaks):
        return {"schedule": schedule, "stages": 4, "microbatches": 8, "forward_s": 0.02, "backward_s": 0.04, "theory": theory,
                "simulated": theory, "measured": measured, "measured_each": [measured] * 5, "error": abs(measured - theory) / theory,
                "makespan_s": 0.66 / (1 - measured) * (1 - theory), "ideal_makespan_s": 0.66, "peak_activations": peaks, "peak_expected": peaks}

    rows = []
    for mib, g, t in zip((4.0, 16.0), grpc, tcp):
        nbytes = int(mib * 2**20)
        rows += [{"route": "grpc", "label": "p2p over gRPC (2 processes)", "mib": mib, "bytes": nbytes, "gbps": g, "round_s": 2 * nbytes / g / 1e9},
                 {"route": "tcp", "label": "raw TCP echo (2 processes)", "mib": mib, "bytes": nbytes, "gbps": t, "round_s": 2 * nbytes / t / 1e9}]
    bubbles = [bubble("gpipe", gpipe, [8, 8, 8, 8]), bubble("1f1b", one_f_one_b, [4, 3, 2, 1])]
    each = [{"mib": mib, "value": g / t, "gbps": g, "baseline_gbps": t} for mib, g, t in zip((4.0, 16.0), grpc, tcp)]
    ratios = {f"bubble_{b['schedule']}": {"value": b["error"], "measured": b["measured"], "theory": theory, "stages": 4, "microbatches": 8} for b in bubbles}
    ratios["p2p_grpc_vs_tcp"] = {**min(each, key=lambda r: r["value"]), "each": each}
    return {"config": {"stages": 4, "microbatches": 8, "forward_ms": 20.0}, "bubble": bubbles, "p2p": rows, "ratios": ratios}


def graph_json(graph=0.55, eager=0.5, named=0.6):
    labels = {"graph": "graph rule (GraphOptimizer)", "eager": "eager torch.optim.Adam", "named": "named 'Adam' shard"}
    rows = [{"route": k, "label": labels[k], "step_s": v, "steps_s": [v] * 20} for k, v in (("graph", graph), ("eager", eager), ("named", named))]
    ratios = {k: {"value": v / eager, "step_s": v, "baseline_step_s": eager, "row": labels[r], "baseline": labels["eager"]}
              for k, r, v in (("graph_vs_eager", "graph", graph), ("named_vs_eager", "named", named))}
    conversion = {"first_s": 2.5, "hit_s": 0.0003, "pserver_build_s": 0.004, "traced": 1, "hits": 1, "rule_bytes": 9400, "nodes": {"first": 22, "step": 19}}
    return {"config": {"params": 10_000_000, "blocks": 10, "steps": 20}, "update": rows, "conversion": conversion, "ratios": ratios, "max_diff": 1e-6}


FAKES = {"transport": transport_json, "master": master_json, "checkpoint": checkpoint_json, "end-to-end": e2e_json, "scale": scale_json,
         "elastic": elastic_json, "replicas": replicas_json, "online": online_json, "sparse": sparse_json, "pipeline": pipeline_json,
         "graph": graph_json}
MACHINE = {"cpu_count": 2, "cpu_model": "Fake CPU 9000", "memory_gib": 7.5, "python": "3.11.7", "torch": "2.13.0", "etcd": "etcd Version: 3.4.23"}


def ran(*reports):
    return [{"ok": True, "seconds": 1.0, "returncode": 0, "report": r, "stderr_tail": ""} for r in reports]


def results_of(suite_runs, runs=2):
    return rp.assemble(
        command="pdps bench --check", machine=MACHINE, quick=False, runs=runs, suite_runs=suite_runs,
        commands={k: f"python bench/{SUITE_SPECS[k].program} --json" for k in suite_runs},
        started="2026-01-01T00:00:00+00:00", finished="2026-01-01T00:10:00+00:00",
    )


def by_id(verdicts):
    return {v["id"]: v for v in verdicts}


# --- verdicts -----------------------------------------------------------------------------


def test_every_target_reads_its_figure_from_its_suite_json():
    for t in tg.TARGETS:
        report = FAKES[t.suite]()
        assert isinstance(t.figure(report), float), t.id
        assert t.detail(report)
    assert {t.suite for t in tg.TARGETS} == set(tg.SUITES)


def test_met_when_every_run_meets_the_threshold_missed_otherwise():
    verdicts = by_id(tg.evaluate({"transport": [transport_json(grpc=3.0), transport_json(grpc=2.0)]}))
    # run 2: 2.0 / 3.2 = 0.625 < 0.75, though run 1 meets it
    assert verdicts["transport.grpc_vs_tcp"]["status"] == tg.MISSED
    assert verdicts["transport.grpc_vs_tcp"]["values"] == pytest.approx([3.0 / 3.2, 2.0 / 3.2])
    assert verdicts["transport.grpc_vs_torch_rpc"]["status"] == tg.MET
    assert set(verdicts) == {
        "transport.grpc_vs_tcp", "transport.grpc_vs_torch_rpc", "stability.transport.grpc_vs_tcp", "stability.transport.grpc_vs_torch_rpc"
    }


def test_threshold_is_inclusive_and_absolute_targets_compare_the_figure():
    verdicts = by_id(tg.evaluate({"master": [master_json(etcd=5000.0), master_json(etcd=4999.0)]}))
    assert verdicts["master.etcd_rate"]["status"] == tg.MISSED
    assert verdicts["master.etcd_rate"]["values"] == [5000.0, 4999.0]
    once = by_id(tg.evaluate({"master": [master_json(etcd=5000.0)]}))
    assert once["master.etcd_rate"]["status"] == tg.MET
    assert "stability.master.etcd_rate" not in once  # not a ratio: no stability verdict


def test_stability_allows_15_percent_between_consecutive_runs():
    ok = by_id(tg.evaluate({"checkpoint": [checkpoint_json(save=1.0), checkpoint_json(save=0.85)]}))
    assert ok["stability.checkpoint.save"]["status"] == tg.MET
    assert ok["stability.checkpoint.save"]["values"] == [pytest.approx(0.15)]
    bad = by_id(tg.evaluate({"checkpoint": [checkpoint_json(save=1.0), checkpoint_json(save=0.84)]}))
    assert bad["stability.checkpoint.save"]["status"] == tg.MISSED
    assert bad["checkpoint.save"]["status"] == tg.MET  # both runs meet 0.8: only the stability is missed
    three = by_id(tg.evaluate({"checkpoint": [checkpoint_json(save=1.0), checkpoint_json(save=0.9), checkpoint_json(save=1.2)]}))
    assert three["stability.checkpoint.save"]["values"] == [pytest.approx(0.25)]  # the worst consecutive pair


def test_spread_is_relative_to_the_larger_value():
    assert tg.spread([2.0, 1.0]) == pytest.approx(0.5)
    assert tg.spread([1.0, 2.0]) == pytest.approx(0.5)
    assert tg.spread([1.0]) == 0.0


def test_one_run_cannot_check_stability():
    verdicts = by_id(tg.evaluate({"checkpoint": [checkpoint_json()]}))
    assert verdicts["stability.checkpoint.save"]["status"] == tg.NOT_CHECKED
    assert verdicts["checkpoint.save"]["status"] == tg.MET
    assert not tg.failing(list(verdicts.values()))


def test_a_renamed_key_is_an_error_naming_it():
    renamed = master_json()
    for row in renamed["results"]:
        row["pdps"] = {"rate": row["pdps"].pop("per_s")}
    verdicts = by_id(tg.evaluate({"master": [renamed, renamed]}))
    v = verdicts["master.etcd_rate"]
    assert v["status"] == tg.ERROR
    assert "'per_s'" in v["errors"][0] and "master" in v["errors"][0]
    assert verdicts["stability.master.etcd_vs_snapshot"]["status"] == tg.MET  # the ratio key is still there
    assert tg.failing([v]) == [v]


def test_master_figures_are_read_from_the_alternative_keys():
    report = master_json(etcd=8000.0, base=40.0)
    for row in report["results"]:
        row["pdps"] = {"transitions_per_s": row["pdps"]["per_s"]}
        del row["ratio_transitions_per_s"]
    verdicts = by_id(tg.evaluate({"master": [report]}))
    assert verdicts["master.etcd_rate"]["values"] == [8000.0]
    assert verdicts["master.etcd_vs_snapshot"]["values"] == [pytest.approx(200.0)]


def test_end_to_end_targets_use_the_async_1x2_rows_of_each_transport():
    verdicts = by_id(tg.evaluate({"end-to-end": [e2e_json(grpc=0.45, inproc=0.95)] * 2}))
    assert verdicts["e2e.grpc"]["values"] == [0.45, 0.45] and verdicts["e2e.grpc"]["status"] == tg.MISSED
    assert verdicts["e2e.inproc"]["status"] == tg.MET
    no_grpc = e2e_json()
    no_grpc["runs"] = [r for r in no_grpc["runs"] if r["transport"] != "grpc"]
    v = by_id(tg.evaluate({"end-to-end": [no_grpc]}))["e2e.grpc"]
    assert v["status"] == tg.ERROR and "'transport': 'grpc'" in v["errors"][0]


def test_a_failed_run_leaves_its_targets_not_run():
    verdicts = by_id(tg.evaluate({"checkpoint": [checkpoint_json(), None]}))
    assert verdicts["checkpoint.save"]["status"] == tg.NOT_RUN
    assert verdicts["stability.checkpoint.save"]["status"] == tg.NOT_RUN
    assert tg.failing([verdicts["checkpoint.save"]])


def test_replicas_targets_compare_failover_with_the_lease_ttl_and_the_rollback():
    verdicts = by_id(tg.evaluate({"replicas": [replicas_json(r1=3.3, r2=2.5), replicas_json(r1=3.0, r2=2.6)]}))
    beyond = verdicts["replicas.resumed_beyond_ttl"]
    assert beyond["values"] == [pytest.approx(0.5), pytest.approx(0.6)] and beyond["unit"] == "s" and beyond["status"] == tg.MISSED
    assert "stability.replicas.resumed_beyond_ttl" not in verdicts  # an absolute figure
    assert verdicts["replicas.resumed_r1_vs_r2"]["values"] == [pytest.approx(3.3 / 2.5), pytest.approx(3.0 / 2.6)]
    assert verdicts["replicas.resumed_r1_vs_r2"]["status"] == tg.MISSED  # 2x wanted
    assert verdicts["replicas.sync_r2_vs_r1"]["status"] == tg.MET
    line = next(line for line in rp.check_lines(results_of({"replicas": ran(replicas_json(r2=2.5))})) if " replicas.resumed_beyond_ttl " in line)
    assert line.startswith("MET ") and "0.5 s  (threshold <= 0.5 s)" in line  # a threshold below 1 is not rounded to 0


def test_a_configuration_the_suite_could_not_run_leaves_its_target_not_run_with_the_reason():
    refused = "ConfigError: job 'x' asks for replicas = 2 in async mode"
    verdicts = by_id(tg.evaluate({"replicas": [replicas_json(async_refused=refused)] * 2}))
    v = verdicts["replicas.async_r2_vs_r1"]
    assert v["status"] == tg.NOT_RUN and v["values"] == [None, None] and not v["errors"]
    assert refused in v["not_run"][0] and tg.failing([v]) == [v]
    assert verdicts["stability.replicas.async_r2_vs_r1"]["status"] == tg.NOT_RUN
    assert verdicts["replicas.sync_r2_vs_r1"]["status"] == tg.MET  # the other rows are judged as usual
    results = results_of({"replicas": ran(replicas_json(async_refused=refused), replicas_json(async_refused=refused))})
    line = next(line for line in rp.check_lines(results) if " replicas.async_r2_vs_r1 " in line)
    assert line.startswith("NOT RUN ") and refused in line
    assert f"- replicas suite: async_r2_vs_r1 not run: async, replicas = 2: {refused}" in rp.render_markdown(results, {})
    names = [name for name, _, _ in tg.suite_figures("replicas", replicas_json(async_refused=refused))]
    assert "async, replicas = 1" in names and "async, replicas = 2" not in names and "async_r2_vs_r1" not in names


def test_the_online_target_is_the_job_time_with_speculation_over_without_at_most_0_6():
    verdicts = by_id(tg.evaluate({"online": [online_json(on=6.0, off=10.0), online_json(on=6.1, off=10.0)]}))
    v = verdicts["online.speculation_on_vs_off"]
    assert v["values"] == [pytest.approx(0.6), pytest.approx(0.61)] and v["comparison"] == "<=" and v["status"] == tg.MISSED
    assert "speculation on 6.10 s, off 10.00 s" in v["details"][1] and "6,400 and 6,400 of 6,400" in v["details"][1]
    assert verdicts["stability.online.speculation_on_vs_off"]["status"] == tg.MET
    assert {x["id"] for x in verdicts.values()} == {"online.speculation_on_vs_off", "stability.online.speculation_on_vs_off"}  # no target on the stream
    figures = {name: (value, unit) for name, value, unit in tg.suite_figures("online", online_json())}
    assert figures["Redis stream / Parquet, records/s"] == (pytest.approx(0.375), "x")
    assert figures["speculation on: records trained exactly once"] == (6400.0, "records")
    assert figures["speculation off: job time"] == (10.0, "s")


def test_the_sparse_targets_are_rows_per_s_against_their_baselines_and_rss_against_the_raw_bytes():
    verdicts = by_id(tg.evaluate({"sparse": [sparse_json(grpc=1.9e6), sparse_json(grpc=2.1e6, rss_per_row=(300.0, 290.0, 800.0, 550.0))]}))
    assert verdicts["sparse.grpc_vs_tcp"]["values"] == [pytest.approx(0.475), pytest.approx(0.525)]
    assert verdicts["sparse.grpc_vs_tcp"]["status"] == tg.MISSED  # run 1 is short of 0.5
    assert verdicts["sparse.inproc_vs_local"]["status"] == tg.MET and verdicts["sparse.inproc_vs_local"]["values"] == [pytest.approx(0.9)] * 2
    memory = verdicts["sparse.memory"]
    assert memory["comparison"] == "<=" and memory["values"] == [pytest.approx(300 / 256), pytest.approx(800 / 512)]
    assert memory["status"] == tg.MISSED and "Adagrad pserver 0, 800 B of RSS a row against 512 B" in memory["details"][1]
    assert "grpc (pdps): 2,100,000 rows/s; raw TCP echo: 4,000,000 rows/s" in verdicts["sparse.grpc_vs_tcp"]["details"][1]
    assert {v for v in verdicts if not v.startswith("stability.")} == {"sparse.grpc_vs_tcp", "sparse.inproc_vs_local", "sparse.memory"}  # no CTR target
    figures = {name: (value, unit) for name, value, unit in tg.suite_figures("sparse", sparse_json())}
    assert figures["raw TCP echo"] == (4.0e6, "rows/s") and figures["Adagrad, pserver 1: RSS a row"] == (550.0, "B")
    assert figures["SGD, pserver 0: row store a row"] == (296.0, "B")
    assert figures["CTR pdps / torch, samples/s"] == (pytest.approx(0.25), "x") and figures["CTR: torch, single process"] == (12_000.0, "samples/s")
    assert "CTR: torch, single process" not in {name for name, _, _ in tg.suite_figures("sparse", sparse_json(ctr=False))}


def test_the_pipeline_targets_are_the_bubbles_within_10_percent_of_theory_and_p2p_against_raw_tcp():
    theory = 3 / 11
    verdicts = by_id(tg.evaluate({"pipeline": [pipeline_json(gpipe=1.1 * theory), pipeline_json(gpipe=0.31, grpc=(1.4, 1.8))]}))
    gpipe = verdicts["pipeline.bubble_gpipe"]
    assert gpipe["comparison"] == "<=" and gpipe["unit"] == "fraction" and gpipe["values"] == [pytest.approx(0.1), pytest.approx(0.31 / theory - 1)]
    assert gpipe["status"] == tg.MISSED  # run 1 is at 10% exactly (met), run 2 at 13.7%
    assert "GPipe, 4 stages x 8 microbatches: measured bubble 0.3100; theory (P-1)/(M+P-1) 0.2727" in gpipe["details"][1]
    assert verdicts["pipeline.bubble_1f1b"]["status"] == tg.MET and verdicts["pipeline.bubble_1f1b"]["values"] == [pytest.approx(0.28 / theory - 1)] * 2
    p2p = verdicts["pipeline.p2p_grpc_vs_tcp"]
    assert p2p["values"] == [pytest.approx(0.8), pytest.approx(0.7)] and p2p["status"] == tg.MISSED  # the worst size of each run
    assert "4 MiB activations: p2p over gRPC 1.40 GB/s; raw TCP echo 2.00 GB/s" in p2p["details"][1]
    assert {v for v in verdicts if v.startswith("stability.")} == {"stability.pipeline.p2p_grpc_vs_tcp"}  # the relative errors are no ratios
    figures = {name: (value, unit) for name, value, unit in tg.suite_figures("pipeline", pipeline_json())}
    assert figures["GPipe: bubble, theory"] == (pytest.approx(theory), "fraction") and figures["1F1B: bubble, measured"] == (0.28, "fraction")
    assert figures["GPipe: peak activations held, stage 3"] == (8.0, "microbatches") and figures["1F1B: peak activations held, stage 0"] == (4.0, "microbatches")
    assert figures["p2p over gRPC (2 processes), 16 MiB"] == (1.8, "GB/s") and figures["raw TCP echo (2 processes), 4 MiB"] == (2.0, "GB/s")
    assert figures["p2p over gRPC / raw TCP, GB/s, worst size"] == (pytest.approx(0.8), "x")
    assert figures["1F1B: |measured - theory| / theory"] == (pytest.approx(0.28 / theory - 1), "fraction")
    assert "| GPipe: bubble, measured | fraction | 0.2900 | 0.2900 |" in rp.render_markdown(results_of({"pipeline": ran(pipeline_json(), pipeline_json())}), {})


def test_the_graph_target_is_the_graph_run_adam_step_over_eager_torch_at_most_1_5():
    verdicts = by_id(tg.evaluate({"graph": [graph_json(graph=0.7), graph_json(graph=0.8)]}))
    v = verdicts["graph.update_vs_eager"]
    assert v["values"] == [pytest.approx(1.4), pytest.approx(1.6)] and v["comparison"] == "<=" and v["status"] == tg.MISSED
    assert "graph rule (GraphOptimizer): 800.0 ms a step; eager torch.optim.Adam: 500.0 ms" in v["details"][1]
    assert {x for x in verdicts if not x.startswith("stability.")} == {"graph.update_vs_eager"}  # no target on the named route
    figures = {name: (value, unit) for name, value, unit in tg.suite_figures("graph", graph_json())}
    assert figures["eager torch.optim.Adam"] == (pytest.approx(500.0), "ms") and figures["cache hits"] == (1.0, "conversions")
    assert figures["graph rule / eager Adam, step"] == (pytest.approx(1.1), "x") and figures["conversion, first (traced)"] == (2.5, "s")


def test_suites_not_run_have_no_verdicts():
    assert {v["suite"] for v in tg.evaluate({"checkpoint": [checkpoint_json()]})} == {"checkpoint"}


# --- exit status and --check lines ---------------------------------------------------------


def test_check_fails_on_a_missed_target_and_plain_runs_do_not():
    met = results_of({"checkpoint": ran(checkpoint_json(), checkpoint_json())})
    assert rp.exit_code(met, check=True) == 0
    missed = results_of({"checkpoint": ran(checkpoint_json(warm=0.5), checkpoint_json(warm=0.5))})
    assert rp.exit_code(missed, check=True) == 1
    assert rp.exit_code(missed, check=False) == 0
    unstable = results_of({"checkpoint": ran(checkpoint_json(cold=2.0), checkpoint_json(cold=1.0))})
    assert rp.exit_code(unstable, check=True) == 1


def test_a_failed_suite_fails_with_or_without_check():
    failed = {"ok": False, "seconds": 3.0, "returncode": 1, "error": "checkpoint.py exited with status 1", "stderr_tail": "Traceback\nOSError: disk full\n"}
    results = results_of({"checkpoint": [*ran(checkpoint_json()), failed]})
    assert rp.exit_code(results, check=False) == 1
    assert rp.exit_code(results, check=True) == 1
    text = "\n".join(rp.check_lines(results))
    assert "FAILED      suite checkpoint, run 2: checkpoint.py exited with status 1" in text
    assert "OSError: disk full" in text


def test_an_at_most_target_is_met_up_to_its_threshold_and_its_best_run_is_the_lowest():
    verdicts = by_id(tg.evaluate({"scale": [scale_json(step_ops=12.0, memory=1024.0), scale_json(step_ops=30.0, memory=1025.0)]}))
    ops = verdicts["scale.step_ops_trainers"]
    assert ops["status"] == tg.MISSED and ops["comparison"] == "<=" and ops["best"] == 12.0
    assert verdicts["scale.master_memory"]["status"] == tg.MISSED
    once = by_id(tg.evaluate({"scale": [scale_json(step_ops=12.0, memory=1024.0)]}))
    assert once["scale.step_ops_trainers"]["status"] == tg.MET and once["scale.master_memory"]["status"] == tg.MET
    assert "stability.scale.master_memory" not in once  # not a ratio


def test_markdown_shows_every_run_of_a_missed_at_most_target_and_its_threshold():
    results = results_of({"scale": ran(scale_json(step_ops=30.0), scale_json(step_ops=31.0))})
    text = rp.render_markdown(results, {})
    assert "| <= 12x | 30.000x | 31.000x | **MISSED** |" in text
    assert "### MISSED: `scale.step_ops_trainers`" in text
    assert "Measured: 30.000x at best (best run), threshold <= 12x." in text
    assert "- run 2: store_ops_per_step at trainers 10 -> 100 (size x10.0): 31.00x" in text
    assert "| <= 1,024 B/task | 600 B/task | 600 B/task | **MET** |" in text


def test_a_target_missed_by_one_run_of_two_names_both_runs_figures():
    results = results_of({"scale": ran(scale_json(step_ops=11.0), scale_json(step_ops=13.0))})
    assert by_id(tg.evaluate({"scale": [scale_json(step_ops=11.0), scale_json(step_ops=13.0)]}))["scale.step_ops_trainers"]["status"] == tg.MISSED
    text = rp.render_markdown(results, {})
    assert "Measured: 11.000x at best (best run), 13.000x at worst; every run must meet the threshold, <= 12x." in text


def test_check_lines_one_per_target_with_figures_and_threshold():
    results = results_of({"checkpoint": ran(checkpoint_json(save=0.9, warm=0.5), checkpoint_json(save=0.92, warm=0.5))})
    lines = rp.check_lines(results)
    assert len(lines) == len(results["targets"]) == 6
    save = next(line for line in lines if " checkpoint.save " in line)
    assert save.startswith("MET ") and "0.900x, 0.920x" in save and "(threshold >= 0.8x)" in save
    warm = next(line for line in lines if " checkpoint.restore_warm " in line)
    assert warm.startswith("MISSED ")


# --- the results JSON ---------------------------------------------------------------------


def test_results_json_holds_machine_command_config_runs_and_targets(tmp_path):
    results = results_of({"end-to-end": ran(e2e_json(), e2e_json(grpc=0.55)), "master": ran(master_json(), master_json())})
    path = rp.write_json(results, tmp_path / "out" / "results.json")
    back = json.loads(path.read_text())
    assert back["command"] == "pdps bench --check"
    assert back["machine"]["cpu_model"] == "Fake CPU 9000"
    e2e = back["suites"]["end-to-end"]
    assert e2e["config"]["model"] == "784-2048-2048-2048-10"  # the config block the suite reports
    assert e2e["args"] == list(SUITE_SPECS["end-to-end"].full)
    assert [r["run"] for r in e2e["runs"]] == [1, 2]
    assert {"name": "grpc async 1x2", "value": 550.0, "unit": "samples/s"} in e2e["runs"][1]["figures"]
    assert e2e["runs"][0]["breakdown_ms"]["inproc async 1x2"]["serialize"] == 2.5
    assert back["suites"]["master"]["config"] == {"tasks": 100_000, "clients": 4}  # top-level settings, no figures
    assert {v["id"] for v in back["targets"]} >= {"e2e.grpc", "e2e.inproc", "master.etcd_rate", "stability.e2e.grpc"}
    assert by_id(back["targets"])["stability.e2e.grpc"]["values"] == [pytest.approx(0.05 / 0.6)]


# --- docs/performance.md and the plots ------------------------------------------------------


def full_results(**checkpoint):
    return results_of({
        "transport": ran(transport_json(), transport_json()),
        "master": ran(master_json(), master_json()),
        "checkpoint": ran(checkpoint_json(**checkpoint), checkpoint_json(**checkpoint)),
        "end-to-end": ran(e2e_json(), e2e_json()),
        "scale": ran(scale_json(), scale_json()),
        "elastic": ran(elastic_json(), elastic_json()),
        "replicas": ran(replicas_json(), replicas_json()),
        "online": ran(online_json(), online_json()),
        "sparse": ran(sparse_json(), sparse_json()),
        "pipeline": ran(pipeline_json(), pipeline_json()),


        "graph": ran(graph_json(), graph_json()),
    })


def test_markdown_has_header_machine_tables_breakdown_and_targets():
    text = rp.render_markdown(full_results(), {})
    assert "Generated by `pdps bench`: do not edit by hand." in text
    assert "- Command: `pdps bench --check`" in text
    assert "Fake CPU 9000 x 2" in text and "7.5 GiB" in text and "etcd Version: 3.4.23" in text
    for suite in tg.SUITES:
        assert f"## {suite}\n" in text
        assert f"![{suite}](performance/{suite}.png)" in text
    assert "| figure | unit | run 1 | run 2 |" in text
    assert "| grpc_vs_tcp" not in text and "| grpc / tcp | x | 0.938 | 0.938 |" in text
    assert "| configuration | run | compute | serialize | network | update | barrier |" in text
    assert "| inproc async 1x2 | 1 | 30.00 | 2.50 | 4.00 | 3.00 | 0.00 |" in text
    assert "| target | threshold | run 1 | run 2 | verdict |" in text
    assert "| `master.etcd_rate`: master transitions/s on etcd with 100k tasks | >= 5,000 transitions/s | 6,000 transitions/s | 6,000 transitions/s | **MET** |" in text
    assert "| `stability.checkpoint.save`: consecutive runs agree on checkpoint.save (\\|a-b\\|/max(a,b)) | <= 15% |  | 0.0% | **MET** |" in text
    assert "### MISSED" not in text


def test_markdown_shows_the_note_and_ceiling_under_a_missed_target_only(tmp_path):
    notes_file = tmp_path / "notes.toml"
    notes_file.write_text(
        '"checkpoint.restore_warm" = """\nThe warm read is bound by **page faults** of the fresh buffer.\n"""\n'
        '"checkpoint.save" = "Saving is bound by fsync."\n'
    )
    notes = rp.load_notes(notes_file)
    text = rp.render_markdown(full_results(warm=0.5), notes)
    assert "### MISSED: `checkpoint.restore_warm`" in text
    assert "The warm read is bound by **page faults** of the fresh buffer." in text
    assert "Measured: 0.500x at best (best run), threshold >= 0.8x." in text
    assert "read_part (crc32 inline) *, warm: 4.50 GB/s; raw read, warm: 9.00 GB/s" in text
    assert "Saving is bound by fsync." not in text  # met: its note is left out
    bare = rp.render_markdown(full_results(warm=0.5), {})
    assert "_No explanation yet: add one to `bench/notes.toml`" in bare


def test_quick_mode_is_flagged_in_the_doc():
    results = full_results()
    results["quick"] = True
    assert "**Quick mode**" in rp.render_markdown(results, {})
    assert "**Quick mode**" not in rp.render_markdown(full_results(), {})


def test_notes_with_unknown_ids_or_bad_toml_are_refused(tmp_path):
    path = tmp_path / "notes.toml"
    path.write_text('"checkpoint.sav" = "typo"\n')
    with pytest.raises(tg.BenchError, match="unknown ids: \\['checkpoint.sav'\\]"):
        rp.load_notes(path)
    path.write_text("not = [toml\n")
    with pytest.raises(tg.BenchError, match="not valid TOML"):
        rp.load_notes(path)
    assert rp.load_notes(tmp_path / "absent.toml") == {}


def test_the_checked_in_notes_file_is_valid():
    assert rp.load_notes(REPO / "bench" / "notes.toml")


def test_write_docs_draws_valid_pngs_and_the_doc(tmp_path):
    pytest.importorskip("matplotlib")
    results = full_results()
    written = rp.write_docs(results, tmp_path, {}, results_link="bench-results/results.json")
    for suite in tg.SUITES:
        png = tmp_path / "docs" / "performance" / f"{suite}.png"
        assert png in written
        assert png.read_bytes()[:8] == PNG and png.stat().st_size > 5000
        assert results["plots"][suite] == f"docs/performance/{suite}.png"
    doc = (tmp_path / "docs" / "performance.md").read_text()
    assert doc == rp.render_markdown(results, {}, results_link="bench-results/results.json")


# --- the scale suite's curves ----------------------------------------------------------------


def scale_sizes_json():
    """Three sizes on each axis: ops and messages linear in the trainers, bytes quadratic,
    conflicts zero; per-task costs flat, master memory growing as the square root of the tasks."""
    steps = [
        {"trainers": t, "pservers": p, "store_ops_per_step": 5.0 * t, "writes_per_step": float(t + 1),
         "bytes_per_step": 3.0 * t * t * p, "messages_per_step": 2.0 * t * p, "conflicts_per_step": 0.0, "extra": {"a": 1}}
        for t in (10, 100, 1000) for p in (4, 16, 64)
    ]
    steps.append({"trainers": 1000, "pservers": 256, "store_ops_per_step": 9000.0})  # a row with one figure, one size
    tasks = [{"tasks": n, "store_ops_per_task": 3.0, "writes_per_task": 4.0, "bytes_written_per_task": 527.0,
              "master_bytes_per_task": 0.5 * n ** 0.5} for n in (10_000, 100_000, 1_000_000)]
    return {**scale_json(), "steps": steps, "tasks": tasks}


def series(points, expect):
    return curves.Series("cost vs size", "cost", "cost", "size", expect, tuple(points))


def test_slopes_tell_linear_flat_and_quadratic_apart():
    sizes = (10, 100, 1000)
    linear = curves.judge(series([(n, 7.0 * n) for n in sizes], curves.LINEAR))
    quadratic = curves.judge(series([(n, 7.0 * n * n) for n in sizes], curves.LINEAR))
    flat = curves.judge(series([(n, 300.0) for n in sizes], curves.FLAT))
    growing = curves.judge(series([(n, 3.0 * n ** 0.5) for n in sizes], curves.FLAT))
    assert (linear.slope, linear.shape, linear.ok) == (pytest.approx(1.0), "linear", True)
    assert (quadratic.slope, quadratic.shape, quadratic.ok) == (pytest.approx(2.0), "superlinear", False)
    assert (flat.slope, flat.shape, flat.ok) == (pytest.approx(0.0), "flat", True)
    assert (growing.slope, growing.shape, growing.ok) == (pytest.approx(0.5), "not flat", False)
    assert linear.line == "cost vs size: slope 1.00 overall, 1.00 between the two largest sizes (linear)"
    assert quadratic.line == "cost vs size: slope 2.00 overall, 2.00 between the two largest sizes (superlinear)"
    assert curves.judge(series([(10, 300.0), (100, 299.9)], curves.FLAT)).line == "cost vs size: slope 0.00 (flat)"


def test_a_cost_that_turns_superlinear_at_the_largest_size_is_named():
    late = curves.judge(series([(10, 1.0), (100, 10.0), (1000, 180.0)], curves.LINEAR))
    assert late.slope < curves.SUPERLINEAR_ABOVE < late.tail
    assert (late.shape, late.ok) == ("superlinear", False)
    two = curves.judge(series([(10, 1.0), (100, 12.0)], curves.LINEAR))
    assert (two.tail, two.shape, two.ok) == (None, "linear", True)


def test_zeros_are_left_out_of_the_slope_and_named():
    zero = curves.judge(series([(10, 0.0), (100, 0.0)], curves.LINEAR))
    assert (zero.slope, zero.ok, zero.shape) == (None, None, "zero at every size measured (not plotted)")
    once = curves.judge(series([(10, 0.0), (100, 3.0)], curves.LINEAR))
    assert (once.slope, once.ok, once.shape) == (None, None, "positive at 1 of 2 sizes only: no slope")
    later = curves.judge(series([(10, 0.0), (100, 3.0), (1000, 30.0)], curves.LINEAR))
    assert later.slope == pytest.approx(1.0) and later.line.endswith("; zero at size 10 (not plotted) (linear)")


def test_scale_panels_follow_the_report_rows_whatever_the_sizes():
    panels = {p.title: p for p in curves.scale_panels(scale_sizes_json())}
    assert list(panels) == [
        "store ops per step vs trainers", "keys written per step vs trainers", "bytes per step (written + read) vs trainers",
        "messages per step vs trainers", "conflicts per step vs trainers", "cost per step vs pservers, 1,000 trainers",
        "master's store costs per task vs tasks", "master memory per task vs tasks",
    ]
    ops = panels["store ops per step vs trainers"].series
    assert [s.legend for s in ops] == ["4 pservers", "16 pservers", "64 pservers", "256 pservers"]
    assert ops[0].points == ((10, 50.0), (100, 500.0), (1000, 5000.0))
    assert [s.figure for s in panels["cost per step vs pservers, 1,000 trainers"].series] == [f for _, f in curves.STEP_FIGURES]
    assert curves.scale_panels({"steps": [], "tasks": []}) == []


def test_the_doc_shows_the_curves_and_names_each_cost_that_is_not_flat_or_linear(tmp_path):
    pytest.importorskip("matplotlib")
    results = results_of({"scale": ran(scale_json(), scale_sizes_json())})
    written = rp.write_docs(results, tmp_path, {})
    png = tmp_path / "docs" / "performance" / "scale-curves.png"
    assert png in written and results["plots"]["scale-curves"] == "docs/performance/scale-curves.png"
    assert png.read_bytes()[:8] == PNG and png.stat().st_size > 5000
    doc = (tmp_path / "docs" / "performance.md").read_text()
    assert "![scale](performance/scale.png)" in doc and "![scale curves](performance/scale-curves.png)" in doc
    assert "(run 2, log-log)" in doc
    assert "- store ops per step vs trainers, 4 pservers: slope 1.00 overall, 1.00 between the two largest sizes (linear)" in doc
    assert "- keys written per step vs pservers, 1,000 trainers: slope 0.00 overall, 0.00 between the two largest sizes (flat)" in doc
    assert "- conflicts per step vs trainers, 4 pservers: zero at every size measured (not plotted)" in doc
    assert "- store ops per step vs trainers, 256 pservers: measured at one size only: no slope" in doc
    assert "- store ops per task vs tasks: slope 0.00 overall, 0.00 between the two largest sizes (flat)" in doc
    named = doc.split("**Not flat or linear in its size:** ", 1)[1].split("\n", 1)[0]
    assert named.split("; ") == [
        "bytes per step (written + read) vs trainers, 4 pservers (superlinear)",
        "bytes per step (written + read) vs trainers, 16 pservers (superlinear)",
        "bytes per step (written + read) vs trainers, 64 pservers (superlinear)",
        "master memory per task vs tasks (not flat).",
    ]


def test_a_scale_run_with_flat_and_linear_costs_says_so():
    report = scale_sizes_json()
    for r in report["steps"]:
        r["bytes_per_step"] = 100.0 * r["trainers"]
    for r in report["tasks"]:
        r["master_bytes_per_task"] = 400.0
    text = rp.render_markdown(results_of({"scale": ran(report)}, runs=1), {})
    assert "Every cost with a slope is flat or linear in its size." in text and "Not flat or linear" not in text


# --- locating bench/ and running a suite ------------------------------------------------------


def test_a_missing_bench_directory_is_a_clear_error(tmp_path):
    (tmp_path / "site-packages" / "pdps").mkdir(parents=True)
    fake = tmp_path / "site-packages" / "pdps" / "__init__.py"
    with pytest.raises(tg.BenchError, match="source checkout.*no bench/ directory at .*site-packages/bench.*pip install -e"):
        bench_dir(str(fake))
    with pytest.raises(tg.BenchError, match="no bench/ directory"):
        run_bench(suites=["checkpoint"], runs=1, docs=False, package_file=str(fake), out_dir=tmp_path / "out")
    assert bench_dir() == REPO / "bench"


def test_malformed_suite_json_is_a_clear_error():
    with pytest.raises(tg.SuiteOutputError, match="last line of its stdout is not JSON.*'total 3 s'"):
        parse_json_line("table\n{\"a\": 1}\ntotal 3 s\n", "checkpoint.py")
    with pytest.raises(tg.SuiteOutputError, match="printed nothing"):
        parse_json_line("\n", "checkpoint.py")
    with pytest.raises(tg.SuiteOutputError, match="not an object"):
        parse_json_line("[1, 2]\n", "checkpoint.py")
    assert parse_json_line("a table\n{\"ratios\": []}\n\n", "x") == {"ratios": []}


def fake_checkout(tmp_path: Path, programs: dict[str, str]) -> Path:
    """A checkout with pdps/__init__.py and bench/ holding machine.py and the given programs."""
    (tmp_path / "pdps").mkdir()
    (tmp_path / "pdps" / "__init__.py").write_text("")
    (tmp_path / "bench").mkdir()
    shutil.copy(REPO / "bench" / "machine.py", tmp_path / "bench" / "machine.py")
    for name, body in programs.items():
        (tmp_path / "bench" / name).write_text(textwrap.dedent(body))
    return tmp_path


def printing(report) -> str:
    return f"import json, sys\nprint('a table', flush=True)\nprint('progress', file=sys.stderr)\nprint(json.dumps({report!r}))\n"


def test_run_suite_reads_the_last_line_or_the_json_file_and_reports_failures(tmp_path):
    writing = (
        "import json, sys\nargs = sys.argv[1:]\npath = args[args.index('--json') + 1]\n"
        f"open(path, 'w').write(json.dumps({master_json()!r}))\n"
    )
    root = fake_checkout(tmp_path, {
        "checkpoint.py": printing(checkpoint_json()),
        "master_transitions.py": writing,
        "transport.py": "import sys\nprint('no json here')\nprint('Traceback: boom', file=sys.stderr)\nsys.exit(3)\n",
        "end_to_end.py": "print('a table')\nprint('{not json')\n",
    })
    echoed: list[str] = []
    kw = {"quick": True, "echo": echoed.append, "timeout": 60}
    ok = run_suite(SUITE_SPECS["checkpoint"], root / "bench", label="checkpoint 1/1", **kw)
    assert ok["ok"] and ok["report"] == checkpoint_json()
    assert "[checkpoint 1/1] a table" in echoed and "[checkpoint 1/1] progress" in echoed
    assert not any(line.startswith("[checkpoint 1/1] {") for line in echoed)  # the JSON line is not echoed
    assert run_suite(SUITE_SPECS["master"], root / "bench", label="m", **kw)["report"] == master_json()
    bad = run_suite(SUITE_SPECS["transport"], root / "bench", label="t", **kw)
    assert not bad["ok"] and bad["error"] == "transport.py exited with status 3" and "boom" in bad["stderr_tail"]
    garbled = run_suite(SUITE_SPECS["end-to-end"], root / "bench", label="e", **kw)
    assert not garbled["ok"] and "end_to_end.py: the last line of its stdout is not JSON" in garbled["error"]


def test_run_bench_writes_results_and_check_sets_the_exit_status(tmp_path, capsys):
    root = fake_checkout(tmp_path, {"checkpoint.py": printing(checkpoint_json(warm=0.5))})
    out = tmp_path / "out"
    args = dict(suites=["checkpoint"], runs=2, docs=False, out_dir=out, package_file=str(root / "pdps" / "__init__.py"), echo=lambda s: None)
    assert run_bench(check=False, argv=["bench", "--suite", "checkpoint"], **args) == 0
    assert run_bench(check=True, argv=["bench", "--suite", "checkpoint", "--check"], **args) == 1
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("MISSED") and "checkpoint.restore_warm" in line for line in lines)
    results = json.loads((out / "results.json").read_text())
    assert results["command"] == "pdps bench --suite checkpoint --check"
    assert results["machine"]["cpu_count"] and "memory_gib" in results["machine"]
    assert [r["ok"] for r in results["suites"]["checkpoint"]["runs"]] == [True, True]
    assert results["suites"]["checkpoint"]["command"].startswith("python bench/checkpoint.py --mib 1024")
    assert not (root / "docs").exists()  # --no-docs


def test_run_bench_rejects_unknown_suites_before_running(tmp_path):
    with pytest.raises(tg.BenchError, match="unknown suite"):
        run_bench(suites=["disk"], docs=False, out_dir=tmp_path)


def test_import_pdps_does_not_import_matplotlib():
    import subprocess

    code = "import pdps, pdps.shell.cli, pdps.shell.benchmark.report, pdps.shell.benchmark.runner, sys; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


# --- bench/machine.py's finish: the report every program's --json ends with ----------------


def test_finish_orders_the_keys_prints_the_table_then_one_json_line(capsys):
    from bench.machine import finish

    tables: list[dict] = []
    report = finish("bench/x.py", ["--quick", "a b"], 0.0, {"rows": 3}, {"runs": [1], "ratios": {}},
                    packages=("pdps",), table=tables.append, as_json=True)  # fmt: skip
    assert list(report) == ["config", "runs", "ratios", "machine", "command", "total_s"]
    assert report["command"] == "python bench/x.py --quick 'a b'"
    assert report["config"] == {"rows": 3} and "pdps" in report["machine"] and report["total_s"] > 0
    assert tables == [report]
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == report

    quiet = finish("bench/x.py", [], 0.0, {}, {}, packages=(), table=lambda r: None, as_json=False, loadavg_start=(1.0, 2.0, 3.0))
    assert list(quiet) == ["config", "machine", "loadavg_start", "loadavg_end", "command", "total_s"]
    assert quiet["loadavg_start"] == [1.0, 2.0, 3.0] and len(quiet["loadavg_end"]) == 3
    assert capsys.readouterr().out == ""


# --- a run of some suites merges into the earlier results ------------------------------------


def earlier_of(suite_runs, runs=2, **settings):
    results = results_of(suite_runs, runs=runs)
    results.update(command="pdps bench --check", started="2025-12-01T00:00:00+00:00", finished="2025-12-01T00:30:00+00:00")
    results["machine"] = {**results["machine"], "git_commit": "0ld0ld0"}
    for s in results["suites"].values():
        s["measured"].update(command="pdps bench --check", finished="2025-12-01T00:30:00+00:00", git_commit="0ld0ld0")
    results.update(settings)
    return json.loads(json.dumps(results))  # as read back from the file


def test_merge_keeps_the_suites_not_run_replaces_those_run_and_judges_the_targets_over_all():
    earlier = earlier_of({"checkpoint": ran(checkpoint_json(warm=0.5), checkpoint_json(warm=0.5)),
                          "master": ran(master_json(), master_json()), "graph": ran(graph_json(), graph_json())})
    now = results_of({"graph": ran(graph_json(graph=0.9)), "pipeline": ran(pipeline_json())}, runs=1)
    merged, kept, dropped = rp.merge(now, earlier)
    assert kept == merged["suites_kept"] == ["master", "checkpoint"] and dropped == []
    assert list(merged["suites"]) == ["master", "checkpoint", "pipeline", "graph"]  # the suites' own order
    assert merged["suites"]["checkpoint"] == earlier["suites"]["checkpoint"]  # kept as it was
    assert merged["suites"]["graph"] == now["suites"]["graph"]  # run again: replaced
    verdicts = by_id(merged["targets"])
    assert verdicts["checkpoint.restore_warm"]["status"] == tg.MISSED  # a kept suite's verdicts stay
    assert verdicts["checkpoint.restore_warm"]["values"] == [0.5, 0.5]
    assert verdicts["graph.update_vs_eager"]["values"] == [pytest.approx(1.8)]  # the new graph figures, one run
    assert {v["suite"] for v in merged["targets"]} == {"master", "checkpoint", "pipeline", "graph"}
    assert merged["command"] == now["command"] and merged["suites_run"] == ["graph", "pipeline"]
    # the exit status and the --check lines judge the suites run now: the kept miss does not fail this run
    assert rp.exit_code(merged, check=True) == 1  # graph 1.8x > 1.5x
    assert all(" checkpoint." not in line and " master." not in line for line in rp.check_lines(merged))
    assert any(" graph.update_vs_eager " in line for line in rp.check_lines(merged))
    met, _, _ = rp.merge(results_of({"pipeline": ran(pipeline_json())}, runs=1), earlier)
    assert rp.exit_code(met, check=True) == 0 and tg.failing(met["targets"])


def test_a_kept_suite_of_results_older_than_measured_gets_the_earlier_runs_settings_and_a_gone_suite_is_dropped():
    earlier = earlier_of({"checkpoint": ran(checkpoint_json(), checkpoint_json())})
    del earlier["suites"]["checkpoint"]["measured"]
    earlier["suites"]["disk"] = dict(earlier["suites"]["checkpoint"])
    merged, kept, dropped = rp.merge(results_of({"master": ran(master_json())}, runs=1), earlier)
    assert kept == ["checkpoint"] and dropped == ["disk"] and "disk" not in merged["suites"]
    assert merged["suites"]["checkpoint"]["measured"] == {
        "command": "pdps bench --check", "started": "2025-12-01T00:00:00+00:00", "finished": "2025-12-01T00:30:00+00:00",
        "git_commit": "0ld0ld0", "runs": 2,
    }


def test_no_merge_into_unreadable_or_other_schema_results_nor_across_quick_or_machines(tmp_path):
    path = tmp_path / "results.json"
    assert rp.earlier_results(path) == (None, f"no earlier results at {path}")
    path.write_text("{not json")
    assert rp.earlier_results(path)[0] is None and "is not JSON" in rp.earlier_results(path)[1]
    good = earlier_of({"checkpoint": ran(checkpoint_json())}, runs=1)
    path.write_text(json.dumps({**good, "schema": 99}))
    assert rp.earlier_results(path) == (None, f"the earlier {path} has schema 99, not {rp.SCHEMA}")
    broken = json.loads(json.dumps(good))
    del broken["suites"]["checkpoint"]["runs"]
    path.write_text(json.dumps(broken))
    assert rp.earlier_results(path) == (None, f"the earlier {path} is malformed: suite 'checkpoint' has no 'runs' list")
    path.write_text(json.dumps(good))
    assert rp.earlier_results(path) == (good, "")

    now = results_of({"master": ran(master_json())}, runs=1)
    assert rp.why_not_merge(now, good) is None
    assert "are full runs and this is --quick: their figures are not comparable" in rp.why_not_merge({**now, "quick": True}, good)
    other = {**now, "machine": {**MACHINE, "cpu_model": "Other CPU"}}
    assert rp.why_not_merge(other, good) == "the earlier results come from another machine (cpu_model 'Other CPU' against 'Fake CPU 9000')"
    assert "memory_gib 15.0 against 7.5" in rp.why_not_merge({**now, "machine": {**MACHINE, "memory_gib": 15.0}}, good)
    host = {**MACHINE, "hostname": "bench-1"}
    assert rp.why_not_merge({**now, "machine": host}, good) is None  # older results name no host: not compared
    assert "hostname 'bench-2' against 'bench-1'" in rp.why_not_merge({**now, "machine": {**host, "hostname": "bench-2"}}, {**good, "machine": host})


def test_run_bench_merges_into_the_results_it_finds_unless_fresh_or_quick_differs(tmp_path):
    root = fake_checkout(tmp_path, {"checkpoint.py": printing(checkpoint_json(warm=0.5)), "master_transitions.py": printing(master_json())})
    out = tmp_path / "out"
    echoed: list[str] = []
    args = dict(runs=1, docs=False, out_dir=out, package_file=str(root / "pdps" / "__init__.py"), echo=echoed.append)

    def results():
        return json.loads((out / "results.json").read_text())

    assert run_bench(suites=["checkpoint"], argv=["bench", "--suite", "checkpoint"], **args) == 0
    assert f"pdps bench: writing only this run's suites: no earlier results at {out / 'results.json'}" in echoed
    first = results()["suites"]["checkpoint"]
    assert first["measured"]["command"] == "pdps bench --suite checkpoint" and first["measured"]["runs"] == 1
    assert first["measured"]["started"] <= first["measured"]["finished"] and "git_commit" in first["measured"]
    assert results()["machine"]["hostname"]

    echoed.clear()
    assert run_bench(suites=["master"], check=True, argv=["bench", "--suite", "master", "--check"], **args) == 0  # the kept miss is not judged
    merged = results()
    assert list(merged["suites"]) == ["master", "checkpoint"] and merged["suites"]["checkpoint"] == first
    assert merged["suites_run"] == ["master"] and merged["suites_kept"] == ["checkpoint"]
    assert by_id(merged["targets"])["checkpoint.restore_warm"]["status"] == tg.MISSED
    assert "pdps bench: kept 1 suite from the earlier results (checkpoint); --fresh would write only this run's" in echoed

    echoed.clear()
    assert run_bench(suites=["master"], quick=True, argv=["bench", "--suite", "master", "--quick"], **args) == 0
    assert list(results()["suites"]) == ["master"] and results()["quick"] is True
    assert any("writing only this run's suites: the earlier results are full runs and this is --quick" in line for line in echoed)

    run_bench(suites=["checkpoint"], quick=True, argv=["bench"], **args)
    assert list(results()["suites"]) == ["master", "checkpoint"]
    echoed.clear()
    run_bench(suites=["checkpoint"], quick=True, fresh=True, argv=["bench", "--fresh"], **args)
    assert list(results()["suites"]) == ["checkpoint"] and results()["suites_kept"] == []
    assert "pdps bench: --fresh: writing only this run's suites, none kept from earlier results" in echoed


def test_the_doc_says_where_each_suite_came_from_and_copes_with_suites_of_different_runs():
    earlier = earlier_of({"checkpoint": ran(checkpoint_json(), checkpoint_json(save=0.95), checkpoint_json())}, runs=3)
    now = results_of({"pipeline": ran(pipeline_json())}, runs=1)
    now["command"] = "pdps bench --suite pipeline --check --runs 1"
    now["suites"]["pipeline"]["measured"].update(command=now["command"], git_commit="abc1234")
    merged, _, _ = rp.merge(now, earlier)
    text = rp.render_markdown(merged, {})
    assert "- Command: `pdps bench --suite pipeline --check --runs 1`" in text
    assert "- Suites it ran: pipeline, 1 consecutive run of each" in text
    assert "- Kept from earlier runs: checkpoint (each suite's heading says which command, date and commit measured it)" in text
    assert ("## checkpoint\n\nMeasured by `pdps bench --check` on 2025-12-01T00:30:00+00:00, 3 runs, commit 0ld0ld0 "
            "(kept from an earlier run).\n") in text
    assert "## pipeline\n\nMeasured by `pdps bench --suite pipeline --check --runs 1` on 2026-01-01T00:10:00+00:00, 1 run, commit abc1234.\n" in text
    checkpoint = text.split("## checkpoint", 1)[1].split("## ", 1)[0]
    pipeline = text.split("## pipeline", 1)[1].split("## ", 1)[0]
    assert "| figure | unit | run 1 | run 2 | run 3 |" in checkpoint and "| figure | unit | run 1 |\n" in pipeline
    assert "| target | threshold | run 1 | run 2 | run 3 | verdict |" in text
    assert "| `checkpoint.save`: " in text and "| >= 0.8x | 0.900x | 0.950x | 0.900x | **MET** |" in text
    assert "| <= 15% |  |  | 5.3% | **MET** |" in text  # checkpoint's stability under its third run
    assert "| <= 10% | 6.3% |  |  | **MET** |" in text  # pipeline's one run, padded
    assert "| <= 15% | - |  |  | **NOT CHECKED** |" in text  # one run: no stability, under its run 1
    alone = rp.render_markdown(results_of({"pipeline": ran(pipeline_json())}, runs=1), {})
    assert "- Runs: 1 consecutive run of each suite" in alone and "Kept from earlier" not in alone


def test_the_fresh_flag_reaches_run_bench(monkeypatch):
    from pdps.shell import cli
    from pdps.shell.benchmark import runner

    seen: list[dict] = []
    monkeypatch.setattr(runner, "run_bench", lambda **kw: seen.append(kw) or 0)
    for argv, fresh in ((["bench", "--suite", "master"], False), (["bench", "--suite", "master", "--fresh"], True)):
        args = cli.build_parser(argv).parse_args(argv)
        args.argv = argv
        assert cli.cmd_bench(args) == 0 and seen[-1]["fresh"] is fresh and seen[-1]["suites"] == ["master"]


def test_a_restart_stage_seen_before_the_last_held_step_was_logged_counts_as_no_time():
    """bench/elastic.py's baseline: the bench may see the checkpoint's pointer a moment
    before a trainer process logs the step that checkpoint holds (the commit does not
    wait for the trainer), which once made the first stage -1 ms. Stages end in order,
    none before the last held step."""
    from bench.elastic import restart_row

    parts = {"checkpoint committed": 9.999, "job stopped": 12.5, "new job attached": 14.0, "restored": 13.9, "first step": 15.0}
    row = restart_row(2, 3, {"id": "c1", "round": 3}, 10.0, parts)
    assert row["parts_s"] == {"checkpoint committed": 0.0, "job stopped": 2.5, "new job attached": 4.0, "restored": 4.0, "first step": 5.0}
    assert row["pause_s"] == 5.0 and (row["checkpoint"], row["checkpoint_round"]) == ("c1", 3)
