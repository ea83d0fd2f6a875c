"""Streaming sources over an append-only log of entries with ordered ids (a Redis
stream, or its in-memory fake): what they share, so that the fake runs the same code.

What this module owns:

* the **schema** of a stream: each entry is one record, each field of an entry one
  column holding the raw little-endian bytes of that column's value; the schema
  names every column's dtype and per-record shape (``x:float32[64],y:int64`` in a
  URL, ``{"x": ["float32", [64]], "y": ["int64", []]}`` as JSON next to the stream);
* **cutting** (:meth:`EntryStreamSource.poll`): runs of ``task_records`` entries after
  the cursor, each a :class:`~pdps.ports.data.Cut` located ``<base>#<first-id>..<last-id>``;
* **reading** a cut back (:meth:`EntryStreamSource.read`) as numpy columns, a batch
  at a time, after checking that the range still holds exactly the cut's records;
* **appending** numpy columns (:meth:`EntryStreamSource.append`), refusing columns
  that disagree with the stream's schema.

A log (:class:`EntryLog`) only stores and ranges entries; it never decodes them.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping
from typing import Protocol

import attrs
import numpy as np

from pdps.core.errors import ConfigError, DatasetError
from pdps.core.tasks import TaskSpec
from pdps.ports.data import Arrivals, Columns, Cut

#: Entries fetched per round trip when a task is read (a batch may span several pages).
PAGE = 512

Entry = tuple[str, Mapping[bytes, bytes]]  # (id, field -> raw bytes)

_DTYPES = frozenset(
    ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32", "float64"]
)


class EntryLog(Protocol):
    """The few operations of an append-only log of entries with ordered ids."""

    start: str  # the cursor before the first entry ever added

    def ids_after(self, cursor: str, count: int) -> tuple[list[str], int | None]:
        """At most ``count`` ids after ``cursor`` in order, and the number of entries
        ever added to the log (None: the log cannot say), both read at one instant."""
        ...

    def entries(self, first: str, last: str, *, after: str | None, count: int) -> list[Entry]:
        """At most ``count`` entries with ids in ``[first, last]``, after ``after`` if given."""
        ...

    def count(self, first: str, last: str) -> int:
        """The number of entries with ids in ``[first, last]``."""
        ...

    def schema_text(self) -> str | None:
        """The JSON schema stored next to the log, None if there is none."""
        ...

    def put_schema_text(self, text: str) -> str:
        """Store ``text`` as the schema unless one is stored already; return the stored one."""
        ...

    def add(self, rows: list[dict[str, bytes]]) -> list[str]:
        """Append the rows in order, return their ids."""
        ...

    def close(self) -> None:
        """Release connections; the log is not used after."""
        ...


@attrs.frozen
class Column:
    dtype: np.dtype  # little-endian, as stored
    shape: tuple[int, ...]  # of one record's value

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.shape)

    def to_json(self) -> list:
        return [self.dtype.name, list(self.shape)]


Schema = dict[str, Column]

_SCHEMA_ITEM = re.compile(r"\s*([A-Za-z_][\w.-]*)\s*:\s*([a-z0-9]+)\s*(?:\[([\d,\s]*)\])?\s*(?:,|$)")


def _column(dtype: str, shape: object, where: str) -> Column:
    if dtype not in _DTYPES:
        raise ConfigError(f"{where}: dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    if not (isinstance(shape, (list, tuple)) and all(isinstance(d, int) and d >= 1 for d in shape)):
        raise ConfigError(f"{where}: shape {shape!r} must be a list of sizes >= 1 ([] for a scalar)")
    return Column(np.dtype(dtype).newbyteorder("<"), tuple(shape))


def parse_schema(text: str, *, where: str) -> Schema:
    """``x:float32[64],y:int64`` (a scalar needs no brackets; ``[4,4]`` is 2-D) as a schema."""
    schema: Schema = {}
    pos = 0
    while pos < len(text):
        m = _SCHEMA_ITEM.match(text, pos)
        if m is None or m.end() == pos:
            raise ConfigError(f"{where}: cannot read schema {text!r} at {text[pos:]!r}; write it as x:float32[64],y:int64")
        name, dtype, dims = m.groups()
        if name in schema:
            raise ConfigError(f"{where}: column {name!r} appears twice in schema {text!r}")
        shape = [int(d) for d in dims.split(",") if d.strip()] if dims else []
        schema[name] = _column(dtype, shape, where)
        pos = m.end()
    if not schema:
        raise ConfigError(f"{where}: empty schema; write it as x:float32[64],y:int64")
    return schema


def schema_from_json(text: str, *, where: str) -> Schema:
    try:
        raw = json.loads(text)
        if not isinstance(raw, dict) or not raw:
            raise ValueError("not a non-empty object")
        return {str(name): _column(spec[0], spec[1], where) for name, spec in raw.items()}
    except (ValueError, TypeError, IndexError, KeyError, ConfigError) as exc:
        raise DatasetError(f"{where} holds a schema pdps cannot read ({exc}): {text[:200]!r}") from exc


def schema_to_json(schema: Schema) -> str:
    return json.dumps({name: col.to_json() for name, col in sorted(schema.items())}, separators=(",", ":"))


def describe(schema: Schema) -> str:
    """The URL spelling of a schema, for messages."""
    return ",".join(f"{n}:{c.dtype.name}" + (f"[{','.join(map(str, c.shape))}]" if c.shape else "") for n, c in schema.items())


def schema_of(columns: Mapping[str, np.ndarray]) -> tuple[Schema, int]:
    """The schema numpy columns would have as a stream, and their number of rows;
    ConfigError for what a stream cannot hold."""
    if not columns:
        raise ConfigError("append needs at least one column")
    schema: Schema = {}
    rows = set()
    for name, arr in columns.items():
        arr = np.asarray(arr)
        if not isinstance(name, str) or not name:
            raise ConfigError(f"column names must be non-empty strings, got {name!r}")
        if arr.ndim < 1:
            raise ConfigError(f"column {name!r} is a scalar; give one value per record (an array of rows)")
        schema[name] = _column(arr.dtype.name, list(arr.shape[1:]), f"column {name!r}")
        rows.add(len(arr))
    if len(rows) != 1:
        raise ConfigError(f"columns have different lengths {({n: len(np.asarray(a)) for n, a in columns.items()})}; every column needs one value per record")
    (n,) = rows
    if n < 1:
        raise ConfigError("append needs at least one record")
    return schema, n


def encode(columns: Mapping[str, np.ndarray], rows: int) -> list[dict[str, bytes]]:
    """One ``{column: raw little-endian bytes}`` per record."""
    raws = {}
    for name, arr in columns.items():
        arr = np.asarray(arr)
        raws[name] = (memoryview(np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()), arr[0].nbytes)
    return [{name: bytes(raw[i * size : (i + 1) * size]) for name, (raw, size) in raws.items()} for i in range(rows)]


def decode(entries: list[Entry], schema: Schema, where: str) -> Columns:
    """Entries as numpy columns (writable, native byte order); DatasetError naming the
    entry whose fields do not match the schema."""
    want = {name.encode(): col for name, col in schema.items()}
    for entry_id, fields in entries:
        if fields.keys() != want.keys() or any(len(fields[k]) != c.nbytes for k, c in want.items()):
            got = {k.decode(errors="replace"): len(v) for k, v in fields.items()}
            need = {n: c.nbytes for n, c in schema.items()}
            raise DatasetError(
                f"entry {entry_id} of {where} has fields (bytes) {got}, the schema {describe(schema)} needs {need}; "
                "append with pdps.streams.append, or fix the URL's schema="
            )
    out: Columns = {}
    for name, col in schema.items():
        key = name.encode()
        buf = bytearray().join(fields[key] for _, fields in entries)  # writable: trainers normalise in place
        arr = np.frombuffer(buf, dtype=col.dtype).reshape(len(entries), *col.shape)
        out[name] = arr.astype(col.dtype.newbyteorder("="), copy=False)
    return out


@attrs.define(eq=False)
class EntryStreamSource:
    """A :class:`~pdps.ports.data.StreamingSource` over an :class:`EntryLog`.

    ``url`` names the source in messages (password masked), ``base`` prefixes the
    locations of its cuts (the URL without its query), ``url_schema`` is the URL's
    ``schema=`` (None: the one stored next to the log).
    """

    url: str
    base: str
    _log: EntryLog = attrs.field(repr=False)
    _url_schema: Schema | None = attrs.field(default=None, repr=False)
    _schema: Schema | None = attrs.field(default=None, init=False, repr=False)
    # (cursor, entries added up to and including it): how backlog stays O(1), see poll
    _anchor: tuple[str, int] | None = attrs.field(default=None, init=False, repr=False)

    def start_cursor(self) -> str:
        return self._log.start

    def tasks(self) -> list[TaskSpec]:
        """Refused: a stream has no fixed list of tasks; the master cuts them with :meth:`poll`."""
        raise DatasetError(
            f"{self.url} is a stream: it has no fixed list of tasks; run the job in stream mode, "
            "which cuts tasks from the stream as records arrive (docs/online.md)"
        )

    def poll(self, cursor: str, *, task_records: int, max_tasks: int, flush: bool) -> Arrivals:
        """Runs of ``task_records`` entries after ``cursor`` (the last one shorter only
        with ``flush``), at most ``max_tasks`` of them; the cursor is the last id cut.

        ``backlog`` counts the entries after the returned cursor in O(1): exactly when
        this poll reached the stream's end; otherwise as the entries ever added minus
        the position of the cursor, which this source knows once it has polled from
        the start cursor or reached the end once (None before that). It assumes nothing
        after the cursor was deleted (trim only behind it).
        """
        if task_records < 1 or max_tasks < 1:
            raise ConfigError(f"poll needs task_records >= 1 and max_tasks >= 1, got {task_records} and {max_tasks}")
        want = task_records * max_tasks
        ids, added = self._log.ids_after(cursor, want)
        runs = [ids[i : i + task_records] for i in range(0, len(ids), task_records)]
        if runs and len(runs[-1]) < task_records and not flush:
            runs.pop()
        cut = sum(len(r) for r in runs)
        new_cursor = runs[-1][-1] if runs else cursor
        rest = len(ids) - cut
        position: int | None = None  # entries ever added up to new_cursor
        if added is not None:
            if len(ids) < want:  # the whole stream after the cursor is in hand
                position = added - rest
            elif (known := self._position(cursor)) is not None:
                position = known + cut
        self._anchor = None if position is None else (new_cursor, position)
        backlog = rest if len(ids) < want else (None if position is None else max(added - position, rest))
        cuts = tuple(Cut(location=f"{self.base}#{r[0]}..{r[-1]}", part=0, records=len(r)) for r in runs)
        return Arrivals(cuts=cuts, cursor=new_cursor, backlog=backlog)

    def read(self, task: TaskSpec, *, start: int = 0, batch_size: int) -> Iterator[Columns]:
        """The cut's entries ``[start, task.records)`` in batches of ``batch_size``.

        Before the first batch, the range is counted on the server: a count other than
        ``task.records`` (entries deleted or trimmed since the cut) is a DatasetError.
        """
        if batch_size < 1:
            raise ConfigError(f"batch_size={batch_size} must be at least 1")
        first, last = self._range_of(task)
        where = f"task {task.id} ({task.location})"
        found = self._log.count(first, last)
        if found != task.records:
            raise DatasetError(
                f"{where} holds {found} entries, its task says {task.records}: entries were deleted or "
                "trimmed after the task was cut; trim a stream only behind the job's cursor"
            )
        schema = self.schema(where=where)
        return self._batches(first, last, start, batch_size, task, schema, where)

    def _batches(self, first: str, last: str, start: int, batch_size: int, task: TaskSpec, schema: Schema, where: str) -> Iterator[Columns]:
        held: list[Entry] = []
        skip, seen, after = start, 0, None
        while seen < task.records:
            page = self._log.entries(first, last, after=after, count=max(PAGE, batch_size))
            if not page:
                break
            after = page[-1][0]
            seen += len(page)
            if skip >= len(page):
                skip -= len(page)
                continue
            held += page[skip:]
            skip = 0
            while len(held) >= batch_size:
                yield decode(held[:batch_size], schema, where)
                held = held[batch_size:]
        if seen != task.records:
            raise DatasetError(f"{where} ended after {seen} entries, its task says {task.records}: entries were deleted while it was read")
        if held:
            yield decode(held, schema, where)

    def append(self, columns: Mapping[str, np.ndarray]) -> list[str]:
        """Append one entry per row of ``columns``; return the entries' ids.

        The first append stores the schema next to the stream; later ones must match
        it (and the URL's ``schema=``), or ConfigError is raised before anything is written.
        """
        schema, rows = schema_of(columns)
        if self._url_schema is not None and schema != self._url_schema:
            raise ConfigError(f"columns {describe(schema)} disagree with schema={describe(self._url_schema)} of {self.url}")
        text = schema_to_json(schema)
        stored = self._log.schema_text() or self._log.put_schema_text(text)
        if stored != text:
            have = schema_from_json(stored, where=f"the schema of {self.url}")
            if have != schema:
                raise ConfigError(
                    f"columns {describe(schema)} disagree with the schema of {self.url}, {describe(have)}; "
                    "cast them (arr.astype(...)) or write to another stream"
                )
        return self._log.add(encode(columns, rows))

    def close(self) -> None:
        self._log.close()

    def schema(self, *, where: str | None = None) -> Schema:
        """The stream's schema: the URL's ``schema=``, else the one stored next to the
        stream; DatasetError when there is none or the two disagree."""
        if self._schema is None:
            text = self._log.schema_text()
            stored = None if text is None else schema_from_json(text, where=f"the schema of {self.url}")
            if self._url_schema is not None and stored is not None and stored != self._url_schema:
                raise DatasetError(
                    f"schema={describe(self._url_schema)} in {self.url} disagrees with the schema stored next to "
                    f"the stream, {describe(stored)}; fix the URL or drop its schema="
                )
            found = self._url_schema or stored
            if found is None:
                raise DatasetError(
                    f"{where or self.url}: stream {self.url} has no schema; append with pdps.streams.append "
                    "(it stores one) or give it in the URL: ?schema=x:float32[64],y:int64"
                )
            self._schema = found
        return self._schema

    def _position(self, cursor: str) -> int | None:
        if cursor == self._log.start:
            return 0
        if self._anchor is not None and self._anchor[0] == cursor:
            return self._anchor[1]
        return None

    def _range_of(self, task: TaskSpec) -> tuple[str, str]:
        base, sep, span = task.location.rpartition("#")
        first, dots, last = span.partition("..")
        if not sep or base != self.base or not dots or not first or not last:
            raise DatasetError(f"task {task.id}'s location {task.location!r} is not a range of {self.base} (<stream>#<first-id>..<last-id>)")
        return first, last
