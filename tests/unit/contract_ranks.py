"""Claiming pipeline ranks (:mod:`pdps.runtime.hybrid`): the tests every store must pass.

A test class inherits :class:`RankClaimContract` and supplies the ``store`` fixture (a
fresh store) and ``advance`` (a callable that lets ``seconds`` of lease time pass: a
fake clock for the memory store, a sleep for a real server). tests/unit runs it on the
memory store, tests/integration on a real etcd and Redis.
"""

from __future__ import annotations

import threading
import time

import pytest

from pdps.core.errors import ConfigError, CorruptRecord, Timeout
from pdps.core.hybrid import HybridLayout, RankClaim
from pdps.core.job import Keys
from pdps.runtime.hybrid import claim_rank, ranks, release, wait_for_ranks
from tests.unit.contract_store import wait_until

KEYS = Keys("pipe")
WORLD = HybridLayout(data_parallel=2, pipeline=4)


def claim_all(store, world=WORLD, ttl: float = 30):
    """Every rank of ``world`` claimed by members m0.. in order, each with a lease of its own."""
    leases = [store.grant_lease(ttl) for _ in range(world.world_size)]
    groups = [claim_rank(store, KEYS, world, f"m{i}", f"inproc://m{i}", leases[i]) for i in range(world.world_size)]
    return leases, groups


class RankClaimContract:
    def test_eight_threads_claim_eight_distinct_ranks(self, store):
        leases = [store.grant_lease(30) for _ in range(8)]
        start = threading.Barrier(8)
        got: dict[int, int] = {}
        errors: list[BaseException] = []

        def member(i: int) -> None:
            try:
                start.wait()
                got[i] = claim_rank(store, KEYS, WORLD, f"m{i}", f"inproc://m{i}", leases[i]).rank
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=member, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        assert sorted(got.values()) == list(range(8))
        claims = ranks(store, KEYS)
        assert {r: c.member for r, c in claims.items()} == {r: f"m{i}" for i, r in got.items()}
        assert all(store.get(KEYS.pipeline_rank(r)).lease == leases[i] for i, r in got.items())

    def test_the_lowest_free_rank_is_taken_and_gives_its_stage_and_pipeline(self, store):
        _, groups = claim_all(store)
        assert [g.rank for g in groups] == list(range(8))
        assert [(g.get_data_parallel_rank(), g.get_stage_id()) for g in groups] == [(d, s) for d in range(2) for s in range(4)]

    def test_a_ninth_is_refused_naming_the_holders(self, store):
        claim_all(store)
        with pytest.raises(ConfigError, match=r"all 8 pipeline ranks are held \(0: m0, 1: m1, .*7: m7\).*at most 8 trainers"):
            claim_rank(store, KEYS, WORLD, "m8", "inproc://m8", store.grant_lease(30))
        with pytest.raises(Timeout, match=r"a free pipeline rank of job 'pipe' \(all 8 pipeline ranks are held"):
            claim_rank(store, KEYS, WORLD, "m8", "inproc://m8", store.grant_lease(30), wait=0.3)
        assert "m8" not in {c.member for c in ranks(store, KEYS).values()}

    def test_a_waiting_ninth_takes_the_rank_released_on_a_clean_exit(self, store):
        leases, _ = claim_all(store)
        late = store.grant_lease(30)
        got = []
        waiter = threading.Thread(target=lambda: got.append(claim_rank(store, KEYS, WORLD, "m8", "inproc://m8", late, wait=20)))
        waiter.start()
        time.sleep(0.2)  # it tried, found none free, and waits
        assert not got
        assert not release(store, KEYS, 5, leases[4])  # another lease's claim is left alone
        assert release(store, KEYS, 5, leases[5])
        waiter.join(20)
        assert [(g.rank, g.get_stage_id(), g.get_data_parallel_rank()) for g in got] == [(5, 1, 1)]
        assert ranks(store, KEYS)[5] == RankClaim("m8", "inproc://m8")
        assert not release(store, KEYS, 5, leases[5])  # the newcomer's now

    def test_an_expired_lease_frees_its_rank_for_a_newcomer(self, store, advance):
        leases = [store.grant_lease(30) for _ in range(8)]
        dying = store.grant_lease(1)  # never kept alive: its trainer died
        for i in range(8):
            claim_rank(store, KEYS, WORLD, f"m{i}", f"inproc://m{i}", dying if i == 6 else leases[i])
        advance(2)
        assert wait_until(lambda: 6 not in ranks(store, KEYS), timeout=10)
        assert sorted(ranks(store, KEYS)) == [0, 1, 2, 3, 4, 5, 7]
        # the same member restarted: it takes the freed rank, and with it that rank's stage
        group = claim_rank(store, KEYS, WORLD, "m6", "inproc://m6-again", store.grant_lease(30))
        assert (group.rank, group.get_stage_id(), group.get_data_parallel_rank(), group.get_p2p_prev_rank()) == (6, 2, 1, 5)
        assert ranks(store, KEYS)[6].addr == "inproc://m6-again"

    def test_claiming_again_with_the_same_lease_finds_the_claim_made(self, store):
        lease = store.grant_lease(30)
        first = claim_rank(store, KEYS, WORLD, "m0", "inproc://m0", lease)
        other = claim_rank(store, KEYS, WORLD, "m1", "inproc://m1", store.grant_lease(30))
        assert claim_rank(store, KEYS, WORLD, "m0", "inproc://m0", lease) == first
        assert (first.rank, other.rank) == (0, 1)
        assert sorted(ranks(store, KEYS)) == [0, 1]

    def test_wait_for_ranks_returns_every_claim_once_all_are_made(self, store):
        leases = [store.grant_lease(30) for _ in range(8)]
        for i in range(7):
            claim_rank(store, KEYS, WORLD, f"m{i}", f"inproc://m{i}", leases[i])
        with pytest.raises(Timeout, match=r"1 of 8 are not \(ranks 7\)"):
            wait_for_ranks(store, KEYS, WORLD, timeout=0.2)
        threading.Timer(0.2, lambda: claim_rank(store, KEYS, WORLD, "m7", "inproc://m7", leases[7])).start()
        claims = wait_for_ranks(store, KEYS, WORLD, timeout=20)
        assert claims == {r: RankClaim(f"m{r}", f"inproc://m{r}") for r in range(8)}

    def test_wait_for_ranks_names_every_missing_rank(self, store):
        lease = store.grant_lease(30)
        for r in (0, 2, 3):
            store.put(KEYS.pipeline_rank(r), RankClaim(f"m{r}", "inproc://x").encode(), lease=lease)
        with pytest.raises(Timeout, match=r"5 of 8 are not \(ranks 1, 4, 5, 6, 7\)"):
            wait_for_ranks(store, KEYS, WORLD, timeout=0.1)

    def test_an_unreadable_claim_is_named_not_guessed(self, store):
        store.put(KEYS.pipeline_rank(2), b"not json")
        with pytest.raises(CorruptRecord, match="/pdps/pipe/pipeline/ranks/2"):
            ranks(store, KEYS)
        store.delete(KEYS.pipeline_rank(2))
        store.put(KEYS.pipeline_ranks + "two", RankClaim("m", "a").encode())
        with pytest.raises(CorruptRecord, match="/pdps/pipe/pipeline/ranks/two is no pipeline rank key"):
            ranks(store, KEYS)
