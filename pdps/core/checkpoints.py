"""The rules of checkpoints: everything that decides about one lives in this file.

What it owns: a checkpoint's id, the records that describe it (a part, the manifest,
the announcement in the store, the ``checkpoint`` pointer, the job's ``epoch``), the
states a checkpoint goes through, and the decisions of committing, cleaning up and
rolling back. It does no I/O, reads no clock and draws no random number: ``now`` and
an id's ``nonce`` are arguments. The store side that reads and applies these decisions
is :mod:`pdps.runtime.recovery`; the bytes of the files are behind
:class:`pdps.ports.checkpoints.CheckpointFiles` (:mod:`pdps.adapters.safetensors_files`).

Rules, in a few lines:

* An id is ``ckpt-<epoch:04d>-<round:010d>-<4 hex>``: ids of one job sort as their
  (epoch, round) do; the nonce keeps two attempts at the same round apart.
* A checkpoint is WRITING from its announcement (``ckpt/<id>/info``) until the one
  transaction that moves the ``checkpoint`` pointer to it makes it COMMITTED. It
  commits only with every expected part recorded, in the epoch it was taken in, and
  when no newer one is committed; the pointer keeps the newest ``checkpoint_keep``.
* A rollback starts a new epoch from a committed checkpoint (or from scratch) and
  ABANDONS every checkpoint it does not keep: those still writing, and those committed
  after the one it restores (they belong to the timeline it leaves).
* A clean-up DELETES what is neither kept nor possibly still in flight: checkpoints
  older than the newest kept one, and any of an older epoch.
* A pserver's part holds its blocks' state keyed by block (``<param>@<first>:<end>/...``,
  :data:`BLOCKS`), so a checkpoint restores onto any pserver count: each pserver
  takes its rows from whichever parts hold them. A part recorded without a layout
  was written by pdps before that: its pserver's shard concatenated in the order of
  the job's first slot map, which a reader recomputes to cut it into blocks.
* A part's integrity is its size, the crc32 of the whole part and, from writers that
  record them, the crc32 of each ``piece_bytes`` piece: a reader checks pieces
  independently, so several threads can read and check one part.
"""

from __future__ import annotations

import enum
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from pdps.core.errors import ConfigError, CorruptCheckpoint, CorruptRecord, InvalidTransition, StorageError
from pdps.core.job import JobConfig, Keys, decode_json
from pdps.core.txn import Compare, Decision, Delete, Done, KeyValue, Put, TxnOp, Write

#: The checksum of every part and piece: CRC-32 as zlib computes it. It guards against
#: torn and bit-rotted files, not against an attacker who can write the bucket.
CHECKSUM = "crc32"
MANIFEST = "manifest.json"
FORMAT = "pdps-checkpoint"
FORMAT_VERSION = 1
MASTER_PART = "master"
#: The layout of a pserver part whose tensors are named by block (``<param>@<first>:<end>/values``,
#: ``.../state.<k>``, ``.../scalar.<k>``) plus the pserver's counters (``pdps.version``).
#: A part recorded without a layout holds one pserver's shard concatenated (``values``,
#: ``state.<k>``, ``scalar.<k>``): pdps before block-keyed checkpoints wrote those.
BLOCKS = "blocks"
LAYOUTS = frozenset({BLOCKS})

_ID = re.compile(r"ckpt-(\d{4,})-(\d{10,})-([0-9a-f]{4})")
_CHECKSUM = re.compile(r"crc32:[0-9a-f]{8}")
_PIECE = re.compile(r"[0-9a-f]{8}")


# --- ids --------------------------------------------------------------------------------


def checkpoint_id(epoch: int, round_no: int, nonce: int) -> str:
    """The id of a checkpoint taken at ``round_no`` of ``epoch``:
    ``ckpt-<epoch:04d>-<round:010d>-<nonce as 4 hex>``.

    Ids of one job sort as their (epoch, round) do, as strings too while the epoch has
    at most 4 digits. ``nonce`` (0..65535, drawn by the caller) keeps two attempts at
    the same round apart.
    """
    for what, value in (("epoch", epoch), ("round", round_no)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"checkpoint {what} must be an int >= 0, got {value!r}")
    if isinstance(nonce, bool) or not isinstance(nonce, int) or not 0 <= nonce < 1 << 16:
        raise ConfigError(f"checkpoint nonce must be an int in 0..65535, got {nonce!r}")
    return f"ckpt-{epoch:04d}-{round_no:010d}-{nonce:04x}"


def is_checkpoint_id(name: object) -> bool:
    """Whether ``name`` is an id :func:`checkpoint_id` makes."""
    return isinstance(name, str) and _ID.fullmatch(name) is not None


def check_id(ckpt_id: object, error: type[StorageError] = StorageError) -> str:
    """``ckpt_id`` if it is a checkpoint id; else ``error`` saying what one looks like.

    Only names :func:`checkpoint_id` makes are taken: a storage root shared with other
    data never has that data taken for a checkpoint (and deleted by a clean-up)."""
    if not is_checkpoint_id(ckpt_id):
        raise error(f"{ckpt_id!r} is not a checkpoint id (ckpt-<epoch>-<round>-<4 hex>, as checkpoint_id() makes)")
    return ckpt_id  # type: ignore[return-value]


def id_order(ckpt_id: str) -> tuple[int, int, str]:
    """Sort key of a checkpoint id: (epoch, round, id), right for any number of digits."""
    m = _ID.fullmatch(ckpt_id)
    if m is None:
        raise ConfigError(f"{ckpt_id!r} is not a checkpoint id")
    return int(m.group(1)), int(m.group(2)), ckpt_id


def pserver_part(index: int) -> str:
    return f"ps-{index}"


def pserver_parts(manifest: Manifest) -> dict[int, PartInfo]:
    """The pservers' parts of a checkpoint, by the index of the pserver that wrote them;
    CorruptCheckpoint unless they are ``ps-0`` .. ``ps-<N-1>``."""
    found = {}
    for name, part in manifest.parts.items():
        prefix, dash, index = name.partition("-")
        if prefix == "ps" and dash and index.isdigit():
            found[int(index)] = part
    if sorted(found) != list(range(len(found))):
        raise CorruptCheckpoint(f"checkpoint {manifest.id}: pserver parts {sorted(found)} are not ps-0 .. ps-{len(found) - 1}", manifest.path)
    return found


def expected_parts(config: JobConfig, pservers: int | None = None) -> set[str]:
    """The parts a checkpoint of this job commits with: one per pserver (``pservers``,
    the count of the slot map it was announced in; None: the job's configured count)
    and the master's."""
    return {pserver_part(i) for i in range(config.pservers if pservers is None else pservers)} | {MASTER_PART}


# --- states -----------------------------------------------------------------------------


class State(str, enum.Enum):
    WRITING = "writing"  # announced; parts being written and recorded
    COMMITTED = "committed"  # the pointer's history names it
    ABANDONED = "abandoned"  # a rollback left it behind: it never commits, its files go
    DELETED = "deleted"  # its files and records are gone

    def __str__(self) -> str:
        return self.value


class Event(str, enum.Enum):
    RECORD_PART = "record_part"
    COMMIT = "commit"
    RESTORE = "restore"  # a rollback starts an epoch from it
    ABANDON = "abandon"  # a rollback leaves it behind
    DELETE = "delete"  # a clean-up removes it

    def __str__(self) -> str:
        return self.value


#: The legal transitions. WRITING and COMMITTED are what the info record says
#: (``state``); ABANDONED and DELETED are the info record gone. A restore of a
#: checkpoint whose manifest was written but whose commit lost makes it committed.
TRANSITIONS: Mapping[tuple[State, Event], State] = {
    (State.WRITING, Event.RECORD_PART): State.WRITING,
    (State.WRITING, Event.COMMIT): State.COMMITTED,
    (State.WRITING, Event.RESTORE): State.COMMITTED,
    (State.COMMITTED, Event.RESTORE): State.COMMITTED,
    (State.WRITING, Event.ABANDON): State.ABANDONED,
    (State.COMMITTED, Event.ABANDON): State.ABANDONED,
    (State.WRITING, Event.DELETE): State.DELETED,
    (State.COMMITTED, Event.DELETE): State.DELETED,
    (State.ABANDONED, Event.DELETE): State.DELETED,
}


def allows(state: State, event: Event) -> bool:
    return (state, event) in TRANSITIONS


def transition(ckpt_id: str, state: State, event: Event) -> State:
    """The state ``event`` leads to; :class:`InvalidTransition` when ``state`` does not allow it."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise InvalidTransition(f"checkpoint {ckpt_id}", state, event) from None


# --- parts and manifests ------------------------------------------------------------------


def checksum_text(value: int) -> str:
    return f"{CHECKSUM}:{value:08x}"


def piece_count(size: int, piece_bytes: int) -> int:
    return -(-size // piece_bytes)


def _natural(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 0


@attrs.frozen
class PartInfo:
    """One written part: where it is, how many bytes it holds, the crc32 of them all and
    (``pieces``) the crc32 of each ``piece_bytes`` piece, the last one shorter.

    ``pieces`` is None in records of writers that did not record pieces (pdps before
    per-piece checksums, other tools): such a part is checked by its whole crc32.
    ``layout`` says how a pserver part names its tensors: :data:`BLOCKS`, or None for
    a part written before checkpoints were keyed by block (and for the master's).
    """

    name: str
    path: str
    bytes: int
    checksum: str  # "crc32:%08x"
    pieces: tuple[str, ...] | None = attrs.field(default=None, converter=attrs.converters.optional(tuple))  # "%08x" each
    piece_bytes: int = 0
    layout: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.layout is not None and self.layout not in LAYOUTS:
            raise ConfigError(f"checkpoint part {self.name!r}: layout {self.layout!r} is not one of {sorted(LAYOUTS)}")
        if self.pieces is not None and (
            not _natural(self.piece_bytes) or self.piece_bytes == 0 or len(self.pieces) != piece_count(self.bytes, self.piece_bytes)
        ):
            raise ConfigError(
                f"checkpoint part {self.name!r}: {len(self.pieces)} piece checksums of {self.piece_bytes!r} bytes "
                f"do not cover its {self.bytes} bytes"
            )

    def keyed_by_block(self) -> PartInfo:
        """This part, recorded as a pserver part whose tensors are named by block."""
        return attrs.evolve(self, layout=BLOCKS)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "path": self.path, "bytes": self.bytes, "checksum": self.checksum}
        if self.pieces is not None:
            d["piece_bytes"] = self.piece_bytes
            d["pieces"] = list(self.pieces)
        if self.layout is not None:
            d["layout"] = self.layout
        return d

    @classmethod
    def from_json(cls, d: object) -> PartInfo:
        """Raises :class:`CorruptCheckpoint` naming the first field that is wrong."""
        if not isinstance(d, dict):
            raise CorruptCheckpoint(f"a checkpoint part record must be a JSON object, got {d!r:.200}")
        name, path, size, checksum = d.get("name"), d.get("path"), d.get("bytes"), d.get("checksum")
        if not isinstance(name, str) or not name:
            raise CorruptCheckpoint(f"checkpoint part record {d!r:.200}: 'name' must be a non-empty string")
        if not isinstance(path, str) or not path:
            raise CorruptCheckpoint(f"checkpoint part {name!r}: 'path' must be a non-empty string, got {path!r}")
        if not _natural(size):
            raise CorruptCheckpoint(f"checkpoint part {name!r}: 'bytes' must be an int >= 0, got {size!r}", path)
        if not isinstance(checksum, str) or not _CHECKSUM.fullmatch(checksum):
            raise CorruptCheckpoint(f"checkpoint part {name!r}: 'checksum' must look like crc32:0123abcd, got {checksum!r}", path)
        pieces, piece_bytes, layout = d.get("pieces"), d.get("piece_bytes", 0), d.get("layout")
        if layout is not None and layout not in LAYOUTS:
            raise CorruptCheckpoint(
                f"checkpoint part {name!r}: layout {layout!r} is not one this pdps reads ({sorted(LAYOUTS)}); "
                "a newer pdps wrote it: restore it with that one", path
            )  # fmt: skip
        if pieces is not None:
            if not isinstance(pieces, list) or not all(isinstance(p, str) and _PIECE.fullmatch(p) for p in pieces):
                raise CorruptCheckpoint(f"checkpoint part {name!r}: 'pieces' must be a list of crc32s like 0123abcd, got {pieces!r:.200}", path)
            if not _natural(piece_bytes) or piece_bytes == 0 or len(pieces) != piece_count(size, piece_bytes):  # type: ignore[arg-type]
                raise CorruptCheckpoint(
                    f"checkpoint part {name!r}: 'piece_bytes' {piece_bytes!r} with {len(pieces)} 'pieces' does not cover its {size} bytes", path
                )
        return cls(
            name=name, path=path, bytes=size, checksum=checksum, pieces=pieces,  # type: ignore[arg-type]
            piece_bytes=piece_bytes if pieces is not None else 0, layout=layout,  # type: ignore[arg-type]
        )  # fmt: skip


@attrs.frozen
class Manifest:
    """What a checkpoint holds: its parts (by name) and where the job was when it was taken.

    ``created`` is seconds since the epoch (the caller's clock); ``extra`` is any
    JSON-safe detail the caller wants kept (mode, pservers, ...).
    """

    id: str
    job: str
    round: int
    epoch: int
    created: float
    parts: dict[str, PartInfo]
    extra: dict[str, Any] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        check_id(self.id, ConfigError)  # type: ignore[arg-type]
        for key, part in self.parts.items():
            if not isinstance(part, PartInfo) or part.name != key:
                raise ConfigError(f"checkpoint {self.id}: parts must map each part's name to its PartInfo, got {key!r}: {part!r}")
            if not part.path.startswith(f"{self.id}/") or part.path == self.path:
                # a checkpoint is deleted with its folder: a part elsewhere would outlive
                # it, or vanish under it when another checkpoint is deleted
                raise ConfigError(f"checkpoint {self.id}: part {key!r} at {part.path!r} is not inside the folder {self.id}/")

    @property
    def path(self) -> str:
        return f"{self.id}/{MANIFEST}"

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "id": self.id,
            "job": self.job,
            "epoch": self.epoch,
            "round": self.round,
            "created": self.created,
            "checksum": CHECKSUM,
            "parts": {key: part.to_json() for key, part in self.parts.items()},
            "extra": self.extra,
        }

    def encode(self) -> bytes:
        """The manifest file's bytes; ConfigError when ``extra`` is not JSON-safe."""
        try:
            return json.dumps(self.to_json(), indent=1, allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"checkpoint {self.id}: the manifest's extra is not JSON-safe: {exc}") from exc

    @classmethod
    def decode(cls, data: bytes, ckpt_id: str, where: str) -> Manifest:
        """The manifest of ``ckpt_id`` from its file's bytes; CorruptCheckpoint naming
        ``where`` (the file) and what is wrong."""
        path = f"{ckpt_id}/{MANIFEST}"
        try:
            d = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise CorruptCheckpoint(f"checkpoint manifest {where} is not JSON: {exc}", path) from exc
        try:
            manifest = cls.from_json(d)
        except CorruptCheckpoint as exc:
            raise CorruptCheckpoint(f"{where}: {exc}", path) from exc
        if manifest.id != ckpt_id:
            raise CorruptCheckpoint(f"{where} is the manifest of {manifest.id}, not of {ckpt_id} (copied?)", path)
        return manifest

    @classmethod
    def from_json(cls, d: object) -> Manifest:
        """Raises :class:`CorruptCheckpoint` naming the first field that is wrong."""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise CorruptCheckpoint(f"not a pdps checkpoint manifest (no \"format\": {FORMAT!r}): {d!r:.200}")
        if d.get("version") != FORMAT_VERSION or d.get("checksum") != CHECKSUM:
            raise CorruptCheckpoint(
                f"checkpoint manifest of version {d.get('version')!r} with {d.get('checksum')!r} checksums; "
                f"this pdps reads version {FORMAT_VERSION} with {CHECKSUM!r}"
            )
        ckpt_id, job, parts, extra = d.get("id"), d.get("job"), d.get("parts"), d.get("extra", {})
        check_id(ckpt_id, CorruptCheckpoint)
        where = f"checkpoint manifest {ckpt_id}"
        if not isinstance(job, str):
            raise CorruptCheckpoint(f"{where}: 'job' must be a string, got {job!r}")
        for field in ("epoch", "round"):
            if not _natural(d.get(field)):
                raise CorruptCheckpoint(f"{where}: {field!r} must be an int >= 0, got {d.get(field)!r}")
        created = d.get("created")
        if isinstance(created, bool) or not isinstance(created, (int, float)) or not math.isfinite(created):
            raise CorruptCheckpoint(f"{where}: 'created' must be a number, got {created!r}")
        if not isinstance(parts, dict) or not isinstance(extra, dict):
            raise CorruptCheckpoint(f"{where}: 'parts' and 'extra' must be JSON objects")
        try:
            return cls(
                id=ckpt_id,  # type: ignore[arg-type]
                job=job,
                round=d["round"],
                epoch=d["epoch"],
                created=float(created),
                parts={key: PartInfo.from_json(p) for key, p in parts.items()},
                extra=extra,
            )
        except ConfigError as exc:
            raise CorruptCheckpoint(f"{where}: {exc}") from exc


# --- records in the store -----------------------------------------------------------------


def _field(d: Mapping[str, Any], name: str, kind: type | tuple[type, ...], key: str) -> Any:
    value = d.get(name)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise CorruptRecord(f"{key}: {name!r} must be {getattr(kind, '__name__', kind)}, got {value!r:.100}", key)
    return value


@attrs.frozen
class CheckpointInfo:
    """``ckpt/<id>/info``: a checkpoint announced at ``round`` of ``epoch``, and its state."""

    id: str
    epoch: int
    round: int
    mode: str
    state: State
    started: float  # when it was announced, seconds since the epoch (the announcer's clock)
    #: the pservers of the slot map it was announced in, one part each (None: an older
    #: pdps's record, the job's configured count); a resized job has another count
    pservers: int | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"id": self.id, "epoch": self.epoch, "round": self.round, "mode": self.mode, "state": self.state.value, "started": self.started}
        if self.pservers is not None:
            out["pservers"] = self.pservers
        return out

    @classmethod
    def decode(cls, kv: KeyValue) -> CheckpointInfo:
        """CorruptRecord naming the key and the field when the record is not an info record."""
        d = decode_json(kv.value, kv.key)
        if not isinstance(d, dict):
            raise CorruptRecord(f"{kv.key} holds no checkpoint info record: {kv.value[:200]!r}", kv.key)
        state = d.get("state")
        if state not in {s.value for s in (State.WRITING, State.COMMITTED)}:
            raise CorruptRecord(f"{kv.key}: 'state' must be 'writing' or 'committed', got {state!r:.100}", kv.key)
        if not is_checkpoint_id(d.get("id")):
            raise CorruptRecord(f"{kv.key}: 'id' must be a checkpoint id, got {d.get('id')!r:.100}", kv.key)
        return cls(
            id=d["id"],
            epoch=_field(d, "epoch", int, kv.key),
            round=_field(d, "round", int, kv.key),
            mode=_field(d, "mode", str, kv.key),
            state=State(state),
            started=float(_field(d, "started", (int, float), kv.key)),
            pservers=None if d.get("pservers") is None else _field(d, "pservers", int, kv.key),
        )


@attrs.frozen
class Pointer:
    """The ``checkpoint`` key: the committed checkpoint the job would restore, and the
    committed ones kept (``history``, newest first, ``id`` among them)."""

    id: str
    epoch: int
    round: int
    url: str
    created: float
    history: tuple[str, ...]

    @classmethod
    def to(cls, manifest: Manifest, url: str, history: Iterable[str]) -> Pointer:
        return cls(manifest.id, manifest.epoch, manifest.round, url, manifest.created, tuple(history))

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "epoch": self.epoch, "round": self.round, "url": self.url, "created": self.created, "history": list(self.history)}

    @classmethod
    def decode(cls, kv: KeyValue) -> Pointer:
        d = decode_json(kv.value, kv.key)
        if not isinstance(d, dict) or not isinstance(d.get("history"), list):
            raise CorruptRecord(f"{kv.key} holds no checkpoint pointer: {kv.value[:200]!r}", kv.key)
        return cls(
            id=_field(d, "id", str, kv.key),
            epoch=_field(d, "epoch", int, kv.key),
            round=_field(d, "round", int, kv.key),
            url=_field(d, "url", str, kv.key),
            created=float(_field(d, "created", (int, float), kv.key)),
            history=tuple(str(i) for i in d["history"]),
        )


@attrs.frozen
class Epoch:
    """Which incarnation of the job's state is current: bumped by every rollback."""

    epoch: int = 0
    checkpoint: str | None = None  # the checkpoint the epoch started from (None: from scratch)
    round: int = 0  # the first sync round of the epoch
    reason: str = ""

    def to_json(self, now: float) -> dict[str, Any]:
        """The record, stamped with ``now`` (seconds since the epoch) for operators."""
        return {**attrs.asdict(self), "time": now}

    @classmethod
    def from_json(cls, d: dict) -> Epoch:
        ckpt = d.get("checkpoint")
        return cls(int(d["epoch"]), None if ckpt is None else str(ckpt), int(d.get("round", 0)), str(d.get("reason", "")))

    @classmethod
    def decode(cls, kv: KeyValue | None) -> Epoch:
        """The record at ``kv`` (None: the job never rolled back, epoch 0)."""
        if kv is None:
            return cls()
        try:
            return cls.from_json(decode_json(kv.value, kv.key))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CorruptRecord(f"{kv.key} holds no epoch record: {kv.value[:200]!r}", kv.key) from exc


def committed(pointer: Pointer | None) -> list[str]:
    """Committed checkpoints, newest first."""
    return list(pointer.history) if pointer is not None else []


# --- decisions ------------------------------------------------------------------------------


@attrs.frozen
class CommitView:
    """What a commit of one checkpoint reads from the store."""

    info: KeyValue | None
    parts: tuple[KeyValue, ...]
    epoch: KeyValue | None
    pointer: KeyValue | None


def manifest_to_commit(view: CommitView, config: JobConfig) -> Manifest | None:
    """The manifest of the checkpoint ``view`` shows, if it may commit now; else None:
    not WRITING (committed already, or abandoned), a part still missing, taken in an
    epoch a rollback has left, or not newer than the committed one."""
    if view.info is None:
        return None
    info = CheckpointInfo.decode(view.info)
    if not allows(info.state, Event.COMMIT):
        return None
    parts = {}
    for kv in view.parts:
        part = PartInfo.from_json(decode_json(kv.value, kv.key))
        parts[part.name] = part
    if set(parts) != expected_parts(config, info.pservers):
        return None
    if Epoch.decode(view.epoch).epoch != info.epoch:
        return None  # taken before a rollback: it never commits
    pointer = None if view.pointer is None else Pointer.decode(view.pointer)
    if pointer is not None and (pointer.epoch, pointer.round) >= (info.epoch, info.round):
        return None  # a newer one is committed already
    return Manifest(
        id=info.id, job=config.name, round=info.round, epoch=info.epoch, created=info.started,
        parts=parts, extra={"mode": config.mode.value, "pservers": config.pservers if info.pservers is None else info.pservers},
    )  # fmt: skip


def decide_commit(view: CommitView, written: Manifest, config: JobConfig, url: str) -> Decision:
    """Commit the checkpoint whose manifest ``written`` is in storage: move the pointer
    to it (keeping the newest ``checkpoint_keep``) and mark its info committed, guarded
    on the info, the pointer and the epoch as read. ``Done(None)`` when it may no longer
    commit, or its parts changed since the manifest was written; ``Write``'s result is
    the new pointer."""
    if manifest_to_commit(view, config) != written:
        return Done(None)
    keys = Keys(config.name)
    assert view.info is not None
    info = CheckpointInfo.decode(view.info)
    old = None if view.pointer is None else Pointer.decode(view.pointer)
    history = [written.id] + [h for h in committed(old) if h != written.id][: config.checkpoint_keep - 1]
    pointer = Pointer.to(written, url, history)
    now_committed = attrs.evolve(info, state=transition(info.id, info.state, Event.COMMIT))
    return Write(
        guards=(Compare.unchanged(view.info.key, view.info), Compare.unchanged(keys.checkpoint, view.pointer), Compare.unchanged(keys.epoch, view.epoch)),
        ops=(Put(keys.checkpoint, json.dumps(pointer.to_json()).encode()), Put(view.info.key, json.dumps(now_committed.to_json()).encode())),
        result=pointer,
    )


def doomed(ids: Iterable[str], keep: Iterable[str], epoch: int) -> list[str]:
    """Which of ``ids`` a clean-up deletes, sorted: those not kept and either older than
    the newest kept one (beyond retention, or never committed) or of an epoch before
    ``epoch`` (a rollback abandoned them). Newer ones of the current epoch may still be
    being written, so they stay."""
    keep = set(keep)
    newest = max(keep) if keep else ""

    def dead(ckpt_id: str) -> bool:
        if ckpt_id in keep:
            return False
        return ckpt_id < newest or (is_checkpoint_id(ckpt_id) and id_order(ckpt_id)[0] < epoch)

    return sorted(i for i in set(ids) if dead(i))


@attrs.frozen
class RollbackView:
    """What a rollback reads: the checkpoint it restores (verified; None: from scratch)
    and the store's records."""

    manifest: Manifest | None
    epoch: KeyValue | None
    pointer: KeyValue | None
    infos: tuple[KeyValue, ...]  # every ``ckpt/<id>/info``


@attrs.frozen
class Rollback:
    """A rollback that committed: the new epoch, and which checkpoints a clean-up keeps."""

    epoch: Epoch
    keep: frozenset[str]


def decide_rollback(view: RollbackView, keys: Keys, *, reason: str, url: str, since: int, now: float) -> Decision:
    """Start the epoch after the one read, from ``view.manifest`` (None: from scratch).

    ``since`` is the epoch the caller saw before it chose ``manifest``: if another
    rollback has bumped it meanwhile, that one stands (``Done`` with its epoch). Else
    ``Write``: the new epoch record; the pointer follows the rollback, dropping what was
    committed after the manifest (it belongs to the timeline the job leaves; a restore
    of a checkpoint that never committed makes it committed), or goes with no
    manifest; and every announced checkpoint not kept is abandoned (its info record
    goes, so none of them can record a part or commit into the new epoch). Guarded on
    the epoch and the pointer as read; the result is a :class:`Rollback`.
    """
    current, manifest = Epoch.decode(view.epoch), view.manifest
    if current.epoch > since:
        return Done(current)
    new = Epoch(current.epoch + 1, manifest.id if manifest else None, manifest.round if manifest else 0, reason)
    old = None if view.pointer is None else Pointer.decode(view.pointer)
    history = committed(old)
    keep = [] if manifest is None else [manifest.id] + [i for i in history if i < manifest.id]
    ops: list[TxnOp] = [Put(keys.epoch, json.dumps(new.to_json(now)).encode())]
    if manifest is None:
        if view.pointer is not None:
            ops.append(Delete(keys.checkpoint))
    elif keep != history:
        ops.append(Put(keys.checkpoint, json.dumps(Pointer.to(manifest, url, keep).to_json()).encode()))
    for kv in view.infos:
        ckpt_id = kv.key[len(keys.checkpoints) :].split("/", 1)[0]
        if ckpt_id not in keep and ckpt_id not in history:
            ops.append(Delete(kv.key))
    return Write(
        guards=(Compare.unchanged(keys.epoch, view.epoch), Compare.unchanged(keys.checkpoint, view.pointer)),
        ops=tuple(ops),
        result=Rollback(new, frozenset(keep) | frozenset(history)),
    )


def describe(infos: Sequence[KeyValue], pointer: Pointer | None, keys: Keys) -> list[dict[str, Any]]:
    """Every checkpoint ``infos`` announce, newest first: id, epoch, round, state
    ("latest", "committed" or what its record says), when it was started."""
    history = committed(pointer)
    out = []
    for kv in infos:
        info = decode_json(kv.value, kv.key)
        ckpt_id = str(info.get("id") or kv.key[len(keys.checkpoints) :].split("/", 1)[0])
        state = "latest" if history[:1] == [ckpt_id] else ("committed" if ckpt_id in history else str(info.get("state")))
        out.append({"id": ckpt_id, "epoch": info.get("epoch"), "round": info.get("round"), "state": state, "started": info.get("started")})
    return sorted(out, key=lambda d: d["id"], reverse=True)
