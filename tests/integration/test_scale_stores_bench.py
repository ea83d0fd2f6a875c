"""bench/scale_stores.py counts on pdps's side what etcd and Redis count on theirs: the
keys and bytes a job writes agree with the server's own counters, so its ratios
(measured / predicted) compare like with like."""

from __future__ import annotations

import pytest

from bench import scale_stores

pytestmark = pytest.mark.integration


def small_job(url, view, steps):
    kind = dict(trainers=4, tasks=4, records=3, first=1, last=3) if steps else dict(trainers=2, tasks=200, records=1, first=20, last=180)
    return scale_stores.job(url, view, pservers=2, steps=steps, latency=0.0, timeout=120, **kind)


@pytest.mark.parametrize("steps", [True, False], ids=["steps", "tasks"])
def test_etcd_counts_the_keys_and_bytes_pdps_counts(etcd_server, steps):
    row = small_job(etcd_server.url, scale_stores.EtcdView(etcd_server.port), steps)
    etcd = row["job_store_view"]
    # every Put pdps counted is one etcd counted, to the byte (key + value); Deletes
    # (counted by pdps as writes, not by etcd as puts) are the few keys a job removes
    assert etcd["etcd_mvcc_put_total"] == pytest.approx(row["job_writes"], rel=0.05)
    assert etcd["etcd_debugging_mvcc_total_put_size_in_bytes"] == pytest.approx(row["job_bytes_written"], rel=0.05)
    if steps:
        assert row["ticks_per_step"] == pytest.approx(4, abs=1)  # every trainer in every round of the window
    else:
        assert row["tasks_done"] == 200 and row["writes_per_task"] == pytest.approx(4, rel=0.1)


def test_redis_runs_the_same_job_and_reports_its_own_counters(redis_server):
    import redis

    redis.Redis(host="127.0.0.1", port=redis_server.port).flushdb()
    row = small_job(redis_server.url, scale_stores.RedisView(redis_server.port), steps=False)
    assert row["tasks_done"] == 200
    # each pdps write is one Lua script of several commands; INFO counts them all
    assert row["job_store_view"]["total_commands_processed"] > row["job_ops"]
    assert row["job_store_view"]["keys"] >= 2 * 200  # a task record and an audit entry per task
