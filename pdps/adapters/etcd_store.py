"""``etcd://`` and ``etcds://`` coordination store: the port on an etcd v3 cluster.

What etcd guarantees, and what this adapter builds on:

* **Linearizable reads and writes.** Every write goes through raft and every read
  here is a linearizable ``Range`` (never ``serializable``), so a role never reads
  state older than a write that has already returned to anyone.
* **One store-wide revision.** etcd's MVCC revision *is* the port's revision and each
  key's ``mod_revision`` is the port's; a transaction is one revision.
* **Leases expire server-side.** A process that dies simply stops sending
  keep-alives; the server deletes its keys after the TTL with nothing needed from the
  client. TTLs are whole seconds (a fractional TTL is rounded up) and the server may
  raise a TTL to its minimum (1.5 × its election timeout).
* **Watches resume by revision.** etcd keeps the history of every key until it is
  compacted, so a watch whose stream breaks (server restart, network outage)
  reconnects with backoff and asks for "everything after the last revision I
  delivered": no event is lost or delivered twice. If that history has been
  compacted meanwhile, the watch logs a warning and resumes from the oldest revision
  still kept.

URL::

    etcd://[user:password@]host:port[,host:port...][?timeout=SECONDS]
    etcds://[user:password@]host:port[,host:port...][?ca=PATH&cert=PATH&key=PATH&timeout=SECONDS]

``etcds`` is TLS: ``ca`` is the CA bundle that signed the servers' certificates (the
system roots when omitted); ``cert`` and ``key`` are a client certificate, both or
neither. ``timeout`` bounds every call (default 5 s): an unreachable cluster raises
:class:`~pdps.core.errors.StoreUnavailable` within it, never hangs. The port defaults
to 2379. Credentials and TLS files may also be passed to :class:`EtcdStore` as keyword
arguments. With several endpoints, a call that cannot reach one moves on to the next
(reads always; writes only when the request provably never left this process, because
retrying a write that may have been applied could misreport a compare-and-set).

Nothing is contacted on construction; the first call connects. Errors are translated
into the pdps hierarchy (``StoreUnavailable``, ``LeaseExpired``, ``StoreError``) with
the URL (password masked) and the operation in the message; no gRPC exception leaves
this module. Transient failures are not retried here: the roles' outage handling does.
A write etcd refuses as larger than its ``--max-request-bytes`` is a ``StoreError``
naming the first keys it writes, its size, and the setting.

Built on the generated gRPC stubs shipped with ``etcd-sdk-python`` (``pyetcd.etcdrpc``)
rather than its client class: that client marks an endpoint failed for 5 minutes
after one error, cannot renew an auth token, and its watches die with the stream.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import attrs
import grpc
from pyetcd import etcdrpc
from pyetcd.etcdrpc import kv_pb2

from pdps.core.backoff import Backoff
from pdps.core.errors import ConfigError, CorruptRecord, FencingError, LeaseExpired, StoreError, StoreUnavailable
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
from pdps.runtime.retry import Retry

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_PORT = 2379
DEFAULT_TIMEOUT = 5.0
_MAX_TTL = 9_000_000_000  # etcd's own limit (seconds)

_CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", -1),  # a range over many keys may exceed gRPC's 4 MiB default
    # gRPC's default reconnect backoff grows to 120 s: a restarted etcd would stay
    # unreachable for minutes. Keep retrying the connection at least every second.
    # (Not grpc.min_reconnect_backoff_ms: despite its name it is the connect timeout.)
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Notice a server that vanished without closing the connection (host down, SIGSTOP)
    # on a long-lived watch stream. etcd refuses pings more often than every 5 s.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 0),
)

_DELETE = kv_pb2.Event.DELETE

_OPS = {
    Op.EQ: etcdrpc.Compare.EQUAL,
    Op.NE: etcdrpc.Compare.NOT_EQUAL,
    Op.LT: etcdrpc.Compare.LESS,
    Op.GT: etcdrpc.Compare.GREATER,
}

# gRPC details meaning the request never reached a server: safe to send elsewhere.
_NOT_SENT = ("failed to connect to all addresses", "Connection refused", "DNS resolution failed")
_TRANSIENT_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# etcd's refusal of a request over --max-request-bytes, and gRPC's of one that is also
# over etcd's allowance for gRPC's overhead (512 KiB more).
_TOO_LARGE = ("etcdserver: request is too large", "grpc: received message larger than max")
_AUTH_DETAILS = ("invalid auth token", "user name is empty", "authentication failed", "auth token is expired")


# --- the URL ----------------------------------------------------------------------------


@attrs.frozen
class EtcdOptions:
    """Everything an ``etcd://`` URL says, parsed (see the module docstring)."""

    endpoints: tuple[tuple[str, int], ...]
    tls: bool = False
    user: str | None = None
    password: str | None = attrs.field(default=None, repr=False)
    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    timeout: float = DEFAULT_TIMEOUT

    def redacted_url(self) -> str:
        """The URL to show in messages and logs: the password is never printed."""
        auth = ""
        if self.user is not None:
            auth = urllib.parse.quote(self.user, safe="") + (":***" if self.password is not None else "") + "@"
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.endpoints)
        query = {k: v for k, v in (("ca", self.ca), ("cert", self.cert), ("key", self.key)) if v is not None}
        if self.timeout != DEFAULT_TIMEOUT:
            query["timeout"] = f"{self.timeout:g}"
        qs = ("?" + urllib.parse.urlencode(query, safe="/")) if query else ""
        return f"{'etcds' if self.tls else 'etcd'}://{auth}{hosts}{qs}"


def parse_etcd_url(url: str) -> EtcdOptions:
    """Parse ``etcd[s]://[user:password@]host:port[,host:port...][?options]``; raises ConfigError."""
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in ("etcd", "etcds"):
        raise ConfigError(f"not an etcd URL: expected etcd://host:port or etcds://host:port, got {url.split('@')[-1]!r}")
    netloc, _, query = rest.partition("?")
    netloc = netloc.rstrip("/")
    userinfo, at, hostlist = netloc.rpartition("@")
    user = password = None
    if at:
        raw_user, colon, raw_password = userinfo.partition(":")
        user = urllib.parse.unquote(raw_user)
        password = urllib.parse.unquote(raw_password) if colon else None
        if not user:
            raise ConfigError("etcd URL has credentials without a user name (expected user:password@)")
    endpoints = tuple(_parse_hostport(part) for part in hostlist.split(",") if part.strip())
    if not endpoints:
        raise ConfigError(f"etcd URL names no host: {scheme}://{hostlist}")
    params: dict[str, str] = {}
    for name, value in urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=False):
        if name not in ("ca", "cert", "key", "timeout"):
            raise ConfigError(f"unknown etcd URL option {name!r}; known: ca, cert, key, timeout")
        params[name] = value
    timeout = DEFAULT_TIMEOUT
    if "timeout" in params:
        try:
            timeout = float(params["timeout"])
        except ValueError:
            timeout = -1.0
        if not (timeout > 0 and math.isfinite(timeout)):
            raise ConfigError(f"etcd URL option timeout must be a positive number of seconds, got {params['timeout']!r}")
    return EtcdOptions(
        endpoints=endpoints,
        tls=scheme == "etcds",
        user=user,
        password=password,
        ca=params.get("ca") or None,
        cert=params.get("cert") or None,
        key=params.get("key") or None,
        timeout=timeout,
    )


def _parse_hostport(text: str) -> tuple[str, int]:
    text = text.strip()
    if text.startswith("["):  # [ipv6]:port
        host, _, tail = text[1:].partition("]")
        port_text = tail[1:] if tail.startswith(":") else ""
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise ConfigError(f"etcd endpoint {text!r} has no host")
    if not port_text:
        return host, DEFAULT_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(f"etcd endpoint {text!r} has an invalid port")
    return host, int(port_text)


def open_etcd_store(url: str) -> EtcdStore:
    return EtcdStore(url)


# --- keys and values --------------------------------------------------------------------


def _key(key: object) -> bytes:
    if not isinstance(key, str) or not key:
        raise StoreError(f"keys must be non-empty str, got {key!r}")
    return key.encode()


def _value(value: object, key: str) -> bytes:
    if not isinstance(value, bytes):
        raise StoreError(f"values must be bytes, got {type(value).__name__} for {key!r}")
    return value


def _prefix_range(prefix: object) -> tuple[bytes, bytes]:
    """etcd's [key, range_end) for "every key starting with prefix"."""
    if not isinstance(prefix, str):
        raise StoreError(f"prefixes must be str, got {prefix!r}")
    raw = prefix.encode()
    for i in reversed(range(len(raw))):
        if raw[i] < 0xFF:
            return raw, raw[:i] + bytes([raw[i] + 1])
    return (raw or b"\0"), b"\0"  # empty (or all-0xff) prefix: to the end of the keyspace


def _decode_key(raw: bytes) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError as exc:
        raise CorruptRecord(f"etcd key {raw!r} is not UTF-8; pdps never writes such keys", key=repr(raw)) from exc


def _kv(kv: Any) -> KeyValue:
    return KeyValue(_decode_key(kv.key), kv.value, kv.mod_revision, kv.lease or None)


def _lease_id(lease: object, what: str) -> int:
    if lease is None:
        return 0
    if not isinstance(lease, int) or isinstance(lease, bool):
        raise StoreError(f"lease ids are int, got {lease!r} ({what})")
    if lease <= 0:  # etcd reads 0 as "no lease"; the port says an unknown lease fails
        raise LeaseExpired(f"lease {lease} was never granted ({what})")
    return lease


def _compare(c: Compare) -> Any:
    key = _key(c.key)
    if c.op not in _OPS:
        raise StoreError(f"unknown compare operator {c.op!r}")
    if c.target == "revision":
        if not isinstance(c.operand, int) or isinstance(c.operand, bool):
            raise StoreError(f"a revision compare needs an int operand, got {c.operand!r}")
        # A missing key has mod_revision 0 in etcd, so Compare.absent works as is.
        return etcdrpc.Compare(key=key, target=etcdrpc.Compare.MOD, result=_OPS[c.op], mod_revision=c.operand)
    if c.target == "value":
        return etcdrpc.Compare(key=key, target=etcdrpc.Compare.VALUE, result=_OPS[c.op], value=_value(c.operand, c.key))
    raise StoreError(f"unknown compare target {c.target!r}")


def _request_op(op: TxnOp) -> Any:
    if isinstance(op, Put):
        put = etcdrpc.PutRequest(
            key=_key(op.key), value=_value(op.value, op.key), lease=_lease_id(op.lease, f"writing {op.key!r}")
        )
        return etcdrpc.RequestOp(request_put=put)
    if isinstance(op, Delete):
        return etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=_key(op.key)))
    raise StoreError(f"transaction ops are Put or Delete, got {op!r}")


# --- the store --------------------------------------------------------------------------


class _Endpoint:
    """One server address: its channel and the stubs on it."""

    def __init__(self, host: str, port: int, credentials: grpc.ChannelCredentials | None) -> None:
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if credentials is None:
            self.channel = grpc.insecure_channel(self.address, options=_CHANNEL_OPTIONS)
        else:
            self.channel = grpc.secure_channel(self.address, credentials, options=_CHANNEL_OPTIONS)
        self.kv = etcdrpc.KVStub(self.channel)
        self.lease = etcdrpc.LeaseStub(self.channel)
        self.watch = etcdrpc.WatchStub(self.channel)
        self.auth = etcdrpc.AuthStub(self.channel)


class EtcdStore:
    """:class:`~pdps.ports.coordination.CoordinationStore` on etcd v3 (see the module docstring).

    ``url`` is kept with the password masked, so it is safe to log. Keyword arguments
    override what the URL says. ``watch_backoff`` is the (first, longest) pause between
    a watch's reconnection attempts, in seconds.
    """

    def __init__(
        self,
        url: str,
        *,
        user: str | None = None,
        password: str | None = None,
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        timeout: float | None = None,
        watch_backoff: tuple[float, float] = (0.05, 2.0),
    ) -> None:
        opts = parse_etcd_url(url)
        overrides = {"user": user, "password": password, "ca": ca, "cert": cert, "key": key, "timeout": timeout}
        opts = attrs.evolve(opts, **{k: v for k, v in overrides.items() if v is not None})
        if opts.password is not None and opts.user is None:
            raise ConfigError("an etcd password was given without a user")
        if not opts.tls and (opts.ca or opts.cert or opts.key):
            raise ConfigError(f"TLS files were given for a plaintext URL; use etcds:// for TLS ({opts.redacted_url()})")
        if bool(opts.cert) != bool(opts.key):
            raise ConfigError("an etcd client certificate needs both cert= and key=")
        if not opts.timeout > 0:
            raise ConfigError(f"etcd timeout must be > 0 seconds, got {opts.timeout}")
        self.url = opts.redacted_url()
        self.timeout = opts.timeout
        self._user = opts.user
        self._password = opts.password or ""
        self._watch_backoff = watch_backoff
        credentials = _tls_credentials(opts) if opts.tls else None
        self._endpoints = [_Endpoint(host, port, credentials) for host, port in opts.endpoints]
        self._current = 0
        self._token: str | None = None  # etcd auth token; "" when the server has auth disabled
        self._auth_lock = threading.Lock()
        self._lock = threading.Lock()
        self._watches: set[_EtcdWatch] = set()
        self._closed = False

    def __repr__(self) -> str:
        return f"EtcdStore({self.url!r})"

    # --- reads ------------------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        raw = _key(key)
        resp = self._call(f"get {key!r}", lambda ep, t, md: ep.kv.Range(etcdrpc.RangeRequest(key=raw), timeout=t, metadata=md))
        return _kv(resp.kvs[0]) if resp.kvs else None

    def range(self, prefix: str) -> list[KeyValue]:
        start, end = _prefix_range(prefix)
        request = etcdrpc.RangeRequest(
            key=start, range_end=end, sort_order=etcdrpc.RangeRequest.ASCEND, sort_target=etcdrpc.RangeRequest.KEY
        )
        resp = self._call(f"range {prefix!r}", lambda ep, t, md: ep.kv.Range(request, timeout=t, metadata=md))
        return [_kv(kv) for kv in resp.kvs]

    # --- writes -----------------------------------------------------------------------

    def put(self, key: str, value: bytes, *, lease: int | None = None) -> int:
        request = etcdrpc.PutRequest(key=_key(key), value=_value(value, key), lease=_lease_id(lease, f"writing {key!r}"))
        what = f"put {key!r}" + (f" with lease {lease}" if lease is not None else "")
        resp = self._call(what, lambda ep, t, md: ep.kv.Put(request, timeout=t, metadata=md), write=True, request=request)
        return int(resp.header.revision)

    def delete(self, key: str) -> bool:
        request = etcdrpc.DeleteRangeRequest(key=_key(key))
        resp = self._call(f"delete {key!r}", lambda ep, t, md: ep.kv.DeleteRange(request, timeout=t, metadata=md), write=True)
        return resp.deleted > 0

    def delete_prefix(self, prefix: str) -> int:
        start, end = _prefix_range(prefix)
        request = etcdrpc.DeleteRangeRequest(key=start, range_end=end)  # one DeleteRange: one revision
        resp = self._call(
            f"delete_prefix {prefix!r}", lambda ep, t, md: ep.kv.DeleteRange(request, timeout=t, metadata=md), write=True
        )
        return int(resp.deleted)

    def commit(
        self,
        compares: Sequence[Compare],
        success: Sequence[TxnOp],
        failure: Sequence[TxnOp] = (),
        *,
        fence: Fence | None = None,
    ) -> TxnResult:
        """One etcd transaction. With ``fence``, the user's transaction is nested inside
        an outer one that compares only the fence and has an empty failure branch: the
        fence and the user's compares are checked in the same revision (no race), and a
        lost lock writes nothing at all, yet is told apart from the user's compares failing."""
        return self._commit(compares, success, failure, fence, "commit")

    def _commit(
        self, compares: Sequence[Compare], success: Sequence[TxnOp], failure: Sequence[TxnOp], fence: Fence | None, what: str
    ) -> TxnResult:
        txn = etcdrpc.TxnRequest(
            compare=[_compare(c) for c in compares],
            success=[_request_op(op) for op in success],
            failure=[_request_op(op) for op in failure],
        )
        if fence is not None:
            txn = etcdrpc.TxnRequest(
                compare=[_compare(c) for c in fence.compares()], success=[etcdrpc.RequestOp(request_txn=txn)]
            )
        resp = self._call(what, lambda ep, t, md: ep.kv.Txn(txn, timeout=t, metadata=md), write=True, request=txn)
        succeeded = bool(resp.succeeded)
        if fence is not None:
            if not succeeded:
                raise FencingError(f"lock {fence.key!r} is no longer held by {fence.owner!r}; write refused")
            succeeded = bool(resp.responses[0].response_txn.succeeded)
        return TxnResult(succeeded, int(resp.header.revision))

    # --- leases -----------------------------------------------------------------------

    def grant_lease(self, ttl: float) -> int:
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl <= _MAX_TTL:
            raise StoreError(f"lease TTL must be > 0 and at most {_MAX_TTL} seconds, got {ttl}")
        request = etcdrpc.LeaseGrantRequest(TTL=math.ceil(ttl))  # etcd TTLs are whole seconds
        resp = self._call(
            f"grant_lease ttl={ttl}", lambda ep, t, md: ep.lease.LeaseGrant(request, timeout=t, metadata=md), write=True
        )
        if resp.error:
            raise StoreError(f"etcd at {self.url} refused a lease of {ttl} s: {resp.error}")
        return int(resp.ID)

    def keep_alive(self, lease: int) -> None:
        request = etcdrpc.LeaseKeepAliveRequest(ID=_lease_id(lease, "keep_alive"))

        def once(ep: _Endpoint, timeout: float, md: Any) -> Any:
            # LeaseKeepAlive is a stream; one request, one answer, then hang up.
            call = ep.lease.LeaseKeepAlive(iter([request]), timeout=timeout, metadata=md)
            try:
                return next(call, None)
            finally:
                call.cancel()

        resp = self._call(f"keep_alive lease {lease}", once)
        if resp is None:
            raise StoreUnavailable(f"etcd at {self.url} closed the keep-alive stream of lease {lease} without an answer")
        if resp.TTL <= 0:
            raise LeaseExpired(f"lease {lease} has expired or was never granted")

    def revoke_lease(self, lease: int) -> None:
        request = etcdrpc.LeaseRevokeRequest(ID=_lease_id(lease, "revoke_lease"))
        try:
            self._call(
                f"revoke_lease {lease}", lambda ep, t, md: ep.lease.LeaseRevoke(request, timeout=t, metadata=md), write=True
            )
        except LeaseExpired:
            pass  # unknown or already expired: nothing left to revoke

    # --- watches and locks ------------------------------------------------------------

    def watch(self, prefix: str, callback: Callable[[WatchEvent], None]) -> _EtcdWatch:
        """Start after the current revision, so nothing from before this call is delivered
        however long the stream takes to open."""
        start, end = _prefix_range(prefix)
        if not callable(callback):
            raise StoreError(f"watch callback must be callable, got {callback!r}")
        count_only = etcdrpc.RangeRequest(key=start, range_end=end, count_only=True)
        resp = self._call(f"watch {prefix!r}", lambda ep, t, md: ep.kv.Range(count_only, timeout=t, metadata=md))
        w = _EtcdWatch(self, prefix, start, end, callback, int(resp.header.revision) + 1)
        with self._lock:
            self._check_open()
            self._watches.add(w)
        w.start()
        return w

    def acquire_lock(self, name: str, lease: int, owner: bytes) -> Fence | None:
        result = self._commit((Compare.absent(name),), (Put(name, owner, lease),), (), None, f"acquire_lock {name!r}")
        return Fence(key=name, owner=owner, revision=result.revision) if result.succeeded else None

    def close(self) -> None:
        """Stop every watch, then close the channels; later calls raise StoreError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            watches = list(self._watches)
        for w in watches:
            w.cancel()
        for w in watches:
            w.join(self.timeout)
        for ep in self._endpoints:
            ep.channel.close()

    # --- internals --------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"store {self.url} is closed")

    def _forget(self, w: _EtcdWatch) -> None:
        with self._lock:
            self._watches.discard(w)

    def _endpoint(self) -> _Endpoint:
        return self._endpoints[self._current % len(self._endpoints)]

    def _next_endpoint(self, failed: _Endpoint) -> None:
        if len(self._endpoints) > 1 and self._endpoint() is failed:
            self._current = (self._endpoints.index(failed) + 1) % len(self._endpoints)

    def _call(self, what: str, invoke: Callable[[_Endpoint, float, Any], T], *, write: bool = False, request: Any = None) -> T:
        """Run one RPC under the store's deadline; translate every failure.

        Tries the next endpoint when this one cannot be reached (a write only when it
        provably was not sent), and re-authenticates once when the token was refused.
        ``request`` (a write's) is described if etcd refuses it as too large."""
        self._check_open()
        deadline = time.monotonic() + self.timeout
        tried: set[int] = set()
        reauthenticated = False
        while True:
            ep = self._endpoint()
            tried.add(id(ep))
            try:
                metadata = self._metadata(ep, deadline)
                return invoke(ep, max(deadline - time.monotonic(), 0.001), metadata)
            except grpc.RpcError as exc:
                code, details = _status(exc)
                if self._closed:
                    raise StoreError(f"store {self.url} is closed (during {what})") from exc
                if self._user is not None and not reauthenticated and _is_auth_error(code, details):
                    reauthenticated = True  # the token expired or the server restarted: log in again
                    self._drop_token()
                    continue
                if code in _TRANSIENT_CODES:
                    self._next_endpoint(ep)
                    unsent = code is grpc.StatusCode.UNAVAILABLE and any(m in details for m in _NOT_SENT)
                    if (unsent or not write) and id(self._endpoint()) not in tried and time.monotonic() < deadline:
                        continue
                raise self._translate(what, code, details, request) from exc
            except ValueError as exc:  # gRPC: "Cannot invoke RPC on closed channel!"
                if self._closed:
                    raise StoreError(f"store {self.url} is closed (during {what})") from exc
                raise

    def _translate(self, what: str, code: grpc.StatusCode, details: str, request: Any = None) -> StoreError:
        where = f"etcd {what} at {self.url}"
        if request is not None and any(m in details for m in _TOO_LARGE):
            keys = _written_keys(request)
            more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
            return StoreError(
                f"{where}: etcd refused a request of {request.ByteSize():,} bytes writing "
                f"{', '.join(map(repr, keys[:3]))}{more} as too large; etcd takes at most --max-request-bytes "
                f"per request (1.5 MiB by default): raise it on every member, or write less in one request ({code.name}: {details})"
            )
        if code in _TRANSIENT_CODES or "too many requests" in details:
            return StoreUnavailable(f"{where}: server unavailable ({code.name}: {details})")
        if "requested lease not found" in details:
            return LeaseExpired(f"{where}: the lease has expired or was never granted")
        if _is_auth_error(code, details):
            if self._user is None:
                return StoreError(f"{where}: the server requires authentication; give user:password@ in the URL ({details})")
            return StoreError(f"{where}: authentication as user {self._user!r} failed ({details})")
        if code is grpc.StatusCode.PERMISSION_DENIED:
            return StoreError(f"{where}: permission denied for user {self._user!r} ({details})")
        return StoreError(f"{where} failed: {code.name}: {details}")

    def _metadata(self, ep: _Endpoint, deadline: float) -> tuple[tuple[str, str], ...] | None:
        """The auth token as call metadata, logging in first if there is none yet."""
        if self._user is None:
            return None
        with self._auth_lock:
            if self._token is None:
                request = etcdrpc.AuthenticateRequest(name=self._user, password=self._password)
                try:
                    self._token = ep.auth.Authenticate(request, timeout=max(deadline - time.monotonic(), 0.001)).token
                except grpc.RpcError as exc:
                    if "authentication is not enabled" not in _status(exc)[1]:
                        raise
                    self._token = ""  # credentials are not needed on this server
            token = self._token
        return (("token", token),) if token else None

    def _drop_token(self) -> None:
        with self._auth_lock:
            self._token = None


def _status(exc: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return code or grpc.StatusCode.UNKNOWN, details or ""


def _written_keys(request: Any) -> list[str]:
    """The keys a Put or Txn request writes, in order (a fenced transaction's nested ones too)."""
    if isinstance(request, etcdrpc.PutRequest):
        return [request.key.decode(errors="replace")]
    keys: list[str] = []
    for op in [*request.success, *request.failure]:
        which = op.WhichOneof("request")
        keys += _written_keys(op.request_txn) if which == "request_txn" else [getattr(op, which).key.decode(errors="replace")]
    return keys


def _is_auth_error(code: grpc.StatusCode, details: str) -> bool:
    return code is grpc.StatusCode.UNAUTHENTICATED or any(m in details for m in _AUTH_DETAILS)


def _tls_credentials(opts: EtcdOptions) -> grpc.ChannelCredentials:
    def read(path: str | None, what: str) -> bytes | None:
        if path is None:
            return None
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as exc:
            raise ConfigError(f"cannot read the etcd TLS {what} file {path!r}: {exc}") from exc

    return grpc.ssl_channel_credentials(read(opts.ca, "CA"), read(opts.key, "key"), read(opts.cert, "certificate"))


# --- watches ----------------------------------------------------------------------------


class _Restart(Exception):
    """Reopen the watch stream at ``_next`` (set by the raiser)."""

    def __init__(self, reason: str, *, backoff: bool = True) -> None:
        super().__init__(reason)
        self.backoff = backoff


class _EtcdWatch:
    """One watch: a thread that keeps a Watch stream open and feeds the callback.

    ``_next`` is the first revision not yet delivered; every (re)connection asks etcd
    for events from there, which is what makes a broken stream lose nothing."""

    def __init__(
        self, store: EtcdStore, prefix: str, key: bytes, range_end: bytes, callback: Callable[[WatchEvent], None], start: int
    ) -> None:
        self.prefix = prefix
        self._store = store
        self._key, self._range_end = key, range_end
        self._callback = callback
        self._next = start
        self._stop = threading.Event()
        self._stream_done: threading.Event | None = None
        self._call: Any = None
        self._call_lock = threading.Lock()
        self._streaming = False
        self._failures = 0  # stream losses since the stream was last open
        self._endpoint_used: _Endpoint | None = None
        self._thread = threading.Thread(target=self._run, name=f"pdps-etcd-watch {prefix}", daemon=True)

    @property
    def revision(self) -> int:
        """The last revision delivered (or skipped as from before the watch)."""
        return self._next - 1

    @property
    def streaming(self) -> bool:
        """Whether the stream to etcd is open now (False while reconnecting)."""
        return self._streaming

    def start(self) -> None:
        self._thread.start()

    def cancel(self) -> None:
        """Stop delivery: no callback starts after this returns (one already running finishes)."""
        self._stop.set()
        with self._call_lock:
            call, done = self._call, self._stream_done
        if done is not None:
            done.set()
        if call is not None:
            call.cancel()
        self._store._forget(self)

    def join(self, timeout: float) -> None:
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        first, longest = self._store._watch_backoff
        reconnects = Retry(Backoff(first=first, longest=longest), stop=self._stop)
        while not self._stop.is_set():
            try:
                self._stream()
                reason, backoff = "the server ended the stream", True
            except _Restart as r:
                reason, backoff = str(r), r.backoff
            except grpc.RpcError as exc:
                code, details = _status(exc)
                reason, backoff = f"{code.name}: {details}", True
                if code in _TRANSIENT_CODES and self._endpoint_used is not None:
                    self._store._next_endpoint(self._endpoint_used)
            except StoreError as exc:  # e.g. a failed re-authentication
                reason, backoff = str(exc), True
            except Exception as exc:  # never let the thread die: the roles rely on delivery
                log.exception("watch on %r at %s failed unexpectedly", self.prefix, self._store.url)
                reason, backoff = repr(exc), True
            was_streaming, self._streaming = self._streaming, False
            if self._stop.is_set() or self._store._closed:
                return
            if was_streaming:
                reconnects.succeeded()
            self._failures += 1
            level = logging.WARNING if self._failures == 1 else logging.DEBUG
            log.log(
                level,
                "watch on %r at %s lost its stream (%s); resuming from revision %d",
                self.prefix,
                self._store.url,
                reason,
                self._next,
            )
            if backoff and not reconnects.failed():
                return

    def _stream(self) -> None:
        store = self._store
        self._endpoint_used = ep = store._endpoint()
        try:
            metadata = store._metadata(ep, time.monotonic() + store.timeout)
        except grpc.RpcError as exc:
            raise StoreError(f"cannot authenticate to {store.url}: {_status(exc)[1]}") from exc
        create = etcdrpc.WatchCreateRequest(key=self._key, range_end=self._range_end, start_revision=self._next)
        done = threading.Event()

        def requests() -> Iterator[Any]:
            yield etcdrpc.WatchRequest(create_request=create)
            done.wait()  # keep our half open until this stream is over

        with self._call_lock:
            if self._stop.is_set():
                return
            self._stream_done = done
            self._call = call = ep.watch.Watch(requests(), metadata=metadata)
        try:
            for resp in call:
                self._handle(resp)
                if self._stop.is_set():
                    return
        finally:
            done.set()
            call.cancel()

    def _handle(self, resp: Any) -> None:
        if resp.compact_revision:
            log.warning(
                "watch on %r at %s: revisions %d..%d were compacted before they could be delivered; "
                "their events are lost, resuming from revision %d",
                self.prefix, self._store.url, self._next, resp.compact_revision - 1, resp.compact_revision,
            )  # fmt: skip
            self._next = max(self._next, resp.compact_revision)
            raise _Restart("history compacted", backoff=False)
        if resp.canceled:
            if _is_auth_error(grpc.StatusCode.UNKNOWN, resp.cancel_reason) or "permission denied" in resp.cancel_reason:
                self._store._drop_token()  # the token died with a server restart: log in again
            raise _Restart(f"etcd cancelled the watch: {resp.cancel_reason or 'no reason given'}")
        if resp.created:
            level = logging.INFO if self._failures else logging.DEBUG
            log.log(level, "watch on %r at %s streaming from revision %d", self.prefix, self._store.url, self._next)
            self._streaming, self._failures = True, 0
        if not resp.events:
            return
        floor = self._next  # events below it were delivered on an earlier stream
        for ev in resp.events:
            if self._stop.is_set():
                return
            revision = int(ev.kv.mod_revision)
            if revision < floor:
                continue
            try:
                event = WatchEvent(
                    EventType.DELETE if ev.type == _DELETE else EventType.PUT,
                    _decode_key(ev.kv.key),
                    None if ev.type == _DELETE else ev.kv.value,
                    revision,
                )
                self._callback(event)
            except Exception:  # a broken callback must not stop delivery
                log.exception("watch callback for prefix %r failed on %r", self.prefix, ev.kv.key)
        # A revision's events always arrive in one response, so this is a clean resume point.
        self._next = max(floor, max(int(ev.kv.mod_revision) for ev in resp.events) + 1)
