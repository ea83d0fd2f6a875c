"""Storage port: blobs (checkpoint parts, manifests, dataset shards) under one root URL.

Paths are relative to the root, ``/``-separated. Contract (every adapter passes
``tests/unit/contract_storage.py``):

* ``put`` is atomic: a reader sees the old object or the whole new one, never a
  prefix (local files are written to a temporary name and renamed).
* ``get`` of a missing path raises :class:`~pdps.core.errors.StorageError` naming it.
* ``list(prefix)`` returns the relative paths of objects whose path starts with
  ``prefix`` as a string (as S3 does: ``list("a")`` finds ``a/1`` and ``ab``), sorted.
* ``exists`` and ``delete`` concern objects, not folders; deleting a missing path is
  a no-op.
* Paths with ``..``, ``.``, empty parts or a leading ``/`` are refused before any I/O.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Storage(Protocol):
    url: str

    def put(self, path: str, data: bytes) -> None: ...

    def get(self, path: str) -> bytes: ...

    def exists(self, path: str) -> bool: ...

    def list(self, prefix: str = "") -> list[str]: ...

    def delete(self, path: str) -> None: ...
