"""A job's checkpoints as an operator sees and controls them (``pdps checkpoint``).

``list`` and ``inspect`` only read: the coordination store for which checkpoints
exist and which one is committed (:mod:`pdps.runtime.recovery`), the checkpoint
storage for their files (:mod:`pdps.adapters.safetensors_files`). ``restore`` starts a new
epoch through :func:`pdps.runtime.recovery.rollback`, the same call a restarted
pserver makes, after checking everything it can before any state changes: the job
is not done, the checkpoint is committed (or forced) and every part passes its
checksum. The roles then follow the new epoch by themselves.

Each function returns one JSON-safe object (the ``--json`` contract); the
``format_*`` functions give the text ``pdps checkpoint`` prints.
"""

from __future__ import annotations

import time
from typing import Any

import attrs

from pdps.adapters import safetensors_files as files
from pdps.core.checkpoints import MASTER_PART, PartInfo, is_checkpoint_id
from pdps.core.errors import ConfigError, CorruptCheckpoint, NoSuchJob, PdpsError
from pdps.core.job import JobConfig, Keys, decode_json
from pdps.ports.coordination import CoordinationStore
from pdps.ports.storage import Storage
from pdps.runtime import recovery
from pdps.shell.status import epoch_text, job_config, job_state

#: The reason a restore gives in the epoch record (and the roles' logs).
RESTORE_REASON = "operator: pdps checkpoint restore"


class NoSuchCheckpoint(NoSuchJob):
    """The job's store and storage hold no checkpoint of that id (or it is no id)."""

    code = "no_such_checkpoint"


class RestoreRefused(PdpsError):
    """``pdps checkpoint restore`` would not roll the job back; nothing was changed."""

    code = "restore_refused"


def open_job_storage(config: JobConfig, url: str | None = None) -> Storage | None:
    """The job's checkpoint storage: at ``url`` when given (the operator reaches it
    another way), else at the job's ``checkpoint_url``; None when there is neither."""
    url = url or config.checkpoint_url
    if not url:
        return None
    from pdps.registry import open_storage

    return open_storage(url)


def list_checkpoints(store: CoordinationStore, storage: Storage | None, job: str) -> dict[str, Any]:
    """Every checkpoint of ``job``, newest first: ``job``, ``storage`` (its URL, or
    null), ``epoch`` (the epoch record, or null before any rollback),
    ``orphan_grace`` (the job's ``checkpoint_orphan_grace``) and ``checkpoints``,
    each with ``id``, ``epoch``, ``round``, ``state`` (latest, committed, writing:
    announced in the store and not committed; orphan: files in storage the store does
    not know), ``created`` (null for an orphan), ``in_storage`` (whether storage holds
    any of its files; null without storage) and ``leftovers`` (temporary files of
    writes that never finished, or are still going on, in its folder: ``path``,
    ``bytes``, ``modified`` in unix time and ``age`` in seconds since; null without
    storage). A commit deletes the leftovers older than ``orphan_grace``.
    """
    keys = Keys(job)
    config = job_config(store, job)  # NoSuchJob first
    known = _known(store, keys)
    stored = set(files.list_ids(storage)) if storage is not None else set()
    left: dict[str, list[dict[str, Any]]] = {}
    now = time.time()
    for t in files.leftovers(storage) if storage is not None else []:
        entry = {"path": t.path, "bytes": t.bytes, "modified": t.modified, "age": max(0.0, now - t.modified)}
        left.setdefault(t.path.split("/", 1)[0], []).append(entry)
    for ckpt_id in stored - set(known):
        epoch, round_no = _epoch_round(ckpt_id)
        known[ckpt_id] = {"id": ckpt_id, "epoch": epoch, "round": round_no, "state": "orphan", "created": None}
    entries = [
        {**e, "in_storage": e["id"] in stored, "leftovers": left.get(e["id"], [])} if storage is not None
        else {**e, "in_storage": None, "leftovers": None}
        for e in _newest_first(known.values())
    ]  # fmt: skip
    return {
        "job": job, "storage": storage.url if storage is not None else None, "epoch": _epoch_record(store, keys),
        "orphan_grace": config.checkpoint_orphan_grace, "checkpoints": entries,
    }  # fmt: skip


def inspect_checkpoint(store: CoordinationStore, storage: Storage | None, job: str, ckpt_id: str | None = None) -> dict[str, Any]:
    """Checkpoint ``ckpt_id`` (default: the latest committed) read back from storage
    and verified part by part: ``job``, ``storage``, ``id``, ``state`` (as
    :func:`list_checkpoints` says), ``epoch``, ``round``, ``created``, ``extra`` (what
    the manifest keeps besides), ``parts`` (``name``, ``path``, ``bytes``,
    ``checksum``, ``layout``: ``blocks`` for a pserver part keyed by block,
    ``pserver`` for one an older pdps wrote as its shard concatenated, null for the
    master's; and ``result``: ``ok`` or what is wrong), ``problems`` (every fault
    found, the manifest's included) and ``sound`` (no problem at all).

    Raises :class:`NoSuchCheckpoint` for an id neither the store nor the storage
    knows, ConfigError without a storage to read, and StorageError when the storage
    cannot be read (that says nothing about the checkpoint).
    """
    keys = Keys(job)
    job_config(store, job)
    if storage is None:
        raise ConfigError(f"job {job!r} has no checkpoint_url: name the storage to read with --storage URL")
    known = _known(store, keys)
    if ckpt_id is None:
        committed = recovery.committed_ids(store, keys)
        if not committed:
            raise NoSuchCheckpoint(f"job {job!r} has no committed checkpoint yet{_known_text(known)}")
        ckpt_id = committed[0]
    entry = known.get(ckpt_id) or _orphan(storage, job, ckpt_id, known)
    report: dict[str, Any] = {"job": job, "storage": storage.url, **{k: entry[k] for k in ("id", "state", "epoch", "round", "created")}}
    try:
        manifest = files.read_manifest(storage, ckpt_id)
    except CorruptCheckpoint as exc:  # no manifest: show what the store recorded of its parts
        parts = [PartInfo.from_json(decode_json(kv.value, kv.key)) for kv in store.range(keys.checkpoint_parts(ckpt_id))]
        results = {p.name: "not verified: the checkpoint has no usable manifest" for p in parts}
        return {**report, "extra": {}, "parts": _parts(parts, results), "problems": [str(exc)], "sound": False}
    results = {}
    for name, part in manifest.parts.items():
        problems = files.verify(storage, attrs.evolve(manifest, parts={name: part}))
        results[name] = "; ".join(problems) if problems else "ok"
    problems = [r for r in results.values() if r != "ok"]
    if manifest.job != job:
        problems.insert(0, f"the manifest is of job {manifest.job!r}, not {job!r}")
    report.update(epoch=manifest.epoch, round=manifest.round, created=manifest.created)
    return {**report, "extra": manifest.extra, "parts": _parts(manifest.parts.values(), results), "problems": problems, "sound": not problems}


def restore(store: CoordinationStore, storage: Storage | None, job: str, ckpt_id: str | None = None, *, force: bool = False) -> dict[str, Any]:
    """Roll ``job`` back to ``ckpt_id`` (default: the newest committed checkpoint
    that passes verification): a new epoch every role follows. Returns ``job``,
    ``checkpoint``, ``round``, ``epoch`` (the new epoch record as stored) and
    ``previous`` (the one it replaced, or null).

    Raises :class:`RestoreRefused`, having changed nothing, when the job is done or
    has no checkpoint storage, when ``ckpt_id`` is not committed (unless ``force``),
    fails verification or belongs to another job, or when no committed checkpoint
    is sound; :class:`NoSuchCheckpoint` for an id nothing knows. Every part is read
    twice: once here, once by the rollback, which checks again what it starts from.
    """
    keys = Keys(job)
    config = job_config(store, job)
    if storage is None:
        raise RestoreRefused(f"job {job!r} has no checkpoint_url: it takes no checkpoints to restore")
    known = _known(store, keys)
    entry = None if ckpt_id is None else known.get(ckpt_id) or _orphan(storage, job, ckpt_id, known)
    if job_state(store, keys) == "done":
        raise RestoreRefused(f"job {job!r} is done: no role is left to follow a new epoch (start a new job to train further)")
    previous = _epoch_record(store, keys)
    if entry is None:
        manifest = recovery.choose(store, files.SafetensorsFiles(storage), keys)
        if manifest is None:
            committed = [i for i, e in known.items() if e["state"] in ("latest", "committed")]
            why = "none passes verification (see pdps checkpoint inspect ID)" if committed else "it has none"
            raise RestoreRefused(f"job {job!r} has no committed checkpoint to restore: {why}")
    else:
        if entry["state"] not in ("latest", "committed") and not force:
            raise RestoreRefused(
                f"checkpoint {ckpt_id} of job {job!r} is {entry['state']}, not committed: only a committed one is known to be "
                "whole and consistent across parts; --force restores it anyway if its files verify"
            )
        try:
            manifest = files.read_manifest(storage, ckpt_id)
        except CorruptCheckpoint as exc:
            raise RestoreRefused(f"checkpoint {ckpt_id} cannot be restored: {exc}") from exc
        if manifest.job != job:
            raise RestoreRefused(f"checkpoint {ckpt_id} in {storage.url} is of job {manifest.job!r}, not {job!r}")
        problems = files.verify(storage, manifest)
        if problems:
            raise RestoreRefused(f"checkpoint {ckpt_id} fails verification: {'; '.join(problems)}")
    new = recovery.rollback(store, files.SafetensorsFiles(storage), keys, reason=RESTORE_REASON, checkpoint=manifest.id, grace=config.checkpoint_orphan_grace)
    if new.checkpoint != manifest.id or new.reason != RESTORE_REASON:
        # rollback() yields to a rollback that won the race (a restarting pserver's)
        raise RestoreRefused(
            f"another rollback of job {job!r} started epoch {new.epoch} from {new.checkpoint or 'scratch'} at the same "
            f"moment ({new.reason}); this restore did not happen: check pdps checkpoint list and run it again if still wanted"
        )
    return {"job": job, "checkpoint": manifest.id, "round": manifest.round, "epoch": _epoch_record(store, keys), "previous": previous}


# --- text ---------------------------------------------------------------------------


def format_list(listing: dict[str, Any], url: str) -> str:
    """The text ``pdps checkpoint list`` prints."""
    rows = [("id", "epoch", "round", "state", "taken at", "files")]
    for c in listing["checkpoints"]:
        present = {True: "yes", False: "missing", None: "?"}[c["in_storage"]]
        rows.append((c["id"], str(c["epoch"]), str(c["round"]), c["state"], _when(c["created"]), present))
    w = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = [
        f"job {listing['job']} on {url}: epoch {epoch_text(listing['epoch'])}",
        f"  storage {listing['storage'] or 'none (the job has no checkpoint_url; give --storage URL)'}",
    ]
    if not listing["checkpoints"]:
        lines.append("  no checkpoints")
    else:
        lines += [f"  {r[0]:<{w[0]}}  {r[1]:>{w[1]}}  {r[2]:>{w[2]}}  {r[3]:<{w[3]}}  {r[4]:<{w[4]}}  {r[5]}" for r in rows]
    left = [t for c in listing["checkpoints"] for t in c["leftovers"] or ()]
    if left:
        lines.append(
            "  leftovers of writes that never finished (or still going on); a commit deletes those unmodified for "
            f"checkpoint_orphan_grace ({listing['orphan_grace']:g} s):"
        )
        w = [max(len(t["path"]) for t in left), max(len(str(t["bytes"])) for t in left)]
        lines += [f"    {t['path']:<{w[0]}}  {t['bytes']:>{w[1]}} bytes, modified {t['age']:.0f} s ago" for t in left]
    return "\n".join(lines)


def format_inspection(report: dict[str, Any], url: str) -> str:
    """The text ``pdps checkpoint inspect`` prints."""
    r = report
    lines = [
        f"checkpoint {r['id']} of job {r['job']} on {url}: {r['state']}",
        f"  storage  {r['storage']}",
        f"  epoch {r['epoch']}, round {r['round']}, taken at {_when(r['created'])}",
    ]
    if r["extra"]:
        lines.append("  " + ", ".join(f"{k} {v}" for k, v in sorted(r["extra"].items())))
    rows = [("part", "bytes", "checksum", "result")]
    rows += [(p["name"], str(p["bytes"]), p["checksum"], "ok" if p["result"] == "ok" else "BAD (below)") for p in r["parts"]]
    w = [max(len(row[i]) for row in rows) for i in range(3)]
    lines += [f"  {row[0]:<{w[0]}}  {row[1]:>{w[1]}}  {row[2]:<{w[2]}}  {row[3]}" for row in rows]
    if any(p["layout"] == "pserver" for p in r["parts"]):
        lines.append(
            "  its pserver parts were written by an older pdps, one shard each: they are cut into blocks when loaded, "
            "which needs a job with the model, num_slots and min_block they were taken with (any pserver count)"
        )
    if r["sound"]:
        lines.append(f"  sound: {len(r['parts'])} parts, every size and crc32 checksum as the manifest says")
    else:
        lines.append(f"  UNUSABLE: {len(r['problems'])} problem{'s' if len(r['problems']) != 1 else ''}")
        lines += [f"    {p}" for p in r["problems"]]
    return "\n".join(lines)


def format_restore(result: dict[str, Any], url: str) -> str:
    """The text ``pdps checkpoint restore`` prints."""
    e = result["epoch"]
    return (
        f"job {result['job']} on {url}: epoch {e['epoch']} starts from {result['checkpoint']} (round {result['round']}), "
        f"replacing epoch {epoch_text(result['previous'])}\n"
        "  pservers reload their parts, the master reloads its queue, trainers drop their step and re-fetch"
    )


# --- internals ----------------------------------------------------------------------


def _known(store: CoordinationStore, keys: Keys) -> dict[str, dict[str, Any]]:
    """The checkpoints the store knows, by id: recovery.describe's, and any id of the
    pointer's history whose info record is gone."""
    known = {
        d["id"]: {"id": d["id"], "epoch": d["epoch"], "round": d["round"], "state": d["state"], "created": d["started"]}
        for d in recovery.describe(store, keys)
    }
    for i, ckpt_id in enumerate(recovery.committed_ids(store, keys)):
        if ckpt_id not in known:
            epoch, round_no = _epoch_round(ckpt_id)
            known[ckpt_id] = {"id": ckpt_id, "epoch": epoch, "round": round_no, "state": "latest" if i == 0 else "committed", "created": None}
    return known


def _orphan(storage: Storage | None, job: str, ckpt_id: str, known: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The entry of a checkpoint the store does not know: one storage holds files of."""
    if not is_checkpoint_id(ckpt_id):
        raise NoSuchCheckpoint(f"{ckpt_id!r} is not a checkpoint id (ckpt-<epoch>-<round>-<4 hex>){_known_text(known)}")
    if storage is None or not (storage.list(f"{ckpt_id}/") or storage.leftovers(f"{ckpt_id}/")):
        where = f" or in {storage.url}" if storage is not None else ""
        raise NoSuchCheckpoint(f"job {job!r} has no checkpoint {ckpt_id} in the store{where}{_known_text(known)}")
    epoch, round_no = _epoch_round(ckpt_id)
    return {"id": ckpt_id, "epoch": epoch, "round": round_no, "state": "orphan", "created": None}


def _known_text(known: dict[str, dict[str, Any]]) -> str:
    if not known:
        return ""
    ids = _newest_first(known.values())
    return "; it knows " + ", ".join(f"{e['id']} ({e['state']})" for e in ids)


def _epoch_round(ckpt_id: str) -> tuple[int | None, int | None]:
    """The epoch and round a checkpoint id names (None, None for a name that is no id)."""
    if not is_checkpoint_id(ckpt_id):
        return None, None
    _, epoch, round_no, _ = ckpt_id.split("-")
    return int(epoch), int(round_no)


def _newest_first(entries: Any) -> list[dict[str, Any]]:
    return sorted(entries, key=lambda e: (int(e["epoch"] or 0), int(e["round"] or 0), e["id"]), reverse=True)


def _epoch_record(store: CoordinationStore, keys: Keys) -> dict[str, Any] | None:
    """The epoch record as stored (with its time), checked as the roles read it."""
    _, kv = recovery.read_epoch(store, keys)
    return None if kv is None else decode_json(kv.value, kv.key)


def _parts(parts: Any, results: dict[str, str]) -> list[dict[str, Any]]:
    return [
        {"name": p.name, "path": p.path, "bytes": p.bytes, "checksum": p.checksum, "layout": _layout(p), "result": results[p.name]}
        for p in sorted(parts, key=lambda p: p.name)
    ]


def _layout(part: PartInfo) -> str | None:
    if part.layout is not None:
        return part.layout
    return None if part.name == MASTER_PART else "pserver"


def _when(t: float | None) -> str:
    return "?" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
