"""A sync round as the store holds it: one key per contribution and a close marker,
read together by one range (:class:`~pdps.core.sgd.RoundRecord` is the decision).

The layout, ``rounds/<epoch>/<r>/t/<trainer>`` and ``rounds/<epoch>/<r>/closed``, is
:class:`~pdps.core.job.Keys`'; this is where a round is read back.
"""

from __future__ import annotations

from pdps.core.errors import CorruptRecord
from pdps.core.job import Keys, decode_as, decode_json
from pdps.core.sgd import Contribution, RoundRecord
from pdps.ports.coordination import CoordinationStore


def read_round(store: CoordinationStore, keys: Keys, epoch: int, round_no: int) -> RoundRecord | None:
    """Round ``round_no`` of ``epoch``: None while nobody has contributed to it (or once
    it was dropped, ``keep_rounds`` later). Raises :class:`CorruptRecord` for a key
    under the round that is not a contribution or a marker, or one that does not decode."""
    prefix = keys.round(epoch, round_no)
    contributions: dict[str, Contribution] = {}
    marker = None
    found = False
    for kv in store.range(prefix):
        found = True
        entry = keys.round_entry(kv.key)
        if entry is None or entry[:2] != (epoch, round_no):
            raise CorruptRecord(f"{kv.key} is under round {round_no}'s prefix {prefix} but is neither a contribution nor its close marker", kv.key)
        trainer = entry[2]
        if trainer is None:
            marker = decode_json(kv.value, kv.key)
        else:
            contributions[trainer] = decode_as(kv.value, kv.key, Contribution.from_json)
    if not found:
        return None
    try:
        return RoundRecord.from_stored(round_no, contributions, marker)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        key = keys.round_closed(epoch, round_no)
        raise CorruptRecord(f"{key} does not hold a close marker ({exc!r}): {marker!r}", key) from exc
