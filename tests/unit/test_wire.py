"""The typed wire protocol: every class survives its encoding, every bad field is refused by name."""

from __future__ import annotations

import inspect

import attrs
import pytest
import torch

from pdps.core import wire
from pdps.core.errors import BadRequest, GradientRejected
from pdps.core.slots import Block
from pdps.core.tasks import TaskSpec
from pdps.ports.transport import Message
from tests.wire_cases import mutations

BLOCKS = [
    Block("w", 0, 0, 2, 0, 6, (2, 3), "float32"),
    Block("w", 0, 2, 4, 6, 6, (2, 3), "float32"),
    Block("b", 1, 0, 3, 12, 3, (3,), "float32"),
]
KEYS = tuple(b.key for b in BLOCKS)
STATE = {"round_no": 3, "updates": 7, "epoch": 1, "incarnation": "abc123"}


def grads(blocks=BLOCKS) -> tuple[torch.Tensor, ...]:
    return tuple(torch.ones(b.shape) for b in blocks)


#: one instance of every class, its optional fields set
SAMPLES: dict[type, wire.Wire] = {
    wire.InitRequest: wire.InitRequest("t0", epoch=1, version=2, tensors=grads()),
    wire.PushRequest: wire.PushRequest("t0", epoch=1, version=2, samples=4, round_no=3, updates=7, records=(0, 5, 1, 0, 8), incarnation="abc123", blocks=KEYS, tensors=grads()),
    wire.PullRequest: wire.PullRequest("t0", epoch=1, version=2, after_round=3, slice_s=5.0, blocks=KEYS[:2]),
    wire.AppliedRequest: wire.AppliedRequest("t0", epoch=1, version=2),
    wire.MigrateRequest: wire.MigrateRequest("t0", epoch=1, version=3, slots=(4, 9)),
    wire.ReplicateRequest: wire.ReplicateRequest("t0", epoch=1, version=2, samples=4, round_no=3, blocks=KEYS[:2], part=True, tensors=grads()[:2]),
    wire.GetTaskRequest: wire.GetTaskRequest("t0", epoch=1, holding=(4, 5)),
    wire.FinishTaskRequest: wire.FinishTaskRequest("t0", 4, 2),
    wire.FailTaskRequest: wire.FailTaskRequest("t0", 4, 2, error="boom"),
    wire.GiveBackRequest: wire.GiveBackRequest("t0", 4, 2),
    wire.CheckpointRequest: wire.CheckpointRequest("t0", "ckpt-1-4-ab", epoch=1),
    wire.InitReply: wire.InitReply(**STATE),
    wire.PushReply: wire.PushReply(**STATE, update_s=0.25, duplicate=True),
    wire.PullReply: wire.PullReply(**STATE, wait_s=0.5, waiting=("t1", "t2"), checkpoint="ckpt-1-4-ab", tensors=grads()),
    wire.AppliedReply: wire.AppliedReply(**STATE, ledger=((4, 2, 0, 8), (5, 1, 8, 16)), slots=((0, 7), (3, 9))),
    wire.MigrateReply: wire.MigrateReply(**STATE, names=("w@0:4/values", "w@0:4/state.exp_avg"), tensors=(torch.zeros(8), torch.ones(8))),
    wire.GetTaskReply: wire.GetTaskReply(task=TaskSpec(4, "file:///d/0.parquet", 1, 64), attempt=2, pass_no=0, offset=8, epoch=1),
    wire.ReportReply: wire.ReportReply(accepted=False, reason="attempt 2 is not current"),
    wire.CheckpointReply: wire.CheckpointReply(accepted=True, epoch=1),
}
REQUESTS = [cls for cls in SAMPLES if issubclass(cls, wire.Request)]


def test_every_class_of_the_protocol_has_a_sample():
    classes = {c for _, c in inspect.getmembers(wire, inspect.isclass) if issubclass(c, wire.Wire) and attrs_has_fields(c) and not c.__subclasses__()}
    assert classes - set(SAMPLES) == set()
    assert set(wire.PSERVER_REQUESTS) | set(wire.MASTER_REQUESTS) == set(REQUESTS)


def attrs_has_fields(cls) -> bool:
    return hasattr(cls, "__attrs_attrs__") and bool(cls.__attrs_attrs__)


@pytest.mark.parametrize("cls", list(SAMPLES), ids=lambda c: c.__name__)
def test_round_trip(cls):
    sample = SAMPLES[cls]
    meta, tensors = sample.encode()
    import json

    assert json.loads(json.dumps(meta)) == meta  # JSON-safe, nothing lost
    back = cls.decode(Message(meta, tensors))
    assert back == sample
    assert len(getattr(back, "tensors", ())) == len(getattr(sample, "tensors", ()))
    assert all(a is b for a, b in zip(getattr(back, "tensors", ()), getattr(sample, "tensors", ())))


def test_none_is_not_sent_and_an_absent_key_is_its_default():
    meta, _ = wire.GetTaskReply(wait="no task", retry_in=0.5, epoch=0).encode()
    assert "task" not in meta and meta["wait"] == "no task"
    assert wire.PullRequest.decode(Message({"trainer": "t0"})) == wire.PullRequest("t0")


def test_keys_the_class_does_not_define_are_ignored():
    """Keys a class does not define are ignored (a newer peer may send more)."""
    assert wire.AppliedRequest.decode(Message({"trainer": "t0", "timeout": 5, "later": [1]})) == wire.AppliedRequest("t0")


def test_version_is_the_slot_map_and_updates_the_update_count():
    meta, _ = SAMPLES[wire.PushRequest].encode()
    assert meta["version"] == 2 and meta["updates"] == 7
    assert "version" not in SAMPLES[wire.PushReply].encode()[0] and SAMPLES[wire.PushReply].encode()[0]["updates"] == 7


CASES = [(cls, m) for cls in REQUESTS for m in mutations(cls) if m.how != "shape"]


@pytest.mark.parametrize("cls,mutation", CASES, ids=[f"{c.__name__}-{m.field}-{m.how}-{m.value!r}" for c, m in CASES])
def test_each_bad_field_is_refused_by_name(cls, mutation):
    meta, tensors = mutation.apply(*SAMPLES[cls].encode())
    with pytest.raises(BadRequest) as info:
        cls.decode(Message(meta, tensors))
    assert info.value.field == mutation.field
    assert mutation.field in str(info.value)
    if "trainer" in meta and isinstance(meta["trainer"], str) and meta["trainer"]:
        assert info.value.trainer == "t0" and "'t0'" in str(info.value)
    expected = GradientRejected if cls in (wire.InitRequest, wire.PushRequest) else BadRequest
    assert isinstance(info.value, expected)


def test_every_request_has_mutations_of_each_kind():
    for cls in REQUESTS:
        hows = {m.how for m in mutations(cls)}
        assert {"kind", "missing", "range"} <= hows, cls
    assert any(m.how == "shape" for m in mutations(wire.PushRequest))


def test_meta_that_is_not_an_object_is_refused():
    with pytest.raises(BadRequest, match="meta must be an object"):
        wire.GetTaskRequest.decode(Message(["trainer"]))  # type: ignore[arg-type]


# --- checks against the blocks a pserver holds ----------------------------------------


def push(**fields) -> wire.PushRequest:
    meta = {"trainer": "t0", "updates": 0, "blocks": list(KEYS), **fields}
    return wire.PushRequest.decode(Message(meta, fields.pop("tensors", grads())))


def test_a_whole_push_claims_every_block_in_order():
    assert push().claim(BLOCKS, 0) is None
    with pytest.raises(GradientRejected, match="lacks gradients") as info:
        push(blocks=list(KEYS[:2])).claim(BLOCKS, 0)
    assert info.value.field == "blocks"
    with pytest.raises(GradientRejected, match="out of order"):
        push(blocks=list(reversed(KEYS))).claim(BLOCKS, 0)
    with pytest.raises(GradientRejected, match=r"parameter 'x' \(block 'x@0'\), which pserver 0 does not hold"):
        push(blocks=["x@0", *KEYS[1:]]).claim(BLOCKS, 0)
    with pytest.raises(GradientRejected, match="does not name its blocks"):
        wire.PushRequest.decode(Message({"trainer": "t0"}, grads())).claim(BLOCKS, 0)


def test_a_push_of_some_slots_claims_them_in_order():
    assert push(blocks=[KEYS[0], KEYS[2]], part=True, tensors=grads([BLOCKS[0], BLOCKS[2]])).claim(BLOCKS, 0) == [0, 2]
    with pytest.raises(GradientRejected, match="out of order or more than once"):
        push(blocks=[KEYS[2], KEYS[0]], part=True, tensors=grads([BLOCKS[2], BLOCKS[0]])).claim(BLOCKS, 0)


@pytest.mark.parametrize("cls", [wire.InitRequest, wire.PushRequest], ids=lambda c: c.__name__)
def test_tensors_must_match_the_blocks_they_claim(cls):
    sample = SAMPLES[cls]
    for value, expect in [("drop", "got 2 tensors for 3 blocks"), ("extra", "got 4 tensors for 3 blocks"), ("reshape", r"w\[0:2\] from trainer 't0' has shape")]:
        mutation = next(m for m in mutations(cls) if m.how == "shape" and m.value == value)
        request = cls.decode(Message(*mutation.apply(*sample.encode())))
        with pytest.raises(GradientRejected, match=expect) as info:
            request.claim(BLOCKS, 0) if cls is wire.PushRequest else request.claim(BLOCKS)
        assert info.value.field == "tensors"


def test_a_pull_names_only_blocks_the_pserver_holds():
    assert wire.PullRequest("t0", blocks=KEYS[1:]).claim(BLOCKS, 0) == [1, 2]
    assert wire.PullRequest("t0").claim(BLOCKS, 0) is None
    with pytest.raises(BadRequest, match="'blocks' names blocks pserver 0 does not hold"):
        wire.PullRequest("t0", blocks=("x@0",)).claim(BLOCKS, 0)


def test_a_field_the_mode_needs_is_required_then():
    request = wire.PushRequest.decode(Message({"trainer": "t0", "blocks": list(KEYS)}, grads()))
    with pytest.raises(GradientRejected, match="request names no 'round'") as info:
        request.require("round_no")
    assert info.value.field == "round"
    with pytest.raises(GradientRejected, match="request names no 'updates'"):
        request.require("updates")


def test_a_request_takes_the_calls_deadline_from_the_transport_never_from_the_wire():
    sent = wire.PullRequest("t0", after_round=3, slice_s=5.0)
    meta, tensors = attrs.evolve(sent, deadline=123.0).encode()
    assert "deadline" not in meta and "timeout" not in meta
    received = wire.PullRequest.decode(Message(meta, tensors, deadline=42.0))
    assert received.deadline == 42.0 and received == sent  # the deadline is not part of equality
    assert wire.PullRequest.decode(Message(meta, tensors)).deadline is None
