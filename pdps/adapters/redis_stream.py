"""``redis-stream://`` streaming source: the records of one Redis stream (redis-py).

URL: ``redis-stream://[[user]:password@]host[:port]/DB/STREAM[?schema=...][&timeout=S]``.
One stream entry is one record; each field of an entry is one column, holding the
raw little-endian bytes of that column's value. The schema (dtype and per-record
shape of each column) is stored by the producer helper (:func:`pdps.streams.append`)
as JSON in the key ``STREAM:pdps-schema``; ``schema=x:float32[64],y:int64`` in the
URL gives it instead (and must agree with the stored one, if any). ``timeout`` bounds
each socket connect and read (default 5 s), as for the ``redis://`` store.

Cursors are entry ids (the start cursor is ``0-0``); a cut is the range
``redis-stream://host:port/DB/STREAM#<first-id>..<last-id>``. Polls read only ids
(one Lua script: ``XRANGE (cursor`` plus ``XINFO STREAM``'s ``entries-added``, at
one instant), so they need Redis >= 7 for the backlog (>= 6.2 for the rest). Every
Redis failure, an unreachable server included, is a :class:`DatasetError` naming the
stream. Cutting, reading and appending are :mod:`pdps.adapters.entry_stream`'s.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import parse_qs, quote, unquote, urlsplit

from pdps.adapters.entry_stream import Entry, EntryStreamSource, parse_schema
from pdps.adapters.redis_store import RedisTarget, connection_kwargs, parse_redis_url
from pdps.core.errors import ConfigError, DatasetError, MissingExtraError

try:
    import redis
except ImportError as exc:  # pragma: no cover - exercised by the registry's extra check
    raise MissingExtraError(f"redis-stream:// data sources need redis-py ({exc.name}): pip install 'pdps[redis]'") from exc

SCHEMA_SUFFIX = ":pdps-schema"
_ADD_CHUNK = 1000  # XADDs per pipelined round trip

# KEYS[1] stream; ARGV cursor, count. Returns {ids after the cursor, entries-added
# (-1 before Redis 7)}: ids only, so a poll moves no record data.
_IDS_AFTER = r"""
if redis.call('EXISTS', KEYS[1]) == 0 then return {{}, 0} end
local ids = {}
for i, e in ipairs(redis.call('XRANGE', KEYS[1], '(' .. ARGV[1], '+', 'COUNT', ARGV[2])) do ids[i] = e[1] end
local info = redis.call('XINFO', 'STREAM', KEYS[1])
local added = -1
for i = 1, #info, 2 do
  if info[i] == 'entries-added' then added = info[i + 1] end
end
return {ids, added}
"""

# KEYS[1] stream; ARGV first, last. The number of entries in [first, last], counted a
# page at a time so that the script never holds a big range.
_COUNT = r"""
local n, from = 0, ARGV[1]
while true do
  local page = redis.call('XRANGE', KEYS[1], from, ARGV[2], 'COUNT', 1000)
  n = n + #page
  if #page < 1000 then return n end
  from = '(' .. page[#page][1]
end
"""


def _parse(url: str) -> tuple[RedisTarget, str, str, str | None]:
    """(connection target, stream name, base URL for locations, schema text) of a URL."""
    parts = urlsplit(url)
    if parts.scheme.lower() != "redis-stream":
        raise ConfigError(f"not a Redis stream URL (redis-stream://host:port/DB/STREAM): {url!r}")
    db, _, stream = parts.path.lstrip("/").partition("/")
    if not stream:
        raise ConfigError(f"Redis stream URL {url!r} names no stream; write redis-stream://host:port/DB/STREAM")
    query = parse_qs(parts.query, keep_blank_values=True)
    unknown = set(query) - {"schema", "timeout"}
    if unknown:
        raise ConfigError(f"unknown option(s) {sorted(unknown)} in a redis-stream:// URL; known: ['schema', 'timeout']")
    schema = query.pop("schema", [None])[-1]
    rest = "&".join(f"{k}={quote(v[-1])}" for k, v in query.items())
    target = parse_redis_url(f"redis://{parts.netloc}/{db}" + (f"?{rest}" if rest else ""))
    masked = urlsplit(target.url)
    base = f"redis-stream://{masked.netloc}/{target.db}/{stream}"
    return target, unquote(stream), base, schema


class _RedisLog:
    start = "0-0"

    def __init__(self, target: RedisTarget, stream: str, url: str) -> None:
        self._url = url
        self._stream = stream
        self._schema_key = stream + SCHEMA_SUFFIX
        self._redis = redis.Redis(connection_pool=redis.ConnectionPool(**connection_kwargs(target)))
        self._ids_after = self._redis.register_script(_IDS_AFTER)
        self._count = self._redis.register_script(_COUNT)

    def ids_after(self, cursor: str, count: int) -> tuple[list[str], int | None]:
        with self._calls("poll"):
            ids, added = self._ids_after(keys=[self._stream], args=[cursor, count])
        return [i.decode() for i in ids], (None if added < 0 else int(added))

    def entries(self, first: str, last: str, *, after: str | None, count: int) -> list[Entry]:
        with self._calls("read"):
            page = self._redis.xrange(self._stream, first if after is None else "(" + after, last, count=count)
        return [(entry_id.decode(), fields) for entry_id, fields in page]

    def count(self, first: str, last: str) -> int:
        with self._calls("count"):
            return int(self._count(keys=[self._stream], args=[first, last]))

    def schema_text(self) -> str | None:
        with self._calls("read the schema"):
            text = self._redis.get(self._schema_key)
        return None if text is None else text.decode()

    def put_schema_text(self, text: str) -> str:
        with self._calls("store the schema"):
            self._redis.set(self._schema_key, text, nx=True)
            return self._redis.get(self._schema_key).decode()

    def add(self, rows: list[dict[str, bytes]]) -> list[str]:
        out: list[str] = []
        with self._calls("append"):
            for lo in range(0, len(rows), _ADD_CHUNK):
                pipe = self._redis.pipeline(transaction=False)
                for row in rows[lo : lo + _ADD_CHUNK]:
                    pipe.xadd(self._stream, row)
                out += [i.decode() for i in pipe.execute()]
        return out

    def close(self) -> None:
        self._redis.close()
        self._redis.connection_pool.disconnect()

    @contextmanager
    def _calls(self, what: str) -> Iterator[None]:
        try:
            yield
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise DatasetError(f"redis stream {self._url} is unreachable ({what}): {exc}") from exc
        except redis.RedisError as exc:
            raise DatasetError(f"redis stream {self._url}: {what} failed: {exc}") from exc


class RedisStreamSource(EntryStreamSource):
    """The stream at ``redis-stream://host:port/DB/STREAM`` as a streaming data source."""

    def __init__(self, url: str) -> None:
        target, stream, base, schema = _parse(url)
        shown = base + (f"?schema={schema}" if schema is not None else "")
        super().__init__(
            url=shown,
            base=base,
            log=_RedisLog(target, stream, base),
            url_schema=None if schema is None else parse_schema(schema, where=shown),
        )
