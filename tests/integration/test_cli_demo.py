"""``pdps demo``: the fixed CLI contract, run as a real process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

FIELDS = {"accuracy", "mode", "trainers", "pservers", "passes", "tasks_done", "tasks_failed", "steps", "seconds"}


def pdps(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdps", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_demo_reaches_the_bar(mode):
    proc = pdps("demo", "--trainers", "3", "--pservers", "2", "--mode", mode, "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(summary) == FIELDS
    assert summary["accuracy"] >= 0.95
    assert summary["tasks_failed"] == 0 and summary["steps"] > 0
    assert (summary["mode"], summary["trainers"], summary["pservers"], summary["passes"]) == (mode, 3, 2, 30)
    tasks_per_pass = summary["tasks_done"] // summary["passes"]
    assert tasks_per_pass * summary["passes"] == summary["tasks_done"] and tasks_per_pass > 3 * 3  # well over N tasks
    assert "pass 30/30" in proc.stderr  # progress goes to stderr


def test_demo_passes_and_seed_are_honoured():
    proc = pdps("demo", "--trainers", "1", "--pservers", "1", "--passes", "2", "--seed", "5", "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["passes"] == 2 and summary["trainers"] == 1
    assert summary["steps"] > 0


def test_demo_help_shows_the_defaults():
    proc = pdps("demo", "--help")
    assert proc.returncode == 0
    for text in ["--passes", "default: 30", "--batch-size", "default: 32", "--optimizer", "default: Adam", "--lr", "default: 0.001"]:
        assert text in proc.stdout


@pytest.mark.parametrize(
    "args,expect",
    [(["--mode", "eventual"], "invalid choice"), (["--trainers", "0"], "at least 1"), (["--optimizer", "LBFGS"], "LBFGS")],
)
def test_demo_bad_input_is_a_clear_error(args, expect):
    proc = pdps("demo", *args)
    assert proc.returncode == 2
    assert expect in proc.stderr
    assert "Traceback" not in proc.stderr


def test_version_and_bad_log_level():
    proc = pdps("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("pdps ")
    proc = pdps("--log-level", "loud", "demo")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr and "Traceback" not in proc.stderr


def test_demo_ctr_example_trains_a_table_on_the_pservers_to_the_bar():
    proc = pdps("demo", "--example", "ctr", "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(summary) == FIELDS - {"accuracy"} | {"auc"}
    assert summary["auc"] >= 0.70  # chance is 0.5; the generator's Bayes AUC is about 0.82
    assert (summary["passes"], summary["tasks_done"], summary["tasks_failed"]) == (2, 2 * 16, 0)
    assert "held-out AUC" in proc.stderr
