"""The rules of checkpoints (pdps.core.checkpoints): ids, records, the state table and
the decisions of committing, cleaning up and rolling back, fed what a store would hold."""

from __future__ import annotations

import json

import pytest

from pdps.core import checkpoints
from pdps.core.checkpoints import (
    TRANSITIONS, CheckpointInfo, CommitView, Epoch, Event, Manifest, PartInfo, Pointer, RollbackView, State,
    checkpoint_id, decide_commit, decide_rollback, doomed, is_checkpoint_id, manifest_to_commit, transition,
)  # fmt: skip
from pdps.core.errors import ConfigError, CorruptCheckpoint, CorruptRecord, InvalidTransition
from pdps.core.job import JobConfig, Keys
from pdps.core.txn import Compare, Delete, Done, KeyValue, Put, Write

# --- ids and records (moved from test_checkpoint_files.py with the code) ----------------


def test_checkpoint_ids_sort_by_epoch_then_round():
    ids = [checkpoint_id(e, r, n) for (e, r), n in zip([(0, 0), (0, 9), (0, 10), (1, 0), (12, 3)], [0xFFFF, 7, 0, 0xA, 1])]
    assert ids == sorted(ids)
    assert all(is_checkpoint_id(i) for i in ids)
    assert checkpoint_id(3, 7, 0x9F2C).startswith("ckpt-0003-0000000007-")
    for bad in [(-1, 0), (0, -1), (1.0, 2), (True, 2)]:
        with pytest.raises(ConfigError):
            checkpoint_id(*bad, 0)


@pytest.mark.parametrize(
    "bad",
    [
        None, [], {},
        {"name": "", "path": "p", "bytes": 1, "checksum": "crc32:00000000"},
        {"name": "a", "path": 3, "bytes": 1, "checksum": "crc32:00000000"},
        {"name": "a", "path": "p", "bytes": -1, "checksum": "crc32:00000000"},
        {"name": "a", "path": "p", "bytes": True, "checksum": "crc32:00000000"},
        {"name": "a", "path": "p", "bytes": 1, "checksum": "sha256:00"},
        {"name": "a", "path": "p", "bytes": 1, "checksum": "crc32:0000000G"},
    ],
)  # fmt: skip
def test_part_info_from_json_refuses_bad_records(bad):
    with pytest.raises(CorruptCheckpoint):
        PartInfo.from_json(bad)


def test_part_info_json_round_trip():
    info = PartInfo("ps-0", "ckpt-0000-0000000001-abcd/ps-0.safetensors", 123, "crc32:0badf00d")
    assert PartInfo.from_json(json.loads(json.dumps(info.to_json()))) == info


def _manifest_json(**changes):
    cid = "ckpt-0001-0000000002-abcd"
    d = {
        "format": "pdps-checkpoint", "version": 1, "checksum": "crc32", "id": cid, "job": "j",
        "epoch": 1, "round": 2, "created": 5.5, "extra": {},
        "parts": {"ps-0": {"name": "ps-0", "path": f"{cid}/ps-0.safetensors", "bytes": 8, "checksum": "crc32:00000000"}},
    }  # fmt: skip
    d.update(changes)
    return d


@pytest.mark.parametrize(
    "changes",
    [
        {"format": "x"}, {"version": 2}, {"checksum": "sha256"}, {"id": "x"}, {"job": None},
        {"epoch": -1}, {"round": "2"}, {"created": "now"}, {"created": float("inf")}, {"parts": []},
        {"extra": None},
        {"parts": {"ps-1": {"name": "ps-0", "path": "ckpt-0001-0000000002-abcd/p", "bytes": 8, "checksum": "crc32:00000000"}}},
        {"parts": {"ps-0": {"name": "ps-0", "path": "elsewhere/p", "bytes": 8, "checksum": "crc32:00000000"}}},
    ],
)  # fmt: skip
def test_manifest_from_json_refuses_bad_manifests(changes):
    assert Manifest.from_json(_manifest_json()).round == 2
    with pytest.raises(CorruptCheckpoint):
        Manifest.from_json(_manifest_json(**changes))


def test_a_manifest_keeps_its_parts_in_its_folder():
    info = PartInfo("ps-0", "other/ps-0.safetensors", 1, "crc32:00000000")
    with pytest.raises(ConfigError, match="not inside the folder"):
        Manifest("ckpt-0001-0000000002-abcd", "j", 2, 1, 0.0, {"ps-0": info})


def test_an_id_carries_its_nonce_and_refuses_one_out_of_range():
    assert checkpoint_id(3, 7, 0x9F2C) == "ckpt-0003-0000000007-9f2c"
    assert checkpoints.id_order(checkpoint_id(10_000, 2, 0)) == (10_000, 2, "ckpt-10000-0000000002-0000")
    for bad in (-1, 1 << 16, 1.0, True):
        with pytest.raises(ConfigError, match="nonce"):
            checkpoint_id(0, 0, bad)


# --- pieces ----------------------------------------------------------------------------


CID = "ckpt-0001-0000000002-abcd"


def test_part_info_with_pieces_round_trips_and_older_records_read_without():
    info = PartInfo("ps-0", f"{CID}/ps-0.safetensors", 10, "crc32:0badf00d", pieces=("00000001", "00000002", "00000003"), piece_bytes=4)
    d = json.loads(json.dumps(info.to_json()))
    assert d["piece_bytes"] == 4 and d["pieces"] == ["00000001", "00000002", "00000003"]
    assert PartInfo.from_json(d) == info
    older = PartInfo.from_json({"name": "ps-0", "path": f"{CID}/ps-0.safetensors", "bytes": 10, "checksum": "crc32:0badf00d"})
    assert older.pieces is None and "pieces" not in older.to_json()


@pytest.mark.parametrize(
    "changes",
    [
        {"pieces": "0000000100000002"}, {"pieces": ["1", "2", "3"]}, {"pieces": ["0000000G"] * 3},
        {"pieces": ["00000001"] * 2}, {"pieces": ["00000001"] * 4}, {"piece_bytes": 0}, {"piece_bytes": True},
        {"piece_bytes": None},
    ],
)  # fmt: skip
def test_part_info_refuses_pieces_that_do_not_cover_the_part(changes):
    d = {"name": "ps-0", "path": f"{CID}/ps-0.safetensors", "bytes": 10, "checksum": "crc32:0badf00d", "pieces": ["00000001"] * 3, "piece_bytes": 4}
    PartInfo.from_json(d)
    with pytest.raises(CorruptCheckpoint, match="piece"):
        PartInfo.from_json({**d, **changes})
    with pytest.raises(ConfigError, match="do not cover"):
        PartInfo("ps-0", "p", 10, "crc32:0badf00d", pieces=("00000001",), piece_bytes=4)


# --- part layouts ---------------------------------------------------------------------


def test_a_part_keyed_by_block_says_so_and_a_record_without_a_layout_is_one_written_per_pserver():
    info = PartInfo("ps-0", f"{CID}/ps-0.safetensors", 10, "crc32:0badf00d", layout=checkpoints.BLOCKS)
    d = json.loads(json.dumps(info.to_json()))
    assert d["layout"] == "blocks" and PartInfo.from_json(d) == info
    assert PartInfo("ps-0", f"{CID}/ps-0.safetensors", 10, "crc32:0badf00d").keyed_by_block() == info
    older = PartInfo.from_json({k: v for k, v in d.items() if k != "layout"})
    assert older.layout is None and "layout" not in older.to_json()


def test_a_layout_this_pdps_does_not_read_is_refused_before_anything_is_loaded():
    d = {"name": "ps-0", "path": f"{CID}/ps-0.safetensors", "bytes": 10, "checksum": "crc32:0badf00d", "layout": "columns"}
    with pytest.raises(CorruptCheckpoint, match="layout 'columns' is not one this pdps reads.*a newer pdps wrote it"):
        PartInfo.from_json(d)
    with pytest.raises(ConfigError, match="layout 'columns'"):
        PartInfo("ps-0", "p", 10, "crc32:0badf00d", layout="columns")


def test_pserver_parts_are_numbered_from_zero_without_gaps():
    def manifest(*names: str) -> Manifest:
        parts = {n: PartInfo(n, f"{CID}/{n}.safetensors", 1, "crc32:00000000") for n in names}
        return Manifest(id=CID, job="j", round=2, epoch=1, created=0.0, parts=parts)

    got = checkpoints.pserver_parts(manifest("master", "ps-1", "ps-0", "ps-2"))
    assert sorted(got) == [0, 1, 2] and got[2].name == "ps-2"
    with pytest.raises(CorruptCheckpoint, match=r"pserver parts \[0, 2\] are not ps-0 .. ps-1"):
        checkpoints.pserver_parts(manifest("master", "ps-0", "ps-2"))


def test_a_manifest_encodes_and_decodes_and_names_its_file_when_wrong():
    part = PartInfo("ps-0", f"{CID}/ps-0.safetensors", 4, "crc32:00000000", pieces=("00000000",), piece_bytes=4)
    manifest = Manifest(CID, "j", 2, 1, 5.5, {"ps-0": part}, extra={"pservers": 1})
    assert Manifest.decode(manifest.encode(), CID, "file:///x/m.json") == manifest
    with pytest.raises(CorruptCheckpoint, match="file:///x/m.json is the manifest of") as raised:
        Manifest.decode(manifest.encode(), "ckpt-0001-0000000003-abcd", "file:///x/m.json")
    assert raised.value.path == "ckpt-0001-0000000003-abcd/manifest.json"
    with pytest.raises(CorruptCheckpoint, match="file:///x/m.json: .*'epoch'"):
        Manifest.decode(json.dumps({**manifest.to_json(), "epoch": "1"}).encode(), CID, "file:///x/m.json")
    with pytest.raises(ConfigError, match="extra"):
        Manifest(CID, "j", 2, 1, 5.5, {}, extra={"x": float("nan")}).encode()


# --- the state table -------------------------------------------------------------------


def test_every_state_and_event_is_in_the_table_and_deleted_is_final():
    assert {s for s, _ in TRANSITIONS} | set(TRANSITIONS.values()) == set(State)
    assert {e for _, e in TRANSITIONS} == set(Event)
    assert not [k for k in TRANSITIONS if k[0] is State.DELETED]


@pytest.mark.parametrize(
    ("state", "event", "after"),
    [
        (State.WRITING, Event.RECORD_PART, State.WRITING),
        (State.WRITING, Event.COMMIT, State.COMMITTED),
        (State.WRITING, Event.RESTORE, State.COMMITTED),
        (State.COMMITTED, Event.ABANDON, State.ABANDONED),
        (State.ABANDONED, Event.DELETE, State.DELETED),
    ],
)
def test_legal_transitions(state, event, after):
    assert transition(CID, state, event) is after


@pytest.mark.parametrize(
    ("state", "event"),
    [
        (State.COMMITTED, Event.COMMIT), (State.COMMITTED, Event.RECORD_PART), (State.ABANDONED, Event.COMMIT),
        (State.ABANDONED, Event.RESTORE), (State.DELETED, Event.DELETE), (State.DELETED, Event.RESTORE),
    ],
)  # fmt: skip
def test_illegal_transitions_raise_naming_the_checkpoint_its_state_and_the_event(state, event):
    with pytest.raises(InvalidTransition) as raised:
        transition(CID, state, event)
    assert (raised.value.state, raised.value.event) == (state, event)
    assert CID in str(raised.value) and str(state) in str(raised.value) and str(event) in str(raised.value)


# --- records in the store --------------------------------------------------------------


def kv(key: str, value: object, rev: int = 1) -> KeyValue:
    return KeyValue(key, json.dumps(value).encode(), rev)


def test_records_decode_and_name_the_key_and_field_when_wrong():
    info = CheckpointInfo(CID, 1, 2, "sync", State.WRITING, 5.5)
    assert CheckpointInfo.decode(kv("k", info.to_json())) == info
    for bad, field in [({"state": "lost"}, "state"), ({"round": "2"}, "round"), ({"id": "x"}, "x"), ({"started": None}, "started")]:
        with pytest.raises(CorruptRecord, match=field) as raised:
            CheckpointInfo.decode(kv("ckpt/k/info", {**info.to_json(), **bad}))
        assert raised.value.key == "ckpt/k/info"
    pointer = Pointer(CID, 1, 2, "file:///c", 5.5, (CID,))
    assert Pointer.decode(kv("p", pointer.to_json())) == pointer
    with pytest.raises(CorruptRecord, match="no checkpoint pointer"):
        Pointer.decode(kv("p", {"id": CID}))
    with pytest.raises(CorruptRecord, match="no epoch record"):
        Epoch.decode(kv("e", {"checkpoint": None}))
    assert Epoch.decode(None) == Epoch()


def test_the_epoch_record_carries_the_time_it_is_given():
    epoch = Epoch(2, CID, 2, "test")
    d = epoch.to_json(now=1234.5)
    assert d["time"] == 1234.5 and Epoch.from_json(d) == epoch


# --- decisions -------------------------------------------------------------------------

CONFIG = JobConfig(name="j", dataset="memory://d", pservers=2, checkpoint_url="memory://c", checkpoint_keep=2)
KEYS = Keys("j")


def part(name: str, ckpt: str = CID) -> KeyValue:
    p = PartInfo(name, f"{ckpt}/{name}.bin", 4, "crc32:00000000")
    return kv(KEYS.checkpoint_part(ckpt, name), p.to_json())


def view(*, state=State.WRITING, parts=("ps-0", "ps-1", "master"), epoch=None, pointer=None, info_epoch=1, pservers=None) -> CommitView:
    info = CheckpointInfo(CID, info_epoch, 2, "sync", state, 5.5, pservers=pservers)
    return CommitView(
        info=kv(KEYS.checkpoint_info(CID), info.to_json(), rev=7),
        parts=tuple(part(n) for n in parts),
        epoch=None if epoch is None else kv(KEYS.epoch, Epoch(epoch).to_json(0.0), rev=3),
        pointer=None if pointer is None else kv(KEYS.checkpoint, pointer.to_json(), rev=5),
    )


def test_a_commit_moves_the_pointer_keeps_the_newest_and_is_guarded_on_what_it_read():
    older = Pointer("ckpt-0001-0000000001-abcd", 1, 1, "memory://c", 1.0, ("ckpt-0001-0000000001-abcd", "ckpt-0000-0000000009-abcd"))
    v = view(epoch=1, pointer=older)
    manifest = manifest_to_commit(v, CONFIG)
    assert manifest is not None and set(manifest.parts) == {"ps-0", "ps-1", "master"} and manifest.created == 5.5
    decision = decide_commit(v, manifest, CONFIG, "memory://c")
    assert isinstance(decision, Write)
    assert decision.result.history == (CID, "ckpt-0001-0000000001-abcd")  # checkpoint_keep=2
    assert set(decision.guards) == {
        Compare.unchanged(KEYS.checkpoint_info(CID), v.info), Compare.unchanged(KEYS.checkpoint, v.pointer), Compare.unchanged(KEYS.epoch, v.epoch),
    }  # fmt: skip
    ptr, info = decision.ops
    assert ptr == Put(KEYS.checkpoint, json.dumps(decision.result.to_json()).encode())
    assert json.loads(info.value)["state"] == "committed"


@pytest.mark.parametrize(
    "changes",
    [
        {"state": State.COMMITTED},  # committed already
        {"parts": ("ps-0", "master")},  # a part missing
        {"epoch": 2},  # a rollback since: it never commits
        {"pointer": Pointer("ckpt-0001-0000000002-ffff", 1, 2, "u", 1.0, ("ckpt-0001-0000000002-ffff",))},  # as new committed
    ],
)
def test_nothing_to_commit(changes):
    v = view(**{"epoch": 1, **changes})
    assert manifest_to_commit(v, CONFIG) is None
    written = manifest_to_commit(view(epoch=1), CONFIG)
    assert decide_commit(v, written, CONFIG, "memory://c") == Done(None)


def test_a_checkpoint_of_a_resized_job_commits_with_one_part_per_pserver_of_its_slot_map():
    """Announced in a slot map of 3 pservers (a 2-pserver job grown by a resize): the three
    parts commit it, the job's configured two do not; an older record without the count
    is held to the configured count."""
    grown = view(epoch=1, pservers=3, parts=("ps-0", "ps-1", "ps-2", "master"))
    manifest = manifest_to_commit(grown, CONFIG)
    assert manifest is not None and set(manifest.parts) == {"ps-0", "ps-1", "ps-2", "master"} and manifest.extra["pservers"] == 3
    assert manifest_to_commit(view(epoch=1, pservers=3), CONFIG) is None
    assert manifest_to_commit(view(epoch=1, pservers=1, parts=("ps-0", "master")), CONFIG) is not None
    info = CheckpointInfo(CID, 1, 2, "sync", State.WRITING, 5.5, pservers=3)
    assert CheckpointInfo.decode(kv(KEYS.checkpoint_info(CID), info.to_json())) == info
    assert "pservers" not in CheckpointInfo(CID, 1, 2, "sync", State.WRITING, 5.5).to_json()


def test_a_commit_whose_parts_changed_after_its_manifest_was_written_is_dropped():
    written = manifest_to_commit(view(epoch=1), CONFIG)
    changed = view(epoch=1)
    other = PartInfo("ps-1", f"{CID}/ps-1.bin", 5, "crc32:00000001")
    changed = CommitView(changed.info, changed.parts[:1] + (kv(KEYS.checkpoint_part(CID, "ps-1"), other.to_json()),) + changed.parts[2:], changed.epoch, None)
    assert decide_commit(changed, written, CONFIG, "memory://c") == Done(None)


def test_doomed_are_older_than_the_newest_kept_or_of_an_older_epoch():
    a, b, c, d = (checkpoint_id(e, r, 0) for e, r in [(0, 4), (0, 8), (1, 2), (1, 6)])
    assert doomed([a, b, c, d, "notes"], keep=[c], epoch=1) == [a, b]  # d may still be written
    assert doomed([a, b, c, d], keep=[], epoch=1) == [a, b]
    assert doomed([a, b, c, d], keep=[d, c], epoch=0) == [a, b]
    assert doomed([a, b], keep=[a, b], epoch=5) == []


def test_a_rollback_starts_the_next_epoch_moves_the_pointer_and_abandons_the_rest():
    kept, newer, writing = "ckpt-0000-0000000004-abcd", "ckpt-0000-0000000008-abcd", "ckpt-0000-0000000009-abcd"
    parts = {"ps-0": PartInfo("ps-0", f"{kept}/ps-0.bin", 1, "crc32:00000000")}
    manifest = Manifest(kept, "j", 4, 0, 1.0, parts)
    pointer = Pointer(newer, 0, 8, "u", 2.0, (newer, kept))
    infos = tuple(kv(KEYS.checkpoint_info(i), {}) for i in (kept, newer, writing))
    v = RollbackView(manifest, kv(KEYS.epoch, Epoch(0).to_json(0.0), rev=2), kv(KEYS.checkpoint, pointer.to_json(), rev=3), infos)
    decision = decide_rollback(v, KEYS, reason="test", url="u", since=0, now=99.0)
    assert isinstance(decision, Write)
    assert decision.result.epoch == Epoch(1, kept, 4, "test")
    assert decision.result.keep == {kept, newer}  # newer stays until a commit, for a look
    put_epoch, put_pointer, *deletes = decision.ops
    assert json.loads(put_epoch.value) == {"epoch": 1, "checkpoint": kept, "round": 4, "reason": "test", "time": 99.0}
    assert json.loads(put_pointer.value)["history"] == [kept]  # newer belongs to the abandoned timeline
    assert deletes == [Delete(KEYS.checkpoint_info(writing))]
    assert set(decision.guards) == {Compare.unchanged(KEYS.epoch, v.epoch), Compare.unchanged(KEYS.checkpoint, v.pointer)}


def test_a_rollback_from_scratch_drops_the_pointer_and_one_already_bumped_stands():
    pointer = Pointer(CID, 1, 2, "u", 2.0, (CID,))
    v = RollbackView(None, None, kv(KEYS.checkpoint, pointer.to_json()), ())
    decision = decide_rollback(v, KEYS, reason="r", url="u", since=0, now=0.0)
    assert decision.result.epoch == Epoch(1, None, 0, "r") and Delete(KEYS.checkpoint) in decision.ops
    bumped = RollbackView(None, kv(KEYS.epoch, Epoch(3, CID, 2, "theirs").to_json(0.0)), None, ())
    assert decide_rollback(bumped, KEYS, reason="r", url="u", since=2, now=0.0) == Done(Epoch(3, CID, 2, "theirs"))
