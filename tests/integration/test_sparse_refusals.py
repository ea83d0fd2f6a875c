"""Bad row sections sent straight to a real pserver (inproc and gRPC): each refused with
a clear error, the pserver keeps serving, and neither a row nor a dense value moved; a
valid push then changes them (so the comparison can fail)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pdps
from pdps.adapters.grpc_transport import GrpcTransport
from pdps.adapters.inproc import InprocTransport
from pdps.adapters.memory_store import MemoryStore
from pdps.adapters.torch_compute import TorchCompute
from pdps.core.errors import BadRequest, GradientRejected
from pdps.core.wire import PullRequest, PushRequest
from pdps.roles.master import publish_job
from pdps.roles.pserver import Pserver
from pdps.shell.sim import fetch_parameters

pytestmark = pytest.mark.integration

ROWS, DIM, LIMIT = 1000, 8, 16


class Source:
    url = "memory://none"

    def tasks(self):
        return []


@pytest.fixture(scope="module", params=["inproc", "grpc"])
def served(request):
    store = MemoryStore()
    config = pdps.JobConfig(name="refusals", mode="async", pservers=1, optimizer="SGD", optimizer_args={"lr": 0.1}, sparse_max_ids=LIMIT, num_slots=16)
    publish_job(store, config)
    transport = InprocTransport() if request.param == "inproc" else GrpcTransport()
    address = "inproc://refusals" if request.param == "inproc" else "grpc://127.0.0.1:0"
    ps = Pserver(store, transport, TorchCompute("cpu"), config, address=address)
    ps.start()
    model = nn.Sequential(nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True), nn.Linear(DIM, 1))
    ctx = pdps.TrainerContext(store, transport, TorchCompute("cpu"), Source(), config, trainer_id="t0")
    ctx.attach(model)
    yield ctx, ps, (store, transport, config)
    ctx.leave()
    ps.stop()
    store.close()


def state(served) -> tuple[dict, int]:
    ctx, ps, (store, transport, config) = served
    params = fetch_parameters(store, transport, config)
    table = params.pop("0.weight")
    return {"ids": table.ids.clone(), "values": table.values.clone(), **{k: v.clone() for k, v in params.items()}}, ps.version


def push(served, ids, grads) -> None:
    ctx, _, _ = served
    group = ctx._group
    part = group.parts[0]
    pulled = group.ask(part, PullRequest("t0", epoch=ctx._epoch, version=group.layout.slot_map.version))
    dense = [torch.zeros(b.shape) for b in part.blocks]
    group.ask(part, PushRequest(
        "t0", epoch=ctx._epoch, version=group.layout.slot_map.version, updates=pulled.updates, blocks=tuple(part.keys),
        tables=(("0.weight", len(ids)),), tensors=(*dense, ids, grads),
    ))


BAD = {
    "float ids": (torch.tensor([1.0, 2.0]), torch.ones(2, DIM), "float32 ids: ids travel as int64"),
    "negative id": (torch.tensor([-1, 2]), torch.ones(2, DIM), f"id -1 is outside the table's [0, {ROWS})"),
    "too many ids": (torch.arange(LIMIT + 1), torch.ones(LIMIT + 1, DIM), f"{LIMIT + 1} ids in one section, more than sparse_max_ids = {LIMIT}"),
    "NaN row": (torch.tensor([3, 4]), torch.tensor([[0.0] * DIM, [float("nan")] * DIM]), "the gradient of id 4 is not finite"),
    "wrong width": (torch.tensor([3, 4]), torch.ones(2, DIM - 1), f"width {DIM - 1}) for table '0.weight' of width {DIM}"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_row_section_is_refused_and_changes_nothing(served, case):
    ids, grads, says = BAD[case]
    before, version = state(served)
    with pytest.raises(GradientRejected) as refused:
        push(served, ids, grads)
    assert says in str(refused.value) and "nothing was applied" in str(refused.value)
    after, version_after = state(served)
    assert version_after == version
    for k in before:
        assert torch.equal(before[k], after[k]), k


def test_a_pull_of_float_ids_is_refused(served):
    ctx, _, _ = served
    group = ctx._group
    with pytest.raises(BadRequest, match="float32 ids: ids travel as int64"):
        group.ask(group.parts[0], PullRequest("t0", epoch=ctx._epoch, version=group.layout.slot_map.version, blocks=(), tables=(("0.weight", 2),), tensors=(torch.tensor([1.0, 2.0]),)))


def test_a_valid_section_does_change_the_rows(served):
    ctx, _, (store, transport, config) = served
    _, version = state(served)
    ids = torch.tensor([3, 4])
    start = fetch_parameters(store, transport, config)["0.weight"].lookup(ids)
    push(served, ids, torch.ones(2, DIM))
    _, version_after = state(served)
    assert version_after == version + 1
    rows = fetch_parameters(store, transport, config)["0.weight"]
    torch.testing.assert_close(rows.lookup(ids), start - 0.1, rtol=0, atol=1e-6)  # SGD, lr 0.1, gradient 1
