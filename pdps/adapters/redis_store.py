"""``redis://`` and ``rediss://`` coordination store on a single Redis node (redis-py).

URL: ``redis://[[user]:password@]host[:port][/db][?timeout=SECONDS]``, and
``rediss://...?ca=PATH&cert=PATH&key=PATH`` for TLS (``ca`` verifies the server,
``cert``/``key`` authenticate the client). ``timeout`` (default 5 s) bounds every
socket connect and read, so an unreachable server fails fast with
:class:`~pdps.core.errors.StoreUnavailable` instead of hanging; the adapter never
retries (redis-py's own retries are switched off: a write is not idempotent), the
roles above it do. ``store.url`` is the URL with the password masked.

How the port maps onto Redis (every name lives under the ``pdps:`` prefix):

* each pdps key is a hash ``pdps:kv:<key>`` (``value``, ``mod_revision``, ``lease``),
  ``pdps:revision`` is the store-wide revision and the sorted set ``pdps:index``
  (all scores 0, so ordered bytewise) lists keys for ``range``. Expired hashes leave
  stale index entries; reads skip them and remove them.
* every mutation (put, delete, transaction, lease keep-alive and revoke) is ONE Lua
  script: compares, lease checks, the revision bump and the writes happen with no
  other command in between. ``get`` is one HMGET.
* a lease is the key ``pdps:lease:<id>`` (its TTL in ms, ``PEXPIRE``d) plus the set
  ``pdps:lease-keys:<id>`` of keys written with it. Leased hashes get the same expiry
  instant, so Redis deletes them itself when the lease runs out; ``keep_alive``
  pushes all of them forward in one script.
* watches: each write script ``PUBLISH``\\es the exact event (type, revision, key,
  value, length-prefixed and binary-safe) on ``pdps:events``; expiry deletions come
  from the ``__keyevent@<db>__:expired`` keyspace notification, read on the same
  pub/sub connection, so both arrive in the server's order. The server must run with
  ``notify-keyspace-events`` containing ``E`` and ``x`` (or ``A``); ``watch`` checks.

What a single Redis node guarantees, and what it does not:

* Guaranteed: scripts are atomic and the node executes commands one at a time, so
  while the node is up every operation is linearizable: compare-and-set, the fenced
  lock and put-if-absent are exact, revisions strictly increase with each write.
* NOT durable: without ``appendonly yes`` and ``appendfsync always`` a crash or
  restart loses acknowledged writes (and with it the revision counter). With a
  replica and failover, replication is asynchronous: a promoted replica can miss
  acknowledged writes, and a fence checked on the old primary proves nothing on the
  new one. Redis Cluster is not supported (scripts touch keys they do not declare).
* Lease expiry follows the Redis server's clock, not the client's.
* Watch events go over pub/sub, which is at-most-once: events published while the
  pub/sub connection is down are lost (the watcher reconnects with backoff,
  resubscribes and logs a warning), and a subscriber too slow for the server's
  output-buffer limit is disconnected.
* Redis expires keys outside any script, so an expiry does not get a revision of
  its own: its DELETE event carries the revision of the last write seen on the
  connection. Revisions of watch events are therefore non-decreasing (an expiry
  shares the previous write's revision), not strictly increasing.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn
from urllib.parse import parse_qs, unquote, urlsplit

import attrs

from pdps.core.backoff import Backoff
from pdps.core.errors import ConfigError, FencingError, LeaseExpired, MissingExtraError, StoreError, StoreUnavailable
from pdps.ports.coordination import (
    Compare,
    Delete,
    EventType,
    Fence,
    KeyValue,
    Op,
    Put,
    TxnOp,
    TxnResult,
    WatchEvent,
)
from pdps.runtime import retry as pdps_retry

try:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError as exc:  # pragma: no cover - exercised by the registry's extra check
    raise MissingExtraError(f"redis:// coordination store needs redis-py ({exc.name}): pip install 'pdps[redis]'") from exc

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 5.0
NAMESPACE = "pdps:"
_RECONNECT = Backoff(first=0.05, longest=1.0)  # pauses between pub/sub reconnect attempts
_POLL = 0.2  # how often the pub/sub reader looks up from the socket to notice close()

# --- Lua ------------------------------------------------------------------------------
# Shared helpers, prepended to every write script. ARGV[1] is always the namespace.
_PRELUDE = r"""
local ns = ARGV[1]
local IDX, REV, CHAN = ns .. 'index', ns .. 'revision', ns .. 'events'
local function kv(key) return ns .. 'kv:' .. key end
local function lease_key(id) return ns .. 'lease:' .. id end
local function lease_set(id) return ns .. 'lease-keys:' .. id end

-- bytewise ordering like Python's bytes (Lua's < uses the locale's strcoll)
local function bytes_cmp(a, b)
  if a == b then return 0 end
  local n = math.min(#a, #b)
  local i = 1
  while i <= n do
    local j = math.min(i + 63, n)
    if string.sub(a, i, j) ~= string.sub(b, i, j) then
      for k = i, j do
        local x, y = string.byte(a, k), string.byte(b, k)
        if x ~= y then return x < y and -1 or 1 end
      end
    end
    i = j + 1
  end
  return #a < #b and -1 or 1
end

local function holds(target, op, key, operand)
  local c
  if target == 'revision' then
    local left = tonumber(redis.call('HGET', kv(key), 'mod_revision') or 0)
    local right = tonumber(operand)
    c = left == right and 0 or (left < right and -1 or 1)
  else
    local left = redis.call('HGET', kv(key), 'value')
    if not left then return false end
    c = bytes_cmp(left, operand)
  end
  if op == '==' then return c == 0 end
  if op == '!=' then return c ~= 0 end
  if op == '<' then return c < 0 end
  return c > 0
end

local function publish(kind, rev, key, value)
  redis.call('PUBLISH', CHAN, kind .. rev .. '\n' .. #key .. '\n' .. key .. value)
end

local function detach(key, k)
  local old = redis.call('HGET', k, 'lease')
  if old and old ~= '' then redis.call('SREM', lease_set(old), key) end
end

local function apply_put(rev, key, value, lease)
  local k = kv(key)
  detach(key, k)
  redis.call('HSET', k, 'value', value, 'mod_revision', rev, 'lease', lease)
  if lease == '' then
    redis.call('PERSIST', k)
  else
    local ttl = redis.call('PTTL', lease_key(lease))
    redis.call('SADD', lease_set(lease), key)
    redis.call('PEXPIRE', lease_set(lease), ttl)
    redis.call('PEXPIRE', k, ttl)
  end
  redis.call('ZADD', IDX, 0, key)
  publish('P', rev, key, value)
end

local function apply_delete(rev, key)
  local k = kv(key)
  redis.call('ZREM', IDX, key)
  if redis.call('EXISTS', k) == 1 then
    detach(key, k)
    redis.call('DEL', k)
    publish('D', rev, key, '')
  end
end

local function current_revision() return tonumber(redis.call('GET', REV) or 0) end
"""

# ARGV: ns, nfence, ncompares, (target, op, key, operand) * ncompares,
#       nsuccess, (kind, key, value, lease) * nsuccess, nfailure, (...) * nfailure.
# The first nfence compares are the fence's. Returns {'ok', succeeded, revision},
# {'fenced'} or {'lease', id, key}; on the last two nothing was written.
_TXN = (
    _PRELUDE
    + r"""
local pos = 2
local nfence, ncmp = tonumber(ARGV[pos]), tonumber(ARGV[pos + 1])
pos = pos + 2
local ok = true
for i = 1, ncmp do
  if ok and not holds(ARGV[pos], ARGV[pos + 1], ARGV[pos + 2], ARGV[pos + 3]) then
    if i <= nfence then return {'fenced'} end
    ok = false
  end
  pos = pos + 4
end
local function read_ops()
  local n = tonumber(ARGV[pos])
  pos = pos + 1
  local ops = {}
  for i = 1, n do
    ops[i] = {ARGV[pos], ARGV[pos + 1], ARGV[pos + 2], ARGV[pos + 3]}
    pos = pos + 4
  end
  return ops
end
local success = read_ops()
local failure = read_ops()
local ops = ok and success or failure
for _, op in ipairs(ops) do
  if op[1] == 'put' and op[4] ~= '' and redis.call('PTTL', lease_key(op[4])) <= 0 then
    return {'lease', op[4], op[2]}
  end
end
if #ops == 0 then return {'ok', ok and 1 or 0, current_revision()} end
local rev = redis.call('INCR', REV)
for _, op in ipairs(ops) do
  if op[1] == 'put' then apply_put(rev, op[2], op[3], op[4]) else apply_delete(rev, op[2]) end
end
return {'ok', ok and 1 or 0, rev}
"""
)

# ARGV: ns, key. Returns 1 if the key existed (and is now deleted), else 0.
_DELETE = (
    _PRELUDE
    + r"""
if redis.call('EXISTS', kv(ARGV[2])) == 0 then return 0 end
apply_delete(redis.call('INCR', REV), ARGV[2])
return 1
"""
)

# ARGV: ns, min, max (ZRANGEBYLEX bounds), mode. mode 'get': the live keys as a flat
# list key, value, mod_revision, lease; mode 'delete': delete them in one revision,
# return how many. Index entries of expired hashes are dropped either way.
_RANGE = (
    _PRELUDE
    + r"""
local out, live = {}, {}
for _, key in ipairs(redis.call('ZRANGEBYLEX', IDX, ARGV[2], ARGV[3])) do
  local h = redis.call('HMGET', kv(key), 'value', 'mod_revision', 'lease')
  if h[1] then
    live[#live + 1] = key
    out[#out + 1] = key
    out[#out + 1] = h[1]
    out[#out + 1] = h[2]
    out[#out + 1] = h[3]
  else
    redis.call('ZREM', IDX, key)
  end
end
if ARGV[4] ~= 'delete' then return out end
if #live > 0 then
  local rev = redis.call('INCR', REV)
  for _, key in ipairs(live) do apply_delete(rev, key) end
end
return #live
"""
)

# ARGV: ns, ttl_ms. Returns the new lease id.
_GRANT = (
    _PRELUDE
    + r"""
local id = redis.call('INCR', ns .. 'lease-seq')
redis.call('SET', lease_key(id), ARGV[2], 'PX', ARGV[2])
return id
"""
)

# ARGV: ns, id. Returns 0 if the lease is gone, else 1 after pushing its expiry (and
# that of every key still attached to it) a full TTL forward.
_KEEP_ALIVE = (
    _PRELUDE
    + r"""
local id = ARGV[2]
local ttl = redis.call('GET', lease_key(id))
if not ttl then return 0 end
redis.call('PEXPIRE', lease_key(id), ttl)
for _, key in ipairs(redis.call('SMEMBERS', lease_set(id))) do
  if redis.call('HGET', kv(key), 'lease') == id then
    redis.call('PEXPIRE', kv(key), ttl)
  else
    redis.call('SREM', lease_set(id), key)
  end
end
redis.call('PEXPIRE', lease_set(id), ttl)
return 1
"""
)

# ARGV: ns, id. Deletes the lease and, in one revision, the keys still attached to it.
_REVOKE = (
    _PRELUDE
    + r"""
local id = ARGV[2]
local keys = {}
for _, key in ipairs(redis.call('SMEMBERS', lease_set(id))) do
  if redis.call('HGET', kv(key), 'lease') == id then keys[#keys + 1] = key end
end
redis.call('DEL', lease_key(id), lease_set(id))
if #keys == 0 then return 0 end
table.sort(keys)
local rev = redis.call('INCR', REV)
for _, key in ipairs(keys) do apply_delete(rev, key) end
return #keys
"""
)


# --- URL ------------------------------------------------------------------------------


@attrs.frozen
class RedisTarget:
    """Where and how to connect, parsed from a store URL."""

    url: str  # the URL with the password masked, for messages
    host: str
    port: int = 6379
    db: int = 0
    username: str | None = None
    password: str | None = attrs.field(default=None, repr=False)
    timeout: float = DEFAULT_TIMEOUT
    tls: bool = False
    ca: str | None = None
    cert: str | None = None
    key: str | None = None


_QUERY_KEYS = {"redis": {"timeout"}, "rediss": {"timeout", "ca", "cert", "key"}}


def parse_redis_url(url: str) -> RedisTarget:
    """Parse a ``redis://``/``rediss://`` URL; a malformed one raises ConfigError naming the problem."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _QUERY_KEYS:
        raise ConfigError(f"not a Redis store URL (redis:// or rediss://): {_mask(url)!r}")
    try:
        port = parts.port or 6379
    except ValueError as exc:
        raise ConfigError(f"bad port in Redis store URL: {exc}") from exc
    host = parts.hostname or ""
    if not host:
        raise ConfigError(f"Redis store URL has no host: {_mask(url)!r}")
    db_text = parts.path.strip("/") or "0"
    if not (db_text.isascii() and db_text.isdigit()):
        raise ConfigError(f"Redis store URL path must be a database number, got {parts.path!r}")
    query = parse_qs(parts.query, keep_blank_values=True, strict_parsing=False)
    unknown = set(query) - _QUERY_KEYS[scheme]
    if unknown:
        hint = " (TLS options need rediss://)" if unknown <= _QUERY_KEYS["rediss"] else ""
        raise ConfigError(f"unknown option(s) {sorted(unknown)} in Redis store URL{hint}; known: {sorted(_QUERY_KEYS[scheme])}")
    opts = {k: v[-1] for k, v in query.items()}
    timeout = DEFAULT_TIMEOUT
    if "timeout" in opts:
        try:
            timeout = float(opts["timeout"])
        except ValueError:
            timeout = math.nan
        if not (math.isfinite(timeout) and timeout > 0):
            raise ConfigError(f"timeout in Redis store URL must be a number of seconds > 0, got {opts['timeout']!r}")
    for name in ("ca", "cert", "key"):
        if name in opts and not os.path.isfile(opts[name]):
            raise ConfigError(f"{name}= in Redis store URL names no readable file: {opts[name]!r}")
    if "key" in opts and "cert" not in opts:
        raise ConfigError("key= in Redis store URL needs cert= as well")
    return RedisTarget(
        url=_mask(url),
        host=host,
        port=port,
        db=int(db_text),
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password is not None else None,
        timeout=timeout,
        tls=scheme == "rediss",
        ca=opts.get("ca"),
        cert=opts.get("cert"),
        key=opts.get("key"),
    )


def _mask(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=f"{user}:***@{host}").geturl()


def open_redis_store(url: str) -> RedisStore:
    return RedisStore(parse_redis_url(url))


# --- the store ------------------------------------------------------------------------


@attrs.define(eq=False)
class _Watch:
    prefix: str
    callback: Callable[[WatchEvent], None]
    token: str  # its marker on the events channel: events after the marker are its own
    epoch: int  # pub/sub connection it was made on; a later one activates it anyway
    active: bool = False
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


class RedisStore:
    """:class:`~pdps.ports.coordination.CoordinationStore` on one Redis node."""

    def __init__(self, target: RedisTarget | str, *, namespace: str = NAMESPACE) -> None:
        if isinstance(target, str):
            target = parse_redis_url(target)
        self.url = target.url
        self.target = target
        self._ns = namespace
        self._redis = redis.Redis(connection_pool=redis.ConnectionPool(**connection_kwargs(target)))
        self._scripts = {
            name: self._redis.register_script(src)
            for name, src in (
                ("txn", _TXN),
                ("delete", _DELETE),
                ("range", _RANGE),
                ("grant", _GRANT),
                ("keep_alive", _KEEP_ALIVE),
                ("revoke", _REVOKE),
            )
        }
        self._closed = threading.Event()
        self._watcher: _Watcher | None = None
        self._watcher_lock = threading.Lock()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    # --- reads ------------------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        _check_key(key)
        with self._calls("get"):
            value, rev, lease = self._redis.hmget(self._ns + "kv:" + key, ["value", "mod_revision", "lease"])
        return None if value is None else _kv(key, value, rev, lease)

    def range(self, prefix: str) -> list[KeyValue]:
        _check_key(prefix)
        flat = self._script("range", *_lex_bounds(prefix), "get")
        return [_kv(flat[i].decode(), flat[i + 1], flat[i + 2], flat[i + 3]) for i in range(0, len(flat), 4)]

    # --- writes -----------------------------------------------------------------------

    def put(self, key: str, value: bytes, *, lease: int | None = None) -> int:
        return self.commit((), (Put(key, value, lease),)).revision

    def delete(self, key: str) -> bool:
        _check_key(key)
        return bool(self._script("delete", key))

    def delete_prefix(self, prefix: str) -> int:
        _check_key(prefix)
        return int(self._script("range", *_lex_bounds(prefix), "delete"))

    def commit(
        self,
        compares: Sequence[Compare],
        success: Sequence[TxnOp],
        failure: Sequence[TxnOp] = (),
        *,
        fence: Fence | None = None,
    ) -> TxnResult:
        fenced = tuple(fence.compares()) if fence is not None else ()
        args: list[Any] = [len(fenced), len(fenced) + len(compares)]
        for c in (*fenced, *compares):
            args += _compare_args(c)
        for ops in (success, failure):
            args.append(len(ops))
            for op in ops:
                args += _op_args(op)
        reply = self._script("txn", *args)
        tag = reply[0]
        if tag == b"fenced":
            assert fence is not None
            raise FencingError(f"lock {fence.key!r} is no longer held by {fence.owner!r}; write refused")
        if tag == b"lease":
            raise LeaseExpired(f"lease {int(reply[1])} has expired or was never granted (writing {reply[2].decode()!r})")
        return TxnResult(bool(reply[1]), int(reply[2]))

    # --- leases -----------------------------------------------------------------------

    def grant_lease(self, ttl: float) -> int:
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl) or not ttl > 0:
            raise StoreError(f"lease TTL must be a finite number of seconds > 0, got {ttl!r}")
        return int(self._script("grant", max(1, round(ttl * 1000))))

    def keep_alive(self, lease: int) -> None:
        _check_lease(lease)
        if not self._script("keep_alive", lease):
            raise LeaseExpired(f"lease {lease} has expired or was never granted")

    def revoke_lease(self, lease: int) -> None:
        _check_lease(lease)
        self._script("revoke", lease)

    def lease_ttl_left(self, lease: int) -> float | None:
        """Seconds until expiry by the server's clock, or ``None`` if the lease is gone."""
        _check_lease(lease)
        with self._calls("lease_ttl_left"):
            ms = self._redis.pttl(f"{self._ns}lease:{lease}")
        return None if ms < 0 else ms / 1000

    # --- watches and locks ------------------------------------------------------------

    def watch(self, prefix: str, callback: Callable[[WatchEvent], None]) -> _Watch:
        _check_key(prefix)
        with self._watcher_lock:
            self._check_open()
            if self._watcher is None:
                self._check_expiry_notifications()
                self._watcher = _Watcher(self)
            watcher = self._watcher
        return watcher.add(prefix, callback)

    def acquire_lock(self, name: str, lease: int, owner: bytes) -> Fence | None:
        result = self.commit((Compare.absent(name),), (Put(name, owner, lease),))
        return Fence(key=name, owner=owner, revision=result.revision) if result.succeeded else None

    def close(self) -> None:
        with self._watcher_lock:
            if self._closed.is_set():
                return
            self._closed.set()
            watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.stop()
        self._redis.close()
        self._redis.connection_pool.disconnect()

    # --- internals --------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise StoreError(f"store {self.url} is closed")

    def _script(self, name: str, *args: Any) -> Any:
        with self._calls(name):
            return self._scripts[name](args=(self._ns, *args))

    @contextmanager
    def _calls(self, what: str) -> Iterator[None]:
        """Run redis-py calls, turning every redis exception into a pdps StoreError."""
        self._check_open()
        try:
            yield
        except redis.RedisError as exc:
            _raise_translated(exc, self.target, what)

    def _check_expiry_notifications(self) -> None:
        """Refuse to watch if the server would never tell us about expiries.

        Without ``E`` (keyevent) and ``x`` (expired) in ``notify-keyspace-events``
        lease expiry deletions would silently never reach watchers. Servers that hide
        CONFIG (managed Redis) get the benefit of the doubt and a warning.
        """
        with self._calls("watch"):
            try:
                flags = self._redis.config_get("notify-keyspace-events").get("notify-keyspace-events", "")
            except redis.ResponseError as exc:
                log.warning("cannot read notify-keyspace-events on %s (%s): lease expiries reach watchers only if it has E and x", self.url, exc)
                return
        flags = flags.decode() if isinstance(flags, bytes) else str(flags)
        if "E" not in flags or not ("x" in flags or "A" in flags):
            raise StoreError(
                f"redis at {self.url} has notify-keyspace-events={flags!r}: watches need expiry events; "
                "run the server with --notify-keyspace-events Ex (or CONFIG SET notify-keyspace-events Ex)"
            )


def connection_kwargs(t: RedisTarget) -> dict[str, Any]:
    """redis-py connection-pool arguments for ``t`` (the stream source connects alike)."""
    kwargs: dict[str, Any] = dict(
        host=t.host,
        port=t.port,
        db=t.db,
        username=t.username,
        password=t.password,
        socket_timeout=t.timeout,
        socket_connect_timeout=t.timeout,
        retry=Retry(NoBackoff(), 0),  # never resend a write: its outcome is unknown; callers retry
    )
    if t.tls:
        kwargs.update(
            connection_class=redis.SSLConnection,
            ssl_ca_certs=t.ca,
            ssl_certfile=t.cert,
            ssl_keyfile=t.key,
        )
    return kwargs


def _raise_translated(exc: redis.RedisError, target: RedisTarget, what: str) -> NoReturn:
    url = target.url
    if isinstance(exc, (redis.AuthenticationError, redis.exceptions.AuthorizationError)):
        if target.password is None:
            raise StoreError(
                f"redis at {url} requires authentication ({exc}); put the password in the store URL: "
                "redis://[user]:PASSWORD@host:port/db"
            ) from exc
        raise StoreError(f"redis at {url} refused the credentials ({exc}); check user and password in the store URL") from exc
    if isinstance(exc, redis.ConnectionError) and _caused_by(exc, ssl.SSLCertVerificationError):
        raise StoreError(f"redis at {url}: TLS certificate verification failed ({exc}); check ca= in the store URL") from exc
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
        raise StoreUnavailable(f"redis at {url} is unreachable ({what}): {exc}") from exc
    raise StoreError(f"redis at {url} failed {what}: {exc}") from exc


def _caused_by(exc: BaseException, kind: type[BaseException]) -> bool:
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, kind):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _check_key(key: object) -> None:
    if not isinstance(key, str):
        raise StoreError(f"keys must be str, got {type(key).__name__}: {key!r}")
    try:
        key.encode()
    except UnicodeEncodeError as exc:
        raise StoreError(f"key {key!r} is not encodable as UTF-8") from exc


def _check_lease(lease: object) -> None:
    if isinstance(lease, bool) or not isinstance(lease, int):
        raise StoreError(f"lease ids are ints, got {type(lease).__name__}: {lease!r}")


def _compare_args(c: Compare) -> list[Any]:
    if not isinstance(c, Compare):
        raise StoreError(f"not a Compare: {c!r}")
    _check_key(c.key)
    try:
        op = Op(c.op)
    except ValueError:
        raise StoreError(f"unknown compare op {c.op!r}") from None
    if c.target == "revision":
        if isinstance(c.operand, bool) or not isinstance(c.operand, int):
            raise StoreError(f"a revision compare needs an int operand (got {c!r})")
    elif c.target == "value":
        if not isinstance(c.operand, bytes):
            raise StoreError(f"a value compare needs a bytes operand (got {c!r})")
    else:
        raise StoreError(f"compare target must be 'revision' or 'value' (got {c!r})")
    return [c.target, op.value, c.key, c.operand]


def _op_args(op: object) -> list[Any]:
    if isinstance(op, Put):
        _check_key(op.key)
        if not isinstance(op.value, bytes):
            raise StoreError(f"keys must be str and values bytes (got {op!r})")
        if op.lease is not None:
            _check_lease(op.lease)
        return ["put", op.key, op.value, "" if op.lease is None else op.lease]
    if isinstance(op, Delete):
        _check_key(op.key)
        return ["delete", op.key, b"", ""]
    raise StoreError(f"transaction ops are Put or Delete, got {op!r}")


def _kv(key: str, value: bytes, rev: bytes, lease: bytes | None) -> KeyValue:
    return KeyValue(key, value, int(rev), int(lease) if lease else None)


def _lex_bounds(prefix: str) -> tuple[bytes, bytes]:
    """ZRANGEBYLEX bounds selecting exactly the members that start with ``prefix``.

    UTF-8 orders like code points, so the index's bytewise order is Python's str order.
    """
    low = prefix.encode()
    if not low:
        return b"-", b"+"
    high = low.rstrip(b"\xff")
    if not high:
        return b"[" + low, b"+"
    return b"[" + low, b"(" + high[:-1] + bytes([high[-1] + 1])


# --- watch delivery -------------------------------------------------------------------


class _Watcher:
    """One pub/sub connection per store, read by one thread and dispatched by another.

    The reader only moves messages from the socket to a queue (so a slow callback
    never makes Redis drop us for a full output buffer); the dispatcher runs the
    callbacks in order. A watch is activated by its own marker message, published
    after the subscription is confirmed, so it sees exactly the events the server
    sent after it was made.
    """

    def __init__(self, store: RedisStore) -> None:
        self._store = store
        self._ns = store._ns
        self._channel = (store._ns + "events").encode()
        self._expired = f"__keyevent@{store.target.db}__:expired".encode()
        self._kv_prefix = (store._ns + "kv:").encode()
        kwargs = connection_kwargs(store.target)
        kwargs["health_check_interval"] = max(1, int(store.target.timeout))
        self._client = redis.Redis(connection_pool=redis.ConnectionPool(**kwargs))
        self._queue: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._watches: list[_Watch] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._subscribed = threading.Event()
        self._epoch = 0
        self._last_error: BaseException | None = None
        self._reader = threading.Thread(target=self._read_loop, name="pdps-redis-watch-reader", daemon=True)
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name="pdps-redis-watch", daemon=True)
        self._reader.start()
        self._dispatcher.start()

    def add(self, prefix: str, callback: Callable[[WatchEvent], None]) -> _Watch:
        if not self._subscribed.wait(self._store.target.timeout):
            raise StoreUnavailable(f"redis at {self._store.url} is unreachable (watch subscribe): {self._last_error}")
        with self._lock:
            w = _Watch(prefix, callback, uuid.uuid4().hex, self._epoch)
            self._watches.append(w)
        try:
            with self._store._calls("watch"):
                self._store._redis.publish(self._channel, b"M" + w.token.encode())
        except StoreError:
            w.cancel()
            raise
        return w

    def stop(self) -> None:
        self._stopping.set()
        self._queue.put(None)
        for t in (self._reader, self._dispatcher):
            if t is not threading.current_thread():
                t.join(self._store.target.timeout + 1)
        self._client.close()
        self._client.connection_pool.disconnect()

    # --- reader -----------------------------------------------------------------------

    def _read_loop(self) -> None:
        reconnects = pdps_retry.Retry(_RECONNECT, stop=self._stopping)
        while not self._stopping.is_set():
            pubsub = self._client.pubsub()
            try:
                self._subscribe(pubsub)
                if reconnects.failures:
                    log.warning("redis watch on %s resubscribed after %.1f s", self._store.url, reconnects.elapsed)
                reconnects.succeeded()
                while not self._stopping.is_set():
                    msg = pubsub.get_message(timeout=_POLL)
                    if msg is not None and msg["type"] == "message":
                        self._queue.put(("msg", msg["channel"], msg["data"]))
            except (redis.RedisError, OSError) as exc:
                self._subscribed.clear()
                self._last_error = exc
                if self._stopping.is_set():
                    break
                if not reconnects.failures:
                    log.warning(
                        "redis watch connection to %s lost (%s); reconnecting. Events written until it is back "
                        "are lost (Redis pub/sub is at-most-once)",
                        self._store.url,
                        exc,
                    )
                reconnects.failed()
            finally:
                try:
                    pubsub.close()
                except Exception:  # closing a dead connection may fail too; nothing to save
                    pass

    def _subscribe(self, pubsub: Any) -> None:
        pubsub.subscribe(self._channel, self._expired)
        confirmed, deadline = 0, time.monotonic() + self._store.target.timeout
        while confirmed < 2:
            if time.monotonic() > deadline:
                raise redis.TimeoutError("no subscribe confirmation")
            msg = pubsub.get_message(timeout=_POLL)
            if msg is not None and msg["type"] == "subscribe":
                confirmed += 1
        rev = int(self._client.get(self._ns + "revision") or 0)
        with self._lock:
            self._epoch += 1
            self._queue.put(("sync", self._epoch, rev))
        self._subscribed.set()

    # --- dispatcher -------------------------------------------------------------------

    def _dispatch_loop(self) -> None:
        last_rev = 0
        while True:
            item = self._queue.get()
            if item is None or self._stopping.is_set():
                return
            if item[0] == "sync":  # (re)subscribed: markers sent on an older connection may be lost
                _, epoch, rev = item
                last_rev = max(last_rev, rev)
                with self._lock:
                    for w in self._watches:
                        w.active = w.active or w.epoch < epoch
                continue
            _, channel, data = item
            event = self._decode(channel, data, last_rev)
            if event is None:
                continue
            last_rev = max(last_rev, event.revision)
            with self._lock:
                self._watches = [w for w in self._watches if not w.cancelled]
                targets = [w for w in self._watches if w.active and event.key.startswith(w.prefix)]
            for w in targets:
                if w.cancelled:
                    continue
                try:
                    w.callback(event)
                except Exception:  # a broken callback must not stop delivery to the others
                    log.exception("watch callback for prefix %r failed on %r", w.prefix, event.key)

    def _decode(self, channel: bytes, data: bytes, last_rev: int) -> WatchEvent | None:
        """The event a message stands for; markers activate their watch and yield None."""
        if channel == self._expired:
            if not data.startswith(self._kv_prefix):
                return None  # a lease or lease-key-set expiring, or someone else's key
            return WatchEvent(EventType.DELETE, data[len(self._kv_prefix) :].decode(errors="replace"), None, last_rev)
        kind = data[:1]
        if kind == b"M":
            token = data[1:].decode(errors="replace")
            with self._lock:
                for w in self._watches:
                    if w.token == token:
                        w.active = True
            return None
        try:
            rev, keylen, rest = data[1:].split(b"\n", 2)
            n = int(keylen)
            key = rest[:n].decode()
            if kind == b"P":
                return WatchEvent(EventType.PUT, key, rest[n:], int(rev))
            if kind == b"D":
                return WatchEvent(EventType.DELETE, key, None, int(rev))
        except (ValueError, UnicodeDecodeError):
            pass
        log.warning("ignoring a malformed message on %s: %r", channel.decode(errors="replace"), data[:80])
        return None
