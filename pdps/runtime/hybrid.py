"""Pipeline ranks claimed through the coordination store.

Each trainer of a pipeline job claims one rank of ``[0, P * D)`` under
``pipeline/ranks/<r>`` (:meth:`~pdps.core.job.Keys.pipeline_rank`), the way a pserver
claims its index: the lowest free rank, by a transaction that holds only while the key
is absent, written with the trainer's lease. The rank decides its stage and pipeline
(:class:`~pdps.core.hybrid.HybridGroup`), so a trainer that restarts and takes a rank
freed by a lease that ran out becomes that rank's stage, whatever it was before.

* A claim lives as long as its lease: a trainer that dies frees its rank once its
  lease runs out, and :func:`release` frees it at once on a clean exit.
* Claiming again with the same lease and address finds the claim already made (a
  reply lost to a store outage) and returns the same rank.
* :func:`wait_for_ranks` returns once every rank is claimed, with every claim's
  address: what the p2p links need to find their peers.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from pdps.core.errors import ConfigError, CorruptRecord
from pdps.core.hybrid import HybridGroup, HybridLayout, RankClaim
from pdps.core.job import Keys
from pdps.core.txn import Decision, Done, Write
from pdps.ports.coordination import Compare, CoordinationStore, Delete, KeyValue, Put
from pdps.runtime.cas import read_modify_write
from pdps.runtime.watching import watch_until

log = logging.getLogger(__name__)

#: A refusal names at most this many holders.
NAMED_HOLDERS = 8


def claim_rank(
    store: CoordinationStore, keys: Keys, world: HybridLayout, member: str, address: str, lease: int, *, wait: float = 0.0
) -> HybridGroup:
    """Claim the lowest free rank of ``world`` for ``member``, whose p2p endpoint serves
    at ``address``, under ``lease``; its :class:`HybridGroup`.

    With every rank held: ConfigError at once (``wait`` 0), or after waiting up to
    ``wait`` seconds for one to be freed (a restarted trainer's old claim lives until its
    lease runs out), :class:`~pdps.core.errors.Timeout` naming the holders.
    """
    value = RankClaim(member=member, addr=address).encode()  # a bad member or address: ConfigError
    seen: dict[int, KeyValue] = {}  # what the last try found held, for the refusal

    def claim(held: Mapping[int, KeyValue]) -> Decision:
        seen.clear()
        seen.update(held)
        for rank, kv in held.items():
            if kv.value == value and kv.lease == lease:
                return Done(rank)  # our own claim, whose reply an outage lost
        free = next((r for r in range(world.world_size) if r not in held), None)
        if free is None:
            return Done(None)
        key = keys.pipeline_rank(free)
        return Write((Compare.absent(key),), (Put(key, value, lease),), result=free)

    def take() -> HybridGroup | None:
        rank = read_modify_write(store, lambda: _held(store, keys, world), claim, what=f"claiming a pipeline rank of job {keys.job!r}")
        if rank is None:
            return None
        log.info("job %r: %s holds pipeline rank %d of %d", keys.job, member, rank, world.world_size)
        return world.group(rank)

    group = take()
    if group is not None:
        return group
    if wait <= 0:
        raise ConfigError(f"job {keys.job!r}: {_all_held(seen, world)}; start at most {world.world_size} trainers, or wait for a dead one's lease to run out")
    return watch_until(store, keys.pipeline_ranks, take, wait, lambda: f"a free pipeline rank of job {keys.job!r} ({_all_held(seen, world)})")


def ranks(store: CoordinationStore, keys: Keys) -> dict[int, RankClaim]:
    """Every claimed rank and its claim. A key under ``pipeline/ranks/`` that names no
    rank, or holds no claim, raises :class:`CorruptRecord` naming it."""
    out = {}
    for kv in store.range(keys.pipeline_ranks):
        rank = keys.pipeline_rank_of(kv.key)
        if rank is None:
            raise CorruptRecord(f"{kv.key} is no pipeline rank key ({keys.pipeline_ranks}<rank>); delete it", kv.key)
        out[rank] = RankClaim.decode(kv.value, kv.key)
    return out


def wait_for_ranks(store: CoordinationStore, keys: Keys, world: HybridLayout, timeout: float) -> dict[int, RankClaim]:
    """The claims of every rank of ``world``, once all are claimed. Past ``timeout``
    seconds raises :class:`~pdps.core.errors.Timeout` naming the ranks still unclaimed."""
    missing: list[int] = []

    def look() -> dict[int, RankClaim] | None:
        claimed = ranks(store, keys)
        missing[:] = [r for r in range(world.world_size) if r not in claimed]
        return None if missing else {r: claimed[r] for r in range(world.world_size)}

    def what() -> str:
        shown = ", ".join(map(str, missing[:32])) + (", ..." if len(missing) > 32 else "")
        return f"every pipeline rank of job {keys.job!r} to be claimed: {len(missing)} of {world.world_size} are not (ranks {shown})"

    return watch_until(store, keys.pipeline_ranks, look, timeout, what)


def release(store: CoordinationStore, keys: Keys, rank: int, lease: int) -> bool:
    """Free ``rank`` if the claim on it is held under ``lease`` (a clean exit); whether
    it was. A claim another lease holds (ours ran out and a newcomer took the rank) is
    left alone."""
    key = keys.pipeline_rank(rank)

    def free(kv: KeyValue | None) -> Decision:
        if kv is None or kv.lease != lease:
            return Done(False)
        return Write((Compare.unchanged(key, kv),), (Delete(key),), result=True)

    return read_modify_write(store, key, free, what=f"releasing pipeline rank {rank} of job {keys.job!r}")


def _held(store: CoordinationStore, keys: Keys, world: HybridLayout) -> dict[int, KeyValue]:
    """The claims on ranks of ``world`` as stored (what a claim's transaction guards)."""
    held = {}
    for kv in store.range(keys.pipeline_ranks):
        rank = keys.pipeline_rank_of(kv.key)
        if rank is not None and rank < world.world_size:
            held[rank] = kv
    return held


def _all_held(held: Mapping[int, KeyValue], world: HybridLayout) -> str:
    def holder(kv: KeyValue) -> str:
        try:
            return RankClaim.decode(kv.value, kv.key).member
        except CorruptRecord:
            return f"an unreadable claim {kv.value[:40]!r}"

    named = ", ".join(f"{r}: {holder(held[r])}" for r in sorted(held)[:NAMED_HOLDERS])
    more = ", ..." if len(held) > NAMED_HOLDERS else ""
    return f"all {world.world_size} pipeline ranks are held ({named}{more})"
