"""Checkpoint files port: the parts and manifests of a job's checkpoints in one storage.

The records are core's (:mod:`pdps.core.checkpoints`); an adapter owns the bytes
(:class:`pdps.adapters.safetensors_files.SafetensorsFiles`). Contract:

* A part is written atomically and described by the :class:`PartInfo` returned: its
  size and crc32s are of exactly the bytes written.
* A reader trusts nothing it has not checked: a part's size, then its checksums (of
  the pieces it reads, for a read of some entries), then its structure, all before a
  value is built. Anything wrong raises
  :class:`~pdps.core.errors.CorruptCheckpoint` naming the object and the fault (fall
  back to another checkpoint); a storage that cannot answer raises a plain
  :class:`~pdps.core.errors.StorageError` (retry).
* Every part and the manifest live in the checkpoint's folder ``<id>/``: ``delete``
  removes the manifest first (a half-deleted checkpoint is never taken for whole),
  the folder last.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

from pdps.core.checkpoints import Manifest, PartInfo
from pdps.ports.storage import Leftover


@runtime_checkable
class CheckpointFiles(Protocol):
    url: str  # the storage's root, as the pointer records it

    def write_part(self, path: str, tensors: Mapping[str, Any], *, name: str | None = None) -> PartInfo:
        """Write ``tensors`` (the compute's tensors, by name) as one part at ``path``."""
        ...

    def read_part(self, part: PartInfo, *, wanted: Callable[[str], bool] | None = None) -> dict[str, Any]:
        """The tensors of a part :meth:`write_part` wrote, checked against ``part``.

        ``wanted``: a predicate on entry names; only the entries it takes are returned,
        and only their bytes read where the part records piece checksums (the header,
        then the ranges of the wanted entries, each piece they touch checked by its
        crc32: a corrupt piece no wanted entry touches goes unnoticed, as :meth:`verify`
        would not let it). The result then holds no more memory than the wanted entries.
        """
        ...

    def write_json_part(self, path: str, obj: Any, *, name: str | None = None) -> PartInfo:
        """Write ``obj`` as a JSON part (ConfigError when it is not JSON-safe)."""
        ...

    def read_json_part(self, part: PartInfo) -> Any: ...

    def write_manifest(self, manifest: Manifest) -> None:
        """Write ``<id>/manifest.json``, after every part it names."""
        ...

    def read_manifest(self, ckpt_id: str) -> Manifest: ...

    def verify(self, manifest: Manifest) -> list[str]:
        """What is wrong with the checkpoint's parts; ``[]`` when every part is sound."""
        ...

    def list_ids(self) -> list[str]:
        """Ids of the checkpoints with anything in storage, oldest (epoch, round) first."""
        ...

    def leftovers(self) -> list[Leftover]:
        """Leftovers of unfinished writes inside checkpoints' folders."""
        ...

    def delete_leftovers(self, *, older_than: float) -> list[Leftover]:
        """Delete the leftovers nobody has written to for ``older_than`` seconds; return them."""
        ...

    def delete(self, ckpt_id: str) -> int:
        """Delete the checkpoint's objects (the manifest first) and its folder; return how many."""
        ...
