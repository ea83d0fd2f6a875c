"""Hybrid groups: where a rank sits among data-parallel pipelines, and its claim record.

Rules, in a few lines:

* A job of ``D`` pipelines of ``P`` stages each has ``P * D`` ranks, laid out
  pipeline-innermost as Paddle's topology with the order ``[data, pipe, model]``:
  ``rank = dp_rank * P + stage``. pdps has no tensor parallelism: the model-parallel
  degree is 1 and every rank is alone in its model-parallel group.
* :class:`HybridGroup` answers the accessors of Paddle's ``HybridCommunicateGroup``
  (``get_stage_id``, ``get_p2p_prev_rank``, ...) for one rank. The first stage has no
  previous rank and the last no next one (``None``: a pipeline is not a ring).
* :class:`HybridLayout` is the degrees alone (a job's shape before a rank is known);
  ``from_counts(trainers, stages)`` is the layout of ``trainers`` processes in
  pipelines of ``stages``.
* A rank is claimed in the store under ``pipeline/ranks/<r>`` with a
  :class:`RankClaim` (who holds it, where its p2p endpoint is): see
  :mod:`pdps.runtime.hybrid`.

Everything here is pure; a bad degree or rank raises :class:`ConfigError` naming it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs

from pdps.core.errors import ConfigError
from pdps.core.job import decode_as, require_whole_number, shown


def _check_degrees(data_parallel: Any, pipeline: Any) -> None:
    require_whole_number("pipeline (stages per pipeline)", pipeline, 1)
    require_whole_number("data_parallel (pipelines)", data_parallel, 1)


@attrs.frozen
class HybridLayout:
    """The degrees of a hybrid job: ``data_parallel`` pipelines of ``pipeline`` stages."""

    data_parallel: int
    pipeline: int

    def __attrs_post_init__(self) -> None:
        _check_degrees(self.data_parallel, self.pipeline)

    @classmethod
    def from_counts(cls, trainers: int, stages: int) -> HybridLayout:
        """The layout of ``trainers`` processes cut into pipelines of ``stages`` stages;
        ConfigError unless ``trainers`` is a whole multiple of ``stages``."""
        require_whole_number("stages", stages, 1)
        require_whole_number("trainers", trainers, 1)
        if trainers % stages:
            below, above = trainers - trainers % stages, trainers - trainers % stages + stages
            fits = f"{below} or {above}" if below else f"{above}"
            raise ConfigError(
                f"trainers ({trainers}) must be a multiple of stages ({stages}): each pipeline needs one trainer per stage; "
                f"use {fits} trainers, or a number of stages that divides {trainers}"
            )
        return cls(data_parallel=trainers // stages, pipeline=stages)

    @property
    def world_size(self) -> int:
        """How many ranks: ``pipeline * data_parallel``."""
        return self.pipeline * self.data_parallel

    def group(self, rank: int) -> HybridGroup:
        """The accessors of ``rank`` (ConfigError outside ``[0, world_size)``)."""
        return HybridGroup(rank=rank, data_parallel=self.data_parallel, pipeline=self.pipeline)


@attrs.frozen
class HybridGroup:
    """Paddle's hybrid communicate group for one rank of a :class:`HybridLayout`."""

    rank: int
    data_parallel: int
    pipeline: int

    def __attrs_post_init__(self) -> None:
        _check_degrees(self.data_parallel, self.pipeline)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ConfigError(
                f"rank must be a whole number in [0, {self.world_size}) for {self.data_parallel} pipeline(s) "
                f"of {self.pipeline} stage(s), got {shown(self.rank)}"
            )

    @property
    def layout(self) -> HybridLayout:
        return HybridLayout(data_parallel=self.data_parallel, pipeline=self.pipeline)

    @property
    def world_size(self) -> int:
        return self.pipeline * self.data_parallel

    # --- the seed's accessors ---------------------------------------------------------

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel

    def get_data_parallel_rank(self) -> int:
        """Which pipeline this rank is in."""
        return self.rank // self.pipeline

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipeline

    def get_stage_id(self) -> int:
        return self.rank % self.pipeline

    def get_p2p_prev_rank(self) -> int | None:
        """The rank of the stage before this one in its pipeline (None on the first stage)."""
        return None if self.is_first_stage else self.rank - 1

    def get_p2p_next_rank(self) -> int | None:
        """The rank of the stage after this one in its pipeline (None on the last stage)."""
        return None if self.is_last_stage else self.rank + 1

    def get_data_parallel_group(self) -> tuple[int, ...]:
        """The ranks of this stage across the pipelines, in pipeline order."""
        return tuple(range(self.get_stage_id(), self.world_size, self.pipeline))

    def get_pipe_parallel_group(self) -> tuple[int, ...]:
        """The ranks of this rank's pipeline, in stage order."""
        first = self.get_data_parallel_rank() * self.pipeline
        return tuple(range(first, first + self.pipeline))

    def get_model_parallel_group(self) -> tuple[int, ...]:
        return (self.rank,)

    @property
    def is_first_stage(self) -> bool:
        return self.get_stage_id() == 0

    @property
    def is_last_stage(self) -> bool:
        return self.get_stage_id() == self.pipeline - 1


@attrs.frozen
class RankClaim:
    """Who holds a pipeline rank (``member``: a trainer id) and where its p2p endpoint
    serves (``addr``), as stored under ``pipeline/ranks/<r>``: ``{"member", "addr"}``."""

    member: str
    addr: str

    def __attrs_post_init__(self) -> None:
        for name in ("member", "addr"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"a rank claim's {name} must be a non-empty string, got {shown(value)}")

    def to_json(self) -> dict[str, str]:
        return {"member": self.member, "addr": self.addr}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RankClaim:
        return cls(member=d["member"], addr=d["addr"])  # a wrong one: ConfigError, a ValueError

    def encode(self) -> bytes:
        return json.dumps(self.to_json(), sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes, key: str) -> RankClaim:
        """A stored claim; anything else raises :class:`CorruptRecord` naming ``key``."""
        return decode_as(raw, key, cls.from_json)
