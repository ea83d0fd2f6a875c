"""A job's settings and its key layout in the coordination store.

Every role reads the same :class:`JobConfig` from the store, so a job is configured
once, in one place. All fields are JSON-safe.
"""

from __future__ import annotations

import difflib
import inspect
import json
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs

from pdps.core.errors import ConfigError, CorruptRecord
from pdps.core.sgd import Cadence, Mode
from pdps.core.slots import DEFAULT_MIN_BLOCK, DEFAULT_NUM_SLOTS
from pdps.core.speculation import RING
from pdps.core.updategraph import brief_args

DEFAULT_JOB = "default"
#: The schedules a pipeline job may run (``pipeline_schedule``; :mod:`pdps.core.pipeline`).
PIPELINE_SCHEDULES = ("gpipe", "1f1b")

T = TypeVar("T")


def shown(value: Any) -> str:
    """A value as an error message shows it: its repr and, unless it is None, its type
    (``'3' (str)``, so a string that looks like a number is told apart)."""
    return "None" if value is None else f"{value!r} ({type(value).__name__})"


def require_whole_number(name: str, value: Any, minimum: int, *, optional: bool = False) -> None:
    """ConfigError unless ``value`` is an int of at least ``minimum`` (``None`` too if
    ``optional``). A bool is refused (``True`` is no count), and so is a float, even a
    whole one like 3.0."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        none = " or None" if optional else ""
        raise ConfigError(f"{name} must be a whole number >= {minimum}{none}, got {shown(value)}")


def require_seconds(name: str, value: Any, *, zero: bool = False) -> None:
    """ConfigError unless ``value`` is a number of seconds, an int or a float (not a bool,
    not NaN), > 0 (>= 0 if ``zero``, where 0 turns something off)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and (value >= 0 if zero else value > 0)):  # NaN fails both comparisons
        raise ConfigError(f"{name} must be a number of seconds {'>=' if zero else '>'} 0, got {shown(value)}")


def _whole_number(minimum: int, *, optional: bool = False) -> Callable[[Any, attrs.Attribute, Any], None]:
    return lambda _inst, attr, value: require_whole_number(attr.name, value, minimum, optional=optional)


def _seconds(*, zero: bool = False) -> Callable[[Any, attrs.Attribute, Any], None]:
    return lambda _inst, attr, value: require_seconds(attr.name, value, zero=zero)


def _text(_inst: object, attr: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, str):
        raise ConfigError(f"{attr.name} must be a string, got {shown(value)}")


def _flag(_inst: object, attr: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):  # "yes", 1: a TOML or env value reaches here parsed, so only a caller's slip does
        raise ConfigError(f"{attr.name} must be True or False, got {shown(value)}")


def _json_safe(_inst: object, attr: attrs.Attribute, value: Any) -> None:
    try:
        ok = json.loads(json.dumps(value)) == value
    except (TypeError, ValueError):
        ok = False
    if not ok:  # an update rule (optimizer_args' graph) is shown by its digest, not its ~10 KB
        raise ConfigError(f"{attr.name} must be JSON-safe (numbers, strings, lists, dicts), got {brief_args(value)!r:.300}")


def _optimizer_args(value: Mapping[str, Any] | None) -> dict[str, Any]:
    if value is not None and not isinstance(value, Mapping):
        raise ConfigError(f"optimizer_args must be a dict of the optimizer's keyword arguments, got {shown(value)}")
    # tuples (Adam's betas) arrive as lists after a JSON round trip; take lists from the start
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dict(value or {}).items()}


# Names users pass as settings that are the optimizer's arguments, not the job's.
_OPTIMIZER_ARGUMENTS = ("lr", "momentum", "weight_decay", "betas", "eps", "nesterov")


@attrs.frozen(kw_only=True, init=False)
class JobConfig:
    """What a training job is. Defaults are the ones ``pdps demo --help`` shows.

    Every field is checked when a JobConfig is made: a misspelt name, a value of the
    wrong type (a bool or a float where a whole number goes) or out of range raises
    :class:`ConfigError` naming the setting, the value and what it should be.
    """

    name: str = attrs.field(default=DEFAULT_JOB, validator=_text)
    dataset: str = attrs.field(default="", validator=_text)
    mode: Mode = attrs.field(default=Mode.SYNC, converter=Mode.parse)
    trainers: int = attrs.field(default=1, validator=_whole_number(1))
    pservers: int = attrs.field(default=1, validator=_whole_number(1))
    optimizer: str = attrs.field(default="SGD", validator=_text)
    optimizer_args: dict[str, Any] = attrs.field(factory=lambda: {"lr": 0.01}, converter=_optimizer_args, validator=_json_safe)
    # sparse tables (pdps.nn): the row rule the pservers apply ("": the row rule of
    # `optimizer`), its arguments ({}: `optimizer_args`), the most ids one request may carry
    sparse_optimizer: str = attrs.field(default="", validator=_text)
    sparse_optimizer_args: dict[str, Any] = attrs.field(factory=dict, converter=_optimizer_args, validator=_json_safe)
    sparse_max_ids: int = attrs.field(default=1 << 20, validator=_whole_number(1))
    batch_size: int = attrs.field(default=32, validator=_whole_number(1))
    passes: int = attrs.field(default=1, validator=_whole_number(1))
    push_every: int = attrs.field(default=1, validator=_whole_number(1))
    pull_every: int = attrs.field(default=1, validator=_whole_number(1))
    staleness: int | None = attrs.field(default=None, validator=_whole_number(0, optional=True))
    failure_max: int = attrs.field(default=3, validator=_whole_number(0))
    task_timeout: float = attrs.field(default=60.0, validator=_seconds())
    max_in_flight: int = attrs.field(default=1, validator=_whole_number(1))
    lease_ttl: float = attrs.field(default=10.0, validator=_seconds())
    num_slots: int = attrs.field(default=DEFAULT_NUM_SLOTS, validator=_whole_number(1))
    # copies of each slot, each on its own pserver: a primary and replicas - 1 backups
    replicas: int = attrs.field(default=1, validator=_whole_number(1))
    min_block: int = attrs.field(default=DEFAULT_MIN_BLOCK, validator=_whole_number(1))
    store_outage_deadline: float = attrs.field(default=60.0, validator=_seconds())
    # storage root for checkpoints (file://, s3://, memory://); "" = none
    checkpoint_url: str = attrs.field(default="", validator=_text)
    # sync: rounds; async: updates on pserver 0; 0 = not by count
    checkpoint_every: int = attrs.field(default=0, validator=_whole_number(0))
    # at most this long between checkpoints; 0 = not by time
    checkpoint_seconds: float = attrs.field(default=0.0, validator=_seconds(zero=True))
    checkpoint_keep: int = attrs.field(default=3, validator=_whole_number(1))
    # seconds a checkpoint write's temporary file must go unmodified before a clean-up
    # takes it for a killed writer's leftover: far above any pause inside a live write
    checkpoint_orphan_grace: float = attrs.field(default=3600.0, validator=_seconds())
    # on a pserver restart: "job" rolls everyone back; "lost" (async) restores only its slots
    restore: str = attrs.field(default="job", validator=_text)
    keep_rounds: int = attrs.field(default=10000, validator=_whole_number(1))  # sync: closed rounds kept
    # on: push each slot during backward, async: pull during the next forward; auto: see trainer
    overlap: str = attrs.field(default="auto", validator=_text)
    # --- pipeline parallelism (docs/pipeline.md): trainers = pipeline_stages x pipelines ---
    pipeline_stages: int = attrs.field(default=1, validator=_whole_number(1))
    # microbatches each batch is cut into (at most: a batch of fewer rows is cut into one per row)
    pipeline_microbatches: int = attrs.field(default=1, validator=_whole_number(1))
    pipeline_schedule: str = attrs.field(default="1f1b", validator=_text)  # "gpipe" | "1f1b"
    # seconds a stage waits for a message of its pipeline's other stages before the pipeline is broken
    pipeline_timeout: float = attrs.field(default=60.0, validator=_seconds())
    # --- streaming jobs (a dataset URL of a streaming source; docs/online.md) ---
    # a window closes after this many records (0: not by count) / seconds open (0: not by time)
    window_records: int = attrs.field(default=0, validator=_whole_number(0))
    window_seconds: float = attrs.field(default=0.0, validator=_seconds(zero=True))
    # streaming: a checkpoint after every this many windows close (needs checkpoint_url); 0: not by windows
    checkpoint_windows: int = attrs.field(default=0, validator=_whole_number(0))
    # the job ends after this many windows; 0: it runs until stopped
    windows: int = attrs.field(default=0, validator=_whole_number(0))
    # records per task cut from a stream (at most; a Parquet row group is one task whatever its size)
    task_records: int = attrs.field(default=1000, validator=_whole_number(1))
    # backpressure: the master cuts no task while this many are todo or pending
    stream_max_tasks: int = attrs.field(default=64, validator=_whole_number(1))
    # a partial task (< task_records) is cut once data has waited this long for more
    stream_linger: float = attrs.field(default=1.0, validator=_seconds(zero=True))
    # post-window work: export the model to this storage URL every export_every windows
    export_url: str = attrs.field(default="", validator=_text)
    export_every: int = attrs.field(default=1, validator=_whole_number(0))  # 0: not after windows
    export_seconds: float = attrs.field(default=0.0, validator=_seconds(zero=True))  # also every this long; 0: not by time
    export_keep: int = attrs.field(default=0, validator=_whole_number(0))  # 0: keep every export
    # speculative execution: a backup attempt races a task running speculation_multiplier x
    # the median time per record (after speculation_min_finished finishes); first commit wins
    speculation: bool = attrs.field(default=False, validator=_flag)
    speculation_multiplier: float = attrs.field(default=1.5, validator=_seconds())
    speculation_min_finished: int = attrs.field(default=8, validator=_whole_number(1))
    # user functions as "module:function": run once before the first task; run after each window
    before_job: str = attrs.field(default="", validator=_text)
    evaluate: str = attrs.field(default="", validator=_text)

    def __init__(self, **settings: Any) -> None:
        # attrs' own __init__ would let an unknown name through as a TypeError
        check_setting_names(settings)
        self.__attrs_init__(**settings)

    def __attrs_post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ConfigError(f"job name must be non-empty and contain no '/', got {self.name!r}")
        if self.mode is Mode.SYNC and (self.push_every != 1 or self.pull_every != 1):
            raise ConfigError("sync mode pushes and pulls every mini-batch; push_every/pull_every are for async mode")
        if self.staleness is not None and self.mode is Mode.SYNC:
            raise ConfigError("staleness is a bound >= 0 for async mode only")
        if self.overlap not in ("auto", "on", "off"):
            raise ConfigError(f"overlap must be 'auto', 'on' or 'off', got {self.overlap!r}")
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise ConfigError(f"pipeline_schedule must be one of {', '.join(repr(k) for k in PIPELINE_SCHEDULES)}, got {shown(self.pipeline_schedule)}")
        if self.pipeline_stages > 1:
            if self.trainers % self.pipeline_stages:
                raise ConfigError(
                    f"trainers ({self.trainers}) must be a multiple of pipeline_stages ({self.pipeline_stages}): "
                    f"each pipeline needs one trainer per stage (trainers = pipeline_stages x pipelines)"
                )
            if self.mode is Mode.ASYNC and (self.push_every != 1 or self.pull_every != 1):
                raise ConfigError(
                    f"pipeline_stages = {self.pipeline_stages} in async mode pushes and pulls every step: "
                    f"push_every and pull_every must be 1, got {self.push_every} and {self.pull_every}"
                )
            if self.replicas > 1:
                raise ConfigError(f"pipeline_stages = {self.pipeline_stages} with replicas = {self.replicas}: a pipeline job keeps one copy of each slot in this version")
        if self.restore not in ("job", "lost"):
            raise ConfigError(f"restore must be 'job' or 'lost', got {self.restore!r}")
        if self.restore == "lost" and self.mode is Mode.SYNC:
            raise ConfigError("restore='lost' is for async mode; a sync job rolls back as a whole so every step stays atomic")
        if (self.checkpoint_every or self.checkpoint_seconds or self.checkpoint_windows) and not self.checkpoint_url:
            raise ConfigError("checkpoint_every/checkpoint_seconds/checkpoint_windows need a checkpoint_url to write to")
        if self.num_slots < self.pservers:
            raise ConfigError(f"num_slots ({self.num_slots}) must be at least the number of pservers ({self.pservers})")
        if self.replicas > self.pservers:
            raise ConfigError(
                f"replicas ({self.replicas}) must be at most the number of pservers ({self.pservers}): each copy of a slot is on its own pserver"
            )
        if (self.window_records or self.window_seconds or self.windows) and self.passes != 1:
            raise ConfigError(f"a streaming job has windows, not passes: passes must be 1, got {self.passes}")
        for name in ("before_job", "evaluate"):
            value = getattr(self, name)
            if value and not _is_import_path(value):
                raise ConfigError(f"{name} must name a function as 'module:function' or 'path/to/file.py:function' (found where the master runs), got {value!r}")
        if self.speculation_min_finished > RING:  # the median is over the last RING finishes: more would never be counted
            raise ConfigError(
                f"speculation_min_finished must be between 1 and {RING} (the median is taken over the last {RING} finished tasks), "
                f"got {self.speculation_min_finished}"
            )
        if self.replicas > 2 and self.mode is not Mode.SYNC:
            raise ConfigError(
                f"replicas = {self.replicas} in {self.mode.value} mode: this version keeps at most 2 copies of an async job's slots "
                "(with more, the backups of a dead primary could disagree on the pushes it had not acknowledged): set replicas = 2, or mode = sync"
            )

    @property
    def checkpoints(self) -> bool:
        """Checkpoints are taken (a storage URL and at least one trigger)."""
        return bool(self.checkpoint_url) and bool(self.checkpoint_every or self.checkpoint_seconds or self.checkpoint_windows)

    @property
    def cadence(self) -> Cadence:
        return Cadence(self.push_every, self.pull_every)

    def to_json(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d["mode"] = self.mode.value
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> JobConfig:
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


def _is_import_path(value: str) -> bool:
    where, _, function = value.rpartition(":")
    return bool(where) and function.isidentifier()


# help(JobConfig) and editors show the fields, not **settings
JobConfig.__init__.__signature__ = inspect.signature(JobConfig.__attrs_init__)


def check_setting_names(settings: Mapping[str, Any]) -> None:
    """ConfigError unless every name in ``settings`` is a JobConfig field, with a
    suggestion for a misspelt one and a pointer to ``optimizer_args`` for ``lr``."""
    names = sorted(a.name for a in attrs.fields(JobConfig))
    for name, value in settings.items():
        if name in names:
            continue
        close = difflib.get_close_matches(name, names, n=1)
        if name in _OPTIMIZER_ARGUMENTS:
            hint = f"an optimizer's arguments go in optimizer_args, e.g. optimizer_args={{{name!r}: {value!r}}}"
        elif close:
            hint = f"did you mean {close[0]!r}?"
        else:
            hint = f"the settings are: {', '.join(names)}"
        raise ConfigError(f"unknown setting {name}={value!r}; {hint}")


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


def says_done(raw: bytes, key: str) -> bool:
    """Whether a job ``state`` record says the job is done (an undecodable one does not)."""
    try:
        state = decode_json(raw, key)
    except CorruptRecord:
        return False
    return isinstance(state, dict) and state.get("state") == "done"


@attrs.frozen
class Keys:
    """The key layout of one job: everything lives under ``/pdps/<job>/``.

    ``config``            the JobConfig (JSON), written once
    ``master/lock``       the master's fenced lock (leased)
    ``master/addr``       where the master serves (leased)
    ``pass``              the current pass number
    ``passes/<n>``        summary of a finished pass: {done, failed}
    ``queue``             {"tasks": N, "chunks": K, "sha256": ...}: the number of tasks and
                          the chunks holding each one's record count, written once with
                          pass 0 (an older pdps wrote the counts here: {"tasks", "records"})
    ``queue/records/<k>`` chunk k of the record counts: {"prev": sha256 of chunk k-1,
                          "runs": [[first_id, tasks, records], ...]}, at most 64 KiB,
                          written before ``queue`` (:class:`pdps.core.audit.RecordCounts`)
    ``tasks/<id>``        one TaskRecord per task (JSON); O(1) writes per transition
    ``progress/<id>``     how far the current attempt at a task has trained, or the fence
                          that ended it: {attempt, applied, fenced} (:mod:`pdps.core.progress`)
    ``quarantine/<id>``   a task record that could not be decoded, moved aside
    ``audit/<pass>/<id>`` the attempts at one task in one pass: a JSON list of {attempt,
                          trainer, outcome[, offset][, late_finish]}, written in the
                          transaction of each transition of the task (pass 6 digits, id 8)
    ``quarantine/audit/<pass>/<id>``  an audit entry that could not be decoded, moved aside
    ``state``             {"state": "running" | "done", ...}
    ``ps_desired``        desired pserver count (not leased)
    ``trainers_desired``  desired trainer count, once a resize named one (not leased)
    ``resize``            the newest resize and how far it is (:class:`pdps.core.elastic.Resize`)
    ``slotmap_since``     sync: {version, epoch, round}: the round the live map began with,
                          written with the close marker of the round before it
    ``resize_got/<version>/<i>``  pserver i holds every slot map ``<version>`` gives it
                          (written by each pserver that received slots)
    ``ps/<index>``        a pserver's claim of its index, with its address (leased)
    ``trainers/<id>``     a live trainer (leased)
    ``pipeline/ranks/<r>``  a pipeline job's rank r, claimed by a trainer: {member, addr}
                          (:class:`pdps.core.hybrid.RankClaim`; leased)
    ``model``             the model's parameter specs (JSON), set by the first trainer
    ``model_tables``      the model's sparse tables ([TableSpec JSON, ...]), written with
                          ``model`` in the same transaction (absent: the model has none)
    ``table_stats/<i>``   pserver i's rows per table: {at, incarnation, tables: {name: {rows,
                          bytes, created, admitted, pending, pending_dropped, evicted_ttl,
                          evicted_lfu, refused}}}, written at most every few seconds and when it stops
    ``slotmap``           the versioned slot map (JSON)
    ``checkpoint``        pointer to the latest committed checkpoint: {id, epoch, round,
                          url, created, history: [ids, newest first]} (JSON), if any
    ``ckpt/<id>/info``    a checkpoint being written or committed: {epoch, round, state}
    ``ckpt/<id>/part/<name>``  one written part (``ps-<i>``, ``master``): its PartInfo
    ``epoch``             {epoch, checkpoint, round, reason}: bumped by each rollback
    ``rounds/<epoch>/<r>/t/<trainer>``  one trainer's contribution to a sync round
                          (Contribution), written once by that trainer
    ``rounds/<epoch>/<r>/closed``  the round's close marker ({round, checkpoint}),
                          written once: the step's decision point (RoundRecord)
    ``initialized``       the pservers were given initial values (a later pserver start is a restart)
    ``waits/<who>``       a role waiting longer than a few seconds: for whom, since when (leased)
    ``stream``            a streaming job's position: {cursor, next_id, records, ended}, written
                          in the transaction that adds the tasks cut up to the cursor
    ``stream/lag``        what a streaming job has not trained yet (written by the master, ~1/s)
    ``specs/<id>``        a streaming job's task spec, written when the task is added
    ``windows/<no>``      a window of a streaming job (:class:`pdps.core.windows.Window`)
    ``evals/<no>``        the user's evaluation of the model after window ``<no>``
    ``checkpoint_wanted`` {window}: window ``<window>`` closed and ``checkpoint_windows`` asks for a
                          checkpoint after it (the pservers take it at the next round or update)
    ``hooks/before``      the before-job function ran (it runs once per job)
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

    @property
    def progress(self) -> str:
        return self.root + "progress/"

    def task_progress(self, task_id: int) -> str:
        return f"{self.progress}{task_id:08d}"

    def task_id(self, key: str) -> int:
        """The task id in a ``tasks/<id>``, ``quarantine/<id>`` or ``audit/<pass>/<id>`` key (ValueError if none)."""
        return int(key.rsplit("/", 1)[1])

    @property
    def queue(self) -> str:
        return self.root + "queue"

    @property
    def queue_records(self) -> str:
        """The prefix of the chunks of record counts that ``queue`` names."""
        return self.root + "queue/records/"

    def queue_chunk(self, k: int) -> str:
        return f"{self.queue_records}{k:06d}"

    @property
    def quarantine(self) -> str:
        return self.root + "quarantine/"

    def quarantined(self, task_id: int) -> str:
        return f"{self.quarantine}{task_id:08d}"

    @property
    def audit(self) -> str:
        return self.root + "audit/"

    def audit_pass(self, pass_no: int) -> str:
        """The prefix of one pass's audit entries."""
        return f"{self.audit}{pass_no:06d}/"

    def audit_entry(self, pass_no: int, task_id: int) -> str:
        return f"{self.audit_pass(pass_no)}{task_id:08d}"

    def quarantined_audit(self, pass_no: int, task_id: int | None = None) -> str:
        """Where an undecodable audit entry is moved aside (without ``task_id``: the prefix of a pass's)."""
        prefix = f"{self.quarantine}audit/{pass_no:06d}/"
        return prefix if task_id is None else f"{prefix}{task_id:08d}"

    @property
    def state(self) -> str:
        return self.root + "state"

    @property
    def stream(self) -> str:
        return self.root + "stream"

    @property
    def stream_lag(self) -> str:
        return self.root + "stream/lag"

    @property
    def specs(self) -> str:
        return self.root + "specs/"

    def spec(self, task_id: int) -> str:
        return f"{self.specs}{task_id:08d}"

    @property
    def windows(self) -> str:
        return self.root + "windows/"

    def window(self, no: int) -> str:
        return f"{self.windows}{no:08d}"

    @property
    def checkpoint_wanted(self) -> str:
        return self.root + "checkpoint_wanted"

    @property
    def evals(self) -> str:
        return self.root + "evals/"

    def evaluation(self, no: int) -> str:
        return f"{self.evals}{no:08d}"

    @property
    def before_hook(self) -> str:
        return self.root + "hooks/before"

    @property
    def ps_desired(self) -> str:
        return self.root + "ps_desired"

    @property
    def trainers_desired(self) -> str:
        return self.root + "trainers_desired"

    @property
    def resize(self) -> str:
        return self.root + "resize"

    @property
    def slotmap_since(self) -> str:
        return self.root + "slotmap_since"

    def resize_ready(self, version: int, index: int | None = None) -> str:
        """Pserver ``index`` has built its shard of map ``version`` ahead of the switch
        (without it: the prefix). A sync switch waits for every pserver of the new map
        (at most :data:`~pdps.roles.pserver.READY_PATIENCE`)."""
        prefix = f"{self.root}resize_ready/{version:08d}/"
        return prefix if index is None else f"{prefix}{index}"

    def resize_got(self, version: int, index: int | None = None) -> str:
        """Pserver ``index`` holds its slots of map ``version`` (without it: the prefix)."""
        prefix = f"{self.root}resize_got/{version:08d}/"
        return prefix if index is None else f"{prefix}{index}"

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
    def pipeline_ranks(self) -> str:
        return self.root + "pipeline/ranks/"

    def pipeline_rank(self, rank: int) -> str:
        return f"{self.pipeline_ranks}{rank}"

    def pipeline_rank_of(self, key: str) -> int | None:
        """The rank in a ``pipeline/ranks/<r>`` key; None for any other key."""
        tail = key[len(self.pipeline_ranks) :] if key.startswith(self.pipeline_ranks) else ""
        return int(tail) if tail.isdigit() and tail.isascii() and self.pipeline_rank(int(tail)) == key else None

    @property
    def model(self) -> str:
        return self.root + "model"

    @property
    def model_tables(self) -> str:
        return self.root + "model_tables"

    @property
    def table_stats_prefix(self) -> str:
        return self.root + "table_stats/"

    def table_stats(self, index: int) -> str:
        return f"{self.table_stats_prefix}{index}"

    @property
    def slotmap(self) -> str:
        return self.root + "slotmap"

    @property
    def checkpoint(self) -> str:
        return self.root + "checkpoint"

    @property
    def epoch(self) -> str:
        return self.root + "epoch"

    @property
    def rounds(self) -> str:
        return self.root + "rounds/"

    def round(self, epoch: int, round_no: int) -> str:
        """The prefix of a sync round: its contributions and its close marker."""
        return f"{self.rounds}{epoch:06d}/{round_no:010d}/"

    def round_closed(self, epoch: int, round_no: int) -> str:
        return self.round(epoch, round_no) + "closed"

    def contribution(self, epoch: int, round_no: int, trainer_id: str) -> str:
        return f"{self.round(epoch, round_no)}t/{trainer_id}"

    def round_entry(self, key: str) -> tuple[int, int, str | None] | None:
        """``(epoch, round, trainer)`` of a contribution key, ``(epoch, round, None)`` of
        a close marker; None for any other key."""
        parts = key[len(self.rounds) :].split("/", 3) if key.startswith(self.rounds) else []
        try:
            epoch, round_no = int(parts[0]), int(parts[1])
        except (IndexError, ValueError):
            return None
        if parts[2:] == ["closed"]:
            return epoch, round_no, None
        if len(parts) == 4 and parts[2] == "t" and parts[3]:
            return epoch, round_no, parts[3]
        return None

    @property
    def checkpoints(self) -> str:
        return self.root + "ckpt/"

    def checkpoint_info(self, ckpt_id: str) -> str:
        return f"{self.checkpoints}{ckpt_id}/info"

    def checkpoint_parts(self, ckpt_id: str) -> str:
        return f"{self.checkpoints}{ckpt_id}/part/"

    def checkpoint_part(self, ckpt_id: str, name: str) -> str:
        return self.checkpoint_parts(ckpt_id) + name

    @property
    def initialized(self) -> str:
        return self.root + "initialized"

    @property
    def waits(self) -> str:
        return self.root + "waits/"

    def wait(self, who: str) -> str:
        return self.waits + who
