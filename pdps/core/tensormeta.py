"""The tensor meta of pipeline messages: Paddle's int64 vector (seed 002) and its cache.

A pipeline stage tells its neighbour the shapes, dtypes and ``stop_gradient`` flags of
the tensors it sends as one flat vector of ints, exactly Paddle's ``send_meta`` /
``recv_meta`` (``p2p_communication.py``):

* one tensor: ``[0, shape_len, *shape, dtype_number, stop_gradient]``
* several: ``[1, tensor_num, (shape_len, *shape, dtype_number, stop_gradient) * tensor_num]``

with the dtype numbers of :data:`DTYPE_NUMBERS`. Rules of this module:

* :func:`decode_meta` parses until nothing is left and trusts nothing: every refusal
  is a :class:`~pdps.core.errors.MetaError` naming the position in the vector and the
  value found there (a type other than 0/1, a tensor count or a rank out of bounds, a
  negative dimension, more than :data:`MAX_ELEMENTS` elements in one tensor, an
  unknown dtype number, a ``stop_gradient`` other than 0/1, a vector that ends early
  or has values left over, a value that is not an int). It does work bounded by
  :data:`MAX_VALUES` whatever it is given.
* :func:`encode_meta` refuses what :func:`decode_meta` would refuse, so a sender finds
  out before anything is sent.
* The meta travels once per (peer, signature): :class:`MetaCache` is the sender's
  side (an id per signature, ``is_new`` the first time), :class:`ReceivedMetas` the
  receiver's (``(peer, id) -> metas``, per sender incarnation). A message naming an id
  the receiver does not know is refused, never guessed; the sender then sends the meta
  again. Ids only grow, so an id never changes meaning within an incarnation.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import attrs
import numpy as np

from pdps.core.errors import MetaError

#: Paddle's ``PADDLE_TO_NUMBER``, by torch's dtype names without ``torch.``.
DTYPE_NUMBERS: Mapping[str, int] = MappingProxyType(
    {"float16": 0, "float32": 1, "float64": 2, "int32": 3, "int64": 4, "bfloat16": 5, "bool": 6}
)
#: The dtype name of each number.
DTYPE_NAMES: Mapping[int, str] = MappingProxyType({n: name for name, n in DTYPE_NUMBERS.items()})
#: Bytes per element of each dtype number.
DTYPE_SIZES: Mapping[int, int] = MappingProxyType({0: 2, 1: 4, 2: 8, 3: 4, 4: 8, 5: 2, 6: 1})
#: Dtype numbers of floating dtypes (the ones a NaN/Inf check and autograd apply to).
FLOATING: frozenset[int] = frozenset({0, 1, 2, 5})

#: Most tensors in one message.
MAX_TENSORS = 64
#: Most dimensions of one tensor.
MAX_DIMS = 8
#: Most elements of one tensor (2**34: 64 GiB of float32).
MAX_ELEMENTS = 1 << 34
#: Longest valid vector: type, count, and per tensor its rank, dims, dtype and flag.
MAX_VALUES = 2 + MAX_TENSORS * (MAX_DIMS + 3)


@attrs.frozen
class TensorMeta:
    """One tensor's shape, dtype (the seed's number, :data:`DTYPE_NUMBERS`) and
    ``stop_gradient`` (True: the receiver's copy takes no gradient)."""

    shape: tuple[int, ...] = attrs.field(converter=tuple)
    dtype: int
    stop_gradient: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES[self.dtype]

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES.get(self.dtype, f"dtype #{self.dtype}")

    def __str__(self) -> str:
        flag = "" if self.stop_gradient else " (takes gradient)"
        return f"{self.dtype_name}{list(self.shape)}{flag}"


def describe(metas: Sequence[TensorMeta]) -> str:
    """``float32[32, 64] (takes gradient), int64[32]``: metas as messages name them."""
    return ", ".join(str(m) for m in metas)


def encode_meta(metas: Sequence[TensorMeta], *, several: bool | None = None) -> list[int]:
    """The seed's vector of ``metas``. ``several=None``: type 0 for one tensor, 1 for
    more; ``several=True`` writes one tensor as type 1; ``several=False`` with more than
    one tensor is refused. Refuses (MetaError) what :func:`decode_meta` would."""
    metas = list(metas)
    if not 1 <= len(metas) <= MAX_TENSORS:
        raise MetaError(f"tensor meta of {len(metas)} tensors: a message carries 1 to {MAX_TENSORS}")
    if several is None:
        several = len(metas) > 1
    if not several and len(metas) > 1:
        raise MetaError(f"tensor meta of {len(metas)} tensors cannot be written as one tensor (type 0): pass several=True or None")
    out = [1, len(metas)] if several else [0]
    for i, m in enumerate(metas):
        shape = m.shape
        if len(shape) > MAX_DIMS:
            raise MetaError(f"tensor {i} has {len(shape)} dimensions {list(shape)}: at most {MAX_DIMS}")
        if not all(_is_int(d) and 0 <= d <= MAX_ELEMENTS for d in shape):
            raise MetaError(f"tensor {i} has shape {list(shape)}: dimensions are ints from 0 to {MAX_ELEMENTS}")
        if math.prod(shape) > MAX_ELEMENTS:
            raise MetaError(f"tensor {i} of shape {list(shape)} has {math.prod(shape)} elements, more than {MAX_ELEMENTS}")
        if not _is_int(m.dtype) or m.dtype not in DTYPE_SIZES:
            raise MetaError(f"tensor {i} has dtype number {m.dtype!r}: known are {dict(DTYPE_NUMBERS)}")
        if not isinstance(m.stop_gradient, (bool, np.bool_)):
            raise MetaError(f"tensor {i} has stop_gradient {m.stop_gradient!r}: True or False")
        out += [len(shape), *(int(d) for d in shape), int(m.dtype), int(bool(m.stop_gradient))]
    return out


def decode_meta(values: Sequence[int]) -> tuple[tuple[TensorMeta, ...], bool]:
    """``(metas, several)`` of the seed's vector ``values``; MetaError naming the
    position and the value for anything wrong (see the module docstring)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
        raise MetaError(f"tensor meta must be a list of ints, got {type(values).__name__}")
    if len(values) > MAX_VALUES:
        raise MetaError(f"tensor meta of {len(values)} values: a valid one has at most {MAX_VALUES} ({MAX_TENSORS} tensors of {MAX_DIMS} dimensions)")
    for pos, v in enumerate(values):
        if not _is_int(v):
            raise MetaError(f"tensor meta position {pos} holds {v!r:.40} ({type(v).__name__}), not an int")
    vals = [int(v) for v in values]
    reader = _Reader(vals)
    kind = reader.take("the type (0: one tensor, 1: several)")
    if kind not in (0, 1):
        raise MetaError(f"tensor meta position 0 (type) is {kind}: 0 (one tensor) or 1 (several)")
    count = 1
    if kind == 1:
        count = reader.take("the tensor count")
        if not 1 <= count <= MAX_TENSORS:
            raise MetaError(f"tensor meta position 1 (tensor count) is {count}: 1 to {MAX_TENSORS}")
    metas = []
    for i in range(count):
        at = reader.pos
        rank = reader.take(f"tensor {i}'s shape_len")
        if not 0 <= rank <= MAX_DIMS:
            raise MetaError(f"tensor meta position {at} (tensor {i}'s shape_len) is {rank}: 0 to {MAX_DIMS}")
        shape = []
        first = reader.pos
        for d in range(rank):
            at = reader.pos
            dim = reader.take(f"tensor {i}'s dimension {d}")
            if not 0 <= dim <= MAX_ELEMENTS:
                raise MetaError(f"tensor meta position {at} (tensor {i}'s dimension {d}) is {dim}: dimensions are 0 to {MAX_ELEMENTS}")
            shape.append(dim)
        if math.prod(shape) > MAX_ELEMENTS:
            raise MetaError(f"tensor meta: tensor {i}'s shape {shape} (positions {first} to {reader.pos - 1}) has {math.prod(shape)} elements, more than {MAX_ELEMENTS}")
        at = reader.pos
        dtype = reader.take(f"tensor {i}'s dtype number")
        if dtype not in DTYPE_SIZES:
            raise MetaError(f"tensor meta position {at} (tensor {i}'s dtype number) is {dtype}: known are {dict(DTYPE_NUMBERS)}")
        at = reader.pos
        stop = reader.take(f"tensor {i}'s stop_gradient")
        if stop not in (0, 1):
            raise MetaError(f"tensor meta position {at} (tensor {i}'s stop_gradient) is {stop}: 0 or 1")
        metas.append(TensorMeta(tuple(shape), dtype, bool(stop)))
    if reader.pos != len(vals):
        left = vals[reader.pos :]
        raise MetaError(
            f"tensor meta has {len(left)} values left over from position {reader.pos} on, after {count} tensor(s) (parsed until nothing is left): {left[:16]}"
        )
    return tuple(metas), kind == 1


class _Reader:
    def __init__(self, values: list[int]) -> None:
        self.values = values
        self.pos = 0

    def take(self, what: str) -> int:
        if self.pos >= len(self.values):
            raise MetaError(f"tensor meta ends at position {self.pos}, before {what} ({len(self.values)} values: {self.values[:16]})")
        v = self.values[self.pos]
        self.pos += 1
        return v


def _is_int(v: Any) -> bool:
    """An int of JSON or numpy; a bool is no int here."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


Signature = tuple[TensorMeta, ...]


def signature(metas: Sequence[TensorMeta]) -> Signature:
    """What a message's meta is cached by: its tensors' metas, in order."""
    return tuple(metas)


@attrs.define
class MetaCache:
    """The sender's side: an id per (peer, signature). ``ident`` says whether the meta
    must travel (``is_new``: the first time this peer gets this signature). A peer holds
    at most ``limit`` signatures; past that its table starts over (new ids: ids only
    grow, so one never changes meaning). ``forget(peer)`` after the peer restarted."""

    limit: int = 1024
    _ids: dict[Hashable, dict[Signature, int]] = attrs.field(factory=dict, init=False)
    _next: dict[Hashable, int] = attrs.field(factory=dict, init=False)

    signature = staticmethod(signature)

    def ident(self, peer: Hashable, sig: Signature) -> tuple[int, bool]:
        table = self._ids.setdefault(peer, {})
        known = table.get(sig)
        if known is not None:
            return known, False
        if len(table) >= self.limit:
            table.clear()
        n = self._next.get(peer, 0)
        self._next[peer] = n + 1
        table[sig] = n
        return n, True

    def forget(self, peer: Hashable) -> None:
        """Send every meta to ``peer`` again (ids keep growing)."""
        self._ids.pop(peer, None)

    def forget_id(self, peer: Hashable, ident: int) -> None:
        """Send the meta of ``ident`` again next time (its receiver did not know it)."""
        table = self._ids.get(peer)
        if table:
            for sig, n in list(table.items()):
                if n == ident:
                    del table[sig]


@attrs.define
class ReceivedMetas:
    """The receiver's side: ``(peer, id) -> metas`` of the sender's current incarnation
    (``session``: a new one drops the old one's ids). Keeps the ``limit`` highest ids
    per peer (the sender's own table is no larger)."""

    limit: int = 1024
    _tables: dict[Hashable, tuple[str, dict[int, Signature]]] = attrs.field(factory=dict, init=False)

    def learn(self, peer: Hashable, session: str, ident: int, metas: Sequence[TensorMeta]) -> None:
        held = self._tables.get(peer)
        if held is None or held[0] != session:
            held = self._tables[peer] = (session, {})
        table = held[1]
        table[ident] = tuple(metas)
        if len(table) > self.limit:
            del table[min(table)]

    def get(self, peer: Hashable, session: str, ident: int) -> Signature | None:
        held = self._tables.get(peer)
        if held is None or held[0] != session:
            return None
        return held[1].get(ident)
