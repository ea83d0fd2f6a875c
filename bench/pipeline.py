"""Pipeline parallelism (issue 20): the bubble of GPipe and 1F1B against theory, the
activations each stage holds at its peak, and p2p activation throughput over gRPC
against raw loopback TCP moving the same bytes in the same run.

A benchmark, not a test: it prints figures and ratios against baselines measured in the
same run and asserts nothing about speed (it exits 1 only when a pipeline step or an
echo did not run, or bytes came back wrong).

What runs
---------
* **Bubble**: ``--stages`` P real :class:`~pdps.adapters.torch_pipeline.StageRunner`\\ s
  (4), one thread each in this process, over real :class:`~pdps.runtime.p2p.P2P`
  endpoints on the **inproc** transport (one ``inproc://`` endpoint per stage). Each
  stage's module is one scalar parameter and an autograd function whose forward sleeps
  ``t`` (``--forward-ms``, 50; 5 with ``--quick``) and whose backward sleeps ``2t``: the
  compute is a controlled sleep, so the figure is the schedule, the runner and p2p, not
  how fast the cores compute. (Why 50 ms: the step's overhead, below, was 20-30 ms a
  660 ms step of 20 ms forwards on a quiet machine here, 10-13% of theory on its own,
  and 17-55 ms a 1650 ms step of 50 ms forwards: the runner's work between sleeps is
  slow on threads that woke on an idle vCPU. A stage worth pipelining computes for tens
  to hundreds of ms a microbatch.) A step runs ``--microbatches`` M microbatches (8) of a
  ``[4, 16]`` float32 activation; each schedule (``gpipe``, ``1f1b`` from
  :mod:`pdps.core.pipeline`) runs ``--steps`` steps (5; 2 with ``--quick``), the two
  schedules' steps interleaved, after one untimed step of each. Every stage thread
  starts a step at one barrier.

  *Definition* (the standard one, as :func:`pdps.core.pipeline.simulate` computes it):
  ``bubble = 1 - sum(busy_s) / (P * makespan_s)``, where ``busy_s`` of a stage is the
  time it spent in its forward and backward sleeps during the step (measured around
  each sleep, so a sleep's overshoot counts as work, not as bubble) and ``makespan_s``
  runs from the barrier to the end of the last stage's run. Theory with equal stages:
  ``(P - 1) / (M + P - 1)``, whatever the forward/backward ratio. The figure is the
  median over the steps; ``simulated`` is :func:`~pdps.core.pipeline.simulate` of the
  same schedule (equal to theory: a check of the schedule, not of the runner).
  ``overhead_s``: the makespan less the same schedule simulated with each stage's sleeps
  as they lasted, i.e. what the runner, p2p and waiting for a core added to the step.

  *Within 10%*: ``|measured - theory| <= 0.10 * theory``; the target figure is that
  relative error, ``|measured - theory| / theory`` (at most 0.10).
* **Peak activations held per stage**: the runner's own counter
  (``StageRunner.peak_activations``: microbatches whose forward is done and backward not
  yet), the most over the steps; expected M on every stage for GPipe and
  ``min(M, P - s)`` on stage ``s`` for 1F1B (reported, no target).
* **p2p throughput**: two P2P endpoints on 127.0.0.1 over ``grpc://`` in two processes:
  rank 0 in this process, rank 1 in a child (this file with ``--echo-peer``). A round is
  one activation of ``--mib`` MiB (4 and 16; 4 with ``--quick``; one float32 tensor
  ``[rows, 4096]``) sent by rank 0 (``P2P.send``: returns once rank 1's mailbox holds
  it; above 1 MiB the adapter's bulk channel carries the bytes), received by rank 1 and
  sent straight back as the gradient, received by rank 0: the forward and backward
  traffic of one pipeline boundary. GB/s = 2 x bytes / round seconds (GB = 1e9 B), the
  median of ``--rounds`` rounds (200; 5 with ``--quick``) after ``--warmup`` (5; 1): the
  median of 40 moved by a fifth from run to run, that of 200 by a few percent.
  Baseline, in the same run, rounds interleaved with the p2p ones (the order alternating):
  ``bench/transport.py``'s raw TCP echo served by a thread of the same second process
  (it ``recv_into`` a preallocated buffer, then sends it back; 4 MiB socket buffers,
  TCP_NODELAY), the same bytes each way. After the rounds rank 0 checks the last echo
  equals what it sent, and the TCP route checks its echo likewise.

Ratios and targets (``pdps bench --suite pipeline --check``)
-----------------------------------------------------------
* ``bubble_gpipe`` / ``bubble_1f1b``: ``|measured - theory| / theory``, at most 0.10.
* ``p2p_grpc_vs_tcp``: p2p GB/s / raw TCP GB/s, the worst activation size; at least 0.75.

Run
---
    .venv/bin/python bench/pipeline.py            # ~40-80 s on 2 shared cores
    .venv/bin/python bench/pipeline.py --quick    # ~10 s
    .venv/bin/python bench/pipeline.py --stages 8 --microbatches 32 --forward-ms 10 --mib 8

``--json``: the table and progress on stderr, one JSON object on stdout's last line.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import select
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # for bench.*

import torch  # noqa: E402
from torch import nn  # noqa: E402

from bench.machine import finish  # noqa: E402
from bench.transport import SERVER_START_S, StdinChild, TcpEchoServer, TcpRoute  # noqa: E402
from pdps.adapters.inproc import InprocTransport  # noqa: E402
from pdps.adapters.torch_pipeline import StageRunner  # noqa: E402
from pdps.core import pipeline as sched  # noqa: E402
from pdps.core.errors import PdpsError, Timeout, TransportError  # noqa: E402
from pdps.registry import open_transport  # noqa: E402
from pdps.runtime.p2p import P2P  # noqa: E402

FULL = {"stages": 4, "microbatches": 8, "forward_ms": 50.0, "steps": 5, "mib": [4.0, 16.0], "rounds": 200, "warmup": 5}
QUICK = {"stages": 4, "microbatches": 8, "forward_ms": 5.0, "steps": 2, "mib": [4.0], "rounds": 5, "warmup": 1}
SCHEDULES: dict[str, Callable[[int, int], list[list[sched.Action]]]] = {"gpipe": sched.gpipe, "1f1b": sched.one_f_one_b}
BACKWARD_OVER_FORWARD = 2.0  # a backward sleeps twice a forward
ROWS, WIDTH = 4, 16  # a microbatch's activation in the bubble runs
ACT_WIDTH = 4096  # the p2p activation: float32 [rows, ACT_WIDTH]
TCP_BUFFER = 4 << 20  # bench/transport.py's socket buffers
WARMUP_STEPS = 1  # untimed steps of each schedule first
STEP_TIMEOUT_S = 60.0  # one pipeline step, one receive, one p2p round
ECHO_IDLE_S = 600.0  # the echo peer gives up after this long without an activation
TARGETS = {"bubble_gpipe": 0.10, "bubble_1f1b": 0.10, "p2p_grpc_vs_tcp": 0.75}


def say(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


# --- bubble: stages whose compute is a sleep ---------------------------------------------------


class Clock:
    """One stage's controlled compute: sleeps of ``forward_s`` / ``backward_s``, each timed
    into ``busy_s`` (the stage's only thread and the autograd engine, which runs a CPU
    backward on the calling thread, are the only ones that sleep on it)."""

    def __init__(self, forward_s: float, backward_s: float) -> None:
        self.forward_s, self.backward_s = forward_s, backward_s
        self.busy_s = 0.0
        self.slept: dict[float, list[float]] = {forward_s: [], backward_s: []}  # each sleep as it lasted, by what was asked

    def sleep(self, seconds: float) -> None:
        t0 = time.perf_counter()
        time.sleep(seconds)
        took = time.perf_counter() - t0
        self.busy_s += took
        self.slept.setdefault(seconds, []).append(took)


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, clock: Clock) -> torch.Tensor:  # type: ignore[override]
        ctx.clock = clock
        clock.sleep(clock.forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        ctx.clock.sleep(ctx.clock.backward_s)
        return grad, None


class SleepStage(nn.Module):
    """A stage of one scalar weight (so every stage, the first too, has a backward) and a sleep."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(()))
        self.clock = clock

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x * self.weight, self.clock)


def expected_peaks(schedule: str, stages: int, microbatches: int) -> list[int]:
    """What the runner's counter must show: GPipe holds M on every stage, 1F1B min(M, P - s)."""
    if schedule == "gpipe":
        return [microbatches] * stages
    return [min(microbatches, stages - s) for s in range(stages)]


def bubble(stages: int, microbatches: int, forward_s: float, steps: int) -> list[dict[str, Any]]:
    """``steps`` steps of each schedule, interleaved, over inproc p2p in ``stages`` threads."""
    backward_s = BACKWARD_OVER_FORWARD * forward_s
    transport = InprocTransport()
    book: dict[int, str] = {}
    links = []
    for r in range(stages):
        links.append(P2P(transport, r, f"inproc://pipeline-bench-{r}", peers=book.__getitem__, timeout=STEP_TIMEOUT_S))
        book[r] = links[r].address
    clocks = [Clock(forward_s, backward_s) for _ in range(stages)]
    runners = {
        name: [StageRunner(SleepStage(clocks[s]), s, stages, links[s], loss_fn=lambda out, y: (out - y).pow(2).mean(), timeout=STEP_TIMEOUT_S)
               for s in range(stages)]
        for name in SCHEDULES
    }  # fmt: skip
    schedules = {name: make(stages, microbatches) for name, make in SCHEDULES.items()}
    rows: dict[str, dict[str, Any]] = {}
    for name, schedule in schedules.items():
        sim = sched.simulate(schedule, forward_s, backward_s)
        rows[name] = {"schedule": name, "stages": stages, "microbatches": microbatches, "forward_s": forward_s, "backward_s": backward_s,
                      "theory": sched.bubble_theory(stages, microbatches), "simulated": sim.bubble,
                      "ideal_makespan_s": sim.makespan, "steps": []}  # fmt: skip
    torch.manual_seed(0)
    inputs = torch.randn(microbatches * ROWS, WIDTH)
    targets = torch.randn(microbatches * ROWS, WIDTH)
    step_ids = itertools.count()
    barrier = threading.Barrier(stages)
    pool = ThreadPoolExecutor(max_workers=stages, thread_name_prefix="stage")
    try:
        for k in range(-WARMUP_STEPS, steps):
            for name in SCHEDULES if k % 2 == 0 else reversed(SCHEDULES):
                step = next(step_ids)
                busy_before = [c.busy_s for c in clocks]

                def run_stage(s: int, name: str = name, step: int = step) -> tuple[float, float, int]:
                    runner = runners[name][s]
                    barrier.wait(STEP_TIMEOUT_S)
                    t0 = time.perf_counter()
                    if s == 0:
                        runner.run(schedules[name][s], inputs, targets, step=step)
                    else:
                        runner.run(schedules[name][s], step=step)
                    return t0, time.perf_counter(), runner.peak_activations

                futures = [pool.submit(run_stage, s) for s in range(stages)]
                got = [f.result(STEP_TIMEOUT_S) for f in futures]
                makespan = max(end for _, end, _ in got) - min(start for start, _, _ in got)
                busy = [c.busy_s - b for c, b in zip(clocks, busy_before)]
                measured = 1.0 - sum(busy) / (stages * makespan)
                # the same schedule simulated with the sleeps as they lasted: what the step would take with free communication
                lasted = [[statistics.mean(c.slept[c.forward_s][-microbatches:]), statistics.mean(c.slept[c.backward_s][-microbatches:])] for c in clocks]
                floor = sched.simulate(schedules[name], [f for f, _ in lasted], [b for _, b in lasted]).makespan
                if k < 0:
                    say(f"  {name:<5} warm-up step: makespan {makespan * 1000:.1f} ms (not counted: first calls, first metas)")
                    continue
                rows[name]["steps"].append({"makespan_s": makespan, "busy_s": busy, "bubble": measured, "peaks": [p for _, _, p in got],
                                            "overhead_s": makespan - floor, "sleep_overshoot_s": statistics.mean(
                                                x - want for c in clocks for want in (c.forward_s, c.backward_s) for x in c.slept[want][-microbatches:])})  # fmt: skip
                say(f"  {name:<5} step {k + 1}/{steps}: makespan {makespan * 1000:.1f} ms (ideal {rows[name]['ideal_makespan_s'] * 1000:.1f}, "
                    f"overhead {(makespan - floor) * 1000:.1f}), "
                    f"bubble {measured:.4f} (theory {rows[name]['theory']:.4f}), peak activations {[p for _, _, p in got]}")  # fmt: skip
    finally:
        barrier.abort()  # a stage still at the barrier stops there
        for link in links:
            link.close()  # a stage waiting on a receive stops there
        pool.shutdown(wait=True)
    out = []
    for name, row in rows.items():
        each = row.pop("steps")
        measured = statistics.median(s["bubble"] for s in each)
        peaks = [max(s["peaks"][r] for s in each) for r in range(stages)]
        out.append({**row, "measured": measured, "measured_each": [s["bubble"] for s in each],
                    "error": abs(measured - row["theory"]) / row["theory"],
                    "makespan_s": statistics.median(s["makespan_s"] for s in each), "makespan_each_s": [s["makespan_s"] for s in each],
                    "busy_s": [statistics.median(s["busy_s"][r] for s in each) for r in range(stages)],
                    "overhead_s": statistics.median(s["overhead_s"] for s in each),
                    "sleep_overshoot_s": statistics.median(s["sleep_overshoot_s"] for s in each),
                    "peak_activations": peaks, "peak_expected": expected_peaks(name, stages, microbatches)})  # fmt: skip
    return out


# --- p2p throughput: gRPC between two processes, against raw TCP --------------------------------


def echo_peer(tcp_bytes: int) -> int:
    """``--echo-peer``: the second process. Rank 1 over gRPC on 127.0.0.1 and, on a thread
    of its own, ``bench/transport.py``'s raw TCP echo server. Prints both addresses (one
    line each), reads rank 0's from stdin, then sends back each ``"{i}/act"`` as
    ``"{i}/grad"`` (i = 0, 1, ...) until stdin closes."""
    book: dict[int, str] = {}
    p2p = P2P(open_transport("grpc"), 1, "grpc://127.0.0.1:0", peers=book.__getitem__, timeout=STEP_TIMEOUT_S)
    tcp = TcpEchoServer("tcp://127.0.0.1:0", tcp_bytes)
    print(p2p.address, flush=True)
    print(tcp.address, flush=True)
    book[0] = sys.stdin.readline().strip()  # rank 0's address, written once it has ours

    def watch_stdin() -> None:
        with contextlib.suppress(OSError):
            while os.read(0, 65536):  # the raw descriptor: a daemon thread must not hold stdin's buffer lock at exit
                pass
        p2p.close()  # ends the receive that waits

    threading.Thread(target=watch_stdin, name="stdin-watch", daemon=True).start()
    try:
        for i in itertools.count():
            try:
                got = p2p.recv(0, f"{i}/act", timeout=ECHO_IDLE_S)
            except TransportError:
                return 0  # closed: the bench is done
            except Timeout as exc:
                print(f"bench/pipeline.py --echo-peer: {exc}", file=sys.stderr, flush=True)
                p2p.close()
                return 1
            p2p.send(0, f"{i}/grad", got, stop_gradient=[True] * len(got))
    finally:
        tcp.close()
    return 0


class EchoPeer(StdinChild):
    """The ``--echo-peer`` process: started, its addresses read, ours written, stopped by closing stdin.
    To ``TcpRoute`` it is a server process: ``address`` is its raw TCP echo's, once ``wait_ready`` read it."""

    def __init__(self, tcp_bytes: int) -> None:
        super().__init__([sys.executable, str(Path(__file__).resolve()), "--echo-peer", "--tcp-bytes", str(tcp_bytes)])
        self.lines: list[str] = []
        self.address = ""

    def wait_ready(self, rank0: str) -> str:
        """Its p2p address, once it printed that and its raw TCP echo's (kept as ``address``); then tells it ``rank0``."""
        assert self.proc.stdout is not None and self.proc.stdin is not None
        deadline = time.monotonic() + SERVER_START_S
        while len(self.lines) < 2:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the echo peer (pid {self.pid}) exited with {self.proc.returncode} before printing its addresses")
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"the echo peer (pid {self.pid}) printed no addresses within {SERVER_START_S:g} s")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 1.0))
            if ready:  # both lines come at once: read them both (the second may sit in the pipe's reader already)
                self.lines = [self.proc.stdout.readline().strip() for _ in range(2)]
                if not all(self.lines):
                    raise RuntimeError(f"the echo peer (pid {self.pid}) printed {self.lines}, not its two addresses")
        self.proc.stdin.write(rank0 + "\n")
        self.proc.stdin.flush()
        self.address = self.lines[1]
        return self.lines[0]


class P2PRoute:
    label = "p2p over gRPC (2 processes)"

    def __init__(self, p2p: P2P, activation: torch.Tensor, counter: itertools.count) -> None:
        self.p2p, self.activation, self.counter = p2p, activation, counter
        self.last: list[torch.Tensor] = []

    def round(self) -> float:
        i = next(self.counter)
        t0 = time.perf_counter()
        self.p2p.send(1, f"{i}/act", [self.activation])
        self.last = self.p2p.recv(1, f"{i}/grad", timeout=STEP_TIMEOUT_S)
        return time.perf_counter() - t0

    def verify(self) -> None:
        if len(self.last) != 1 or not torch.equal(self.last[0], self.activation):
            raise RuntimeError("p2p over gRPC: the echo differs from the activation sent")


class RawTcpRoute:
    label = "raw TCP echo (2 processes)"

    def __init__(self, route: TcpRoute) -> None:
        self.route = route

    def round(self) -> float:
        send, receive = self.route.round()
        return send + receive

    def verify(self) -> None:
        self.route.verify()


def throughput(sizes_mib: Sequence[float], rounds: int, warmup: int) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Rows of both routes for each size, and rank 0's p2p stats."""
    out: list[dict[str, Any]] = []
    largest = int(max(sizes_mib) * 2**20)
    with contextlib.ExitStack() as stack:
        peer = EchoPeer(largest)
        stack.callback(peer.stop)
        book: dict[int, str] = {}
        p2p = P2P(open_transport("grpc"), 0, "grpc://127.0.0.1:0", peers=book.__getitem__, timeout=STEP_TIMEOUT_S)
        stack.callback(p2p.close)
        book[1] = peer.wait_ready(p2p.address)
        counter = itertools.count()
        pool = stack.enter_context(ThreadPoolExecutor(max_workers=1))
        for mib in sizes_mib:
            nbytes = int(mib * 2**20)
            rows = max(1, nbytes // (4 * ACT_WIDTH))
            activation = torch.randn(rows, ACT_WIDTH)
            nbytes = activation.numel() * 4
            tcp = TcpRoute([peer], activation.reshape(-1), pool, TCP_BUFFER)
            stack.callback(tcp.close)
            routes = [P2PRoute(p2p, activation, counter), RawTcpRoute(tcp)]
            times: dict[str, list[float]] = {r.label: [] for r in routes}
            for k in range(warmup + rounds):
                for r in routes if k % 2 == 0 else reversed(routes):
                    took = r.round()
                    if k >= warmup:
                        times[r.label].append(took)
            for r in routes:
                r.verify()
            for r, kind in zip(routes, ("grpc", "tcp")):
                each = times[r.label]
                median = statistics.median(each)
                out.append({"route": kind, "label": r.label, "mib": mib, "bytes": nbytes, "shape": [rows, ACT_WIDTH],
                            "round_s": median, "gbps": 2 * nbytes / median / 1e9, "min_round_s": min(each), "max_round_s": max(each),
                            "rounds": len(each)})  # fmt: skip
            grpc_row, tcp_row = out[-2], out[-1]
            say(f"  {mib:g} MiB: p2p over gRPC {grpc_row['gbps']:.2f} GB/s, raw TCP {tcp_row['gbps']:.2f} GB/s "
                f"({grpc_row['gbps'] / tcp_row['gbps']:.3f}x)")  # fmt: skip
        stats = dict(p2p.stats)
    return out, stats


# --- the report -------------------------------------------------------------------------------


def ratios(bubbles: list[dict[str, Any]], p2p_rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for row in bubbles:
        out[f"bubble_{row['schedule']}"] = {"value": row["error"], "measured": row["measured"], "theory": row["theory"],
                                            "stages": row["stages"], "microbatches": row["microbatches"]}  # fmt: skip
    per_size = []
    for mib in sorted({r["mib"] for r in p2p_rows}):
        grpc_row = next(r for r in p2p_rows if r["mib"] == mib and r["route"] == "grpc")
        tcp_row = next(r for r in p2p_rows if r["mib"] == mib and r["route"] == "tcp")
        per_size.append({"mib": mib, "value": grpc_row["gbps"] / tcp_row["gbps"], "gbps": grpc_row["gbps"], "baseline_gbps": tcp_row["gbps"]})
    worst = min(per_size, key=lambda r: r["value"])
    out["p2p_grpc_vs_tcp"] = {**worst, "each": per_size}
    return out


def print_table(report: dict[str, Any]) -> None:
    c = report["config"]
    say("")
    say(f"bubble: {c['stages']} stages x {c['microbatches']} microbatches, forward {c['forward_ms']:g} ms, backward "
        f"{c['forward_ms'] * BACKWARD_OVER_FORWARD:g} ms (sleeps), StageRunners in threads over inproc p2p, median of {c['steps']} steps")  # fmt: skip
    say(f"{'schedule':<9} {'theory':>7} {'simulated':>9} {'measured':>9} {'error':>7} {'makespan ms':>12} {'ideal ms':>9} {'overhead ms':>12}"
        "  peak activations (expected)")  # fmt: skip
    for r in report["bubble"]:
        say(f"{r['schedule']:<9} {r['theory']:>7.4f} {r['simulated']:>9.4f} {r['measured']:>9.4f} {100 * r['error']:>6.1f}% "
            f"{r['makespan_s'] * 1000:>12.1f} {r['ideal_makespan_s'] * 1000:>9.1f} {r['overhead_s'] * 1000:>12.1f}  {r['peak_activations']} ({r['peak_expected']})")  # fmt: skip
    say(" overhead: the makespan less the schedule simulated with each stage's sleeps as they lasted (mean overshoot of a sleep "
        f"{1000 * statistics.mean(r['sleep_overshoot_s'] for r in report['bubble']):.2f} ms): waiting for a core, the runner and p2p between sleeps")  # fmt: skip
    say("")
    say(f"p2p: one activation there and back a round, median of {c['rounds']} rounds after {c['warmup']} warm-up; GB = 1e9 B")
    say(f"{'route':<32} {'MiB':>5} {'GB/s':>6} {'round ms':>9} {'min ms':>7} {'max ms':>7}")
    for r in report["p2p"]:
        say(f"{r['label']:<32} {r['mib']:>5g} {r['gbps']:>6.2f} {r['round_s'] * 1000:>9.2f} {r['min_round_s'] * 1000:>7.2f} {r['max_round_s'] * 1000:>7.2f}")
    say("")
    say("load average (1, 5, 15 min): at the start " + ", ".join(f"{x:.1f}" for x in report["loadavg_start"])
        + "; at the end " + ", ".join(f"{x:.1f}" for x in report["loadavg_end"]))  # fmt: skip
    for name, r in report["ratios"].items():
        if name.startswith("bubble_"):
            verdict = "MET" if r["value"] <= TARGETS[name] else "MISSED"
            say(f"{name}: |measured - theory| / theory = {100 * r['value']:.1f}% (target <= {100 * TARGETS[name]:g}%: {verdict})")
        else:
            verdict = "MET" if r["value"] >= TARGETS[name] else "MISSED"
            say(f"{name}: {r['value']:.3f}x at {r['mib']:g} MiB, the worst size (target >= {TARGETS[name]:g}x: {verdict})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--stages", type=int, help=f"pipeline stages P (default {FULL['stages']})")
    p.add_argument("--microbatches", type=int, help=f"microbatches M a step (default {FULL['microbatches']})")
    p.add_argument("--forward-ms", type=float, help=f"a forward's sleep; a backward sleeps twice as long (default {FULL['forward_ms']:g}, --quick {QUICK['forward_ms']:g})")
    p.add_argument("--steps", type=int, help=f"steps of each schedule, the median reported (default {FULL['steps']}, --quick {QUICK['steps']})")
    p.add_argument("--mib", type=float, nargs="+", help=f"activation sizes of the p2p rounds (default {FULL['mib']}, --quick {QUICK['mib']})")
    p.add_argument("--rounds", type=int, help=f"timed p2p rounds per size and route (default {FULL['rounds']}, --quick {QUICK['rounds']})")
    p.add_argument("--warmup", type=int, help=f"untimed rounds first (default {FULL['warmup']}, --quick {QUICK['warmup']})")
    p.add_argument("--quick", action="store_true", help="fewer steps and rounds, shorter sleeps, 4 MiB only")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout's last line")
    p.add_argument("--echo-peer", action="store_true", help=argparse.SUPPRESS)  # the child process of the p2p rounds
    p.add_argument("--tcp-bytes", type=int, default=16 << 20, help=argparse.SUPPRESS)  # its raw TCP echo's first buffer
    args = p.parse_args(argv)
    if args.echo_peer:
        return echo_peer(args.tcp_bytes)
    preset = QUICK if args.quick else FULL
    stages, microbatches, forward_ms, steps, mib, rounds, warmup = (
        getattr(args, k) if getattr(args, k) is not None else preset[k] for k in ("stages", "microbatches", "forward_ms", "steps", "mib", "rounds", "warmup")
    )
    if stages < 2 or microbatches < 1 or forward_ms <= 0 or steps < 1 or rounds < 1 or warmup < 0 or any(m <= 0 for m in mib):
        p.error("--stages must be at least 2; --microbatches, --steps, --rounds, --forward-ms and --mib positive; --warmup >= 0")
    began = time.monotonic()
    loadavg_start = list(os.getloadavg())  # the figures move with what else runs on the cores
    try:
        say(f"bubble: {stages} stages x {microbatches} microbatches, forward {forward_ms:g} ms, backward {forward_ms * BACKWARD_OVER_FORWARD:g} ms, {steps} steps each")
        bubbles = bubble(stages, microbatches, forward_ms / 1000, steps)
        say(f"p2p over gRPC against raw TCP: {', '.join(f'{m:g}' for m in mib)} MiB, {warmup} + {rounds} rounds")
        p2p_rows, stats = throughput(mib, rounds, warmup)
    except (RuntimeError, PdpsError, TimeoutError, threading.BrokenBarrierError) as exc:
        say(f"bench/pipeline.py: {type(exc).__name__}: {exc}")
        return 1
    finish("bench/pipeline.py", argv, began,
           {"stages": stages, "microbatches": microbatches, "forward_ms": forward_ms, "backward_over_forward": BACKWARD_OVER_FORWARD,
            "steps": steps, "mib": mib, "rounds": rounds, "warmup": warmup, "bubble_transport": "inproc",
            "p2p_transport": "grpc", "activation_width": ACT_WIDTH, "tcp_buffer_bytes": TCP_BUFFER},
           {"bubble": bubbles, "p2p": p2p_rows, "p2p_stats": stats, "ratios": ratios(bubbles, p2p_rows), "targets": TARGETS},
           packages=("torch", "grpcio"), table=print_table, as_json=args.json, loadavg_start=loadavg_start)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
