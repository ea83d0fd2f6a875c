"""``pdps bench --suite pipeline --quick``: the pipeline suite runs GPipe and 1F1B on 4
StageRunners over inproc p2p with sleeping stages, counts the activations each stage
holds, and sends activations over gRPC to a second process and back beside a raw loopback
TCP echo, and reports every figure its targets read. No speed is asserted: only that the
figures exist and agree with each other, and that the counted peaks are the schedules'."""

from __future__ import annotations

import pytest

from tests.integration.benchkit import quick_suite

pytestmark = pytest.mark.integration


def test_the_pipeline_suite_reports_bubbles_against_theory_peak_activations_and_p2p_against_raw_tcp(tmp_path):
    proc, results = quick_suite("pipeline", tmp_path, timeout=120)
    (run,) = results["suites"]["pipeline"]["runs"]
    report = run["report"]
    config = report["config"]
    assert (config["stages"], config["microbatches"], config["steps"], config["mib"]) == (4, 8, 2, [4.0])  # --quick
    assert config["bubble_transport"] == "inproc" and config["p2p_transport"] == "grpc"

    bubbles = {r["schedule"]: r for r in report["bubble"]}
    assert set(bubbles) == {"gpipe", "1f1b"}
    for r in bubbles.values():
        assert r["theory"] == pytest.approx(3 / 11) and r["simulated"] == pytest.approx(r["theory"])  # (P-1)/(M+P-1)
        assert len(r["measured_each"]) == 2 and 0 < r["measured"] < 1 and r["makespan_s"] > 0
        assert r["error"] == pytest.approx(abs(r["measured"] - r["theory"]) / r["theory"])
        assert all(b > 0 for b in r["busy_s"])
    assert bubbles["gpipe"]["peak_activations"] == [8, 8, 8, 8]  # GPipe holds all M
    assert bubbles["1f1b"]["peak_activations"] == [4, 3, 2, 1]  # 1F1B: min(M, P - stage)

    rows = {r["route"]: r for r in report["p2p"]}
    assert set(rows) == {"grpc", "tcp"}
    for r in rows.values():
        assert r["mib"] == 4.0 and r["rounds"] == 5 and r["gbps"] == pytest.approx(2 * r["bytes"] / r["round_s"] / 1e9), r
    assert report["p2p_stats"]["meta_sent"] == 1 and report["p2p_stats"]["messages"] == 6  # one signature: meta once; 1 + 5 rounds
    ratios = report["ratios"]
    assert ratios["p2p_grpc_vs_tcp"]["value"] == pytest.approx(rows["grpc"]["gbps"] / rows["tcp"]["gbps"])
    assert ratios["bubble_gpipe"]["value"] == bubbles["gpipe"]["error"] and ratios["bubble_1f1b"]["value"] == bubbles["1f1b"]["error"]

    verdicts = {v["id"]: v for v in results["targets"]}
    for target in ("pipeline.bubble_gpipe", "pipeline.bubble_1f1b", "pipeline.p2p_grpc_vs_tcp"):
        assert verdicts[target]["status"] in ("MET", "MISSED") and f" {target} " in proc.stdout
    names = {f["name"] for f in run["figures"]}
    assert {"GPipe: bubble, measured", "1F1B: peak activations held, stage 3", "raw TCP echo (2 processes), 4 MiB",
            "p2p over gRPC / raw TCP, GB/s, worst size"} <= names  # fmt: skip
