"""Issue 16's acceptance: a resized job trains as if it had not been resized.

* Sync, over gRPC and etcd, every role its own ``python -m pdps ROLE`` process (started
  by the test as an operator or a StatefulSet would): one job resized 2->3->1->2
  pservers, then 3->2->4 trainers (the surplus trainer leaves by itself), at seeded
  points mid-pass, the final parameters equal a single-process replay of the rounds'
  contributions, and the audit counts every record of every pass exactly once.
* Async: the same pserver resizes lose no acknowledged push: per slot, what the
  pservers applied (counts travel with their slots) equals what the trainers were told.
* Each resize sends the fewest bytes the two maps allow (values and Adam's state).
"""

from __future__ import annotations

import collections
import json
import os
import random
import subprocess
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import pdps
from pdps.adapters.grpc_transport import GrpcTransport
from pdps.adapters.parquet import write_parquet_shards
from pdps.core.elastic import minimum_bytes
from pdps.core.job import Keys
from pdps.core.slots import Layout, ParamSpec
from pdps.registry import connect_store
from pdps.runtime.resizing import read_map
from pdps.shell.status import job_config, pass_audit
from tests.integration.jobkit import start_job
from tests.integration.test_elastic import resize, source  # noqa: F401 - source is a fixture
from tests.integration.test_processes import procs, wait_until  # noqa: F401 - procs is a fixture
from tests.integration.test_transactional_sync import LR, closed_rounds, make_model, replay

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[2]
TARGET = Path(__file__).parent / "targets" / "replayable.py"
#: the seeded points; PDPS_TEST_SEED=<n> replays another run's
SEED = int(os.environ.get("PDPS_TEST_SEED", "16"))
ROWS, ROW_GROUP, BATCH, PASSES = 720, 40, 10, 2
#: seconds a trainer sleeps after each step: while a resize is asked for and its roles
#: start, and otherwise (72 rounds a pass with 2 trainers)
SLOW, FAST = 1.0, 0.05


@pytest.fixture
def dataset(tmp_path) -> str:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(ROWS, 4))
    y = np.stack([x[:, 0] - x[:, 1], x[:, 2] * x[:, 3]], axis=1)
    url = f"{tmp_path.as_uri()}/d"
    write_parquet_shards({"x": x, "y": y}, url, shards=3, row_group_size=ROW_GROUP)
    return url


class Job:
    """A sync job as role processes started one by one (``python -m pdps ROLE``, as an
    operator or a StatefulSet starts them): a float64 SGD job of :func:`make_model` with
    fine blocks and every round kept; its trainers run the replayable target."""

    def __init__(
        self, procs, url: str, dataset: str, out: Path, *, trainers: int, pservers: int, settings: tuple[str, ...] = (), entry: str = "recorded"
    ) -> None:
        """``settings``: more master flags (a flag given again overrides the one above);
        ``entry``: the trainers' function in the replayable target."""
        self.url, self.out, self.name, self.entry = url, out, f"acc-{uuid.uuid4().hex[:8]}", entry
        self._pace = out.parent / "pace"
        self.pace(FAST)
        self._procs, self._common = procs, ("--store", url, "--job", self.name)
        self._env = {
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),  # the target imports tests.*
            "GRADS_OUT": str(out), "STEP_PACE": str(self._pace),
        }  # fmt: skip
        self.master = procs(
            "master", *self._common, "--dataset", dataset, "--mode", "sync", "--trainers", str(trainers),
            "--pservers", str(pservers), "--passes", str(PASSES), "--batch-size", str(BATCH), "--optimizer", "SGD",
            "--lr", str(LR), "--num-slots", "16", "--min-block", "1", "--keep-rounds", "100000", "--lease-ttl", "2",
            "--task-timeout", "60", *settings,
        )  # fmt: skip
        self.pservers: list[subprocess.Popen] = []
        self.trainers: list[subprocess.Popen] = []
        self._named = 0
        for _ in range(pservers):
            self.add_pserver()
        for _ in range(trainers):
            self.add_trainer()

    def add_pserver(self, index: int | None = None) -> subprocess.Popen:
        """A pserver process; ``index``: the one it claims (as a StatefulSet's pod does)."""
        self.pservers.append(self._procs("pserver", *self._common, *(() if index is None else ("--index", str(index)))))
        return self.pservers[-1]

    def add_trainer(self) -> None:
        self.trainers.append(self._procs("trainer", *self._common, "--trainer-id", f"trainer-{self._named}", f"{TARGET}:{self.entry}", env=self._env))
        self._named += 1

    def pace(self, seconds: float) -> None:
        """Seconds each trainer sleeps after each step from now on."""
        part = self._pace.with_suffix(".part")
        part.write_text(str(seconds))
        os.replace(part, self._pace)

    def alive(self, roles: list[subprocess.Popen]) -> list[subprocess.Popen]:
        return [p for p in roles if p.poll() is None]

    def steps(self) -> int:
        """Steps applied so far (each trainer saves one file per step)."""
        return sum(1 for p in self.out.iterdir() if p.suffix == ".f64")

    def after_steps(self, k: int, timeout: float = 90.0) -> None:
        """Wait until ``k`` more steps were applied."""
        target, deadline = self.steps() + k, time.monotonic() + timeout
        while self.steps() < target:
            assert self.master.poll() is None, f"the job ended before {k} more steps"
            assert time.monotonic() < deadline, f"no {k} more steps in {timeout:.0f}s"
            time.sleep(0.02)

    def scale(self, *, pservers: int | None = None, trainers: int | None = None) -> dict:
        """Ask with :func:`pdps.scale` (``wait=True``) and, once the request is in, start
        the roles it adds; then wait until those it removes have left, each exit 0. The
        trainers go slowly meanwhile (the job must not end before the new roles start)."""
        self.pace(SLOW)
        asked: list = []
        asker = threading.Thread(target=lambda: asked.append(pdps.scale(self.url, job=self.name, pservers=pservers, trainers=trainers, wait=True, timeout=90)))
        asker.start()
        store, keys = connect_store(self.url), Keys(self.name)
        try:
            key, want = (keys.ps_desired, pservers) if pservers is not None else (keys.trainers_desired, trainers)
            wait_until(lambda: (kv := store.get(key)) is not None and int(kv.value) == want, 30, f"the request for {want}")
        finally:
            store.close()
        roles, add = (self.pservers, self.add_pserver) if pservers is not None else (self.trainers, self.add_trainer)
        for _ in range(want - len(self.alive(roles))):
            add()
        asker.join(timeout=100)
        assert asked, "pdps.scale did not return"
        wait_until(lambda: len(self.alive(roles)) == want, 60, f"{want} to take part")
        assert all(p.returncode == 0 for p in roles if p.poll() is not None), [p.returncode for p in roles]
        if trainers is None:
            self.pace(FAST)
        return asked[0]

    def finish(self) -> dict:
        """Wait for the trainers and the master to end (exit 0); the final parameters."""
        for p in [*self.trainers, self.master]:
            assert p.wait(timeout=150) == 0, f"{p.args[3:]} exited {p.returncode}"
        store = connect_store(self.url)
        try:
            return pdps.fetch_parameters(store, GrpcTransport(connect_timeout=2), job_config(store, self.name))
        finally:
            store.close()


def check_replay_and_audit(url: str, name: str, out: Path, params: dict, kept=None) -> list:
    """The job's final parameters equal a replay of its closed rounds with the gradients
    the trainers saved, and every record of every pass was trained exactly once; the
    rounds replayed. ``kept(store, rounds)``: those of the timeline the job kept (after
    a rollback; default: all)."""
    store = connect_store(url)
    try:
        rounds = closed_rounds(store, name)
        rounds = rounds if kept is None else kept(store, rounds)
        audits = [pass_audit(store, name, p) for p in range(PASSES)]
    finally:
        store.close()
    grads = {}
    for path in out.glob("*.f64"):
        epoch, round_no, trainer = path.stem.split("-", 2)
        grads[(int(epoch), int(round_no), trainer)] = torch.from_numpy(np.fromfile(path, dtype=np.float64))
    final = torch.cat([params[n].reshape(-1) for n, _ in make_model().named_parameters()])
    torch.testing.assert_close(final, replay(rounds, grads), rtol=0, atol=1e-10)
    for audit in audits:
        assert audit["summary"]["records_trained"] == ROWS, audit["summary"]
        assert audit["summary"]["records_trained_more_than_once"] == 0 and audit["summary"]["failed"] == 0, audit["summary"]
        assert all(e["record_counts"] == [[1, ROW_GROUP]] for e in audit["entries"]), audit["entries"]
    return rounds


def seeded_points(n: int) -> list[int]:
    rng = random.Random(SEED)
    points = [rng.randrange(3, 12) for _ in range(n)]
    print(f"seed {SEED} (PDPS_TEST_SEED): resizes after {points} more steps")
    return points


def test_processes_resized_2_3_1_2_pservers_then_3_2_4_trainers_equal_a_replay(etcd_server, dataset, procs, tmp_path):
    """One job of processes, 3 trainers: its pserver processes grown and shrunk by
    ``pdps.scale`` 2->3->1->2 while the trainer processes train; then its trainers 3->2->4.
    Fewer trainers wanted: the surplus one gives its task back and exits 0 by itself;
    more wanted: the trainer processes started for them join at the next round. Each
    pserver resize switched the map at one round boundary; every trainer contributed."""
    out = tmp_path / "grads"
    out.mkdir()
    job = Job(procs, etcd_server.url, dataset, out, trainers=3, pservers=2)
    for k, pservers in zip(seeded_points(3), (3, 1, 2)):
        job.after_steps(k)
        record = job.scale(pservers=pservers)
        assert record["state"] == "done" and record["pservers"] == pservers, record
    for k, trainers in zip(seeded_points(2), (2, 4)):
        job.after_steps(k)
        record = job.scale(trainers=trainers)
        assert record["state"] == "done" and record["trainers"] == trainers, record
        joined = {f"trainer-{i}" for i in range(3, trainers)}
        wait_until(lambda: joined <= {p.stem.split("-", 2)[2] for p in out.glob("*.f64")}, 90, f"{sorted(joined)} to step")
        job.pace(FAST)
    assert job.trainers[2].returncode == 0  # trainer-2, the surplus of 3 when 2 were wanted
    params = job.finish()
    rounds = check_replay_and_audit(etcd_server.url, job.name, out, params)
    switched = [r.map_version for _, r in rounds if r.map_version is not None]
    assert len(switched) == 3, switched  # each pserver resize switched the map at one round boundary
    contributed = {t for _, r in rounds for t, _ in r.weights()}
    assert contributed == {f"trainer-{i}" for i in range(5)}, contributed


# --- in process: counts and bytes the pservers keep ------------------------------------


def train_threads(job, trainers: int, delay: float):
    """``trainers`` trainers of ``job`` running a plain loop in threads: the contexts, the
    threads (started), a step counter and the errors they raised."""
    steps = collections.Counter()
    errors: list[BaseException] = []
    lock = threading.Lock()

    def train(ctx: pdps.TrainerContext) -> None:
        try:
            model = ctx.attach(make_model())
            for batch in ctx.batches():
                ctx.step(F.mse_loss(model(batch["x"]), batch["y"]))
                with lock:
                    steps[ctx.trainer_id] += 1
                time.sleep(delay)
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    contexts = [job.trainer(f"t{i}") for i in range(trainers)]
    for ctx in contexts:
        ctx.patience = 15.0  # an unreachable pserver is an error well within the test's time
        ctx.register()
    threads = [threading.Thread(target=train, args=(ctx,), daemon=True) for ctx in contexts]
    for th in threads:
        th.start()
    return contexts, threads, steps, errors


def wait_steps(steps: collections.Counter, errors: list, k: int, timeout: float = 30.0) -> None:
    target, deadline = sum(steps.values()) + k, time.monotonic() + timeout
    while sum(steps.values()) < target:
        assert not errors, errors
        assert time.monotonic() < deadline, f"no {k} more steps in {timeout:.0f}s"
        time.sleep(0.01)


def test_async_resizes_lose_no_acknowledged_push(source):
    """Resized 2->3->1->2 in async mode: per slot, the pushes the pservers applied (a
    departing pserver's counts travel with its slots) equal those the trainers were told
    were applied."""
    job = start_job(source, name="elastic-async", mode="async", pservers=2, min_block=1, num_slots=16, lease_ttl=2.0,
                    optimizer_args={"lr": LR}, batch_size=10, passes=2, task_timeout=60.0)  # fmt: skip
    everyone = list(job.pservers)
    try:
        contexts, threads, steps, errors = train_threads(job, 2, delay=0.02)
        for k, pservers in zip(seeded_points(3), (3, 1, 2)):
            wait_steps(steps, errors, k)
            resize(job, pservers)
            everyone += [ps for ps in job.pservers if ps not in everyone]
        last_resize_at = sum(steps.values())
        for th in threads:
            th.join(timeout=60)
        assert not errors, errors
        assert not any(th.is_alive() for th in threads)
        assert sum(steps.values()) > last_resize_at  # the resizes happened while the job trained
        assert all(ctx.map_changes == 3 for ctx in contexts), [ctx.map_changes for ctx in contexts]
        acknowledged = sum((ctx.acknowledged for ctx in contexts), collections.Counter())
        applied = collections.Counter()
        for ps in everyone:
            applied.update(ps.applied_by_slot)
        assert +applied == +acknowledged and acknowledged
        departed = [ps for ps in everyone if ps.departed.is_set()]
        assert len(departed) == 2 and not any(sum(ps.applied_by_slot.values()) for ps in departed)
    finally:
        job.close()


def test_each_resize_sends_the_fewest_bytes_the_maps_allow(source):
    """Sync, Adam: each of 2->3->1->2 sends each moving block's values, exp_avg and
    exp_avg_sq once, plus at most one 0-d tensor per moving block (Adam's ``step``):
    :func:`minimum_bytes` with ``state_copies=3``, within that overhead."""
    job = start_job(source, name="elastic-bytes", mode="sync", pservers=2, min_block=1, num_slots=16, lease_ttl=2.0,
                    optimizer="Adam", optimizer_args={"lr": 0.01}, batch_size=10, passes=2, task_timeout=60.0)  # fmt: skip
    keys = Keys(job.config.name)
    everyone = list(job.pservers)
    try:
        contexts, threads, steps, errors = train_threads(job, 2, delay=0.01)
        specs = None
        for k, pservers in zip(seeded_points(3), (3, 1, 2)):
            wait_steps(steps, errors, k)
            specs = specs or [ParamSpec.from_json(d) for d in json.loads(job.store.get(keys.model).value)]
            before = read_map(job.store, keys)
            sent, received = sum(ps.sent_bytes for ps in everyone), sum(ps.received_bytes for ps in everyone)
            resize(job, pservers)
            everyone += [ps for ps in job.pservers if ps not in everyone]
            after = read_map(job.store, keys)
            sent = sum(ps.sent_bytes for ps in everyone) - sent
            received = sum(ps.received_bytes for ps in everyone) - received
            layout = Layout.build(specs, before, job.config.min_block)
            minimum = minimum_bytes(layout, after, state_copies=3)
            moving = {slot for slot, _, _ in before.moves(after)}
            moving_blocks = sum(1 for slot in layout.slots if slot in moving)
            print(f"{before.num_pservers}->{after.num_pservers}: sent {sent} B, received {received} B, minimum {minimum} B, {moving_blocks} blocks moved")
            assert minimum > 0 and sent == received
            assert minimum <= sent <= minimum + 8 * moving_blocks  # measured: + 4 B per block (a float32 step)
        for th in threads:
            th.join(timeout=60)
        assert not errors, errors
    finally:
        job.close()
