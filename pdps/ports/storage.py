"""Storage port: blobs (checkpoint parts, manifests, dataset shards) under one root URL.

Paths are relative to the root, ``/``-separated. Contract (every adapter passes
``tests/unit/contract_storage.py``):

* ``put`` and ``put_chunks`` are atomic: a reader sees the old object or the whole
  new one, never a prefix (local files are written to a temporary name and renamed;
  object stores publish an upload only when it completes). A write that fails, or
  whose ``chunks`` raise, leaves the old object (or nothing) and nothing half-written.
* ``put_chunks`` writes straight from the caller's buffers (tensor memory, memoryviews)
  and ``read_into`` reads into the caller's buffer, so a checkpoint of gigabytes is
  never copied into one ``bytes`` on its way (object stores copy into HTTP bodies).
* ``get``, ``size`` and ``read_into`` of a missing path raise
  :class:`~pdps.core.errors.StorageError` naming it; so does a ``read_into`` that asks
  for bytes past the object's end.
* ``list(prefix)`` returns the relative paths of objects whose path starts with
  ``prefix`` as a string (as S3 does: ``list("a")`` finds ``a/1`` and ``ab``), sorted.
* ``exists`` and ``delete`` concern objects, not folders; deleting a missing path is
  a no-op. ``delete_folder`` removes a folder that holds nothing (no object, no
  leftover), and does nothing otherwise: to a storage without real folders (S3) a
  folder is a prefix, gone with its last object.
* A writer killed in the middle of a write can leave a *leftover* (a local temporary
  file; object stores publish an upload whole or not at all, so they have none).
  Leftovers are never objects: ``list``, ``get`` and ``exists`` do not see them.
  ``leftovers(prefix)`` lists them, with when each was last written to;
  ``delete_leftover`` deletes one. A write in progress is listed too: it is the
  caller who decides, by how long a leftover has gone unmodified, that its writer
  is dead.
* Paths with ``..``, ``.``, empty parts or a leading ``/`` are refused before any I/O.

Optional capabilities, checked with ``isinstance``: :class:`OpensReaders` (an object
opened once for many reads at offsets) and, on a :class:`Reader`, :class:`CachedReads`
(a read that does not wait for the disk).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

import attrs

#: What ``put_chunks`` takes and ``read_into`` fills: bytes, bytearray, memoryview, a
#: numpy array, ... (``read_into`` needs a writable one). Any C-contiguous buffer.
Buffer = bytes | bytearray | memoryview


@attrs.frozen
class Leftover:
    """What an unfinished write left behind: its path (relative, as objects' are, but
    never an object's), its size, and when it was last written to (seconds since the
    epoch, by the storage's clock: a live writer keeps pushing it forward)."""

    path: str
    bytes: int
    modified: float


@runtime_checkable
class Storage(Protocol):
    url: str

    def put(self, path: str, data: bytes) -> None: ...

    def put_chunks(self, path: str, chunks: Iterable[Buffer]) -> int:
        """Write the concatenation of ``chunks`` as one object, atomically; return its size.

        Chunks are consumed one at a time and written from the caller's memory, so
        they must stay unchanged until this returns. An exception raised by ``chunks``
        itself propagates unchanged (it is the caller's, not the storage's) after the
        partial write was thrown away. Raises StorageError naming the path when the
        write fails or a chunk is not a C-contiguous buffer.
        """
        ...

    def get(self, path: str) -> bytes: ...

    def size(self, path: str) -> int:
        """Bytes in the object at ``path``; StorageError naming it when there is none."""
        ...

    def read_into(self, path: str, buffer: Buffer, offset: int = 0) -> int:
        """Fill ``buffer`` (``n`` bytes) with the object's bytes ``[offset, offset + n)``; return ``n``.

        ``offset`` is a position in the object, so a big object can be read in pieces
        (a checksum of piece ``i`` runs while piece ``i + 1`` is read). To read a whole
        object, size the buffer with :meth:`size`. Raises StorageError naming the path
        when the object is missing or ends before ``offset + n`` (it holds fewer bytes
        than the caller expects: truncated, or replaced), and when ``buffer`` is not a
        writable C-contiguous buffer.
        """
        ...

    def exists(self, path: str) -> bool: ...

    def list(self, prefix: str = "") -> list[str]: ...

    def delete(self, path: str) -> None: ...

    def delete_folder(self, path: str) -> None:
        """Remove the folder ``path`` if it holds nothing; else, or when there is no such
        folder, or the storage has no real folders, do nothing."""
        ...

    def leftovers(self, prefix: str = "") -> list[Leftover]:
        """The leftovers of unfinished writes whose path starts with ``prefix``, sorted by path."""
        ...

    def delete_leftover(self, path: str) -> None:
        """Delete the leftover at ``path`` (one :meth:`leftovers` listed); a missing one is
        a no-op. A path that cannot name a leftover (an object's) raises StorageError."""
        ...


@runtime_checkable
class Reader(Protocol):
    """One object opened for many reads; what :meth:`OpensReaders.open_reader` yields.
    ``size`` is the object's size when it was opened; ``parallel``: ``read_into`` may be
    called from several threads at once."""

    size: int
    parallel: bool

    def read_into(self, buffer: Buffer, offset: int = 0) -> int:
        """As :meth:`Storage.read_into`, of the opened object; the same errors."""
        ...


@runtime_checkable
class OpensReaders(Protocol):
    """A storage that can open an object once for many reads at offsets: a checkpoint
    part is read in pieces, and reopening a local file for each piece restarts the
    kernel's read-ahead on a cold page cache."""

    def open_reader(self, path: str) -> AbstractContextManager[Reader]: ...


@runtime_checkable
class CachedReads(Protocol):
    """A :class:`Reader` that can read what the page cache holds without waiting for the disk."""

    def read_cached(self, buffer: Buffer, offset: int = 0) -> bool:
        """Fill ``buffer`` from ``offset`` if that needs no wait for the disk: True when it
        did, False when it would have waited (``buffer`` then holds an unknown part)."""
        ...
