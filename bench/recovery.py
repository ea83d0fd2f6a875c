"""Time from killing a pserver to training resumed, against the lease TTL and a process restart.

A benchmark, not a test: it prints figures and ratios and asserts nothing about speed
(it exits 0 whatever the figures; it exits 1 only when a recovery did not happen at
all, after printing what the launcher logged).

What runs
---------
* A throwaway etcd on a free 127.0.0.1 port (``tests/servers.py``, data under /dev/shm).
* ``python -m pdps launch`` as a subprocess: the digits example
  (``pdps.examples.digits:train``), 2 trainers, 2 pservers, sync mode, ``--restart
  on-failure``, checkpoints every ``--checkpoint-every`` rounds (default 20) to a
  fresh ``file://`` directory, ``--lease-ttl`` (default 2 s), passes enough that it
  trains for the whole run. Its stdout and stderr go to a log (``--log FILE`` keeps it).
* Per repeat (``--repeats``, default 3): wait until a checkpoint of the current epoch
  is committed (the ``checkpoint`` pointer names the current epoch and a round past
  the epoch's first) and training goes on after it (the round record two rounds past
  the checkpoint is closed); find pserver 1's process (the launcher's child whose argv
  holds ``pserver --index 1``, from /proc) and SIGKILL it. The launcher restarts it
  with the same index; the new pserver waits for the old claim to expire, claims
  ``ps/1``, and rolls the job back to the checkpoint (a new epoch).

What is timed
-------------
Seconds after the kill (``time.monotonic`` just before ``os.kill``), by polling etcd
every ``--poll`` seconds (default 0.02; 3 small reads a poll) and /proc:

* ``respawned``: a new launcher child with ``pserver --index 1`` exists;
* ``claim gone``: ``ps/1`` is absent (the dead pserver's lease expired);
* ``serving``: the new pserver logged that it serves (its imports and gRPC server are up;
  time of the line's arrival through the launcher's relay);
* ``claimed``: ``ps/1`` holds a claim under another lease than the dead one's;
* ``epoch``: the ``epoch`` record holds a higher epoch (the rollback);
* ``noticed``: a trainer logged that pserver 1 moved to a new address (it follows
  ``ps/1`` only when a call to the old address has failed for good);
* ``resumed``: a closed round record exists under ``rounds/<new epoch>/`` (a whole sync
  step of the new epoch went through every pserver: training resumed).

:func:`recoveries` runs the same job with ``replicas`` > 1 for ``bench/replicas.py``:
the victim is killed once every slot has all its copies; ``failed over`` is when the
slot map changed (a backup promoted), and ``resumed`` the close of the round after the
one under way at the kill, in the same epoch (no rollback).

Also per repeat: the machine's CPU busy fraction from the kill to the resumption (from
/proc/stat; the run shares the machine with whatever else runs there), and the
launcher's WARNING/ERROR lines and its own ``[launch]`` lines of that window.

Baselines, measured in the same run before the job starts: the lease TTL (as etcd
grants it: whole seconds, rounded up), which bounds how soon a dead pserver can be
replaced, and a process restart, the wall time of ``python -c "import torch, pdps"``
(median of ``--restart-samples`` runs after one untimed run). The ratio printed is
resumed / (lease TTL + restart), on the median resumed time; and, since the restart
runs while the lease expires, resumed / max(lease TTL, restart) as well. 1.0 would be
recovery with no cost beyond noticing the death and starting a process.

Run
---
    .venv/bin/python bench/recovery.py                    # ~1-2 min on 2 cores
    .venv/bin/python bench/recovery.py --lease-ttl 5 --repeats 5
    .venv/bin/python bench/recovery.py --json --log /tmp/recovery.log

``run(lease_ttl, repeats, checkpoint_every, ...) -> dict`` is importable; ``--json``
prints that dict as one JSON object on the last stdout line, after the table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # for tests.servers (throwaway etcd)

from bench.machine import describe  # noqa: E402
from pdps.core.job import Keys  # noqa: E402
from pdps.registry import open_store  # noqa: E402
from pdps.runtime.resizing import read_map, read_resize  # noqa: E402

JOB = "bench-recovery"
TARGET = "pdps.examples.digits:train"
TRAINERS = 2
PSERVERS = 2
VICTIM = 1  # the pserver index killed
PASSES = 100_000  # the job never ends during a run
GRACE_S = 5.0  # the roles' --grace: how long a stopping role may take
STARTUP_S = 90.0  # the job must commit its first checkpoint within this
CHECKPOINT_S = 60.0  # ... and each later one (after a recovery) within this
RECOVERY_S = 60.0  # from the kill to training resumed
PID_S = 10.0  # the victim's process must be found within this
STOP_S = 2 * GRACE_S + 20  # the launcher must exit this long after SIGTERM
LAUNCH_TIMEOUT_S = 900.0  # the launcher's own --timeout: it never outlives a stuck run by much
IMPORT_S = 120.0  # one `python -c "import torch, pdps"`
ROUNDS_PAST_CHECKPOINT = 2  # "advancing": this many rounds past the checkpoint are closed
STAGES = ("respawned", "claim_gone", "failed_over", "serving", "claimed", "epoch", "noticed", "resumed")
STAGE_LABELS = {
    "respawned": "respawned",
    "claim_gone": "claim gone",
    "failed_over": "failed over",
    "serving": "serving",
    "claimed": "claimed",
    "epoch": "epoch",
    "noticed": "noticed",
    "resumed": "resumed",
}
NOTEWORTHY = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b|Traceback|^\[launch\]|Error:|exited with")


def say(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


class BenchFailed(RuntimeError):
    """A wait ran out or the launcher died: the run cannot go on."""


# --- the launcher's output --------------------------------------------------------------


class LauncherLog:
    """Drains the launcher's output into a file and keeps each line with its arrival time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lines: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self._file = open(path, "w", encoding="utf-8", errors="replace")
        self._thread: threading.Thread | None = None

    def follow(self, stream: Any) -> None:
        self._thread = threading.Thread(target=self._drain, args=(stream,), name="launcher-log", daemon=True)
        self._thread.start()

    def _drain(self, stream: Any) -> None:
        for line in stream:
            now = time.monotonic()
            with self._lock:
                self._lines.append((now, line.rstrip("\n")))
                self._file.write(line)
                self._file.flush()

    def since(self, t: float, until: float = math.inf) -> list[tuple[float, str]]:
        with self._lock:
            return [(at, line) for at, line in self._lines if t <= at <= until]

    def first(self, t: float, pattern: re.Pattern[str]) -> float | None:
        """Arrival time of the first line after ``t`` that matches ``pattern``."""
        return next((at for at, line in self.since(t) if pattern.search(line)), None)

    def tail(self, n: int = 40) -> list[str]:
        with self._lock:
            return [line for _, line in self._lines[-n:]]

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            self._file.close()


# --- processes ----------------------------------------------------------------------------


def children(pid: int) -> list[tuple[int, list[str]]]:
    """(pid, argv) of each live child of ``pid``, from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) != pid or fields[0] == "Z":  # ppid; a zombie is dead already
                continue
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace").split("\0")
            out.append((int(entry), [a for a in argv if a]))
    return out


def pserver_pid(launcher: int, index: int, *, not_pid: int | None = None) -> int | None:
    """The launcher's child running ``pdps pserver --index <index>`` (other than ``not_pid``)."""
    for pid, argv in children(launcher):
        if pid == not_pid or "pserver" not in argv:
            continue
        i = argv.index("--index") if "--index" in argv else -1
        if 0 <= i < len(argv) - 1 and argv[i + 1] == str(index):
            return pid
    return None


def cpu_times() -> tuple[int, int]:
    """(idle + iowait, total) jiffies of the whole machine, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return fields[3] + fields[4], sum(fields)


def restart_seconds(samples: int) -> list[float]:
    """Wall times of ``python -c "import torch, pdps"``, after one untimed run (warms the page cache)."""
    times = []
    for k in range(samples + 1):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch, pdps"], check=True, timeout=IMPORT_S, cwd=ROOT)
        if k:
            times.append(time.perf_counter() - t0)
    return times


# --- the store ----------------------------------------------------------------------------


class JobView:
    """What the benchmark reads of the job in the store."""

    def __init__(self, store: Any, keys: Keys) -> None:
        self.store = store
        self.keys = keys

    def _json(self, key: str) -> Any:
        kv = self.store.get(key)
        return None if kv is None else json.loads(kv.value)

    def epoch(self) -> dict[str, Any]:
        return self._json(self.keys.epoch) or {"epoch": 0, "round": 0, "checkpoint": None}

    def pointer(self) -> dict[str, Any] | None:
        return self._json(self.keys.checkpoint)

    def closed(self, epoch: int, round_no: int) -> bool:
        return self.store.get(self.keys.round_closed(epoch, round_no)) is not None

    def any_closed(self, epoch: int) -> int | None:
        """The lowest closed round of ``epoch``, or None."""
        entries = [self.keys.round_entry(kv.key) for kv in self.store.range(f"{self.keys.rounds}{epoch:06d}/")]
        rounds = [e[1] for e in entries if e is not None and e[2] is None]
        return min(rounds) if rounds else None

    def claim(self) -> Any:
        return self.store.get(self.keys.pserver(VICTIM))

    def newest_closed(self, epoch: int, closed: int) -> int:
        """The newest closed round of ``epoch``, from ``closed``, one known closed (rounds close in order)."""
        while self.closed(epoch, closed + 1):
            closed += 1
        return closed

    def slot_map(self) -> Any:
        return read_map(self.store, self.keys)

    def replicated(self) -> bool:
        """Every slot has all its copies and no resize (re-replication) is under way: a
        kill now is one a job with replicas survives without a rollback."""
        resize, _ = read_resize(self.store, self.keys)
        return not self.slot_map().under_replicated() and (resize is None or not resize.active)


def wait_for(what: str, timeout: float, poll: float, check: Any, launcher: subprocess.Popen) -> Any:
    """Call ``check()`` every ``poll`` seconds until it returns something truthy; its value."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if launcher.poll() is not None:
            raise BenchFailed(f"the launcher exited with {launcher.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise BenchFailed(f"no {what} after {timeout:.0f} s")
        time.sleep(poll)


def ready_checkpoint(view: JobView) -> dict[str, Any] | None:
    """The pointer, once it names a checkpoint of the current epoch taken after the epoch
    began and training has gone ``ROUNDS_PAST_CHECKPOINT`` rounds past it."""
    ep = view.epoch()
    ptr = view.pointer()
    if ptr is None or int(ptr["epoch"]) != int(ep["epoch"]) or int(ptr["round"]) <= int(ep.get("round", 0)):
        return None
    if not view.closed(int(ep["epoch"]), int(ptr["round"]) + ROUNDS_PAST_CHECKPOINT):
        return None
    return {"pointer": ptr, "epoch": ep, "closed": int(ptr["round"]) + ROUNDS_PAST_CHECKPOINT}


def ready_replicated(view: JobView, closed: int, poll: float, launcher: subprocess.Popen) -> dict[str, Any]:
    """With replicas: once every slot has all its copies again (the last kill's
    re-replication done) and training has gone ``ROUNDS_PAST_CHECKPOINT`` rounds past that.
    ``closed``: a round of the current epoch known closed (the rounds are probed from it)."""
    wait_for("every slot with all its copies (re-replication done)", CHECKPOINT_S, poll, view.replicated, launcher)
    ep = view.epoch()
    closed = view.newest_closed(int(ep["epoch"]), closed)
    wait_for("training after re-replication", CHECKPOINT_S, poll, lambda: view.closed(int(ep["epoch"]), closed + ROUNDS_PAST_CHECKPOINT), launcher)
    return {"pointer": view.pointer(), "epoch": ep, "closed": closed + ROUNDS_PAST_CHECKPOINT}


# --- one kill and recovery ----------------------------------------------------------------


def kill_and_recover(view: JobView, launcher: subprocess.Popen, log: LauncherLog, poll: float, repeat: int, *, replicas: int = 1, closed: int = 0) -> dict[str, Any]:
    """Kill pserver ``VICTIM`` once the job is ready for it, and time what follows.

    Ready once a checkpoint of the current epoch is followed by training. Replicas = 1:
    the kill rolls the job back to it, and training has resumed when a round of the new
    epoch closes. Replicas > 1: ready once every slot has all its copies too; a backup takes
    over with no rollback, and training has resumed when the round after the one under
    way at the kill closes (every trainer has pulled the round under way, from the slots'
    new primaries, and pushed the next one). ``closed``: a round of the current epoch
    known closed (where the replicated job's rounds are probed from).
    """
    timeout = STARTUP_S if repeat == 0 else CHECKPOINT_S
    # with replicas too: the first kill comes as late in the job as with one copy, not in its first rounds
    got = wait_for("checkpoint of the current epoch followed by training", timeout, poll, lambda: ready_checkpoint(view), launcher)
    if replicas > 1:
        got = ready_replicated(view, max(closed, got["closed"]), poll, launcher)
    ptr, ep = got["pointer"], got["epoch"]
    epoch_before = int(ep["epoch"])
    victim = wait_for(f"pserver {VICTIM} process", PID_S, poll, lambda: pserver_pid(launcher.pid, VICTIM), launcher)
    old = view.claim()
    if old is None:
        raise BenchFailed(f"ps/{VICTIM} is not claimed while the job trains")
    map_before = view.slot_map().version

    t0 = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    # the newest closed round, read after the kill: a round that closed meanwhile only makes the wait longer
    last = view.newest_closed(epoch_before, got["closed"])
    resumed_round = last + 2  # replicas: the round under way at the kill (last + 1) may have been pushed before it
    where = f"checkpoint {ptr['id']} (round {ptr['round']})" if ptr else "no checkpoint yet"
    say(f"repeat {repeat + 1}: killed pserver {VICTIM} (pid {victim}) after round {last} of epoch {epoch_before}; {where}")

    at: dict[str, float] = {}
    notes: list[str] = []
    epochs_seen: list[int] = []
    new_epoch: dict[str, Any] | None = None
    new_pid: int | None = None
    serving = re.compile(rf"^\[pserver-{VICTIM}\] .*serving \['init'")
    noticed = re.compile(rf"^\[trainer-\d+\] .*pserver {VICTIM} moved from")
    cpu0 = cpu_times()
    deadline = t0 + RECOVERY_S
    while "resumed" not in at:
        now = time.monotonic()
        if "respawned" not in at:
            new_pid = pserver_pid(launcher.pid, VICTIM, not_pid=victim)
            if new_pid is not None:
                at["respawned"] = now
        kv = view.claim()
        if "claimed" not in at:
            if kv is None:
                at.setdefault("claim_gone", now)
            elif kv.lease != old.lease:
                if "claim_gone" not in at:
                    at["claim_gone"] = now
                    notes.append("the free ps/1 was never seen between polls: claim gone = claimed")
                at["claimed"] = now
        if replicas > 1 and "failed_over" not in at and view.slot_map().version > map_before:
            at["failed_over"] = now
        ep = view.epoch()
        if int(ep["epoch"]) > epoch_before:
            if int(ep["epoch"]) not in epochs_seen:
                epochs_seen.append(int(ep["epoch"]))
            if "epoch" not in at:
                at["epoch"] = now
            new_epoch = ep
            if view.any_closed(int(ep["epoch"])) is not None:
                at["resumed"] = now
        elif view.closed(epoch_before, resumed_round):
            at["resumed"] = now
        for stage, pattern in (("serving", serving), ("noticed", noticed)):
            if stage not in at:
                line_at = log.first(t0, pattern)
                if line_at is not None:
                    at[stage] = line_at
        if "resumed" in at:
            break
        if launcher.poll() is not None:
            notes.append(f"the launcher exited with {launcher.returncode}")
            break
        if now > deadline:
            notes.append(f"not resumed {RECOVERY_S:.0f} s after the kill")
            break
        time.sleep(poll)
    t_end = time.monotonic()
    cpu1 = cpu_times()
    time.sleep(0.3)  # a log line relayed a little after the store showed its effect
    for stage, pattern in (("serving", serving), ("noticed", noticed)):
        if stage not in at:
            line_at = log.first(t0, pattern)
            if line_at is not None:
                at[stage] = line_at
    lines = [f"+{at_ - t0:7.3f}s {line}" for at_, line in log.since(t0 - 0.5, t_end + 0.5) if NOTEWORTHY.search(line)]
    return {
        "repeat": repeat + 1,
        "ok": "resumed" in at,
        "replicas": replicas,
        "killed_pid": victim,
        "new_pid": new_pid,
        "epoch_before": epoch_before,
        "checkpoint": ptr["id"] if ptr else None,
        "checkpoint_round": int(ptr["round"]) if ptr else None,
        "last_round_before_kill": last,
        "resumed_round": None if new_epoch else resumed_round,
        "rolled_back": bool(epochs_seen),
        "new_epoch": new_epoch,
        "epochs_seen": epochs_seen,
        "seconds": {stage: at[stage] - t0 for stage in STAGES if stage in at},
        "cpu_busy": 1.0 - (cpu1[0] - cpu0[0]) / max(1, cpu1[1] - cpu0[1]),
        "notes": notes,
        "log": lines,
    }


# --- the run ------------------------------------------------------------------------------


def launch_argv(store_url: str, checkpoint_dir: Path, lease_ttl: float, checkpoint_every: int, repeats: int, *, replicas: int = 1, job: str = JOB) -> list[str]:
    return [
        sys.executable, "-m", "pdps", "launch",
        "--store", store_url,
        "--job", job,
        "--trainers", str(TRAINERS),
        "--pservers", str(PSERVERS),
        "--replicas", str(replicas),
        "--mode", "sync",
        "--restart", "on-failure",
        "--max-restarts", str(repeats + 2),
        "--checkpoint-url", checkpoint_dir.as_uri(),
        "--checkpoint-every", str(checkpoint_every),
        "--lease-ttl", f"{lease_ttl:g}",
        "--passes", str(PASSES),
        "--grace", f"{GRACE_S:g}",
        "--timeout", f"{LAUNCH_TIMEOUT_S:g}",
        TARGET,
    ]  # fmt: skip


def stop_launcher(launcher: subprocess.Popen) -> int | None:
    """SIGTERM (the launcher stops its roles in order), SIGKILL if it hangs; its exit code."""
    if launcher.poll() is None:
        launcher.send_signal(signal.SIGTERM)
        try:
            launcher.wait(STOP_S)
        except subprocess.TimeoutExpired:
            say(f"the launcher ignored SIGTERM for {STOP_S:.0f} s; killing it (its roles get SIGTERM from the kernel)")
            launcher.kill()
            launcher.wait(10)
    return launcher.returncode


def recoveries(
    store_url: str, lease_ttl: float, repeats: int, checkpoint_every: int, *, replicas: int = 1, poll: float = 0.02, log_path: str | None = None, job: str = JOB
) -> dict[str, Any]:
    """Launch the job on the etcd at ``store_url``, kill pserver 1 ``repeats`` times and time
    each recovery: ``{"command_launch", "replicas", "results", "medians", "error", "log_tail",
    "launcher_exit"}`` (``medians``: of each stage over the repeats that resumed)."""
    workdir = Path(tempfile.mkdtemp(prefix="pdps-bench-recovery-"))
    log = LauncherLog(Path(log_path) if log_path else workdir / "launcher.log")
    results: list[dict[str, Any]] = []
    error: str | None = None
    launcher_rc: int | None = None
    argv: list[str] = []
    try:
        with contextlib.ExitStack() as stack:
            store = open_store(store_url)
            stack.callback(store.close)
            view = JobView(store, Keys(job))
            checkpoint_dir = workdir / "checkpoints"
            checkpoint_dir.mkdir()
            argv = launch_argv(store_url, checkpoint_dir, lease_ttl, checkpoint_every, repeats, replicas=replicas, job=job)
            say("starting: " + " ".join(shlex.quote(a) for a in argv))
            launcher = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
            log.follow(launcher.stdout)
            try:
                closed = 0
                for k in range(repeats):
                    r = kill_and_recover(view, launcher, log, poll, k, replicas=replicas, closed=closed)
                    results.append(r)
                    closed = r["resumed_round"] or 0  # where the next repeat probes the rounds from (same epoch)
                    s = r["seconds"]
                    say(f"repeat {k + 1}: " + ", ".join(f"{STAGE_LABELS[x]} {s[x]:.3f}" for x in STAGES if x in s) + (f"; {'; '.join(r['notes'])}" if r["notes"] else ""))
                    if not r["ok"]:
                        error = f"repeat {k + 1}: training did not resume ({'; '.join(r['notes']) or 'see the log'})"
                        break
            except BenchFailed as exc:
                error = str(exc)
            finally:
                launcher_rc = stop_launcher(launcher)
                log.close()
    finally:
        tail = log.tail(60) if error else []
        if log_path is None:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            shutil.rmtree(workdir / "checkpoints", ignore_errors=True)
            with contextlib.suppress(OSError):
                workdir.rmdir()
    ok = [r for r in results if r["ok"]]
    medians = {stage: statistics.median(r["seconds"][stage] for r in ok if stage in r["seconds"]) for stage in STAGES if any(stage in r["seconds"] for r in ok)}
    return {"command_launch": argv, "replicas": replicas, "results": results, "medians": medians, "error": error, "log_tail": tail, "launcher_exit": launcher_rc}


def run(
    lease_ttl: float = 2.0,
    repeats: int = 3,
    checkpoint_every: int = 20,
    *,
    restart_samples: int = 5,
    poll: float = 0.02,
    log_path: str | None = None,
) -> dict[str, Any]:
    """Kill pserver 1 ``repeats`` times and time each recovery; the results as a JSON-safe dict."""
    if lease_ttl <= 0 or repeats < 1 or checkpoint_every < 1 or restart_samples < 1 or poll <= 0:
        raise ValueError("lease_ttl, repeats, checkpoint_every, restart_samples and poll must be positive")
    from tests.servers import EtcdServer

    started = time.perf_counter()
    loadavg_start = list(os.getloadavg())
    say(f"baseline: {restart_samples} runs of python -c 'import torch, pdps' (after 1 untimed)")
    restart = restart_seconds(restart_samples)
    say(f"baseline: restart {statistics.median(restart):.3f} s (median)")
    with EtcdServer() as server:
        got = recoveries(server.url, lease_ttl, repeats, checkpoint_every, poll=poll, log_path=log_path)
    etcd_ttl = float(math.ceil(lease_ttl))
    restart_s = statistics.median(restart)
    medians = got["medians"]
    ratios = {}
    if "resumed" in medians:
        ratios = {
            "resumed_vs_ttl_plus_restart": medians["resumed"] / (etcd_ttl + restart_s),
            "resumed_vs_max_ttl_restart": medians["resumed"] / max(etcd_ttl, restart_s),
        }
    return {
        "bench": "recovery",
        "command_launch": got["command_launch"],
        "lease_ttl": lease_ttl,
        "lease_ttl_etcd": etcd_ttl,
        "repeats": repeats,
        "checkpoint_every": checkpoint_every,
        "trainers": TRAINERS,
        "pservers": PSERVERS,
        "victim": VICTIM,
        "poll_s": poll,
        "restart_s": restart,
        "restart_median_s": restart_s,
        "results": got["results"],
        "medians": medians,
        "ratios": ratios,
        "error": got["error"],
        "log_tail": got["log_tail"],
        "launcher_exit": got["launcher_exit"],
        "log_path": log_path,
        "machine": describe("torch", "grpcio", "pdps", etcd=etcd_version()),
        "loadavg_start": loadavg_start,
        "loadavg_end": list(os.getloadavg()),
        "total_s": time.perf_counter() - started,
    }


def etcd_version() -> str:
    exe = shutil.which("etcd")
    if exe is None:
        return "not installed"
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    m = re.search(r"etcd Version:\s*(\S+)", out)
    return m.group(1) if m else "unknown"


# --- reporting ----------------------------------------------------------------------------


def print_report(report: dict[str, Any], command: str) -> None:
    m = report["machine"]
    print(f"command: {command}")
    print(f"machine: {m['cpu_count']} CPUs ({m['cpu_model']}), Python {m['python']}, torch {m['torch']}, grpcio {m['grpcio']}, etcd {m['etcd']}")
    ls, le = report["loadavg_start"], report["loadavg_end"]
    print(f"load average (1/5/15 min) at start {ls[0]:.2f} {ls[1]:.2f} {ls[2]:.2f}, at end {le[0]:.2f} {le[1]:.2f} {le[2]:.2f}")
    print(
        f"job: {TARGET}, {report['trainers']} trainers, {report['pservers']} pservers, sync, checkpoint every {report['checkpoint_every']} rounds (file://), "
        f"lease TTL {report['lease_ttl']:g} s (etcd grants {report['lease_ttl_etcd']:g} s); pserver {report['victim']} SIGKILLed {report['repeats']} times; "
        f"etcd polled every {1000 * report['poll_s']:g} ms"
    )
    if ls[0] > m["cpu_count"]:
        print(f"CAUTION: the load average ({ls[0]:.1f}) exceeds the CPU count ({m['cpu_count']}): process starts are slow, the figures high")
    print()
    h = f"{'repeat':<7} {'ckpt round':>10} {'killed at':>9} " + " ".join(f"{STAGE_LABELS[s]:>10}" for s in STAGES) + f" {'epochs':>7} {'cpu busy':>8}"
    print(h)
    print("-" * len(h))
    for r in report["results"]:
        s = r["seconds"]
        cells = " ".join(f"{s[x]:>10.3f}" if x in s else f"{'-':>10}" for x in STAGES)
        print(f"{r['repeat']:<7} {r['checkpoint_round'] if r['checkpoint_round'] is not None else '-':>10} {r['last_round_before_kill']:>9} {cells} {','.join(map(str, r['epochs_seen'])) or '-':>7} {r['cpu_busy']:>8.0%}")
    med = report["medians"]
    if med:
        print(f"{'median':<7} {'':>10} {'':>9} " + " ".join(f"{med[x]:>10.3f}" if x in med else f"{'-':>10}" for x in STAGES))
    print("(seconds after the SIGKILL; ckpt round: the round the job rolls back to; killed at: the newest closed round")
    print(" read just after the kill; respawned: the launcher started a new pserver 1; claim gone: ps/1 expired; serving: the new")
    print(" pserver logged it serves; claimed: it holds ps/1; epoch: the rollback's new epoch record; noticed: a trainer")
    print(" logged that pserver 1 moved; resumed: a round of the new epoch closed; epochs: the epoch numbers seen after the")
    print(" kill; cpu busy: the whole machine's, from the kill to the resumption; failed over, with replicas only: the slot")
    print(" map changed, a backup promoted)")
    if med:
        pairs = [
            ("claim gone - kill", "claim_gone", None),
            ("claimed - claim gone", "claimed", "claim_gone"),
            ("epoch - claimed", "epoch", "claimed"),
            ("noticed - epoch", "noticed", "epoch"),
            ("resumed - noticed", "resumed", "noticed"),
        ]
        print("breakdown of the median: " + ", ".join(f"{name} {med[a] - (med[b] if b else 0.0):.3f} s" for name, a, b in pairs if a in med and (b is None or b in med)))
    print()
    rs = report["restart_s"]
    print(f"baseline lease TTL (detection)          {report['lease_ttl_etcd']:>7.3f} s")
    print(f"baseline process restart                {report['restart_median_s']:>7.3f} s  (python -c 'import torch, pdps', median of {len(rs)}: {', '.join(f'{x:.3f}' for x in rs)})")
    for key, label in (("resumed_vs_ttl_plus_restart", "resumed / (lease TTL + restart)"), ("resumed_vs_max_ttl_restart", "resumed / max(lease TTL, restart)")):
        if key in report["ratios"]:
            print(f"{label:<39} {report['ratios'][key]:>7.3f}")
    print("(1.0: recovery costs nothing beyond noticing the death and starting a process; the restart overlaps the TTL, so max() is the tighter floor)")
    for r in report["results"]:
        if r["notes"] or r["log"]:
            print(f"\nrepeat {r['repeat']}: what the launcher logged from the kill to the resumption (WARNING/ERROR/launcher lines, time after the kill):")
            for note in r["notes"]:
                print(f"  NOTE {note}")
            for line in r["log"][:60]:
                print(f"  {line}")
            if len(r["log"]) > 60:
                print(f"  ... {len(r['log']) - 60} more lines")
    if report["error"]:
        print(f"\nFAILED: {report['error']}")
        print("the launcher's last lines:")
        for line in report["log_tail"]:
            print(f"  {line}")
    print(f"\nlauncher exit code after SIGTERM: {report['launcher_exit']}" + (f"; its whole log: {report['log_path']}" if report["log_path"] else ""))
    print(f"total run time {report['total_s']:.1f} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lease-ttl", type=float, default=2.0, help="the job's lease TTL in seconds (default 2.0; etcd rounds up to whole seconds)")
    p.add_argument("--repeats", type=int, default=3, help="kills of pserver 1, each after a fresh checkpoint (default 3)")
    p.add_argument("--checkpoint-every", type=int, default=20, help="sync rounds between checkpoints (default 20)")
    p.add_argument("--restart-samples", type=int, default=5, help="timed runs of python -c 'import torch, pdps' (default 5)")
    p.add_argument("--poll", type=float, default=0.02, help="seconds between polls of etcd after a kill (default 0.02)")
    p.add_argument("--log", metavar="FILE", help="keep the launcher's whole output in FILE")
    p.add_argument("--json", action="store_true", help="also print the results as one JSON object on the last stdout line")
    args = p.parse_args(argv)
    command = " ".join(shlex.quote(a) for a in [sys.executable, *(sys.argv if argv is None else [sys.argv[0], *argv])])
    report = run(args.lease_ttl, args.repeats, args.checkpoint_every, restart_samples=args.restart_samples, poll=args.poll, log_path=args.log)
    report["command"] = command
    print_report(report, command)
    if args.json:
        print(json.dumps(report, sort_keys=True), flush=True)
    return 1 if report["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
