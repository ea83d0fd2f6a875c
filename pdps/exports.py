"""Model exports for serving: a model's tensors as safetensors plus a JSON manifest,
under one storage URL (``file://`` or ``s3://``), with a ``LATEST`` pointer that moves
only once an export is whole. See docs/online.md#model-exports.

* :func:`publish` writes the next export (and, with ``keep``, deletes old ones);
* :func:`latest` and :func:`list_exports` say what is there;
* :func:`load` reads one back, checked against its manifest.

The storage is opened by URL (:func:`pdps.open_storage`: ``s3://`` takes the standard
AWS variables); the work is :mod:`pdps.runtime.exports`'.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pdps.adapters.safetensors_files import SafetensorsFormat
from pdps.core.errors import ConfigError
from pdps.core.exports import Export, TensorSpec, check_url
from pdps.registry import open_storage
from pdps.runtime import exports as _exports

if TYPE_CHECKING:
    import torch

__all__ = ["Export", "TensorSpec", "latest", "list_exports", "load", "publish"]

_FORMAT = SafetensorsFormat()


def publish(url: str, tensors: Mapping[str, torch.Tensor], *, meta: Mapping[str, Any] | None = None, keep: int | None = None) -> Export:
    """Publish ``tensors`` (a state_dict: name -> tensor, CPU or CUDA) as the next export
    under ``url``; return it. ``meta`` (JSON-safe: window, round, version, ...) goes into
    its manifest; ``keep=K`` then deletes all but the K newest exports.

    Raises ConfigError (a bad URL, meta, keep, name or tensor) before anything is
    written; ExportConflict when other writers kept taking the number; StorageError
    when the storage fails.
    """
    tables = [name for name, t in tensors.items() if hasattr(t, "lookup") and hasattr(t, "spec")]
    if tables:
        raise ConfigError(
            f"the model has sparse tables {tables}: exporting a table's rows is not built yet, so a model with "
            "tables cannot be exported (export the dense parameters yourself, or fetch the rows with pdps.fetch_parameters)"
        )
    return _exports.publish(open_storage(check_url(url)), _FORMAT, tensors, meta=meta, keep=keep)


def latest(url: str) -> Export | None:
    """The export ``LATEST`` names under ``url``; None before the first publish."""
    return _exports.latest(open_storage(check_url(url)))


def list_exports(url: str) -> list[Export]:
    """The complete exports under ``url``, oldest first."""
    return _exports.list_exports(open_storage(check_url(url)))


def load(url: str, seq: int | None = None, *, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of export ``seq`` under ``url`` (``LATEST``'s when None), on ``device``.

    The model file's size and sha256, and its tensors' names, dtypes and shapes, are
    checked against the manifest: a mismatch or a missing piece raises CorruptExport
    naming the object.
    """
    _, tensors = _exports.load(open_storage(check_url(url)), _FORMAT, seq)
    if str(device) == "cpu":
        return tensors
    return {name: t.to(device) for name, t in tensors.items()}
