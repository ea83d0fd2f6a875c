"""Every request of the wire protocol, made bad field by field, against a live pserver
and a live master over both transports (in-process and gRPC on 127.0.0.1).

A valid request of each class is mutated (:mod:`tests.wire_cases`: a field of the
wrong kind, left out, out of range; a malformed row section; tensors too few, too
many or misshapen). Each
mutation is refused with the typed error naming the field; the server keeps serving
(a good request right after succeeds) and its state is unchanged (the pserver's
update count, open round and parameters; the master's task counts).
"""

from __future__ import annotations

import json

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pdps
from pdps.adapters.grpc_transport import GrpcTransport
from pdps.adapters.inproc import InprocTransport
from pdps.core import wire
from pdps.core.errors import BadRequest, GradientRejected, SlotMapChanged
from pdps.core.job import Keys
from pdps.core.tasks import TaskSpec
from pdps.ports.transport import Message
from pdps.roles import calls
from tests.integration.jobkit import start_job
from tests.wire_cases import Mutation, mutations

pytestmark = pytest.mark.integration

FUZZ = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ADDRESSES = {"inproc": "inproc://", "grpc": "grpc://127.0.0.1:0"}
TIMEOUT = 10.0
SLOT_MAP = 1  # the version of the job's slot map: never resized here


class Source:
    url = "memory://wire-fuzz"

    def tasks(self) -> list[TaskSpec]:
        return [TaskSpec(i, "memory://wire-fuzz", i, 8) for i in range(4)]


@pytest.fixture(scope="module", params=list(ADDRESSES))
def live(request):
    """One async job per transport: a master, a pserver initialized by a trainer, and
    channels to both."""
    transport = InprocTransport() if request.param == "inproc" else GrpcTransport()
    name = f"wire-fuzz-{request.param}"
    job = start_job(Source(), transport=transport, address=ADDRESSES[request.param], name=name, mode="async", min_block=16)
    ctx = job.trainer("t0")
    ctx.attach(torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)))
    part = ctx._group.parts[0]
    ps_channel = transport.connect(json.loads(job.store.get(Keys(name).pserver(0)).value)["addr"])
    master_channel = transport.connect(job.master.address)
    yield job, ctx, part, ps_channel, master_channel
    ps_channel.close()
    master_channel.close()
    job.close()


def pserver_state(job, channel) -> tuple:
    """Update count, open round, and the parameters' bits (read by a good request)."""
    reply = calls.call(channel, wire.PullRequest("t0", version=SLOT_MAP), timeout=TIMEOUT)
    return job.ps.version, job.ps.round_no, [t.clone().view(torch.uint8) for t in reply.tensors]


def same(a: tuple, b: tuple) -> bool:
    return a[:2] == b[:2] and len(a[2]) == len(b[2]) and all(torch.equal(x, y) for x, y in zip(a[2], b[2]))


def valid_pserver_request(cls: type[wire.Request], job, part) -> wire.Request:
    """A request of ``cls`` the pserver would take as it is now."""
    common = {"epoch": job.ps.epoch, "version": SLOT_MAP}
    values = [torch.full(b.shape, 0.5, dtype=getattr(torch, b.dtype)) for b in part.blocks]
    if cls is wire.InitRequest:
        return wire.InitRequest("t0", **common, tensors=values)
    if cls is wire.PushRequest:
        return wire.PushRequest("t0", **common, updates=job.ps.version, samples=4, blocks=tuple(part.keys), tensors=values)
    if cls is wire.PullRequest:  # with a row section (refused after decoding until the pserver holds tables)
        return wire.PullRequest("t0", **common, blocks=tuple(part.keys), tables=(("emb", 2),), tensors=(torch.tensor([3, 9]),))
    if cls is wire.ReplicateRequest:  # (refused after decoding: this pserver backs up nothing)
        return wire.ReplicateRequest("t0", **common, blocks=tuple(part.keys), part=True, tensors=values, primary=0, seq=1)
    if cls is wire.MigrateRequest:
        return wire.MigrateRequest("t0", **common, slots=(0, 1))
    if cls is wire.RuleRequest:
        from tests.unit.test_updategraph import sgd_momentum

        return wire.RuleRequest("t0", **common, rule=sgd_momentum())
    assert cls is wire.AppliedRequest, cls
    return wire.AppliedRequest("t0", **common)


def valid_master_request(cls: type[wire.Request]) -> wire.Request:
    """A request of ``cls`` for a trainer that is not registered (a get_task from it
    would be refused only after decoding)."""
    if cls is wire.GetTaskRequest:
        return wire.GetTaskRequest("stranger", epoch=0, holding=(1,))
    if cls is wire.CheckpointRequest:
        return wire.CheckpointRequest("stranger", "ckpt-0-1-ab", epoch=0)
    if cls is wire.FailTaskRequest:
        return wire.FailTaskRequest("stranger", 0, 999, error="boom")
    return cls("stranger", 0, 999)  # type: ignore[call-arg]


def refused(channel, cls: type[wire.Request], mutation: Mutation, request: wire.Request) -> BadRequest:
    meta, tensors = mutation.apply(*request.encode())
    with pytest.raises(BadRequest) as info:
        channel.call(cls.METHOD, Message(meta, tensors), timeout=TIMEOUT)
    if cls in (wire.InitRequest, wire.PushRequest):
        assert isinstance(info.value, GradientRejected)
    return info.value


def pserver_cases() -> st.SearchStrategy:
    return st.sampled_from([(cls, m) for cls in wire.PSERVER_REQUESTS for m in mutations(cls)])


def master_cases() -> st.SearchStrategy:
    return st.sampled_from([(cls, m) for cls in wire.MASTER_REQUESTS for m in mutations(cls)])


@FUZZ
@given(pserver_cases())
def test_a_bad_pserver_request_is_refused_by_name_and_changes_nothing(live, case):
    job, ctx, part, channel, _ = live
    cls, mutation = case
    before = pserver_state(job, channel)
    error = refused(channel, cls, mutation, valid_pserver_request(cls, job, part))
    if mutation.how == "shape" and mutation.value == "reshape":  # a tensor is named by its parameter, or its table
        assert any(name in str(error) for name in [b.param for b in part.blocks] + ["'emb'"]) and "shape" in str(error), error
    else:
        assert mutation.field in str(error), error
    assert same(pserver_state(job, channel), before)


@FUZZ
@given(master_cases())
def test_a_bad_master_request_is_refused_by_name_and_changes_nothing(live, case):
    job, ctx, part, _, channel = live
    cls, mutation = case
    counts = job.master.counts()
    error = refused(channel, cls, mutation, valid_master_request(cls))
    assert mutation.field in str(error), error
    assert job.master.counts() == counts
    good = calls.call(channel, wire.FinishTaskRequest("t0", 0, 999), timeout=TIMEOUT)  # an attempt that never was: ignored
    assert good.accepted is False and job.master.counts() == counts


def test_the_valid_requests_are_taken(live):
    """The baseline: the unmutated requests change what the refusals must not."""
    job, ctx, part, ps_channel, master_channel = live
    before = pserver_state(job, ps_channel)
    reply = calls.call(ps_channel, valid_pserver_request(wire.PushRequest, job, part), timeout=TIMEOUT)
    assert reply.updates == job.ps.version == before[0] + 1
    assert not same(pserver_state(job, ps_channel), before)
    ctx.register()
    pending = job.master.counts().pending
    task = calls.call(master_channel, wire.GetTaskRequest("t0", epoch=0, holding=()), timeout=TIMEOUT)
    assert task.task is not None and job.master.counts().pending == pending + 1
    assert calls.call(master_channel, wire.FinishTaskRequest("t0", task.task.id, task.attempt), timeout=TIMEOUT).accepted


def test_a_request_for_another_slot_map_is_refused_naming_both_versions(live):
    job, ctx, part, channel, _ = live
    before = pserver_state(job, channel)
    for cls in wire.PSERVER_REQUESTS:
        request = attrs.evolve(valid_pserver_request(cls, job, part), version=SLOT_MAP + 1)
        with pytest.raises(SlotMapChanged, match=rf"{cls.METHOD} from trainer 't0' was computed for slot map version 2, but pserver 0 serves version 1"):
            channel.call(cls.METHOD, calls.message(request), timeout=TIMEOUT)
    assert same(pserver_state(job, channel), before)


def test_the_errors_are_exported():
    assert pdps.BadRequest is BadRequest and pdps.SlotMapChanged is SlotMapChanged
