"""``memory-stream://NAME``: an in-process stream of records, the fake of ``redis-stream://``.

Streams are process-global, by name, and live until the process ends; entry ids are
``"1"``, ``"2"``, ... (the start cursor is ``"0"``). Cutting, reading, schemas and
appends are :mod:`pdps.adapters.entry_stream`'s, the same code the Redis adapter runs,
so unit tests of the master see what a job on Redis sees. :func:`delete` removes
entries, as ``XDEL`` or trimming would.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable

import attrs

from pdps.adapters.entry_stream import Entry, EntryStreamSource, parse_schema
from pdps.core.errors import ConfigError

_lock = threading.Lock()


@attrs.define(eq=False)
class _MemoryLog:
    start = "0"
    _ids: list[int] = attrs.Factory(list)  # increasing
    _rows: dict[int, dict[bytes, bytes]] = attrs.Factory(dict)
    _added: int = 0
    _schema: str | None = None

    def ids_after(self, cursor: str, count: int) -> tuple[list[str], int | None]:
        with _lock:
            i = bisect.bisect_right(self._ids, _id(cursor))
            return [str(n) for n in self._ids[i : i + count]], self._added

    def entries(self, first: str, last: str, *, after: str | None, count: int) -> list[Entry]:
        with _lock:
            lo = bisect.bisect_left(self._ids, _id(first)) if after is None else bisect.bisect_right(self._ids, _id(after))
            hi = bisect.bisect_right(self._ids, _id(last))
            return [(str(n), self._rows[n]) for n in self._ids[lo : min(hi, lo + count)]]

    def count(self, first: str, last: str) -> int:
        with _lock:
            return max(0, bisect.bisect_right(self._ids, _id(last)) - bisect.bisect_left(self._ids, _id(first)))

    def schema_text(self) -> str | None:
        return self._schema

    def put_schema_text(self, text: str) -> str:
        with _lock:
            if self._schema is None:
                self._schema = text
            return self._schema

    def add(self, rows: list[dict[str, bytes]]) -> list[str]:
        with _lock:
            out = []
            for row in rows:
                self._added += 1
                self._ids.append(self._added)
                self._rows[self._added] = {k.encode(): v for k, v in row.items()}
                out.append(str(self._added))
            return out

    def close(self) -> None:
        pass  # the stream outlives its sources: other sources of the same name share it

    def delete(self, ids: Iterable[str]) -> int:
        with _lock:
            gone = {_id(i) for i in ids} & self._rows.keys()
            for n in gone:
                del self._rows[n]
            self._ids = [n for n in self._ids if n not in gone]
            return len(gone)


_streams: dict[str, _MemoryLog] = {}


def _id(text: str) -> int:
    if not (isinstance(text, str) and text.isascii() and text.isdigit()):
        raise ConfigError(f"{text!r} is not an entry id or cursor of a memory stream (a decimal number)")
    return int(text)


def _parse(url: str) -> tuple[str, str, str | None]:
    """(name, base, schema text) of ``memory-stream://NAME[?schema=...]``."""
    scheme, sep, rest = url.partition("://")
    name, _, query = rest.partition("?")
    if scheme != "memory-stream" or not sep or not name or "#" in name:
        raise ConfigError(f"not a memory stream URL (memory-stream://NAME): {url!r}")
    schema = None
    for item in filter(None, query.split("&")):
        key, _, value = item.partition("=")
        if key != "schema":
            raise ConfigError(f"unknown option {key!r} in {url!r}; known: ['schema']")
        schema = value
    return name, f"memory-stream://{name}", schema


class MemoryStreamSource(EntryStreamSource):
    """The stream named by ``memory-stream://NAME[?schema=...]``, made on first use."""

    def __init__(self, url: str) -> None:
        name, base, schema = _parse(url)
        with _lock:
            log = _streams.setdefault(name, _MemoryLog())
        super().__init__(url=url, base=base, log=log, url_schema=None if schema is None else parse_schema(schema, where=url))


def delete(url: str, ids: Iterable[str]) -> int:
    """Delete entries by id from the stream at ``url`` (like ``XDEL``); return how many were there."""
    name, _, _ = _parse(url)
    with _lock:
        log = _streams.setdefault(name, _MemoryLog())
    return log.delete(ids)
