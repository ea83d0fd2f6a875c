"""``pdps bench --suite online --quick``: the online suite trains the same records from a
Redis stream (a throwaway redis-server on 127.0.0.1) and from Parquet, and runs a job with
one 10x straggler with speculation off and on, and reports every figure its target reads.
No speed is asserted: only that the figures exist, agree with each other, and show every
record trained exactly once."""

from __future__ import annotations


import pytest

from tests.integration.benchkit import quick_suite

pytestmark = pytest.mark.integration


def test_the_online_suite_reports_stream_against_parquet_and_speculation_on_against_off(tmp_path):
    proc, results = quick_suite("online", tmp_path, timeout=120)
    (run,) = results["suites"]["online"]["runs"]
    report = run["report"]
    config = report["config"]
    assert config["repeats"] == 1 and config["records"] == 20_000 and config["spec_steps"] == 20  # --quick

    rows = {r["source"]: r for r in report["throughput"]}
    assert set(rows) == {"parquet", "redis-stream"}
    for r in rows.values():
        assert r["records"] == r["records_exactly_once"] == 20_000 and r["records_per_s"] > 0, r
    ratios = report["ratios"]
    assert ratios["stream_vs_parquet"]["value"] == pytest.approx(rows["redis-stream"]["records_per_s"] / rows["parquet"]["records_per_s"])

    spec = {r["speculation"]: r for r in report["speculation"]}
    records = config["spec_tasks"] * config["spec_steps"] * config["spec_batch"]
    for r in spec.values():
        assert r["records"] == r["records_exactly_once"] == records and r["seconds"] > 0, r
    assert spec[False]["beaten_each"] == [0] and spec[True]["beaten_each"][0] >= 1  # a race happened only with speculation on
    assert ratios["speculation_on_vs_off"]["value"] == pytest.approx(spec[True]["seconds"] / spec[False]["seconds"])

    verdicts = {v["id"]: v for v in results["targets"]}
    assert verdicts["online.speculation_on_vs_off"]["status"] in ("MET", "MISSED") and " online.speculation_on_vs_off " in proc.stdout
    names = {f["name"] for f in run["figures"]}
    assert {"Parquet: records/s", "Redis stream: records/s", "speculation on: job time", "speculation off: records trained exactly once"} <= names
