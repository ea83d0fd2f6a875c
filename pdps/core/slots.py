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
* With ``replicas`` R > 1 each slot also has R - 1 backups on other pservers, placed
  and rebalanced by :mod:`pdps.core.replicas` (copies balanced too, the fewest moved).

Everything here is a pure function of its inputs, so every process computes the
same layout from the same model description.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Mapping, Sequence

import attrs

from pdps.core import replicas as replicas_
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


def _backup_lists(value: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(b) for b in value)


@attrs.frozen
class SlotMap:
    """Which pservers hold each slot. ``owners[s]`` is the pserver index of slot ``s``'s
    primary, the copy that serves it.

    ``replicas``: the copies each slot is meant to have (R, 1 unless the job sets
    ``replicas``); ``backups[s]``: the pservers holding slot ``s``'s other copies, in
    the order they are promoted (empty tuples when R is 1). A slot has fewer than
    R - 1 backups only while it runs short after a pserver's death
    (:meth:`without`, until :meth:`replenish`).

    ``base``: the pserver count the model's blocks were cut and placed for (the job's
    first map); None for a first map, whose own count it is. A resized map keeps it,
    so a block stays in its slot whatever the pserver count: resizing moves slots,
    never blocks, and every process computes the same :class:`Layout`.
    """

    version: int
    num_pservers: int
    owners: tuple[int, ...] = attrs.field(converter=tuple)
    base: int | None = None
    replicas: int = 1
    backups: tuple[tuple[int, ...], ...] = attrs.field(
        default=attrs.Factory(lambda self: ((),) * len(self.owners), takes_self=True), converter=_backup_lists
    )

    def __attrs_post_init__(self) -> None:
        if self.num_pservers < 1:
            raise ConfigError(f"a slot map needs at least one pserver, got {self.num_pservers}")
        if len(self.owners) < self.num_pservers:
            raise ConfigError(f"{len(self.owners)} slots cannot cover {self.num_pservers} pservers")
        if any(not 0 <= o < self.num_pservers for o in self.owners):
            raise ConfigError("slot owner out of range")
        if self.base is not None and not 1 <= self.base <= len(self.owners):
            raise ConfigError(f"a slot map's base pserver count must be 1..{len(self.owners)}, got {self.base}")
        _check_replicas(self.replicas, self.num_pservers)
        if len(self.backups) != len(self.owners):
            raise ConfigError(f"a slot map lists backups for {len(self.backups)} slots, but it has {len(self.owners)}")
        for s, backups in enumerate(self.backups):
            if len(backups) >= self.replicas:
                raise ConfigError(f"slot {s} has {len(backups)} backups {list(backups)}; with replicas={self.replicas} at most {self.replicas - 1}")
            if any(not 0 <= b < self.num_pservers for b in backups):
                raise ConfigError(f"slot {s}: backup out of range {list(backups)} (pservers 0..{self.num_pservers - 1})")
            if len(set(self.holders(s))) != len(backups) + 1:
                raise ConfigError(f"slot {s}: its primary {self.owners[s]} and backups {list(backups)} must be distinct pservers")

    @property
    def placement(self) -> SlotMap:
        """The map the model's blocks are cut and placed by (:meth:`Layout.build`)."""
        return self if self.base is None else SlotMap.initial(self.base, self.num_slots)

    @property
    def _placed_by(self) -> int:
        """``base`` of every map that follows this one: the pserver count of the job's
        first map. A map's blocks are placed by that map, never by one whose primaries a
        failover or a resize moved (:attr:`placement`): with its own owners as the
        placement, a small model's blocks would change slots (and so pservers) with no
        slot moving, and a promoted backup would lack them."""
        return self.num_pservers if self.base is None else self.base

    @property
    def num_slots(self) -> int:
        return len(self.owners)

    @classmethod
    def initial(cls, num_pservers: int, num_slots: int = DEFAULT_NUM_SLOTS, replicas: int = 1) -> SlotMap:
        """Primaries round-robin: balanced, and the same in every process. With
        ``replicas`` R > 1, each slot's R - 1 backups go where every pserver ends with
        ``R*S // n`` copies or one more, and the slots a pserver holds share their other
        copies with as many different pservers as they can (so its death spreads)."""
        if num_slots < 1:
            raise ConfigError(f"num_slots must be >= 1, got {num_slots}")
        if num_pservers < 1:  # checked here too: the round-robin below would divide by zero first
            raise ConfigError(f"a slot map needs at least one pserver, got {num_pservers}")
        _check_replicas(replicas, num_pservers)
        owners = tuple(s % num_pservers for s in range(num_slots))
        holders = [[o] for o in owners]
        have = [len(range(p, num_slots, num_pservers)) for p in range(num_pservers)]
        placed = replicas_.place(holders, [list(h) for h in holders], replicas_.quotas(have, replicas * num_slots), replicas)
        return cls(version=1, num_pservers=num_pservers, owners=owners, replicas=replicas, backups=[h[1:] for h in placed])

    def holders(self, slot: int) -> tuple[int, ...]:
        """The pservers holding a copy of ``slot``, its primary first."""
        return (self.owners[slot], *self.backups[slot])

    def held_by(self, pserver: int) -> list[int]:
        """The slots ``pserver`` holds a copy of (primary or backup), lowest first."""
        return [s for s in range(self.num_slots) if pserver in self.holders(s)]

    def load(self) -> list[int]:
        """Slots per pserver (those it is the primary of)."""
        out = [0] * self.num_pservers
        for o in self.owners:
            out[o] += 1
        return out

    def copy_load(self) -> list[int]:
        """Copies per pserver: the slots it is primary of, plus those it backs up."""
        out = self.load()
        for backups in self.backups:
            for b in backups:
                out[b] += 1
        return out

    def under_replicated(self) -> list[int]:
        """The slots with fewer than ``replicas`` copies (after :meth:`without`)."""
        return [s for s, b in enumerate(self.backups) if len(b) < self.replicas - 1]

    def rebalance(self, num_pservers: int) -> SlotMap:
        """A balanced map for ``num_pservers`` that moves the fewest copies.

        Balanced: every pserver is the primary of ``S // M`` slots or one more, and
        holds ``R*S // M`` copies or one more. Each surviving pserver keeps its copies
        up to its quota (``R*S // M``, and one more for the ``R*S % M`` pservers that hold
        the most now), its primaries first, then the lowest slots; the other copies
        are made anew, lowest slot first, on the pservers below quota (lowest index
        first when R is 1; with replicas, the one sharing the fewest slots with the
        slot's other holders), rerouting earlier ones where a slot finds no pserver
        with room that does not hold it already. No balanced map keeps more copies.
        A slot's primary stays where its copy stays; where it does not, the first
        surviving backup is promoted (no bytes move); then primaries shift along
        holders only as far as balance needs. A short map (:meth:`without`) comes
        back to ``replicas`` copies per slot.
        """
        m = num_pservers
        if m < 1:
            raise ConfigError(f"cannot rebalance onto {m} pservers")
        if m > self.num_slots:
            raise ConfigError(f"{self.num_slots} slots cannot cover {m} pservers")
        if self.replicas > m:
            raise ConfigError(f"each slot has {self.replicas} replicas on distinct pservers, so a job needs at least {self.replicas} pservers; cannot rebalance onto {m}")
        surviving = [[p for p in self.holders(s) if p < m] for s in range(self.num_slots)]
        have = [0] * m
        for hs in surviving:
            for p in hs:
                have[p] += 1
        quota = replicas_.quotas(have, self.replicas * self.num_slots)
        holders = replicas_.place(replicas_.keep(surviving, self.owners, quota), surviving, quota, self.replicas)
        # the kept copies lead each list in their old order: the old primary, else its first surviving backup
        owners = replicas_.balance_primaries(holders, [hs[0] for hs in holders], m)
        base = self._placed_by
        return SlotMap(
            version=self.version + 1, num_pservers=m, owners=tuple(owners), base=base, replicas=self.replicas,
            backups=[[p for p in hs if p != o] for hs, o in zip(holders, owners)],
        )

    def lost_with(self, pserver: int) -> list[int]:
        """The slots whose only copy ``pserver`` holds (all of its slots when R is 1):
        if it dies, they are lost and the job rolls back to its last checkpoint."""
        return [s for s in range(self.num_slots) if self.holders(s) == (pserver,)]

    def without(self, pserver: int) -> SlotMap:
        """The next map once ``pserver`` is dead: each slot it was the primary of is
        served by its first surviving backup (promoted: no bytes move), and it is
        dropped from every backup list. Those slots run one copy short until
        :meth:`replenish`. ``pserver`` keeps its index (a replacement takes it) and
        holds nothing. ConfigError when it held the only copy of a slot
        (:meth:`lost_with`): no map can do without it, the job must roll back."""
        if not 0 <= pserver < self.num_pservers:
            raise ConfigError(f"pserver {pserver} is not in this slot map (pservers 0..{self.num_pservers - 1})")
        lost = self.lost_with(pserver)
        if lost:
            shown = ", ".join(map(str, lost[:10])) + (f" and {len(lost) - 10} more" if len(lost) > 10 else "")
            raise ConfigError(
                f"pserver {pserver} holds the only copy of {len(lost)} slot{'s' if len(lost) != 1 else ''} ({shown}; replicas={self.replicas}): "
                "without it they are lost, and the job must roll back to its last checkpoint"
            )
        holders = [[p for p in self.holders(s) if p != pserver] for s in range(self.num_slots)]
        return attrs.evolve(self, version=self.version + 1, owners=[hs[0] for hs in holders], backups=[hs[1:] for hs in holders], base=self._placed_by)

    def replenish(self, live: Collection[int] | None = None) -> SlotMap:
        """The next map with every slot back to ``replicas`` copies, made one at a time on
        the live pserver (default: all of them) holding the fewest copies that lacks a
        short slot (a replacement holding nothing takes them all), the slot being the
        one the fewest live pservers could take, then the lowest
        (:func:`pdps.core.replicas.replenish`). Primaries and existing copies stay; a
        rebalance onto the same count then hands primaries to the replacement without
        moving a copy. On fewer pservers than the map (no replacement) the copies can
        end less balanced than a rebalance would leave them. ConfigError when fewer
        than ``replicas`` pservers are live."""
        live = sorted(range(self.num_pservers) if live is None else set(live))
        if any(not 0 <= p < self.num_pservers for p in live):
            raise ConfigError(f"live pservers {live} are not all in this slot map (pservers 0..{self.num_pservers - 1})")
        if len(live) < self.replicas:
            raise ConfigError(f"{len(live)} live pservers {live} cannot hold {self.replicas} replicas of each slot; at least {self.replicas} are needed")
        holders = [list(self.holders(s)) for s in range(self.num_slots)]
        replicas_.replenish(holders, live, self.replicas, self.num_pservers)
        return attrs.evolve(self, version=self.version + 1, backups=[hs[1:] for hs in holders], base=self._placed_by)

    def moved(self, other: SlotMap) -> int:
        """How many copies ``other`` makes anew (:meth:`moves`)."""
        return len(self.moves(other))

    def moves(self, other: SlotMap) -> list[tuple[int, int, int]]:
        """``(slot, from pserver, to pserver)`` for each copy ``other`` places on a pserver
        that holds no copy of the slot here. The source is the first holder here
        (primary first) that still holds the slot in ``other`` (it stays serving),
        else the primary here."""
        out = []
        for s in range(self.num_slots):
            old, new = self.holders(s), other.holders(s)
            src = next((p for p in old if p in new), old[0])
            out.extend((s, src, dst) for dst in new if dst not in old)
        return out

    def to_json(self) -> dict:
        out: dict = {"version": self.version, "num_pservers": self.num_pservers, "owners": list(self.owners)}
        if self.base is not None:
            out["base"] = self.base
        if self.replicas > 1:  # a map without replicas reads and writes as before they existed
            out["replicas"] = self.replicas
            out["backups"] = [list(b) for b in self.backups]
        return out

    @classmethod
    def from_json(cls, d: Mapping) -> SlotMap:
        base = d.get("base")
        owners = tuple(int(x) for x in d["owners"])
        backups = [[int(x) for x in b] for b in d["backups"]] if "backups" in d else [[] for _ in owners]
        return cls(
            version=int(d["version"]), num_pservers=int(d["num_pservers"]), owners=owners,
            base=None if base is None else int(base), replicas=int(d.get("replicas", 1)), backups=backups,
        )


def _check_replicas(replicas: int, num_pservers: int) -> None:
    if replicas < 1:
        raise ConfigError(f"replicas must be >= 1 (1: no backups), got {replicas}")
    if replicas > num_pservers:
        raise ConfigError(f"replicas={replicas} puts each slot on {replicas} distinct pservers, but the map has only {num_pservers}")


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
        when every pserver holds a share (with replicas, backup copies count: a
        pserver holding only backups applies every update, and serves once promoted)."""
        idle = tuple(p for p in self.idle_pservers if not any(b.numel for b in self.blocks_held(p)))
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
        """The blocks a pserver is the primary of, in model order (the order of every
        push and pull: trainers address primaries only)."""
        return [b for i, b in enumerate(self.blocks) if self.pserver_of(i) == pserver]

    def blocks_held(self, pserver: int) -> list[Block]:
        """The blocks a pserver holds a copy of (primary or backup), in model order: its
        shard. With one replica, :meth:`blocks_of`."""
        if self.slot_map.replicas == 1:
            return self.blocks_of(pserver)
        return [b for b, s in zip(self.blocks, self.slots) if pserver in self.slot_map.holders(s)]
