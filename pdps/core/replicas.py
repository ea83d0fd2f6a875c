"""Where the copies of the slots go when each slot has ``R`` holders (replicas): the
placement behind :meth:`SlotMap.initial`, :meth:`SlotMap.rebalance` and
:meth:`SlotMap.replenish`. Plain lists in, plain lists out; the map itself lives in
:mod:`pdps.core.slots`.

Two problems, solved one after the other:

* **Copies.** Every slot gets ``R`` distinct holders; every pserver holds
  ``R*S // n`` copies or one more (its *quota*); every copy that can stay, stays. A
  kept copy costs nothing and a new one costs its bytes, so this is a min-cost flow
  (slots -> pservers, capacities the quotas) solved by successive shortest paths:
  a new copy goes straight to a pserver with room where one can take it (a path of
  cost 1, which nothing beats), and only when none can does :func:`_reroute` search
  for the cheapest way to make room (moving copies placed earlier, or a quota's
  extra copy to another pserver). The result is optimal: no balanced placement
  keeps more copies.
* **Primaries.** Each slot's primary is one of its holders; every pserver is the
  primary of ``S // n`` slots or one more. A primary moves no bytes, and balanced
  copies always admit balanced primaries (a pserver holding between
  ``R*floor(S/n)`` and ``R*ceil(S/n)`` copies can take between ``floor`` and ``ceil``
  of their primaries), so :func:`balance_primaries` only walks chains of holders.

Where several pservers could take a copy, the one sharing the fewest slots with the
slot's other holders wins: the copies a pserver shares spread over the others, so
when it dies its primaries are promoted, and its copies re-made, all over the job
rather than on one neighbour.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence


def quotas(have: Sequence[int], total: int) -> list[int]:
    """``total`` copies over ``len(have)`` pservers, balanced; the ``total % n`` larger
    quotas go to the pservers that hold the most now (lowest index on a tie), which
    is what lets the most of them stay."""
    m = len(have)
    base, extra = divmod(total, m)
    out = [base] * m
    for p in sorted(range(m), key=lambda p: (-have[p], p))[:extra]:
        out[p] += 1
    return out


def keep(holders: Sequence[Sequence[int]], primaries: Sequence[int], quota: Sequence[int]) -> list[list[int]]:
    """The copies that stay: each pserver keeps as many of its copies as its quota
    allows, its primaries first, then the lowest slots. Each slot's kept holders stay
    in their old order (primary first)."""
    kept = [0] * len(quota)
    stays: set[tuple[int, int]] = set()
    order = sorted(((s, p) for s, hs in enumerate(holders) for p in hs), key=lambda sp: (primaries[sp[0]] != sp[1], sp[0]))
    for s, p in order:
        if kept[p] < quota[p]:
            kept[p] += 1
            stays.add((s, p))
    return [[p for p in hs if (s, p) in stays] for s, hs in enumerate(holders)]


class _Placement:
    """Copies being placed: the holders of each slot, the copies each pserver holds
    and may hold, and how many slots each pair of pservers shares."""

    def __init__(self, holders: list[list[int]], num_pservers: int, replicas: int, old: Sequence[Sequence[int]] = ()) -> None:
        self.holders = holders
        self.replicas = replicas
        self.old = [set(hs) for hs in old]  # a copy there already costs nothing to keep
        self.quota: list[int] = []
        self.load = [0] * num_pservers
        # shared[p][q]: slots both hold; led[p][q]: slots p holds first and q second (promoted when p dies)
        self.shared = [[0] * num_pservers for _ in range(num_pservers)]
        self.led = [[0] * num_pservers for _ in range(num_pservers)]
        for s in range(len(holders)):
            self._count(s, 1)

    def _count(self, s: int, sign: int) -> None:
        hs = self.holders[s]
        for p in hs:
            self.load[p] += sign
            for q in hs:
                self.shared[p][q] += sign * (p != q)
        if len(hs) > 1:
            self.led[hs[0]][hs[1]] += sign

    def spread(self, s: int, p: int) -> tuple[int, int]:
        """How much ``p`` would pile onto one pserver as a holder of slot ``s``: as its
        second holder, the slots whose primary is promoted to it when the first holder
        dies; then the slots it shares with ``s``'s holders (copied again when one of
        them dies)."""
        hs = self.holders[s]
        return (self.led[hs[0]][p] if len(hs) == 1 else 0), sum(self.shared[p][q] for q in hs)

    def cost(self, s: int, p: int) -> int:
        return 0 if p in self.old[s] else 1

    def add(self, s: int, p: int) -> None:
        self._count(s, -1)
        self.holders[s].append(p)
        self._count(s, 1)

    def drop(self, s: int, p: int) -> None:
        self._count(s, -1)
        self.holders[s].remove(p)
        self._count(s, 1)

    def fill(self, quota: list[int]) -> None:
        """Bring every slot to ``replicas`` holders within the quotas, lowest slot first."""
        self.quota = quota
        for s, hs in enumerate(self.holders):
            while len(hs) < self.replicas:
                room = [p for p in range(len(quota)) if self.load[p] < quota[p] and p not in hs]
                if room:
                    self.add(s, min(room, key=lambda p: (*self.spread(s, p), p)))
                else:
                    self._reroute()

    def _reroute(self) -> None:
        """One more copy for some slot short of holders, by the cheapest chain of changes
        (Bellman-Ford over the residual graph; no cycle there costs less than 0, as every
        earlier change was a cheapest one).

        Nodes: a slot short of one holder; a pserver holding one copy more than its
        quota; ``extra``, a larger quota passing from one pserver to another. A slot
        takes a pserver not holding it (cost 0 where it held it before, else 1); a
        pserver over quota gives up one of its copies (minus that copy's cost) or
        takes an extra quota from a pserver holding one (whose turn it then is); a
        pserver under quota ends the chain.
        """
        num_slots, m = len(self.holders), len(self.quota)
        floor = sum(self.quota) // m
        extra = num_slots + m
        dist: list[float] = [float("inf")] * (extra + 1)
        parent: list[int | None] = [None] * (extra + 1)
        queue = deque(s for s, hs in enumerate(self.holders) if len(hs) < self.replicas)
        for s in queue:
            dist[s] = 0
        queued = set(queue)
        held: list[list[int]] = [[] for _ in range(m)]
        for u, hs in enumerate(self.holders):
            for p in hs:
                held[p].append(u)

        def relax(node: int, d: float, via: int) -> None:
            if d < dist[node]:
                dist[node], parent[node] = d, via
                if node not in queued:
                    queued.add(node)
                    queue.append(node)

        while queue:
            v = queue.popleft()
            queued.discard(v)
            if v < num_slots:
                for p in range(m):
                    if p not in self.holders[v]:
                        relax(num_slots + p, dist[v] + self.cost(v, p), v)
            elif v < extra:
                p = v - num_slots
                for u in held[p]:
                    relax(u, dist[v] - self.cost(u, p), v)
                if self.quota[p] == floor:
                    relax(extra, dist[v], v)
            else:
                for p in range(m):
                    if self.quota[p] > floor:
                        relax(num_slots + p, dist[v], v)
        ends = [p for p in range(m) if self.load[p] < self.quota[p] and dist[num_slots + p] < float("inf")]
        # a balanced placement exists for any replicas <= pservers <= slots (copy i of
        # slot s on pserver (s*R + i) % n), so a short slot always has a chain
        assert ends, "no chain of changes gives a short slot a holder"
        node: int | None = num_slots + min(ends, key=lambda p: (dist[num_slots + p], p))
        changes = []
        while node is not None and parent[node] is not None:
            changes.append((parent[node], node))
            node = parent[node]
        for a, b in changes:
            if a < num_slots:
                self.add(a, b - num_slots)
            elif a < extra and b < num_slots:
                self.drop(b, a - num_slots)
            elif a < extra:
                self.quota[a - num_slots] += 1
            else:
                self.quota[b - num_slots] -= 1


def place(holders: list[list[int]], old: Sequence[Sequence[int]], quota: list[int], replicas: int) -> list[list[int]]:
    """``holders`` (the copies that stay) completed to ``replicas`` holders per slot, every
    pserver ending at its quota (a larger quota may pass to another pserver where that
    keeps more copies), with the fewest new copies: a copy on a pserver in ``old[s]``
    costs nothing. Changes ``holders`` and ``quota`` in place."""
    _Placement(holders, len(quota), replicas, old).fill(quota)
    return holders


def replenish(holders: list[list[int]], live: Sequence[int], replicas: int, num_pservers: int) -> list[list[int]]:
    """``holders`` completed to ``replicas`` holders per slot, one copy at a time on the
    ``live`` pserver holding the fewest copies that lacks some short slot (on a tie, the
    one that held the fewest before, then the lowest index: a replacement that came
    with nothing takes them all where balance allows): of those it lacks, the slot the
    fewest live pservers could take, then the one whose holders it shares the fewest
    slots with, then the lowest. Filling the emptiest pserver first keeps the copies as
    balanced as the slots already held allow. Changes ``holders`` in place."""
    placement = _Placement(holders, num_pservers, replicas)
    before = list(placement.load)
    short = {s for s, hs in enumerate(holders) if len(hs) < replicas}
    while short:
        for p in sorted(live, key=lambda p: (placement.load[p], before[p], p)):
            lacking = [s for s in short if p not in holders[s]]
            if lacking:
                break
        s = min(lacking, key=lambda s: (sum(q not in holders[s] for q in live), *placement.spread(s, p), s))
        placement.add(s, p)
        if len(holders[s]) == replicas:
            short.discard(s)
    return holders


def balance_primaries(holders: Sequence[Sequence[int]], primaries: list[int], num_pservers: int) -> list[int]:
    """``primaries`` (one holder of each slot) changed along chains of holders until every
    pserver is the primary of ``S // n`` slots or one more; a chain is as short as can
    be, so few primaries change. Changes ``primaries`` in place."""
    low, rem = divmod(len(holders), num_pservers)
    high = low + (rem > 0)
    count = [0] * num_pservers
    for p in primaries:
        count[p] += 1
    for p in range(num_pservers):
        while count[p] > high:
            _shift(holders, primaries, count, p, lambda q: count[q] < high, give=True)
    for p in range(num_pservers):
        while count[p] < low:
            _shift(holders, primaries, count, p, lambda q: count[q] > low, give=False)
    return primaries


def _shift(
    holders: Sequence[Sequence[int]], primaries: list[int], count: list[int], start: int, done: Callable[[int], bool], give: bool
) -> None:
    """Breadth first from ``start`` over pservers sharing a slot: with ``give``, ``start``
    hands the primary of one of its slots to another holder, who hands one on, until a
    pserver for which ``done`` holds takes one; without, ``start`` takes one and the
    chain runs the other way."""
    seen: dict[int, tuple[int, int] | None] = {start: None}
    queue = deque([start])
    while queue:
        p = queue.popleft()
        for s, hs in enumerate(holders):
            if (primaries[s] == p) if give else (p in hs and primaries[s] != p):
                for q in (hs if give else (primaries[s],)):
                    if q in seen:
                        continue
                    seen[q] = (p, s)
                    if done(q):
                        count[start] -= 1 if give else -1
                        count[q] += 1 if give else -1
                        while seen[q] is not None:
                            p, s = seen[q]
                            primaries[s] = q if give else p
                            q = p
                        return
                    queue.append(q)
    raise AssertionError("balanced copies always admit balanced primaries")
