"""The sockets of the ``grpc://`` transport's bulk channel: tensor bytes beside gRPC.

This module owns the bulk channel's connections: the hello and its token check, the
message prefix, moving bytes (``sendmsg`` of the tensors' own memory out,
``recv_into`` the receive buffer in, nothing joined or copied on the way), the
server's listener with a thread per connection, and the client's pool of idle
connections. What a header says, the checks on a request, running the handler and
the mapping of errors belong to ``grpc_transport``, which serves calls from gRPC
streams and from bulk connections alike. docs/transport.md describes the wire:

    hello     client: MAGIC, VERSION (1 byte), token length (2 bytes), token
              server: one status byte, HELLO_OK or a refusal after which it closes
    message   kind (1 byte), length (4 bytes), a header frame of that length; the
              header of a REQUEST or a REPLY is followed by the tensor bytes it declares

Integers are big-endian. A connection carries one call at a time.
"""

from __future__ import annotations

import hmac
import logging
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Sequence

from pdps.adapters.refusals import RefusalLog

log = logging.getLogger(__name__)

MAGIC = b"PDPSBULK"
VERSION = 1
HELLO_OK, HELLO_NOT_BULK, HELLO_BAD_TOKEN, HELLO_BUSY = 0, 1, 2, 3
_HELLO_REFUSALS = {
    HELLO_NOT_BULK: "not the pdps bulk protocol, or another version",
    HELLO_BAD_TOKEN: "missing or wrong token",
    HELLO_BUSY: "too many connections",
}

#: Message kinds. A server answers a REQUEST with ACCEPTED (the request was whole and
#: valid; the handler runs now) then REPLY or ERROR, or with ERROR alone (refused).
REQUEST, ACCEPTED, REPLY, ERROR = 1, 2, 3, 4

_HELLO = struct.Struct("!8sBH")
_PREFIX = struct.Struct("!BI")
#: Seconds a socket's armed timeout may run past an operation's deadline rather than be armed again.
_REARM_SLACK = 0.001

#: SO_SNDBUF and SO_RCVBUF of every bulk socket: what net.core.[rw]mem_max allows on
#: the development machine, and what the raw TCP baseline of bench/transport.py uses.
SOCKET_BUFFER_BYTES = 4 << 20
#: Most connections one server serves at once (a thread each; the transport's
#: ``max_connections`` may lower it); more are refused (with HELLO_BUSY when plaintext)
#: and their calls go over gRPC.
MAX_CONNECTIONS = 64
#: Idle connections a client keeps per channel.
POOLED_CONNECTIONS = 8
#: Seconds a new connection gets for its TLS handshake and hello (the default of the
#: transport's ``handshake_timeout``, which bounds gRPC's handshake too).
HELLO_TIMEOUT = 10.0
#: Seconds a peer may stall in the middle of a message before the server gives up on it.
STALL_TIMEOUT = 60.0
#: Seconds a server keeps an idle connection open; a client reuses one only for half
#: that (the default of the transport's ``idle_timeout``, for gRPC connections too).
SERVER_IDLE = 120.0
#: Seconds a client waits for a bulk port to accept a connection (never past a call's deadline).
CONNECT_TIMEOUT = 3.0
#: Buffers one sendmsg takes (Linux allows 1024).
_IOV_MAX = 512
#: Bytes per write on a TLS socket, so that a stall is noticed within STALL_TIMEOUT.
_TLS_WRITE = 1 << 20


class PeerClosed(ConnectionError):
    """The other side closed the connection."""


class Unreachable(ConnectionError):
    """No bulk connection could be set up: nothing listens, or TLS failed."""


class HelloRefused(ConnectionError):
    """The server answered the hello with a refusal (``status``)."""

    def __init__(self, status: int) -> None:
        super().__init__(f"bulk hello refused: {_HELLO_REFUSALS.get(status, f'status {status}')}")
        self.status = status


def hello(token: str | None) -> bytes:
    secret = (token or "").encode()
    return _HELLO.pack(MAGIC, VERSION, len(secret)) + secret


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


class Connection:
    """One bulk socket, plain or TLS: whole messages out and in.

    Every operation takes ``deadline`` (a ``time.monotonic()`` instant, None for
    none) and ``stall`` (seconds without progress allowed, None for no limit); past
    either it raises ``TimeoutError`` and the connection must be closed.
    """

    def __init__(self, sock: socket.socket, peer: str, port: int = 0) -> None:
        self.sock = sock
        self.peer = peer
        self.port = port  # the server's bulk port (client side)
        self.busy = False  # in the middle of a call (server side)
        self.idle_since = time.monotonic()

    def start_tls(self, context: ssl.SSLContext, *, server_side: bool, hostname: str | None = None) -> None:
        """Replace the plain socket by a TLS one; the handshake runs within the socket's timeout."""
        self.sock = context.wrap_socket(self.sock, server_side=server_side, server_hostname=hostname)

    def _arm(self, deadline: float | None, stall: float | None) -> None:
        limit = stall
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("deadline passed")
            limit = left if limit is None else min(limit, left)
        # settimeout is a system call (FIONBIO) each time: a read of many chunks under the
        # same stall keeps the one armed, and a deadline's up to _REARM_SLACK s longer
        armed = self.sock.gettimeout()
        if armed == limit or (armed is not None and limit is not None and limit <= armed <= limit + _REARM_SLACK):
            return
        self.sock.settimeout(limit)

    def send(self, kind: int, header: bytes, views: Sequence[memoryview] = (), *, deadline: float | None = None, stall: float | None = None) -> None:
        """One message: the prefix and ``header``, then ``views`` as they are."""
        buffers = [memoryview(_PREFIX.pack(kind, len(header)) + header), *(v for v in views if len(v))]
        if not isinstance(self.sock, ssl.SSLSocket):
            self._sendmsg(buffers, deadline, stall)
            return
        for buf in buffers:  # ssl sockets have no sendmsg; each write is encrypted anyway
            for at in range(0, len(buf), _TLS_WRITE):
                self._arm(deadline, stall)
                self.sock.sendall(buf[at : at + _TLS_WRITE])

    def _sendmsg(self, buffers: list[memoryview], deadline: float | None, stall: float | None) -> None:
        i = 0
        while i < len(buffers):
            self._arm(deadline, stall)
            sent = self.sock.sendmsg(buffers[i : i + _IOV_MAX])
            while sent and i < len(buffers):
                n = len(buffers[i])
                if sent >= n:
                    sent -= n
                    i += 1
                else:
                    buffers[i] = buffers[i][sent:]
                    sent = 0

    def send_raw(self, data: bytes, *, deadline: float | None = None, stall: float | None = None) -> None:
        self._arm(deadline, stall)
        self.sock.sendall(data)

    def read_into(self, view: memoryview, *, deadline: float | None = None, stall: float | None = None, eof_ok: bool = False) -> bool:
        """Fill ``view``; False on a clean end of stream before its first byte when ``eof_ok``."""
        got, n = 0, len(view)
        while got < n:
            self._arm(deadline, stall)
            k = self.sock.recv_into(view[got:], n - got)
            if k == 0:
                if eof_ok and got == 0:
                    return False
                raise PeerClosed(f"{self.peer} closed the connection after {got} of {n} bytes")
            got += k
        return True

    def read_bytes(self, n: int, *, deadline: float | None = None, stall: float | None = None) -> bytearray:
        buf = bytearray(n)
        self.read_into(memoryview(buf), deadline=deadline, stall=stall)
        return buf

    def read_prefix(self, *, deadline: float | None = None, stall: float | None = None, eof_ok: bool = False) -> tuple[int, int] | None:
        """(kind, length) of the next message; None on a clean end of stream when ``eof_ok``."""
        buf = bytearray(_PREFIX.size)
        if not self.read_into(memoryview(buf), deadline=deadline, stall=stall, eof_ok=eof_ok):
            return None
        kind, length = _PREFIX.unpack(buf)
        return kind, length

    def shutdown(self) -> None:
        """Wake whoever reads or writes this connection (from another thread)."""
        try:
            # The plain socket's method, also on an SSLSocket: its own shutdown() drops
            # the SSL object under a thread that may still be using it.
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


# ----------------------------------------------------------------------------------
# Client.


def connect(host: str, port: int, *, token: str | None, tls: ssl.SSLContext | None, deadline: float | None) -> Connection:
    """A connection to the bulk port ``host:port`` that passed the hello.

    Raises Unreachable (no connection, or TLS refused), HelloRefused, TimeoutError, or
    another OSError.
    """
    limit = CONNECT_TIMEOUT if deadline is None else min(CONNECT_TIMEOUT, deadline - time.monotonic())
    if limit <= 0:
        raise TimeoutError("deadline passed")
    conn = Connection(_dial(host, port, limit), f"{host}:{port}", port)
    try:
        if tls is not None:
            try:
                conn.start_tls(tls, server_side=False, hostname=host)  # checks the certificate names host
            except ssl.SSLError as exc:
                raise Unreachable(f"TLS with {host}:{port} failed: {exc}") from exc
        conn.send_raw(hello(token), deadline=time.monotonic() + limit)
        status = conn.read_bytes(1, deadline=time.monotonic() + limit)[0]
    except BaseException:
        conn.close()
        raise
    if status != HELLO_OK:
        conn.close()
        raise HelloRefused(status)
    return conn


def _dial(host: str, port: int, timeout: float) -> socket.socket:
    """A TCP connection with the bulk socket options set before connecting."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise Unreachable(f"cannot resolve {host}: {exc}") from exc
    error: OSError | None = None
    for family, kind, proto, _, address in infos:
        sock = socket.socket(family, kind, proto)
        try:
            _tune(sock)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(timeout)
            sock.connect(address)
            return sock
        except OSError as exc:
            sock.close()
            error = exc
    raise Unreachable(f"cannot connect to {host}:{port}: {error}") from error


class Pool:
    """A channel's idle connections, most recently used first; thread-safe. A connection
    is reused for half of ``server_idle``, the seconds servers keep one open."""

    def __init__(self, server_idle: float = SERVER_IDLE) -> None:
        self._reuse_for = server_idle / 2
        self._idle: list[Connection] = []
        self._lock = threading.Lock()
        self._closed = False

    def take(self, port: int) -> Connection | None:
        """An idle connection to ``port`` used recently enough, if there is one."""
        stale = []
        with self._lock:
            found = None
            while self._idle and found is None:
                conn = self._idle.pop()
                if conn.port == port and time.monotonic() - conn.idle_since < self._reuse_for:
                    found = conn
                else:
                    stale.append(conn)
        for conn in stale:
            conn.close()
        return found

    def give(self, conn: Connection) -> None:
        """Keep ``conn`` for the next call (it finished one cleanly)."""
        conn.idle_since = time.monotonic()
        with self._lock:
            if not self._closed and len(self._idle) < POOLED_CONNECTIONS:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


# ----------------------------------------------------------------------------------
# Server.

#: serve(connection, kind, length): one call whose message prefix has been read; the
#: connection stays open for the next call when it returns True.
Serve = Callable[[Connection, int, int], bool]


class Listener:
    """Accepts bulk connections on ``port`` of ``host`` (0: a free one), checks each
    one's TLS and hello, and passes each call to ``serve`` on the connection's own thread.

    A connection has ``handshake_timeout`` seconds for its TLS handshake and hello, and
    is closed after ``idle_timeout`` seconds without a call; at most ``max_connections``
    (never more than MAX_CONNECTIONS) are served at once. Refusals go to ``refusals``.
    """

    def __init__(
        self,
        host: str,
        *,
        token: str | None,
        tls: ssl.SSLContext | None,
        serve: Serve,
        name: str,
        refusals: RefusalLog,
        port: int = 0,
        handshake_timeout: float = HELLO_TIMEOUT,
        idle_timeout: float = SERVER_IDLE,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self._sock = _listen(host, port)
        self.port: int = self._sock.getsockname()[1]
        self._token = token.encode() if token is not None else None
        self._tls = tls
        self._serve = serve
        self._name = name
        self._refusals = refusals
        self._handshake_timeout = handshake_timeout
        self._idle_timeout = idle_timeout
        self._max_connections = min(max_connections, MAX_CONNECTIONS)
        self._lock = threading.Condition()
        self._conns: set[Connection] = set()
        self._closing = False
        self._acceptor = threading.Thread(target=self._accept, name="pdps-bulk-accept", daemon=True)
        self._acceptor.start()

    def close(self, grace: float) -> None:
        """Stop accepting, close idle connections, give busy ones ``grace`` seconds."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            idle = [c for c in self._conns if not c.busy]
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes accept() (Linux)
        except OSError:
            pass
        self._sock.close()
        for conn in idle:
            conn.shutdown()
        until = time.monotonic() + grace
        with self._lock:
            while any(c.busy for c in self._conns) and (left := until - time.monotonic()) > 0:
                self._lock.wait(left)
            rest = list(self._conns)
        for conn in rest:
            conn.shutdown()
        self._acceptor.join(5.0)

    def _accept(self) -> None:
        while True:
            try:
                sock, address = self._sock.accept()
            except OSError:
                return  # closed
            peer = "%s:%s" % address[:2]
            conn = Connection(sock, peer)
            with self._lock:
                if self._closing:
                    conn.close()
                    return
                full = len(self._conns) >= self._max_connections
                if not full:
                    self._conns.add(conn)
            if full:
                # Refused without a thread (so without TLS: the client sees the connection
                # close during its handshake); either way its call goes over gRPC.
                self._refusals.refused("refused a bulk connection", peer, f"already {self._max_connections} connections")
                if self._tls is None:
                    try:
                        sock.setblocking(False)
                        sock.send(bytes([HELLO_BUSY]))
                    except OSError:
                        pass
                conn.close()
                continue
            threading.Thread(target=self._run, args=(conn,), name="pdps-bulk", daemon=True).start()

    def _handshake(self, conn: Connection) -> bool:
        """TLS (when configured) for a new connection; False when it failed."""
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._tls is None:
            return True
        conn.sock.settimeout(self._handshake_timeout)
        try:
            conn.start_tls(self._tls, server_side=True)
        except (ssl.SSLError, OSError) as exc:
            self._refusals.refused("refused a bulk connection", conn.peer, f"TLS handshake failed: {exc}")
            return False
        return True

    def _hello(self, conn: Connection) -> bool:
        """Read and check the hello; answer it. False: refused (and answered)."""
        deadline = time.monotonic() + self._handshake_timeout
        magic, version, size = _HELLO.unpack(conn.read_bytes(_HELLO.size, deadline=deadline))
        if magic != MAGIC or version != VERSION:
            self._refusals.refused("refused a bulk connection", conn.peer, f"not a pdps bulk hello (version {version})")
            conn.send_raw(bytes([HELLO_NOT_BULK]), deadline=deadline)
            return False
        sent = bytes(conn.read_bytes(size, deadline=deadline))
        if self._token is not None and not hmac.compare_digest(sent, self._token):
            self._refusals.refused("refused a bulk connection", conn.peer, f"{'wrong' if sent else 'no'} token")
            conn.send_raw(bytes([HELLO_BAD_TOKEN]), deadline=deadline)
            return False
        conn.send_raw(bytes([HELLO_OK]), deadline=deadline)
        return True

    def _run(self, conn: Connection) -> None:
        try:
            if not (self._handshake(conn) and self._hello(conn)):
                return
            while True:
                with self._lock:
                    conn.busy = False
                    self._lock.notify_all()
                    if self._closing:
                        return
                prefix = conn.read_prefix(stall=self._idle_timeout, eof_ok=True)
                if prefix is None:
                    return
                with self._lock:
                    if self._closing:
                        return  # not accepted: the client may send it again elsewhere
                    conn.busy = True
                if not self._serve(conn, *prefix):
                    return
        except OSError as exc:  # the peer went away, stalled, or broke TLS
            log.debug("bulk connection from %s at %s ended: %s", conn.peer, self._name, exc)
        except Exception:
            log.exception("bulk connection from %s at %s failed", conn.peer, self._name)
        finally:
            with self._lock:
                self._conns.discard(conn)
                conn.busy = False
                self._lock.notify_all()
            conn.close()


def _listen(host: str, port: int = 0) -> socket.socket:
    """A listening socket on ``port`` of ``host`` (0: a free one; a wildcard host listens
    on all addresses)."""
    if host in ("", "0.0.0.0"):
        infos = [(socket.AF_INET, ("0.0.0.0", port))]
    elif host == "::":
        infos = [(socket.AF_INET6, ("::", port))]
    else:
        try:
            infos = [(info[0], info[4]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)]
        except OSError as exc:
            raise Unreachable(f"cannot resolve {host}: {exc}") from exc
    family, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if family == socket.AF_INET6 and host == "::" and socket.has_dualstack_ipv6():
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        _tune(sock)  # before listen(): accepted sockets inherit it, and the window scale follows
        sock.bind(address)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock
