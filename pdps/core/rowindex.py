"""The index of a pserver's rows of one table: id -> position in its row store.

Open addressing with linear probing over two arrays of ``B`` buckets (a power of
two): ``keys`` int64 and ``pos`` int32, where ``pos`` is -1 for an empty bucket and -2
for a deleted one (a tombstone, which lookups probe past). 12 bytes a bucket, at most
60% full, so ~20-40 bytes a row against ~100 for a Python dict entry.

Every operation is vectorized over an array of ids: each probe round looks at the
next bucket of every id still unresolved, so a batch costs a few numpy passes (the
probe sequences are short at this load), never a Python step per id. An insert
claims empty buckets one winner per bucket per round; the others probe on. The table
is rebuilt (every live entry re-inserted) when an insert would pass the load, and
when tombstones pass a quarter of the buckets.

Pure: numpy only. Callers hold the lock; an IdIndex is not thread-safe.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pdps.core.tables import as_ids

_EMPTY = -1
_DELETED = -2
_MAX_LOAD = 0.6
_MIN_BUCKETS = 8
# buckets probed at once for the ids the first probe leaves unresolved
_WINDOW = 4
#: Positions are stored as int32.
MAX_POSITION = np.iinfo(np.int32).max
# Fibonacci hashing: the top bits of id * 2^64/phi spread ids (sequential ones too)
_FIB = np.uint64(0x9E3779B97F4A7C15)


def _buckets_for(entries: int) -> int:
    buckets = _MIN_BUCKETS
    while entries > _MAX_LOAD * buckets:
        buckets *= 2
    return buckets


class IdIndex:
    """int64 id -> int64 position (>= 0), for a table's rows on one pserver.

    ``lookup`` gives -1 for an id not held; ``insert`` takes distinct ids that are not
    held (ValueError otherwise, before anything changes); ``delete`` ignores ids not
    held and says how many it deleted. ``capacity`` sizes the table for that many
    entries up front.
    """

    def __init__(self, capacity: int = 0) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 0:
            raise ValueError(f"capacity must be a whole number >= 0, got {capacity!r}")
        self._allocate(_buckets_for(int(capacity)))
        self._len = 0

    def _allocate(self, buckets: int) -> None:
        self._keys = np.zeros(buckets, dtype=np.int64)
        self._pos = np.full(buckets, _EMPTY, dtype=np.int32)
        self._mask = buckets - 1
        self._shift = np.uint64(64 - (buckets.bit_length() - 1))
        self._deleted = 0

    # --- reading ---------------------------------------------------------------------

    def __len__(self) -> int:
        return self._len

    @property
    def buckets(self) -> int:
        return self._pos.shape[0]

    @property
    def tombstones(self) -> int:
        """Buckets of deleted entries not reused or rebuilt away yet."""
        return self._deleted

    @property
    def nbytes(self) -> int:
        """Bytes the index holds (its two bucket arrays)."""
        return self._keys.nbytes + self._pos.nbytes

    def _home(self, ids: np.ndarray) -> np.ndarray:
        u = np.ascontiguousarray(ids, dtype=np.int64).view(np.uint64)
        return ((u * _FIB) >> self._shift).astype(np.int64)

    def _find(self, ids: np.ndarray) -> np.ndarray:
        """The bucket holding each id (1-D int64), -1 where none does. One probe of
        every id first (most end there), then windows of ``_WINDOW`` buckets for the
        rest: an id's answer is the first bucket of its path that holds it or is empty."""
        keys, pos, mask = self._keys, self._pos, self._mask
        at = self._home(ids)
        p = pos[at]
        hit = (keys[at] == ids) & (p >= 0)
        found = np.where(hit, at, -1)
        go_on = ~hit & (p != _EMPTY)
        if not go_on.any():
            return found
        active = np.flatnonzero(go_on)
        want, at = ids[active], (at[active] + 1) & mask
        steps = np.arange(_WINDOW)
        while active.size:
            window = (at[:, None] + steps) & mask
            p = pos[window]
            hit = (keys[window] == want[:, None]) & (p >= 0)
            stop = hit | (p == _EMPTY)
            first = stop.argmax(axis=1)
            rows = np.arange(active.size)
            ended = stop[rows, first]
            held = ended & hit[rows, first]
            found[active[held]] = window[rows[held], first[held]]
            go_on = ~ended
            active, want, at = active[go_on], want[go_on], (at[go_on] + _WINDOW) & mask
        return found

    def lookup(self, ids: Any) -> np.ndarray:
        """The position of each id (int64, the shape of ``ids``), -1 for an id not held."""
        arr = as_ids(ids)
        flat = arr.reshape(-1)
        at = self._find(flat)
        out = np.where(at >= 0, self._pos[np.maximum(at, 0)], -1).astype(np.int64)
        return out.reshape(arr.shape)

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """Every ``(ids, positions)`` held, int64, in ascending id order."""
        live = self._pos >= 0
        ids, positions = self._keys[live], self._pos[live].astype(np.int64)
        order = np.argsort(ids, kind="stable")
        return ids[order], positions[order]

    # --- writing ---------------------------------------------------------------------

    def insert(self, ids: Any, positions: Any) -> None:
        """Hold ``ids[i] -> positions[i]``. The ids must be distinct and not held, the
        positions in ``[0, MAX_POSITION]``: ValueError otherwise, with nothing changed."""
        keys = as_ids(ids).reshape(-1)
        where = np.asarray(positions)
        if where.dtype.kind not in "iu" and where.size:
            raise ValueError(f"positions must be integers, got an array of {where.dtype}")
        where = where.reshape(-1).astype(np.int64)
        if where.shape[0] != keys.shape[0]:
            raise ValueError(f"insert takes one position per id: {keys.shape[0]} ids, {where.shape[0]} positions")
        if not keys.size:
            return
        if where.min() < 0 or where.max() > MAX_POSITION:
            raise ValueError(f"positions must be in [0, {MAX_POSITION}], got some in [{where.min()}, {where.max()}]")
        sorted_keys = np.sort(keys)
        dup = sorted_keys[1:] == sorted_keys[:-1]
        if dup.any():
            raise ValueError(f"insert takes distinct ids; id {int(sorted_keys[1:][dup][0])} is given more than once")
        held = self._find(keys) >= 0
        if held.any():
            raise ValueError(f"insert takes ids not held yet; id {int(keys[held][0])} is held (at position {int(self.lookup(keys[held][:1])[0])})")
        if self._len + self._deleted + keys.size > _MAX_LOAD * self.buckets:
            self._rebuild(self._len + keys.size)
        self._place(keys, where.astype(np.int32))
        self._len += keys.size

    def delete(self, ids: Any) -> int:
        """Forget ``ids`` (those not held are ignored, repeats count once); how many were held."""
        at = self._find(as_ids(ids).reshape(-1))
        at = np.unique(at[at >= 0])
        self._pos[at] = _DELETED
        self._len -= at.size
        self._deleted += at.size
        if self._deleted * 4 > self.buckets:
            self._rebuild(self._len)
        return int(at.size)

    def _place(self, keys: np.ndarray, where: np.ndarray) -> None:
        """Put absent, distinct ``keys`` in the first free bucket of their probe path
        (empty or a tombstone: an absent key may take the first of either)."""
        pos, mask = self._pos, self._mask
        todo = np.arange(keys.shape[0])
        at = self._home(keys)
        while todo.size:
            free = pos[at] < 0
            cand, cand_at = todo[free], at[free]
            # one winner per bucket: each candidate writes its own number, one write stays
            self._deleted -= int(np.count_nonzero(pos[np.unique(cand_at)] == _DELETED)) if self._deleted else 0
            pos[cand_at] = cand.astype(np.int32)
            won = pos[cand_at] == cand
            win, win_at = cand[won], cand_at[won]
            self._keys[win_at] = keys[win]
            pos[win_at] = where[win]
            placed = np.zeros(todo.shape[0], dtype=bool)
            placed[np.flatnonzero(free)[won]] = True
            todo, at = todo[~placed], (at[~placed] + 1) & mask

    def _rebuild(self, entries: int) -> None:
        """Re-insert every live entry into a table sized for ``entries``, no tombstones."""
        live = self._pos >= 0
        keys, where = self._keys[live], self._pos[live]
        self._allocate(_buckets_for(entries))
        self._place(keys, where)
