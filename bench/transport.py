"""Push + pull throughput of a parameter set over pdps transports, against raw TCP, torch RPC and memcpy.

A benchmark, not a test: it prints figures and ratios and asserts nothing about speed
(it exits 0 whatever the figures; a target it misses is printed as MISSED).

What runs (``--transports``, default all five)
-----------------------------------------------
A parameter set of ``--mib`` MiB of float32 (default 64), held by 2 pservers, half
each, and one trainer holding a gradient of the same size in one flat buffer.

* ``grpc``: 2 server processes (this file run with ``--serve grpc://127.0.0.1:0
  --shard-bytes N``; each prints its address on stdout and serves until its stdin
  closes). Each holds its half (one float32 tensor) and serves two handlers through
  the transport's ``serve(address, handlers)``: ``push`` receives the gradient
  tensors (borrowed for the call: it checks their count, dtype, size and first/last
  value and copies nothing) and ``pull`` returns ``Message({}, [shard])`` (as views
  when the trainer asks for several blocks). The trainer, in this process, connects
  with ``open_transport("grpc").connect(address)``; a round pushes to both pservers,
  then pulls from both. The transport says ``concurrent = True``, so the two
  pservers are called at once on 2 threads (as the real trainer does); a transport
  without it is called one pserver after the other. Each pserver's half travels as
  ``--blocks`` tensors (default 1, 4 and 16: views of the flat gradient / shard),
  one row per block count. ``--chunk-mib`` (one or more values) is passed as the
  adapter's ``chunk_bytes`` on both sides; each value gets its own pair of servers
  and rows. Without it the adapter's default is used. ``--bulk-threshold BYTES|off``
  is passed as the adapter's ``bulk_threshold`` on both sides (``off``: None, pure
  gRPC); without it the adapter's default applies.
* ``inproc``: the same two handlers on the same kind of shards, served in this
  process at ``inproc://`` addresses and called the same way (the adapter has no
  ``concurrent``: one pserver after the other).
* ``tcp`` (the ceiling): a server process on 127.0.0.1 (this file with ``--serve
  tcp://127.0.0.1:0``) receives N bytes into a preallocated buffer with
  ``recv_into`` and sends N bytes back; the client sends all ``--mib`` MiB on one
  connection, then receives as many (an 8-byte length goes first). Socket buffers
  are set to ``--tcp-buffer-mib`` (default 4 MiB, what ``net.core.[rw]mem_max``
  allows here; 0 leaves Linux autotuning on). An extra row, ``tcp x2``, does the
  same with half the bytes to each of 2 server processes on 2 threads, the shape of
  the pdps rows; it is printed, not used by a target.
* ``torch-rpc``: ``torch.distributed.rpc`` with the TensorPipe backend between two
  processes (this file with ``--torch-rpc-role server|client``, MASTER_ADDR
  127.0.0.1, a free port, TensorPipe's default transports and channels). The client
  process times ``rpc_sync("worker1", push, args=(gradient,))`` then
  ``rpc_sync("worker1", pull)`` returning the server's parameter tensor, both the
  full ``--mib`` MiB in one tensor, and prints its figures as one JSON line. (It
  pickles the call; that is fine for a baseline, pdps never pickles.)
* ``memcpy``: ``np.copyto`` of the same bytes into preallocated arrays, once for the
  push (gradient -> pserver side), once for the pull (parameters -> trainer side).

What is timed
-------------
* A round = push + pull of the whole parameter set; GB/s = (bytes pushed + bytes
  pulled) / round seconds, GB = 1e9 bytes. The median of ``--repeats`` rounds after
  ``--warmup`` untimed ones; min and max are printed too. The rounds of every route
  that lives in this process (grpc, inproc, tcp, memcpy) are interleaved, in an
  order rotated each round, so that noise from other processes on the machine falls
  on all of them alike. torch RPC cannot join them (TensorPipe keeps about a third of
  a core busy polling while idle, which would slow every other route): it runs in its
  own two processes before the rest and again after, ``--warmup`` + ``--repeats``
  rounds each time, and its row is the median of both sets.
* push / pull GB/s = bytes one way / the median push or pull phase (pdps and torch
  RPC only: TCP's ``sendall`` returns once the kernel has the bytes).
* cpu/round = CPU seconds (user + system) per timed round, of the trainer process
  (``time.process_time``) and of the server processes summed (/proc, 10 ms ticks);
  cores = both / round time.
* After the timed rounds each pdps route pulls once more and compares every value
  with what the servers hold; a wrong byte stops the run.

Targets: best grpc row / tcp >= 0.75; best grpc row / torch-rpc >= 1.0; slowest
inproc row / memcpy >= 1.0 (no copy at all).

Run
---
    .venv/bin/python bench/transport.py                           # ~30-60 s on 2 cores
    .venv/bin/python bench/transport.py --repeats 5 --chunk-mib 1 4
    .venv/bin/python bench/transport.py --transports grpc tcp --blocks 1 --json

``run(mib, repeats, warmup, ...) -> dict`` is importable; ``--json`` prints that dict
as one JSON object on the last stdout line, after the table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import select
import shlex
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.machine import describe  # noqa: E402
from pdps.core.errors import GradientRejected  # noqa: E402
from pdps.ports.transport import Message  # noqa: E402
from pdps.registry import open_transport  # noqa: E402

TRANSPORTS = ("grpc", "inproc", "tcp", "torch-rpc", "memcpy")
PSERVERS = 2
GRAD_VALUE = 0.5  # every gradient element; the pservers check the first and last of each block
GB = 1e9
SERVER_START_S = 60.0  # a server process must print its address within this
SERVER_STOP_S = 10.0  # ... and exit this long after its stdin closes
SERVER_MAX_S = 900.0  # a server process never outlives this, whatever its parent does
CALL_TIMEOUT_S = 60.0  # one push or pull call, one socket operation
TORCH_RPC_S = 240.0  # the whole torch RPC measurement, both processes
TARGETS = {"grpc_vs_tcp": 0.75, "grpc_vs_torch_rpc": 1.0, "inproc_vs_memcpy": 1.0}
CLK_TCK = os.sysconf("SC_CLK_TCK")


def say(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


def shard_values(nbytes: int, index: int) -> torch.Tensor:
    """The parameter values pserver ``index`` holds: known to both sides, so a pull can be checked."""
    n = nbytes // 4
    return torch.arange(n, dtype=torch.int32).remainder_(65521).to(torch.float32).add_(100_000.0 * index)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


# --- the pserver side -------------------------------------------------------------------


class ShardService:
    """The two handlers of one pserver-like service over a shard of ``nbytes``."""

    def __init__(self, nbytes: int, index: int) -> None:
        self.nbytes = nbytes
        self.shard = shard_values(nbytes, index)
        self._views: dict[int, list[torch.Tensor]] = {}

    def handlers(self) -> dict[str, Callable[[Message], Message]]:
        return {"push": self.push, "pull": self.pull}

    def _blocks(self, meta: Any) -> int:
        blocks = int(meta.get("blocks", 1))
        if not 1 <= blocks <= self.shard.numel():
            raise GradientRejected(f"cannot cut {self.shard.numel()} parameters into {blocks} blocks")
        return blocks

    def push(self, request: Message) -> Message:
        # The tensors are borrowed for the call: look, never copy.
        blocks = self._blocks(request.meta)
        tensors = list(request.tensors)
        size = sum(t.numel() * t.element_size() for t in tensors)
        if len(tensors) != blocks or size != self.nbytes or any(t.dtype != torch.float32 for t in tensors):
            raise GradientRejected(
                f"push: expected {blocks} float32 blocks of {self.nbytes} bytes in all, got {len(tensors)} tensors "
                f"({[str(t.dtype) for t in tensors[:4]]}...) of {size} bytes"
            )
        for t in tensors:
            if t.numel() and (t[0].item() != GRAD_VALUE or t[-1].item() != GRAD_VALUE):
                raise GradientRejected(f"push: a block of {t.numel()} values does not hold the gradient that was sent")
        return Message({"bytes": size})

    def pull(self, request: Message) -> Message:
        blocks = self._blocks(request.meta)
        views = self._views.get(blocks)
        if views is None:
            views = self._views[blocks] = list(self.shard.tensor_split(blocks))
        return Message({}, views)


def serve_forever(address: str, nbytes: int, index: int, chunk_mib: float | None, bulk_threshold: str = "default") -> int:
    """``--serve``: serve one shard at ``address``, print the address, stop when stdin closes."""
    stdin_closed = threading.Event()

    def watch_stdin() -> None:
        with contextlib.suppress(OSError, ValueError):
            while sys.stdin.buffer.read(65536):
                pass
        stdin_closed.set()

    if address.startswith("tcp://"):
        server = TcpEchoServer(address, nbytes)
        endpoint_address, close = server.address, server.close
    else:
        transport = open_transport(address.split("://", 1)[0], **grpc_options(chunk_mib, bulk_threshold))
        endpoint = transport.serve(address, ShardService(nbytes, index).handlers())
        endpoint_address, close = endpoint.address, endpoint.close
    print(endpoint_address, flush=True)
    threading.Thread(target=watch_stdin, name="stdin-watch", daemon=True).start()
    stdin_closed.wait(SERVER_MAX_S)
    close()
    return 0


def grpc_options(chunk_mib: float | None, bulk_threshold: str = "default") -> dict[str, Any]:
    """The gRPC adapter's options; ``bulk_threshold`` is ``default``, ``off`` or a byte count."""
    options: dict[str, Any] = {} if chunk_mib is None else {"chunk_bytes": int(chunk_mib * 2**20)}
    if bulk_threshold != "default":
        options["bulk_threshold"] = None if bulk_threshold == "off" else int(bulk_threshold)
    return options


class TcpEchoServer:
    """Receives a length and that many bytes into a preallocated buffer, sends as many back."""

    def __init__(self, address: str, nbytes: int) -> None:
        host, _, port = address[len("tcp://") :].rpartition(":")
        self._sock = socket.create_server((host, int(port)))
        self._sock.settimeout(1.0)
        self.address = "tcp://%s:%d" % self._sock.getsockname()[:2]
        self._buf = bytearray(nbytes)
        self._stop = threading.Event()
        threading.Thread(target=self._accept, name="tcp-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="tcp-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = self._buf  # connections share it: the bench runs one round at a time
        with conn, contextlib.suppress(OSError, ConnectionError):
            conn.settimeout(CALL_TIMEOUT_S)
            header = bytearray(8)
            while not self._stop.is_set():
                if not recv_exactly(conn, memoryview(header), allow_eof=True):
                    return
                (n,) = struct.unpack("<Q", header)
                if n > len(buf):
                    buf = bytearray(n)
                view = memoryview(buf)[:n]
                recv_exactly(conn, view)
                conn.sendall(view)

    def close(self) -> None:
        self._stop.set()
        self._sock.close()


def recv_exactly(sock: socket.socket, view: memoryview, *, allow_eof: bool = False) -> bool:
    """Fill ``view`` from ``sock``; False on a clean EOF before the first byte when allowed."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            if allow_eof and got == 0:
                return False
            raise ConnectionError(f"the peer closed the connection after {got} of {n} bytes")
        got += k
    return True


class StdinChild:
    """A child process run from the repository root that prints on stdout and exits when its stdin
    closes: ``stop()`` closes it and waits ``SERVER_STOP_S``, then kills it and waits as long again."""

    def __init__(self, argv: Sequence[str]) -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        self.pid = self.proc.pid

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(SERVER_STOP_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(SERVER_STOP_S)


class ServerProcess(StdinChild):
    """This file run as ``--serve ADDRESS``: started, its address read, stopped by closing stdin."""

    def __init__(self, address: str, nbytes: int, index: int, chunk_mib: float | None = None, bulk_threshold: str = "default") -> None:
        argv = [sys.executable, str(Path(__file__).resolve()), "--serve", address, "--shard-bytes", str(nbytes), "--shard-index", str(index)]
        if chunk_mib is not None:
            argv += ["--chunk-mib", repr(chunk_mib)]
        argv += ["--bulk-threshold", bulk_threshold]
        super().__init__(argv)
        self.address = ""

    def wait_ready(self, deadline: float) -> str:
        assert self.proc.stdout is not None
        while not self.address:
            left = deadline - time.monotonic()
            if self.proc.poll() is not None:
                raise RuntimeError(f"server process {self.pid} exited with {self.proc.returncode} before printing its address")
            if left <= 0:
                raise RuntimeError(f"server process {self.pid} printed no address within {SERVER_START_S:g} s")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 1.0))
            if ready:
                self.address = self.proc.stdout.readline().strip()
        return self.address


def start_servers(stack: contextlib.ExitStack, specs: Sequence[tuple[str, int, int, float | None, str]]) -> list[ServerProcess]:
    """Start every server at once (their imports overlap), then wait for all addresses."""
    servers = []
    for spec in specs:
        s = ServerProcess(*spec)
        stack.callback(s.stop)
        servers.append(s)
    deadline = time.monotonic() + SERVER_START_S
    for s in servers:
        s.wait_ready(deadline)
    return servers


# --- the routes a round can take ---------------------------------------------------------


class Route:
    """One row of the table: ``round()`` moves the whole set there and back once."""

    kind = ""
    label = ""
    blocks: int | None = None
    chunk_mib: float | None = None
    server_pids: Sequence[int] = ()
    split = True  # whether the push / pull phases mean something

    def round(self) -> tuple[float, float]:
        """(push seconds, pull seconds)."""
        raise NotImplementedError

    def verify(self) -> None:
        pass


class MemcpyRoute(Route):
    kind = label = "memcpy"

    def __init__(self, grad: torch.Tensor, shards: Sequence[torch.Tensor]) -> None:
        self._grad = grad.numpy()
        self._grad_dst = np.empty_like(self._grad)
        self._param = torch.cat(list(shards)).numpy()
        self._param_dst = np.empty_like(self._param)

    def round(self) -> tuple[float, float]:
        t0 = time.perf_counter()
        np.copyto(self._grad_dst, self._grad)
        t1 = time.perf_counter()
        np.copyto(self._param_dst, self._param)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1

    def verify(self) -> None:
        if not (np.array_equal(self._grad_dst, self._grad) and np.array_equal(self._param_dst, self._param)):
            raise RuntimeError("memcpy: the copies differ from their sources")


class TcpRoute(Route):
    kind = "tcp"
    split = False

    def __init__(self, servers: Sequence[ServerProcess], grad: torch.Tensor, pool: ThreadPoolExecutor, buffer_bytes: int) -> None:
        self.label = "tcp" if len(servers) == 1 else f"tcp x{len(servers)}"
        self.server_pids = [s.pid for s in servers]
        self._pool = pool
        parts = grad.tensor_split(len(servers))
        self._send = [memoryview(p.numpy()).cast("B") for p in parts]
        self._recv = [memoryview(bytearray(len(v))) for v in self._send]
        self._socks = []
        for s in servers:
            host, _, port = s.address[len("tcp://") :].rpartition(":")
            sock = socket.create_connection((host, int(port)), timeout=CALL_TIMEOUT_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if buffer_bytes:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
            self._socks.append(sock)

    def _one(self, i: int) -> float:
        sock, out, back = self._socks[i], self._send[i], self._recv[i]
        t0 = time.perf_counter()
        sock.sendall(struct.pack("<Q", len(out)))
        sock.sendall(out)
        t1 = time.perf_counter()
        recv_exactly(sock, back)
        return t1 - t0

    def round(self) -> tuple[float, float]:
        t0 = time.perf_counter()
        if len(self._socks) == 1:
            push = self._one(0)
        else:
            push = max(f.result(CALL_TIMEOUT_S) for f in [self._pool.submit(self._one, i) for i in range(len(self._socks))])
        return push, time.perf_counter() - t0 - push

    def verify(self) -> None:
        if any(a != b for a, b in zip(self._send, self._recv)):
            raise RuntimeError(f"{self.label}: the bytes that came back differ from the bytes sent")

    def close(self) -> None:
        for s in self._socks:
            s.close()


class PdpsRoute(Route):
    """The trainer side: push to every pserver, then pull from every pserver."""

    def __init__(
        self,
        kind: str,
        transport: Any,
        channels: Sequence[Any],
        grad_shards: Sequence[torch.Tensor],
        shard_bytes: int,
        blocks: int,
        pool: ThreadPoolExecutor,
        chunk_mib: float | None = None,
        server_pids: Sequence[int] = (),
    ) -> None:
        self.kind = kind
        self.blocks = blocks
        self.chunk_mib = chunk_mib
        self.server_pids = server_pids
        self.concurrent = bool(getattr(transport, "concurrent", False))
        chunk = "" if kind != "grpc" else f", chunk {'default' if chunk_mib is None else f'{chunk_mib:g} MiB'}"
        self.label = f"{kind}{chunk}, {blocks} block{'s' if blocks > 1 else ''}"
        self._channels = list(channels)
        self._grads = [list(g.tensor_split(blocks)) for g in grad_shards]
        self._shard_bytes = shard_bytes
        self._pool = pool
        self._meta = {"blocks": blocks}
        self.last_pull: list[Message] = []

    def _each(self, fn: Callable[[int], Message]) -> list[Message]:
        if not self.concurrent:
            return [fn(i) for i in range(len(self._channels))]
        futures = [self._pool.submit(fn, i) for i in range(len(self._channels))]
        return [f.result(2 * CALL_TIMEOUT_S) for f in futures]

    def _push(self, i: int) -> Message:
        return self._channels[i].call("push", Message(self._meta, self._grads[i]), timeout=CALL_TIMEOUT_S)

    def _pull(self, i: int) -> Message:
        return self._channels[i].call("pull", Message(self._meta), timeout=CALL_TIMEOUT_S)

    def round(self) -> tuple[float, float]:
        t0 = time.perf_counter()
        pushed = self._each(self._push)
        t1 = time.perf_counter()
        pulled = self._each(self._pull)
        t2 = time.perf_counter()
        for reply in pushed:
            if reply.meta.get("bytes") != self._shard_bytes:
                raise RuntimeError(f"{self.label}: a pserver acknowledged {reply.meta.get('bytes')} bytes, not {self._shard_bytes}")
        for reply in pulled:
            size = sum(t.numel() * t.element_size() for t in reply.tensors)
            if len(reply.tensors) != self.blocks or size != self._shard_bytes:
                raise RuntimeError(f"{self.label}: a pull brought {len(reply.tensors)} tensors of {size} bytes, not {self.blocks} of {self._shard_bytes}")
        self.last_pull = pulled
        return t1 - t0, t2 - t1

    def verify(self) -> None:
        self.round()
        for i, reply in enumerate(self.last_pull):
            got = torch.cat([t.reshape(-1) for t in reply.tensors])
            if not torch.equal(got, shard_values(self._shard_bytes, i)):
                raise RuntimeError(f"{self.label}: the values pulled from pserver {i} differ from what it holds")
        self.last_pull = []


# --- torch RPC: two processes of their own ----------------------------------------------

_RPC_STATE: dict[str, Any] = {}


def _rpc_push(grad: torch.Tensor) -> int:
    if grad.numel() * grad.element_size() != _RPC_STATE["nbytes"]:
        raise ValueError(f"push of {grad.numel() * grad.element_size()} bytes, expected {_RPC_STATE['nbytes']}")
    return grad.numel()


def _rpc_pull() -> torch.Tensor:
    return _RPC_STATE["param"]


def _rpc_cpu() -> float:
    return time.process_time()


def torch_rpc_worker(role: str, port: int, nbytes: int, warmup: int, repeats: int) -> int:
    """``--torch-rpc-role``: one side of the torch RPC baseline; the client prints its figures as JSON."""
    import warnings

    import torch.distributed.rpc as rpc

    # init_rpc warns about its own use of a gloo ProcessGroup; nothing to act on here.
    warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    rank = 0 if role == "client" else 1
    if role == "server":
        _RPC_STATE.update(nbytes=nbytes, param=shard_values(nbytes, 0))
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=8, rpc_timeout=CALL_TIMEOUT_S, init_method="env://")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    try:
        if role == "client":
            grad = torch.full((nbytes // 4,), GRAD_VALUE)
            pushes, pulls, client_cpu, server_cpu = [], [], [], []
            for i in range(warmup + repeats):
                c0, s0 = time.process_time(), rpc.rpc_sync("worker1", _rpc_cpu)
                t0 = time.perf_counter()
                rpc.rpc_sync("worker1", _rpc_push, args=(grad,))
                t1 = time.perf_counter()
                param = rpc.rpc_sync("worker1", _rpc_pull)
                t2 = time.perf_counter()
                c1, s1 = time.process_time(), rpc.rpc_sync("worker1", _rpc_cpu)
                if i >= warmup:
                    pushes.append(t1 - t0)
                    pulls.append(t2 - t1)
                    client_cpu.append(c1 - c0)
                    server_cpu.append(s1 - s0)
            ok = torch.equal(param, shard_values(nbytes, 0))
            print(json.dumps({"push_s": pushes, "pull_s": pulls, "client_cpu_s": client_cpu, "server_cpu_s": server_cpu, "verified": ok}), flush=True)
    finally:
        rpc.shutdown()
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_torch_rpc(nbytes: int, warmup: int, repeats: int) -> dict[str, Any]:
    port = free_port()
    base = [sys.executable, str(Path(__file__).resolve()), "--port", str(port), "--rpc-bytes", str(nbytes), "--warmup", str(warmup), "--repeats", str(repeats)]
    server = subprocess.Popen([*base, "--torch-rpc-role", "server"], stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL, cwd=ROOT)
    try:
        client = subprocess.run([*base, "--torch-rpc-role", "client"], capture_output=True, text=True, timeout=TORCH_RPC_S, stdin=subprocess.DEVNULL, cwd=ROOT)
        server.wait(SERVER_STOP_S)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(SERVER_STOP_S)
    lines = [line for line in client.stdout.splitlines() if line.startswith("{")]
    if client.returncode != 0 or not lines:
        raise RuntimeError(f"the torch RPC client exited with {client.returncode}: {client.stderr.strip()[-2000:]}")
    out = json.loads(lines[-1])
    if not out["verified"]:
        raise RuntimeError("torch RPC: the pulled tensor differs from the server's")
    return out


# --- running ----------------------------------------------------------------------------


def summarize(path_label: str, kind: str, nbytes: int, push: list[float], pull: list[float], client_cpu: list[float], server_cpu: list[float], **extra: Any) -> dict[str, Any]:
    rounds = [a + b for a, b in zip(push, pull)]
    med = statistics.median(rounds)
    row = {
        "label": path_label,
        "kind": kind,
        "rounds": len(rounds),
        "round_s": rounds,
        "median_round_s": med,
        "gbps": 2 * nbytes / med / GB,
        "gbps_min": 2 * nbytes / max(rounds) / GB,
        "gbps_max": 2 * nbytes / min(rounds) / GB,
        "push_gbps": nbytes / statistics.median(push) / GB if min(push) > 0 else None,  # None: below the clock's resolution
        "pull_gbps": nbytes / statistics.median(pull) / GB if min(pull) > 0 else None,
        "client_cpu_per_round_s": statistics.fmean(client_cpu),
        "server_cpu_per_round_s": statistics.fmean(server_cpu),
    }
    row["cores"] = (row["client_cpu_per_round_s"] + row["server_cpu_per_round_s"]) / statistics.fmean(rounds)
    row.update(extra)
    return row


def run(
    mib: float = 64,
    repeats: int = 7,
    warmup: int = 2,
    *,
    transports: Sequence[str] = TRANSPORTS,
    blocks: Sequence[int] = (1, 4, 16),
    chunk_mib: Sequence[float | None] = (None,),
    tcp_buffer_mib: float = 4,
    bulk_threshold: str = "default",
) -> dict[str, Any]:
    """Measure every route in ``transports``; returns the results as a JSON-safe dict."""
    unknown = set(transports) - set(TRANSPORTS)
    if unknown:
        raise ValueError(f"unknown transports {sorted(unknown)}; choose from {TRANSPORTS}")
    if mib <= 0 or repeats < 1 or warmup < 0 or not blocks or min(blocks) < 1 or any(c is not None and c <= 0 for c in chunk_mib):
        raise ValueError("mib, repeats, blocks and chunk sizes must be positive and warmup not negative")
    nbytes = int(mib * 2**20) // (4 * PSERVERS) * 4 * PSERVERS  # whole float32 values, split evenly
    shard_bytes = nbytes // PSERVERS
    t_total = time.perf_counter()
    load_start = os.getloadavg()
    rows: list[dict[str, Any]] = []

    torch_rpc: list[dict[str, Any]] = []
    if "torch-rpc" in transports:
        say(f"torch RPC (before): 2 processes, {warmup} + {repeats} rounds of {nbytes / 2**20:g} MiB push + pull")
        torch_rpc.append(measure_torch_rpc(nbytes, warmup, repeats))

    grad = torch.full((nbytes // 4,), GRAD_VALUE)
    grad_shards = list(grad.tensor_split(PSERVERS))
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(ThreadPoolExecutor(max_workers=PSERVERS, thread_name_prefix="bench-trainer"))
        routes: list[Route] = []
        specs: list[tuple[str, int, int, float | None, str]] = []
        if "tcp" in transports:
            specs += [("tcp://127.0.0.1:0", shard_bytes * (PSERVERS if i == 0 else 1), i, None, "default") for i in range(PSERVERS)]
        grpc_chunks = list(chunk_mib) if "grpc" in transports else []
        # Built before any server starts, so a bad chunk size or a missing extra fails here, clearly.
        grpc_transports = [open_transport("grpc", **grpc_options(c, bulk_threshold)) for c in grpc_chunks]
        for c in grpc_chunks:
            specs += [("grpc://127.0.0.1:0", shard_bytes, i, c, bulk_threshold) for i in range(PSERVERS)]
        if specs:
            say(f"starting {len(specs)} server processes")
        servers = start_servers(stack, specs)
        if "memcpy" in transports:
            routes.append(MemcpyRoute(grad, [shard_values(shard_bytes, i) for i in range(PSERVERS)]))
        if "tcp" in transports:
            tcp_servers, servers = servers[:PSERVERS], servers[PSERVERS:]
            for group in ([tcp_servers[0]], tcp_servers):
                p = TcpRoute(group, grad, pool, int(tcp_buffer_mib * 2**20))
                stack.callback(p.close)
                routes.append(p)
        if "inproc" in transports:
            transport = open_transport("inproc")
            endpoints = [transport.serve("inproc://", ShardService(shard_bytes, i).handlers()) for i in range(PSERVERS)]
            for e in endpoints:
                stack.callback(e.close)
            channels = [transport.connect(e.address) for e in endpoints]
            routes += [PdpsRoute("inproc", transport, channels, grad_shards, shard_bytes, b, pool) for b in blocks]
        for c, transport in zip(grpc_chunks, grpc_transports):
            pair, servers = servers[:PSERVERS], servers[PSERVERS:]
            channels = [transport.connect(s.address) for s in pair]
            for ch in channels:
                stack.callback(ch.close)
            pids = [s.pid for s in pair]
            routes += [PdpsRoute("grpc", transport, channels, grad_shards, shard_bytes, b, pool, chunk_mib=c, server_pids=pids) for b in blocks]

        say(f"{len(routes)} routes in this process, {warmup} + {repeats} interleaved rounds of {nbytes / 2**20:g} MiB push + pull each")
        stats: dict[int, tuple[list[float], ...]] = {id(p): ([], [], [], []) for p in routes}
        for r in range(warmup + repeats):
            k = r % len(routes) if routes else 0
            for p in routes[k:] + routes[:k]:
                c0 = time.process_time()  # this process, every thread, at the clock's resolution
                s0 = sum(cpu_seconds(x) for x in p.server_pids)
                push_s, pull_s = p.round()
                c1 = time.process_time()
                s1 = sum(cpu_seconds(x) for x in p.server_pids)
                if r >= warmup:
                    for xs, x in zip(stats[id(p)], (push_s, pull_s, c1 - c0, s1 - s0)):
                        xs.append(x)
            say(f"  round {r + 1}/{warmup + repeats}{' (warm-up)' if r < warmup else ''} done")
        for p in routes:
            p.verify()
            push, pull, ccpu, scpu = stats[id(p)]
            rows.append(summarize(p.label, p.kind, nbytes, push, pull, ccpu, scpu, blocks=p.blocks, chunk_mib=p.chunk_mib, split=p.split, concurrent=getattr(p, "concurrent", None)))
    if torch_rpc:
        say(f"torch RPC (after): 2 processes, {warmup} + {repeats} rounds")
        torch_rpc.append(measure_torch_rpc(nbytes, warmup, repeats))
        both = {k: [x for out in torch_rpc for x in out[k]] for k in ("push_s", "pull_s", "client_cpu_s", "server_cpu_s")}
        halves = [2 * nbytes / statistics.median([a + b for a, b in zip(out["push_s"], out["pull_s"])]) / GB for out in torch_rpc]
        rows.append(summarize("torch-rpc", "torch-rpc", nbytes, both["push_s"], both["pull_s"], both["client_cpu_s"], both["server_cpu_s"], gbps_before=halves[0], gbps_after=halves[1]))
    order = ("memcpy", "tcp", "torch-rpc", "inproc", "grpc")
    rows.sort(key=lambda r: order.index(r["kind"]))  # stable: rows of one kind keep their order
    return {
        "bench": "transport",
        "bytes": nbytes,
        "mib": nbytes / 2**20,
        "pservers": PSERVERS,
        "repeats": repeats,
        "warmup": warmup,
        "transports": list(transports),
        "blocks": list(blocks),
        "chunk_mib": list(chunk_mib),
        "bulk_threshold": bulk_threshold,
        "tcp_buffer_mib": tcp_buffer_mib,
        "machine": machine(),
        "loadavg_start": list(load_start),
        "loadavg_end": list(os.getloadavg()),
        "results": rows,
        "ratios": ratios(rows),
        "total_s": time.perf_counter() - t_total,
    }


def ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The targets' ratios: best grpc row against tcp and torch RPC, slowest inproc row against memcpy."""

    def one(label: str) -> dict[str, Any] | None:
        return next((r for r in rows if r["label"] == label), None)

    grpc = max((r for r in rows if r["kind"] == "grpc"), key=lambda r: r["gbps"], default=None)
    inproc = min((r for r in rows if r["kind"] == "inproc"), key=lambda r: r["gbps"], default=None)
    out: dict[str, Any] = {}
    for name, mine, base in (("grpc_vs_tcp", grpc, one("tcp")), ("grpc_vs_torch_rpc", grpc, one("torch-rpc")), ("inproc_vs_memcpy", inproc, one("memcpy"))):
        if mine is None or base is None:
            continue
        value = mine["gbps"] / base["gbps"]
        out[name] = {"value": value, "target": TARGETS[name], "met": value >= TARGETS[name], "row": mine["label"], "baseline": base["label"]}
    return out


# --- reporting --------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    return describe("grpcio", "pdps", torch=torch.__version__, numpy=np.__version__)


def _gbps(x: float) -> str:
    return f"{x:,.2f}" if x < 1000 else f"{x:,.0f}"


def print_report(report: dict[str, Any], command: str) -> None:
    m = report["machine"]
    print(f"command: {command}")
    print(f"machine: {m['cpu_count']} CPUs ({m['cpu_model']}), Python {m['python']}, torch {m['torch']}, numpy {m['numpy']}, grpcio {m['grpcio']}")
    ls, le = report["loadavg_start"], report["loadavg_end"]
    print(f"load average (1/5/15 min) at start {ls[0]:.2f} {ls[1]:.2f} {ls[2]:.2f}, at end {le[0]:.2f} {le[1]:.2f} {le[2]:.2f}")
    print(
        f"{report['mib']:g} MiB float32 pushed and pulled per round, {report['pservers']} pservers of {report['mib'] / report['pservers']:g} MiB; "
        f"median of {report['repeats']} rounds after {report['warmup']} warm-up; GB = 1e9 bytes; tcp socket buffers {report['tcp_buffer_mib']:g} MiB"
    )
    if ls[0] > m["cpu_count"]:
        print(f"CAUTION: the load average ({ls[0]:.1f}) exceeds the CPU count ({m['cpu_count']}): other processes compete for the cores, the figures are low and noisy")
    print()
    h = f"{'route':<32} {'GB/s':>9} {'min':>9} {'max':>9} {'push GB/s':>10} {'pull GB/s':>10} {'ms/round':>9} {'cpu trainer':>12} {'cpu servers':>12} {'cores':>6}"
    print(h)
    print("-" * len(h))
    for r in report["results"]:
        split = r.get("split", True)
        print(
            f"{r['label']:<32} {_gbps(r['gbps']):>9} {_gbps(r['gbps_min']):>9} {_gbps(r['gbps_max']):>9} "
            f"{_gbps(r['push_gbps']) if split and r['push_gbps'] else '-':>10} {_gbps(r['pull_gbps']) if split and r['pull_gbps'] else '-':>10} "
            f"{1000 * r['median_round_s']:>9.3f} {1000 * r['client_cpu_per_round_s']:>10.0f}ms {1000 * r['server_cpu_per_round_s']:>10.0f}ms {r['cores']:>6.2f}"
        )
    print("(GB/s = (bytes pushed + bytes pulled) / round time, median; min / max over the timed rounds;")
    print(" cpu = CPU time per round of the trainer process / the server processes (from /proc, 10 ms ticks); cores = both / round time;")
    print(" tcp and torch-rpc move all bytes to and from one server; tcp x2 and the pdps rows use 2, on 2 threads")
    print(" when the transport says concurrent (grpc), one after the other otherwise (inproc))")
    rpc = next((r for r in report["results"] if r["kind"] == "torch-rpc"), None)
    if rpc is not None:
        print(f"(torch-rpc ran twice in its own processes, before and after the rest: {rpc['gbps_before']:.2f} then {rpc['gbps_after']:.2f} GB/s;"
              f" its row is the median of all {rpc['rounds']} rounds)")
    print()
    names = {"grpc_vs_tcp": "grpc / raw TCP", "grpc_vs_torch_rpc": "grpc / torch rpc", "inproc_vs_memcpy": "inproc / memcpy"}
    for key, label in names.items():
        x = report["ratios"].get(key)
        if x is None:
            print(f"{label:<18} not measured (pick both transports)")
            continue
        print(f"{label:<18} {x['value']:>8.3f}   target >= {x['target']:<5g} {'MET' if x['met'] else 'MISSED':<7} ({x['row']} vs {x['baseline']})")
    print("(grpc: its best row; inproc: its slowest row)")
    print(f"\ntotal run time {report['total_s']:.1f} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transports", nargs="+", choices=TRANSPORTS, default=list(TRANSPORTS), help="routes to measure (default: all)")
    p.add_argument("--mib", type=float, default=64, help="parameter set size in MiB of float32 (default 64)")
    p.add_argument("--repeats", type=int, default=7, help="timed rounds per route (default 7)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds per route first (default 2)")
    p.add_argument("--blocks", type=int, nargs="+", default=[1, 4, 16], help="tensors per pserver's half, one row each (default 1 4 16)")
    p.add_argument("--chunk-mib", type=float, nargs="+", default=None, help="gRPC chunk_bytes in MiB, one server pair each (default: the adapter's)")
    p.add_argument(
        "--bulk-threshold", default="default", metavar="BYTES|off", help="gRPC bulk_threshold in bytes, or off (default: the adapter's)"
    )
    p.add_argument("--tcp-buffer-mib", type=float, default=4, help="SO_SNDBUF / SO_RCVBUF of the tcp client (default 4; 0 = autotuning)")
    p.add_argument("--json", action="store_true", help="also print the results as one JSON object on the last stdout line")
    # Internal: this file as a server process or a torch RPC worker.
    p.add_argument("--serve", metavar="ADDRESS", help="serve one shard at grpc://HOST:PORT or tcp://HOST:PORT, print the address, run until stdin closes")
    p.add_argument("--shard-bytes", type=int, help="with --serve: bytes the shard holds")
    p.add_argument("--shard-index", type=int, default=0, help="with --serve: which pserver (picks the shard's values)")
    p.add_argument("--torch-rpc-role", choices=("server", "client"), help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--rpc-bytes", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.bulk_threshold not in ("default", "off") and not args.bulk_threshold.isdigit():
        p.error(f"--bulk-threshold must be a byte count or off, not {args.bulk_threshold!r}")

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    chunk = None if args.chunk_mib is None or len(args.chunk_mib) != 1 else args.chunk_mib[0]
    if args.serve:
        if args.shard_bytes is None:
            p.error("--serve needs --shard-bytes")
        return serve_forever(args.serve, args.shard_bytes, args.shard_index, chunk, args.bulk_threshold)
    if args.torch_rpc_role:
        return torch_rpc_worker(args.torch_rpc_role, args.port, args.rpc_bytes, args.warmup, args.repeats)

    command = " ".join(shlex.quote(a) for a in [sys.executable, *(sys.argv if argv is None else [sys.argv[0], *argv])])
    report = run(
        args.mib,
        args.repeats,
        args.warmup,
        transports=args.transports,
        blocks=args.blocks,
        chunk_mib=args.chunk_mib or [None],
        tcp_buffer_mib=args.tcp_buffer_mib,
        bulk_threshold=args.bulk_threshold,
    )
    report["command"] = command
    print_report(report, command)
    if args.json:
        print(json.dumps(report, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
