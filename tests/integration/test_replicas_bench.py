"""``pdps bench --suite replicas --quick``: the replicas suite kills a pserver of a job with
replicas = 1 and of one with replicas = 2 (every role a process, gRPC + etcd), and runs the
throughput configurations, and reports every figure its targets read. No speed is
asserted: only that the figures exist and agree with what each kill did."""

from __future__ import annotations


import pytest

from tests.integration.benchkit import quick_suite

pytestmark = pytest.mark.integration


def test_the_replicas_suite_reports_failover_against_rollback_and_throughput(tmp_path):
    proc, results = quick_suite("replicas", tmp_path, timeout=300)
    (run,) = results["suites"]["replicas"]["runs"]
    report = run["report"]
    assert report["config"]["roles"] == "in-process" and report["config"]["repeats"] == 1  # --quick

    r1, r2 = report["failover"]["runs"]
    assert (r1["replicas"], r2["replicas"]) == (1, 2)
    (kill1,), (kill2,) = r1["results"], r2["results"]
    # replicas = 1 rolls back to its checkpoint and trains again what came after it; replicas = 2 fails over
    assert kill1["rolled_back"] and r1["rollbacks"] == 1 and r1["rounds_retrained"] == [kill1["last_round_before_kill"] - kill1["checkpoint_round"]]
    assert not kill2["rolled_back"] and r2["rollbacks"] == 0 and r2["rounds_retrained"] == [0]
    assert kill2["resumed_round"] == kill2["last_round_before_kill"] + 2
    stages2 = kill2["seconds"]
    assert 0 < stages2["failed_over"] <= stages2["resumed"] and "failed_over" not in kill1["seconds"]
    assert r1["resumed_s"] == kill1["seconds"]["resumed"] > 0 and r2["resumed_s"] == stages2["resumed"]

    ttl = report["failover"]["lease_ttl_etcd_s"]
    ratios = report["ratios"]
    assert ratios["resumed_beyond_ttl"]["value"] == pytest.approx(r2["resumed_s"] - ttl)
    assert ratios["resumed_r1_vs_r2"]["value"] == pytest.approx(r1["resumed_s"] / r2["resumed_s"])
    rows = {(r["mode"], r["replicas"]): r for r in report["throughput"]}
    assert set(rows) == {("sync", 1), ("sync", 2), ("async", 1), ("async", 2)}
    for key in (("sync", 1), ("sync", 2), ("async", 1)):
        assert rows[key]["samples_per_s"] > 0 and rows[key]["steps_per_s"] > 0, rows[key]
    assert ratios["sync_r2_vs_r1"]["value"] == pytest.approx(rows["sync", 2]["samples_per_s"] / rows["sync", 1]["samples_per_s"])
    # async replication may be refused by this version's pservers: then the row and its ratio say why
    if "not_run" in rows["async", 2]:
        assert "async" in rows["async", 2]["not_run"] and ratios["async_r2_vs_r1"]["not_run"]
    else:
        assert ratios["async_r2_vs_r1"]["value"] == pytest.approx(rows["async", 2]["samples_per_s"] / rows["async", 1]["samples_per_s"])

    verdicts = {v["id"]: v for v in results["targets"]}
    for target in ("replicas.resumed_beyond_ttl", "replicas.resumed_r1_vs_r2", "replicas.sync_r2_vs_r1"):
        assert verdicts[target]["status"] in ("MET", "MISSED") and f" {target} " in proc.stdout
    assert verdicts["replicas.async_r2_vs_r1"]["status"] in ("MET", "MISSED", "NOT RUN")
    names = {f["name"] for f in run["figures"]}
    assert {"replicas = 1: kill -> resumed", "replicas = 2: kill -> resumed", "sync, replicas = 2", "lease TTL"} <= names
