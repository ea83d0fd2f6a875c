"""Coordinated checkpoints and rollbacks: the store side.

The files of a checkpoint (parts, manifest, checksums) are :mod:`pdps.roles.checkpoint`'s;
this module decides *which* checkpoint exists and which one the job runs from:

* **Taking one.** A checkpoint is announced by ``ckpt/<id>/info`` = {epoch, round,
  state: "writing"} (in sync mode in the same transaction that closes the round it
  follows). Every pserver and the master write their part to storage and record it
  under ``ckpt/<id>/part/<name>``, fenced on the info record. Whoever records the last
  part writes the manifest and then commits with one transaction: the ``checkpoint``
  pointer moves to the new id, compared against the pointer, the info record and the
  job's epoch as they were read. Only after that are older checkpoints beyond
  ``checkpoint_keep``, and abandoned ones, deleted, folders included, with the
  temporary files of writers killed mid-write (once unmodified for
  ``checkpoint_orphan_grace``): a crash at any moment leaves the previous pointer
  and its files intact.
* **Rolling back.** A restarted pserver (or an operator: ``pdps checkpoint restore``)
  picks the newest committed checkpoint whose every part passes its checksum, falling
  back to older ones and saying so, and bumps the job's ``epoch`` record to
  {epoch + 1, checkpoint, round}. Every role watches ``epoch``: pservers load their
  parts, the master reloads its queues, trainers drop their step and re-fetch. A part
  or commit of the old epoch can no longer land.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import attrs

from pdps.core.errors import CorruptRecord, PdpsError, StorageError
from pdps.core.job import JobConfig, Keys, decode_json
from pdps.ports.coordination import Compare, CoordinationStore, Delete, KeyValue, Op, Put, TxnOp
from pdps.ports.storage import Storage

# The files module imports torch (its tensor parts): imported where a checkpoint is
# written or read, so a master and `pdps status` that take none start without torch.
if TYPE_CHECKING:
    from pdps.roles import checkpoint as files

log = logging.getLogger(__name__)

MASTER_PART = "master"


def pserver_part(index: int) -> str:
    return f"ps-{index}"


def expected_parts(config: JobConfig) -> set[str]:
    return {pserver_part(i) for i in range(config.pservers)} | {MASTER_PART}


def open_checkpoint_storage(config: JobConfig) -> Storage | None:
    """The job's checkpoint storage, or None when it has no ``checkpoint_url``."""
    if not config.checkpoint_url:
        return None
    from pdps.registry import open_storage

    return open_storage(config.checkpoint_url)


# --- the epoch ----------------------------------------------------------------------


@attrs.frozen
class Epoch:
    """Which incarnation of the job's state is current: bumped by every rollback."""

    epoch: int = 0
    checkpoint: str | None = None  # the checkpoint the epoch started from (None: from scratch)
    round: int = 0  # the first sync round of the epoch
    reason: str = ""

    def to_json(self) -> dict:
        return {**attrs.asdict(self), "time": time.time()}

    @classmethod
    def from_json(cls, d: dict) -> Epoch:
        ckpt = d.get("checkpoint")
        return cls(int(d["epoch"]), None if ckpt is None else str(ckpt), int(d.get("round", 0)), str(d.get("reason", "")))


def read_epoch(store: CoordinationStore, keys: Keys) -> tuple[Epoch, KeyValue | None]:
    kv = store.get(keys.epoch)
    if kv is None:
        return Epoch(), None
    try:
        return Epoch.from_json(decode_json(kv.value, kv.key)), kv
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptRecord(f"{kv.key} holds no epoch record: {kv.value[:200]!r}", kv.key) from exc


def _same(kv: KeyValue | None, key: str) -> Compare:
    return Compare.absent(key) if kv is None else Compare.revision(key, Op.EQ, kv.mod_revision)


# --- the pointer --------------------------------------------------------------------


def read_pointer(store: CoordinationStore, keys: Keys) -> tuple[dict | None, KeyValue | None]:
    kv = store.get(keys.checkpoint)
    if kv is None:
        return None, None
    ptr = decode_json(kv.value, kv.key)
    if not isinstance(ptr, dict) or not isinstance(ptr.get("history"), list):
        raise CorruptRecord(f"{kv.key} holds no checkpoint pointer: {kv.value[:200]!r}", kv.key)
    return ptr, kv


def committed_ids(store: CoordinationStore, keys: Keys) -> list[str]:
    """Committed checkpoints, newest first."""
    ptr, _ = read_pointer(store, keys)
    return [str(i) for i in ptr["history"]] if ptr else []


# --- taking a checkpoint ------------------------------------------------------------


def announce(keys: Keys, ckpt_id: str, epoch: int, round_no: int, mode: str) -> Put:
    """The op that starts checkpoint ``ckpt_id`` (goes into the caller's transaction)."""
    info = {"id": ckpt_id, "epoch": epoch, "round": round_no, "mode": mode, "state": "writing", "started": time.time()}
    return Put(keys.checkpoint_info(ckpt_id), json.dumps(info).encode())


def record_part(store: CoordinationStore, keys: Keys, ckpt_id: str, part: files.PartInfo) -> bool:
    """Record a written part; False if the checkpoint was abandoned meanwhile (a rollback)."""
    info = keys.checkpoint_info(ckpt_id)
    ok = store.commit(
        (Compare.revision(info, Op.GT, 0),),  # the info record still exists
        (Put(keys.checkpoint_part(ckpt_id, part.name), json.dumps(part.to_json()).encode()),),
    ).succeeded
    if not ok:
        log.warning("checkpoint %s was abandoned before part %s was recorded", ckpt_id, part.name)
    return ok


def try_commit(store: CoordinationStore, storage: Storage, config: JobConfig, ckpt_id: str) -> bool:
    """Commit ``ckpt_id`` if every part is recorded; True if this call committed it."""
    from pdps.roles import checkpoint as files

    keys = Keys(config.name)
    info_kv = store.get(keys.checkpoint_info(ckpt_id))
    if info_kv is None:
        return False
    info = decode_json(info_kv.value, info_kv.key)
    if info.get("state") != "writing":
        return False
    parts = {}
    for kv in store.range(keys.checkpoint_parts(ckpt_id)):
        part = files.PartInfo.from_json(decode_json(kv.value, kv.key))
        parts[part.name] = part
    if set(parts) != expected_parts(config):
        return False
    epoch, epoch_kv = read_epoch(store, keys)
    if epoch.epoch != int(info["epoch"]):
        return False  # taken before a rollback: it never commits
    ptr, ptr_kv = read_pointer(store, keys)
    if ptr is not None and (int(ptr["epoch"]), int(ptr["round"])) >= (int(info["epoch"]), int(info["round"])):
        return False  # a newer one is committed already
    manifest = files.Manifest(
        id=ckpt_id,
        job=config.name,
        round=int(info["round"]),
        epoch=int(info["epoch"]),
        created=float(info["started"]),
        parts=parts,
        extra={"mode": config.mode.value, "pservers": config.pservers},
    )
    files.write_manifest(storage, manifest)
    history = [ckpt_id] + [h for h in (ptr["history"] if ptr else []) if h != ckpt_id][: config.checkpoint_keep - 1]
    pointer = {
        "id": ckpt_id,
        "epoch": manifest.epoch,
        "round": manifest.round,
        "url": storage.url,
        "created": manifest.created,
        "history": history,
    }
    ok = store.commit(
        (_same(info_kv, info_kv.key), _same(ptr_kv, keys.checkpoint), _same(epoch_kv, keys.epoch)),
        (Put(keys.checkpoint, json.dumps(pointer).encode()), Put(info_kv.key, json.dumps({**info, "state": "committed"}).encode())),
    ).succeeded
    if not ok:
        return False
    log.info("checkpoint %s committed: epoch %d, round %d, %d parts", ckpt_id, manifest.epoch, manifest.round, len(parts))
    cleanup(store, storage, keys, keep=history, epoch=manifest.epoch, grace=config.checkpoint_orphan_grace)
    return True


def cleanup(
    store: CoordinationStore, storage: Storage, keys: Keys, *, keep: Iterable[str], epoch: int = 0, grace: float | None = None
) -> list[str]:
    """Delete every checkpoint that is not kept and either older than the newest kept
    one (beyond retention, or never committed) or from an epoch before ``epoch`` (a
    rollback abandoned it). Newer ones of the current epoch may still be in flight.

    With a ``grace`` (seconds), first delete the leftovers of writes nobody has written
    to for that long (killed writers'), in any checkpoint's folder, kept ones included:
    the folder of a deleted checkpoint goes with it only once it is empty."""
    from pdps.roles import checkpoint as files

    keep = list(keep)
    newest = max(keep) if keep else ""

    def dead(ckpt_id: str) -> bool:
        if ckpt_id in keep:
            return False
        return ckpt_id < newest or (files.is_checkpoint_id(ckpt_id) and int(ckpt_id.split("-")[1]) < epoch)

    in_store = {kv.key[len(keys.checkpoints) :].split("/", 1)[0] for kv in store.range(keys.checkpoints)}
    try:
        in_storage = set(files.list_ids(storage))
    except StorageError as exc:
        log.warning("could not list checkpoints in %s: %s", storage.url, exc)
        in_storage = set()
    gone = sorted(i for i in (in_store | in_storage) if dead(i))
    if grace is not None:
        try:
            stale = files.delete_leftovers(storage, older_than=grace)
        except StorageError as exc:  # retried at the next commit
            log.warning("could not delete leftovers of killed checkpoint writers in %s: %s", storage.url, exc)
        else:
            if stale:
                log.info("deleted %d leftovers of killed checkpoint writers (%d bytes): %s",
                         len(stale), sum(left.bytes for left in stale), [left.path for left in stale])  # fmt: skip
    for ckpt_id in gone:
        try:
            files.delete(storage, ckpt_id)
        except StorageError as exc:  # retried at the next commit
            log.warning("could not delete checkpoint %s from %s: %s", ckpt_id, storage.url, exc)
            continue
        store.delete_prefix(f"{keys.checkpoints}{ckpt_id}/")
    if gone:
        log.info("deleted checkpoints %s", gone)
    return gone


# --- choosing and rolling back ------------------------------------------------------


def choose(store: CoordinationStore, storage: Storage, keys: Keys, *, skip: Iterable[str] = ()) -> files.Manifest | None:
    """The newest committed checkpoint whose every part is sound, or None.

    A corrupt one (a checksum mismatch, a missing part, no manifest) is passed over
    with an error naming what is wrong and which checkpoint is used instead.
    """
    from pdps.roles import checkpoint as files

    skip = set(skip)
    bad: list[str] = []
    for ckpt_id in committed_ids(store, keys):
        if ckpt_id in skip:
            continue
        try:
            manifest = files.read_manifest(storage, ckpt_id)
            problems = files.verify(storage, manifest)
        except StorageError as exc:  # CorruptCheckpoint included
            problems = [str(exc)]
        if not problems:
            if bad:
                log.error("falling back to checkpoint %s (round %d): %s", ckpt_id, manifest.round, "; ".join(bad))
            return manifest
        bad.append(f"checkpoint {ckpt_id} is unusable ({'; '.join(problems[:3])})")
        log.error("checkpoint %s is unusable: %s", ckpt_id, "; ".join(problems[:5]))
    if bad:
        log.error("no usable checkpoint: %s", "; ".join(bad))
    return None


def rollback(
    store: CoordinationStore, storage: Storage | None, keys: Keys, reason: str, *,
    checkpoint: str | None = None, grace: float | None = None,
) -> Epoch:  # fmt: skip
    """Start a new epoch from the best checkpoint (or ``checkpoint``); returns it.

    Checkpoints being written are abandoned: their info records go in the same
    transaction, so none of them can commit into the new epoch. The pointer moves
    to the chosen checkpoint, dropping any committed after it. Their files are then
    deleted by :func:`cleanup`, with leftovers older than ``grace`` (the job's
    ``checkpoint_orphan_grace``; None leaves them to the next commit).
    """
    from pdps.roles import checkpoint as files

    while True:
        current, kv = read_epoch(store, keys)
        if checkpoint is not None:
            if storage is None:
                raise StorageError("a rollback to a named checkpoint needs the job's checkpoint_url")
            manifest = files.read_manifest(storage, checkpoint)
            problems = files.verify(storage, manifest)
            if problems:
                raise StorageError(f"checkpoint {checkpoint} is unusable: {'; '.join(problems[:5])}")
        else:
            manifest = choose(store, storage, keys) if storage is not None else None
        new = Epoch(current.epoch + 1, manifest.id if manifest else None, manifest.round if manifest else 0, reason)
        ptr, ptr_kv = read_pointer(store, keys)
        committed = [str(i) for i in ptr["history"]] if ptr else []
        # The pointer follows the rollback: what was committed after the checkpoint the
        # job now runs from belongs to the timeline it abandoned, so a later restart must
        # not pick it (and a forced restore of an uncommitted checkpoint becomes committed).
        keep = [] if manifest is None else [manifest.id] + [i for i in committed if i < manifest.id]
        ops: list[TxnOp] = [Put(keys.epoch, json.dumps(new.to_json()).encode())]
        if manifest is None:
            if ptr_kv is not None:
                ops.append(Delete(keys.checkpoint))
        elif keep != committed:
            pointer = {
                "id": manifest.id, "epoch": manifest.epoch, "round": manifest.round, "url": storage.url if storage else "",
                "created": manifest.created, "history": keep,
            }  # fmt: skip
            ops.append(Put(keys.checkpoint, json.dumps(pointer).encode()))
        for info in store.range(keys.checkpoints):
            ckpt_id = info.key[len(keys.checkpoints) :].split("/", 1)[0]
            if info.key.endswith("/info") and ckpt_id not in keep and ckpt_id not in committed:
                ops.append(Delete(info.key))
        if store.commit((_same(kv, keys.epoch), _same(ptr_kv, keys.checkpoint)), ops).succeeded:
            where = f"checkpoint {new.checkpoint} (round {new.round})" if new.checkpoint else "no checkpoint: from scratch"
            log.warning("job %r rolls back to %s as epoch %d: %s", keys.job, where, new.epoch, reason)
            if storage is not None:  # what the old epoch left half-written can never commit now
                try:  # passed-over committed ones stay until the next commit, for a look
                    cleanup(store, storage, keys, keep=set(keep) | set(committed), epoch=new.epoch, grace=grace)
                except PdpsError as exc:
                    log.warning("could not clean up abandoned checkpoints: %s", exc)
            return new
        # someone else bumped it meanwhile; theirs is as good as ours unless older
        again, _ = read_epoch(store, keys)
        if again.epoch > current.epoch:
            return again


def describe(store: CoordinationStore, keys: Keys) -> list[dict[str, Any]]:
    """Every checkpoint the store knows of, newest first: id, epoch, round, state."""
    ptr, _ = read_pointer(store, keys)
    committed = [str(i) for i in ptr["history"]] if ptr else []
    out = []
    for kv in store.range(keys.checkpoints):
        if not kv.key.endswith("/info"):
            continue
        info = decode_json(kv.value, kv.key)
        ckpt_id = str(info.get("id") or kv.key[len(keys.checkpoints) :].split("/", 1)[0])
        state = "latest" if committed[:1] == [ckpt_id] else ("committed" if ckpt_id in committed else str(info.get("state")))
        out.append({"id": ckpt_id, "epoch": info.get("epoch"), "round": info.get("round"), "state": state, "started": info.get("started")})
    return sorted(out, key=lambda d: d["id"], reverse=True)
