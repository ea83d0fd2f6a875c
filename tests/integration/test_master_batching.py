"""The master's group commit on real stores (etcd and Redis): the checks of
``tests/unit/test_master_batching.py``, plus etcd's own op limit at the default cap."""

from __future__ import annotations

import pytest

from pdps.runtime.group_commit import MAX_TXN_OPS
from tests.unit import test_master_batching as batching

pytestmark = pytest.mark.integration


@pytest.fixture(params=["etcd", "redis"])
def real_store(request):
    return request.getfixturevalue(f"{request.param}_store")


def test_concurrent_clients_get_distinct_tasks_and_every_transition_is_durable(real_store):
    batching.concurrent_clients_get_distinct_tasks_and_every_transition_is_durable(real_store, clients=24, pairs=4, delay=0.0)


def test_a_batch_that_lost_its_fence_fails_every_transition_in_it(real_store):
    batching.a_batch_that_lost_its_fence_fails_every_transition_in_it(real_store)


def test_a_failed_batch_fails_its_transitions_and_the_queue_is_rebuilt_from_the_store(real_store):
    batching.a_failed_batch_fails_its_transitions_and_the_queue_is_rebuilt_from_the_store(real_store)


def test_batches_respect_a_small_op_cap(real_store):
    batching.batches_respect_the_op_cap(real_store, max_txn_ops=10, clients=12)


def test_full_batches_stay_within_etcds_default_limit(etcd_store):
    # 80 clients stage up to 160 writes behind a slowed transaction: batches are cut at
    # 126 (128 less the fence's compares), which etcd accepts; one more would be refused
    sizes = batching.batches_respect_the_op_cap(etcd_store, max_txn_ops=MAX_TXN_OPS, clients=80, pairs=2, delay=0.02)
    assert max(sizes) == MAX_TXN_OPS - 2, sorted(sizes)[-5:]
