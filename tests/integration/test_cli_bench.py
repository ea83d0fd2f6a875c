"""``pdps bench`` as a user runs it: a real (quick) suite, its results JSON. No speed is asserted."""

from __future__ import annotations


import pytest

from tests.integration.benchkit import quick_suite

pytestmark = pytest.mark.integration


def test_bench_checkpoint_quick_writes_its_targets(tmp_path):
    proc, results = quick_suite("checkpoint", tmp_path, timeout=240)
    assert "[checkpoint 1/1] raw write" in proc.stderr  # the suite's table, streamed through
    assert results["command"] == f"pdps bench --suite checkpoint --quick --runs 1 --out {tmp_path / 'results'} --no-docs"
    assert results["quick"] is True and list(results["suites"]) == ["checkpoint"]
    suite = results["suites"]["checkpoint"]
    assert suite["args"] == ["--mib", "64", "--repeats", "2"] and suite["config"]["repeats"] == 2
    assert [r["ok"] for r in suite["runs"]] == [True]
    verdicts = {v["id"]: v for v in results["targets"]}
    for target in ("checkpoint.save", "checkpoint.restore_warm", "checkpoint.restore_cold"):
        (value,) = verdicts[target]["values"]
        assert isinstance(value, float) and value > 0
        assert verdicts[target]["status"] in ("MET", "MISSED")
        assert f" {target} " in proc.stdout  # one line per target
        assert verdicts[f"stability.{target}"]["status"] == "NOT CHECKED"  # one run
