"""How the model's parameters are spread over the pservers.

* A parameter is cut into *blocks* of whole rows (along dim 0), each at least a
  *floor* of elements; a parameter smaller than that is one block. The rows that
  do not fill a block join the previous one, so only a whole parameter is ever
  smaller than the floor. The floor is ``min_block``, lowered for a model too small
  to give every pserver several blocks of that size (:func:`block_floor`).
* A block hashes (blake2b of ``"<name>@<first row>"``, never Python's salted ``hash``)
  into one of ``num_slots`` slots; a versioned :class:`SlotMap` assigns slots to
  pservers. Moving a slot later moves all its blocks, so elastic scaling re-places
  slots, never individual rows. Where the hash leaves a pserver with no block, the
  layout moves one block into that pserver's slots (:meth:`Layout.build`), so every
  pserver holds a share whenever the model has at least one row per pserver.
* :meth:`SlotMap.rebalance` to M pservers keeps the map balanced (pserver loads
  differ by at most one slot) and moves the fewest slots a balanced map allows.

Everything here is a pure function of its inputs, so every process computes the
same layout from the same model description.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence

import attrs

from pdps.core.errors import ConfigError

DEFAULT_NUM_SLOTS = 256
DEFAULT_MIN_BLOCK = 4096
#: A model smaller than this many blocks of ``min_block`` per pserver is cut finer:
#: with several blocks each, the hash spreads a pserver's share over its slots.
BLOCKS_PER_PSERVER = 8

_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
_DTYPES = frozenset(_ITEMSIZE)


@attrs.frozen
class ParamSpec:
    """A named parameter: its shape and dtype (``torch`` dtype name without prefix)."""

    name: str
    shape: tuple[int, ...] = attrs.field(converter=tuple)
    dtype: str

    def __attrs_post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ConfigError(f"parameter {self.name!r}: dtype {self.dtype!r} is not a floating dtype pdps trains ({sorted(_DTYPES)})")
        if any(d < 0 for d in self.shape):
            raise ConfigError(f"parameter {self.name!r}: negative dimension in shape {self.shape}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:]) if self.shape else 1

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, d: Mapping) -> ParamSpec:
        return cls(name=str(d["name"]), shape=tuple(int(x) for x in d["shape"]), dtype=str(d["dtype"]))


@attrs.frozen
class Block:
    """Rows ``[row_start, row_end)`` of one parameter.

    ``offset`` is the block's first element in the model's flat buffer (parameters
    laid out in order, each row-major), so a block is one contiguous range there.
    """

    param: str
    index: int  # position of the parameter in the model
    row_start: int
    row_end: int
    offset: int
    numel: int
    shape: tuple[int, ...]  # the block's own shape: (rows, *param.shape[1:])
    dtype: str

    @property
    def key(self) -> str:
        return f"{self.param}@{self.row_start}"

    def describe(self) -> str:
        return f"{self.param}[{self.row_start}:{self.row_end}]"


def block_entry(b: Block) -> str:
    """The name a block's state goes by, whatever pserver holds it: ``<param>@<first>:<end>``
    (``.../values``, ``.../state.<k>``, ``.../scalar.<k>`` are its entries in a slot
    migration and a checkpoint part)."""
    return f"{b.param}@{b.row_start}:{b.row_end}"


def parse_entry(key: str) -> tuple[str, int, int, str] | None:
    """``(param, first row, end row, what)`` of an entry named ``<param>@<first>:<end>/<what>``;
    None for any other name."""
    block, sep, what = key.rpartition("/")
    param, at, rows = block.rpartition("@")
    first, colon, end = rows.partition(":")
    if not (sep and at and colon and first.isdigit() and end.isdigit()):
        return None
    return param, int(first), int(end), what


def cut_blocks(params: Sequence[ParamSpec], min_block: int = DEFAULT_MIN_BLOCK) -> list[Block]:
    """Cut parameters into row-aligned blocks of at least ``min_block`` elements."""
    if min_block < 1:
        raise ConfigError(f"min_block must be >= 1 element, got {min_block}")
    names = [p.name for p in params]
    if len(set(names)) != len(names):
        raise ConfigError("parameter names must be unique")
    blocks: list[Block] = []
    offset = 0
    for index, p in enumerate(params):
        rows, row_numel = p.rows, p.row_numel
        per = max(1, math.ceil(min_block / row_numel)) if row_numel else rows or 1
        starts = list(range(0, rows, per)) or [0]
        if len(starts) > 1 and (rows - starts[-1]) * row_numel < min_block:
            starts.pop()  # the short tail joins the previous block
        bounds = starts + [rows]
        for a, b in zip(bounds, bounds[1:]):
            n = (b - a) * row_numel if p.shape else 1
            shape = (b - a, *p.shape[1:]) if p.shape else ()
            blocks.append(Block(p.name, index, a, b, offset + a * row_numel, n, shape, p.dtype))
        offset += p.numel
    return blocks


def block_floor(params: Sequence[ParamSpec], num_pservers: int, min_block: int = DEFAULT_MIN_BLOCK) -> int:
    """The fewest elements of a block (:func:`cut_blocks`) for this model on ``num_pservers``.

    ``min_block`` for a model of at least ``BLOCKS_PER_PSERVER * num_pservers`` blocks
    of that size, so a big model's blocks are those of ``min_block`` whatever the
    pserver count. A smaller model is cut into about that many blocks, and finer
    still (halving the floor, down to one element: one row per block) until it has a
    block with elements for every pserver, or one per row when it has fewer rows
    than pservers.
    """
    if num_pservers < 1:
        raise ConfigError(f"a model is spread over at least one pserver, got {num_pservers}")
    if min_block < 1:
        raise ConfigError(f"min_block must be >= 1 element, got {min_block}")
    total = sum(p.numel for p in params)
    floor = min(min_block, max(1, -(-total // (BLOCKS_PER_PSERVER * num_pservers))))
    want = min(num_pservers, sum(p.rows for p in params if p.numel))
    while floor > 1 and sum(1 for b in cut_blocks(params, floor) if b.numel) < want:
        floor //= 2
    return floor


def slot_of(block_key: str, num_slots: int) -> int:
    digest = hashlib.blake2b(block_key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % num_slots


@attrs.frozen
class SlotMap:
    """Which pserver owns each slot. ``owners[s]`` is the pserver index of slot ``s``.

    ``base``: the pserver count the model's blocks were cut and placed for (the job's
    first map); None for a first map, whose own count it is. A resized map keeps it,
    so a block stays in its slot whatever the pserver count: resizing moves slots,
    never blocks, and every process computes the same :class:`Layout`.
    """

    version: int
    num_pservers: int
    owners: tuple[int, ...] = attrs.field(converter=tuple)
    base: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.num_pservers < 1:
            raise ConfigError(f"a slot map needs at least one pserver, got {self.num_pservers}")
        if len(self.owners) < self.num_pservers:
            raise ConfigError(f"{len(self.owners)} slots cannot cover {self.num_pservers} pservers")
        if any(not 0 <= o < self.num_pservers for o in self.owners):
            raise ConfigError("slot owner out of range")
        if self.base is not None and not 1 <= self.base <= len(self.owners):
            raise ConfigError(f"a slot map's base pserver count must be 1..{len(self.owners)}, got {self.base}")

    @property
    def placement(self) -> SlotMap:
        """The map the model's blocks are cut and placed by (:meth:`Layout.build`)."""
        return self if self.base is None else SlotMap.initial(self.base, self.num_slots)

    @property
    def num_slots(self) -> int:
        return len(self.owners)

    @classmethod
    def initial(cls, num_pservers: int, num_slots: int = DEFAULT_NUM_SLOTS) -> SlotMap:
        """Round-robin: balanced, and the same in every process."""
        if num_slots < 1:
            raise ConfigError(f"num_slots must be >= 1, got {num_slots}")
        if num_pservers < 1:  # checked here too: the round-robin below would divide by zero first
            raise ConfigError(f"a slot map needs at least one pserver, got {num_pservers}")
        return cls(version=1, num_pservers=num_pservers, owners=tuple(s % num_pservers for s in range(num_slots)))

    def load(self) -> list[int]:
        """Slots per pserver."""
        out = [0] * self.num_pservers
        for o in self.owners:
            out[o] += 1
        return out

    def rebalance(self, num_pservers: int) -> SlotMap:
        """A balanced map for ``num_pservers`` that moves the fewest slots.

        Each surviving pserver keeps its slots up to its new quota (``S // M``, and
        one more for the ``S % M`` pservers that hold the most now); only the surplus
        and the slots of removed pservers move, lowest slot first, to the pservers
        below quota, lowest index first.
        """
        m = num_pservers
        if m < 1:
            raise ConfigError(f"cannot rebalance onto {m} pservers")
        if m > self.num_slots:
            raise ConfigError(f"{self.num_slots} slots cannot cover {m} pservers")
        have = [0] * m
        for o in self.owners:
            if o < m:
                have[o] += 1
        base, extra = divmod(self.num_slots, m)
        by_load = sorted(range(m), key=lambda p: (-have[p], p))
        quota = [base] * m
        for p in by_load[:extra]:
            quota[p] += 1
        kept = [0] * m
        owners = list(self.owners)
        moving: list[int] = []
        for s, o in enumerate(owners):
            if o < m and kept[o] < quota[o]:
                kept[o] += 1
            else:
                moving.append(s)
        receivers = (p for p in range(m) for _ in range(quota[p] - kept[p]))
        for s, p in zip(moving, receivers):
            owners[s] = p
        base = self.num_pservers if self.base is None else self.base
        return SlotMap(version=self.version + 1, num_pservers=m, owners=tuple(owners), base=base)

    def moved(self, other: SlotMap) -> int:
        return sum(a != b for a, b in zip(self.owners, other.owners))

    def moves(self, other: SlotMap) -> list[tuple[int, int, int]]:
        """``(slot, from pserver, to pserver)`` for each slot ``other`` places elsewhere."""
        return [(s, a, b) for s, (a, b) in enumerate(zip(self.owners, other.owners)) if a != b]

    def to_json(self) -> dict:
        out = {"version": self.version, "num_pservers": self.num_pservers, "owners": list(self.owners)}
        if self.base is not None:
            out["base"] = self.base
        return out

    @classmethod
    def from_json(cls, d: Mapping) -> SlotMap:
        base = d.get("base")
        return cls(
            version=int(d["version"]), num_pservers=int(d["num_pservers"]), owners=tuple(int(x) for x in d["owners"]),
            base=None if base is None else int(base),
        )


@attrs.frozen
class Layout:
    """The blocks of a model and the pserver each one lives on."""

    blocks: tuple[Block, ...]
    slot_map: SlotMap
    slots: tuple[int, ...]  # slot of each block, parallel to ``blocks``

    @classmethod
    def build(cls, params: Sequence[ParamSpec], slot_map: SlotMap, min_block: int = DEFAULT_MIN_BLOCK) -> Layout:
        """Cut the model at its :func:`block_floor` and place each block in its hash slot.

        Then, for each pserver left holding no element (lowest index first), the last
        block of the pserver holding the most blocks (lowest index on a tie) moves to
        one of the empty pserver's slots (chosen by the block's hash), as long as that
        pserver keeps a block: every pserver holds a share when the model has at least
        one row per pserver, and every process computes the same moves. All of this
        is done for the map's :attr:`~SlotMap.placement` (the job's first map); the
        blocks then live on whichever pserver ``slot_map`` gives their slot.
        """
        placement = slot_map.placement  # a resized job's blocks stay where its first map put them
        blocks = tuple(cut_blocks(params, block_floor(params, placement.num_pservers, min_block)))
        slots = [slot_of(b.key, placement.num_slots) for b in blocks]
        owners = placement.owners
        held: list[list[int]] = [[] for _ in range(placement.num_pservers)]
        for i, b in enumerate(blocks):
            if b.numel:
                held[owners[slots[i]]].append(i)
        for p, mine in enumerate(held):
            if mine:
                continue
            donor = max(held, key=len)
            if len(donor) < 2:
                break
            own = [s for s, o in enumerate(owners) if o == p]
            if not own:
                continue
            i = donor.pop()
            slots[i] = own[slot_of(blocks[i].key, len(own))]
            mine.append(i)
        return cls(blocks, slot_map, tuple(slots))

    def pserver_of(self, i: int) -> int:
        return self.slot_map.owners[self.slots[i]]

    def slot_bytes(self, state_copies: int = 1) -> list[int]:
        """Bytes of each slot's blocks, times ``state_copies`` (the values plus each
        per-element optimizer state tensor): what moving the slot sends."""
        out = [0] * self.slot_map.num_slots
        for b, s in zip(self.blocks, self.slots):
            out[s] += b.numel * _ITEMSIZE[b.dtype] * state_copies
        return out

    @property
    def idle_pservers(self) -> tuple[int, ...]:
        """The pservers that hold no element of the model: it has fewer rows than
        pservers, or (a hand-made map) the slot map gives them no slot."""
        busy = {self.pserver_of(i) for i, b in enumerate(self.blocks) if b.numel}
        return tuple(p for p in range(self.slot_map.num_pservers) if p not in busy)

    def spread_warning(self) -> str | None:
        """Why some pservers sit idle, in words for a log line and ``pdps status``; None
        when every pserver holds a share."""
        idle = self.idle_pservers
        if not idle:
            return None
        rows = sum(b.row_end - b.row_start for b in self.blocks if b.numel)
        m = self.slot_map.num_pservers
        if rows < m:
            fit = max(rows, 1)
            why = f"the model has {rows} row{'s' if rows != 1 else ''} with elements, and a row is never split; run it with at most {fit} pserver{'s' if fit != 1 else ''}"
        elif all(any(o == p for o in self.slot_map.owners) for p in idle):
            why = f"their slots hold none of the model's {len(self.blocks)} blocks (cut for the job's first {self.slot_map.placement.num_pservers} pservers)"
        else:
            why = "the slot map gives them no slot"
        return f"{len(idle)} of {m} pservers hold no part of the model (pserver {', '.join(map(str, idle))}): {why}"

    def blocks_of(self, pserver: int) -> list[Block]:
        """The blocks a pserver holds, in model order (the order of every push and pull)."""
        return [b for i, b in enumerate(self.blocks) if self.pserver_of(i) == pserver]
