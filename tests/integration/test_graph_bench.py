"""``pdps bench --suite graph --quick``: the graph suite steps Adam on a 1M-element shard from
the graph rule, eager torch and the named shard, times a cold and a cached conversion, and
reports every figure its target reads. No speed is asserted: only that the figures exist
and agree with each other (the suite itself exits 1 if the graph-run parameters differ
from eager torch's)."""

from __future__ import annotations

import pytest

from tests.integration.benchkit import quick_suite

pytestmark = pytest.mark.integration


def test_the_graph_suite_reports_the_update_against_eager_torch_and_the_conversion_cache(tmp_path):
    proc, results = quick_suite("graph", tmp_path, timeout=150)
    (run,) = results["suites"]["graph"]["runs"]
    report = run["report"]
    assert (report["config"]["params"], report["config"]["blocks"], report["config"]["steps"]) == (1_000_000, 10, 5)  # --quick
    rows = {r["route"]: r for r in report["update"]}
    assert set(rows) == {"graph", "eager", "named"}
    for r in rows.values():
        assert len(r["steps_s"]) == 5 and min(r["steps_s"]) <= r["step_s"] <= max(r["steps_s"]), r
    assert report["max_diff"] <= 1e-5
    ratio = report["ratios"]["graph_vs_eager"]
    assert ratio["value"] == pytest.approx(rows["graph"]["step_s"] / rows["eager"]["step_s"])
    conv = report["conversion"]
    assert (conv["traced"], conv["hits"]) == (1, 1) and conv["first_s"] > conv["hit_s"] > 0
    (verdict,) = [v for v in results["targets"] if v["id"] == "graph.update_vs_eager"]
    assert verdict["status"] in ("MET", "MISSED") and " graph.update_vs_eager " in proc.stdout
    names = {f["name"] for f in run["figures"]}
    assert {"graph rule (GraphOptimizer)", "eager torch.optim.Adam", "cache hits", "graph rule / eager Adam, step"} <= names
