"""Throwaway etcd, Redis and S3 (moto) servers on free loopback ports, for tests and benchmarks.

Each server is a real subprocess (the Debian binaries ``etcd`` and ``redis-server``;
moto's S3 server from the virtual environment) with its data under a fresh temporary
directory (``/dev/shm`` when it exists). A server that does not become ready raises
:class:`ServerFailed` with its log: tests fail loudly, they are never skipped.
``kill``/``restart`` and ``pause``/``resume`` let outage tests take a server away and
bring it back on the same port (and data, where it keeps any: moto keeps its objects
in memory, so a restarted one is empty).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
import time
import urllib.request
from pathlib import Path

HOST = "127.0.0.1"


class ServerFailed(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _scratch(prefix: str) -> Path:
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


class _Server:
    binary = ""

    def __init__(self, extra_args: tuple[str, ...] = ()) -> None:
        self.extra_args = tuple(extra_args)
        self.dir = _scratch(f"pdps-{self.binary}-")
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self._log = None

    # subclasses: argv(), ready() -> bool, url; executable() when not a binary on PATH
    def argv(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    def executable(self) -> str:
        exe = shutil.which(self.binary)
        if exe is None:
            raise ServerFailed(f"{self.binary} is not installed (the README's test command installs it: scripts/test)")
        return exe

    def start(self, timeout: float = 20.0) -> _Server:
        exe = self.executable()
        self._log = open(self.dir / "server.log", "ab")
        self.proc = subprocess.Popen([exe, *self.argv()], stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerFailed(f"{self.binary} exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.ready():
                return self
            time.sleep(0.05)
        self.stop()
        raise ServerFailed(f"{self.binary} on port {self.port} not ready after {timeout} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        try:
            return (self.dir / "server.log").read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL, keeping the data directory for :meth:`restart`."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self._log is not None:
            self._log.close()
            self._log = None

    def restart(self, timeout: float = 20.0) -> _Server:
        self.kill()
        return self.start(timeout)

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self._log is not None:
            self._log.close()
            self._log = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> _Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class EtcdServer(_Server):
    """A single-node etcd 3.4 (the command line of ARCHITECTURE.md §9)."""

    binary = "etcd"

    def __init__(self, extra_args: tuple[str, ...] = ()) -> None:
        super().__init__(extra_args)
        self.peer_port = free_port()

    @property
    def url(self) -> str:
        return f"etcd://{HOST}:{self.port}"

    def argv(self) -> list[str]:
        client, peer = f"http://{HOST}:{self.port}", f"http://{HOST}:{self.peer_port}"
        return [
            "--name", "n0",
            "--data-dir", str(self.dir / "data"),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"n0={peer}",
            "--initial-cluster-state", "new",
            "--logger", "zap",
            "--log-level", "error",
            # A single node never holds an election after startup; fast timings lower
            # etcd's minimum lease TTL (1.5 x election timeout) from 2 s to 1 s, so the
            # contract's 1 s leases are really 1 s.
            "--heartbeat-interval", "10",
            "--election-timeout", "100",
            *self.extra_args,
        ]  # fmt: skip

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{HOST}:{self.port}/health", timeout=1) as resp:
                return b'"health":"true"' in resp.read()
        except OSError:
            return False


class RedisServer(_Server):
    """A single Redis node with keyspace notifications on and persistence off."""

    binary = "redis-server"

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def argv(self) -> list[str]:
        return [
            "--port", str(self.port),
            "--bind", HOST,
            "--dir", str(self.dir),
            "--save", "",
            "--appendonly", "no",
            "--notify-keyspace-events", "KEA",
            *self.extra_args,
        ]  # fmt: skip

    def ready(self) -> bool:
        try:
            with socket.create_connection((HOST, self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False


class MotoServer(_Server):
    """moto's S3-compatible server (``python -m moto.server``), objects in memory.

    Clients reach it with the standard AWS variables, as pdps roles would reach any
    S3-compatible store (MinIO, Ceph, ...): :meth:`environ` gives them. moto checks no
    signatures, so the credentials only have to exist.
    """

    binary = "moto_server"
    key = "pdps-test-key"
    secret = "pdps-test-secret"

    def executable(self) -> str:
        # The interpreter of the tests' own virtual environment: `moto_server` is not
        # on PATH when pytest runs as .venv/bin/pytest without activating the venv.
        return sys.executable

    def argv(self) -> list[str]:
        return ["-m", "moto.server", "-H", HOST, "-p", str(self.port), *self.extra_args]

    @property
    def url(self) -> str:
        """The endpoint URL (``AWS_ENDPOINT_URL``)."""
        return f"http://{HOST}:{self.port}"

    def environ(self) -> dict[str, str]:
        """The AWS variables that point boto/s3fs at this server."""
        return {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": self.secret,
        }

    def storage_options(self) -> dict[str, object]:
        """The same as s3fs options, for code that cannot change the environment."""
        return {"key": self.key, "secret": self.secret, "endpoint_url": self.url}

    def create_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh uniquely named one by default) and return its name.

        A plain unsigned PUT: moto needs no signature, and leaving s3fs out of it avoids
        its region handling, which makes bucket creation fail against custom endpoints.
        """
        name = name or f"pdps-{uuid.uuid4().hex[:20]}"
        req = urllib.request.Request(f"{self.url}/{name}", method="PUT")
        with urllib.request.urlopen(req, timeout=10) as resp:
            if resp.status != 200:
                raise ServerFailed(f"moto refused to create bucket {name!r}: HTTP {resp.status}")
        return name

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/", timeout=1) as resp:
                return resp.status == 200 and b"ListAllMyBucketsResult" in resp.read()
        except OSError:
            return False
