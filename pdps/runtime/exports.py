"""Model exports for serving: publishing and reading them through the Storage port.

The layout and the rules are :mod:`pdps.core.exports`'; the tensors' bytes are a
:class:`~pdps.ports.tensor_format.TensorFormat`'s. :mod:`pdps.exports` opens both by
URL for users; a role hands in its own.

How a publish stays whole for readers (every object put is atomic, S3's included):

1. everything is checked (meta, keep, every tensor) before the first write;
2. the writer claims the next number: it writes ``<seq>/claim-<token>``, then lists the
   claims on ``<seq>``; seeing another writer's, it withdraws its claim and tries the
   next number (at least one of two racing writers sees the other's claim, so two
   writers never write the same export);
3. ``<seq>/model.safetensors``, its sha256 computed over exactly the bytes written;
4. ``<seq>/manifest.json``: from now on the export is complete;
5. ``LATEST`` moves to ``<seq>``, unless it already names a newer export;
6. with ``keep``: the complete exports beyond the ``keep`` newest (never the one
   ``LATEST`` names) and every unfinished folder below ``<seq>`` are deleted, each
   manifest first, so a folder half-deleted is unfinished, never complete.

A writer killed at any step leaves an unfinished folder, which readers never look
into and the next publish with ``keep`` deletes; ``LATEST`` still names a whole export.
Retention assumes one writer per URL: a folder below ``<seq>`` without a manifest is
taken for a dead writer's.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import secrets
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from pdps.core import exports as rules
from pdps.core.backoff import Backoff
from pdps.core.errors import CorruptExport, ExportConflict, StorageError
from pdps.core.exports import Export
from pdps.ports.storage import Buffer, Storage
from pdps.ports.tensor_format import TensorFormat
from pdps.runtime.retry import Retry

log = logging.getLogger(__name__)

#: Numbers a publish tries before it gives up with ExportConflict: each lost one means
#: another writer claimed it in the same moment.
CLAIM_ATTEMPTS = 8
# Jittered, so that two writers that saw each other's claims do not meet again.
_CLAIM_BACKOFF = Backoff(first=0.02, longest=0.5, jitter=1.0)
#: The model file is read and hashed in pieces of this size.
PIECE = 64 * 2**20
# How many times load() of LATEST follows the pointer when retention deleted the
# export it pointed at while it was being read.
_FOLLOW_LATEST = 3


def publish(
    storage: Storage, tensor_format: TensorFormat, tensors: Mapping[str, Any], *, meta: Mapping[str, Any] | None = None, keep: int | None = None
) -> Export:
    """Publish ``tensors`` as the next export under ``storage``; return it.

    Raises ConfigError (bad meta, keep, names or tensors) before anything is written;
    ExportConflict when other writers took every number tried (nothing published:
    the claims were withdrawn); StorageError when the storage fails (what was written
    is an unfinished folder, never complete).
    """
    meta = rules.check_meta(meta)
    rules.check_keep(keep)
    rules.check_names(tensors)
    file = tensor_format.encode(tensors, f"export at {storage.url}")  # checks every tensor; no bytes yet
    seq = _claim(storage, secrets.token_hex(8))
    where = _url(storage, rules.model_path(seq))
    digest = hashlib.sha256()
    written = storage.put_chunks(rules.model_path(seq), _hashed(file.chunks, digest))
    if written != file.size:  # the storage's own accounting disagrees: publish nothing
        raise StorageError(f"export {where}: wrote {written} bytes, expected {file.size}")
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")
    export = Export(seq, where, created, written, digest.hexdigest(), file.specs, meta)
    storage.put(rules.manifest_path(seq), export.manifest())
    latest = _pointed(storage)
    if latest is None or latest < seq:
        storage.put(rules.LATEST, rules.pointer(seq))
        latest = seq
    else:
        log.warning("export %s: LATEST already names the newer export %d; left as it is", where, latest)
    if keep is not None:
        _retain(storage, keep=keep, latest=latest, current=seq)
    log.info("published export %d (%d bytes, %d tensors) at %s", seq, written, len(file.specs), where)
    return export


def _claim(storage: Storage, token: str) -> int:
    state = Retry(_CLAIM_BACKOFF, attempts=CLAIM_ATTEMPTS)
    while True:
        seq = rules.next_seq(storage.list() + [left.path for left in storage.leftovers()])
        mine = rules.claim_path(seq, token)
        storage.put(mine, b"")
        others = rules.rivals(storage.list(f"{rules.folder(seq)}/{rules.CLAIM_PREFIX}"), seq, token)
        if not others:
            return seq
        storage.delete(mine)
        storage.delete_folder(rules.folder(seq))
        log.info("export %d at %s is claimed by another writer too (%s); trying the next number", seq, storage.url, others[0])
        if not state.failed():
            raise ExportConflict(
                f"export URL {storage.url}: another writer claimed every number this one tried ({state.failures} of them, "
                f"the last {seq}); an export URL takes one writer at a time"
            )


def _hashed(chunks: Iterable[Buffer], digest: Any) -> Iterator[Buffer]:
    for chunk in chunks:
        digest.update(chunk)
        yield chunk


def _retain(storage: Storage, *, keep: int, latest: int, current: int) -> None:
    paths = storage.list()
    gone = rules.to_delete(paths + [left.path for left in storage.leftovers()], keep=keep, latest=latest, current=current)
    inside = rules.folders(paths)
    for seq in gone:
        manifest = rules.manifest_path(seq)
        for path in sorted(inside.get(seq, []), key=lambda p: p != manifest):
            storage.delete(path)
        for left in storage.leftovers(f"{rules.folder(seq)}/"):
            storage.delete_leftover(left.path)
        storage.delete_folder(rules.folder(seq))
    if gone:
        log.info("deleted exports %s at %s (keep=%d)", gone, storage.url, keep)


def list_exports(storage: Storage) -> list[Export]:
    """The complete exports under ``storage``, oldest first. CorruptExport for a
    manifest that cannot be read."""
    return [_read_manifest(storage, seq) for seq in rules.complete(storage.list())]


def latest(storage: Storage) -> Export | None:
    """The export ``LATEST`` names; None before the first publish. CorruptExport when
    the pointer or the manifest it leads to cannot be read."""
    seq = _pointed(storage)
    return None if seq is None else _read_manifest(storage, seq)


def load(storage: Storage, tensor_format: TensorFormat, seq: int | None = None) -> tuple[Export, dict[str, Any]]:
    """Export ``seq`` (``LATEST``'s when None) and its tensors, checked.

    The model file's size and sha256 must be the manifest's, and its tensors' names,
    dtypes and shapes too; anything else is a CorruptExport naming the object. Loading
    ``LATEST`` follows the pointer again when retention deleted the export it named
    while it was being read.
    """
    if seq is not None:
        return _load(storage, tensor_format, _read_manifest(storage, rules.check_seq(seq)))
    for attempt in range(1, _FOLLOW_LATEST + 1):
        newest = _pointed(storage)
        if newest is None:
            raise CorruptExport(f"no export at {storage.url}: nothing was published there (no {rules.LATEST})", _url(storage, rules.LATEST))
        try:
            return _load(storage, tensor_format, _read_manifest(storage, newest))
        except CorruptExport:
            if attempt == _FOLLOW_LATEST or _pointed(storage) == newest:
                raise  # still the newest: it is broken, not replaced
    raise AssertionError("unreachable")


def _load(storage: Storage, tensor_format: TensorFormat, export: Export) -> tuple[Export, dict[str, Any]]:
    path = rules.model_path(export.seq)
    where = export.path
    size = _size(storage, path)
    if size != export.bytes:
        raise CorruptExport(f"export {where} holds {size} bytes, its manifest says {export.bytes}", where)
    buf = bytearray(size)
    view = memoryview(buf)
    digest = hashlib.sha256()
    for start in range(0, size, PIECE):
        piece = view[start : start + PIECE]
        _read_into(storage, path, piece, start)
        digest.update(piece)
    if digest.hexdigest() != export.sha256:
        raise CorruptExport(f"export {where} fails its checksum: sha256 {digest.hexdigest()}, its manifest says {export.sha256}", where)
    tensors, specs = tensor_format.decode(buf, f"export {where}", where, CorruptExport)
    wrong = rules.mismatches(export.tensors, specs)
    if wrong:
        raise CorruptExport(f"export {where} does not hold the tensors its manifest names: {'; '.join(wrong)}", where)
    return export, tensors


def _read_manifest(storage: Storage, seq: int) -> Export:
    path = rules.manifest_path(seq)
    where = _url(storage, path)
    data = _missing_as_corrupt(storage, path, lambda: storage.get(path), f"no export {seq} at {storage.url} (never finished, or deleted)")
    return Export.decode(data, seq, _url(storage, rules.model_path(seq)), where)


def _pointed(storage: Storage) -> int | None:
    if not storage.exists(rules.LATEST):
        return None
    where = _url(storage, rules.LATEST)
    return rules.pointed(_missing_as_corrupt(storage, rules.LATEST, lambda: storage.get(rules.LATEST), f"{where} vanished"), where)


def _size(storage: Storage, path: str) -> int:
    return _missing_as_corrupt(storage, path, lambda: storage.size(path), f"export {_url(storage, path)} is missing")


def _read_into(storage: Storage, path: str, piece: memoryview, start: int) -> None:
    _missing_as_corrupt(storage, path, lambda: storage.read_into(path, piece, start), f"export {_url(storage, path)} vanished while being read")


def _missing_as_corrupt(storage: Storage, path: str, read: Any, what: str) -> Any:
    """``read()``; a StorageError of an object that is not there becomes CorruptExport
    saying ``what`` (retrying will not help); one of a storage that cannot answer stays."""
    try:
        return read()
    except StorageError as exc:
        try:
            there = storage.exists(path)
        except StorageError:
            raise exc from None
        if there:
            raise
        raise CorruptExport(what, _url(storage, path)) from exc


def _url(storage: Storage, path: str) -> str:
    return f"{storage.url.rstrip('/')}/{path}"
