"""The wire protocol: one class per request and per reply of every call the roles serve.

Rules of this module:

* A call travels as a JSON-safe ``meta`` mapping plus raw tensors (the transport
  port's :class:`~pdps.ports.transport.Message`). :meth:`Wire.encode` and
  :meth:`Wire.decode` are the only code that reads or writes ``meta``; a role gets
  and answers typed objects (``pdps.roles.calls`` does the wrapping).
* A request validates itself on decode: every field present or defaulted, of its
  type, in its range. A refusal is a :class:`~pdps.core.errors.BadRequest` (for
  ``init`` and ``push``, its subclass :class:`~pdps.core.errors.GradientRejected`)
  whose message names the call, the field and the trainer. What needs the server's
  state (which blocks it holds: :meth:`PushRequest.claim`) is a pure method the
  server calls with that state. Keys a request does not define are ignored (a
  transport may add its own).
* A value of None is not sent, and an absent key decodes to the field's default.
* ``version`` in a pserver request is the *slot-map* version the request was
  computed for (:class:`~pdps.core.slots.SlotMap`); a pserver counts its applied
  updates in ``updates``.
* Rows of sparse tables ride in the pserver calls as *row sections*: a list field of
  ``[table, n]`` pairs in meta (``tables``, ``created``), and per pair its tensors
  after the dense block tensors, in the pairs' order (a push: ids ``[n]`` then
  gradients ``[n, dim]``; a pull: ids ``[n]``; a pull's reply: rows ``[n, dim]``).
  The wire checks their structure (pairs, each table once, ``n >= 0``, the tensor
  count, each tensor's leading dimension ``n``); dtypes, id ranges and finite values
  are the pserver's to check (``TorchRows.check``), since they need the tables.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol

import attrs

from pdps.core.errors import BadGraph, BadRequest, GradientRejected
from pdps.core.slots import Block
from pdps.core.tasks import TaskSpec

_MISSING = object()


class Envelope(Protocol):
    """What a transport carries: :class:`~pdps.ports.transport.Message` is one."""

    @property
    def meta(self) -> Mapping[str, Any]: ...

    @property
    def tensors(self) -> Sequence[Any]: ...

    @property
    def deadline(self) -> float | None:
        """When the caller stops waiting (``time.monotonic()`` of the serving process),
        set by the transport from the call's timeout; None without one."""
        ...

    @property
    def owned(self) -> bool:
        """Whether the handler may keep the tensors without a copy (nobody else writes them)."""
        ...


# --- fields ---------------------------------------------------------------------------


@attrs.frozen
class _Wire:
    """How one attribute travels: its meta ``key``, its JSON ``kind``, a range ``check``
    (the problem in words, or None) and, for lists, each ``item``'s kind."""

    key: str | None
    kind: type
    check: Callable[[Any], str | None] | None = None
    item: type | None = None


def _field(kind: type, *, key: str | None = None, default: Any = _MISSING, check: Callable[[Any], str | None] | None = None, item: type | None = None) -> Any:
    meta = {"wire": _Wire(key, kind, check, item)}
    if default is _MISSING:
        return attrs.field(metadata=meta)
    return attrs.field(default=default, metadata=meta)


def _tensors() -> Any:
    return attrs.field(default=(), converter=tuple, metadata={"tensors": True}, repr=lambda ts: f"<{len(ts)} tensors>", eq=False)


def _at_least(low: int) -> Callable[[Any], str | None]:
    return lambda v: None if v >= low else f"must be >= {low}"


def _finite_positive(v: float) -> str | None:
    return None if math.isfinite(v) and v > 0 else "must be a finite number > 0"


def _nonempty(v: str) -> str | None:
    return None if v else "must not be empty"


def _names_once(v: Sequence[str]) -> str | None:
    return None if len(set(v)) == len(v) else "names a block more than once"


def _leading(t: Any) -> int | None:
    """A tensor's first dimension; None for what is no tensor or has no dimension."""
    shape = getattr(t, "shape", None)
    return int(shape[0]) if shape is not None and hasattr(t, "dtype") and len(shape) >= 1 else None


def _is(kind: type, value: Any) -> bool:
    """JSON kinds: a bool is no number, an int is a float too."""
    if isinstance(value, bool):
        return kind is bool
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)


_KIND_NAMES = {int: "a whole number", float: "a number", str: "a string", bool: "true or false", list: "a list", dict: "an object"}


class Wire:
    """Base of every request and reply: the one codec between typed objects and meta."""

    #: the error a refused field raises
    REFUSAL: ClassVar[type[BadRequest]] = BadRequest

    @classmethod
    def _specs(cls) -> list[tuple[attrs.Attribute, str | None, _Wire | None]]:
        """(attribute, meta key, how it travels) per field; the tensors field has no key."""
        specs = _SPECS.get(cls)
        if specs is None:
            specs = _SPECS[cls] = [
                (a, None, None) if "tensors" in a.metadata else (a, a.metadata["wire"].key or a.name, a.metadata["wire"])
                for a in attrs.fields(cls)  # type: ignore[arg-type]
                if "local" not in a.metadata
            ]
        return specs

    def encode(self) -> tuple[dict[str, Any], list[Any]]:
        """``(meta, tensors)`` for the transport: JSON-safe meta, None values left out."""
        meta: dict[str, Any] = {}
        tensors: list[Any] = []
        for a, key, _ in self._specs():
            value = getattr(self, a.name)
            if key is None:
                tensors = list(value)
            elif value is not None:
                meta[key] = _json(value)
        return meta, tensors

    @classmethod
    def decode(cls, envelope: Envelope) -> Any:
        """The object ``envelope`` carries, each field checked; raises :attr:`REFUSAL`
        naming the first wrong field."""
        meta = envelope.meta
        if not isinstance(meta, Mapping):
            raise cls.REFUSAL(f"{cls._what(None)}: meta must be an object, got {type(meta).__name__}")
        trainer = meta.get("trainer") if isinstance(meta.get("trainer"), str) else None
        values: dict[str, Any] = {}
        for a, key, spec in cls._specs():
            if key is None or spec is None:
                values[a.name] = tuple(envelope.tensors)
                continue
            if key not in meta or (meta[key] is None and a.default is None):
                if a.default is attrs.NOTHING:
                    raise cls.REFUSAL(f"{cls._what(trainer)}: request names no {key!r}", field=key, trainer=trainer)
                continue
            values[a.name] = cls._value(meta[key], key, spec, trainer)
        if issubclass(cls, Request):
            values["deadline"] = envelope.deadline
            values["owned"] = envelope.owned
        obj = cls(**values)
        obj._validate()
        return obj

    @classmethod
    def _value(cls, value: Any, key: str, spec: _Wire, trainer: str | None) -> Any:
        def refuse(problem: str) -> BadRequest:
            return cls.REFUSAL(f"{cls._what(trainer)}: request field {key!r} {problem}, got {value!r:.200}", field=key, trainer=trainer)

        if spec.kind is TaskSpec:
            try:
                return TaskSpec.from_json(value)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise refuse(f"must be a task ({exc})") from exc
        if not _is(spec.kind, value):
            raise refuse(f"must be {_KIND_NAMES[spec.kind]}")
        if spec.item is not None:
            if any(not _is(spec.item, v) for v in value):
                raise refuse(f"must be a list of {_KIND_NAMES[spec.item]}s")
            value = tuple(value)
        elif spec.kind is float:
            value = float(value)
        problem = spec.check(value) if spec.check is not None else None
        if problem:
            raise refuse(problem)
        return value

    @classmethod
    def _what(cls, trainer: str | None) -> str:
        name = getattr(cls, "METHOD", cls.__name__)
        return f"{name} from trainer {trainer!r}" if trainer is not None else name

    def _validate(self) -> None:
        """Checks that span fields (a subclass's); raise :attr:`REFUSAL`."""

    def _refuse(self, field: str, message: str) -> BadRequest:
        trainer = getattr(self, "trainer", None)
        return self.REFUSAL(message, field=field, trainer=trainer)

    def _who(self) -> str:
        """The call and its sender, as refusals name them."""
        trainer = getattr(self, "trainer", None)
        return self._what(trainer if isinstance(trainer, str) else None)

    def _sections(self, field: str) -> tuple[tuple[str, int], ...]:
        """Field ``field`` (``[[table, n], ...]``) checked and made a tuple of pairs:
        each a non-empty table name and a row count ``n >= 0``, each table once."""
        value = getattr(self, field) or ()
        for pair in value:
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[0], str) and pair[0] and _is(int, pair[1]) and pair[1] >= 0):
                raise self._refuse(
                    field,
                    f"{self._who()}: field {field!r} must be [table, n] pairs (a table name, a whole number of rows >= 0), got {pair!r:.200} in {list(value)!r:.200}",
                )
        names = [pair[0] for pair in value]
        twice = next((n for n in names if names.count(n) > 1), None)
        if twice is not None:
            raise self._refuse(field, f"{self._who()}: field {field!r} names table {twice!r} more than once: send one section per table, each id once")
        pairs = tuple((str(name), int(n)) for name, n in value)
        object.__setattr__(self, field, pairs if getattr(self, field) is not None else None)
        return pairs

    def _check_rows(self, field: str, sections: Sequence[tuple[str, int]], tensors: Sequence[Any], what: Sequence[str]) -> None:
        """The tensors of ``sections`` (``len(what)`` per section, named by ``what``: an
        id tensor ``[n]``, rows ``[n, dim]``) each of leading dimension ``n``."""
        for i, (name, n) in enumerate(sections):
            for j, kind in enumerate(what):
                t = tensors[i * len(what) + j]
                if _leading(t) != n:
                    shape = tuple(t.shape) if hasattr(t, "shape") and hasattr(t, "dtype") else type(t).__name__
                    want = "[n] int64" if kind == "ids" else "[n, dim]"
                    raise self._refuse(
                        field,
                        f"{self._who()}: table {name!r} in field {field!r} has n={n} rows but its {kind} tensor has shape {shape}; "
                        f"{kind} travel as {want} tensors, n the section's row count",
                    )


_SPECS: dict[type, list] = {}


def _json(value: Any) -> Any:
    if isinstance(value, TaskSpec):
        return value.to_json()
    if isinstance(value, tuple):
        return [_json(v) for v in value]
    return value


@attrs.frozen
class Request(Wire):
    #: the transport method that serves this request
    METHOD: ClassVar[str]
    #: the class of its reply
    REPLY: ClassVar[type[Wire]]

    #: When the caller stops waiting (``time.monotonic()`` here): not on the wire, but
    #: the transport's deadline for the call (:attr:`Envelope.deadline`), for handlers that wait.
    deadline: float | None = attrs.field(default=None, kw_only=True, eq=False, repr=False, metadata={"local": True})
    #: the transport gave the tensors away (:attr:`Envelope.owned`): a handler may keep them as they are.
    owned: bool = attrs.field(default=False, kw_only=True, eq=False, repr=False, metadata={"local": True})


# --- pserver ---------------------------------------------------------------------------

_count = _at_least(0)


@attrs.frozen
class PserverReply(Wire):
    """What every pserver reply says of the pserver: its open sync ``round_no``, the
    ``updates`` it applied, its ``epoch`` and ``incarnation`` (new at each start), and
    ``map_version``, the slot map it serves (a sync pull of the round a resize switched
    at is served for the map it switched from, and says the new one: the trainer
    follows it before its next push rather than being refused)."""

    round_no: int = _field(int, key="round", check=_count)
    updates: int = _field(int, check=_count)
    epoch: int = _field(int, check=_count)
    incarnation: str = _field(str)
    map_version: int | None = _field(int, key="map", default=None, check=_at_least(1))


@attrs.frozen
class InitReply(PserverReply):
    pass


@attrs.frozen
class PushReply(PserverReply):
    """``update_s``: the pserver's own time on the push; ``duplicate``: its records had
    been applied already, so it was not applied again."""

    update_s: float | None = _field(float, default=None, check=_at_least(0))
    duplicate: bool = _field(bool, default=False)


@attrs.frozen
class PullReply(PserverReply):
    """The parameters (one tensor per block asked for, then the rows of each of
    ``tables``: ``[n, dim]`` per ``[table, n]`` pair, the ids' rows in the pull's order)
    or, from a sync pull whose round is still open after its ``slice``, ``waiting``:
    the trainers the round waits for (and no tensors). ``wait_s``: time at the barrier;
    ``checkpoint``: a checkpoint taken right after the round pulled.

    The reply to a ``dump`` pull: ``more`` is set (whether rows follow the page), and
    the tensors are the page's :attr:`ids` ``[k]`` and :attr:`values` ``[k, dim]``, or
    none (and ``more`` false) when the slot holds no row of the table."""

    wait_s: float | None = _field(float, default=None, check=_at_least(0))
    waiting: tuple[str, ...] | None = _field(list, default=None, item=str)
    checkpoint: str | None = _field(str, default=None)
    tables: tuple[tuple[str, int], ...] | None = _field(list, default=None)
    more: bool | None = _field(bool, default=None)
    tensors: tuple[Any, ...] = _tensors()

    def _validate(self) -> None:
        sections = self._sections("tables")
        if self.more is not None:
            if not self.tensors and not self.more and not sections:
                return  # the slot holds no row of the table
            if sections or len(self.tensors) != 2:
                raise self._refuse("more", f"pull reply: a dump's page ('more' set) holds ids and values, got {len(self.tensors)} tensors and tables {list(sections)!r:.200}")
            k, width = _leading(self.tensors[0]), _leading(self.tensors[1])
            if k is None or width != k:
                shapes = [tuple(t.shape) if hasattr(t, "shape") else type(t).__name__ for t in self.tensors]
                raise self._refuse("more", f"pull reply: a dump's page must be ids [k] and values [k, dim], got shapes {shapes}")
            return
        if len(self.tensors) < len(sections):
            raise self._refuse("tables", f"pull reply: field 'tables' names {len(sections)} tables but the reply carries {len(self.tensors)} tensors")
        self._check_rows("tables", sections, self.tensors[len(self.tensors) - len(sections) :], ("rows",))

    @property
    def dense_tensors(self) -> tuple[Any, ...]:
        """The values of the blocks asked for (the tensors before the rows)."""
        return self.tensors[: len(self.tensors) - len(self.tables or ())] if self.more is None else ()

    @property
    def table_rows(self) -> list[tuple[str, Any]]:
        """``(table, rows [n, dim])`` per section of ``tables``, in order."""
        rows = self.tensors[len(self.dense_tensors) :] if self.more is None else ()
        return [(name, t) for (name, _), t in zip(self.tables or (), rows)]

    @property
    def ids(self) -> Any:
        """A dump's page: the ids of its rows, ``[k]`` int64 (None: not a dump's reply)."""
        return self.tensors[0] if self.more is not None and self.tensors else None

    @property
    def values(self) -> Any:
        """A dump's page: the rows of :attr:`ids`, ``[k, dim]`` (None: not a dump's reply)."""
        return self.tensors[1] if self.more is not None and self.tensors else None


@attrs.frozen
class AppliedReply(PserverReply):
    """``ledger``: ``(task, attempt, start, end)`` rows, the records each attempt had
    applied on this pserver in its epoch. ``slots``: async, ``(slot, pushes applied to
    it)`` for each slot the pserver holds a copy of (a slot's count travels with it)."""

    ledger: tuple[tuple[int, int, int, int], ...] = _field(list, default=())
    slots: tuple[tuple[int, int], ...] = _field(list, default=())

    def _validate(self) -> None:
        if any(not isinstance(r, (list, tuple)) or len(r) != 4 or not all(_is(int, v) for v in r) for r in self.ledger):
            raise self._refuse("ledger", f"applied reply: field 'ledger' must be rows of [task, attempt, start, end], got {self.ledger!r:.200}")
        object.__setattr__(self, "ledger", tuple(tuple(r) for r in self.ledger))
        if any(not isinstance(r, (list, tuple)) or len(r) != 2 or not all(_is(int, v) for v in r) for r in self.slots):
            raise self._refuse("slots", f"applied reply: field 'slots' must be [slot, count] pairs, got {self.slots!r:.200}")
        object.__setattr__(self, "slots", tuple(tuple(r) for r in self.slots))


@attrs.frozen
class PserverRequest(Request):
    """Fields of every pserver request: the ``trainer`` that sends it, the ``epoch`` and
    the slot-map ``version`` it was computed for (None: the caller does not say; a
    trainer always does)."""

    trainer: str = _field(str, check=_nonempty)
    epoch: int | None = _field(int, default=None, check=_count)
    version: int | None = _field(int, default=None, check=_at_least(1))


def check_tensors(tensors: Sequence[Any], blocks: Sequence[Block], trainer: str | None, what: str = "gradient", *, held: int | None = None) -> None:
    """One tensor per block, each of the block's shape; GradientRejected names the
    parameter (its rows) and the trainer. ``held``: how many blocks the server holds."""
    if len(tensors) != len(blocks):
        holds = f" (this pserver holds {held})" if held is not None else ""
        raise GradientRejected(
            f"{what}s from trainer {trainer!r}: got {len(tensors)} tensors for {len(blocks)} blocks{holds}; the trainer's layout is out of date, re-fetch it",
            field="tensors", trainer=trainer,
        )
    for b, t in zip(blocks, tensors):
        shape = getattr(t, "shape", None)
        if shape is None or not hasattr(t, "dtype"):
            raise GradientRejected(f"{what} for {b.describe()} from trainer {trainer!r} is a {type(t).__name__}, not a tensor", field="tensors", trainer=trainer)
        if tuple(shape) != b.shape:
            raise GradientRejected(f"{what} for {b.describe()} from trainer {trainer!r} has shape {tuple(shape)} but the block is {b.shape}", field="tensors", trainer=trainer)


@attrs.frozen
class InitRequest(PserverRequest):
    """Initial values of every block the pserver holds, in its order (taken only by a
    pserver that has none)."""

    METHOD: ClassVar[str] = "init"
    REPLY: ClassVar[type[Wire]] = InitReply
    REFUSAL: ClassVar[type[BadRequest]] = GradientRejected

    tensors: tuple[Any, ...] = _tensors()

    def claim(self, held: Sequence[Block]) -> None:
        check_tensors(self.tensors, held, self.trainer, "initial value", held=len(held))


@attrs.frozen
class PushRequest(PserverRequest):
    """A gradient. Sync: for ``round_no``, from ``samples`` (> 0) samples; staged until
    the round closes. Async: computed on the pserver's ``updates`` (within the
    staleness bound), for ``records`` ``(pass, task, attempt, start, end)`` of a task
    (applied once), from a pserver ``incarnation``.

    ``blocks`` names the blocks the tensors are for, in the pserver's order: all of them,
    or with ``part`` (overlap: pushed while backward runs) some of them. Async, a step in
    parts is staged piece by piece: ``first`` opens it (dropping an unfinished one), and
    a ``final`` part (usually of no blocks) applies it.
    """

    METHOD: ClassVar[str] = "push"
    REPLY: ClassVar[type[Wire]] = PushReply
    REFUSAL: ClassVar[type[BadRequest]] = GradientRejected

    samples: int = _field(int, default=0)
    round_no: int | None = _field(int, key="round", default=None, check=_count)
    updates: int | None = _field(int, default=None, check=_count)
    records: tuple[int, int, int, int, int] | None = _field(list, default=None)
    incarnation: str | None = _field(str, default=None)
    blocks: tuple[str, ...] | None = _field(list, default=None, item=str)
    part: bool = _field(bool, default=False)
    first: bool = _field(bool, default=False)
    final: bool = _field(bool, default=False)
    tables: tuple[tuple[str, int], ...] | None = _field(list, default=None)
    tensors: tuple[Any, ...] = _tensors()

    #: the row sections after the dense tensors: (meta field, tensors of each section)
    _ROWS: ClassVar[tuple[tuple[str, tuple[str, ...]], ...]] = (("tables", ("ids", "grads")),)

    def _validate(self) -> None:
        self._check_sections()
        if self.samples < 0:
            raise self._refuse("samples", f"push from trainer {self.trainer!r} claims {self.samples} samples")
        r = self.records
        if r is not None:
            if len(r) != 5 or any(type(v) is not int or v < 0 for v in r) or r[3] > r[4]:
                raise self._refuse("records", f"push from trainer {self.trainer!r}: field 'records' must be [pass, task, attempt, start, end] (whole numbers, start <= end), got {list(r)!r:.200}")
            object.__setattr__(self, "records", tuple(r))
        if (self.first or self.final) and not self.part:
            name = "first" if self.first else "final"
            raise self._refuse(name, f"push from trainer {self.trainer!r}: field {name!r} is for a push of some slots ('part': true)")

    def _check_sections(self) -> None:
        """The row sections' pairs, then their tensors, in order after the dense ones
        (one per named block): each section's present and of leading dimension ``n``,
        none left over. A refusal names the field whose section the tensors do not fit."""
        parsed = [(field, self._sections(field), what) for field, what in self._ROWS]
        if all(getattr(self, field) is None for field, _, _ in parsed):
            return  # a push of blocks only: claim() checks its tensors against the pserver's blocks
        rows = sum(len(sections) * len(what) for _, sections, what in parsed)
        at = len(self.blocks) if self.blocks is not None else max(0, len(self.tensors) - rows)
        last = next((field for field, sections, _ in reversed(parsed) if sections), parsed[0][0])
        blocks = f"{len(self.blocks)} blocks" if self.blocks is not None else "its blocks"

        def miscount(field: str) -> BadRequest:
            counts = ", ".join(f"{len(sections)} in {f!r} ({len(what)} tensors each)" for f, sections, what in parsed)
            return self._refuse(
                field,
                f"{self._who()}: got {len(self.tensors)} tensors for {blocks} and row sections {counts}: "
                f"the tensors are one per block, then per section its ids and rows",
            )

        for field, sections, what in parsed:
            if at + len(sections) * len(what) > len(self.tensors):
                raise miscount(field)
            self._check_rows(field, sections, self.tensors[at:], what)
            at += len(sections) * len(what)
        if at != len(self.tensors):
            raise miscount(last)

    @property
    def dense_tensors(self) -> tuple[Any, ...]:
        """The tensors of ``blocks`` (those before the row sections')."""
        rows = sum(len(getattr(self, field) or ()) * len(what) for field, what in self._ROWS)
        return self.tensors[: max(0, len(self.tensors) - rows)]

    @property
    def row_sections(self) -> list[tuple[str, Any, Any]]:
        """``(table, ids [n], grads [n, dim])`` per section of ``tables``, in order."""
        start = len(self.dense_tensors)
        return [(name, self.tensors[start + 2 * i], self.tensors[start + 2 * i + 1]) for i, (name, _) in enumerate(self.tables or ())]

    def require(self, name: str) -> Any:
        """A field the pserver's mode needs (``round`` sync, ``updates`` async)."""
        key = "round" if name == "round_no" else name
        value = getattr(self, name)
        if value is None:
            raise self._refuse(key, f"push from trainer {self.trainer!r}: request names no {key!r}")
        return value

    def claim(self, held: Sequence[Block], pserver: int | None) -> list[int] | None:
        """Check ``blocks`` and the dense tensors against the blocks the pserver holds,
        in order: all of them (None is returned), or, for a ``part``, some of them, whose
        positions are returned. The row sections are not the blocks' business."""
        trainer, keys = self.trainer, self.blocks
        index = {b.key: i for i, b in enumerate(held)}
        if keys is not None and not self.part and len(keys) == len(held) and all(k == b.key for k, b in zip(keys, held)):
            check_tensors(self.dense_tensors, held, trainer, held=len(held))
            return None
        if keys is None:
            raise self._refuse("blocks", f"push from trainer {trainer!r} does not name its blocks")
        unknown = [k for k in keys if k not in index]
        if unknown:
            raise self._refuse(
                "blocks",
                f"trainer {trainer!r} pushed a gradient for parameter {unknown[0].split('@')[0]!r} "
                f"(block {unknown[0]!r}), which pserver {pserver} does not hold",
            )
        indices = [index[k] for k in keys]
        if self.part:
            if any(a >= b for a, b in zip(indices, indices[1:])):
                raise self._refuse("blocks", f"push of some slots from trainer {trainer!r} names pserver {pserver}'s blocks out of order or more than once")
            check_tensors(self.dense_tensors, [held[i] for i in indices], trainer, held=len(held))
            return indices
        missing = [b.describe() for b in held if b.key not in set(keys)]
        if missing:
            raise self._refuse("blocks", f"push from trainer {trainer!r} lacks gradients for {missing[:5]}")
        raise self._refuse(
            "blocks",
            f"push from trainer {trainer!r} names pserver {pserver}'s blocks out of order or more than once: "
            f"expected {[b.key for b in held[:5]]}..., got {list(keys[:5])}...",
        )


@attrs.frozen
class PullRequest(PserverRequest):
    """The values of ``blocks`` (default: all the pserver holds; ``()``: none, a pull of
    rows only) and the rows of ``tables``: per ``[table, n]`` pair an ids tensor ``[n]``
    (the reply's rows are in the same order). Sync, with ``after_round``: once that
    round is applied, waiting up to ``slice_s`` (then answering with whom it waits for)
    or until the call's :attr:`deadline`.

    ``dump``: ``(table, slot, offset, limit)``, a page of every row the pserver holds of
    ``table`` in ``slot``: at most ``limit`` rows from the ``offset``-th on (read-only,
    for fetching the rows after a job; the reply's ``more`` says whether rows follow).
    A dump pulls nothing else: it names no ``blocks`` and no ``tables``."""

    METHOD: ClassVar[str] = "pull"
    REPLY: ClassVar[type[Wire]] = PullReply

    after_round: int | None = _field(int, default=None, check=_count)
    slice_s: float | None = _field(float, key="slice", default=None, check=_finite_positive)
    blocks: tuple[str, ...] | None = _field(list, default=None, item=str, check=_names_once)
    tables: tuple[tuple[str, int], ...] | None = _field(list, default=None)
    dump: tuple[str, int, int, int] | None = _field(list, default=None)
    tensors: tuple[Any, ...] = _tensors()

    def _validate(self) -> None:
        sections = self._sections("tables")
        if self.dump is not None:
            d = self.dump
            if not (len(d) == 4 and isinstance(d[0], str) and d[0] and all(_is(int, v) for v in d[1:]) and d[1] >= 0 and d[2] >= 0 and d[3] >= 1):
                raise self._refuse("dump", f"{self._who()}: field 'dump' must be [table, slot, offset, limit] (slot and offset >= 0, limit >= 1), got {list(d)!r:.200}")
            if self.blocks is not None or self.tables is not None or self.tensors:
                raise self._refuse("dump", f"{self._who()}: a 'dump' pulls one table's rows and nothing else: send it without 'blocks', 'tables' or tensors")
            object.__setattr__(self, "dump", tuple(d))
            return
        if len(self.tensors) != len(sections):
            raise self._refuse("tables", f"{self._who()}: field 'tables' names {len(sections)} tables but the request carries {len(self.tensors)} tensors: one ids tensor per table")
        self._check_rows("tables", sections, self.tensors, ("ids",))

    @property
    def row_sections(self) -> list[tuple[str, Any, None]]:
        """``(table, ids [n], None)`` per section of ``tables``, in order (a pull carries no gradients)."""
        return [(name, t, None) for (name, _), t in zip(self.tables or (), self.tensors)]

    def claim(self, held: Sequence[Block], pserver: int | None) -> list[int] | None:
        """Positions of ``blocks`` among the pserver's (None: all)."""
        if self.blocks is None:
            return None
        index = {b.key: i for i, b in enumerate(held)}
        if any(k not in index for k in self.blocks):
            raise self._refuse("blocks", f"pull from {self.trainer!r}: field 'blocks' names blocks pserver {pserver} does not hold")
        return [index[k] for k in self.blocks]


@attrs.frozen
class AppliedRequest(PserverRequest):
    """What the pserver applied in its epoch, per task attempt (to check an audit)."""

    METHOD: ClassVar[str] = "applied"
    REPLY: ClassVar[type[Wire]] = AppliedReply


@attrs.frozen
class RuleReply(PserverReply):
    """The ``digest`` of the update rule checked (:func:`pdps.core.updategraph.digest`) and
    whether it is the rule this pserver ``runs`` (its job's ``optimizer="graph"`` rule)."""

    digest: str = _field(str, default="")
    runs: bool = _field(bool, default=False)


@attrs.frozen
class RuleRequest(PserverRequest):
    """An update rule as a graph (the JSON of :mod:`pdps.core.updategraph`), for the
    pserver to check as it checks its job's own: a converter confirms the pservers
    accept, and run, the rule it made. Checked on decode, so a malformed or hostile
    rule is refused (:class:`~pdps.core.errors.BadGraph`) before the pserver does
    anything with it; the call changes nothing on the pserver."""

    METHOD: ClassVar[str] = "rule"
    REPLY: ClassVar[type[Wire]] = RuleReply

    rule: dict = _field(dict, default=None)

    def _validate(self) -> None:
        from pdps.core.updategraph import check

        if self.rule is None:
            raise self._refuse("rule", f"{self._who()}: request names no 'rule'")
        try:
            check(self.rule)
        except BadGraph as exc:
            raise BadGraph(f"{self._who()}: {exc}", field="rule", trainer=self.trainer, node=exc.node, operator=exc.operator) from exc


@attrs.frozen
class MigrateReply(PserverReply):
    """The state of the slots asked for, as ``names`` (block entries:
    ``<param>@<first>:<end>/values|state.K|scalar.K``) and one tensor per name."""

    names: tuple[str, ...] = _field(list, default=(), item=str)
    #: a page of a slot's rows (the request's ``row_offset``): rows follow, ask again from
    #: ``row_offset`` + the rows this page holds
    more: bool = _field(bool, default=False)
    #: async: ``(slot, pushes applied to it)`` for each slot, which the receiver counts on from
    applied: tuple[tuple[int, int], ...] = _field(list, default=())
    #: async replicas: ``(backup, seq)``: the forwards the sender (a primary) had queued
    #: for each backup when it switched, which the state sent holds already (a receiver
    #: acknowledges those, if they reach it, without applying them again)
    forwarded: tuple[tuple[int, int], ...] = _field(list, default=())
    tensors: tuple[Any, ...] = _tensors()

    def _validate(self) -> None:
        for name in ("applied", "forwarded"):
            pairs = getattr(self, name)
            if any(not isinstance(r, (list, tuple)) or len(r) != 2 or not all(_is(int, v) for v in r) for r in pairs):
                raise self._refuse(name, f"migrate reply: field {name!r} must be pairs of whole numbers, got {pairs!r:.200}")
            object.__setattr__(self, name, tuple(tuple(r) for r in pairs))
        if len(self.names) != len(self.tensors):
            raise self._refuse("names", f"migrate reply: {len(self.names)} names for {len(self.tensors)} tensors")


@attrs.frozen
class ReplicateRequest(PushRequest):
    """A push's gradient for the blocks a pserver backs up, forwarded by their primary
    (``trainer`` is the trainer that pushed it; ``blocks`` names some of the backup's
    blocks, ``part`` is set; ``tables``, the row sections of the ids whose slots it backs
    up). The primary answers the trainer only once every backup has it.

    ``created``: per ``[table, n]`` pair, ids ``[n]`` and values ``[n, dim]`` (after the
    row sections' tensors): the rows the primary created for this push, so that a
    backup copies their initial values, never computes them.

    Sync: staged as the trainer's own push would be, so every replica applies each
    closed round whole. Async: applied at once, in the order the primary applied it:
    ``primary`` is the forwarding pserver, ``incarnation`` its incarnation and ``seq``
    the forward's place in what it sends this backup (a forward sent again after a
    lost reply is applied once). ``records`` are not sent: the primary decided the push
    was no duplicate, and a backup applies what its primary applied, no more.

    ``steps`` (async): per ``[table, step]`` pair, the primary's table step once it
    applied this push's section, the step its backup applies the section at (an async
    table step counts the pushes one pserver applied)."""

    METHOD: ClassVar[str] = "replicate"
    REPLY: ClassVar[type[Wire]] = PushReply

    primary: int | None = _field(int, default=None, check=_count)
    seq: int | None = _field(int, default=None, check=_count)
    created: tuple[tuple[str, int], ...] | None = _field(list, default=None)
    steps: tuple[tuple[str, int], ...] | None = _field(list, default=None)

    def _validate(self) -> None:
        super()._validate()
        value = self.steps
        if value is None:
            return
        if not all(isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) and p[0] and _is(int, p[1]) and p[1] >= 1 for p in value):
            raise self._refuse("steps", f"{self._who()}: field 'steps' must be [table, step] pairs (a table name, a whole table step >= 1), got {list(value)!r:.200}")
        object.__setattr__(self, "steps", tuple((str(name), int(step)) for name, step in value))

    _ROWS: ClassVar[tuple[tuple[str, tuple[str, ...]], ...]] = (("tables", ("ids", "grads")), ("created", ("ids", "values")))

    @property
    def created_rows(self) -> list[tuple[str, Any, Any]]:
        """``(table, ids [n], values [n, dim])`` per section of ``created``, in order."""
        start = len(self.dense_tensors) + 2 * len(self.tables or ())
        return [(name, self.tensors[start + 2 * i], self.tensors[start + 2 * i + 1]) for i, (name, _) in enumerate(self.created or ())]


@attrs.frozen
class MigrateRequest(PserverRequest):
    """From a pserver that receives ``slots`` in slot map ``version`` (required): the
    state those slots had when the sender switched to that map. ``trainer`` names the
    asking pserver.

    ``row_offset``: the rows of one slot's tables, paged: the entries of its rows from
    the ``row_offset``-th row on, as many as fit one reply (whose ``more`` says whether
    rows follow). Without it, the slots' blocks."""

    METHOD: ClassVar[str] = "migrate"
    REPLY: ClassVar[type[Wire]] = MigrateReply

    slots: tuple[int, ...] = _field(list, default=(), item=int)
    row_offset: int | None = _field(int, default=None, check=_count)

    def _validate(self) -> None:
        if self.version is None:
            raise self._refuse("version", f"migrate from {self.trainer!r} names no slot map version")
        if any(s < 0 for s in self.slots) or len(set(self.slots)) != len(self.slots):
            raise self._refuse("slots", f"migrate from {self.trainer!r}: field 'slots' must name distinct slots >= 0")
        if self.row_offset is not None and len(self.slots) != 1:
            raise self._refuse("row_offset", f"migrate from {self.trainer!r}: field 'row_offset' pages the rows of one slot, but 'slots' names {len(self.slots)}")


# --- master ----------------------------------------------------------------------------


@attrs.frozen
class GetTaskReply(Wire):
    """One of: ``done`` (the job is over); a ``task`` with its ``attempt``, ``pass_no``
    and the record ``offset`` to resume at; or ``wait`` (why) and ask again in
    ``retry_in`` seconds. ``epoch``: the master's (a newer one means a rollback)."""

    done: bool = _field(bool, default=False)
    task: TaskSpec | None = _field(TaskSpec, default=None)
    attempt: int | None = _field(int, default=None, check=_count)
    pass_no: int | None = _field(int, key="pass", default=None, check=_count)
    offset: int | None = _field(int, default=None, check=_count)
    epoch: int | None = _field(int, default=None, check=_count)
    wait: str | None = _field(str, default=None)
    retry_in: float | None = _field(float, default=None, check=_at_least(0))


@attrs.frozen
class ReportReply(Wire):
    """Whether the master took the report; ``reason`` when it did not (the attempt is
    no longer the task's current one, ...)."""

    accepted: bool = _field(bool)
    reason: str | None = _field(str, default=None)


@attrs.frozen
class CheckpointReply(Wire):
    accepted: bool = _field(bool)
    epoch: int = _field(int, check=_count)


@attrs.frozen
class MasterRequest(Request):
    trainer: str = _field(str, check=_nonempty)


@attrs.frozen
class GetTaskRequest(MasterRequest):
    """Work, please. ``holding``: the task ids the trainer knows it holds (a task it
    holds but does not name was handed out by a lost reply: it comes again); ``epoch``:
    the trainer's."""

    METHOD: ClassVar[str] = "get_task"
    REPLY: ClassVar[type[Wire]] = GetTaskReply

    epoch: int | None = _field(int, default=None, check=_count)
    holding: tuple[int, ...] | None = _field(list, default=None, item=int)

    def _validate(self) -> None:
        if self.holding is not None and any(t < 0 for t in self.holding):
            raise self._refuse("holding", f"get_task from trainer {self.trainer!r}: request field 'holding' must list task ids >= 0, got {list(self.holding)!r:.200}")


@attrs.frozen
class TaskReport(MasterRequest):
    """A report on ``attempt`` of ``task``."""

    task: int = _field(int, check=_count)
    attempt: int = _field(int, check=_count)


@attrs.frozen
class FinishTaskRequest(TaskReport):
    METHOD: ClassVar[str] = "finish_task"
    REPLY: ClassVar[type[Wire]] = ReportReply


@attrs.frozen
class FailTaskRequest(TaskReport):
    """The attempt failed with ``error`` (it counts toward the task's failures)."""

    METHOD: ClassVar[str] = "fail_task"
    REPLY: ClassVar[type[Wire]] = ReportReply

    error: str | None = _field(str, default=None)


@attrs.frozen
class GiveBackRequest(TaskReport):
    """The trainer stops the attempt without failing it (it is leaving)."""

    METHOD: ClassVar[str] = "give_back"
    REPLY: ClassVar[type[Wire]] = ReportReply


@attrs.frozen
class CheckpointRequest(MasterRequest):
    """Sync: the ``checkpoint`` taken right after the round the trainer pulled."""

    METHOD: ClassVar[str] = "checkpoint"
    REPLY: ClassVar[type[Wire]] = CheckpointReply

    checkpoint: str = _field(str, check=_nonempty)
    epoch: int | None = _field(int, default=None, check=_count)


#: Every request class by role, in the order a role serves them.
PSERVER_REQUESTS: tuple[type[Request], ...] = (InitRequest, PushRequest, PullRequest, AppliedRequest, MigrateRequest, ReplicateRequest, RuleRequest)
MASTER_REQUESTS: tuple[type[Request], ...] = (GetTaskRequest, FinishTaskRequest, FailTaskRequest, GiveBackRequest, CheckpointRequest)
