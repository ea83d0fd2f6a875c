"""Checkpoint files: the parts (safetensors, JSON) and the manifest that binds them.

What this module owns: the bytes of a checkpoint in storage and their integrity.
Which checkpoints exist, which one is committed and which one a job runs from is
:mod:`pdps.roles.recovery`'s (the coordination store's pointer, not these files).

Layout under the checkpoint storage's root, one folder per checkpoint::

    ckpt-0003-0000001200-9f2c/        a checkpoint_id(): epoch, round, 4 random hex
        ps-0.safetensors              a pserver's shard (values, optimizer state)
        ps-1.safetensors
        master.json                   the master's queue snapshot
        manifest.json                 written last: every part's path, size and crc32

Rules:

* A part is written atomically (``put_chunks``) straight from tensor memory; its
  crc32 is computed over exactly the bytes written, while they are written.
* A reader trusts nothing it has not checked: a part's size, then its crc32, then
  its header, all before a tensor is built. Anything wrong raises
  :class:`CorruptCheckpoint` naming the object and what is wrong; an unreachable
  storage stays a plain :class:`StorageError` (retry it; a corrupt part, fall back).
* Tensors are safetensors files (8-byte little-endian header length, a JSON header
  of dtype/shape/data_offsets padded with spaces to 8 bytes, raw little-endian data):
  any safetensors reader loads them, and nothing is ever unpickled.
* Parts live under their checkpoint's folder, so ``delete`` of a checkpoint removes
  all of it (the manifest first: a half-deleted checkpoint is never taken for whole),
  the folder last.
* A writer killed mid-write leaves a temporary file (a *leftover*) in the folder;
  :func:`delete_leftovers` deletes those nobody has written to for a grace period.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import math
import mmap
import queue
import re
import secrets
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import attrs
import torch

from pdps.core.errors import ConfigError, CorruptCheckpoint, StorageError
from pdps.ports.storage import Leftover, Storage

try:  # ISA-L's crc32 (pip install 'pdps[isal]'): the same checksums, 24 GB/s here
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # zlib's: 5.7-6 GB/s here, slower than reading from the page cache
    from zlib import crc32 as _crc32

log = logging.getLogger(__name__)

#: The checksum of every part: CRC-32 as zlib computes it, by :data:`CRC32_IMPLEMENTATION`.
#: zlib's runs at 5.7 GB/s here (sha256: 1.6 GB/s, too slow to save within 0.8x of a
#: raw write). It guards against torn and bit-rotted files, not against an attacker
#: who can write the bucket.
CHECKSUM = "crc32"
CRC32_IMPLEMENTATION = f"{_crc32.__module__}.crc32"
MANIFEST = "manifest.json"
FORMAT = "pdps-checkpoint"
FORMAT_VERSION = 1

#: Big parts are written in pieces of this size, so that the crc32 of one piece is
#: computed while the next is written; storages without ``open_reader`` (object
#: stores, other adapters) are read in pieces of this size too, one request each.
PIECE = 64 * 2**20

#: Parts read through a storage's ``open_reader`` (local files: ``pread`` on one
#: descriptor) are read in pieces of this size, each hashed right after it was read,
#: while its bytes are still in the CPU cache: the crc32 then costs a fraction of a
#: pass over memory (ISA-L here: 17 GB/s from memory, 53 GB/s from the cache for
#: pieces of up to 4 MiB). One descriptor read in order for the whole part keeps the
#: kernel's read-ahead going on a cold page cache. A multiple of 2 MiB, the huge page
#: the buffer is made of.
READ_PIECE = 4 * 2**20

#: Parts bigger than this get a helper thread beside the caller's (crc32, file I/O
#: and page faults all release the GIL), whichever crc32. Writing, it hashes each
#: piece while the caller's thread writes it. Reading a local part from the page
#: cache, both threads read and hash pieces side by side; from the disk, the caller's
#: thread reads in order (read-ahead) and the helper hashes each piece while the next
#: is read (see :func:`_read_pieces_hashed`). bench/checkpoint.py, 1 GiB on 2 busy
#: cores (load 4-11), fastest rounds: restore 0.89x raw read warm, 0.84x cold, where
#: the crc32 inline in 64 MiB pieces, each opened anew, made 0.73x and 0.70x.
HASH_IN_THREAD_ABOVE = 8 * 2**20

# Read buffers from this size on are anonymous mmaps asking for transparent huge pages:
# first-touching 1 GiB of 4 KiB pages cost 0.25-0.45 s here, more than reading it from
# the page cache (0.1 s); with 2 MiB pages, about 0.01 s.
_HUGE_PAGES_ABOVE = 4 * 2**20

# safetensors' dtype names; every entry is a plain little-endian element type.
_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_BY_NAME = {name: dtype for dtype, name in _DTYPES.items()}

_ID = re.compile(r"ckpt-(\d{4,})-(\d{10,})-([0-9a-f]{4})")
_CHECKSUM = re.compile(r"crc32:[0-9a-f]{8}")


# --- ids --------------------------------------------------------------------------------


def checkpoint_id(epoch: int, round_no: int) -> str:
    """A new checkpoint's id: ``ckpt-<epoch:04d>-<round:010d>-<4 random hex>``.

    Ids of one job sort as their (epoch, round) do, as strings too while the epoch
    has at most 4 digits; the random part keeps two attempts at the same round apart.
    """
    for what, value in (("epoch", epoch), ("round", round_no)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"checkpoint {what} must be an int >= 0, got {value!r}")
    return f"ckpt-{epoch:04d}-{round_no:010d}-{secrets.token_hex(2)}"


def is_checkpoint_id(name: str) -> bool:
    """Whether ``name`` is an id :func:`checkpoint_id` makes."""
    return isinstance(name, str) and _ID.fullmatch(name) is not None


def _check_id(ckpt_id: object, error: type[StorageError] = StorageError) -> str:
    if not is_checkpoint_id(ckpt_id):  # type: ignore[arg-type]
        # Only names checkpoint_id() makes: a storage root shared with other data never
        # has that data taken for a checkpoint (and deleted by a clean-up).
        raise error(f"{ckpt_id!r} is not a checkpoint id (ckpt-<epoch>-<round>-<4 hex>, as checkpoint_id() makes)")
    return ckpt_id  # type: ignore[return-value]


# --- parts ------------------------------------------------------------------------------


def _checksum(value: int) -> str:
    return f"{CHECKSUM}:{value:08x}"


@attrs.frozen
class PartInfo:
    """One written part: where it is, how many bytes it holds and their crc32."""

    name: str
    path: str
    bytes: int
    checksum: str  # "crc32:%08x"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "path": self.path, "bytes": self.bytes, "checksum": self.checksum}

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
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise CorruptCheckpoint(f"checkpoint part {name!r}: 'bytes' must be an int >= 0, got {size!r}", path)
        if not isinstance(checksum, str) or not _CHECKSUM.fullmatch(checksum):
            raise CorruptCheckpoint(f"checkpoint part {name!r}: 'checksum' must look like crc32:0123abcd, got {checksum!r}", path)
        return cls(name=name, path=path, bytes=size, checksum=checksum)


def write_part(storage: Storage, path: str, tensors: Mapping[str, torch.Tensor], *, name: str | None = None) -> PartInfo:
    """Write ``tensors`` as one safetensors file at ``path``; return its PartInfo.

    Contiguous CPU tensors are written straight from their memory, which must not
    change until this returns (the pserver hands in copies). Others are copied first,
    one at a time: a CUDA tensor to the CPU, a non-contiguous one to contiguous.
    Tensors are laid out biggest element first, so that every tensor starts at a
    multiple of its element size and :func:`read_part` can return views without copies.
    ``name`` defaults to the file name without its extension (``ps-0``).

    Raises ConfigError for a dtype safetensors has no name for, or a name that is not
    a string; StorageError when the write fails (nothing is then visible at ``path``).
    """
    items = []
    for key, t in tensors.items():
        if not isinstance(key, str) or not key or key == "__metadata__":
            raise ConfigError(f"checkpoint part {path}: tensor names must be non-empty strings other than '__metadata__', got {key!r}")
        if not isinstance(t, torch.Tensor) or t.layout is not torch.strided:
            raise ConfigError(f"checkpoint part {path}: {key!r} is a {type(t).__name__}, not a dense tensor")
        if t.dtype not in _DTYPES:
            supported = ", ".join(str(d).removeprefix("torch.") for d in _DTYPES)
            raise ConfigError(f"checkpoint part {path}: {key!r} is {t.dtype}; checkpoints hold {supported}")
        items.append((key, t.detach()))
    items.sort(key=lambda kv: (-kv[1].element_size(), kv[0]))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, t in items:
        nbytes = t.numel() * t.element_size()
        header[key] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data then starts 8-aligned
    prefix = len(head).to_bytes(8, "little") + head

    def chunks() -> Iterator[memoryview | bytes]:
        yield prefix
        for _, t in items:
            if t.numel() == 0:
                continue
            yield from _pieces(_bytes_of(t))

    return _write(storage, path, chunks(), len(prefix) + offset, name)


def write_json_part(storage: Storage, path: str, obj: Any, *, name: str | None = None) -> PartInfo:
    """Write ``obj`` as a JSON part (the master's queue snapshot); return its PartInfo.

    Raises ConfigError when ``obj`` is not JSON (NaN and infinities included: the part
    must read back as the same value in any JSON reader). As in any JSON, dict keys
    read back as strings and tuples as lists.
    """
    try:
        data = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"checkpoint part {path}: {type(obj).__name__} is not JSON-safe: {exc}") from exc
    return _write(storage, path, [data], len(data), name)


def read_part(storage: Storage, info: PartInfo) -> dict[str, torch.Tensor]:
    """The tensors of a part :func:`write_part` wrote, checked against ``info``.

    The object is read into one new buffer; its size and crc32 are checked before any
    tensor is built, then every tensor is a view of that buffer (they keep it alive
    together: copy what must outlive the rest). Raises :class:`CorruptCheckpoint`
    naming the object and the fault: missing, wrong size, wrong checksum, a bad header
    (unknown dtype, offsets outside the data or leaving gaps); StorageError when the
    storage cannot be read.
    """
    buf = _read_checked(storage, info)
    entries, data_start = _parse_header(memoryview(buf.numpy()), buf.numel(), _where(storage, info.path), info.path)
    out: dict[str, torch.Tensor] = {}
    for key, dtype, shape, begin, end in entries:
        raw = buf[data_start + begin : data_start + end]
        if (data_start + begin) % dtype.itemsize:
            raw = raw.clone()  # another writer's unaligned layout: a copy is the only way
        out[key] = raw.view(dtype).reshape(shape)
    return out


def read_json_part(storage: Storage, info: PartInfo) -> Any:
    """The value of a part :func:`write_json_part` wrote, checked as :func:`read_part` does."""
    buf = _read_checked(storage, info)
    try:
        return json.loads(memoryview(buf.numpy()).tobytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptCheckpoint(f"checkpoint part {_where(storage, info.path)} is not JSON: {exc}", info.path) from exc


# --- manifests --------------------------------------------------------------------------


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
        _check_id(self.id, ConfigError)  # type: ignore[arg-type]
        for key, part in self.parts.items():
            if not isinstance(part, PartInfo) or part.name != key:
                raise ConfigError(f"checkpoint {self.id}: parts must map each part's name to its PartInfo, got {key!r}: {part!r}")
            if not part.path.startswith(f"{self.id}/") or part.path == self.path:
                # delete() removes the folder: a part elsewhere would outlive its
                # checkpoint, or vanish under it when another checkpoint is deleted.
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
        _check_id(ckpt_id, CorruptCheckpoint)
        where = f"checkpoint manifest {ckpt_id}"
        if not isinstance(job, str):
            raise CorruptCheckpoint(f"{where}: 'job' must be a string, got {job!r}")
        for field in ("epoch", "round"):
            value = d.get(field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise CorruptCheckpoint(f"{where}: {field!r} must be an int >= 0, got {value!r}")
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


def write_manifest(storage: Storage, manifest: Manifest) -> None:
    """Write ``<id>/manifest.json`` (atomically). Write it after every part: a manifest
    names parts that exist. Raises ConfigError when ``extra`` is not JSON-safe."""
    try:
        data = json.dumps(manifest.to_json(), indent=1, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"checkpoint {manifest.id}: the manifest's extra is not JSON-safe: {exc}") from exc
    storage.put(manifest.path, data)


def read_manifest(storage: Storage, ckpt_id: str) -> Manifest:
    """The manifest of checkpoint ``ckpt_id``; CorruptCheckpoint when it is missing or
    undecodable (or ``ckpt_id`` cannot name one), StorageError when storage fails."""
    path = f"{_check_id(ckpt_id, CorruptCheckpoint)}/{MANIFEST}"
    try:
        data = storage.get(path)
    except StorageError as exc:
        _raise_if_missing(storage, path, exc, "has no manifest (never finished, or deleted)")
        raise
    try:
        d = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptCheckpoint(f"checkpoint manifest {_where(storage, path)} is not JSON: {exc}", path) from exc
    try:
        manifest = Manifest.from_json(d)
    except CorruptCheckpoint as exc:
        raise CorruptCheckpoint(f"{_where(storage, path)}: {exc}", path) from exc
    if manifest.id != ckpt_id:
        raise CorruptCheckpoint(f"{_where(storage, path)} is the manifest of {manifest.id}, not of {ckpt_id} (copied?)", path)
    return manifest


def verify(storage: Storage, manifest: Manifest) -> list[str]:
    """What is wrong with the checkpoint's parts; ``[]`` when every part is sound.

    Reads every part fully (size, crc32, and the header of a ``.safetensors`` part or
    the text of a ``.json`` part), in pieces, without holding a big part in memory.
    Corruption is reported in the list; a storage that fails to answer raises
    StorageError, since it says nothing about the checkpoint.
    """
    problems = []
    for part in manifest.parts.values():
        try:
            if part.path.endswith(".json"):
                read_json_part(storage, part)
            else:
                _scan(storage, part, safetensors=part.path.endswith(".safetensors"))
        except CorruptCheckpoint as exc:
            problems.append(str(exc))
    return problems


def list_ids(storage: Storage) -> list[str]:
    """Ids of the checkpoints with any object or leftover in ``storage``, oldest (epoch,
    round) first.

    Only folders named as :func:`checkpoint_id` names them count; whether a checkpoint
    is complete is for :func:`read_manifest` and :func:`verify` to say. A folder that
    holds nothing but a killed writer's leftover counts, so that a clean-up finds it.
    """
    paths = storage.list() + [left.path for left in storage.leftovers()]
    found = {p.split("/", 1)[0] for p in paths if "/" in p}
    ids = [i for i in found if is_checkpoint_id(i)]
    return sorted(ids, key=_sort_key)


def leftovers(storage: Storage) -> list[Leftover]:
    """The leftovers of unfinished writes inside checkpoints' folders, by path: a part or
    a manifest whose writer was killed mid-write, or one still being written."""
    return [left for left in storage.leftovers() if is_checkpoint_id(left.path.split("/", 1)[0])]


def delete_leftovers(storage: Storage, *, older_than: float) -> list[Leftover]:
    """Delete the leftovers inside checkpoints' folders that nobody has written to for
    ``older_than`` seconds (their writers are dead); return them.

    A live writer pushes its file's modification time forward with every write, so a
    grace well above the longest pause inside one write never takes a live one.
    """
    now = time.time()
    dead = [left for left in leftovers(storage) if now - left.modified > older_than]
    for left in dead:
        storage.delete_leftover(left.path)
    return dead


def delete(storage: Storage, ckpt_id: str) -> int:
    """Delete every object under ``<ckpt_id>/``, the manifest first, then the folder if
    nothing is left in it; return how many objects.

    The manifest goes first so that a delete cut short leaves parts without a
    manifest (garbage a later delete removes), never a manifest without its parts. A
    leftover of a writer that may still live keeps the folder (and the checkpoint's
    id in :func:`list_ids`) until :func:`delete_leftovers` takes it.
    """
    prefix = f"{_check_id(ckpt_id)}/"
    paths = storage.list(prefix)
    paths.sort(key=lambda p: p != f"{prefix}{MANIFEST}")
    for p in paths:
        storage.delete(p)
    storage.delete_folder(ckpt_id)
    return len(paths)


# --- internals --------------------------------------------------------------------------


def _sort_key(ckpt_id: str) -> tuple[int, int, str]:
    m = _ID.fullmatch(ckpt_id)
    assert m is not None
    return int(m.group(1)), int(m.group(2)), ckpt_id


def _where(storage: Storage, path: str) -> str:
    return f"{storage.url.rstrip('/')}/{path}"


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The tensor's bytes as a flat memoryview of its own memory (copied only when the
    tensor is not a contiguous CPU tensor, which cannot be written from where it is)."""
    if t.device.type != "cpu":
        t = t.to("cpu")
    if not t.is_contiguous():
        t = t.contiguous()
    # uint8 view: numpy has no bfloat16, and bool must go out as its bytes
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _pieces(view: memoryview) -> Iterator[memoryview]:
    for start in range(0, view.nbytes, PIECE):
        yield view[start : start + PIECE]


def _hash_in_thread(nbytes: int) -> bool:
    return nbytes > HASH_IN_THREAD_ABOVE


# CRC-32 (zlib's polynomial, reflected) as arithmetic in GF(2)[x] mod p, after zlib's
# crc32_combine: the crc32 of a concatenation from the crc32s of its pieces.
_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    """a * b mod p, in zlib's reflected bit order (bit 31 is x^0)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x8n(nbytes: int) -> int:
    """x^(8 * nbytes) mod p: what appending ``nbytes`` bytes multiplies a crc32 by."""
    p, square, n = 1 << 31, 1 << 23, nbytes  # 1 << 23 is x^8, one byte
    while n:
        if n & 1:
            p = _multmodp(square, p)
        square = _multmodp(square, square)
        n >>= 1
    return p


def _crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The crc32 of ``A + B`` from crc32(A), crc32(B) and len(B), as zlib's crc32_combine."""
    return _multmodp(_x8n(len2), crc1) ^ crc2


@functools.lru_cache(maxsize=8)
def _shift_tables(nbytes: int) -> tuple[list[int], ...]:
    """Byte tables of c -> c * x^(8 * nbytes) mod p (a linear map): one lookup per byte."""
    xn = _x8n(nbytes)
    tables = []
    for k in range(4):
        table = [0] * 256
        for j in range(8):
            table[1 << j] = _multmodp(xn, 1 << (8 * k + j))
        for b in range(3, 256):
            low = b & -b
            if b != low:
                table[b] = table[b ^ low] ^ table[low]
        tables.append(table)
    return tuple(tables)


def _crc32_of_pieces(crcs: list[int], piece: int, last: int) -> int:
    """The crc32 of pieces of ``piece`` bytes (the last one ``last`` bytes) from theirs."""
    t0, t1, t2, t3 = _shift_tables(piece)
    value = crcs[0]
    for c in crcs[1:-1]:
        value = t0[value & 0xFF] ^ t1[(value >> 8) & 0xFF] ^ t2[(value >> 16) & 0xFF] ^ t3[value >> 24] ^ c
    if len(crcs) > 1:
        value = _crc32_combine(value, crcs[-1], last)
    return value


class _Crc32:
    """The running crc32 of buffers given in order; in a helper thread when ``threaded``.

    One worker runs the updates in the order they were submitted, so the chained value
    is right; the caller's thread meanwhile does the I/O.
    """

    def __init__(self, threaded: bool) -> None:
        self.value = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pdps-crc32") if threaded else None

    def update(self, data: memoryview | bytes) -> Future[None] | None:
        if self._pool is None:
            self.value = _crc32(data, self.value)
            return None
        return self._pool.submit(self._update, data)

    def _update(self, data: memoryview | bytes) -> None:
        self.value = _crc32(data, self.value)

    def result(self) -> int:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        return self.value

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def _hashed(chunks: Iterable[memoryview | bytes], crc: _Crc32) -> Iterator[memoryview | bytes]:
    for chunk in chunks:
        crc.update(chunk)  # hashed (in the helper) while the storage writes it
        yield chunk


def _write(storage: Storage, path: str, chunks: Iterable[memoryview | bytes], expected: int, name: str | None) -> PartInfo:
    crc = _Crc32(threaded=_hash_in_thread(expected))
    try:
        written = storage.put_chunks(path, _hashed(chunks, crc))
        value = crc.result()
    finally:
        crc.close()
    if written != expected:  # the storage's own accounting disagrees: nothing to trust
        raise StorageError(f"checkpoint part {_where(storage, path)}: wrote {written} bytes, expected {expected}")
    if name is None:
        name = path.rsplit("/", 1)[-1].split(".", 1)[0]
    return PartInfo(name=name, path=path, bytes=written, checksum=_checksum(value))


def _raise_if_missing(storage: Storage, path: str, exc: StorageError, what: str = "is missing") -> None:
    """Turn a failed read into CorruptCheckpoint when the object is not there at all;
    otherwise (the storage could not answer) the caller re-raises the StorageError."""
    try:
        there = storage.exists(path)
    except StorageError:
        return
    if not there:
        raise CorruptCheckpoint(f"checkpoint object {_where(storage, path)} {what}", path) from exc


def _checked_size(storage: Storage, info: PartInfo) -> int:
    try:
        size = storage.size(info.path)
    except StorageError as exc:
        _raise_if_missing(storage, info.path, exc)
        raise
    if size != info.bytes:
        raise CorruptCheckpoint(
            f"checkpoint part {_where(storage, info.path)} holds {size} bytes, the manifest says {info.bytes}", info.path
        )
    return size


def _check_crc(storage: Storage, info: PartInfo, value: int) -> None:
    if _checksum(value) != info.checksum:
        raise CorruptCheckpoint(
            f"checkpoint part {_where(storage, info.path)} fails its checksum: {_checksum(value)}, "
            f"the manifest says {info.checksum}",
            info.path,
        )


def _new_buffer(size: int) -> torch.Tensor:
    """A new uint8 tensor of ``size`` bytes for a part to be read into."""
    if size < _HUGE_PAGES_ABOVE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(size, dtype=torch.uint8)
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pass  # a kernel without transparent huge pages: 4 KiB pages, slower to touch
    return torch.frombuffer(m, dtype=torch.uint8)  # the tensor keeps the mapping alive


def _read_checked(storage: Storage, info: PartInfo) -> torch.Tensor:
    """The whole part in one new buffer, its size and crc32 checked."""
    size = _checked_size(storage, info)
    buf = _new_buffer(size)
    view = memoryview(buf.numpy())
    open_reader = getattr(storage, "open_reader", None)
    if open_reader is not None and size > READ_PIECE:
        with open_reader(info.path) as reader:
            if reader.parallel:
                cached = getattr(reader, "read_cached", None)
                value = _read_pieces_hashed(reader.read_into, view, 2 if _hash_in_thread(size) else 1, cached)
            else:
                value = _read_hashed(reader.read_into, view)
    else:
        value = _read_hashed(lambda piece, start: storage.read_into(info.path, piece, start), view)
    _check_crc(storage, info, value)
    return buf


def _read_hashed(read_into: Any, view: memoryview) -> int:
    """Fill ``view`` in PIECE pieces with ``read_into(piece, offset)``, one after the
    other; return its crc32, each piece hashed (in a helper thread for a big part)
    while the next is read."""
    size = view.nbytes
    crc = _Crc32(threaded=_hash_in_thread(size))
    try:
        for start in range(0, size, PIECE):
            piece = view[start : start + PIECE]
            read_into(piece, start)
            crc.update(piece)  # hashed while the next piece is read
        return crc.result()
    finally:
        crc.close()


def _read_pieces_hashed(read_into: Any, view: memoryview, threads: int, cached: Any = None) -> int:
    """Fill ``view`` in READ_PIECE pieces with ``read_into(piece, offset)``, in order;
    return its crc32. Each piece is hashed right after it was read, while its bytes
    are still in the CPU cache.

    This thread reads every piece, one after the other, so that the kernel sees one
    sequential reader and keeps its read-ahead going on a cold page cache. With
    ``threads`` > 1 a helper thread hashes the pieces this one hands it while this one
    reads on; when the helper falls behind (the other cores are busy), this thread
    hashes the piece itself instead of queueing it, so no piece waits long enough to
    leave the cache, and the reading never waits for the helper. The pieces' crc32s
    are combined, in order, into the part's.

    ``cached(piece, 0)``, when given, reads the first piece if the storage can without
    waiting for a disk (it is in the page cache) and says whether it did: then the
    rest is read by two threads side by side (:func:`_read_pieces_side_by_side`).
    """
    size, piece = view.nbytes, READ_PIECE
    if threads <= 1:
        value = 0
        for start in range(0, size, piece):
            chunk = view[start : start + piece]
            read_into(chunk, start)
            value = _crc32(chunk, value)
        return value
    count = -(-size // piece)
    crcs = [0] * count
    if cached is not None and cached(view[:piece], 0):
        # In the page cache (a part just written, or read before): no read-ahead to keep
        # going, so two threads read and hash pieces side by side, each taking the next.
        crcs[0] = _crc32(view[:piece])
        return _read_pieces_side_by_side(read_into, view, crcs, 1)
    todo: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    done = [0]  # pieces the helper has hashed (only it writes this)
    failures: list[BaseException] = []

    def hash_pieces() -> None:
        try:
            while (i := todo.get()) is not None:
                crcs[i] = _crc32(view[i * piece : (i + 1) * piece])
                done[0] += 1
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            failures.append(exc)

    helper = threading.Thread(target=hash_pieces, name="pdps-crc32", daemon=True)
    helper.start()
    handed = 0
    try:
        for i in range(count):
            chunk = view[i * piece : (i + 1) * piece]
            read_into(chunk, i * piece)
            if handed - done[0] < 2 and not failures:
                todo.put(i)  # hashed while the next piece is read
                handed += 1
            else:
                crcs[i] = _crc32(chunk)
    finally:
        todo.put(None)
        helper.join()
    if failures:
        raise failures[0]
    return _crc32_of_pieces(crcs, piece, size - (count - 1) * piece)


def _read_pieces_side_by_side(read_into: Any, view: memoryview, crcs: list[int], first: int) -> int:
    """Pieces ``first``.. of ``view`` read and hashed by this thread and a helper, each
    taking the next piece not yet taken (a thread held back by the scheduler costs only
    the piece it holds); returns the crc32 of the whole, ``crcs`` holding the first's."""
    size, piece, count = view.nbytes, READ_PIECE, len(crcs)
    take = itertools.count(first).__next__  # atomic under the GIL: each piece goes to one thread
    failures: list[BaseException] = []

    def work() -> None:
        try:
            while not failures:
                i = take()
                if i >= count:
                    return
                chunk = view[i * piece : (i + 1) * piece]
                read_into(chunk, i * piece)
                crcs[i] = _crc32(chunk)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            failures.append(exc)

    helper = threading.Thread(target=work, name="pdps-ckpt-read", daemon=True)
    helper.start()
    work()
    helper.join()
    if failures:
        raise failures[0]
    return _crc32_of_pieces(crcs, piece, size - (count - 1) * piece)


def _scan(storage: Storage, info: PartInfo, *, safetensors: bool) -> None:
    """:func:`read_part`'s checks without keeping the part: two piece buffers in turn."""
    where = _where(storage, info.path)
    size = _checked_size(storage, info)
    bufs = [bytearray(min(size, PIECE)) for _ in range(2 if size > PIECE else 1)]
    pending: list[Future[None] | None] = [None] * len(bufs)
    header_fault: CorruptCheckpoint | None = None
    crc = _Crc32(threaded=_hash_in_thread(size))
    try:
        for i, start in enumerate(range(0, size, PIECE)):
            slot = i % len(bufs)
            if pending[slot] is not None:
                pending[slot].result()  # type: ignore[union-attr]  # hashed: the buffer is free
            piece = memoryview(bufs[slot])[: min(PIECE, size - start)]
            storage.read_into(info.path, piece, start)
            if start == 0 and safetensors:
                header_fault = _header_fault(storage, info, piece, size, where)
            pending[slot] = crc.update(piece)
        value = crc.result()
    finally:
        crc.close()
    _check_crc(storage, info, value)
    if size == 0 and safetensors:
        header_fault = _header_fault(storage, info, memoryview(b""), 0, where)
    if header_fault is not None:
        raise header_fault


def _header_fault(storage: Storage, info: PartInfo, first: memoryview, size: int, where: str) -> CorruptCheckpoint | None:
    """What is wrong with a safetensors header whose file starts with ``first``, if anything."""
    try:
        if len(first) >= 8:
            n = int.from_bytes(first[:8], "little")
            if 8 + n > len(first) and 8 + n <= size:
                head = bytearray(8 + n)  # a header longer than a piece: read it alone
                storage.read_into(info.path, head)
                first = memoryview(head)
        _parse_header(first, size, where, info.path)
    except CorruptCheckpoint as exc:
        return exc
    return None


def _parse_header(
    view: memoryview, size: int, where: str, path: str
) -> tuple[list[tuple[str, torch.dtype, list[int], int, int]], int]:
    """The (name, dtype, shape, begin, end) of each tensor of a safetensors file of
    ``size`` bytes whose start is in ``view``, and where its data starts.

    Checks what safetensors' own reader checks: every entry's dtype, shape and span,
    and that the spans tile the data exactly (no gap, no overlap, no trailing bytes).
    """

    def corrupt(what: str) -> CorruptCheckpoint:
        return CorruptCheckpoint(f"checkpoint part {where} is not a valid safetensors file: {what}", path)

    if size < 8 or len(view) < 8:
        raise corrupt(f"{size} bytes, too short for the 8-byte header length")
    n = int.from_bytes(view[:8], "little")
    if 8 + n > size:
        raise corrupt(f"the header length {n} runs past the end of the file")

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        d = dict(pairs)
        if len(d) != len(pairs):
            raise ValueError("a name appears twice in the header")
        return d

    try:
        header = json.loads(view[8 : 8 + n].tobytes().decode("utf-8"), object_pairs_hook=unique)
    except (UnicodeDecodeError, ValueError) as exc:
        raise corrupt(f"the header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise corrupt("the header is not a JSON object")
    data_start, data_len = 8 + n, size - 8 - n
    entries = []
    for key, entry in header.items():
        if key == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise corrupt("__metadata__ must map names to strings")
            continue
        if not isinstance(entry, dict):
            raise corrupt(f"the entry of {key!r} is not an object")
        dtype = _BY_NAME.get(entry.get("dtype"))  # type: ignore[arg-type]
        if dtype is None:
            raise corrupt(f"{key!r} has dtype {entry.get('dtype')!r}; pdps reads {', '.join(_BY_NAME)}")
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise corrupt(f"{key!r} has shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise corrupt(f"{key!r} has data_offsets {offsets!r}")
        begin, end = offsets
        if not 0 <= begin <= end <= data_len:
            raise corrupt(f"{key!r} spans bytes {begin}..{end}, outside the {data_len} bytes of data")
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise corrupt(f"{key!r} is {shape} {entry['dtype']} but spans {end - begin} bytes")
        entries.append((key, dtype, shape, begin, end))
    pos = 0
    for key, _, _, begin, end in sorted(entries, key=lambda e: (e[3], e[4])):
        if begin != pos:
            raise corrupt(f"{key!r} starts at byte {begin} of the data, where {pos} was expected (a gap or an overlap)")
        pos = end
    if pos != data_len:
        raise corrupt(f"the tensors end at byte {pos} of the data, but the file holds {data_len} (trailing bytes)")
    return entries, data_start
