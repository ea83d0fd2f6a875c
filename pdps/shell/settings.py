"""Settings of the role processes (``pdps master|pserver|trainer|launch``).

One table, :data:`SETTINGS`, names every setting once: its type, default, which
commands take it and what it means. Each setting can come from three places, in
increasing order of precedence:

1. a TOML file (``--config FILE`` or ``PDPS_CONFIG``), flat keys named as below;
2. environment variables ``PDPS_<NAME>`` (``PDPS_STORE``, ``PDPS_BATCH_SIZE``, ...);
3. command-line flags ``--<name-with-dashes>`` (``--store``, ``--batch-size``, ...).

*Role* settings say how a process reaches the others (store, transport, TLS, token);
*job* settings are :class:`~pdps.core.job.JobConfig` fields, read by whoever creates
the job (``pdps launch``, or ``pdps master`` when the store has no job yet). Every
other role reads the job's configuration from the store, never from its own settings.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import attrs

from pdps.core.errors import ConfigError
from pdps.core.job import DEFAULT_JOB, JobConfig

log = logging.getLogger(__name__)

ENV_PREFIX = "PDPS_"

MASTER, PSERVER, TRAINER, LAUNCH = "master", "pserver", "trainer", "launch"
ROLES = (MASTER, PSERVER, TRAINER)
ALL = (MASTER, PSERVER, TRAINER, LAUNCH)
CREATES_JOB = (MASTER, LAUNCH)


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value


def _optional_int(text: str) -> int | None:
    return None if text.strip().lower() in ("", "none") else int(text)


def _port_or_none(text: str) -> int | None:
    port = _optional_int(text)
    if port is not None and not 0 <= port <= 65535:
        raise ValueError(f"a port is 0 to 65535 (or none), got {port}")
    return port


@attrs.frozen
class Setting:
    name: str
    parse: Callable[[str], Any]  # from a flag or an environment variable
    default: Any
    commands: tuple[str, ...]
    help: str
    job: bool = False  # a JobConfig field
    choices: tuple[str, ...] | None = None
    secret: bool = False  # never shown in logs or summaries

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


_JOB_DEFAULTS = JobConfig()


def _job(name: str, parse: Callable[[str], Any], help: str, **kw: Any) -> Setting:
    return Setting(name, parse, getattr(_JOB_DEFAULTS, name), CREATES_JOB, help, job=True, **kw)


SETTINGS: tuple[Setting, ...] = (
    # --- role settings ------------------------------------------------------------------
    Setting("store", str, None, ALL, "coordination store URL (etcd://host:port, redis://host:port/db, ...); required"),
    Setting("job", str, DEFAULT_JOB, ALL, "job name: the namespace /pdps/<job>/ in the store"),
    Setting("transport", str, "grpc", ALL, "how roles exchange tensors: grpc (processes) or inproc (launch only: one process)", choices=("grpc", "inproc")),
    Setting("listen", str, "127.0.0.1:0", (MASTER, PSERVER), "host:port to serve on (port 0 picks a free one)"),
    Setting("bulk_port", int, 0, (MASTER, PSERVER), "port of the bulk channel for large tensors, beside gRPC (0 picks a free one)"),
    Setting("handshake_timeout", float, 10.0, (MASTER, PSERVER, LAUNCH), "seconds a new connection to a served port gets for its TLS and HTTP/2 (or bulk hello) handshake, and a connection with a call in flight gets to answer a keepalive ping; then it is closed"),
    Setting("idle_timeout", float, 120.0, ALL, "seconds a served port keeps a connection without calls open (pinged every half that during a call); clients reuse idle bulk connections for half of it"),
    Setting("max_connections", int, 1024, (MASTER, PSERVER, LAUNCH), "connections the gRPC port serves at once; more are closed on arrival (the bulk port takes at most 64 and sends the rest to gRPC)"),
    Setting("max_streams", int, 100, (MASTER, PSERVER, LAUNCH), "calls one gRPC connection carries at once; more wait on the client's side"),
    Setting("advertise", str, None, (MASTER, PSERVER), "host others use to reach this role (default: the listen host, or the hostname when listening on 0.0.0.0)"),
    Setting("token", str, None, ALL, "shared secret every gRPC call must carry; calls without it are refused", secret=True),
    Setting("token_file", str, None, ALL, "file holding the token (e.g. a mounted Kubernetes secret); used when token is unset"),
    Setting("tls_cert", str, None, ALL, "PEM certificate this role presents (as a server, and as a client for mutual TLS)"),
    Setting("tls_key", str, None, ALL, "PEM private key of tls_cert"),
    Setting("tls_ca", str, None, ALL, "PEM CA bundle: servers require client certificates it signed; clients verify servers with it"),
    Setting("connect_timeout", float, 10.0, ALL, "seconds to keep retrying an unreachable store at startup"),
    Setting("grace", float, 30.0, ALL, "seconds a role gets after SIGTERM to finish its batch and leave before it is stopped hard"),
    Setting("log_level", str.upper, "INFO", ALL, "logging level of the role's messages (stderr)", choices=("DEBUG", "INFO", "WARNING", "ERROR")),
    Setting("metrics_port", _port_or_none, 0, ALL, "port serving this role's Prometheus metrics at /metrics (0: a free one, logged; none: no metrics); pdps launch gives its master this port, pserver i port+1+i and trainer i port+1+pservers+i"),
    Setting("metrics_host", str, "127.0.0.1", ALL, "interface the metrics port listens on (0.0.0.0 in a pod, for Prometheus to scrape)"),
    Setting("index", _optional_int, None, (PSERVER,), "pserver index to claim (a StatefulSet's ordinal); default: the first free one"),
    Setting("trim_every", float, 2.0, (PSERVER,), "seconds between a pserver's looks at its row traffic: once 32 MiB moved since its last trim, it gives the memory that traffic freed back to the system (glibc malloc_trim) at a look that finds the traffic paused, or 15 looks after the last trim while it goes on; 0: never"),
    Setting("trainer_id", str, None, (TRAINER,), "this trainer's id in the job (default: host-pid-random)"),
    Setting("target", str, None, (TRAINER, LAUNCH), "the training function, module:function or path/to/file.py:function"),
    Setting("linger", float, 30.0, (MASTER,), "after the last pass, seconds the master keeps serving for trainers still registered"),
    Setting("restart", str, "on-failure", (LAUNCH,), "restart roles that die (on-failure) or not (never)", choices=("on-failure", "never")),
    Setting("max_restarts", int, 5, (LAUNCH,), "restarts per role before the launcher gives up on the job"),
    Setting("timeout", float, 3600.0, (LAUNCH,), "seconds the launcher waits for the job before stopping it"),
    Setting("json", _bool, False, (LAUNCH,), "print the summary as one JSON object on the last line of stdout"),
    # --- job settings (JobConfig fields) ---------------------------------------------
    _job("dataset", str, "dataset URL (Parquet directory or file: file://, s3://); default: the target module's dataset() hook"),
    _job("mode", str, "sync-SGD (a barrier per step) or async-SGD", choices=("sync", "async")),
    _job("trainers", int, "number of trainers"),
    _job("pservers", int, "number of parameter servers"),
    _job("optimizer", str, "torch.optim class (or registered import path) the pservers apply"),
    _job("optimizer_args", _json_object, "the optimizer's keyword arguments, a JSON object (a table in TOML)"),
    Setting("lr", float, None, CREATES_JOB, "shortcut for optimizer_args.lr", job=True),
    _job("sparse_optimizer", str, "the row rule the pservers apply to sparse tables (SGD, Adagrad, RowWiseAdagrad, SparseAdam); empty: the row rule of optimizer"),
    _job("sparse_optimizer_args", _json_object, "the row rule's keyword arguments, a JSON object; empty: optimizer_args, unless sparse_optimizer is named (then the rule's defaults)"),
    _job("sparse_max_ids", int, "the most ids of one table one push or pull may carry"),
    _job("batch_size", int, "mini-batch size per trainer"),
    _job("passes", int, "passes over the dataset"),
    _job("push_every", int, "async: push every n mini-batches"),
    _job("pull_every", int, "async: pull every m mini-batches"),
    _job("staleness", _optional_int, "async: drop pushes more than this many versions behind (none: no bound)"),
    _job("failure_max", int, "failures of one task before it is given up for the pass"),
    _job("task_timeout", float, "seconds a leased task may stay pending before it is re-queued"),
    _job("max_in_flight", int, "tasks one trainer may hold at once"),
    _job("lease_ttl", float, "seconds a role's lease lives without keep-alives (how fast a dead role is noticed)"),
    _job("num_slots", int, "slots the parameters are hashed into"),
    _job("replicas", int, "copies of each slot, each on its own pserver (1: none; at most pservers; async jobs: at most 2, and no pserver resize); every copy applies every update"),
    _job("min_block", int, "fewest elements of a block of a parameter cut across slots (a model smaller than 8 such blocks per pserver is cut finer)"),
    _job("store_outage_deadline", float, "seconds a role rides out an unreachable store before it exits"),
    _job("checkpoint_url", str, "where checkpoints go (file:///abs/dir, s3://bucket/prefix); empty: no checkpoints"),
    _job("checkpoint_every", int, "take a checkpoint every this many sync rounds (async: updates on pserver 0); 0: not by count"),
    _job("checkpoint_seconds", float, "take a checkpoint at least this often, in seconds; 0: not by time"),
    _job("checkpoint_keep", int, "committed checkpoints kept (older ones are deleted after each commit)"),
    _job("checkpoint_orphan_grace", float, "seconds a temporary file of a checkpoint write must go unmodified before a commit deletes it as a killed writer's leftover"),
    _job("restore", str, "when a pserver restarts: roll the whole job back (job), or async only, reload just its slots (lost)", choices=("job", "lost")),
    _job("keep_rounds", int, "sync: closed rounds kept in the store (their contributions: the audit of which gradients each step applied)"),
    _job("window_records", int, "streaming job: a window closes after this many records; 0: not by count"),
    _job("window_seconds", float, "streaming job: a window closes after this many seconds open; 0: not by time"),
    _job("checkpoint_windows", int, "streaming job: take a checkpoint after every this many windows close (needs checkpoint_url); 0: not by windows"),
    _job("windows", int, "streaming job: the job ends after this many windows; 0: it runs until stopped"),
    _job("task_records", int, "streaming job: records per task cut from a stream, at most (a Parquet row group is one task)"),
    _job("stream_max_tasks", int, "streaming job: the master cuts no new task while this many are todo or pending (backpressure)"),
    _job("stream_linger", float, "streaming job: seconds arrived data waits for a full task before a partial one is cut"),
    _job("export_url", str, "streaming job: export the model (safetensors + manifest) after windows to this storage URL; empty: no exports"),
    _job("export_every", int, "streaming job: export after every this many windows; 0: not after windows"),
    _job("export_seconds", float, "streaming job: also export every this many seconds, windows or not; 0: not by time"),
    _job("export_keep", int, "exports kept under export_url (older ones are deleted); 0: keep every export"),
    _job("speculation", _bool, "start a backup attempt of a task running speculation_multiplier times the median time per record; the first to commit a range of records wins, each record is trained once"),
    _job("speculation_multiplier", float, "speculation: how many times the median time per record a task must run before a backup races it"),
    _job("speculation_min_finished", int, "speculation: finished tasks the median needs before any backup starts"),
    _job("before_job", str, "a function (module:function or path/to/file.py:function) the master runs once before the job's first task"),
    _job("evaluate", str, "a function (module:function) given the parameters after each window, returning a number or a dict of numbers, recorded for pdps status"),
    _job("overlap", str, "trainers push each parameter's slots while backward still runs, and in async mode pull while the next forward runs: on, off, or auto (on where it pays: CUDA, in-process pservers, or CPU cores to spare)", choices=("auto", "on", "off")),
    _job("pipeline_stages", int, "stages of each pipeline (docs/pipeline.md): trainers = pipeline_stages x data-parallel pipelines; 1: no pipeline"),
    _job("pipeline_microbatches", int, "pipeline job: microbatches each batch is cut into"),
    _job("pipeline_schedule", str, "pipeline job: the schedule each step runs", choices=("gpipe", "1f1b")),
    _job("pipeline_timeout", float, "pipeline job: seconds a stage waits for a message of another stage of its pipeline before the pipeline is broken"),
)

BY_NAME = {s.name: s for s in SETTINGS}


def for_command(command: str) -> list[Setting]:
    return [s for s in SETTINGS if command in s.commands]


def add_flags(
    parser: argparse.ArgumentParser, command: str, *, skip: Sequence[str] = (), required: Collection[str] = ()
) -> None:
    """Add ``--config`` and one flag per setting of ``command``; unset flags stay absent.
    Flags named in ``required`` must be given (nothing else can supply them)."""
    parser.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS, help=f"TOML file of settings (env {ENV_PREFIX}CONFIG)")
    for s in for_command(command):
        if s.name in skip:
            continue
        default = "" if s.default in (None, "") else f" (default: {s.default})"  # the help says what unset means
        kw: dict[str, Any] = {"dest": s.name, "default": argparse.SUPPRESS, "help": f"{s.help}{default}; env {s.env}"}
        if s.name in required:
            kw["required"] = True
        if s.parse is _bool:
            kw["action"] = "store_true"
        else:
            kw["type"] = _flag_parser(s)
            kw["metavar"] = s.name.upper()
            if s.choices:
                kw["choices"] = s.choices
                kw.pop("metavar")
        parser.add_argument(s.flag, **kw)


def _flag_parser(s: Setting) -> Callable[[str], Any]:
    """``s.parse`` for argparse: a value it cannot read is refused as its variable is
    (``argument --trainers: cannot read trainers from '3.0': ...``), not by a helper's name."""

    def parse(text: str) -> Any:
        try:
            return s.parse(text)
        except (ValueError, TypeError) as exc:
            raise argparse.ArgumentTypeError(f"cannot read {s.name} from {text!r}: {exc}") from None

    return parse


def _load_toml(path: str) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on 3.10 only
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read settings file {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"settings file {path} is not valid TOML: {exc}") from exc


def _check(s: Setting, value: Any, origin: str) -> Any:
    if s.choices and value not in s.choices:
        raise ConfigError(f"{s.name} must be one of {', '.join(s.choices)}, got {value!r} ({origin})")
    return value


def resolve(
    command: str, flags: Mapping[str, Any], env: Mapping[str, str] | None = None, *, defaults: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The settings of ``command``: defaults < TOML file < ``PDPS_*`` environment < ``flags``.

    ``defaults`` replace built-in defaults of job settings (a target module's
    ``JOB_DEFAULTS``: the digits example trains with Adam for 30 passes).

    ``flags`` holds only what was given on the command line (plus ``config``). A
    setting another command takes, or a name no command knows, is an error in a
    file or a flag; unknown ``PDPS_*`` variables are logged and ignored (the
    environment is shared with everything else).
    """
    env = os.environ if env is None else env
    mine = {s.name: s for s in for_command(command)}
    values: dict[str, Any] = {name: s.default for name, s in mine.items()}
    for name, value in (defaults or {}).items():
        if name not in BY_NAME or not BY_NAME[name].job:
            raise ConfigError(f"job defaults name {name!r}, which is not a job setting")
        if name in mine:
            values[name] = value
    path = flags.get("config") or env.get(ENV_PREFIX + "CONFIG")
    if path:
        for name, value in _load_toml(path).items():
            if name not in BY_NAME:
                raise ConfigError(f"{path}: unknown setting {name!r}; known settings: {', '.join(sorted(BY_NAME))}")
            if name in mine:
                s = mine[name]
                if isinstance(value, str) and s.parse is not str:  # log_level = "info" as PDPS_LOG_LEVEL=info
                    value = _parse(s, value, f"{path}: {name}")
                elif not s.job:  # a job setting is checked as JobConfig checks it; a role setting here
                    value = _typed(s, value, f"{path}: {name}")
                values[name] = _check(s, value, f"{path}: {name}")
            # a setting of another command is allowed in a shared file, and ignored here
    known_env = {s.env for s in SETTINGS} | {ENV_PREFIX + "CONFIG"}
    for var in sorted(v for v in env if v.startswith(ENV_PREFIX) and v not in known_env):
        log.warning("ignoring unknown environment variable %s", var)
    for name, s in mine.items():
        if s.env in env:
            values[name] = _check(s, _parse(s, env[s.env], s.env), s.env)
    for name, value in flags.items():
        if name == "config":
            continue
        if name not in mine:
            raise ConfigError(f"pdps {command} takes no setting {name!r}")
        values[name] = _check(mine[name], value, BY_NAME[name].flag)
    for name, s in mine.items():  # a role's counts, ports and seconds: never below 0 (a job's: JobConfig checks them)
        value = values[name]
        if not s.job and s.parse in (int, float, _optional_int) and value is not None and not value >= 0:  # NaN too
            raise ConfigError(f"{name} must be 0 or more, got {value!r}")
    if values.get("token") is None and values.get("token_file"):
        try:
            with open(values["token_file"], encoding="utf-8") as f:
                values["token"] = f.read().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read token_file {values['token_file']}: {exc.strerror}") from exc
        if not values["token"]:
            raise ConfigError(f"token_file {values['token_file']} is empty")
    if not values.get("store"):
        raise ConfigError(f"pdps {command} needs a coordination store: --store URL, {ENV_PREFIX}STORE or store = \"...\" in a settings file")
    return values


def _typed(s: Setting, value: Any, origin: str) -> Any:
    """A role setting's TOML value, refused unless it has its setting's type (a count an
    int, seconds an int or a float, a flag a bool, text a string; a bool is no number)."""
    if s.parse in (int, _optional_int, _port_or_none):
        ok, what = isinstance(value, int) and not isinstance(value, bool), "a whole number"
    elif s.parse is float:
        ok, what = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
    elif s.parse is _bool:
        ok, what = isinstance(value, bool), "true or false"
    else:
        ok, what = isinstance(value, str), "a string"
    if not ok:
        raise ConfigError(f"{origin} must be {what}, got {value!r} ({type(value).__name__})")
    return _parse(s, str(value), origin) if s.parse is _port_or_none else value


def _parse(s: Setting, text: str, origin: str) -> Any:
    try:
        return s.parse(text)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{origin}: cannot read {s.name} from {text!r}: {exc}") from exc


def job_config(values: Mapping[str, Any]) -> JobConfig:
    """The JobConfig the resolved settings describe (``lr`` folded into ``optimizer_args``)."""
    fields = {s.name: values[s.name] for s in SETTINGS if s.job and s.name in values and s.name != "lr"}
    if values.get("lr") is not None:
        fields["optimizer_args"] = {**fields.get("optimizer_args", {}), "lr": values["lr"]}
    return JobConfig(name=values["job"], **fields)


def role_env(values: Mapping[str, Any]) -> dict[str, str]:
    """The ``PDPS_*`` variables that hand a launcher's role settings to its children."""
    out = {}
    for s in SETTINGS:
        if s.job or LAUNCH not in s.commands or s.name in ("target", "restart", "max_restarts", "timeout", "json", "metrics_port"):
            continue
        value = values.get(s.name)
        if value is not None and s.name != "token_file":
            out[s.env] = str(value)
    return out
