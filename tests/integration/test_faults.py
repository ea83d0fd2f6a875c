"""Fault injection: a multi-process job over gRPC and etcd, run by ``pdps launch
--restart on-failure``, with roles SIGKILLed at seeded points inside passes.

Each run trains the digits example for a few passes with coordinated checkpoints to a
local directory. Under each of three seeds one job has the master, pserver 1 and
trainer 0 killed, each at its own seeded point of a different pass; pserver 1 is
killed once more, in another job, in the middle of writing its checkpoint part.
Every run must finish all its passes, reach held-out accuracy 0.95, account for
every task of every pass in the audit as done or failed, and leave only committed
checkpoints that pass their checksums. The third seed's job runs on an etcd of its
own, which is restarted under it after the three kills.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from pdps.adapters import safetensors_files as files
from pdps.core.job import Keys, decode_json
from pdps.registry import open_storage, open_store
from pdps.runtime import recovery
from pdps.shell.status import job_status, pass_audit
from tests.integration.jobkit import leftovers_on_disk
from tests.servers import EtcdServer

pytestmark = pytest.mark.integration

PASSES = 10
LR = "0.005"  # Adam, batch 64: 10 passes reach 0.967-0.969 without faults (5 runs)
BATCH = "64"
CHECKPOINT_EVERY = 5  # sync rounds; a pass of digits with 2 trainers is about 19 rounds
LEASE_TTL = "2"


def children(pid: int) -> list[tuple[int, list[str]]]:
    """(pid, argv) of the live child processes of ``pid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != pid:
                continue
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            out.append((int(entry.name), [a.decode() for a in argv if a]))
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
    return out


def role_pid(launcher: subprocess.Popen, role: str) -> int | None:
    """The pid of ``master``, ``pserver-<i>`` or ``trainer-<i>`` among the launcher's children."""
    kind, _, index = role.partition("-")
    for pid, argv in children(launcher.pid):
        if kind not in argv[2:4]:
            continue
        if kind == "master":
            return pid
        if kind == "pserver" and argv[argv.index("--index") + 1] == index:
            return pid
        if kind == "trainer" and argv[argv.index("--trainer-id") + 1].split("-r")[0] == f"trainer-{index}":
            return pid
    return None


class Job:
    """One ``pdps launch`` of the digits example on its own job and checkpoint directory."""

    def __init__(self, store_url: str, tmp_path: Path, *, env: dict[str, str] | None = None, settings: list[str] | None = None) -> None:
        """``settings``: the launch flags and target after ``--store``, ``--job`` and
        ``--checkpoint-url`` (default: the digits job of these tests)."""
        self.name = f"f-{uuid.uuid4().hex[:8]}"
        self.store_url = store_url
        self.checkpoints = (tmp_path / "ckpt").as_uri()
        self.log = tmp_path / "launch.log"
        if settings is None:
            settings = [
                "--trainers", "2", "--pservers", "2", "--mode", "sync", "--passes", str(PASSES), "--lr", LR, "--batch-size", BATCH,
                "--lease-ttl", LEASE_TTL, "--task-timeout", "60", "--restart", "on-failure", "--max-restarts", "3",
                "--checkpoint-every", str(CHECKPOINT_EVERY), "--timeout", "240", "--json", "pdps.examples.digits:train",
            ]  # fmt: skip
        args = [sys.executable, "-m", "pdps", "launch", "--store", store_url, "--job", self.name, "--checkpoint-url", self.checkpoints, *settings]
        self._err = self.log.open("w")
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self._err, text=True, env={**os.environ, **(env or {})})
        self.store = open_store(store_url)
        self.keys = Keys(self.name)

    def status(self) -> dict | None:
        try:
            return job_status(self.store, self.name)
        except Exception:  # not created yet, or the store is away: ask again
            return None

    def wait_for(self, predicate, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the job ended (exit {self.proc.returncode}) before {what}:\n{self.tail()}")
            value = predicate()
            if value:
                return value
            time.sleep(0.02)
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}:\n{self.tail()}")

    def kill(self, role: str) -> int:
        pid = self.wait_for(lambda: role_pid(self.proc, role), 30, f"{role}'s process")
        os.kill(pid, signal.SIGKILL)
        return pid

    def finish(self, timeout: float = 280) -> dict:
        out, _ = self.proc.communicate(timeout=timeout)
        self._err.close()
        assert self.proc.returncode == 0, f"launch exited {self.proc.returncode}:\n{self.tail()}"
        return json.loads(out.strip().splitlines()[-1])

    def tail(self, n: int = 6000) -> str:
        if not self._err.closed:
            self._err.flush()
        return self.log.read_text()[-n:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._err.close()
        self.store.close()


def at_point(job: Job, target_pass: int, fraction: float) -> tuple[int, float]:
    """Wait until pass ``target_pass`` has ``fraction`` of its tasks done (or a later pass began)."""

    def reached() -> bool:
        st = job.status()
        if st is None or st.get("tasks") is None:
            return False
        return st["pass"] > target_pass or (st["pass"] == target_pass and st["done"] >= fraction * st["tasks"])

    job.wait_for(reached, 180, f"pass {target_pass} at {fraction:.0%}")
    return target_pass, fraction


def check_run(job: Job, summary: dict) -> None:
    """The bar every faulty run must clear."""
    assert summary["passes"] == PASSES, summary
    assert summary["accuracy"] >= 0.95, summary
    tasks = job.status()["tasks"]
    for p in range(PASSES):
        audit = pass_audit(job.store, job.name, p)
        outcomes = {e["task"]: e["outcome"] for e in audit["entries"]}
        assert len(outcomes) == tasks and set(outcomes.values()) <= {"done", "failed"}, (p, audit["summary"])
    storage = open_storage(job.checkpoints)
    history = recovery.committed_ids(job.store, job.keys)
    assert history, "no checkpoint was committed"
    for ckpt in history:
        assert files.verify(storage, files.read_manifest(storage, ckpt)) == [], ckpt


def seeded_kills(seed: int, points: int = 3) -> list[tuple[str, int, float]]:
    """(role, pass, fraction) for each of the master, pserver 1 and trainer 0, in the order
    they are killed, then (``points`` = 4) ``"etcd"``: different passes in 1..PASSES-3,
    each at a seeded fraction of its tasks; seeds 1, 2 and 3 put each role first, second
    and last once."""
    rng = random.Random(seed)
    roles = ["master", "pserver-1", "trainer-0"]
    roles = [*roles[seed % 3 :], *roles[: seed % 3], "etcd"][:points]
    passes = sorted(rng.sample(range(1, PASSES - 2), points))
    return [(role, p, rng.uniform(0.2, 0.8)) for role, p in zip(roles, passes)]


def kill_each_role(job: Job, kills: list[tuple[str, int, float]]) -> list[int]:
    """SIGKILL each role at its point, waiting for the launcher to restart it before the
    next; the job's epoch at each point (before each kill)."""
    epochs = []
    for role, target_pass, fraction in kills:
        at_point(job, target_pass, fraction)
        epochs.append(recovery.read_epoch(job.store, job.keys)[0].epoch)
        killed = job.kill(role)
        job.wait_for(lambda: role_pid(job.proc, role) not in (None, killed), 60, f"{role} restarted")
    return epochs


def check_kills(job: Job, kills: list[tuple[str, int, float]], epochs: list[int]) -> None:
    """Each role was restarted, and only a pserver's loss rolled the job back: ``epochs``,
    read at each kill's point and once after the last kill's effects (at the next point,
    or at the end), rise by one across the pserver's kill and by none across the others'."""
    log = job.tail(10**7)
    for (role, _, _), before, after in zip(kills, epochs, epochs[1:]):
        assert f"{role} exited with signal SIGKILL; restarting it" in log, role
        assert after - before == (1 if role.startswith("pserver") else 0), (role, epochs)  # only a pserver's loss rolls back


@pytest.mark.parametrize("seed", [1])
def test_job_survives_a_sigkill_of_each_role(etcd_server, tmp_path, seed):
    """One job per seed; each role is SIGKILLed once, at its own seeded point, a pass
    after the last kill at least (so each role's restart, and a pserver's rollback, is
    over before the next kill). Each is restarted, and only a pserver's loss rolls the
    job back. (Seed 3's job is the etcd restart's, below: seeds 1 and 3 kill the roles
    in two of the three rotations; seed 2, the third, is left out for the suite's time.)"""
    kills = seeded_kills(seed)
    print(f"seed {seed}: kills (role, pass, fraction) {kills}")
    job = Job(etcd_server.url, tmp_path)
    try:
        epochs = kill_each_role(job, kills)
        summary = job.finish()
        check_run(job, summary)
        epochs.append(recovery.read_epoch(job.store, job.keys)[0].epoch)
        check_kills(job, kills, epochs)
    finally:
        job.close()


def test_pserver_killed_while_writing_its_checkpoint_part(etcd_server, tmp_path):
    """Pservers pause between writing their part and recording it (a fault-injection
    hook); pserver 1 is killed in that pause. That checkpoint never commits, the job
    rolls back to the previous one, and the half-written one's files are deleted."""
    job = Job(etcd_server.url, tmp_path, env={"_PDPS_FAULT_CHECKPOINT_DELAY": "1.5"})
    storage = open_storage(job.checkpoints)
    try:
        job.wait_for(lambda: recovery.committed_ids(job.store, job.keys), 120, "a first committed checkpoint")

        def half_written() -> str | None:
            for kv in job.store.range(job.keys.checkpoints):
                if not kv.key.endswith("/info") or decode_json(kv.value, kv.key).get("state") != "writing":
                    continue
                ckpt = decode_json(kv.value, kv.key)["id"]
                written = storage.exists(f"{ckpt}/ps-1.safetensors")
                if written and job.store.get(job.keys.checkpoint_part(ckpt, "ps-1")) is None:
                    return ckpt
            return None

        ckpt = job.wait_for(half_written, 120, "pserver 1 between writing and recording its part")
        job.kill("pserver-1")
        assert job.store.get(job.keys.checkpoint_part(ckpt, "ps-1")) is None, "killed after all: the hook's pause was missed"
        summary = job.finish()
        check_run(job, summary)
        epoch, _ = recovery.read_epoch(job.store, job.keys)
        assert epoch.epoch == 1 and epoch.checkpoint != ckpt
        assert ckpt not in recovery.committed_ids(job.store, job.keys)
        assert ckpt not in files.list_ids(storage), "the half-written checkpoint's parts were cleaned up"
        assert leftovers_on_disk(tmp_path / "ckpt") == [], "and its folder; no temporary file is left anywhere"
    finally:
        job.close()


def test_etcd_restart_pauses_the_roles_and_they_resume(tmp_path):
    """The job of seed 3 on an etcd of its own: its three roles SIGKILLed in turn, as
    above; then, a pass later at least, etcd goes away for a few seconds in the middle
    of a pass and comes back on the same port and data: every role pauses (retrying),
    then the job carries on."""
    kills = seeded_kills(3, points=4)
    print(f"seed 3: kills (role, pass, fraction) {kills}")
    *kills, (_, outage_pass, outage_fraction) = kills
    with EtcdServer() as etcd:
        job = Job(etcd.url, tmp_path)
        try:
            epochs = kill_each_role(job, kills)
            at_point(job, outage_pass, outage_fraction)
            epochs.append(recovery.read_epoch(job.store, job.keys)[0].epoch)
            etcd.kill()
            time.sleep(8.0)  # longer than a lease TTL and than a store call's 5 s deadline
            etcd.restart()
            summary = job.finish()
            check_run(job, summary)
            check_kills(job, kills, epochs)
            log = job.tail(10**7)
            assert "coordination store" in log and "unreachable" in log, "the roles said they were waiting for the store"
            assert "is back after" in log
        finally:
            job.close()
