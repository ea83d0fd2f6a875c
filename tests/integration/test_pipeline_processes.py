"""Issue 20's acceptance over processes: ``pdps launch --pipeline-stages 4`` runs 8 trainer
processes as 2 data-parallel pipelines of 4 stages, over gRPC and etcd, sync, float64,
once with each schedule. The job finishes with every task done, and its final
parameters equal single-process training of the whole model on the batches of the
rounds the job closed (atol 1e-10).

In the 1F1B job a stage process SIGKILLs itself in the middle of a step: the other
stages of its pipeline stop (their receives end naming the peer that left), the
launcher restarts them, the restarted ones claim the free ranks, and the pipeline forms
again and trains (the other pipeline's stage 0 waits for it). The GPipe job runs
without a kill (the failure path is the schedule's business no more than 1F1B's: the
runner, the groups and the launcher are the same)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pdps.adapters.parquet import ParquetSource, write_parquet_shards
from pdps.ports.data import read_whole
from pdps.registry import connect_store
from tests.integration.test_processes import last_json
from tests.integration.test_transactional_sync import closed_rounds

pytestmark = pytest.mark.integration

TARGET = Path(__file__).parent / "targets" / "pipeline.py"
ROWS, ROW_GROUP, BATCH, LR = 96, 16, 8, 0.1  # 6 tasks of 2 steps


def load_target():
    import importlib.util

    spec = importlib.util.spec_from_file_location("pipeline_target", TARGET)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("schedule,kill", [("1f1b", True), ("gpipe", False)], ids=["1f1b-a-stage-killed", "gpipe"])
def test_launch_pipeline_stages_trains_as_one_process(etcd_server, tmp_path, schedule, kill):
    rng = np.random.default_rng(11)
    x = rng.normal(size=(ROWS, 4))
    y = np.stack([x[:, 0] * x[:, 1], np.tanh(x[:, 2] - x[:, 3])], axis=1)
    data = f"{tmp_path.as_uri()}/d"
    write_parquet_shards({"x": x, "y": y}, data, shards=1, row_group_size=ROW_GROUP)
    job, out, marker = f"pp-{uuid.uuid4().hex[:8]}", tmp_path / "params", tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PIPELINE_PARAMS_OUT": str(out)}
    if kill:
        env["PIPELINE_KILL_MARKER"] = str(marker)
    log = tmp_path / "launch.log"
    with log.open("w") as err:
        launcher = subprocess.Popen(
            [
                sys.executable, "-m", "pdps", "launch", "--job", job, "--store", etcd_server.url, "--transport", "grpc",
                "--trainers", "8", "--pipeline-stages", "4", "--pipeline-microbatches", "2", "--pipeline-schedule", schedule,
                "--pipeline-timeout", "20", "--pservers", "1", "--mode", "sync", "--dataset", data, "--batch-size", str(BATCH),
                "--optimizer", "SGD", "--lr", str(LR), "--lease-ttl", "3", "--min-block", "1", "--num-slots", "8",
                "--keep-rounds", "100000", "--restart", "on-failure", "--timeout", "90", "--json", f"{TARGET}:train",
            ],
            stdout=subprocess.PIPE, stderr=err, text=True, env=env,
        )  # fmt: skip
        try:
            stdout, _ = launcher.communicate(timeout=120)
        finally:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait(timeout=30)
    stderr = log.read_text()
    assert launcher.returncode == 0, stderr[-6000:]
    summary = last_json(stdout)
    assert summary["tasks_done"] == ROWS // ROW_GROUP and summary["tasks_failed"] == 0, summary
    if kill:
        assert "restarting it" in stderr, stderr[-4000:]
        assert "the pipeline is broken" in stderr and "which left the pipeline" in stderr, stderr[-4000:]
    else:
        assert "restarting it" not in stderr and not marker.exists(), stderr[-4000:]

    target = load_target()
    store = connect_store(etcd_server.url)
    try:
        rounds = closed_rounds(store, job)
    finally:
        store.close()
    source = ParquetSource(data)
    tasks = {t.id: read_whole(source, t) for t in source.tasks()}
    model = target.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    rejoined = {t for _, r in rounds for t, _ in r.weights() if "-r" in t}
    if kill:
        assert rejoined, "no restarted trainer's step went into a round: the broken pipeline did not form again"
    else:
        assert not rejoined, rejoined  # nothing was restarted
    trained = 0
    for _, record in rounds:
        weights = record.weights()
        if not weights:
            continue
        opt.zero_grad()
        loss = 0
        for trainer, w in weights:
            c = record.contributions[trainer]
            cols = {k: torch.from_numpy(v[c.start : c.offset]) for k, v in tasks[c.task].items()}
            loss = loss + F.mse_loss(model(cols["x"]), cols["y"]) * w
            trained += c.offset - c.start
        loss.backward()
        opt.step()
    assert trained == ROWS  # every record trained once, the killed step's included (again)
    for name, p in model.named_parameters():
        got = torch.from_numpy(np.fromfile(out / f"{name}.f64", dtype=np.float64)).view(p.shape)
        torch.testing.assert_close(got, p.detach(), rtol=0, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")
    if kill:
        assert int(marker.read_text()) > 0  # the pid of the stage that killed itself
