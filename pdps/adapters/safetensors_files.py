"""Checkpoint files in storage: parts as safetensors and JSON, the manifest, integrity.

What this module owns: the bytes of a checkpoint in a :class:`~pdps.ports.storage.Storage`
and their integrity (:class:`SafetensorsFiles` is the :class:`~pdps.ports.checkpoints.CheckpointFiles`
port over one storage; the functions take the storage as their first argument). The same
files are model exports' (:class:`SafetensorsFormat`, the
:class:`~pdps.ports.tensor_format.TensorFormat` port: :func:`encode` and :func:`decode`). Which
checkpoints exist, which one is committed and what each record holds are
:mod:`pdps.core.checkpoints`' rules, applied by :mod:`pdps.runtime.recovery`.

Layout under the checkpoint storage's root, one folder per checkpoint::

    ckpt-0003-0000001200-9f2c/        a checkpoint id: epoch, round, 4 hex
        ps-0.safetensors              a pserver's shard (values, optimizer state)
        ps-1.safetensors
        master.json                   the master's queue snapshot
        manifest.json                 written last: every part's path, size and crc32s

Rules:

* A part is written atomically (``put_chunks``) straight from tensor memory; the crc32
  of the whole part and of each ``READ_PIECE`` piece are computed over exactly the
  bytes written, while they are written.
* A reader trusts nothing it has not checked: a part's size, then its crc32s, then its
  header, all before a tensor is built. Anything wrong raises :class:`CorruptCheckpoint`
  naming the object and what is wrong; an unreachable storage stays a plain
  :class:`StorageError` (retry it; a corrupt part, fall back). Pieces are checked each
  on its own, so two threads can read one part; a part recorded without pieces (by an
  older pdps) is read in order and checked by its whole crc32.
* A read of some entries (``read_part(..., wanted=)``: a pserver restoring its own
  slots) reads the pieces that hold the header, then only the pieces that hold a
  wanted byte, each once and checked by its crc32: a piece it does not read is not
  checked (:func:`verify` reads them all). A part without pieces is read whole.
* Tensors are safetensors files (8-byte little-endian header length, a JSON header
  of dtype/shape/data_offsets padded with spaces to 8 bytes, raw little-endian data):
  any safetensors reader loads them, and nothing is ever unpickled. The header is
  built and checked here: the ``safetensors`` package parses only whole files by local
  path (``safe_open``) or whole ``bytes`` (``deserialize``, a copy of every tensor),
  so it cannot check a part read from an object store into one buffer, and its
  errors do not say which fault (a gap or an overlap) a header has. The tests read
  our files with it and read its files with us.
* Parts live under their checkpoint's folder, so ``delete`` of a checkpoint removes
  all of it (the manifest first: a half-deleted checkpoint is never taken for whole),
  the folder last.
* A writer killed mid-write leaves a temporary file (a *leftover*) in the folder;
  :func:`delete_leftovers` deletes those nobody has written to for a grace period.

torch is imported where tensors are written or read, so that a master (whose part is
JSON) and ``pdps checkpoint`` start without it.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import mmap
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import attrs

from pdps.core.checkpoints import MANIFEST, Manifest, PartInfo, check_id, checksum_text, id_order, is_checkpoint_id
from pdps.core.errors import ConfigError, CorruptCheckpoint, StorageError
from pdps.core.exports import TensorSpec
from pdps.ports.storage import CachedReads, Leftover, OpensReaders, Storage
from pdps.ports.tensor_format import Encoded

if TYPE_CHECKING:
    import torch

try:  # ISA-L's crc32 (pip install 'pdps[isal]'): the same checksums, 24 GB/s here
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # zlib's: 5.7-6 GB/s here, slower than reading from the page cache
    from zlib import crc32 as _crc32

log = logging.getLogger(__name__)

#: zlib's crc32 runs at 5.7 GB/s here (sha256: 1.6 GB/s, too slow to save within 0.8x
#: of a raw write); ISA-L's at 24 GB/s.
CRC32_IMPLEMENTATION = f"{_crc32.__module__}.crc32"

#: Big parts are written in pieces of this size, so that the crc32s of one piece are
#: computed while the next is written; storages without ``open_reader`` (object
#: stores, other adapters) are read in pieces of this size too, one request each.
PIECE = 64 * 2**20

#: The pieces a part's crc32s are recorded for (``PartInfo.piece_bytes``), and what a
#: part read through a storage's ``open_reader`` (local files: ``pread`` on one
#: descriptor) is read in: each piece is hashed right after it was read, while its
#: bytes are still in the CPU cache, so the crc32 costs a fraction of a pass over
#: memory (ISA-L here: 17 GB/s from memory, 53 GB/s from the cache for pieces of up to
#: 4 MiB). One descriptor read in order for the whole part keeps the kernel's
#: read-ahead going on a cold page cache. A multiple of 2 MiB, the huge page the
#: buffer is made of. A 1 GiB part records 256 crc32s (2.8 kB of manifest).
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

# safetensors' dtype names: the torch dtype of each and its size in bytes. Every one is
# a plain little-endian element type.
_DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
}


@attrs.frozen
class SafetensorsFiles:
    """The :class:`~pdps.ports.checkpoints.CheckpointFiles` of the checkpoints in
    ``storage``: this module's functions, bound to it."""

    storage: Storage

    @property
    def url(self) -> str:
        return self.storage.url

    def write_part(self, path: str, tensors: Mapping[str, torch.Tensor], *, name: str | None = None) -> PartInfo:
        return write_part(self.storage, path, tensors, name=name)

    def read_part(self, part: PartInfo, *, wanted: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
        return read_part(self.storage, part, wanted)

    def write_json_part(self, path: str, obj: Any, *, name: str | None = None) -> PartInfo:
        return write_json_part(self.storage, path, obj, name=name)

    def read_json_part(self, part: PartInfo) -> Any:
        return read_json_part(self.storage, part)

    def write_manifest(self, manifest: Manifest) -> None:
        write_manifest(self.storage, manifest)

    def read_manifest(self, ckpt_id: str) -> Manifest:
        return read_manifest(self.storage, ckpt_id)

    def verify(self, manifest: Manifest) -> list[str]:
        return verify(self.storage, manifest)

    def list_ids(self) -> list[str]:
        return list_ids(self.storage)

    def leftovers(self) -> list[Leftover]:
        return leftovers(self.storage)

    def delete_leftovers(self, *, older_than: float) -> list[Leftover]:
        return delete_leftovers(self.storage, older_than=older_than)

    def delete(self, ckpt_id: str) -> int:
        return delete(self.storage, ckpt_id)


@attrs.frozen
class SafetensorsFormat:
    """The :class:`~pdps.ports.tensor_format.TensorFormat` of safetensors files: :func:`encode` and :func:`decode`."""

    def encode(self, tensors: Mapping[str, torch.Tensor], where: str) -> Encoded:
        return encode(tensors, where)

    def decode(
        self, buf: Any, where: str, path: str, error: Callable[[str, str], StorageError]
    ) -> tuple[dict[str, torch.Tensor], tuple[TensorSpec, ...]]:
        return decode(buf, where, path, error)


# --- parts ------------------------------------------------------------------------------


def write_part(storage: Storage, path: str, tensors: Mapping[str, torch.Tensor], *, name: str | None = None) -> PartInfo:
    """Write ``tensors`` as one safetensors file at ``path`` (see :func:`encode`); return
    its PartInfo. ``name`` defaults to the file name without its extension (``ps-0``).

    Raises ConfigError as :func:`encode` does; StorageError when the write fails
    (nothing is then visible at ``path``).
    """
    file = encode(tensors, f"checkpoint part {path}")
    return _write(storage, path, file.chunks, file.size, name)


def encode(tensors: Mapping[str, torch.Tensor], where: str) -> Encoded:
    """``tensors`` as a safetensors file, to be written from its chunks.

    Contiguous CPU tensors are written straight from their memory, which must not
    change until the chunks are consumed (the pserver hands in copies). Others are
    copied first, one at a time, as the chunks are: a CUDA tensor to the CPU, a
    non-contiguous one to contiguous. Tensors are laid out biggest element first, so
    that every tensor starts at a multiple of its element size and :func:`decode` can
    return views without copies.

    Raises ConfigError naming ``where`` and the tensor, before any chunk exists, for a
    value that is not a dense tensor, a dtype safetensors has no name for, or a name
    that is not a string.
    """
    import torch

    names = {getattr(torch, attr): key for key, (attr, _) in _DTYPES.items()}
    items = []
    for key, t in tensors.items():
        if not isinstance(key, str) or not key or key == "__metadata__":
            raise ConfigError(f"{where}: tensor names must be non-empty strings other than '__metadata__', got {key!r}")
        if not isinstance(t, torch.Tensor) or t.layout is not torch.strided:
            raise ConfigError(f"{where}: {key!r} is a {type(t).__name__}, not a dense tensor")
        if t.dtype not in names:
            supported = ", ".join(attr for attr, _ in _DTYPES.values())
            raise ConfigError(f"{where}: {key!r} is {t.dtype}; pdps's safetensors files hold {supported}")
        items.append((key, t.detach()))
    specs = tuple(TensorSpec(key, names[t.dtype], tuple(t.shape)) for key, t in items)
    items.sort(key=lambda kv: (-kv[1].element_size(), kv[0]))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, t in items:
        nbytes = t.numel() * t.element_size()
        header[key] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
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

    return Encoded(len(prefix) + offset, chunks(), specs)


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


def read_part(storage: Storage, info: PartInfo, wanted: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a part :func:`write_part` wrote, checked against ``info``.

    The object is read into one new buffer; its size and crc32s are checked before any
    tensor is built, then every tensor is a view of that buffer (they keep it alive
    together: copy what must outlive the rest). Raises :class:`CorruptCheckpoint`
    naming the object and the fault: missing, wrong size, wrong checksum, a bad header
    (unknown dtype, offsets outside the data or leaving gaps); StorageError when the
    storage cannot be read.

    ``wanted``: a predicate on entry names; only the entries it takes are returned, and
    of a part recorded with pieces only they are read (:func:`_read_wanted`): its header
    (the pieces that hold it, checked first, then the whole header parsed and checked),
    then the byte ranges of the wanted entries, adjacent entries in one range, each
    ``piece_bytes`` piece they touch read whole and checked by its crc32. A corrupt
    piece no wanted entry touches goes unnoticed (:func:`verify` reads everything). The
    tensors are views of one buffer holding just the wanted entries. A part recorded
    without pieces is read whole, checked, and the wanted entries copied out of it.
    """
    if wanted is not None and info.pieces:
        return _read_wanted(storage, info, wanted)
    buf = _read_checked(storage, info)
    tensors = decode(buf, f"checkpoint part {_where(storage, info.path)}", info.path)[0]
    return tensors if wanted is None else _kept(tensors, wanted)


def _kept(tensors: dict[str, torch.Tensor], wanted: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """The tensors ``wanted`` takes: all of them as they are, some of them as copies (so
    that the buffer the others are views of goes)."""
    kept = {k: t for k, t in tensors.items() if wanted(k)}
    return kept if len(kept) == len(tensors) else {k: t.clone() for k, t in kept.items()}


@attrs.frozen
class _Range:
    """Adjacent wanted entries: bytes ``[start, end)`` of the part, placed at ``at`` in
    the buffer they are read into (``at`` and ``start`` agree modulo 8, so every entry
    keeps the alignment it has in the file)."""

    start: int
    end: int
    at: int


def _wanted_ranges(entries: Iterable[tuple[str, str, list[int], int, int]], data_start: int) -> list[_Range]:
    """The byte ranges of the part that the non-empty ``entries`` (some of those
    :func:`_parse_header` gives) span, adjacent ones merged, in file order."""
    spans = sorted((data_start + begin, data_start + end) for _, _, _, begin, end in entries if end > begin)
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and merged[-1][1] == start:
            merged[-1][1] = end
        else:
            merged.append([start, end])
    ranges, at = [], 0
    for start, end in merged:
        at += (start - at) % 8
        ranges.append(_Range(start, end, at))
        at += end - start
    return ranges


def _read_wanted(storage: Storage, info: PartInfo, wanted: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """:func:`read_part` of the entries ``wanted`` takes, reading only the pieces that
    hold the header or a wanted byte, each piece once, in file order.

    Pieces that wanted bytes fill whole are read straight into the result's buffer (a
    run of them as :func:`_read_checked` reads a whole part: a helper thread hashes
    while the next piece is read); a piece holding other bytes too is read into a
    scratch piece and its wanted bytes copied out. Bytes read: at most the part's."""
    import bisect
    import contextlib

    import torch

    where = f"checkpoint part {_where(storage, info.path)}"
    size = _checked_size(storage, info)
    piece = info.piece_bytes
    opened = storage.open_reader(info.path) if isinstance(storage, OpensReaders) else contextlib.nullcontext(None)
    with opened as reader:
        if reader is not None:
            read_into = reader.read_into
            cached = reader.read_cached if reader.parallel and isinstance(reader, CachedReads) else None
        else:
            read_into, cached = (lambda buf, offset: storage.read_into(info.path, buf, offset)), None

        def read_checked(first: int, view: memoryview) -> None:
            """Pieces ``first``.. into ``view`` (which they fill), each checked by its crc32."""
            start = first * piece
            threads = 2 if _hash_in_thread(view.nbytes) else 1
            in_cache = (lambda chunk, offset: cached(chunk, start + offset)) if cached is not None else None
            crcs = _read_pieces_hashed(lambda chunk, offset: read_into(chunk, start + offset), view, threads, in_cache, piece=piece)
            _check_pieces(storage, info, crcs, first)

        # The header: the pieces that hold it, checked before a byte of it is believed.
        head = bytearray(min(size, piece))
        read_checked(0, memoryview(head))
        end = 8 + int.from_bytes(head[:8], "little") if size >= 8 else 0
        if end <= size:  # (a header running past the end is _parse_header's to refuse)
            more = -(-end // piece) * piece - len(head)
            if more > 0:
                rest = bytearray(min(more, size - len(head)))
                read_checked(len(head) // piece, memoryview(rest))
                head += rest
        entries, data_start = _parse_header(memoryview(head), size, where, info.path)
        if len(head) == size:  # the whole part was in the header's pieces
            return _kept(decode(head, where, info.path)[0], wanted)

        entries = [e for e in entries if wanted(e[0])]
        ranges = _wanted_ranges(entries, data_start)
        total = ranges[-1].at + ranges[-1].end - ranges[-1].start if ranges else 0
        buf = _new_buffer(total) if total else bytearray(0)
        out = memoryview(buf)
        ends = [r.end for r in ranges]

        def copy_out(view: memoryview, start: int) -> None:
            """The wanted bytes of ``view`` (the part's bytes from ``start``) into ``out``."""
            end = start + view.nbytes
            i = bisect.bisect_right(ends, start)
            while i < len(ranges) and ranges[i].start < end:
                r = ranges[i]
                lo, hi = max(r.start, start), min(r.end, end)
                out[r.at + lo - r.start : r.at + hi - r.start] = view[lo - start : hi - start]
                i += 1

        copy_out(memoryview(head), 0)
        done = len(head) // piece  # pieces read: those before this one
        scratch: memoryview | None = None
        for r in ranges:
            first, last = max(r.start // piece, done), (r.end - 1) // piece
            full_from = first if first * piece >= r.start else first + 1
            full_to = last + 1 if min(size, (last + 1) * piece) <= r.end else last  # pieces [full_from, full_to) lie inside r
            for p in range(first, last + 1):
                if p < done:
                    continue
                if full_from <= p < full_to:
                    lo, hi = p * piece, min(size, full_to * piece)
                    read_checked(p, out[r.at + lo - r.start : r.at + hi - r.start])
                    done = full_to
                    continue
                if scratch is None:
                    scratch = memoryview(bytearray(piece))
                view = scratch[: min(piece, size - p * piece)]
                read_checked(p, view)
                copy_out(view, p * piece)
                done = p + 1

    data = torch.frombuffer(buf, dtype=torch.uint8) if total else torch.empty(0, dtype=torch.uint8)
    tensors: dict[str, torch.Tensor] = {}
    for key, dtype_name, shape, begin, end in entries:
        attr, itemsize = _DTYPES[dtype_name]
        if end == begin:
            tensors[key] = torch.empty(shape, dtype=getattr(torch, attr))
            continue
        r = ranges[bisect.bisect_right(ends, data_start + begin)]
        at = r.at + data_start + begin - r.start
        raw = data[at : at + end - begin]
        if at % itemsize:
            raw = raw.clone()  # another writer's unaligned layout: a copy is the only way
        tensors[key] = raw.view(getattr(torch, attr)).reshape(shape)
    return tensors


def decode(
    buf: Any, where: str, path: str, error: Callable[[str, str], StorageError] = CorruptCheckpoint
) -> tuple[dict[str, torch.Tensor], tuple[TensorSpec, ...]]:
    """The tensors of the safetensors file in ``buf`` (views of it, which keep it alive)
    and their specs, in the file's order. Raises ``error(message, path)`` naming
    ``where`` when the header is not a valid one."""
    import torch

    entries, data_start = _parse_header(memoryview(buf), len(buf), where, path, error)
    data = torch.frombuffer(buf, dtype=torch.uint8)  # the tensors keep the buffer alive
    out: dict[str, torch.Tensor] = {}
    for key, dtype_name, shape, begin, end in entries:
        attr, itemsize = _DTYPES[dtype_name]
        raw = data[data_start + begin : data_start + end]
        if (data_start + begin) % itemsize:
            raw = raw.clone()  # another writer's unaligned layout: a copy is the only way
        out[key] = raw.view(getattr(torch, attr)).reshape(shape)
    return out, tuple(TensorSpec(key, dtype, tuple(shape)) for key, dtype, shape, _, _ in entries)


def read_json_part(storage: Storage, info: PartInfo) -> Any:
    """The value of a part :func:`write_json_part` wrote, checked as :func:`read_part` does."""
    buf = _read_checked(storage, info)
    try:
        return json.loads(memoryview(buf).tobytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptCheckpoint(f"checkpoint part {_where(storage, info.path)} is not JSON: {exc}", info.path) from exc


# --- manifests --------------------------------------------------------------------------


def write_manifest(storage: Storage, manifest: Manifest) -> None:
    """Write ``<id>/manifest.json`` (atomically). Write it after every part: a manifest
    names parts that exist. Raises ConfigError when ``extra`` is not JSON-safe."""
    storage.put(manifest.path, manifest.encode())


def read_manifest(storage: Storage, ckpt_id: str) -> Manifest:
    """The manifest of checkpoint ``ckpt_id``; CorruptCheckpoint when it is missing or
    undecodable (or ``ckpt_id`` cannot name one), StorageError when storage fails."""
    path = f"{check_id(ckpt_id, CorruptCheckpoint)}/{MANIFEST}"
    try:
        data = storage.get(path)
    except StorageError as exc:
        _raise_if_missing(storage, path, exc, "has no manifest (never finished, or deleted)")
        raise
    return Manifest.decode(data, ckpt_id, _where(storage, path))


def verify(storage: Storage, manifest: Manifest) -> list[str]:
    """What is wrong with the checkpoint's parts; ``[]`` when every part is sound.

    Reads every part fully (size, crc32s, and the header of a ``.safetensors`` part or
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

    Only folders named as checkpoint ids count; whether a checkpoint is complete is for
    :func:`read_manifest` and :func:`verify` to say. A folder that holds nothing but a
    killed writer's leftover counts, so that a clean-up finds it.
    """
    paths = storage.list() + [left.path for left in storage.leftovers()]
    found = {p.split("/", 1)[0] for p in paths if "/" in p}
    return sorted((i for i in found if is_checkpoint_id(i)), key=id_order)


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
    prefix = f"{check_id(ckpt_id)}/"
    paths = storage.list(prefix)
    paths.sort(key=lambda p: p != f"{prefix}{MANIFEST}")
    for p in paths:
        storage.delete(p)
    storage.delete_folder(ckpt_id)
    return len(paths)


# --- internals --------------------------------------------------------------------------


def _where(storage: Storage, path: str) -> str:
    return f"{storage.url.rstrip('/')}/{path}"


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The tensor's bytes as a flat memoryview of its own memory (copied only when the
    tensor is not a contiguous CPU tensor, which cannot be written from where it is)."""
    import torch

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


class _Hasher:
    """The crc32s of the buffers given in order: of them all (``whole``) and of each
    ``piece`` bytes of them (``pieces``, when ``piece`` is given); in a helper thread
    when ``threaded``.

    One worker runs the updates in the order they were submitted, so the chained values
    are right; the caller's thread meanwhile does the I/O. A buffer is hashed in slices
    of at most ``READ_PIECE``, each slice by both crc32s in turn while it is in the CPU
    cache.
    """

    def __init__(self, threaded: bool, *, whole: bool, piece: int | None) -> None:
        self.whole = 0
        self.pieces: list[int] = []
        self._with_whole = whole
        self._piece = piece
        self._filled = 0  # bytes of the last piece hashed so far; 0: a new piece starts
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pdps-crc32") if threaded else None

    def update(self, data: memoryview | bytes) -> Future[None] | None:
        if self._pool is None:
            self._update(data)
            return None
        return self._pool.submit(self._update, data)

    def _update(self, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        pos, size = 0, view.nbytes
        while pos < size:
            take = min(size - pos, READ_PIECE)
            if self._piece is not None:
                take = min(take, self._piece - self._filled)
            chunk = view[pos : pos + take]
            if self._with_whole:
                self.whole = _crc32(chunk, self.whole)
            if self._piece is not None:
                if self._filled == 0:
                    self.pieces.append(0)
                self.pieces[-1] = _crc32(chunk, self.pieces[-1])
                self._filled = (self._filled + take) % self._piece
            pos += take

    def result(self) -> _Hasher:
        """Itself, once every update is done."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        return self

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def _hashed(chunks: Iterable[memoryview | bytes], hasher: _Hasher) -> Iterator[memoryview | bytes]:
    for chunk in chunks:
        hasher.update(chunk)  # hashed (in the helper) while the storage writes it
        yield chunk


def _write(storage: Storage, path: str, chunks: Iterable[memoryview | bytes], expected: int, name: str | None) -> PartInfo:
    piece = READ_PIECE
    hasher = _Hasher(threaded=_hash_in_thread(expected), whole=True, piece=piece)
    try:
        written = storage.put_chunks(path, _hashed(chunks, hasher))
        hasher.result()
    finally:
        hasher.close()
    if written != expected:  # the storage's own accounting disagrees: nothing to trust
        raise StorageError(f"checkpoint part {_where(storage, path)}: wrote {written} bytes, expected {expected}")
    if name is None:
        name = path.rsplit("/", 1)[-1].split(".", 1)[0]
    pieces = tuple(f"{c:08x}" for c in hasher.pieces)
    return PartInfo(name=name, path=path, bytes=written, checksum=checksum_text(hasher.whole), pieces=pieces, piece_bytes=piece)


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


def _check_pieces(storage: Storage, info: PartInfo, crcs: list[int], first: int = 0) -> None:
    """``crcs``, the crc32s of pieces ``first``.., against the part's record."""
    assert info.pieces is not None
    for i, (got, want) in enumerate(zip(crcs, info.pieces[first:]), first):
        if f"{got:08x}" != want:
            start = i * info.piece_bytes
            raise CorruptCheckpoint(
                f"checkpoint part {_where(storage, info.path)} fails its checksum: {checksum_text(got)} for bytes "
                f"{start}..{min(start + info.piece_bytes, info.bytes)} (piece {i}), the manifest says crc32:{want}",
                info.path,
            )


def _check(storage: Storage, info: PartInfo, hasher: _Hasher) -> None:
    if info.pieces is not None:
        _check_pieces(storage, info, hasher.pieces)
    elif checksum_text(hasher.whole) != info.checksum:
        raise CorruptCheckpoint(
            f"checkpoint part {_where(storage, info.path)} fails its checksum: {checksum_text(hasher.whole)}, "
            f"the manifest says {info.checksum}",
            info.path,
        )


def _new_buffer(size: int) -> bytearray | mmap.mmap:
    """A new writable buffer of ``size`` bytes for a part to be read into."""
    if size < _HUGE_PAGES_ABOVE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return bytearray(size)
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pass  # a kernel without transparent huge pages: 4 KiB pages, slower to touch
    return m


def _read_checked(storage: Storage, info: PartInfo) -> bytearray | mmap.mmap:
    """The whole part in one new buffer, its size and crc32s checked.

    Pieces are checked each on its own: a local part is read by two threads side by
    side when the page cache holds it. A part recorded without pieces is read in order,
    chaining its crc32."""
    size = _checked_size(storage, info)
    buf = _new_buffer(size)
    view = memoryview(buf)
    if isinstance(storage, OpensReaders) and size > READ_PIECE:
        with storage.open_reader(info.path) as reader:
            if info.pieces is not None and reader.parallel:
                threads = 2 if _hash_in_thread(size) else 1
                cached = reader.read_cached if isinstance(reader, CachedReads) else None
                crcs = _read_pieces_hashed(reader.read_into, view, threads, cached, piece=info.piece_bytes)
                _check_pieces(storage, info, crcs)
            else:
                _check(storage, info, _read_hashed(reader.read_into, view, READ_PIECE, info.piece_bytes or None))
    else:
        read_into = lambda piece, start: storage.read_into(info.path, piece, start)  # noqa: E731
        _check(storage, info, _read_hashed(read_into, view, PIECE, info.piece_bytes or None))
    return buf


def _read_hashed(read_into: Any, view: memoryview, step: int, piece: int | None) -> _Hasher:
    """Fill ``view`` in ``step`` pieces with ``read_into(chunk, offset)``, one after the
    other, each hashed (in a helper thread for a big part) while the next is read: the
    crc32 of each ``piece`` bytes, or (``piece`` None) of the whole."""
    size = view.nbytes
    hasher = _Hasher(threaded=_hash_in_thread(size), whole=piece is None, piece=piece)
    try:
        for start in range(0, size, step):
            chunk = view[start : start + step]
            read_into(chunk, start)
            hasher.update(chunk)  # hashed while the next chunk is read
        return hasher.result()
    finally:
        hasher.close()


def _read_pieces_hashed(read_into: Any, view: memoryview, threads: int, cached: Any = None, *, piece: int | None = None) -> list[int]:
    """Fill ``view`` in pieces of ``piece`` bytes (default ``READ_PIECE``) with
    ``read_into(chunk, offset)``, in order; return the crc32 of each piece. Each piece
    is hashed right after it was read, while its bytes are still in the CPU cache.

    This thread reads every piece, one after the other, so that the kernel sees one
    sequential reader and keeps its read-ahead going on a cold page cache. With
    ``threads`` > 1 a helper thread hashes the pieces this one hands it while this one
    reads on; when the helper falls behind (the other cores are busy), this thread
    hashes the piece itself instead of queueing it, so no piece waits long enough to
    leave the cache, and the reading never waits for the helper.

    ``cached(chunk, 0)``, when given, reads the first piece if the storage can without
    waiting for a disk (it is in the page cache) and says whether it did: then the
    rest is read by two threads side by side (:func:`_read_pieces_side_by_side`).
    """
    size, piece = view.nbytes, piece or READ_PIECE
    count = -(-size // piece)
    crcs = [0] * count
    if threads <= 1:
        for i in range(count):
            chunk = view[i * piece : (i + 1) * piece]
            read_into(chunk, i * piece)
            crcs[i] = _crc32(chunk)
        return crcs
    if cached is not None and cached(view[:piece], 0):
        # In the page cache (a part just written, or read before): no read-ahead to keep
        # going, so two threads read and hash pieces side by side, each taking the next.
        crcs[0] = _crc32(view[:piece])
        _read_pieces_side_by_side(read_into, view, crcs, 1, piece)
        return crcs
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
    return crcs


def _read_pieces_side_by_side(read_into: Any, view: memoryview, crcs: list[int], first: int, piece: int) -> None:
    """Pieces ``first``.. of ``view`` read and hashed into ``crcs`` by this thread and a
    helper, each taking the next piece not yet taken (a thread held back by the
    scheduler costs only the piece it holds)."""
    count = len(crcs)
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


def _scan(storage: Storage, info: PartInfo, *, safetensors: bool) -> None:
    """:func:`read_part`'s checks without keeping the part: two piece buffers in turn."""
    where = _where(storage, info.path)
    size = _checked_size(storage, info)
    bufs = [bytearray(min(size, PIECE)) for _ in range(2 if size > PIECE else 1)]
    pending: list[Future[None] | None] = [None] * len(bufs)
    header_fault: CorruptCheckpoint | None = None
    hasher = _Hasher(threaded=_hash_in_thread(size), whole=info.pieces is None, piece=info.piece_bytes or None)
    try:
        for i, start in enumerate(range(0, size, PIECE)):
            slot = i % len(bufs)
            if pending[slot] is not None:
                pending[slot].result()  # type: ignore[union-attr]  # hashed: the buffer is free
            chunk = memoryview(bufs[slot])[: min(PIECE, size - start)]
            storage.read_into(info.path, chunk, start)
            if start == 0 and safetensors:
                header_fault = _header_fault(storage, info, chunk, size, where)
            pending[slot] = hasher.update(chunk)
        hasher.result()
    finally:
        hasher.close()
    _check(storage, info, hasher)
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
        _parse_header(first, size, f"checkpoint part {where}", info.path)
    except CorruptCheckpoint as exc:
        return exc
    return None


def _parse_header(
    view: memoryview, size: int, where: str, path: str, error: Callable[[str, str], StorageError] = CorruptCheckpoint
) -> tuple[list[tuple[str, str, list[int], int, int]], int]:
    """The (name, dtype, shape, begin, end) of each tensor of a safetensors file of
    ``size`` bytes whose start is in ``view``, and where its data starts.

    Checks what safetensors' own reader checks: every entry's dtype, shape and span,
    and that the spans tile the data exactly (no gap, no overlap, no trailing bytes).
    """

    def corrupt(what: str) -> StorageError:
        return error(f"{where} is not a valid safetensors file: {what}", path)

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
        dtype = entry.get("dtype")
        if not isinstance(dtype, str) or dtype not in _DTYPES:
            raise corrupt(f"{key!r} has dtype {dtype!r}; pdps reads {', '.join(_DTYPES)}")
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise corrupt(f"{key!r} has shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise corrupt(f"{key!r} has data_offsets {offsets!r}")
        begin, end = offsets
        if not 0 <= begin <= end <= data_len:
            raise corrupt(f"{key!r} spans bytes {begin}..{end}, outside the {data_len} bytes of data")
        if end - begin != math.prod(shape) * _DTYPES[dtype][1]:
            raise corrupt(f"{key!r} is {shape} {dtype} but spans {end - begin} bytes")
        entries.append((key, dtype, shape, begin, end))
    pos = 0
    for key, _, _, begin, end in sorted(entries, key=lambda e: (e[3], e[4])):
        if begin != pos:
            raise corrupt(f"{key!r} starts at byte {begin} of the data, where {pos} was expected (a gap or an overlap)")
        pos = end
    if pos != data_len:
        raise corrupt(f"the tensors end at byte {pos} of the data, but the file holds {data_len} (trailing bytes)")
    return entries, data_start
