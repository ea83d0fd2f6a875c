"""Claiming pipeline ranks on a real etcd and a real Redis: the contract of
tests/unit/contract_ranks.py (concurrent claims, a ninth refused or waiting, a rank freed
by a lease that ran out on the server's clock), each thread on a connection of its own
where it matters."""

from __future__ import annotations

import threading
import time

import pytest

from pdps.registry import open_store
from pdps.runtime.hybrid import claim_rank, ranks
from tests.unit.contract_ranks import KEYS, WORLD, RankClaimContract

pytestmark = pytest.mark.integration


class TestEtcdRankClaims(RankClaimContract):
    @pytest.fixture
    def store(self, etcd_store):
        return etcd_store

    @pytest.fixture
    def advance(self):
        return time.sleep  # leases expire on the server's clock


class TestRedisRankClaims(RankClaimContract):
    @pytest.fixture
    def store(self, redis_store):
        return redis_store

    @pytest.fixture
    def advance(self):
        return time.sleep


@pytest.mark.parametrize("backend", ["etcd", "redis"])
def test_nine_connections_race_for_eight_ranks(backend, request):
    request.getfixturevalue(f"{backend}_store")  # wiped
    url = request.getfixturevalue(f"{backend}_server").url
    stores = [open_store(url) for _ in range(9)]
    try:
        start = threading.Barrier(9)
        got: dict[int, object] = {}

        def member(i: int) -> None:
            start.wait()
            try:
                got[i] = claim_rank(stores[i], KEYS, WORLD, f"m{i}", f"grpc://10.0.0.{i}:7000", stores[i].grant_lease(30)).rank
            except Exception as exc:  # noqa: BLE001 - the one that found none free
                got[i] = exc

        threads = [threading.Thread(target=member, args=(i,)) for i in range(9)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        taken = sorted(r for r in got.values() if isinstance(r, int))
        refused = [e for e in got.values() if not isinstance(e, int)]
        assert taken == list(range(8)) and len(refused) == 1, got
        assert "all 8 pipeline ranks are held" in str(refused[0])
        assert sorted(ranks(stores[0], KEYS)) == list(range(8))
    finally:
        for s in stores:
            s.close()
