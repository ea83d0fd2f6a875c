"""The Redis adapter: the store contract on a real redis-server, plus what only Redis has
(URLs, auth, TLS, outages, expiry notifications)."""

from __future__ import annotations

import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path

import pytest
import redis

from pdps.adapters.redis_store import RedisStore, open_redis_store, parse_redis_url
from pdps.core.errors import ConfigError, StoreError, StoreUnavailable
from pdps.ports.coordination import Compare, EventType, Op, Put
from pdps.registry import open_store
from tests.servers import HOST, RedisServer, free_port
from tests.unit.contract_store import StoreContract, wait_until

pytestmark = pytest.mark.integration


class TestRedisStore(StoreContract):
    @pytest.fixture
    def store(self, redis_store):
        return redis_store

    @pytest.fixture
    def advance(self):
        return time.sleep


# --- servers of our own ---------------------------------------------------------------


class AuthRedisServer(RedisServer):
    """A password-protected Redis: ``-NOAUTH`` to a bare PING means it is up."""

    def ready(self) -> bool:
        try:
            with socket.create_connection((HOST, self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False


class TlsRedisServer(RedisServer):
    """Redis speaking only TLS on ``port`` (its plain listener is off)."""

    def __init__(self, certs: Path) -> None:
        super().__init__()
        self.certs = certs

    @property
    def url(self) -> str:
        return f"rediss://{HOST}:{self.port}/0?ca={self.certs / 'ca.crt'}"

    def argv(self) -> list[str]:
        return [
            *super().argv(),
            "--port", "0",
            "--tls-port", str(self.port),
            "--tls-cert-file", str(self.certs / "server.crt"),
            "--tls-key-file", str(self.certs / "server.key"),
            "--tls-ca-cert-file", str(self.certs / "ca.crt"),
            "--tls-auth-clients", "no",
        ]  # fmt: skip

    def ready(self) -> bool:
        ctx = ssl.create_default_context(cafile=str(self.certs / "ca.crt"))
        try:
            with socket.create_connection((HOST, self.port), timeout=1) as raw, ctx.wrap_socket(raw, server_hostname=HOST) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False


def make_certs(d: Path) -> Path:
    """A throwaway CA and a server certificate for 127.0.0.1 it signed."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=pdps test CA")
    openssl("req", "-new", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", f"/CN={HOST}")
    (d / "san.ext").write_text(f"subjectAltName=IP:{HOST}\n")
    openssl(
        "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.crt", "-days", "2", "-extfile", "san.ext",
    )  # fmt: skip
    return d


@pytest.fixture(scope="module")
def auth_server():
    server = AuthRedisServer(extra_args=("--requirepass", "s3cret")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    server = TlsRedisServer(make_certs(tmp_path_factory.mktemp("certs"))).start()
    yield server
    server.stop()


@pytest.fixture
def own_server():
    server = RedisServer().start()
    yield server
    server.stop()


# --- URLs -----------------------------------------------------------------------------


def test_url_defaults():
    t = parse_redis_url("redis://example.org")
    assert (t.host, t.port, t.db, t.username, t.password, t.timeout, t.tls) == ("example.org", 6379, 0, None, None, 5.0, False)
    store = open_store("redis://example.org:7000/2")  # connects on first use only
    assert isinstance(store, RedisStore) and (store.target.port, store.target.db) == (7000, 2)
    store.close()


def test_url_with_everything_and_the_password_masked(tmp_path):
    for name in ("ca.pem", "c.pem", "k.pem"):
        (tmp_path / name).write_text("x")
    url = f"rediss://ann:p%40ss@10.0.0.5:6380/3?timeout=1.5&ca={tmp_path}/ca.pem&cert={tmp_path}/c.pem&key={tmp_path}/k.pem"
    t = parse_redis_url(url)
    assert (t.host, t.port, t.db, t.username, t.password, t.timeout, t.tls) == ("10.0.0.5", 6380, 3, "ann", "p@ss", 1.5, True)
    assert (t.ca, t.cert, t.key) == (f"{tmp_path}/ca.pem", f"{tmp_path}/c.pem", f"{tmp_path}/k.pem")
    assert "p%40ss" not in t.url and "ann:***@10.0.0.5:6380/3" in t.url
    assert "p@ss" not in repr(t)
    assert parse_redis_url("redis://:s3cret@h/0").url == "redis://:***@h/0"


@pytest.mark.parametrize(
    "url, words",
    [
        ("redis://h/x", "database number"),
        ("redis://h:99999/0", "port"),
        ("redis:///0", "no host"),
        ("redis://h/0?timeout=0", "timeout"),
        ("redis://h/0?timeout=soon", "timeout"),
        ("redis://h/0?ca=/etc/hostname", "rediss://"),
        ("redis://h/0?tls=1", "unknown option"),
        ("rediss://h/0?ca=/no/such/ca.pem", "no readable file"),
        ("http://h/0", "redis://"),
    ],
)
def test_bad_urls_are_config_errors(url, words):
    with pytest.raises(ConfigError, match=words):
        parse_redis_url(url)


# --- failures -------------------------------------------------------------------------


def test_unreachable_server_raises_store_unavailable_naming_the_url_quickly():
    port = free_port()  # nothing listens there
    store = open_redis_store(f"redis://bob:hunter2@{HOST}:{port}/0")
    start = time.monotonic()
    with pytest.raises(StoreUnavailable) as info:
        store.get("/a")
    assert time.monotonic() - start < 2
    assert f"redis://bob:***@{HOST}:{port}/0" in str(info.value) and "hunter2" not in str(info.value)
    assert not isinstance(info.value.__cause__, StoreError)  # the redis error is chained, not leaked
    store.close()


def test_a_server_that_never_answers_times_out():
    with socket.socket() as silent:  # accepts connections (backlog) but never replies
        silent.bind((HOST, 0))
        silent.listen(8)
        store = open_redis_store(f"redis://{HOST}:{silent.getsockname()[1]}/0?timeout=0.5")
        start = time.monotonic()
        with pytest.raises(StoreUnavailable):
            store.put("/a", b"1")
        assert time.monotonic() - start < 3
        store.close()


def test_bad_keys_and_values_are_refused_before_anything_is_sent():
    store = open_redis_store(f"redis://{HOST}:{free_port()}/0")  # unreachable: sending would raise StoreUnavailable
    for call in (
        lambda: store.put("/a", "text"),  # type: ignore[arg-type]
        lambda: store.put(b"/a", b"1"),  # type: ignore[arg-type]
        lambda: store.get(1),  # type: ignore[arg-type]
        lambda: store.put("/\ud800", b"1"),
        lambda: store.put("/a", b"1", lease="7"),  # type: ignore[arg-type]
        lambda: store.commit((Compare.value("/a", Op.EQ, "x"),), ()),  # type: ignore[arg-type]
        lambda: store.commit((Compare.revision("/a", Op.EQ, b"1"),), ()),  # type: ignore[arg-type]
        lambda: store.commit((), ("put /a",)),  # type: ignore[arg-type]
        lambda: store.grant_lease(0),
        lambda: store.grant_lease(float("inf")),
    ):
        with pytest.raises(StoreError) as info:
            call()
        assert not isinstance(info.value, StoreUnavailable)
    store.close()


def test_close_stops_the_watch_threads_and_refuses_work(redis_store):
    before = set(threading.enumerate())
    redis_store.watch("/w/", lambda e: None)
    started = set(threading.enumerate()) - before
    assert {t.name for t in started} == {"pdps-redis-watch", "pdps-redis-watch-reader"}
    redis_store.close()
    assert not [t for t in started if t.is_alive()]
    with pytest.raises(StoreError, match="closed"):
        redis_store.get("/a")
    with pytest.raises(StoreError, match="closed"):
        redis_store.watch("/w/", lambda e: None)
    redis_store.close()  # twice is fine


def test_script_errors_become_store_errors(redis_server, redis_store):
    redis.Redis(host=HOST, port=redis_server.port).set("pdps:revision", "not a number")
    with pytest.raises(StoreError, match="failed txn") as info:
        redis_store.put("/a", b"1")
    assert isinstance(info.value.__cause__, redis.ResponseError)


# --- auth and TLS ---------------------------------------------------------------------


def test_password_auth(auth_server):
    good = open_store(f"redis://:s3cret@{HOST}:{auth_server.port}/0")
    good.put("/a", b"1")
    assert good.get("/a").value == b"1"
    good.close()
    for url, words in (
        (f"redis://:wrong@{HOST}:{auth_server.port}/0", "refused the credentials"),
        (f"redis://{HOST}:{auth_server.port}/0", "requires authentication.*PASSWORD@"),
    ):
        store = open_store(url)
        with pytest.raises(StoreError, match=words) as info:
            store.get("/a")
        assert not isinstance(info.value, StoreUnavailable) and "wrong" not in str(info.value)
        store.close()


def test_tls(tls_server):
    store = open_store(tls_server.url)
    events = []
    store.watch("/t/", events.append)
    store.put("/t/a", b"over tls")
    assert store.get("/t/a").value == b"over tls"
    assert wait_until(lambda: [e.value for e in events] == [b"over tls"])
    store.close()


def test_tls_server_refuses_plain_and_unverified_clients(tls_server):
    plain = open_store(f"redis://{HOST}:{tls_server.port}/0?timeout=2")
    with pytest.raises(StoreError):
        plain.get("/a")
    plain.close()
    untrusted = open_store(f"rediss://{HOST}:{tls_server.port}/0?timeout=2")  # system CAs do not know ours
    with pytest.raises(StoreError, match="certificate verification") as info:
        untrusted.get("/a")
    assert not isinstance(info.value, StoreUnavailable)
    untrusted.close()


# --- watches --------------------------------------------------------------------------


def test_expiry_delete_event_shares_the_last_writes_revision(redis_store):
    events = []
    redis_store.watch("/e/", events.append)
    lease = redis_store.grant_lease(0.5)
    redis_store.put("/e/leased", b"1", lease=lease)
    rev = redis_store.put("/e/last", b"2")
    # no get(): Redis's own expiry cycle must notice and notify
    assert wait_until(lambda: len(events) == 3, timeout=3)
    assert [(e.type, e.key, e.revision) for e in events[1:]] == [(EventType.PUT, "/e/last", rev), (EventType.DELETE, "/e/leased", rev)]
    assert redis_store.lease_ttl_left(lease) is None


def test_watch_events_carry_binary_values_and_unicode_keys(redis_store):
    events = []
    redis_store.watch("/ü/", events.append)
    blob = b"P1\n3\n/x" + bytes(range(256))  # looks like our own framing, and every byte value
    redis_store.commit((), (Put("/ü/\n\x00k", blob), Put("/ü/empty", b"")))
    assert wait_until(lambda: len(events) == 2)
    assert [(e.key, e.value) for e in events] == [("/ü/\n\x00k", blob), ("/ü/empty", b"")]
    assert events[0].revision == events[1].revision


def test_a_broken_callback_does_not_stop_the_others(redis_store):
    def broken(event):
        raise RuntimeError("boom")

    events = []
    redis_store.watch("/b/", broken)
    redis_store.watch("/b/", events.append)
    redis_store.put("/b/1", b"1")
    redis_store.put("/b/2", b"2")
    assert wait_until(lambda: [e.key for e in events] == ["/b/1", "/b/2"])


def test_watch_survives_a_server_restart(own_server, caplog):
    store = open_store(own_server.url + "?timeout=1")
    events = []
    store.watch("/r/", events.append)
    store.put("/r/before", b"1")
    assert wait_until(lambda: len(events) == 1)
    own_server.kill()
    with pytest.raises(StoreUnavailable):
        store.put("/r/during", b"x")
    own_server.start()  # same port, empty (no persistence): revisions start again
    # pub/sub is at-most-once: keep writing until the resubscribed watch hears one
    deadline, n = time.monotonic() + 10, 0
    while time.monotonic() < deadline and not any(e.key.startswith("/r/after") for e in events):
        store.put(f"/r/after-{n}", b"2")
        n += 1
        time.sleep(0.05)
    after = [e for e in events if e.key.startswith("/r/after")]
    assert after and after[0].type is EventType.PUT and after[0].value == b"2"
    assert "/r/during" not in [e.key for e in events]
    assert any("lost" in r.getMessage() and "at-most-once" in r.getMessage() for r in caplog.records)
    store.close()


def test_watch_refuses_a_server_without_expiry_notifications():
    with RedisServer(extra_args=("--notify-keyspace-events", "")) as server:
        store = open_store(server.url)
        with pytest.raises(StoreError, match="notify-keyspace-events"):
            store.watch("/", lambda e: None)
        store.close()


# --- compares -------------------------------------------------------------------------


def test_value_compares_are_bytewise_like_python(redis_store):
    redis_store.put("/v", b"\x80abc")
    for op, operand in [(Op.GT, b"zzz"), (Op.GT, b"\x80ab"), (Op.LT, b"\x80abd"), (Op.LT, b"\x81"), (Op.NE, b"\x80abc"), (Op.EQ, b"\x80abc")]:
        expected = Compare.value("/v", op, operand).holds(redis_store.get("/v"))
        assert redis_store.commit((Compare.value("/v", op, operand),), ()).succeeded is expected, (op, operand)
    assert not redis_store.commit((Compare.value("/missing", Op.NE, b"x"),), ()).succeeded


def test_revision_compares_and_empty_transactions(redis_store):
    rev = redis_store.put("/r", b"1")
    assert redis_store.commit((Compare.revision("/r", Op.LT, rev + 1), Compare.revision("/r", Op.GT, 0)), ()).revision == rev
    assert not redis_store.commit((Compare.revision("/r", Op.NE, rev),), ()).succeeded
    assert redis_store.commit((Compare.revision("/nothing", Op.LT, 1),), ()).succeeded


def test_range_skips_and_cleans_expired_keys(redis_server, redis_store):
    lease = redis_store.grant_lease(0.2)
    redis_store.put("/x/leased", b"1", lease=lease)
    redis_store.put("/x/kept", b"1")
    time.sleep(0.4)
    assert [kv.key for kv in redis_store.range("/x/")] == ["/x/kept"]
    assert redis.Redis(host=HOST, port=redis_server.port).zrange("pdps:index", 0, -1) == [b"/x/kept"]
