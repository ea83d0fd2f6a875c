"""Tensor format port: tensors by name to the bytes of one file and back.

What :mod:`pdps.runtime.exports` needs to publish and load a model without importing
torch; :class:`pdps.adapters.safetensors_files.SafetensorsFormat` is the adapter
(safetensors files, which any safetensors reader loads). Contract:

* ``encode`` checks every name and tensor before it returns, so a refusal
  (:class:`~pdps.core.errors.ConfigError`: not a tensor, a dtype the format cannot
  hold) comes before anything is written; its chunks are then written as they are,
  from the tensors' memory, which must not change until they are consumed.
* ``decode`` checks the file's structure (header, spans) before it builds a tensor and
  raises ``error(message, path)`` naming ``where`` for anything wrong; the tensors it
  returns are views of ``buffer``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

import attrs

from pdps.core.errors import StorageError
from pdps.core.exports import TensorSpec
from pdps.ports.storage import Buffer


@attrs.frozen
class Encoded:
    """A file not yet written: its size, its bytes as chunks, and its tensors in the
    order they were given."""

    size: int
    chunks: Iterable[Buffer]
    specs: tuple[TensorSpec, ...]


@runtime_checkable
class TensorFormat(Protocol):
    def encode(self, tensors: Mapping[str, Any], where: str) -> Encoded:
        """The file holding ``tensors``; ConfigError naming ``where`` and the tensor when one cannot go in."""
        ...

    def decode(
        self, buffer: Any, where: str, path: str, error: Callable[[str, str], StorageError]
    ) -> tuple[dict[str, Any], tuple[TensorSpec, ...]]:
        """The tensors of the file in ``buffer`` (views of it) and their specs."""
        ...
