"""The ``queue`` record of a job of many tasks, on real stores.

Each task's record count is kept for the audit; with counts that vary from task to
task, one value holding them all outgrew etcd's default request limit (1.5 MiB) at
about 93,000 tasks and the master could not start. These tests start a master over
120,000 such tasks on the session's etcd (default limits) and Redis, restore a second
master from what it wrote, and read the counts back as ``pdps status --pass`` does.
"""

from __future__ import annotations

import pytest

from pdps.adapters.inproc import InprocTransport
from pdps.core.job import JobConfig, Keys
from pdps.core.tasks import TaskSpec
from pdps.roles.master import Master
from pdps.shell.status import job_status, pass_audit

pytestmark = pytest.mark.integration

TASKS = 120_000


class VaryingTasks:
    """A data source that only describes ``n`` tasks whose record counts all differ from their neighbours'."""

    def __init__(self, n: int) -> None:
        self.url = f"memory://varying-{n}"
        self.n = n

    def tasks(self) -> list[TaskSpec]:
        return [TaskSpec(id=i, location=f"part-{i // 1000}", part=i % 1000, records=100 + i % 7) for i in range(self.n)]

    def read(self, task, *, start=0, batch_size):  # pragma: no cover - never called by the master
        raise AssertionError("the master must not read records")


@pytest.fixture(params=["etcd", "redis"])
def real_store(request):
    return request.getfixturevalue(f"{request.param}_store")


def test_a_master_over_120k_tasks_of_varying_records_starts_and_a_second_restores_it(real_store):
    source = VaryingTasks(TASKS)
    config = JobConfig(name="queue-varying-120k", dataset=source.url, lease_ttl=30.0, task_timeout=60.0)
    first = Master(real_store, InprocTransport(), source, config)
    first.start()  # main: StoreError "etcdserver: request is too large" on etcd
    first.stop()
    second = Master(real_store, InprocTransport(), source, config)
    second.start()
    try:
        assert second.restored is not None  # restored, not created afresh
        assert second.counts().todo == TASKS
    finally:
        second.stop()
    assert job_status(real_store, config.name)["tasks"] == TASKS
    audit = pass_audit(real_store, config.name, 0)
    assert audit["records"] == sum(s.records for s in source.tasks())
    assert [e["records"] for e in audit["entries"][:8]] == [100, 101, 102, 103, 104, 105, 106, 100]
    assert max(len(kv.value) for kv in real_store.range(Keys(config.name).root)) <= 64 * 1024
