"""The coordination store's values: keys read, the conditions and writes of a
transaction, and the decision of one read-modify-write.

These are plain data, shared by the store port (:mod:`pdps.ports.coordination`, which
re-exports them), its adapters and the pure rules in core that decide what to write.

A read-modify-write is a pure function from what was read to a :class:`Decision`:
:class:`Write` (these guards must hold, then these ops; the caller gets ``result``)
or :class:`Done` (nothing to write; the caller gets ``result``). One loop in the shell
(:func:`pdps.runtime.cas.read_modify_write`) reads, decides, commits, and reads again
when a guard no longer holds.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Generic, TypeVar, Union

import attrs

R = TypeVar("R")


@attrs.frozen
class KeyValue:
    key: str
    value: bytes
    mod_revision: int
    lease: int | None = None


class Op(str, enum.Enum):
    EQ = "=="
    NE = "!="
    LT = "<"
    GT = ">"


@attrs.frozen
class Compare:
    """One condition of a transaction.

    ``Compare.revision(key, Op.EQ, 0)`` means "the key does not exist";
    ``Compare.value(key, Op.EQ, b"x")`` compares the stored bytes.
    """

    key: str
    target: str  # "revision" | "value"
    op: Op
    operand: int | bytes

    @classmethod
    def revision(cls, key: str, op: Op, rev: int) -> Compare:
        return cls(key, "revision", op, rev)

    @classmethod
    def value(cls, key: str, op: Op, value: bytes) -> Compare:
        return cls(key, "value", op, value)

    @classmethod
    def absent(cls, key: str) -> Compare:
        return cls(key, "revision", Op.EQ, 0)

    @classmethod
    def unchanged(cls, key: str, read: KeyValue | None) -> Compare:
        """The key is still as it was read (``read`` None: still absent)."""
        return cls.absent(key) if read is None else cls(key, "revision", Op.EQ, read.mod_revision)

    def holds(self, current: KeyValue | None) -> bool:
        """Evaluate against the key's current state (shared by the in-memory adapters)."""
        if self.target == "revision":
            left: int | bytes = current.mod_revision if current else 0
        else:
            if current is None:
                return False
            left = current.value
        op = self.op
        if op is Op.EQ:
            return left == self.operand
        if op is Op.NE:
            return left != self.operand
        if op is Op.LT:
            return left < self.operand  # type: ignore[operator]
        return left > self.operand  # type: ignore[operator]


@attrs.frozen
class Put:
    key: str
    value: bytes
    lease: int | None = None


@attrs.frozen
class Delete:
    key: str


TxnOp = Union[Put, Delete]


@attrs.frozen
class TxnResult:
    succeeded: bool
    revision: int  # the store revision after the transaction


@attrs.frozen
class Fence:
    """Proof of lock ownership: the lock key, its owner value and the revision it was taken at."""

    key: str
    owner: bytes
    revision: int

    def compares(self) -> tuple[Compare, Compare]:
        return (Compare.value(self.key, Op.EQ, self.owner), Compare.revision(self.key, Op.EQ, self.revision))


class EventType(str, enum.Enum):
    PUT = "put"
    DELETE = "delete"


@attrs.frozen
class WatchEvent:
    type: EventType
    key: str
    value: bytes | None
    revision: int




@attrs.frozen
class Write(Generic[R]):
    """Commit ``ops`` if every guard holds; then the read-modify-write returns ``result``."""

    guards: Sequence[Compare]
    ops: Sequence[TxnOp]
    result: Any = None


@attrs.frozen
class Done(Generic[R]):
    """Nothing to write: the read-modify-write returns ``result`` as it is."""

    result: Any = None


Decision = Union[Write, Done]
