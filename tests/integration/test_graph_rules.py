"""Update rules shipped as checked graphs: a user-defined optimizer (Lion, defined here
and importable nowhere else) trains through ``pdps.simulate`` exactly as single-process
torch does, and a live pserver over gRPC refuses hostile rules, keeps serving and keeps
its parameters."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import pdps
from pdps.adapters.grpc_transport import GrpcTransport
from pdps.adapters.torch_compute import TorchCompute
from pdps.core.errors import BadGraph
from pdps.ports.transport import Message
from pdps.roles.master import publish_job
from tests.integration.jobkit import grpc_pserver, pull, valid_push
from tests.integration.test_inprocess_job import K, make_model, reference, regression_dataset, run_sync

pytestmark = pytest.mark.integration


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023), written in plain torch ops: sign of an interpolated momentum."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(exp_avg.mul(beta1).add(p.grad, alpha=1 - beta1).sign(), alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)


LION = {"lr": 0.003, "betas": (0.9, 0.99), "weight_decay": 0.01}


def test_a_user_defined_lion_trains_in_sync_exactly_as_single_process_torch(tmp_path):
    source = regression_dataset(tmp_path.as_uri(), np.float64)
    optimizer, args = pdps.graph_rule(Lion(make_model(torch.float64).parameters(), **LION))
    result = run_sync(source, torch.float64, optimizer, args)
    want = reference(source, torch.float64, Lion, LION)
    assert result.steps == K
    for name, w in want.items():
        torch.testing.assert_close(result.params[name], w, rtol=0, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")
    assert any(not torch.equal(w, make_model(torch.float64).state_dict()[n]) for n, w in want.items())


# --- hostile rules sent straight to a live pserver ---------------------------------------

TOKEN = "graph"


@pytest.fixture(scope="module")
def live():
    """A real pserver over gRPC running a Lion graph rule, initialized by a real trainer."""
    model = torch.nn.Linear(6, 3).double()
    optimizer, args = pdps.graph_rule(Lion(model.parameters(), **LION))
    with grpc_pserver(model, token=TOKEN, name="graph-live", optimizer=optimizer, optimizer_args=args, min_block=4) as (_, channel, part):
        yield channel, args["graph"], part


def hostile(rule: dict, how: str) -> dict:
    g = json.loads(json.dumps(rule))
    node = g["step"]["nodes"][0]
    if how == "unknown operator":
        node["op"] = "linalg_vector_norm.default"
    elif how == "cycle":
        node["args"][0] = {"ref": g["step"]["nodes"][-1]["name"]}
    elif how == "missing node":
        node["args"][0] = {"ref": "ghost"}
    elif how == "huge shape":
        g["first"]["nodes"].insert(0, {"name": "big", "op": "zeros.default", "args": [[1 << 30, 1 << 30]]})
    elif how == "wrong dtype":
        g["state"][0]["dtype"] = "complex64"
    elif how == "byte mismatch":
        g["step"]["constants"] = {"c": {"dtype": "float64", "shape": [], "data": "AAAA"}}
    return g


@pytest.mark.parametrize("how", ["unknown operator", "cycle", "missing node", "huge shape", "wrong dtype", "byte mismatch"])
def test_a_hostile_rule_is_refused_and_the_pserver_serves_on_unchanged(live, how):
    channel, rule, part = live
    before = pull(channel)
    with pytest.raises(BadGraph) as info:
        channel.call("rule", Message({"trainer": "t0", "rule": hostile(rule, how)}), timeout=10)
    assert "rule from trainer 't0'" in str(info.value)
    after = pull(channel)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    # the pserver still steps with its own rule: a push moves the parameters
    channel.call("push", Message(*valid_push(channel, part, torch.float64)), timeout=10)
    assert not all(torch.equal(a, b) for a, b in zip(after, pull(channel)))


def test_the_rule_a_pserver_runs_is_recognised_and_another_is_not(live):
    channel, rule, _ = live
    reply = channel.call("rule", Message({"trainer": "t0", "rule": rule}), timeout=10)
    assert reply.meta["runs"] is True and len(reply.meta["digest"]) == 64
    other = pdps.graph_rule(Lion([torch.zeros(2, dtype=torch.float64)], lr=0.5))[1]["graph"]
    assert channel.call("rule", Message({"trainer": "t0", "rule": other}), timeout=10).meta.get("runs", False) is False


# --- the acceptance run: processes over gRPC and etcd, pservers that cannot import this file ---

ROWS, BATCH = 48, 8


def test_lion_over_grpc_and_etcd_with_pserver_processes_that_cannot_import_it(etcd_server, tmp_path):
    """2 pservers, each a ``python -m pdps pserver`` process, with the master and a
    trainer in this process, over gRPC and etcd; the pservers run from a folder whose
    import path holds ``pdps`` alone, so this module (and its Lion) cannot be imported
    there. The job's final parameters equal
    single-process Lion to 1e-10 (float64, sync)."""
    import os
    import subprocess
    import sys
    import uuid
    from pathlib import Path

    from pdps.adapters.parquet import write_parquet_shards
    from pdps.registry import connect_store
    from pdps.adapters.parquet import ParquetSource
    from pdps.roles.master import Master
    from tests.integration.targets.graph_model import make_model as target_model
    from tests.integration.targets.graph_model import train

    rng = np.random.default_rng(3)
    x = rng.normal(size=(ROWS, 4))
    y = np.stack([x[:, 0] - x[:, 1], x[:, 2] * x[:, 3]], axis=1)
    data = f"{tmp_path.as_uri()}/d"
    write_parquet_shards({"x": x, "y": y}, data, shards=1, row_group_size=ROWS)

    name = f"graph-{uuid.uuid4().hex[:8]}"
    optimizer, args = pdps.graph_rule(Lion(target_model().parameters(), **LION))
    config = pdps.JobConfig(
        name=name, dataset=data, mode="sync", trainers=1, pservers=2, batch_size=BATCH, passes=1,
        optimizer=optimizer, optimizer_args=args, num_slots=16, min_block=4, lease_ttl=5.0,
    )  # fmt: skip
    store = connect_store(etcd_server.url)
    publish_job(store, config)

    bare = tmp_path / "bare"  # an import path with pdps alone
    bare.mkdir()
    (bare / "pdps").symlink_to(Path(pdps.__file__).parent)
    env = {**os.environ, "PYTHONPATH": str(bare), "OMP_NUM_THREADS": "1"}
    probe = subprocess.run([sys.executable, "-c", f"import tests.integration.{Path(__file__).stem}"], cwd=bare, env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "No module named 'tests'" in probe.stderr, probe.stderr

    common = ("--store", etcd_server.url, "--job", name)
    pservers, transport = [], GrpcTransport(connect_timeout=5)
    master = Master(store, transport, ParquetSource(data), config, address="grpc://127.0.0.1:0")
    try:
        for i in range(2):
            with (tmp_path / f"pserver-{i}.log").open("w") as err:
                pservers.append(subprocess.Popen([sys.executable, "-m", "pdps", "pserver", *common], cwd=bare, env=env, stdout=subprocess.DEVNULL, stderr=err))
        master.start()
        # the master and the trainer run here, over the same gRPC and etcd
        ctx = pdps.TrainerContext(store, transport, TorchCompute("cpu"), ParquetSource(data), config, trainer_id="t0")
        ctx.register()
        try:
            assert train(ctx)["steps"] == ROWS // BATCH
        finally:
            ctx.leave()
        got = pdps.fetch_parameters(store, transport, config)
    finally:
        master.stop()
        for p in pservers:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
        for i in range(len(pservers)):
            print(f"--- pserver {i} ---\n{(tmp_path / f'pserver-{i}.log').read_text()[-3000:]}")
        store.close()

    model = target_model()
    opt = Lion(model.parameters(), **LION)
    for k in range(ROWS // BATCH):
        opt.zero_grad()
        rows = slice(k * BATCH, (k + 1) * BATCH)
        F.mse_loss(model(torch.from_numpy(x[rows])), torch.from_numpy(y[rows])).backward()
        opt.step()
    for n, w in model.named_parameters():
        torch.testing.assert_close(got[n], w.detach(), rtol=0, atol=1e-10, msg=lambda m, n=n: f"{n}: {m}")
    assert any(not torch.equal(w, target_model().state_dict()[n]) for n, w in got.items())
