"""The etcd adapter against real etcd servers: the store contract, URLs, outages, TLS, auth.

Outage, TLS and auth tests start an etcd of their own (a fraction of a second each);
the contract runs on the session's server.
"""

from __future__ import annotations

import logging
import socket
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from pyetcd import etcdrpc

from pdps.adapters.etcd_store import DEFAULT_TIMEOUT, EtcdStore, parse_etcd_url
from pdps.core.errors import ConfigError, LeaseExpired, StoreError, StoreUnavailable
from pdps.ports.coordination import Compare, CoordinationStore, EventType, Put
from pdps.registry import open_store
from tests.servers import HOST, EtcdServer, free_port
from tests.unit.contract_store import StoreContract, wait_until

pytestmark = pytest.mark.integration


class TestEtcdStore(StoreContract):
    @pytest.fixture
    def store(self, etcd_store):
        return etcd_store

    @pytest.fixture
    def advance(self):
        return time.sleep  # leases expire on the server's clock


@pytest.fixture
def own_etcd():
    """An etcd of the test's own, for tests that kill it or reconfigure it."""
    server = EtcdServer().start()
    yield server
    server.stop()


# --- URLs -------------------------------------------------------------------------------


def test_url_with_credentials_tls_files_endpoints_and_timeout():
    opts = parse_etcd_url(
        "etcds://ann:p%40ss%3Aw@10.0.0.1:2379,etcd-b:2380,[::1]:2381?ca=/c/ca.pem&cert=/c/me.pem&key=/c/me.key&timeout=1.5"
    )
    assert opts.tls and opts.user == "ann" and opts.password == "p@ss:w"
    assert opts.endpoints == (("10.0.0.1", 2379), ("etcd-b", 2380), ("::1", 2381))
    assert (opts.ca, opts.cert, opts.key, opts.timeout) == ("/c/ca.pem", "/c/me.pem", "/c/me.key", 1.5)
    assert "p@ss" not in opts.redacted_url() and "ann:***@" in opts.redacted_url()


def test_url_defaults():
    opts = parse_etcd_url("etcd://db")
    assert opts.endpoints == (("db", 2379),)
    assert not opts.tls and opts.user is None and opts.password is None and opts.ca is None
    assert opts.timeout == DEFAULT_TIMEOUT
    assert opts.redacted_url() == "etcd://db:2379"


@pytest.mark.parametrize(
    "url",
    [
        "redis://h:1",
        "etcd://",
        "etcd://h:notaport",
        "etcd://h:70000",
        "etcd://h:1?timeout=0",
        "etcd://h:1?timeout=soon",
        "etcd://h:1?tls=yes",
        "etcd://:pw@h:1",
        "etcd://h:1?ca=/ca.pem",  # TLS files on a plaintext URL: almost surely meant etcds://
        "etcds://h:1?cert=/me.pem",  # a client certificate needs its key
    ],
)
def test_bad_urls_are_config_errors(url):
    with pytest.raises(ConfigError):
        EtcdStore(url)


def test_store_url_never_shows_the_password():
    store = open_store("etcd://ann:s3cret@127.0.0.1:1")
    assert isinstance(store, EtcdStore) and isinstance(store, CoordinationStore)
    assert "s3cret" not in store.url and "s3cret" not in repr(store)
    store.close()


def test_keyword_arguments_override_the_url(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_bytes(b"")  # read at construction, parsed by gRPC only when connecting
    store = EtcdStore("etcds://127.0.0.1:1", user="bob", password="pw", ca=str(ca), timeout=0.5)
    assert store.timeout == 0.5 and "bob:***@" in store.url and str(ca) in store.url
    store.close()
    with pytest.raises(ConfigError, match="TLS CA"):
        EtcdStore("etcds://127.0.0.1:1", ca=str(tmp_path / "missing.pem"))


# --- errors -----------------------------------------------------------------------------


def test_unreachable_server_raises_store_unavailable_naming_the_url_quickly():
    port = free_port()
    store = open_store(f"etcd://ann:s3cret@{HOST}:{port}")  # constructing contacts nothing
    calls = {
        "get": lambda: store.get("/a"),
        "range": lambda: store.range("/"),
        "put": lambda: store.put("/a", b"1"),
        "delete_prefix": lambda: store.delete_prefix("/"),
        "commit": lambda: store.commit((Compare.absent("/a"),), (Put("/a", b"1"),)),
        "grant_lease": lambda: store.grant_lease(5),
        "keep_alive": lambda: store.keep_alive(7),
        "revoke_lease": lambda: store.revoke_lease(7),
        "watch": lambda: store.watch("/", print),
        "acquire_lock": lambda: store.acquire_lock("/lock", 7, b"me"),
    }
    for name, call in calls.items():
        start = time.monotonic()
        with pytest.raises(StoreUnavailable) as info:
            call()
        assert time.monotonic() - start < 2.0, name
        message = str(info.value)
        assert f"{HOST}:{port}" in message and name.split("_")[0] in message, message
        assert "s3cret" not in message and isinstance(info.value.__cause__, grpc.RpcError)
    store.close()


def test_a_server_that_never_answers_times_out_instead_of_hanging():
    with socket.socket() as silent:  # accepts connections (backlog) but never speaks
        silent.bind((HOST, 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        store = open_store(f"etcd://{HOST}:{port}?timeout=0.5")
        start = time.monotonic()
        with pytest.raises(StoreUnavailable, match=f"{HOST}:{port}"):
            store.get("/a")
        assert 0.4 < time.monotonic() - start < 3.0
        store.close()


def test_bad_keys_and_values_are_refused_before_anything_is_sent():
    store = open_store(f"etcd://{HOST}:{free_port()}")  # nothing listens: sending would be StoreUnavailable
    bad = [
        lambda: store.put("/a", "text"),  # type: ignore[arg-type]
        lambda: store.put(b"/a", b"1"),  # type: ignore[arg-type]
        lambda: store.get(1),  # type: ignore[arg-type]
        lambda: store.commit((), (Put("/ok", b"1"), Put("/a", bytearray(b"1")))),  # type: ignore[arg-type]
        lambda: store.commit((Compare.value("/a", "==", "text"),), ()),  # type: ignore[arg-type]
        lambda: store.commit((Compare.revision("/a", "==", b"1"),), ()),  # type: ignore[arg-type]
        lambda: store.grant_lease(0),
    ]
    for call in bad:
        with pytest.raises(StoreError) as info:
            call()
        assert not isinstance(info.value, StoreUnavailable), info.value
    store.close()


def test_several_endpoints_fail_over_to_a_live_one(etcd_server):
    store = open_store(f"etcd://{HOST}:{free_port()},{HOST}:{etcd_server.port}")
    rev = store.put("/failover", b"1")  # the dead first endpoint is skipped within the call
    assert store.get("/failover").mod_revision == rev
    assert store.delete("/failover")
    store.close()


def test_closed_store_refuses_work_and_stops_its_watch_threads(etcd_server):
    store = open_store(etcd_server.url)
    w = store.watch("/closing/", print)
    assert wait_until(lambda: w.streaming)
    store.close()
    assert not w._thread.is_alive()
    with pytest.raises(StoreError, match="closed"):
        store.get("/a")
    with pytest.raises(StoreError, match="closed"):
        store.watch("/", print)
    store.close()  # idempotent


def test_a_broken_callback_does_not_stop_delivery(etcd_store):
    seen = []

    def flaky(event):
        seen.append(event.key)
        if event.key == "/cb/1":
            raise RuntimeError("callback bug")

    etcd_store.watch("/cb/", flaky)
    for i in range(3):
        etcd_store.put(f"/cb/{i}", b"x")
    assert wait_until(lambda: len(seen) == 3)
    assert seen == ["/cb/0", "/cb/1", "/cb/2"]


def test_a_transactions_events_share_its_revision_in_op_order(etcd_store):
    events = []
    etcd_store.watch("/batch/", events.append)
    res = etcd_store.commit((), (Put("/batch/b", b"2"), Put("/batch/a", b"1")))
    assert etcd_store.delete_prefix("/batch/") == 2
    assert wait_until(lambda: len(events) == 4)
    assert [(e.type, e.key, e.revision) for e in events[:2]] == [
        (EventType.PUT, "/batch/b", res.revision),
        (EventType.PUT, "/batch/a", res.revision),
    ]
    assert [e.key for e in events[2:]] == ["/batch/a", "/batch/b"]
    assert events[2].revision == events[3].revision > res.revision  # delete_prefix is one revision


def test_a_request_over_the_size_limit_names_its_keys_its_size_and_the_setting(etcd_store):
    """etcd refuses a request over --max-request-bytes (1.5 MiB by default) as "request is
    too large", and one over that plus gRPC's allowance of 512 KiB as a gRPC message
    too large: both name the keys, the size and the setting."""
    lease = etcd_store.grant_lease(30)
    fence = etcd_store.acquire_lock("/big/lock", lease, b"me")
    mib = b"x" * 2**20
    refused = [
        (lambda: etcd_store.put("/big/one", mib + mib[:600_000]), ["'/big/one'"], "1,6"),
        (lambda: etcd_store.commit((), [Put(f"/big/{i}", mib) for i in range(5)], fence=fence), ["'/big/0'", "'/big/2'", "and 2 more"], "5,24"),
    ]
    for call, names, size in refused:
        with pytest.raises(StoreError) as info:
            call()
        message = str(info.value)
        assert all(name in message for name in names) and "'/big/3'" not in message, message
        assert f"{size}" in message and "--max-request-bytes" in message, message
    assert [kv.key for kv in etcd_store.range("/big/")] == ["/big/lock"]
    etcd_store.revoke_lease(lease)


def test_fractional_ttl_is_rounded_up_to_whole_seconds(etcd_server, etcd_store):
    lease = etcd_store.grant_lease(1.2)
    channel = grpc.insecure_channel(f"{HOST}:{etcd_server.port}")
    info = etcdrpc.LeaseStub(channel).LeaseTimeToLive(etcdrpc.LeaseTimeToLiveRequest(ID=lease), timeout=5)
    channel.close()
    assert info.grantedTTL == 2  # never shorter than asked for
    etcd_store.revoke_lease(lease)
    with pytest.raises(LeaseExpired):
        etcd_store.keep_alive(lease)


# --- outages ----------------------------------------------------------------------------


def test_watch_survives_a_server_restart_without_losing_or_repeating_events(own_etcd):
    # The watch waits 2 s before each reconnection, so the write made right after the
    # restart certainly lands while it is disconnected: only resuming by revision finds it.
    store = EtcdStore(own_etcd.url, watch_backoff=(2.0, 2.0))
    events = []
    w = store.watch("/w/", events.append)
    store.put("/w/before", b"1")
    assert wait_until(lambda: len(events) == 1)

    own_etcd.kill()
    assert wait_until(lambda: not w.streaming)
    with pytest.raises(StoreUnavailable):
        store.put("/w/lost", b"x")
    own_etcd.start()
    writer = EtcdStore(own_etcd.url)
    writer.put("/w/during", b"2")
    assert not w.streaming  # written while the watch was away
    assert wait_until(lambda: w.streaming, timeout=10)
    writer.put("/w/after", b"3")
    assert wait_until(lambda: len(events) >= 3, timeout=10)
    time.sleep(0.2)
    assert [e.key for e in events] == ["/w/before", "/w/during", "/w/after"]
    assert events[0].revision < events[1].revision < events[2].revision
    assert store.get("/w/during").value == b"2"  # the store's own calls reconnect too
    writer.close()
    store.close()


def test_watch_resumes_past_compacted_history_with_a_warning(own_etcd, caplog):
    store = EtcdStore(own_etcd.url, watch_backoff=(2.0, 2.0))
    events = []
    w = store.watch("/c/", events.append)
    assert wait_until(lambda: w.streaming)
    own_etcd.kill()
    assert wait_until(lambda: not w.streaming)
    own_etcd.start()
    writer = EtcdStore(own_etcd.url)
    writer.put("/c/gone", b"1")
    rev = writer.put("/c/kept", b"2")
    channel = grpc.insecure_channel(f"{HOST}:{own_etcd.port}")
    etcdrpc.KVStub(channel).Compact(etcdrpc.CompactionRequest(revision=rev, physical=True), timeout=5)
    channel.close()
    assert not w.streaming
    with caplog.at_level(logging.WARNING, logger="pdps.adapters.etcd_store"):
        assert wait_until(lambda: w.streaming, timeout=10)
        writer.put("/c/later", b"3")
        assert wait_until(lambda: len(events) >= 2, timeout=10)
    assert [e.key for e in events] == ["/c/kept", "/c/later"]
    assert any("compacted" in r.getMessage() for r in caplog.records)
    writer.close()
    store.close()


# --- TLS --------------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _make_ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN=pdps test {name}", cwd=d)  # fmt: skip


def _make_cert(d: Path, name: str, ca: str, ext: str) -> None:
    (d / f"{name}.ext").write_text(ext + "\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)  # fmt: skip
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)  # fmt: skip


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    """A CA, a server certificate for 127.0.0.1 signed by it, a client certificate, and an unrelated CA."""
    d = tmp_path_factory.mktemp("certs")
    _make_ca(d, "ca")
    _make_ca(d, "other-ca")
    _make_cert(d, "server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth")
    _make_cert(d, "client", "ca", "extendedKeyUsage=clientAuth")
    return d


class TlsEtcdServer(EtcdServer):
    """etcd serving clients over https only; ``client_auth`` also demands a client certificate."""

    def __init__(self, certs: Path, *, client_auth: bool = False) -> None:
        args = ["--cert-file", str(certs / "server.pem"), "--key-file", str(certs / "server.key")]
        if client_auth:
            args += ["--client-cert-auth", "--trusted-ca-file", str(certs / "ca.pem")]
        super().__init__(tuple(args))
        self.certs, self.client_auth = certs, client_auth

    @property
    def url(self) -> str:
        return f"etcds://{HOST}:{self.port}?ca={self.certs / 'ca.pem'}"

    def argv(self) -> list[str]:
        return [a.replace(f"http://{HOST}:{self.port}", f"https://{HOST}:{self.port}") for a in super().argv()]

    def ready(self) -> bool:
        context = ssl.create_default_context(cafile=str(self.certs / "ca.pem"))
        if self.client_auth:
            context.load_cert_chain(self.certs / "client.pem", self.certs / "client.key")
        try:
            with urllib.request.urlopen(f"https://{HOST}:{self.port}/health", timeout=1, context=context) as resp:
                return b'"health":"true"' in resp.read()
        except OSError:
            return False


def test_tls_store_works_and_plaintext_or_a_wrong_ca_fails(certs):
    with TlsEtcdServer(certs) as server:
        store = open_store(server.url)
        rev = store.put("/tls", b"secret")
        assert store.get("/tls").mod_revision == rev and store.get("/tls").value == b"secret"
        events = []
        store.watch("/tls", events.append)
        store.put("/tls", b"again")
        assert wait_until(lambda: len(events) == 1)
        store.close()

        for url in (
            f"etcd://{HOST}:{server.port}?timeout=1",
            f"etcds://{HOST}:{server.port}?ca={certs / 'other-ca.pem'}&timeout=1",
        ):
            other = open_store(url)
            with pytest.raises(StoreError, match=f"{HOST}:{server.port}"):
                other.get("/tls")
            other.close()


def test_tls_client_certificate(certs):
    with TlsEtcdServer(certs, client_auth=True) as server:
        mutual = open_store(f"{server.url}&cert={certs / 'client.pem'}&key={certs / 'client.key'}")
        mutual.put("/mtls", b"1")
        assert mutual.get("/mtls").value == b"1"
        mutual.close()
        anonymous = open_store(f"{server.url}&timeout=1")
        with pytest.raises(StoreError):
            anonymous.get("/mtls")
        anonymous.close()


# --- auth -------------------------------------------------------------------------------


def _enable_auth(port: int, password: str) -> None:
    channel = grpc.insecure_channel(f"{HOST}:{port}")
    auth = etcdrpc.AuthStub(channel)
    auth.UserAdd(etcdrpc.AuthUserAddRequest(name="root", password=password), timeout=5)
    auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout=5)
    auth.AuthEnable(etcdrpc.AuthEnableRequest(), timeout=5)
    channel.close()


def test_auth_credentials_wrong_password_missing_credentials_and_token_renewal():
    with EtcdServer() as server:
        _enable_auth(server.port, "r00t-pw")
        store = open_store(f"etcd://root:r00t-pw@{HOST}:{server.port}")
        store.put("/auth", b"1")
        events = []
        w = store.watch("/auth", events.append)
        assert wait_until(lambda: w.streaming)

        wrong = open_store(f"etcd://root:nope@{HOST}:{server.port}")
        with pytest.raises(StoreError, match="authentication as user 'root' failed") as info:
            wrong.get("/auth")
        assert "nope" not in str(info.value) and not isinstance(info.value, StoreUnavailable)
        wrong.close()
        anonymous = open_store(server.url)
        with pytest.raises(StoreError, match="requires authentication"):
            anonymous.get("/auth")
        anonymous.close()

        # A token the server no longer accepts (expired: "invalid auth token") is renewed
        # by logging in again, for calls and for a watch that reconnects with it.
        store._token = "expired-token"
        assert store.get("/auth").value == b"1"
        store._token = "expired-token"
        server.restart()
        assert wait_until(lambda: w.streaming, timeout=10)
        store.put("/auth", b"2")
        assert wait_until(lambda: [e.value for e in events] == [b"2"], timeout=10)
        store.close()


def test_lease_ids_from_one_store_work_from_another(etcd_server):
    # Leases are server-side: a keeper in one process, writers in another.
    a, b = open_store(etcd_server.url), open_store(etcd_server.url)
    lease = a.grant_lease(30)
    b.put("/shared-lease", b"1", lease=lease)
    assert a.get("/shared-lease").lease == lease
    a.revoke_lease(lease)
    assert b.get("/shared-lease") is None
    with pytest.raises(LeaseExpired):
        b.put("/shared-lease", b"1", lease=lease)
    a.close()
    b.close()
