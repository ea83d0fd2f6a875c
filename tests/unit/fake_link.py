"""An in-memory :class:`~pdps.ports.link.Link` for pipeline tests: one mailbox per rank.

Behaves as design/pipeline.md §2 asks of the real one: a send returns once the message
is in the receiver's mailbox (it never waits for the receive), the receiver gets copies
(never the sender's memory), the same ``(src, tag)`` twice before a receive is refused,
and a receive past its timeout raises :class:`~pdps.core.errors.Timeout`.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from pdps.core.errors import BadRequest, Timeout


class Mailboxes:
    """The shared post office: ``link(rank)`` is rank ``rank``'s end."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._boxes: dict[tuple[int, int, str], list[Any]] = {}  # (dst, src, tag) -> tensors
        self.sent: list[tuple[int, int, str, tuple[tuple[int, ...], ...]]] = []  # (src, dst, tag, shapes)

    def link(self, rank: int) -> QueueLink:
        return QueueLink(self, rank)

    def pending(self) -> list[tuple[int, int, str]]:
        with self._cond:
            return sorted(self._boxes)


class QueueLink:
    def __init__(self, boxes: Mailboxes, rank: int) -> None:
        self._boxes = boxes
        self.rank = rank

    def send(self, peer: int, tag: str, tensors: Sequence[Any], *, stop_gradient: Sequence[bool] | None = None) -> None:
        copies = [t.detach().clone() for t in tensors]
        box = self._boxes
        with box._cond:
            key = (peer, self.rank, tag)
            if key in box._boxes:
                raise BadRequest(f"rank {self.rank} sent {tag!r} to rank {peer} twice before it was received", field="tag")
            box._boxes[key] = copies
            box.sent.append((self.rank, peer, tag, tuple(tuple(t.shape) for t in copies)))
            box._cond.notify_all()

    def recv(self, peer: int, tag: str, *, timeout: float | None = None) -> list[Any]:
        box = self._boxes
        key = (self.rank, peer, tag)
        with box._cond:
            if not box._cond.wait_for(lambda: key in box._boxes, timeout=timeout):
                raise Timeout(f"rank {self.rank} waited {timeout}s for {tag!r} from rank {peer}")
            return box._boxes.pop(key)

    def batch_send_recv(self, sends, recvs, *, timeout=None):
        for peer, tag, tensors in sends:
            self.send(peer, tag, tensors)
        return [self.recv(peer, tag, timeout=timeout) for peer, tag in recvs]
