"""Slot replicas in the slot map: each slot on R distinct pservers, placed balanced,
rebalanced with the fewest copies moved, and the failover helpers (without, replenish).
Pure functions, checked by example, by property and against an independent min-cost
flow (networkx, a dependency of torch)."""

from __future__ import annotations

import json
from pathlib import Path

import hypothesis.strategies as st
import networkx as nx
import pytest
from hypothesis import given, settings

from pdps.adapters.memory_store import MemoryStore
from pdps.core.elastic import Resize, ResizeState, check_counts, minimum_bytes
from pdps.core.errors import ConfigError, CorruptRecord
from pdps.core.job import JobConfig, Keys, decode_as
from pdps.core.slots import Layout, ParamSpec, SlotMap
from pdps.roles.master import publish_job
from pdps.shell.settings import job_config, resolve

FIXTURE = Path(__file__).parent / "data" / "slotmaps_r1.json"


def check_replicated(m: SlotMap) -> None:
    """Every slot on ``replicas`` distinct pservers; primaries and copies balanced within 1."""
    for s in range(m.num_slots):
        assert len(m.holders(s)) == m.replicas == len(set(m.holders(s)))
    assert m.under_replicated() == []
    load, copies = m.load(), m.copy_load()
    assert max(load) - min(load) <= 1 and sum(load) == m.num_slots
    assert max(copies) - min(copies) <= 1 and sum(copies) == m.replicas * m.num_slots
    assert copies == [len(m.held_by(p)) for p in range(m.num_pservers)]


def fewest_new_copies(old: SlotMap, m: int) -> int:
    """The fewest copies any balanced map on ``m`` pservers makes anew from ``old``: a
    min-cost flow, slots -> pservers (a copy already there costs 0, a new one 1), each
    pserver taking ``R*S // m`` copies and ``R*S % m`` of them one more."""
    r, s = old.replicas, old.num_slots
    base, extra = divmod(r * s, m)
    g = nx.DiGraph()
    g.add_node("src", demand=-r * s)
    g.add_node("sink", demand=r * s)
    for slot in range(s):
        g.add_edge("src", ("slot", slot), capacity=r, weight=0)
        for p in range(m):
            g.add_edge(("slot", slot), ("ps", p), capacity=1, weight=0 if p in old.holders(slot) else 1)
    for p in range(m):
        g.add_edge(("ps", p), "sink", capacity=base, weight=0)
        g.add_edge(("ps", p), "extra", capacity=1, weight=0)
    g.add_edge("extra", "sink", capacity=extra, weight=0)
    return nx.cost_of_flow(g, nx.min_cost_flow(g))


def kept_bound(old: SlotMap, m: int) -> int:
    """A simpler lower bound on the new copies: each pserver keeps at most its quota of
    what it holds, the larger quotas on those holding the most. The flow above reaches
    it whenever the kept copies leave room for the rest on distinct pservers."""
    have = sorted((len(old.held_by(p)) for p in range(min(m, old.num_pservers))), reverse=True) + [0] * max(0, m - old.num_pservers)
    base, extra = divmod(old.replicas * old.num_slots, m)
    return old.replicas * old.num_slots - sum(min(h, base + (i < extra)) for i, h in enumerate(have))


@st.composite
def replicated_maps(draw, max_slots: int = 48, max_pservers: int = 10):
    """A replicated map as a job has it: its first map, then a few resizes."""
    num_slots = draw(st.integers(1, max_slots))
    n = draw(st.integers(1, min(num_slots, max_pservers)))
    r = draw(st.integers(1, n))
    m = SlotMap.initial(n, num_slots, r)
    for k in draw(st.lists(st.integers(r, min(num_slots, max_pservers)), max_size=2)):
        m = m.rebalance(k)
    return m


# --- R = 1: nothing changes -------------------------------------------------------------


def test_r1_maps_and_moves_are_those_written_before_replicas():
    """``slotmaps_r1.json`` was written by slots.py before replicas existed (commit
    98f22b7): first maps, chains of resizes and resizes of unbalanced maps, their JSON
    and their moves. Today's code gives the same, byte for byte."""
    cases = json.loads(FIXTURE.read_text())["cases"]
    assert len(cases) > 100
    for case in cases:
        if "owners" in case:
            chain = [SlotMap(version=3, num_pservers=case["pservers"], owners=case["owners"])]
        else:
            chain = [SlotMap.initial(case["pservers"], case["num_slots"])]
        for m in case["sizes"]:
            chain.append(chain[-1].rebalance(m))
        assert [json.dumps(m.to_json()) for m in chain] == case["maps"]
        assert [[list(mv) for mv in a.moves(b)] for a, b in zip(chain, chain[1:])] == case["moves"]
        assert all(SlotMap.from_json(json.loads(text)) == m for text, m in zip(case["maps"], chain))


def test_an_r1_map_has_no_backups_and_writes_none():
    m = SlotMap.initial(3, 7)
    assert m.replicas == 1 and m.backups == ((),) * 7
    assert m.holders(4) == (1,) and m.held_by(1) == [1, 4] and m.copy_load() == m.load() == [3, 2, 2]
    assert set(m.to_json()) == {"version", "num_pservers", "owners"}
    assert m == SlotMap(version=1, num_pservers=3, owners=(0, 1, 2, 0, 1, 2, 0))


# --- the first map ----------------------------------------------------------------------


def test_initial_map_with_replicas_example():
    m = SlotMap.initial(4, 8, replicas=2)
    assert m.owners == SlotMap.initial(4, 8).owners  # primaries round-robin, as without replicas
    assert m.to_json() == {
        "version": 1, "num_pservers": 4, "owners": [0, 1, 2, 3, 0, 1, 2, 3],
        "replicas": 2, "backups": [[1], [2], [0], [0], [2], [3], [3], [1]],
    }
    assert m.holders(2) == (2, 0) and m.held_by(0) == [0, 2, 3, 4] and m.copy_load() == [4, 4, 4, 4]


@settings(max_examples=200, deadline=None)
@given(num_slots=st.integers(1, 120), data=st.data())
def test_initial_map_places_every_copy_balanced_and_spread(num_slots, data):
    n = data.draw(st.integers(1, min(num_slots, 16)))
    r = data.draw(st.integers(1, n))
    m = SlotMap.initial(n, num_slots, r)
    assert m.version == 1 and m.base is None and m.replicas == r
    assert m.owners == SlotMap.initial(n, num_slots).owners
    check_replicated(m)
    if r > 1:
        # when a pserver dies its primaries are promoted to their first backups: those
        # spread over the other pservers (a few more on one where the quotas force it)
        for a in range(n):
            mine = [s for s in range(num_slots) if m.owners[s] == a]
            promoted = [sum(1 for s in mine if m.backups[s][0] == q) for q in range(n) if q != a]
            assert max(promoted) <= -(-len(mine) // (n - 1)) + 2, (a, promoted)


def test_four_pservers_share_a_dead_ones_primaries_evenly():
    m = SlotMap.initial(4, 256, replicas=2)
    for a in range(4):
        promoted = sorted(sum(1 for s in range(256) if m.owners[s] == a and m.backups[s] == (q,)) for q in range(4) if q != a)
        assert promoted == [21, 21, 22]  # 64 primaries over the 3 others; a chain on the next server puts all 64 on one


# --- rebalance ---------------------------------------------------------------------------


@settings(max_examples=250, deadline=None)
@given(old=replicated_maps(), data=st.data())
def test_rebalance_with_replicas_is_balanced_and_makes_the_fewest_new_copies(old, data):
    m = data.draw(st.integers(old.replicas, min(old.num_slots, 10)))
    new = old.rebalance(m)
    assert (new.num_pservers, new.num_slots, new.version, new.replicas) == (m, old.num_slots, old.version + 1, old.replicas)
    assert new.base == (old.base or old.num_pservers)
    check_replicated(new)
    assert old.moved(new) == fewest_new_copies(old, m) >= kept_bound(old, m)
    assert new.owners == old.rebalance(m).owners  # the same in every process


def test_the_kept_bound_is_reached_where_the_kept_copies_leave_room():
    """Growing by one pserver: the new one takes a share of copies and of primaries;
    nothing else moves."""
    old = SlotMap.initial(4, 64, replicas=2)
    new = old.rebalance(5)
    check_replicated(new)
    assert old.moved(new) == kept_bound(old, 5) == fewest_new_copies(old, 5) == new.copy_load()[4] == 25
    assert all(dst == 4 for _, _, dst in old.moves(new))
    assert new.load()[4] in (12, 13)  # primaries handed over to it along holders: no bytes


@settings(max_examples=150, deadline=None)
@given(old=replicated_maps(), data=st.data())
def test_moves_name_every_new_copy_and_a_source_that_stays(old, data):
    new = old.rebalance(data.draw(st.integers(old.replicas, min(old.num_slots, 10))))
    moves = old.moves(new)
    for s in range(old.num_slots):
        before, after = set(old.holders(s)), set(new.holders(s))
        mine = [(src, dst) for slot, src, dst in moves if slot == s]
        assert sorted(dst for _, dst in mine) == sorted(after - before)
        for src, _ in mine:
            assert src in before
            assert src in after or not before & after  # the source keeps serving where any copy stays
    assert old.moved(new) == len(moves)


@settings(max_examples=100, deadline=None)
@given(old=replicated_maps())
def test_rebalance_to_the_same_count_moves_nothing(old):
    new = old.rebalance(old.num_pservers)
    assert new.owners == old.owners and new.backups == old.backups and old.moves(new) == []


def test_rebalance_promotes_a_backup_of_a_departing_primary():
    old = SlotMap.initial(3, 6, replicas=2)
    new = old.rebalance(2)
    for s in range(6):
        if old.owners[s] == 2:
            assert new.owners[s] == old.backups[s][0]  # promoted: its copy was there already
    assert old.moved(new) == fewest_new_copies(old, 2) == 4  # pserver 2's four copies, re-made
    with pytest.raises(ConfigError, match="at least 2 pservers"):
        old.rebalance(1)


# --- failover: without, replenish --------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(old=replicated_maps(), data=st.data())
def test_without_promotes_backups_and_replenish_brings_every_slot_back(old, data):
    dead = data.draw(st.integers(0, old.num_pservers - 1))
    if old.replicas == 1:
        assert old.lost_with(dead) == old.held_by(dead)
        if old.held_by(dead):
            with pytest.raises(ConfigError, match=f"pserver {dead} holds the only copy"):
                old.without(dead)
        return
    assert old.lost_with(dead) == []
    short = old.without(dead)
    assert short.version == old.version + 1 and short.num_pservers == old.num_pservers and short.replicas == old.replicas
    assert short.held_by(dead) == [] and short.under_replicated() == old.held_by(dead)
    for s in range(old.num_slots):
        assert short.holders(s) == tuple(p for p in old.holders(s) if p != dead)  # the first surviving backup is promoted
    assert old.moves(short) == []  # a promotion moves no bytes

    full = short.replenish()  # a replacement at the dead one's index
    assert full.version == short.version + 1 and full.owners == short.owners
    assert all(len(set(full.holders(s))) == old.replicas for s in range(old.num_slots))
    copies = full.copy_load()
    assert max(copies) - min(copies) <= 1
    moves = short.moves(full)
    assert len(moves) == sum(old.replicas - len(short.holders(s)) for s in range(old.num_slots))  # only the missing copies
    assert all(set(short.holders(s)) < set(full.holders(s)) for s in short.under_replicated())
    assert all(dst == dead for _, _, dst in moves)  # the replacement holds nothing: it takes them all
    assert [src for _, src, _ in moves] == [short.owners[s] for s, _, _ in moves]
    # handing primaries back to the replacement moves no bytes: a rebalance onto the same count does it
    again = full.rebalance(full.num_pservers)
    check_replicated(again)
    assert full.moves(again) == []
    # every map after the first places the model's blocks by the first (Layout.build)
    first = old.placement
    assert all((m.placement.num_pservers, m.placement.owners) == (first.num_pservers, first.owners) for m in (short, full, again))


def test_a_failover_leaves_every_block_in_its_slot():
    """A model of 2 blocks on 3 pservers: Layout.build gives the pserver left without one
    the last block of the first map's busiest, chosen by the map it places by. A failover
    map that placed by its own primaries moved out.bias from slot 129 to 61 with no slot
    moving: the promoted backup had no copy of it and failed to switch, and the job
    trained on with one pserver serving nothing (found as a result differing from a run
    without the kill)."""
    params = [ParamSpec("out.weight", (1, 4), "float32"), ParamSpec("out.bias", (1,), "float32")]
    old = SlotMap.initial(3, 256, replicas=2)
    want = Layout.build(params, old, 1).slots
    for dead in range(3):
        short = old.without(dead)
        full = short.replenish()
        for m in (short, full, full.rebalance(3)):
            assert Layout.build(params, m, 1).slots == want, (dead, m.version)


@settings(max_examples=150, deadline=None)
@given(old=replicated_maps(), data=st.data())
def test_replenish_on_the_survivors_only(old, data):
    dead = data.draw(st.integers(0, old.num_pservers - 1))
    if old.replicas == 1 or old.num_pservers - 1 < old.replicas:
        return
    short = old.without(dead)
    full = short.replenish(set(range(old.num_pservers)) - {dead})
    assert full.held_by(dead) == [] and full.under_replicated() == [] and full.owners == short.owners
    assert all(len(set(full.holders(s))) == old.replicas for s in range(old.num_slots))
    assert short.moved(full) == sum(old.replicas - len(short.holders(s)) for s in range(old.num_slots))
    assert all(set(short.holders(s)) <= set(full.holders(s)) for s in range(old.num_slots))  # no copy moves


def test_two_deaths_lose_the_slots_both_held():
    m = SlotMap.initial(4, 8, replicas=2)
    both = [s for s in range(8) if set(m.holders(s)) == {0, 1}]
    assert both
    short = m.without(0)
    assert short.lost_with(1) == both
    with pytest.raises(ConfigError, match="roll back to its last checkpoint"):
        short.without(1)
    with pytest.raises(ConfigError, match="at least 2 are needed"):
        short.replenish({2})
    with pytest.raises(ConfigError, match="not in this slot map"):
        m.without(4)


# --- records ------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(m=replicated_maps())
def test_replicated_map_json_round_trip(m):
    assert SlotMap.from_json(json.loads(json.dumps(m.to_json()))) == m
    assert ("replicas" in m.to_json()) == (m.replicas > 1)


def test_a_record_without_replicas_reads_as_one_copy():
    m = SlotMap.from_json({"version": 4, "num_pservers": 2, "owners": [0, 1, 1], "base": 2})
    assert m.replicas == 1 and m.backups == ((), (), ())


@pytest.mark.parametrize(
    "backups,replicas,match",
    [
        ([[1], [0]], 2, None),
        ([[1], [1]], 2, "must be distinct"),  # slot 1's backup is its primary
        ([[2], [0]], 2, "out of range"),
        ([[1, 0], [0]], 2, "at most 1"),
        ([[1]], 2, "backups for 1 slots"),
        ([[], []], 3, "only 2"),
        ([[], []], 0, "replicas must be >= 1"),
    ],
)
def test_a_slot_map_checks_its_backups(backups, replicas, match):
    record = {"version": 1, "num_pservers": 2, "owners": [0, 1], "replicas": replicas, "backups": backups}
    if match is None:
        assert SlotMap.from_json(record).holders(1) == (1, 0)
        return
    with pytest.raises(ConfigError, match=match):
        SlotMap.from_json(record)
    with pytest.raises(CorruptRecord, match="slotmap"):
        decode_as(json.dumps(record).encode(), "slotmap", SlotMap.from_json)
    with pytest.raises(ConfigError, match=match):
        SlotMap(version=1, num_pservers=2, owners=(0, 1), replicas=replicas, backups=backups)


def test_initial_refuses_more_replicas_than_pservers():
    with pytest.raises(ConfigError, match="replicas=3 .* only 2"):
        SlotMap.initial(2, 8, replicas=3)


# --- resizes --------------------------------------------------------------------------------


def test_check_counts_refuses_fewer_pservers_than_replicas():
    check_counts(2, None, 64, replicas=2)
    check_counts(None, 3, 64, replicas=2)
    with pytest.raises(ConfigError, match="keeps 2 replicas of each slot .* at least 2 pservers; asked for 1"):
        check_counts(1, None, 64, replicas=2)


def test_a_resize_carries_the_replicas_and_counts_every_new_copy():
    params = [ParamSpec("emb", (512, 16), "float32"), ParamSpec("fc", (16, 16), "float32")]
    first = SlotMap.initial(2, 32, replicas=2)
    layout = Layout.build(params, first, min_block=64)
    resize = Resize("r1", ResizeState.REQUESTED, 3, None, 0.0).plan(first)
    assert resize.to_map.replicas == 2 and resize.to_map.base == 2
    assert Resize.from_json(json.loads(json.dumps(resize.to_json()))) == resize
    sizes = layout.slot_bytes()
    assert resize.moves() == first.moves(resize.to_map) and len(resize.moves()) == first.moved(resize.to_map) > 0
    assert minimum_bytes(layout, resize.to_map) == sum(sizes[s] for s, _, _ in resize.moves())
    # more than the slots whose primary changes: every backup made anew counts too
    assert minimum_bytes(layout, resize.to_map) > sum(sizes[s] for s in range(32) if first.owners[s] != resize.to_map.owners[s])
    assert resize.receivers() == [2] and sum(len(v) for v in resize.incoming(2).values()) == len(resize.moves())


# --- the setting ------------------------------------------------------------------------------


def test_replicas_setting_is_checked_against_pservers():
    assert JobConfig().replicas == 1
    assert JobConfig(pservers=3, replicas=3).replicas == 3
    with pytest.raises(ConfigError, match=r"replicas \(3\) must be at most the number of pservers \(2\)"):
        JobConfig(pservers=2, replicas=3)
    with pytest.raises(ConfigError, match="replicas"):
        JobConfig(replicas=0)
    assert JobConfig.decode(JobConfig(pservers=2, replicas=2).encode()).replicas == 2


def test_replicas_from_file_env_and_flag(tmp_path):
    cfg = tmp_path / "job.toml"
    cfg.write_text("pservers = 3\nreplicas = 2\n")
    assert job_config(resolve("master", {"config": str(cfg)}, {"PDPS_STORE": "memory://"})).replicas == 2
    assert job_config(resolve("master", {"config": str(cfg)}, {"PDPS_STORE": "memory://", "PDPS_REPLICAS": "3"})).replicas == 3
    assert job_config(resolve("master", {"config": str(cfg), "replicas": 1}, {"PDPS_STORE": "memory://", "PDPS_REPLICAS": "3"})).replicas == 1


def test_a_new_jobs_first_map_has_its_replicas():
    store = MemoryStore()
    publish_job(store, JobConfig(name="replicated", pservers=3, num_slots=12, replicas=2))
    kv = store.get(Keys("replicated").slotmap)
    assert kv is not None and SlotMap.from_json(json.loads(kv.value)) == SlotMap.initial(3, 12, replicas=2)
    publish_job(store, JobConfig(name="plain", pservers=3, num_slots=12))
    assert "replicas" not in json.loads(store.get(Keys("plain").slotmap).value)


def test_async_pservers_keep_at_most_two_copies():
    """An async job keeps at most 2 copies (with more, the backups of a dead primary
    could disagree on what it had not acknowledged): more is refused when the JobConfig
    is made, before anything starts, naming the setting and the mode; sync takes any count."""
    with pytest.raises(ConfigError, match="replicas = 3 in async mode"):
        JobConfig(name="r3", pservers=3, replicas=3, mode="async")
    assert JobConfig(name="r2", pservers=2, replicas=2, mode="async").replicas == 2
    assert JobConfig(name="r3s", pservers=3, replicas=3).replicas == 3


@settings(max_examples=100, deadline=None)
@given(old=replicated_maps(), data=st.data())
def test_a_replenish_with_balance_hands_the_replacement_its_primaries_and_makes_only_the_missing_copies(old, data):
    from pdps.core.elastic import Resize, ResizeState

    if old.replicas == 1:
        return
    dead = data.draw(st.integers(0, old.num_pservers - 1))
    short = old.without(dead)
    asked = Resize(id="r", state=ResizeState.REQUESTED, pservers=short.num_pservers, trainers=None, requested=0.0)
    plain = asked.replenish(short, set(range(short.num_pservers))).to_map
    balanced = asked.replenish(short, set(range(short.num_pservers)), balance=True).to_map
    assert balanced.version == plain.version == short.version + 1
    assert [set(balanced.holders(s)) for s in range(short.num_slots)] == [set(plain.holders(s)) for s in range(short.num_slots)]
    assert short.moves(balanced) == short.moves(plain)  # the same copies made, from the same sources
    load = balanced.load()
    assert max(load) - min(load) <= 1  # the primaries spread again: the replacement has its share


def test_a_replenish_whose_only_receiver_died_is_dropped_with_it():
    from pdps.core.elastic import Resize, ResizeState

    old = SlotMap.initial(3, 12, replicas=2)
    short = old.without(1)
    asked = Resize(id="r", state=ResizeState.REQUESTED, pservers=3, trainers=None, requested=0.0)
    planned = asked.replenish(short, {0, 1, 2}, balance=True)
    live = planned.to_map
    assert planned.receivers() == [1] and live.held_by(1)
    after = planned.without_receiver(live, 1)
    assert after is not None and not after.held_by(1) and after.version == live.version + 1
    assert [set(after.holders(s)) for s in range(12)] == [set(short.holders(s)) for s in range(12)]  # back to the copies it came from
    assert live.moves(after) == []  # nothing moves
    assert planned.without_receiver(live, 0) is None  # a source: a death during the copy of its slots rolls back
    assert planned.without_receiver(short, 1) is None  # the map not switched yet: the flip comes first
    grown = Resize(id="g", state=ResizeState.REQUESTED, pservers=4, trainers=None, requested=0.0).plan(old)
    assert grown.without_receiver(grown.to_map, 3) is None  # a resize changing the count: rollback, as ever
