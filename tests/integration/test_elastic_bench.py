"""``pdps bench --suite elastic --quick``: the resize suite runs the library's roles, resizes
2 -> 3 -> 4 -> 2 pservers live and restarts from a checkpoint for each, and reports every
figure its targets read; ``bench/elastic.py --processes`` does the same with every role
its own process. No speed is asserted: only that the figures exist and agree with each
other and with the slot maps."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.benchkit import REPO, quick_suite

pytestmark = pytest.mark.integration


def test_the_elastic_suite_reports_each_resize_against_a_checkpoint_restart(tmp_path):
    proc, results = quick_suite("elastic", tmp_path, timeout=300)
    assert "[elastic 1/1] pause: longest gap between a trainer's consecutive steps" in proc.stderr  # the definition, printed
    suite = results["suites"]["elastic"]
    (run,) = suite["runs"]
    report = run["report"]
    assert report["config"]["resizes"] == [2, 3, 4, 2] and report["config"]["transport"] == "grpc"
    assert report["config"]["roles"] == "in-process"  # --quick: the roles are threads, cheap to start
    check_resizes(report, [2, 3, 4, 2])
    verdicts = {v["id"]: v for v in results["targets"]}
    for target in ("elastic.pause_vs_restart", "elastic.bytes_vs_minimum"):
        assert verdicts[target]["status"] in ("MET", "MISSED") and f" {target} " in proc.stdout
    assert verdicts["elastic.bytes_vs_minimum"]["status"] == "MET"
    names = {f["name"] for f in run["figures"]}
    assert "8 MiB sync, 2->3: longest trainer pause" in names and "8 MiB sync, 4->2: stop, checkpoint, restart" in names


def check_resizes(report, counts):
    """Each resize's figures agree with each other, with its baseline and with its slot maps."""
    (job,) = report["runs"]
    assert [(x["from"], x["to"]) for x in job["resizes"]] == list(zip(counts, counts[1:]))
    for x in job["resizes"]:
        assert x["slots_moved"] > 0 and 0 < x["bytes_minimum"] <= job["mib"] * 2**20
        assert x["bytes_moved"] == x["bytes_received"] == x["bytes_minimum"], x  # SGD: the values alone move, once
        # a gap shorter than the usual step is no pause (steps before a resize can be slow: it follows another)
        assert 0 < x["wall_s"] and 0 < x["step_s"] and 0 < x["longest_gap_s"] and x["pause_s"] == pytest.approx(max(0.0, x["longest_gap_s"] - x["step_s"]))
        restart = x["restart"]
        assert (restart["from"], restart["to"]) == (x["from"], x["to"]) and restart["checkpoint_round"] == report["config"]["steps"]
        parts = list(restart["parts_s"].values())
        assert parts == sorted(parts) and parts[-1] == pytest.approx(restart["pause_s"]) and parts[0] >= 0
        assert x["pause_vs_restart"] == pytest.approx(restart["pause_s"] / max(x["pause_s"], 0.001))
    assert report["ratios"]["bytes_vs_minimum"]["value"] == 1.0
    worst = min(x["pause_vs_restart"] for x in job["resizes"])
    assert report["ratios"]["pause_vs_restart"]["value"] == worst


def test_the_elastic_bench_runs_each_role_as_a_process_when_asked(tmp_path):
    """Live: a pserver process added; the baseline: processes stopped, a new job's processes
    started and restored by the pdps checkpoint command. (A pserver process leaving by itself
    is test_elastic_acceptance's 3 -> 1; one resize keeps this test to half its time.)"""
    proc = subprocess.run(
        [sys.executable, "bench/elastic.py", "--quick", "--processes", "--resizes", "2", "3", "--tmp", str(tmp_path), "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["config"]["roles"] == "processes" and report["config"]["resizes"] == [2, 3]
    check_resizes(report, [2, 3])
    assert list(tmp_path.iterdir()) == []  # the dataset and checkpoints go with their jobs
