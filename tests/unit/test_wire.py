"""The typed wire protocol: every class survives its encoding, every bad field is refused by name."""

from __future__ import annotations

import inspect

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdps.core import wire
from pdps.core.errors import BadRequest, GradientRejected
from pdps.core.slots import Block
from pdps.core.tasks import TaskSpec
from pdps.ports.transport import Message
from tests.wire_cases import mutations
from tests.unit.test_updategraph import sgd_momentum

BLOCKS = [
    Block("w", 0, 0, 2, 0, 6, (2, 3), "float32"),
    Block("w", 0, 2, 4, 6, 6, (2, 3), "float32"),
    Block("b", 1, 0, 3, 12, 3, (3,), "float32"),
]
KEYS = tuple(b.key for b in BLOCKS)
STATE = {"round_no": 3, "updates": 7, "epoch": 1, "incarnation": "abc123"}


def grads(blocks=BLOCKS) -> tuple[torch.Tensor, ...]:
    return tuple(torch.ones(b.shape) for b in blocks)


IDS = torch.tensor([3, 9], dtype=torch.int64)  # table "emb" (dim 4) of the pull sample


def rows(n: int, dim: int = 4, fill: float = 0.5) -> torch.Tensor:
    return torch.full((n, dim), fill)


#: one instance of every class, its optional fields set
SAMPLES: dict[type, wire.Wire] = {
    wire.InitRequest: wire.InitRequest("t0", epoch=1, version=2, tensors=grads()),
    wire.PushRequest: wire.PushRequest("t0", epoch=1, version=2, samples=4, round_no=3, updates=7, records=(0, 5, 1, 0, 8), incarnation="abc123", blocks=KEYS, tensors=grads()),
    wire.PullRequest: wire.PullRequest("t0", epoch=1, version=2, after_round=3, slice_s=5.0, blocks=KEYS[:2], tables=(("emb", 2),), tensors=(IDS,)),
    wire.AppliedRequest: wire.AppliedRequest("t0", epoch=1, version=2),
    wire.RuleRequest: wire.RuleRequest("t0", rule=sgd_momentum()),
    wire.MigrateRequest: wire.MigrateRequest("t0", epoch=1, version=3, slots=(4, 9)),
    wire.ReplicateRequest: wire.ReplicateRequest(
        "t0", epoch=1, version=2, samples=4, round_no=3, blocks=KEYS[:2], part=True, tables=(("emb", 2),), created=(("emb", 3),), steps=(("emb", 12),),
        tensors=(*grads()[:2], IDS, rows(2), torch.tensor([3, 9, 12]), rows(3)),
    ),
    wire.GetTaskRequest: wire.GetTaskRequest("t0", epoch=1, holding=(4, 5)),
    wire.FinishTaskRequest: wire.FinishTaskRequest("t0", 4, 2),
    wire.FailTaskRequest: wire.FailTaskRequest("t0", 4, 2, error="boom"),
    wire.GiveBackRequest: wire.GiveBackRequest("t0", 4, 2),
    wire.CheckpointRequest: wire.CheckpointRequest("t0", "ckpt-1-4-ab", epoch=1),
    wire.InitReply: wire.InitReply(**STATE),
    wire.PushReply: wire.PushReply(**STATE, update_s=0.25, duplicate=True),
    wire.PullReply: wire.PullReply(**STATE, wait_s=0.5, waiting=("t1", "t2"), checkpoint="ckpt-1-4-ab", tables=(("emb", 2),), tensors=(*grads(), rows(2))),
    wire.RuleReply: wire.RuleReply(**STATE, digest="ab" * 32, runs=True),
    wire.AppliedReply: wire.AppliedReply(**STATE, ledger=((4, 2, 0, 8), (5, 1, 8, 16)), slots=((0, 7), (3, 9))),
    wire.MigrateReply: wire.MigrateReply(**STATE, names=("w@0:4/values", "w@0:4/state.exp_avg"), more=True, tensors=(torch.zeros(8), torch.ones(8))),
    wire.GetTaskReply: wire.GetTaskReply(task=TaskSpec(4, "file:///d/0.parquet", 1, 64), attempt=2, pass_no=0, offset=8, epoch=1),
    wire.ReportReply: wire.ReportReply(accepted=False, reason="attempt 2 is not current"),
    wire.CheckpointReply: wire.CheckpointReply(accepted=True, epoch=1),
}
REQUESTS = [cls for cls in SAMPLES if issubclass(cls, wire.Request)]
#: more instances: the forms of a class that exclude each other's fields
VARIANTS: list[wire.Wire] = [
    wire.PushRequest("t0", updates=7, blocks=KEYS, tables=(("emb", 2), ("tags", 0)), tensors=(*grads(), IDS, rows(2), IDS[:0], rows(0, 8))),
    wire.PullRequest("t0", blocks=(), tables=(("emb", 2),), tensors=(IDS,)),
    wire.PullRequest("t0", after_round=3, dump=("emb", 17, 4096, 1024)),
    wire.PullReply(**STATE, more=False, tensors=(IDS, rows(2))),
    wire.MigrateRequest("t0", version=3, slots=(9,), row_offset=65536),
]


def test_every_class_of_the_protocol_has_a_sample():
    classes = {c for _, c in inspect.getmembers(wire, inspect.isclass) if issubclass(c, wire.Wire) and attrs_has_fields(c) and not c.__subclasses__()}
    assert classes - set(SAMPLES) == set()
    assert set(wire.PSERVER_REQUESTS) | set(wire.MASTER_REQUESTS) == set(REQUESTS)


def attrs_has_fields(cls) -> bool:
    return hasattr(cls, "__attrs_attrs__") and bool(cls.__attrs_attrs__)


@pytest.mark.parametrize("sample", [*SAMPLES.values(), *VARIANTS], ids=lambda s: type(s).__name__)
def test_round_trip(sample):
    cls = type(sample)
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


# --- row sections (sparse tables) ------------------------------------------------------


def table_push(tables=(("emb", 2), ("tags", 0)), blocks=KEYS, **fields) -> wire.PushRequest:
    """A push of every block of BLOCKS and the row sections of ``tables`` (ids 0..n-1, dim 4)."""
    sections = [t for name, n in tables for t in (torch.arange(n), rows(n))]
    dense = grads([b for b in BLOCKS if b.key in blocks])
    meta = {"trainer": "t0", "updates": 0, "blocks": list(blocks), "tables": [list(p) for p in tables], **fields}
    return wire.PushRequest.decode(Message(meta, [*dense, *sections]))


def test_a_push_splits_its_tensors_into_dense_ones_and_row_sections():
    request = table_push()
    assert request.tables == (("emb", 2), ("tags", 0))
    assert all(a is b for a, b in zip(request.dense_tensors, request.tensors[:3], strict=True))
    (emb, ids, g), (tags, tag_ids, tag_g) = request.row_sections
    assert (emb, tags) == ("emb", "tags")
    assert ids is request.tensors[3] and g is request.tensors[4] and tag_ids is request.tensors[5] and tag_g is request.tensors[6]
    assert ids.dtype == torch.int64 and ids.tolist() == [0, 1] and tuple(g.shape) == (2, 4) and tuple(tag_g.shape) == (0, 4)


def test_claim_checks_the_dense_tensors_only_when_a_push_carries_rows():
    assert table_push().claim(BLOCKS, 0) is None
    some = table_push(blocks=(KEYS[0], KEYS[2]), part=True)
    assert some.claim(BLOCKS, 0) == [0, 2]
    rows_only = table_push(blocks=(), part=True)  # a pserver's part of no block, its rows
    assert rows_only.dense_tensors == () and rows_only.claim(BLOCKS, 0) == [] and len(rows_only.row_sections) == 2
    with pytest.raises(GradientRejected, match=r"w\[0:2\] from trainer 't0' has shape \(3, 2\) but the block is \(2, 3\)"):
        bad = table_push()
        wire.PushRequest.decode(Message(bad.encode()[0], [bad.tensors[0].reshape(3, 2), *bad.tensors[1:]])).claim(BLOCKS, 0)


def test_a_request_without_tables_is_what_it_was():
    meta, tensors = SAMPLES[wire.PushRequest].encode()
    assert "tables" not in meta and "created" not in meta
    old = wire.PushRequest.decode(Message(meta, tensors))
    assert old.tables is None and old.row_sections == [] and len(old.dense_tensors) == len(tensors) == 3
    pull = wire.PullRequest.decode(Message({"trainer": "t0", "blocks": list(KEYS)}))
    assert pull.tables is None and pull.dump is None and pull.row_sections == [] and "tables" not in pull.encode()[0]
    reply = wire.PullReply.decode(Message({"round": 1, "updates": 2, "epoch": 0, "incarnation": "i"}, grads()))
    assert reply.tables is None and reply.more is None and len(reply.dense_tensors) == 3 and reply.table_rows == []
    assert reply.ids is None and reply.values is None


@pytest.mark.parametrize(
    "tables,tensors,field,match",
    [
        ([["emb", 2]], lambda d, ids, g: [*d, ids], "tables", r"got 4 tensors for 3 blocks and row sections 1 in 'tables' \(2 tensors each\)"),
        ([["emb", 2]], lambda d, ids, g: [*d, ids, g, g], "tables", "got 6 tensors for 3 blocks"),
        ([["emb", 2]], lambda d, ids, g: [*d[:2], ids, g], "tables", "got 4 tensors for 3 blocks"),
        ([["emb", 3]], lambda d, ids, g: [*d, ids, g], "tables", r"table 'emb' in field 'tables' has n=3 rows but its ids tensor has shape \(2,\)"),
        ([["emb", 2]], lambda d, ids, g: [*d, ids, g[:1]], "tables", r"n=2 rows but its grads tensor has shape \(1, 4\)"),
        ([["emb", 2]], lambda d, ids, g: [*d, torch.tensor(7), g], "tables", r"its ids tensor has shape \(\)"),
        ([["emb", 2]], lambda d, ids, g: [*d, [0, 1], g], "tables", "its ids tensor has shape list"),
        ([["emb", 2], ["emb", 2]], lambda d, ids, g: [*d, ids, g, ids, g], "tables", "names table 'emb' more than once"),
        ([["emb", -2]], lambda d, ids, g: list(d), "tables", r"must be \[table, n\] pairs"),
        ([["", 0]], lambda d, ids, g: list(d), "tables", r"must be \[table, n\] pairs"),
        ([["emb", 2, 4]], lambda d, ids, g: [*d, ids, g], "tables", r"must be \[table, n\] pairs"),
    ],
)
def test_a_malformed_row_section_is_refused_on_decode_naming_the_table(tables, tensors, field, match):
    meta = {"trainer": "t0", "updates": 0, "blocks": list(KEYS), "tables": tables}
    with pytest.raises(GradientRejected, match=match) as info:
        wire.PushRequest.decode(Message(meta, tensors(grads(), IDS, rows(2))))
    assert info.value.field == field and info.value.trainer == "t0" and "push from trainer 't0'" in str(info.value)


def test_a_push_of_no_named_blocks_finds_its_dense_tensors_before_the_sections():
    request = wire.PushRequest.decode(Message({"trainer": "t0", "updates": 0, "tables": [["emb", 2]]}, [*grads(), IDS, rows(2)]))
    assert len(request.dense_tensors) == 3 and request.row_sections[0][1] is request.tensors[3]
    with pytest.raises(GradientRejected, match="does not name its blocks"):
        request.claim(BLOCKS, 0)
    with pytest.raises(GradientRejected, match="got 1 tensors for its blocks"):
        wire.PushRequest.decode(Message({"trainer": "t0", "updates": 0, "tables": [["emb", 2]]}, [IDS]))


def test_a_forward_carries_the_rows_the_primary_created_after_the_sections():
    sample = SAMPLES[wire.ReplicateRequest]
    back = wire.ReplicateRequest.decode(Message(*sample.encode()))
    assert len(back.dense_tensors) == 2 and [name for name, _, _ in back.row_sections] == ["emb"]
    [(name, ids, values)] = back.created_rows
    assert name == "emb" and ids.tolist() == [3, 9, 12] and tuple(values.shape) == (3, 4)
    assert back.claim(BLOCKS, 1) == [0, 1]
    meta, tensors = sample.encode()
    for cut, field in [(-1, "created"), (-2, "created"), (-3, "tables")]:
        with pytest.raises(GradientRejected) as info:
            wire.ReplicateRequest.decode(Message(meta, tensors[:cut]))
        assert info.value.field == field
    with pytest.raises(GradientRejected, match="table 'emb' in field 'created' has n=3 rows but its values tensor has shape") as info:
        wire.ReplicateRequest.decode(Message(meta, [*tensors[:-1], rows(2)]))
    assert back.steps == (("emb", 12),)  # async: the primary's table step the backup applies the section at
    for bad in ([["emb", 0]], [["emb"]], [["", 3]], [["emb", 2.5]]):
        with pytest.raises(GradientRejected, match="field 'steps' must be \\[table, step\\] pairs") as info:
            wire.ReplicateRequest.decode(Message({**meta, "steps": bad}, tensors))
        assert info.value.field == "steps"


def test_a_pull_of_rows_only_and_its_reply():
    request = wire.PullRequest.decode(Message({"trainer": "t0", "blocks": [], "tables": [["emb", 2], ["tags", 0]]}, [IDS, IDS[:0]]))
    assert request.claim(BLOCKS, 0) == []
    assert [(name, ids.tolist(), none) for name, ids, none in request.row_sections] == [("emb", [3, 9], None), ("tags", [], None)]
    reply = wire.PullReply.decode(Message({**wire.PullReply(**STATE).encode()[0], "tables": [["emb", 2], ["tags", 0]]}, [rows(2), rows(0)]))
    assert reply.dense_tensors == () and [(n, tuple(r.shape)) for n, r in reply.table_rows] == [("emb", (2, 4)), ("tags", (0, 4))]
    full = SAMPLES[wire.PullReply]
    assert len(full.dense_tensors) == 3 and full.table_rows[0][1] is full.tensors[3]


@pytest.mark.parametrize(
    "meta,tensors,field,match",
    [
        ({"tables": [["emb", 2]]}, [], "tables", "names 1 tables but the request carries 0 tensors: one ids tensor per table"),
        ({"tables": [["emb", 2]]}, [IDS, IDS], "tables", "carries 2 tensors"),
        ({}, [IDS], "tables", "names 0 tables but the request carries 1 tensors"),
        ({"tables": [["emb", 2]]}, [IDS[:, None].expand(2, 2)[:1]], "tables", r"n=2 rows but its ids tensor has shape \(1, 2\)"),
        ({"dump": ["emb", 0, 0, 10], "tables": [["emb", 2]]}, [IDS], "dump", "a 'dump' pulls one table's rows and nothing else"),
        ({"dump": ["emb", 0, 0, 10], "blocks": []}, [], "dump", "nothing else"),
        ({"dump": ["emb", 0, 0, 0]}, [], "dump", r"must be \[table, slot, offset, limit\]"),
        ({"dump": ["emb", 0, 0]}, [], "dump", r"must be \[table, slot, offset, limit\]"),
    ],
)
def test_a_malformed_pull_of_rows_is_refused(meta, tensors, field, match):
    with pytest.raises(BadRequest, match=match) as info:
        wire.PullRequest.decode(Message({"trainer": "t0", **meta}, tensors))
    assert info.value.field == field and "pull from trainer 't0'" in str(info.value)


def test_a_dump_pages_through_a_slots_rows():
    request = wire.PullRequest.decode(Message({"trainer": "t0", "dump": ["emb", 17, 4096, 1024]}))
    assert request.dump == ("emb", 17, 4096, 1024) and request.encode()[0]["dump"] == ["emb", 17, 4096, 1024]
    page = wire.PullReply.decode(Message({**wire.PullReply(**STATE).encode()[0], "more": True}, [IDS, rows(2)]))
    assert page.more is True and page.ids is page.tensors[0] and page.values is page.tensors[1] and page.dense_tensors == () and page.table_rows == []
    last = wire.PullReply.decode(Message({**wire.PullReply(**STATE).encode()[0], "more": False}, [IDS[:0], rows(0)]))
    assert last.more is False and last.ids.numel() == 0
    for tensors, extra in [([IDS], {}), ([IDS, rows(3)], {}), ([torch.tensor(1), rows(1)], {}), ([IDS, rows(2)], {"tables": [["emb", 2]]})]:
        with pytest.raises(BadRequest, match="a dump's page") as info:
            wire.PullReply.decode(Message({**wire.PullReply(**STATE).encode()[0], "more": True, **extra}, tensors))
        assert info.value.field == "more"


def test_a_reply_with_fewer_tensors_than_tables_is_refused():
    with pytest.raises(BadRequest, match="names 2 tables but the reply carries 1 tensors") as info:
        wire.PullReply.decode(Message({**wire.PullReply(**STATE).encode()[0], "tables": [["emb", 2], ["tags", 0]]}, [rows(2)]))
    assert info.value.field == "tables"
    with pytest.raises(BadRequest, match=r"table 'emb' in field 'tables' has n=2 rows but its rows tensor has shape \(3, 4\)"):
        wire.PullReply.decode(Message({**wire.PullReply(**STATE).encode()[0], "tables": [["emb", 2]]}, [*grads(), rows(3)]))


def test_a_migration_of_rows_is_paged_one_slot_at_a_time():
    assert wire.MigrateRequest.decode(Message({"trainer": "ps-1", "version": 3, "slots": [9], "row_offset": 65536})).row_offset == 65536
    assert wire.MigrateRequest.decode(Message({"trainer": "ps-1", "version": 3, "slots": [4, 9]})).row_offset is None
    with pytest.raises(BadRequest, match="'row_offset' pages the rows of one slot, but 'slots' names 2") as info:
        wire.MigrateRequest.decode(Message({"trainer": "ps-1", "version": 3, "slots": [4, 9], "row_offset": 0}))
    assert info.value.field == "row_offset"
    reply = wire.MigrateReply.decode(Message({**wire.MigrateReply(**STATE).encode()[0]}))
    assert reply.more is False and "more" in wire.MigrateReply(**STATE, more=True).encode()[0]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(0, 5), max_size=4),  # rows per table
    st.integers(0, 3),  # dense blocks
    st.data(),
)
def test_any_layout_of_sections_splits_back_and_any_cut_tensor_is_refused(counts, nblocks, data):
    blocks = BLOCKS[:nblocks]
    tables = [(f"t{i}", n) for i, n in enumerate(counts)]
    sections = [t for name, n in tables for t in (torch.arange(n) + 100 * int(name[1:]), rows(n, 3))]
    tensors = [*grads(blocks), *sections]
    meta = {"trainer": "t0", "updates": 0, "blocks": [b.key for b in blocks], "tables": [list(p) for p in tables]}
    request = wire.PushRequest.decode(Message(meta, tensors))
    assert len(request.dense_tensors) == nblocks
    assert [(name, ids.tolist(), tuple(g.shape)) for name, ids, g in request.row_sections] == [
        (name, [100 * i + k for k in range(n)], (n, 3)) for i, (name, n) in enumerate(tables)
    ]
    if not tensors:
        return
    drop = data.draw(st.integers(0, len(tensors) - 1), label="tensor dropped")
    with pytest.raises(GradientRejected) as info:
        wire.PushRequest.decode(Message(meta, tensors[:drop] + tensors[drop + 1 :]))
    assert info.value.field == "tables"
