"""Hybrid groups (pdps.core.hybrid): the seed's accessors, the layout's refusals, the claim
record and its keys; rank claims on the memory store (the same contract runs on etcd and
Redis in tests/integration/test_hybrid_ranks.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdps.adapters.memory_store import MemoryStore
from pdps.core.errors import ConfigError, CorruptRecord
from pdps.core.hybrid import HybridGroup, HybridLayout, RankClaim
from pdps.core.job import Keys
from tests.unit.contract_ranks import RankClaimContract

# P = 4 stages, D = 2 pipelines, written out by hand:
# rank: (stage, pipeline, prev, next, data-parallel group, pipe-parallel group)
TABLE = {
    0: (0, 0, None, 1, (0, 4), (0, 1, 2, 3)),
    1: (1, 0, 0, 2, (1, 5), (0, 1, 2, 3)),
    2: (2, 0, 1, 3, (2, 6), (0, 1, 2, 3)),
    3: (3, 0, 2, None, (3, 7), (0, 1, 2, 3)),
    4: (0, 1, None, 5, (0, 4), (4, 5, 6, 7)),
    5: (1, 1, 4, 6, (1, 5), (4, 5, 6, 7)),
    6: (2, 1, 5, 7, (2, 6), (4, 5, 6, 7)),
    7: (3, 1, 6, None, (3, 7), (4, 5, 6, 7)),
}


def accessors(g: HybridGroup) -> tuple:
    return (
        g.get_stage_id(), g.get_data_parallel_rank(), g.get_p2p_prev_rank(), g.get_p2p_next_rank(),
        g.get_data_parallel_group(), g.get_pipe_parallel_group(),
    )


@pytest.mark.parametrize("rank", sorted(TABLE))
def test_accessors_of_four_stages_by_two_pipelines(rank):
    g = HybridGroup(rank=rank, data_parallel=2, pipeline=4)
    assert accessors(g) == TABLE[rank]
    assert (g.get_data_parallel_world_size(), g.get_pipe_parallel_world_size(), g.world_size) == (2, 4, 8)
    assert (g.get_model_parallel_world_size(), g.get_model_parallel_rank(), g.get_model_parallel_group()) == (1, 0, (rank,))
    assert (g.is_first_stage, g.is_last_stage) == (rank % 4 == 0, rank % 4 == 3)
    assert HybridLayout(data_parallel=2, pipeline=4).group(rank) == g and g.layout == HybridLayout(2, 4)


def test_one_stage_is_plain_data_parallelism():
    groups = [HybridGroup(rank=r, data_parallel=3, pipeline=1) for r in range(3)]
    for r, g in enumerate(groups):
        assert g.is_first_stage and g.is_last_stage
        assert (g.get_stage_id(), g.get_data_parallel_rank(), g.get_p2p_prev_rank(), g.get_p2p_next_rank()) == (0, r, None, None)
        assert (g.get_data_parallel_group(), g.get_pipe_parallel_group()) == ((0, 1, 2), (r,))


def test_one_pipeline_is_plain_pipelining():
    groups = [HybridGroup(rank=r, data_parallel=1, pipeline=3) for r in range(3)]
    assert [(g.get_p2p_prev_rank(), g.get_p2p_next_rank()) for g in groups] == [(None, 1), (0, 2), (1, None)]
    assert [(g.get_data_parallel_group(), g.get_pipe_parallel_group()) for g in groups] == [((r,), (0, 1, 2)) for r in range(3)]
    assert [(g.is_first_stage, g.is_last_stage) for g in groups] == [(True, False), (False, False), (False, True)]
    only = HybridGroup(rank=0, data_parallel=1, pipeline=1)
    assert accessors(only) == (0, 0, None, None, (0,), (0,)) and only.is_first_stage and only.is_last_stage


@pytest.mark.parametrize(
    ("settings_", "message"),
    [
        (dict(rank=0, data_parallel=2, pipeline=0), r"pipeline \(stages per pipeline\) must be a whole number >= 1, got 0 \(int\)"),
        (dict(rank=0, data_parallel=0, pipeline=4), r"data_parallel \(pipelines\) must be a whole number >= 1, got 0 \(int\)"),
        (dict(rank=0, data_parallel=2, pipeline=4.0), r"pipeline .* got 4.0 \(float\)"),
        (dict(rank=0, data_parallel=True, pipeline=4), r"data_parallel .* got True \(bool\)"),
        (dict(rank=8, data_parallel=2, pipeline=4), r"rank must be a whole number in \[0, 8\) for 2 pipeline\(s\) of 4 stage\(s\), got 8 \(int\)"),
        (dict(rank=-1, data_parallel=2, pipeline=4), r"in \[0, 8\) .* got -1 \(int\)"),
        (dict(rank="3", data_parallel=2, pipeline=4), r"got '3' \(str\)"),
        (dict(rank=False, data_parallel=2, pipeline=4), r"got False \(bool\)"),
    ],
)
def test_bad_degrees_and_ranks_are_refused_by_name(settings_, message):
    with pytest.raises(ConfigError, match=message):
        HybridGroup(**settings_)


def test_layout_from_trainer_and_stage_counts():
    assert HybridLayout.from_counts(8, 4) == HybridLayout(data_parallel=2, pipeline=4)
    assert HybridLayout.from_counts(3, 1) == HybridLayout(data_parallel=3, pipeline=1)
    assert HybridLayout.from_counts(4, 4).world_size == 4
    with pytest.raises(ConfigError, match=r"trainers \(6\) must be a multiple of stages \(4\).*use 4 or 8 trainers, or a number of stages that divides 6"):
        HybridLayout.from_counts(6, 4)
    with pytest.raises(ConfigError, match=r"trainers \(3\) must be a multiple of stages \(4\).*use 4 trainers"):
        HybridLayout.from_counts(3, 4)
    with pytest.raises(ConfigError, match=r"stages must be a whole number >= 1, got 0"):
        HybridLayout.from_counts(8, 0)
    with pytest.raises(ConfigError, match=r"trainers must be a whole number >= 1, got 0"):
        HybridLayout.from_counts(0, 2)
    with pytest.raises(ConfigError, match=r"data_parallel \(pipelines\) must be a whole number >= 1, got -1"):
        HybridLayout(data_parallel=-1, pipeline=2)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 9), st.integers(1, 9))
def test_every_ranks_groups_partition_the_world_and_links_agree(pipeline, data_parallel):
    layout = HybridLayout(data_parallel=data_parallel, pipeline=pipeline)
    world = range(layout.world_size)
    groups = [layout.group(r) for r in world]
    for kind in ("get_data_parallel_group", "get_pipe_parallel_group", "get_model_parallel_group"):
        blocks = {getattr(g, kind)() for g in groups}
        assert sorted(r for b in blocks for r in b) == list(world), kind  # disjoint and covering
        assert all(g.rank in getattr(g, kind)() for g in groups)
        for g in groups:  # everyone in my group has my group
            assert all(getattr(groups[o], kind)() == getattr(g, kind)() for o in getattr(g, kind)())
    assert {len(g.get_data_parallel_group()) for g in groups} == {data_parallel}
    assert {len(g.get_pipe_parallel_group()) for g in groups} == {pipeline}
    for g in groups:
        assert g.rank == g.get_data_parallel_rank() * pipeline + g.get_stage_id()
        prev, nxt = g.get_p2p_prev_rank(), g.get_p2p_next_rank()
        assert (prev is None) == g.is_first_stage and (nxt is None) == g.is_last_stage
        if prev is not None:
            assert groups[prev].get_p2p_next_rank() == g.rank and groups[prev].get_stage_id() == g.get_stage_id() - 1
            assert prev in g.get_pipe_parallel_group()
        if nxt is not None:
            assert groups[nxt].get_p2p_prev_rank() == g.rank and nxt in g.get_pipe_parallel_group()
        # walking next from the first stage visits the pipeline in stage order
        if g.is_first_stage:
            walk = [g.rank]
            while groups[walk[-1]].get_p2p_next_rank() is not None:
                walk.append(groups[walk[-1]].get_p2p_next_rank())
            assert tuple(walk) == g.get_pipe_parallel_group()


# --- the claim record and its keys ------------------------------------------------------


def test_a_claim_round_trips_and_bad_ones_are_refused_naming_the_key():
    claim = RankClaim(member="trainer-3", addr="grpc://10.0.0.3:7000")
    assert RankClaim.decode(claim.encode(), "k") == claim
    assert claim.encode() == b'{"addr": "grpc://10.0.0.3:7000", "member": "trainer-3"}'
    for raw in (b"nope", b"[1, 2]", b'{"member": "m"}', b'{"member": "", "addr": "a"}', b'{"member": "m", "addr": 7}', b'"m"'):
        with pytest.raises(CorruptRecord, match="/pdps/j/pipeline/ranks/4") as info:
            RankClaim.decode(raw, "/pdps/j/pipeline/ranks/4")
        assert info.value.key == "/pdps/j/pipeline/ranks/4"
    with pytest.raises(ConfigError, match=r"a rank claim's addr must be a non-empty string, got ''"):
        RankClaim(member="m", addr="")


def test_rank_keys_are_built_and_read_back():
    keys = Keys("j")
    assert keys.pipeline_ranks == "/pdps/j/pipeline/ranks/"
    assert keys.pipeline_rank(12) == "/pdps/j/pipeline/ranks/12"
    assert [keys.pipeline_rank_of(keys.pipeline_rank(r)) for r in (0, 7, 12)] == [0, 7, 12]
    for other in ("/pdps/j/pipeline/ranks/", "/pdps/j/pipeline/ranks/07", "/pdps/j/pipeline/ranks/-1",
                  "/pdps/j/pipeline/ranks/1/x", "/pdps/j/pipeline/ranks/²", "/pdps/k/pipeline/ranks/1", "/pdps/j/ps/1"):
        assert keys.pipeline_rank_of(other) is None, other


# --- claims on the memory store ---------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class TestMemoryRankClaims(RankClaimContract):
    @pytest.fixture
    def clock(self):
        return FakeClock()

    @pytest.fixture
    def store(self, clock):
        s = MemoryStore(clock=clock)
        yield s
        s.close()

    @pytest.fixture
    def advance(self, clock, store):
        def advance(seconds: float) -> None:
            clock.now += seconds
            store.tick()

        return advance
