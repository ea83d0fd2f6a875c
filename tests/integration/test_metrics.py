"""Prometheus metrics of the roles: scraped over HTTP from a running ``pdps launch`` job,
and read from a simulated job's trainers and boundaries."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

TARGETS = Path(__file__).parent / "targets"
URL = re.compile(r"\[launch\] (\S+) serves metrics at (http://127\.0\.0\.1:\d+/metrics)")


def fetch(url: str) -> dict[str, float]:
    """Every sample of the exposition at ``url``: ``name{labels}`` -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def total(samples: dict[str, float], name: str, **labels: str) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in samples.items() if k.split("{")[0] == name and all(w in k for w in want))


def test_roles_of_a_launched_job_serve_their_metrics(etcd_server, tmp_path):
    """While a small launch job runs, each role's port answers with its metrics: the
    master's queue, a trainer's samples and steps, its push/pull bytes and latencies and
    barrier time, a pserver's updates and checkpoint writes; all labelled job/role/id."""
    job = f"m-{uuid.uuid4().hex[:8]}"
    log = tmp_path / "launch.log"
    args = [
        sys.executable, "-m", "pdps", "launch", "--job", job, "--store", etcd_server.url, "--trainers", "2", "--pservers", "1",
        "--mode", "sync", "--passes", "2", "--checkpoint-url", (tmp_path / "ckpt").as_uri(), "--checkpoint-every", "5",
        "--metrics-port", "0", "--restart", "never", f"{TARGETS / 'slow.py'}:train",
    ]  # fmt: skip
    with log.open("w") as err:
        launcher = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err, text=True, env={**os.environ, "SLOW_TRAIN_DELAY": "0.05", "OMP_NUM_THREADS": "1"})
    try:
        urls: dict[str, str] = {}
        seen: dict[str, dict[str, float]] = {}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and launcher.poll() is None:
            urls.update(URL.findall(log.read_text()))
            for role, url in urls.items():
                try:
                    seen[role] = fetch(url)
                except OSError:
                    pass  # not up yet, or already gone
            trainer = seen.get("trainer-0", {})
            if total(trainer, "pdps_trainer_samples_total") > 0 and total(trainer, "pdps_rpc_seconds_count", method="pull") > 0 and "pserver-0" in seen and "master" in seen:
                if total(seen["pserver-0"], "pdps_checkpoint_write_seconds_count") > 0:
                    break
            time.sleep(0.2)
        assert launcher.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    text = log.read_text()
    assert set(urls) == {"master", "pserver-0", "trainer-0", "trainer-1"}, text[-3000:]

    trainer = seen["trainer-0"]
    mine = {"job": job, "role": "trainer", "id": "trainer-0"}
    assert total(trainer, "pdps_trainer_samples_total", **mine) > 0
    assert total(trainer, "pdps_trainer_steps_total", **mine) > 0
    for method in ("push", "pull"):
        assert total(trainer, "pdps_rpc_seconds_count", side="client", method=method, **mine) > 0
        assert total(trainer, "pdps_rpc_seconds_bucket", side="client", method=method, le="+Inf") > 0
    assert total(trainer, "pdps_rpc_sent_bytes_total", side="client", method="push") > 0
    assert total(trainer, "pdps_rpc_received_bytes_total", side="client", method="pull") > 0
    assert f'pdps_trainer_seconds_total{{id="trainer-0",job="{job}",kind="barrier",role="trainer"}}' in trainer
    assert total(trainer, "pdps_store_errors_total") == 0  # present once met: none here

    master = seen["master"]
    assert total(master, "pdps_master_leading", job=job, role="master") == 1
    for state in ("todo", "pending", "done", "failed"):
        assert f'state="{state}"' in " ".join(k for k in master if k.startswith("pdps_master_tasks{"))
    assert total(master, "pdps_master_tasks") > 0  # the pass's tasks, whatever their state
    assert total(master, "pdps_rpc_seconds_count", side="server") > 0

    pserver = seen["pserver-0"]
    assert total(pserver, "pdps_pserver_updates_total", job=job, role="pserver", id="0") > 0
    assert total(pserver, "pdps_checkpoint_write_seconds_count", id="0") > 0
    assert total(pserver, "pdps_checkpoint_write_seconds_sum", id="0") > 0
    assert total(pserver, "pdps_rpc_received_bytes_total", side="server", method="push") > 0


def test_a_simulated_job_counts_what_it_measures(tmp_path):
    """The same adapter around pdps.simulate's store and transport, and over each
    trainer's context: the counters agree with what the job reports."""
    import torch.nn.functional as F
    from prometheus_client import generate_latest

    import pdps
    from pdps.adapters.inproc import InprocTransport
    from pdps.adapters.prometheus_metrics import RoleMetrics, scrape, trainer_reading
    from pdps.examples.digits import dataset, make_model

    boundaries = RoleMetrics("sim-metrics", "simulate", "all")
    scraped: dict[str, dict[str, float]] = {}

    def train(ctx):
        metrics = RoleMetrics(ctx.config.name, "trainer", ctx.trainer_id)  # one registry per role
        metrics.watch(trainer_reading(ctx))
        model = ctx.attach(make_model())
        for batch in ctx.batches():
            ctx.step(F.cross_entropy(model(batch["x"]), batch["y"]))
        text = generate_latest(metrics.registry).decode()
        scraped[ctx.trainer_id] = scrape(text, ["pdps_trainer_samples_total", "pdps_trainer_steps_total", "pdps_trainer_tasks_done_total"])
        return {"steps": ctx.steps, "tasks_done": ctx.tasks_done}

    result = pdps.simulate(
        train, dataset=dataset(tmp_path.as_uri()), store=boundaries.store(pdps.open_store("memory://")),
        transport=boundaries.transport(InprocTransport()), trainers=2, pservers=1, mode="sync", passes=1, name="sim-metrics",
    )  # fmt: skip
    for tid, counts in scraped.items():
        samples = sum(step.samples for step in result.history[tid])
        assert counts["pdps_trainer_samples_total"] == samples > 0
        assert counts["pdps_trainer_steps_total"] == result.trainers[tid]["steps"] > 0
        assert counts["pdps_trainer_tasks_done_total"] == result.trainers[tid]["tasks_done"]
    assert sum(c["pdps_trainer_tasks_done_total"] for c in scraped.values()) == result.tasks_done

    both = scrape(generate_latest(boundaries.registry).decode(), ["pdps_rpc_seconds_count", "pdps_rpc_sent_bytes_total", "pdps_rpc_received_bytes_total"])
    assert both["pdps_rpc_seconds_count"] > 0
    # in process, every tensor byte a client sends a server receives, and back
    assert both["pdps_rpc_sent_bytes_total"] == both["pdps_rpc_received_bytes_total"] > 0
