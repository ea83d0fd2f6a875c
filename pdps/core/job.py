"""A job's settings and its key layout in the coordination store.

Every role reads the same :class:`JobConfig` from the store, so a job is configured
once, in one place. All fields are JSON-safe.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs

from pdps.core.errors import ConfigError, CorruptRecord
from pdps.core.sgd import Cadence, Mode
from pdps.core.slots import DEFAULT_MIN_BLOCK, DEFAULT_NUM_SLOTS

DEFAULT_JOB = "default"

T = TypeVar("T")


def _positive(name: str):
    def check(_inst: object, _attr: object, value: float) -> None:
        if not value > 0:
            raise ConfigError(f"{name} must be > 0, got {value!r}")

    return check


def _json_safe(_inst: object, attr: attrs.Attribute, value: Any) -> None:
    try:
        ok = json.loads(json.dumps(value)) == value
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(f"{attr.name} must be JSON-safe (numbers, strings, lists, dicts), got {value!r}")


def _optimizer_args(value: Mapping[str, Any] | None) -> dict[str, Any]:
    # tuples (Adam's betas) arrive as lists after a JSON round trip; take lists from the start
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dict(value or {}).items()}


@attrs.frozen(kw_only=True)
class JobConfig:
    """What a training job is. Defaults are the ones ``pdps demo --help`` shows."""

    name: str = DEFAULT_JOB
    dataset: str = ""
    mode: Mode = attrs.field(default=Mode.SYNC, converter=Mode.parse)
    trainers: int = attrs.field(default=1, validator=_positive("trainers"))
    pservers: int = attrs.field(default=1, validator=_positive("pservers"))
    optimizer: str = "SGD"
    optimizer_args: dict[str, Any] = attrs.field(factory=lambda: {"lr": 0.01}, converter=_optimizer_args, validator=_json_safe)
    batch_size: int = attrs.field(default=32, validator=_positive("batch_size"))
    passes: int = attrs.field(default=1, validator=_positive("passes"))
    push_every: int = attrs.field(default=1, validator=_positive("push_every"))
    pull_every: int = attrs.field(default=1, validator=_positive("pull_every"))
    staleness: int | None = None
    failure_max: int = 3
    task_timeout: float = attrs.field(default=60.0, validator=_positive("task_timeout"))
    max_in_flight: int = attrs.field(default=1, validator=_positive("max_in_flight"))
    lease_ttl: float = attrs.field(default=10.0, validator=_positive("lease_ttl"))
    num_slots: int = attrs.field(default=DEFAULT_NUM_SLOTS, validator=_positive("num_slots"))
    min_block: int = attrs.field(default=DEFAULT_MIN_BLOCK, validator=_positive("min_block"))
    store_outage_deadline: float = attrs.field(default=60.0, validator=_positive("store_outage_deadline"))

    def __attrs_post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ConfigError(f"job name must be non-empty and contain no '/', got {self.name!r}")
        if self.mode is Mode.SYNC and (self.push_every != 1 or self.pull_every != 1):
            raise ConfigError("sync mode pushes and pulls every mini-batch; push_every/pull_every are for async mode")
        if self.staleness is not None and (self.mode is Mode.SYNC or self.staleness < 0):
            raise ConfigError("staleness is a bound >= 0 for async mode only")
        if self.failure_max < 0:
            raise ConfigError(f"failure_max must be >= 0, got {self.failure_max}")
        if self.num_slots < self.pservers:
            raise ConfigError(f"num_slots ({self.num_slots}) must be at least the number of pservers ({self.pservers})")

    @property
    def cadence(self) -> Cadence:
        return Cadence(self.push_every, self.pull_every)

    def to_json(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d["mode"] = self.mode.value
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> JobConfig:
        names = {a.name for a in attrs.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"unknown job settings: {sorted(unknown)}")
        return cls(**d)

    def encode(self) -> bytes:
        return json.dumps(self.to_json(), sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes, key: str = "config") -> JobConfig:
        """Parse a stored config; anything unreadable raises :class:`CorruptRecord` naming ``key``."""
        d = decode_json(raw, key)
        try:
            return cls.from_json(d)
        except (ConfigError, TypeError, ValueError) as exc:
            raise CorruptRecord(f"{key} holds no valid job config: {exc}", key) from exc


def decode_as(raw: bytes, key: str, parse: Callable[[Any], T]) -> T:
    """``parse(json.loads(raw))``; a value that is not JSON, or not the JSON ``parse``
    expects, raises :class:`CorruptRecord` naming ``key``."""
    value = decode_json(raw, key)
    try:
        return parse(value)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise CorruptRecord(f"{key} does not hold what it should ({exc!r}): {raw[:200]!r}", key) from exc


def decode_json(raw: bytes, key: str) -> Any:
    """``json.loads`` of a stored value; a value that is not JSON raises :class:`CorruptRecord`."""
    try:
        return json.loads(raw)
    except (TypeError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CorruptRecord(f"cannot decode the value of {key} ({len(raw)} bytes): {exc}", key) from exc


@attrs.frozen
class Keys:
    """The key layout of one job: everything lives under ``/pdps/<job>/``.

    ``config``            the JobConfig (JSON), written once
    ``master/lock``       the master's fenced lock (leased)
    ``master/addr``       where the master serves (leased)
    ``pass``              the current pass number
    ``passes/<n>``        summary of a finished pass: {done, failed}
    ``queue``             {"tasks": N}: the number of tasks, written once with pass 0
    ``tasks/<id>``        one TaskRecord per task (JSON); O(1) writes per transition
    ``quarantine/<id>``   a task record that could not be decoded, moved aside
    ``state``             {"state": "running" | "done", ...}
    ``ps_desired``        desired pserver count (not leased)
    ``ps/<index>``        a pserver's claim of its index, with its address (leased)
    ``trainers/<id>``     a live trainer (leased)
    ``model``             the model's parameter specs (JSON), set by the first trainer
    ``slotmap``           the versioned slot map (JSON)
    ``checkpoint``        pointer to the latest committed checkpoint (JSON), if any
    """

    job: str

    @property
    def root(self) -> str:
        return f"/pdps/{self.job}/"

    @property
    def config(self) -> str:
        return self.root + "config"

    @property
    def master_lock(self) -> str:
        return self.root + "master/lock"

    @property
    def master_addr(self) -> str:
        return self.root + "master/addr"

    @property
    def pass_no(self) -> str:
        return self.root + "pass"

    @property
    def passes(self) -> str:
        return self.root + "passes/"

    def pass_summary(self, n: int) -> str:
        return f"{self.passes}{n:06d}"

    @property
    def tasks(self) -> str:
        return self.root + "tasks/"

    def task(self, task_id: int) -> str:
        return f"{self.tasks}{task_id:08d}"

    def task_id(self, key: str) -> int:
        """The task id in a ``tasks/<id>`` or ``quarantine/<id>`` key (ValueError if none)."""
        return int(key.rsplit("/", 1)[1])

    @property
    def queue(self) -> str:
        return self.root + "queue"

    @property
    def quarantine(self) -> str:
        return self.root + "quarantine/"

    def quarantined(self, task_id: int) -> str:
        return f"{self.quarantine}{task_id:08d}"

    @property
    def state(self) -> str:
        return self.root + "state"

    @property
    def ps_desired(self) -> str:
        return self.root + "ps_desired"

    @property
    def pservers(self) -> str:
        return self.root + "ps/"

    def pserver(self, index: int) -> str:
        return f"{self.pservers}{index}"

    @property
    def trainers(self) -> str:
        return self.root + "trainers/"

    def trainer(self, trainer_id: str) -> str:
        return self.trainers + trainer_id

    def trainer_id(self, key: str) -> str:
        """The trainer id in a ``trainers/<id>`` key."""
        return key[len(self.trainers) :]

    @property
    def model(self) -> str:
        return self.root + "model"

    @property
    def slotmap(self) -> str:
        return self.root + "slotmap"

    @property
    def checkpoint(self) -> str:
        return self.root + "checkpoint"
