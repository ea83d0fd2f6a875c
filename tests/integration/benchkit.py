"""A ``pdps bench`` suite run as a user runs it, quick, for the bench-suite tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def quick_suite(suite: str, tmp_path: Path, *, timeout: float) -> tuple[subprocess.CompletedProcess, dict[str, Any]]:
    """``pdps bench --suite SUITE --quick --runs 1 --no-docs`` into ``tmp_path``: the
    finished process (it must have exited 0) and its results JSON."""
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "pdps", "bench", "--suite", suite, "--quick", "--runs", "1", "--out", str(out), "--no-docs"],
        cwd=REPO, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads((out / "results.json").read_text())
