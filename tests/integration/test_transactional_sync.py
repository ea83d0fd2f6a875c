"""Sync-SGD steps are transactions across pservers, and the barrier survives trainer loss.

A trainer's gradient for round k is applied on every pserver or on none
(:class:`pdps.core.sgd.RoundRecord`); a trainer that dies stops being waited for once
its lease expires. The checks are exact: the final parameters equal a single-process
replay, in float64, of the gradients the round records say were applied.
"""

from __future__ import annotations

import collections
import threading
import time
import uuid

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pdps
from pdps.adapters.memory_store import MemoryStore
from pdps.adapters.parquet import ParquetSource, write_parquet_shards
from pdps.core.errors import Timeout
from pdps.core.job import Keys
from pdps.core.sgd import RoundRecord
from pdps.ports.coordination import Put
from pdps.runtime.counting import CountingStore
from pdps.runtime.rounds import read_round
from pdps.ports.transport import Message
from tests.integration.jobkit import start_job

LR = 0.05


def make_model() -> nn.Module:
    g = torch.Generator().manual_seed(99)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.5, 0.5, generator=g)
    return model


@pytest.fixture
def source(tmp_path) -> ParquetSource:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(480, 4))
    y = np.stack([x[:, 0] - x[:, 1], x[:, 2] * x[:, 3]], axis=1)
    write_parquet_shards({"x": x, "y": y}, f"{tmp_path.as_uri()}/d", shards=3, row_group_size=20)
    return ParquetSource(f"{tmp_path.as_uri()}/d")


def flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()


def closed_rounds(store, job: str) -> list[tuple[int, RoundRecord]]:
    keys = Keys(job)
    out = []
    for kv in store.range(keys.rounds):
        entry = keys.round_entry(kv.key)
        if entry is not None and entry[2] is None:  # a close marker
            epoch, round_no, _ = entry
            record = read_round(store, keys, epoch, round_no)
            assert record is not None and record.closed
            out.append((epoch, record))
    return sorted(out, key=lambda er: (er[0], er[1].round_no))


def replay(rounds, grads: dict[tuple[int, int, str], torch.Tensor]) -> torch.Tensor:
    """Plain SGD over the applied rounds, each the sample-weighted mean of its gradients."""
    params = torch.cat([p.detach().reshape(-1) for p in make_model().parameters()])
    for epoch, record in rounds:
        weights = record.weights()
        if not weights:
            continue
        g = sum(w * grads[(epoch, record.round_no, t)] for t, w in weights)
        params = params - LR * g
    return params


def test_gradient_of_a_trainer_that_died_between_its_pushes_is_applied_nowhere(source):
    job = start_job(source, name="half", mode="sync", pservers=2, min_block=1, num_slots=8, lease_ttl=1.0, optimizer_args={"lr": LR})
    try:
        a, b = job.trainer("a"), job.trainer("b")
        a.register()
        b.register()
        models = {}
        # sync trainers join the first round together: attach them side by side
        threads = [threading.Thread(target=lambda c=c: models.__setitem__(c.trainer_id, c.attach(make_model()))) for c in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        ma, mb = models["a"], models["b"]
        x = torch.randn(5, 4, dtype=torch.float64)
        # a: backward, then a push that reaches pserver 0 only, then a crash
        F.mse_loss(ma(x), torch.zeros(5, 2, dtype=torch.float64)).backward()
        part0 = a._group.parts[0]
        meta = {"trainer": "a", "round": part0.round_no, "samples": 5, "blocks": part0.keys, "epoch": a.epoch}
        a._group.call(part0, "push", Message(meta, a._replica.grads(part0.blocks)))
        assert "a" in job.pservers[0]._shard.staged()
        a.leave(crashed=True)
        # b: a whole step; the round closes without a once a's lease runs out
        F.mse_loss(mb(x * 2), torch.ones(5, 2, dtype=torch.float64)).backward()
        g_b = flat_grad(mb)
        start = time.monotonic()
        b._sync_round(5)  # push, commit, pull: what ctx.step does after backward
        waited = time.monotonic() - start
        expect = torch.cat([p.detach().reshape(-1) for p in make_model().parameters()]) - LR * g_b
        got = torch.cat([p.reshape(-1) for p in pdps.fetch_parameters(job.store, job.transport, job.config).values()])
        torch.testing.assert_close(got, expect, rtol=0, atol=1e-12)
        assert waited < 30, f"the round waited {waited:.1f}s for a dead trainer with a 1s lease"
        applied = [r for _, r in closed_rounds(job.store, "half") if r.weights()]
        assert [set(r.contributions) for r in applied] == [{"b"}]
        assert all(ps.version == 1 and not ps._shard.staged() for ps in job.pservers)
    finally:
        job.close()


def test_barrier_continues_without_a_killed_trainer_and_matches_a_replay(source):
    grads: dict[tuple[int, int, str], torch.Tensor] = {}
    stamps: list[float] = []
    lock = threading.Lock()

    def train(ctx: pdps.TrainerContext) -> None:
        model = ctx.attach(make_model())
        for batch in ctx.batches():
            loss = F.mse_loss(model(batch["x"]), batch["y"])
            round_no = max(p.round_no for p in ctx._group.parts)
            loss.backward(retain_graph=True)
            with lock:
                grads[(ctx.epoch, round_no, ctx.trainer_id)] = flat_grad(model)
            model.zero_grad(set_to_none=False)
            ctx.step(loss)
            with lock:
                stamps.append(time.monotonic())

    store = MemoryStore()
    result = pdps.simulate(
        train, dataset=source, store=store, trainers=3, pservers=2, mode="sync", batch_size=10, passes=2,
        optimizer="SGD", optimizer_args={"lr": LR}, lease_ttl=2.0, task_timeout=60.0,
        min_block=1, num_slots=8, kill={1: 7}, keep_rounds=100000,
    )
    assert result.killed == ("trainer-1",)
    gaps = np.diff(sorted(stamps))
    assert gaps.max() < 30.0, f"a step waited {gaps.max():.1f}s: the barrier should go on once the 2s lease expires, long before the 60s task timeout"
    rounds = closed_rounds(store, result.config.name)
    assert rounds, "no round was recorded"
    dead = [r for _, r in rounds if "trainer-1" in r.contributions]
    assert dead and len(dead) < len(rounds)
    got = torch.cat([p.reshape(-1) for p in result.params.values()])
    torch.testing.assert_close(got, replay(rounds, grads), rtol=0, atol=1e-10)


class PutsByKey(CountingStore):
    """Counts, per key, the puts of the transactions that committed."""

    def __init__(self, inner, root: str) -> None:
        super().__init__(inner, root=root)
        self.puts: collections.Counter[str] = collections.Counter()

    def commit(self, compares, success, failure=(), *, fence=None):
        result = super().commit(compares, success, failure, fence=fence)
        for op in success if result.succeeded else failure:
            if isinstance(op, Put):
                self.puts[op.key] += 1
        return result


def test_every_round_key_is_written_once_by_its_own_writer(source):
    """A round is one key per contribution, written by its trainer, and one close marker,
    written by one pserver: no key is rewritten by every trainer (before: one record per
    round, rewritten whole by each of them, racing for it)."""

    def train(ctx: pdps.TrainerContext) -> None:
        model = ctx.attach(make_model())
        for batch in ctx.batches():
            ctx.step(F.mse_loss(model(batch["x"]), batch["y"]))

    name = "once-" + uuid.uuid4().hex[:8]
    keys = Keys(name)
    store = PutsByKey(MemoryStore(), root=keys.root)
    result = pdps.simulate(
        train, dataset=source, store=store, trainers=4, pservers=3, mode="sync", batch_size=20,
        optimizer="SGD", optimizer_args={"lr": LR}, name=name, keep_rounds=100000,
    )
    written = {k: n for k, n in store.puts.items() if k.startswith(keys.rounds)}
    assert written and max(written.values()) == 1, [k for k, n in written.items() if n > 1]
    entries = [keys.round_entry(k) for k in written]
    assert None not in entries
    markers = [e for e in entries if e[2] is None]
    assert len(markers) >= result.steps > 0
    for epoch, round_no, _ in markers:
        record = read_round(store, keys, epoch, round_no)
        contributors = {e[2] for e in entries if e[:2] == (epoch, round_no) and e[2] is not None}
        assert record.closed and set(record.contributions) == contributors and contributors <= {f"trainer-{i}" for i in range(4)}
    assert sum(r.total for r in (read_round(store, keys, e, r) for e, r, _ in markers)) == 480  # every record, once


def test_a_sync_pull_at_an_open_round_gives_up_at_the_callers_deadline(source):
    """In process nothing can interrupt the pserver's wait at the barrier: it ends at
    the deadline the transport hands over, not after the pserver's own 600 s."""
    job = start_job(source, name="deadline", mode="sync", pservers=1, optimizer_args={"lr": LR})
    try:
        a = job.trainer("a")
        a.register()
        a.attach(make_model())
        part = a._group.parts[0]
        meta = {"trainer": "a", "epoch": a.epoch, "after_round": part.round_no}
        start = time.monotonic()
        with pytest.raises(Timeout, match=f"round {part.round_no} did not close"):
            part.channel.call("pull", Message(meta), timeout=1.0)
        assert time.monotonic() - start < 30
    finally:
        job.close()
