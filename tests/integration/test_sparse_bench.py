"""``pdps bench --suite sparse --quick``: the sparse suite pulls and pushes rows of a 1M-row
table through 2 pservers in process and 2 pserver processes over gRPC (a throwaway etcd)
beside their baselines, measures the pservers' memory over the fill (SGD and Adagrad) and
trains the CTR example both ways, and reports every figure its targets read. No speed is
asserted: only that the figures exist and agree with each other (the suite itself exits 1
if the rows pulled back are not what the fill and the steps left in them)."""

from __future__ import annotations

import pytest

from tests.integration.benchkit import quick_suite

pytestmark = pytest.mark.integration


def test_the_sparse_suite_reports_rows_per_s_against_baselines_memory_per_row_and_ctr(tmp_path):
    proc, results = quick_suite("sparse", tmp_path, timeout=150)
    (run,) = results["suites"]["sparse"]["runs"]
    report = run["report"]
    config = report["config"]
    assert (config["rows"], config["ids"], config["repeats"], config["dim"]) == (1_000_000, 8_192, 3, 64)  # --quick

    rows = {r["route"]: r for r in report["throughput"]}
    assert set(rows) == {"inproc", "local", "grpc", "tcp"}
    for r in rows.values():
        assert r["steps"] == 3 and r["ids_per_step"] == 8_192 and r["rows_per_s"] == pytest.approx(8_192 / r["step_s"]), r
    assert rows["inproc"]["update_s"] > 0 and rows["grpc"]["update_s"] > 0  # the pservers' own time taking a push
    ratios = report["ratios"]
    assert ratios["grpc_vs_tcp"]["value"] == pytest.approx(rows["grpc"]["rows_per_s"] / rows["tcp"]["rows_per_s"])
    assert ratios["inproc_vs_local"]["value"] == pytest.approx(rows["inproc"]["rows_per_s"] / rows["local"]["rows_per_s"])

    memory = report["memory"]
    assert sorted((m["rule"], m["pserver"]) for m in memory) == [("Adagrad", 0), ("Adagrad", 1), ("SGD", 0), ("SGD", 1)]
    for rule, raw in (("SGD", 256), ("Adagrad", 512)):
        held = [m for m in memory if m["rule"] == rule]
        assert sum(m["rows"] for m in held) == 1_000_000  # every id pushed once: each row on the pserver of its slot
        for m in held:
            assert m["row_bytes"] == raw and m["rss_after"] > m["rss_before"]
            assert m["ratio"] == pytest.approx((m["rss_after"] - m["rss_before"]) / (m["rows"] * raw))
            assert 1.0 < m["store_ratio"] < 1.3  # the store's own bytes: the row and state, ~25 B of index, under a chunk of slack
    assert ratios["memory"]["value"] == pytest.approx(max(m["ratio"] for m in memory))

    ctr = report["ctr"]
    assert ctr["pdps"]["samples"] == ctr["torch"]["samples"] == ctr["samples"] * ctr["passes"] > 0
    assert ctr["pdps"]["samples_per_s"] > 0 and ctr["torch"]["samples_per_s"] > 0 and 0.5 < ctr["pdps"]["auc"] <= 1.0
    assert ratios["ctr_vs_torch"]["value"] == pytest.approx(ctr["pdps"]["samples_per_s"] / ctr["torch"]["samples_per_s"])

    verdicts = {v["id"]: v for v in results["targets"]}
    for target in ("sparse.grpc_vs_tcp", "sparse.inproc_vs_local", "sparse.memory"):
        assert verdicts[target]["status"] in ("MET", "MISSED") and f" {target} " in proc.stdout
    names = {f["name"] for f in run["figures"]}
    assert {"raw TCP echo (2 server processes)", "SGD, pserver 0: RSS a row", "CTR: torch, single process", "grpc / raw TCP, rows/s"} <= names
