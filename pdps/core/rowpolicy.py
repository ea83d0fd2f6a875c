"""Admission and eviction of table rows: which ids get a row, which rows go.

Pure decisions over numpy arrays (design/sparse-embeddings.md §2); the row store
(:mod:`pdps.adapters.torch_rows`) keeps the state and does what they say. Every input
is replicated state (pending counts, per-row update counts, the table step of a row's
last update, the table step itself), and every tie is broken by a hash of the id
(:func:`tie_break`), never by a position in memory or an arrival order: a primary and
its backups, given the same pushes, take the same decisions and evict the same rows
at the same step.

* **Admission** (``admit_after = c``): an id with no row is *pending* until its c-th
  touch (one applied section holding it); that touch creates the row. The pending map
  is bounded: past its capacity the entries touched longest ago go first
  (:func:`pending_drops`), down to :func:`shrink_target` so the cost is amortized.
* **TTL**: a row not updated for ``ttl`` table steps (or seconds, the caller's clock)
  is expired; a sweep evicts the expired rows (:func:`ttl_victims`).
* **LFU**: past ``capacity`` rows, the least-frequently-updated go (count, then the
  hash of the id), down to :func:`shrink_target` (:func:`lfu_victims`).
* **Floor**: neither TTL nor LFU takes the table below ``floor`` rows; the most
  updated rows are the ones that stay.
"""

from __future__ import annotations

import numpy as np

from pdps.core.errors import ConfigError
from pdps.core.tables import splitmix64


def tie_break(ids: np.ndarray) -> np.ndarray:
    """splitmix64 of each id (uint64): the order among rows that tie on what a rule
    ranks by. Unsalted and independent of the table, the slot and the pserver."""
    return splitmix64(np.ascontiguousarray(ids, dtype=np.int64).view(np.uint64))


def shrink_target(capacity: int) -> int:
    """How many entries remain once a bound of ``capacity`` is enforced: a sixteenth
    below it, so the next enforcement is at least ``capacity // 16`` insertions away."""
    return capacity - capacity // 16


def admit(pending_counts: np.ndarray, admit_after: int) -> tuple[np.ndarray, np.ndarray]:
    """One touch of ids that have no row. ``pending_counts``: each id's count of earlier
    touches (0: not pending). Returns ``(admitted, counts)``: the ids whose touch
    creates their row now (this is their ``admit_after``-th touch), and every id's count
    after this touch (what stays pending where not admitted)."""
    if admit_after < 1:
        raise ConfigError(f"admit_after must be >= 1 (1: every touch creates a row), got {admit_after}")
    counts = np.asarray(pending_counts, dtype=np.int64) + 1
    return counts >= admit_after, counts


def _least_first(rank: np.ndarray, ids: np.ndarray, *ahead: np.ndarray) -> np.ndarray:
    """Indices ordered by ``ahead`` keys (first one most significant), then ``rank``,
    then the id's hash: the order in which entries go."""
    return np.lexsort((tie_break(ids), np.asarray(rank), *reversed(ahead)))


def pending_drops(seen: np.ndarray, ids: np.ndarray, capacity: int) -> np.ndarray:
    """Positions (into ``ids``) of the pending entries to drop so the map fits
    ``capacity``: none while it does; else those touched longest ago (``seen``: the
    table step of each entry's last touch; ties by hash of the id) until
    :func:`shrink_target` entries remain."""
    n = len(ids)
    if capacity < 1:
        raise ConfigError(f"the pending map's capacity must be >= 1, got {capacity}")
    if n <= capacity:
        return np.empty(0, dtype=np.int64)
    return np.sort(_least_first(seen, ids)[: n - shrink_target(capacity)])


def expired(last: np.ndarray, now: float | int, ttl: float | int) -> np.ndarray:
    """Rows whose last update (``last``, in table steps or seconds) is ``ttl`` or more
    before ``now``."""
    return (now - np.asarray(last)) >= ttl


def sweep_due(step: int, period: int) -> bool:
    """Whether the TTL sweep runs at this table step (every ``period`` steps)."""
    return period > 0 and step > 0 and step % period == 0


def ttl_victims(expired_mask: np.ndarray, counts: np.ndarray, ids: np.ndarray, floor: int) -> np.ndarray:
    """Positions (into ``ids``, every row of the table on this pserver) of the expired
    rows to evict: all of them, unless that would leave fewer than ``floor`` rows; then
    the most updated of them (``counts``, ties by hash) stay, just enough to keep
    ``floor``."""
    expired_at = np.flatnonzero(expired_mask)
    spare = max(0, floor - (len(ids) - len(expired_at)))
    if spare == 0:
        return expired_at
    if spare >= len(expired_at):
        return np.empty(0, dtype=np.int64)
    order = _least_first(np.asarray(counts)[expired_at], np.asarray(ids)[expired_at])
    return np.sort(expired_at[order[: len(expired_at) - spare]])


def lfu_victims(counts: np.ndarray, ids: np.ndarray, capacity: int, floor: int = 0, protect: np.ndarray | None = None) -> np.ndarray:
    """Positions (into ``ids``, every row of the table on this pserver) of the rows to
    evict for ``capacity``: none while the table fits; else the least updated
    (``counts``, ties by hash of the id) until ``max(floor, shrink_target(capacity))``
    rows remain. Rows in ``protect`` (those the current step just updated) go last."""
    n = len(ids)
    if capacity < 1 or n <= capacity:
        return np.empty(0, dtype=np.int64)
    target = max(floor, shrink_target(capacity))
    if n <= target:
        return np.empty(0, dtype=np.int64)
    ahead = () if protect is None else (np.asarray(protect, dtype=bool),)
    return np.sort(_least_first(counts, ids, *ahead)[: n - target])
