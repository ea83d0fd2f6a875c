"""``pdps bench`` as a user runs it: a real (quick) suite, its results JSON. No speed is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration


def test_bench_checkpoint_quick_writes_its_targets(tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "pdps", "bench", "--suite", "checkpoint", "--quick", "--runs", "1", "--out", str(out), "--no-docs"],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[checkpoint 1/1] raw write" in proc.stderr  # the suite's table, streamed through
    results = json.loads((out / "results.json").read_text())
    assert results["command"] == f"pdps bench --suite checkpoint --quick --runs 1 --out {out} --no-docs"
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
