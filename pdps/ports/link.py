"""Link port: point-to-point tensor messages between the ranks of a pipeline.

What a stage runner (:mod:`pdps.adapters.torch_pipeline`) needs to move activations,
gradients and targets; :class:`pdps.runtime.p2p.P2P` implements it over any transport,
tests use in-memory fakes. design/pipeline.md §2 is the full contract; in short:

* A message is addressed by the receiving rank (``peer``) and a ``tag`` naming the
  step, the microbatch and the direction (``f"{step}/{mb}/act"``, ``f"{step}/{mb}/grad"``).
* ``send`` returns once the peer's mailbox holds the message: it never waits for the
  matching ``recv``, so no order of sends and receives deadlocks by itself.
* ``recv(peer, tag)`` waits for the message from ``peer`` with ``tag`` and returns its
  tensors, in the order sent, as tensors of the receiver's own (never views of the
  sender's memory); past ``timeout`` seconds it raises
  :class:`~pdps.core.errors.Timeout` naming the peer and the tag. The same
  ``(peer, tag)`` sent twice before it is received is an error.
* Shapes and dtypes may differ from one message to the next (the link carries each
  tensor's meta, design §1); ``stop_gradient`` is carried with it, one flag per tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Link(Protocol):
    def send(self, peer: int, tag: str, tensors: Sequence[Any], *, stop_gradient: Sequence[bool] | None = None) -> None:
        """Deliver ``tensors`` to ``peer``'s mailbox under ``tag`` (module docstring)."""
        ...

    def recv(self, peer: int, tag: str, *, timeout: float | None = None) -> list[Any]:
        """The tensors ``peer`` sent under ``tag``, waiting up to ``timeout`` seconds."""
        ...

    def batch_send_recv(
        self,
        sends: Sequence[tuple[int, str, Sequence[Any]]],
        recvs: Sequence[tuple[int, str]],
        *,
        timeout: float | None = None,
    ) -> list[list[Any]]:
        """Every send, then every receive; the received tensors in the order of ``recvs``."""
        ...
