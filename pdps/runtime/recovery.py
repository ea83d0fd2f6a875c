"""Coordinated checkpoints and rollbacks: the store side.

The rules (ids, records, states, what a commit or a rollback writes) are
:mod:`pdps.core.checkpoints`'; the files go through the
:class:`~pdps.ports.checkpoints.CheckpointFiles` port. This module reads the store,
hands what it read to those rules, applies their decisions through the one
compare-and-set loop (:func:`pdps.runtime.cas.read_modify_write`) and drives the files:

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
  blocks, the master reloads its queues, trainers drop their step and re-fetch. A part
  or commit of the old epoch can no longer land.
* **A pserver's part** holds its blocks keyed by block and the rows of its sparse
  tables keyed by table and slot (:func:`write_shard_part`), so a pserver loads the
  blocks and the slots' rows its slot map gives it now from whichever parts hold them,
  reading only those byte ranges (:func:`load_shard`): a checkpoint restores onto any
  pserver count. Parts that pdps wrote before, one shard concatenated, are cut into
  blocks as they are read.

It lives in the runtime, not beside the roles: the master, the pservers, the trainers
and the operator's commands (``pdps checkpoint``, ``pdps status``) all use it, and it
imports no role, adapter, registry or torch.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pdps.core import checkpoints
from pdps.core.checkpoints import CheckpointInfo, CommitView, Epoch, Manifest, PartInfo, Pointer, RollbackView, State
from pdps.core.errors import ConfigError, CorruptCheckpoint, PdpsError, StorageError
from pdps.core.job import JobConfig, Keys, decode_as
from pdps.core.slots import Block, Layout, ParamSpec, SlotMap, block_entry, parse_entry
from pdps.core.tables import parse_row_entry, parse_table_entry
from pdps.core.txn import Compare, KeyValue, Op, Put
from pdps.ports.checkpoints import CheckpointFiles
from pdps.ports.compute import ParameterShard, RowShard
from pdps.ports.coordination import CoordinationStore
from pdps.runtime.cas import read_modify_write

log = logging.getLogger(__name__)


def new_checkpoint_id(epoch: int, round_no: int) -> str:
    """A new checkpoint's id (:func:`pdps.core.checkpoints.checkpoint_id`) with a random nonce."""
    return checkpoints.checkpoint_id(epoch, round_no, secrets.randbelow(1 << 16))


def files_for(config: JobConfig, files: CheckpointFiles | None) -> CheckpointFiles | None:
    """The checkpoint files a role of ``config``'s job is given; refused when the job
    has a ``checkpoint_url`` and none were given (the composition roots open them)."""
    if config.checkpoint_url and files is None:
        raise ConfigError(
            f"job {config.name!r} keeps checkpoints at {config.checkpoint_url}, but this role was given no checkpoint files: "
            "pass checkpoints=pdps.registry.open_checkpoint_files(checkpoint_url) (pdps.simulate and pdps launch do)"
        )
    return files


# --- reading the store ------------------------------------------------------------------


def read_epoch(store: CoordinationStore, keys: Keys) -> tuple[Epoch, KeyValue | None]:
    kv = store.get(keys.epoch)
    return Epoch.decode(kv), kv


def read_pointer(store: CoordinationStore, keys: Keys) -> tuple[Pointer | None, KeyValue | None]:
    kv = store.get(keys.checkpoint)
    return (None if kv is None else Pointer.decode(kv)), kv


def committed_ids(store: CoordinationStore, keys: Keys) -> list[str]:
    """Committed checkpoints, newest first."""
    return checkpoints.committed(read_pointer(store, keys)[0])


def describe(store: CoordinationStore, keys: Keys) -> list[dict[str, Any]]:
    """Every checkpoint the store knows of, newest first: id, epoch, round, state."""
    infos = [kv for kv in store.range(keys.checkpoints) if kv.key.endswith("/info")]
    return checkpoints.describe(infos, read_pointer(store, keys)[0], keys)


# --- taking a checkpoint ------------------------------------------------------------


def announce(keys: Keys, ckpt_id: str, epoch: int, round_no: int, mode: str, pservers: int | None = None) -> Put:
    """The op that starts checkpoint ``ckpt_id`` (goes into the caller's transaction);
    ``pservers``: the count of the slot map it is taken in, one part each."""
    info = CheckpointInfo(ckpt_id, epoch, round_no, mode, State.WRITING, started=time.time(), pservers=pservers)
    return Put(keys.checkpoint_info(ckpt_id), json.dumps(info.to_json()).encode())


def record_part(store: CoordinationStore, keys: Keys, ckpt_id: str, part: PartInfo) -> bool:
    """Record a written part; False if the checkpoint was abandoned meanwhile (a rollback)."""
    info = keys.checkpoint_info(ckpt_id)
    ok = store.commit(
        (Compare.revision(info, Op.GT, 0),),  # the info record still exists
        (Put(keys.checkpoint_part(ckpt_id, part.name), json.dumps(part.to_json()).encode()),),
    ).succeeded
    if not ok:
        log.warning("checkpoint %s was abandoned before part %s was recorded", ckpt_id, part.name)
    return ok


def try_commit(store: CoordinationStore, files: CheckpointFiles, config: JobConfig, ckpt_id: str) -> bool:
    """Commit ``ckpt_id`` if every part is recorded; True if this call committed it."""
    keys = Keys(config.name)

    def read() -> CommitView:
        return CommitView(
            info=store.get(keys.checkpoint_info(ckpt_id)),
            parts=tuple(store.range(keys.checkpoint_parts(ckpt_id))),
            epoch=store.get(keys.epoch),
            pointer=store.get(keys.checkpoint),
        )

    manifest = checkpoints.manifest_to_commit(read(), config)
    if manifest is None:
        return False
    files.write_manifest(manifest)
    pointer = read_modify_write(
        store, read, lambda view: checkpoints.decide_commit(view, manifest, config, files.url), what=f"the commit of checkpoint {ckpt_id}"
    )
    if pointer is None:
        return False
    log.info("checkpoint %s committed: epoch %d, round %d, %d parts", ckpt_id, manifest.epoch, manifest.round, len(manifest.parts))
    cleanup(store, files, keys, keep=pointer.history, epoch=manifest.epoch, grace=config.checkpoint_orphan_grace)
    return True


def cleanup(
    store: CoordinationStore, files: CheckpointFiles, keys: Keys, *, keep: Iterable[str], epoch: int = 0, grace: float | None = None
) -> list[str]:
    """Delete every checkpoint :func:`pdps.core.checkpoints.doomed` names: not kept, and
    either older than the newest kept one or of an epoch before ``epoch``.

    With a ``grace`` (seconds), first delete the leftovers of writes nobody has written
    to for that long (killed writers'), in any checkpoint's folder, kept ones included:
    the folder of a deleted checkpoint goes with it only once it is empty."""
    in_store = {kv.key[len(keys.checkpoints) :].split("/", 1)[0] for kv in store.range(keys.checkpoints)}
    try:
        in_storage = set(files.list_ids())
    except StorageError as exc:
        log.warning("could not list checkpoints in %s: %s", files.url, exc)
        in_storage = set()
    gone = checkpoints.doomed(in_store | in_storage, keep, epoch)
    if grace is not None:
        try:
            stale = files.delete_leftovers(older_than=grace)
        except StorageError as exc:  # retried at the next commit
            log.warning("could not delete leftovers of killed checkpoint writers in %s: %s", files.url, exc)
        else:
            if stale:
                log.info("deleted %d leftovers of killed checkpoint writers (%d bytes): %s",
                         len(stale), sum(left.bytes for left in stale), [left.path for left in stale])  # fmt: skip
    for ckpt_id in gone:
        try:
            files.delete(ckpt_id)
        except StorageError as exc:  # retried at the next commit
            log.warning("could not delete checkpoint %s from %s: %s", ckpt_id, files.url, exc)
            continue
        store.delete_prefix(f"{keys.checkpoints}{ckpt_id}/")
    if gone:
        log.info("deleted checkpoints %s", gone)
    return gone


# --- a pserver's part ---------------------------------------------------------------

#: The counter of updates a pserver had applied, a 0-d int64 tensor beside its blocks.
VERSION = "pdps.version"


def write_shard_part(files: CheckpointFiles, ckpt_id: str, index: int, snapshot: Mapping[str, Any]) -> PartInfo:
    """Write pserver ``index``'s :meth:`~pdps.ports.compute.ParameterShard.snapshot` (with
    the :meth:`~pdps.ports.compute.RowShard.snapshot` of each table's slots, if any) as
    its part of ``ckpt_id``, recorded as keyed by block (:data:`~pdps.core.checkpoints.BLOCKS`)."""
    name = checkpoints.pserver_part(index)
    return files.write_part(f"{ckpt_id}/{name}.safetensors", snapshot, name=name).keyed_by_block()


def load_shard(
    store: CoordinationStore, files: CheckpointFiles, config: JobConfig, ckpt_id: str, shard: ParameterShard,
    tables: Mapping[str, RowShard] | None = None,
) -> int:  # fmt: skip
    """Load every block of ``shard``, and the rows of every slot each of ``tables`` holds
    (fresh row stores, by table name), from checkpoint ``ckpt_id``, whatever pserver
    count it was taken with; return the pserver's version: the most updates applied by
    a pserver whose part held some of its blocks or rows.

    Each pserver part recorded by block is read in ranges (``read_part(wanted=)``): its
    header, the version counter, the entries of ``shard``'s blocks, and the row entries
    (:func:`pdps.core.tables.row_entry`) of the slots the tables hold, never another
    pserver's. Each table's step becomes the largest any part recorded for it. A part
    written before checkpoints were keyed by block (it holds no rows) is read whole and
    cut into blocks by the layout it was written for: the model (the job's ``model``
    record), the job's ``num_slots`` and ``min_block``, and the job's first slot map
    for as many pservers as the checkpoint has parts. A checkpoint without row entries
    leaves the tables empty (rows start from their init values again, as after a
    rollback from scratch). ConfigError, with ``shard`` unchanged, when the checkpoint
    does not hold every row of it or such a part does not fit that layout, or a row
    entry does not fit its table; CorruptCheckpoint when a part is not what its record
    says.
    """
    manifest = files.read_manifest(ckpt_id)
    parts = checkpoints.pserver_parts(manifest)
    rows: dict[str, list[tuple[int, int]]] = {}
    for b in shard.blocks:
        rows.setdefault(b.param, []).append((b.row_start, b.row_end))
    held = {name: t.slots for name, t in (tables or {}).items()}

    def wanted(key: str) -> bool:
        if key == VERSION:
            return True
        row = parse_row_entry(key)
        if row is not None:  # a slot's rows: only those of a slot a table here holds
            return row[1] in held.get(row[0], ())
        scalar = parse_table_entry(key)
        if scalar is not None:
            return scalar[0] in held
        name = parse_entry(key)  # an entry of no block is import_blocks' to refuse
        return name is None or any(lo < name[2] and name[1] < hi for lo, hi in rows.get(name[0], ()))

    layout_then: Layout | None = None
    entries: dict[str, Any] = {}
    row_entries: dict[str, Any] = {}
    steps: dict[str, Any] = {}
    version = 0
    for index, part in sorted(parts.items()):
        if part.layout is None:
            tensors = files.read_part(part)
        else:
            tensors = files.read_part(part, wanted=wanted)  # holds only what is wanted: no copies needed
        counter = tensors.pop(VERSION, None)
        if counter is None:
            raise CorruptCheckpoint(f"checkpoint {ckpt_id}: part {part.name} has no {VERSION!r} counter", part.path)
        if part.layout is None:
            layout_then = layout_then or _layout_written_for(store, config, manifest, len(parts))
            tensors = _cut_into_blocks(tensors, layout_then.blocks_of(index), manifest, part, config)
            mine = {k: t for k, t in tensors.items() if wanted(k)}
            # all of a part kept: its buffer is needed anyway; some of it: copies, so the rest goes
            tensors = mine if len(mine) == len(tensors) else {k: t.clone() for k, t in mine.items()}
        took = False
        for key, t in tensors.items():
            scalar = parse_table_entry(key)
            if scalar is not None:  # every part records each table's step: the largest is the table's
                if key not in steps or int(t) > int(steps[key]):
                    steps[key] = t
            elif parse_row_entry(key) is not None:
                row_entries[key] = t
                took = True
            else:
                entries[key] = t
                took = True
        if took:
            version = max(version, int(counter))
    try:
        shard.import_blocks(entries)
    except ConfigError as exc:
        raise ConfigError(f"checkpoint {ckpt_id} cannot be loaded into this pserver's blocks: {exc}") from exc
    if row_entries or steps:
        for name, table in sorted((tables or {}).items()):
            try:
                table.import_slots({**row_entries, **steps})  # (entries of other tables are ignored)
            except ConfigError as exc:
                raise ConfigError(f"checkpoint {ckpt_id} cannot be loaded into this pserver's rows of table {name!r}: {exc}") from exc
    return version


def _layout_written_for(store: CoordinationStore, config: JobConfig, manifest: Manifest, pservers: int) -> Layout:
    """The layout a checkpoint written per pserver (before block keys) was taken in."""
    keys = Keys(config.name)
    kv = store.get(keys.model)
    if kv is None:
        raise ConfigError(
            f"checkpoint {manifest.id} was written before checkpoints were keyed by block: reading it needs the model "
            f"description ({keys.model}), which a trainer writes when it attaches; attach one first"
        )
    specs = decode_as(kv.value, kv.key, lambda ds: [ParamSpec.from_json(d) for d in ds])
    return Layout.build(specs, SlotMap.initial(pservers, config.num_slots), config.min_block)


def _cut_into_blocks(tensors: Mapping[str, Any], blocks: Sequence[Block], manifest: Manifest, part: PartInfo, config: JobConfig) -> dict[str, Any]:
    """A part written per pserver (``values``, ``state.<k>``, ``scalar.<k>``: the shard's
    blocks laid end to end) as block entries; ConfigError when it does not fit ``blocks``."""
    numel = sum(b.numel for b in blocks)
    for key, t in tensors.items():
        kind, _, name = key.partition(".")
        flat = key == "values" or (kind == "state" and name and t.dim() > 0)
        if not (flat or (kind in ("state", "scalar") and name and t.dim() == 0)):
            raise CorruptCheckpoint(f"checkpoint {manifest.id}: unexpected entry {key!r} in part {part.name}", part.path)
        if flat and tuple(t.shape) != (numel,):
            raise ConfigError(
                f"checkpoint {manifest.id} was written before checkpoints were keyed by block, and its part {part.name} "
                f"does not fit the layout it must have been taken in: {key!r} holds {t.numel()} elements where "
                f"{part.name} of {manifest.extra.get('pservers', '?')} pservers holds {numel} for this job's model with "
                f"num_slots={config.num_slots} and min_block={config.min_block}. Restore it into a job with the model, "
                "num_slots and min_block it was taken with (any pserver count)"
            )
    out: dict[str, Any] = {}
    offset = 0
    for b in blocks:
        entry = block_entry(b)
        for key, t in tensors.items():  # a 0-d state tensor is a per-block counter: every block's
            out[f"{entry}/{key}"] = t[offset : offset + b.numel] if t.dim() > 0 else t
        offset += b.numel
    return out


# --- choosing and rolling back ------------------------------------------------------


def choose(store: CoordinationStore, files: CheckpointFiles, keys: Keys, *, skip: Iterable[str] = ()) -> Manifest | None:
    """The newest committed checkpoint whose every part is sound, or None.

    A corrupt one (a checksum mismatch, a missing part, no manifest) is passed over
    with an error naming what is wrong and which checkpoint is used instead.
    """
    skip = set(skip)
    bad: list[str] = []
    for ckpt_id in committed_ids(store, keys):
        if ckpt_id in skip:
            continue
        try:
            manifest = files.read_manifest(ckpt_id)
            problems = files.verify(manifest)
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
    store: CoordinationStore, files: CheckpointFiles | None, keys: Keys, reason: str, *,
    checkpoint: str | None = None, grace: float | None = None, since: int | None = None,
) -> Epoch:  # fmt: skip
    """Start a new epoch from the best checkpoint (or ``checkpoint``); returns it.

    Checkpoints being written are abandoned: their info records go in the same
    transaction, so none of them can commit into the new epoch. The pointer moves
    to the chosen checkpoint, dropping any committed after it. Their files are then
    deleted by :func:`cleanup`, with leftovers older than ``grace`` (the job's
    ``checkpoint_orphan_grace``; None leaves them to the next commit). When another
    rollback bumps the epoch first, that one stands and its epoch is returned.
    ``since``: the epoch in which the caller saw what calls for this rollback (default:
    the current one). A failure seen in an epoch the job has left since is moot, since
    the rollback that ended that epoch restored everything from a checkpoint: then
    nothing is written and the current epoch is returned.
    """
    if since is None:
        since = read_epoch(store, keys)[0].epoch

    def read() -> RollbackView:
        return RollbackView(
            # chosen afresh each time round: a lost race may be the commit of a newer one
            manifest=_checkpoint_to_restore(store, files, keys, checkpoint),
            epoch=store.get(keys.epoch),
            pointer=store.get(keys.checkpoint),
            infos=tuple(kv for kv in store.range(keys.checkpoints) if kv.key.endswith("/info")),
        )

    outcome = read_modify_write(
        store, read,
        lambda view: checkpoints.decide_rollback(view, keys, reason=reason, url=files.url if files else "", since=since, now=time.time()),
        what=f"the rollback of job {keys.job!r}",
    )  # fmt: skip
    if isinstance(outcome, Epoch):
        return outcome  # another rollback got there first; theirs is as good as ours
    new: Epoch = outcome.epoch
    where = f"checkpoint {new.checkpoint} (round {new.round})" if new.checkpoint else "no checkpoint: from scratch"
    log.warning("job %r rolls back to %s as epoch %d: %s", keys.job, where, new.epoch, reason)
    if files is not None:  # what the old epoch left half-written can never commit now
        try:  # passed-over committed ones stay until the next commit, for a look
            cleanup(store, files, keys, keep=outcome.keep, epoch=new.epoch, grace=grace)
        except PdpsError as exc:
            log.warning("could not clean up abandoned checkpoints: %s", exc)
    return new


def _checkpoint_to_restore(store: CoordinationStore, files: CheckpointFiles | None, keys: Keys, named: str | None) -> Manifest | None:
    if named is None:
        return choose(store, files, keys) if files is not None else None
    if files is None:
        raise StorageError("a rollback to a named checkpoint needs the job's checkpoint_url")
    manifest = files.read_manifest(named)
    problems = files.verify(manifest)
    if problems:
        raise StorageError(f"checkpoint {named} is unusable: {'; '.join(problems[:5])}")
    return manifest
