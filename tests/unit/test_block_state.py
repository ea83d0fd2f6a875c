"""Shard state keyed by block: what a slot migration sends and a checkpoint stores
loads into a shard of any other cut of the same parameters."""

import pytest
import torch

from pdps.adapters.torch_compute import TorchShard
from pdps.core.errors import ConfigError
from pdps.core.slots import Layout, ParamSpec, SlotMap

SPECS = [ParamSpec("w", (40, 3), "float64"), ParamSpec("b", (40,), "float64"), ParamSpec("s", (), "float64")]


def trained(layout: Layout, pserver: int, steps: int = 3) -> TorchShard:
    shard = TorchShard(layout.blocks_of(pserver), "Adam", {"lr": 0.01})
    g = torch.Generator().manual_seed(pserver)
    shard.initialize([torch.randn(b.shape, generator=g, dtype=torch.float64) for b in shard.blocks], "t")
    for _ in range(steps):
        shard.apply([torch.randn(b.shape, generator=g, dtype=torch.float64) for b in shard.blocks])
    return shard


def whole(shards: list[TorchShard]) -> dict[str, torch.Tensor]:
    """Each parameter's values and exp_avg, put together from the shards' blocks."""
    rows: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for shard in shards:
        for b, v in zip(shard.blocks, shard.views()):
            rows.setdefault(b.param, []).append((b.row_start, v.reshape(-1), shard.optimizer.state[v]["exp_avg"].reshape(-1)))
    out = {}
    for p, parts in rows.items():
        parts.sort(key=lambda x: x[0])
        out[p] = torch.cat([v for _, v, _ in parts])
        out[p + ".exp_avg"] = torch.cat([a for _, _, a in parts])
    return out


@pytest.mark.parametrize("to", [1, 2, 3, 5])
def test_state_of_two_pservers_loads_into_another_cut_and_count(to):
    two = Layout.build(SPECS, SlotMap.initial(2, 16), min_block=8)
    shards = [trained(two, p) for p in range(2)]
    entries = {k: v.clone() for s in shards for k, v in s.export_blocks().items()}
    other = Layout.build(SPECS, SlotMap.initial(to, 16), min_block=5)  # cut differently, too
    if to == 2:  # the same cut (as a slot migration has it): the fast path
        other = two
    loaded = [TorchShard(other.blocks_of(p), "Adam", {"lr": 0.01}) for p in range(to)]
    for s in loaded:
        s.import_blocks(entries)
        assert s.initialized
    before, after = whole(shards), whole([s for s in loaded if s.blocks])
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k


def test_missing_rows_are_refused_and_nothing_changes():
    two = Layout.build(SPECS, SlotMap.initial(2, 16), min_block=8)
    shard = trained(two, 0)
    one = TorchShard(Layout.build(SPECS, SlotMap.initial(1, 16), min_block=8).blocks_of(0), "Adam", {"lr": 0.01})
    with pytest.raises(ConfigError, match="no state for"):
        one.import_blocks(shard.export_blocks())
    assert not one.initialized


def test_a_bad_entry_name_is_refused():
    shard = trained(Layout.build(SPECS, SlotMap.initial(1, 16), min_block=8), 0)
    with pytest.raises(ConfigError, match="unexpected entry"):
        shard.import_blocks({"values": torch.zeros(3)})


def test_gradients_staged_while_the_values_come_are_applied_with_them():
    """A shard built ahead of a resize's switch (``reserve``d buffers) takes gradients
    before its values (``expect_import``); importing the values keeps them, and the
    round applies as on a shard that had its values first."""
    layout = Layout.build(SPECS, SlotMap.initial(1, 16), min_block=8)
    source = trained(layout, 0)
    g = [torch.randn(b.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64) for b in source.blocks]
    early = TorchShard(layout.blocks_of(0), "Adam", {"lr": 0.01})
    early.reserve(["t"])
    with pytest.raises(Exception, match="not initialized"):
        early.stage("t", g)  # values first, unless told they are on their way
    early.expect_import()
    early.stage("t", g)
    early.import_blocks({k: v.clone() for k, v in source.export_blocks().items()})
    assert early.staged() == {"t"}
    late = TorchShard(layout.blocks_of(0), "Adam", {"lr": 0.01})
    late.import_blocks({k: v.clone() for k, v in source.export_blocks().items()})
    late.stage("t", g)
    early.apply_staged([("t", 0.5)])
    late.apply_staged([("t", 0.5)])
    for a, b in zip(early.views(), late.views()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
