"""Roles as processes: the composition root of ``pdps master``, ``pdps pserver`` and
``pdps trainer``.

Each role needs only the store URL and the job name: it reads the job's
configuration from the store and finds the others there. Its own settings (how
to serve, TLS, token) come from :mod:`pdps.shell.settings`.

Shutdown: SIGTERM (or SIGINT) asks the role to stop gracefully — a trainer
finishes its mini-batch and gives its tasks back, a pserver stops serving once
in-flight calls end, a master releases its lock so a standby takes over at once.
A second signal, or ``grace`` seconds without an exit, ends the process hard.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from pdps.core.errors import ConfigError, PdpsError, ResizeInProgress
from pdps.core.job import JobConfig, Keys
from pdps.ports.coordination import CoordinationStore

if TYPE_CHECKING:
    from pdps.adapters.prometheus_metrics import RoleMetrics

log = logging.getLogger(__name__)

#: Exit code of a role that stopped because it lost its lease or its lock (restart it).
EXIT_LOST = 3


def load_target(spec: str, what: str = "training target") -> tuple[Callable[..., Any], ModuleType]:
    """The training function (or, as ``what`` says, another of the user's functions) named
    by ``module:function`` or ``path/to/file.py:function``."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ConfigError(f"{what} {spec!r} must look like module:function or path/to/file.py:function")
    if where.endswith(".py") or os.sep in where:
        path = Path(where)
        if not path.is_file():
            raise ConfigError(f"{what} {spec!r}: no file {path}")
        module_name = f"pdps_target_{path.stem}"
        loaded = sys.modules.get(module_name)
        if loaded is not None and Path(getattr(loaded, "__file__", "")).resolve() == path.resolve():
            module = loaded  # loaded once per process, like an imported module
        else:
            mod_spec = importlib.util.spec_from_file_location(module_name, path)
            assert mod_spec is not None and mod_spec.loader is not None
            module = importlib.util.module_from_spec(mod_spec)
            sys.modules[module_name] = module
            mod_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise ConfigError(f"{what} {spec!r}: cannot import {where!r}: {exc}") from exc
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"{what} {spec!r}: {where} has no function {name!r}")
    return fn, module


def function_error(spec: str, fn: Callable[..., Any], exc: BaseException) -> str:
    """``the training function train.py:train raised ValueError: ... (at train.py:12, in
    train)``: the exception of the user's ``fn`` (named by ``spec``) and the deepest line of
    ``fn``'s own file it passed through, which a traceback ending in torch or pdps frames
    leaves out of its last lines."""
    raised = "".join(traceback.format_exception_only(exc)).strip()
    source = getattr(getattr(fn, "__code__", None), "co_filename", None)
    mine = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == source]
    where = f" (at {mine[-1].filename}:{mine[-1].lineno}, in {mine[-1].name})" if mine else ""
    return f"the training function {spec} raised {raised}{where}"


def open_role_transport(values: Mapping[str, Any]) -> Any:
    """The transport a role's settings describe (gRPC with its token and TLS files)."""
    from pdps.registry import open_transport

    if values["transport"] == "inproc":
        return open_transport("inproc")
    check_tls_files(values)
    cert, key, ca = values.get("tls_cert"), values.get("tls_key"), values.get("tls_ca")
    # A call to an unreachable peer fails after connect_timeout; the roles retry above it
    # with the peer's address looked up again in the store (a restarted pserver or master
    # serves elsewhere), so the channel itself only needs to ride out a blip.
    options: dict[str, Any] = {"token": values.get("token"), "advertise_host": values.get("advertise"), "connect_timeout": 0.5}
    if values.get("bulk_port"):
        options["bulk_port"] = values["bulk_port"]
    for name in ("handshake_timeout", "idle_timeout", "max_connections", "max_streams"):
        if values.get(name) is not None:  # the trainer takes only idle_timeout
            options[name] = values[name]
    if cert or ca:
        from pdps.adapters.grpc_transport import TlsConfig

        options["tls"] = TlsConfig(cert=cert, key=key, ca=ca)
    return open_transport(values["transport"], **options)


def check_shared(command: str, values: Mapping[str, Any]) -> None:
    """Refuse a role process (``pdps master|pserver|trainer``) the other roles could never
    reach: an ``inproc`` transport or a ``memory://`` store lives in this process only."""
    from pdps.registry import scheme_of

    if values["transport"] == "inproc":
        raise ConfigError(
            f"pdps {command} runs one role, in a process of its own, and transport inproc lives in one process: "
            "use --transport grpc (inproc is for pdps launch, which then runs the whole job in its own process)"
        )
    if scheme_of(values["store"]) == "memory":
        raise ConfigError(
            f"store {values['store']} is in this process's memory, where no other role can find this {command}: "
            "give an etcd:// or redis:// store"
        )


def check_tls_files(values: Mapping[str, Any]) -> None:
    """Raise ConfigError unless the TLS files the settings name are readable files, the
    certificate and its key given together."""
    cert, key = values.get("tls_cert"), values.get("tls_key")
    if bool(cert) != bool(key):
        raise ConfigError("tls_cert and tls_key go together: give both or neither")
    for name in ("tls_cert", "tls_key", "tls_ca"):
        path = values.get(name)
        if path and not (os.path.isfile(path) and os.access(path, os.R_OK)):
            raise ConfigError(f"{name} {path} is not a readable file")


def check_dataset(url: str) -> None:
    """Raise a PdpsError (DatasetError, ConfigError) naming ``url`` unless the dataset can
    be read as the job's master will read it: its source opens and, for a finite dataset,
    its files exist and their footers parse (a stream may have no data yet)."""
    from pdps.ports.data import StreamingSource
    from pdps.registry import open_data_source

    source = open_data_source(url)
    if not isinstance(source, StreamingSource):
        source.tasks()


def serve_address(values: Mapping[str, Any]) -> str:
    if values["transport"] == "inproc":
        return "inproc://"
    listen = values["listen"]
    if ":" not in listen:
        raise ConfigError(f"listen must be host:port, got {listen!r}")
    return f"{values['transport']}://{listen}"


class Shutdown:
    """Turns SIGTERM/SIGINT into ``requested``; the role stops itself gracefully.

    ``on_request`` runs on a helper thread (never inside the signal handler). If the
    process has not exited ``grace`` seconds later, or a second signal arrives, it
    exits hard.
    """

    def __init__(self, grace: float, on_request: Callable[[], None] | None = None) -> None:
        self.requested = threading.Event()
        self._grace = grace
        self._on_request = on_request
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
        if self.requested.is_set():
            os._exit(128 + signum)
        self.requested.set()
        threading.Thread(target=self._stop, args=(signum,), name="pdps-shutdown", daemon=True).start()

    def _stop(self, signum: int) -> None:
        log.info("%s: stopping gracefully (up to %.0f s)", signal.Signals(signum).name, self._grace)
        if self._on_request is not None:
            self._on_request()
        time.sleep(self._grace)
        log.error("still running %.0f s after %s; exiting hard", self._grace, signal.Signals(signum).name)
        logging.shutdown()
        os._exit(128 + signum)


def role_metrics(values: Mapping[str, Any], role: str, id: str) -> RoleMetrics:
    from pdps.adapters.prometheus_metrics import RoleMetrics

    return RoleMetrics(values["job"], role, id)


@contextlib.contextmanager
def serving_metrics(values: Mapping[str, Any], metrics: RoleMetrics) -> Iterator[None]:
    """Serve the role's metrics while it runs, unless ``metrics_port`` is none. Where is
    logged, and printed on stdout as ``{"metrics": URL}`` (how ``pdps launch`` learns it)."""
    if values.get("metrics_port") is None:
        yield
        return
    from pdps.adapters.prometheus_metrics import serve

    server = serve(metrics, values.get("metrics_host") or "127.0.0.1", values["metrics_port"])
    log.info("serving metrics at %s", server.url)
    print(json.dumps({"metrics": server.url, "role": metrics.role, "id": metrics.id}), flush=True)
    try:
        yield
    finally:
        server.close()


def _connect(values: Mapping[str, Any]) -> CoordinationStore:
    from pdps.registry import connect_store

    return connect_store(values["store"], timeout=values["connect_timeout"])


def _stored_config(store: CoordinationStore, job: str, *, wait: bool) -> JobConfig | None:
    from pdps.roles.trainer.discovery import DISCOVERY_TIMEOUT, wait_for_key

    keys = Keys(job)
    if wait:
        raw = wait_for_key(store, keys.config, f"job {job!r} (start its master, or pdps launch)", timeout=DISCOVERY_TIMEOUT)
        return JobConfig.decode(raw, keys.config)
    kv = store.get(keys.config)
    return None if kv is None else JobConfig.decode(kv.value, keys.config)


def _resilient(store: CoordinationStore, config: JobConfig, metrics: RoleMetrics) -> CoordinationStore:
    from pdps.runtime.resilient import ResilientStore

    # counted beneath the retries: every failed try of an outage counts
    return ResilientStore(metrics.store(store), deadline=config.store_outage_deadline)


def _join(values: Mapping[str, Any], metrics: RoleMetrics) -> tuple[CoordinationStore, JobConfig, CoordinationStore]:
    """Connect, wait for the job's config, and wrap the store to ride out outages.
    Returns the raw store (the caller closes it), the config and the wrapped store."""
    store = _connect(values)
    try:
        config = _stored_config(store, values["job"], wait=True)
    except BaseException:
        store.close()
        raise
    assert config is not None
    return store, config, _resilient(store, config, metrics)


def run_master(values: Mapping[str, Any]) -> int:
    """Serve the job's task queue until the job is done (or SIGTERM). Exit code."""
    from pdps.adapters.prometheus_metrics import master_reading
    from pdps.ports.data import StreamingSource
    from pdps.registry import open_checkpoint_files, open_data_source
    from pdps.roles.master import Master
    from pdps.shell.hooks import WindowHooks, run_before_job, user_function
    from pdps.shell.settings import job_config

    metrics = role_metrics(values, "master", f"{socket.gethostname()}-{os.getpid()}")
    store = _connect(values)
    try:
        config = _stored_config(store, values["job"], wait=False)
        if config is None:
            config = job_config(values)
            if not config.dataset:
                raise ConfigError(f"job {config.name!r} does not exist yet and no dataset is set: give --dataset URL (or PDPS_DATASET)")
            log.info("creating job %r", config.name)
        else:
            log.info("job %r exists; serving its stored configuration", config.name)
        st = _resilient(store, config, metrics)
        transport = metrics.transport(open_role_transport(values))
        before = user_function(config.before_job, "before_job") if config.before_job else None
        evaluate = user_function(config.evaluate, "evaluate") if config.evaluate else None
        hooks = WindowHooks(st, transport, config, evaluate) if config.export_url or evaluate else None
        source = open_data_source(config.dataset)
        master = Master(
            st, transport, source, config,
            address=serve_address(values), checkpoints=open_checkpoint_files(config.checkpoint_url),
            on_window=hooks, before_job=None if before is None else lambda: run_before_job(st, config, before),
        )  # fmt: skip
        metrics.watch(master_reading(master))
        shutdown = Shutdown(values["grace"], on_request=master.stop)
        with serving_metrics(values, metrics):
            master.start(standby=True)
            if shutdown.requested.is_set() or not master.leading.is_set():
                return 0 if master.error is None else 2
            keys = Keys(config.name)
            done_at: float | None = None
            while not shutdown.requested.wait(0.2):
                if master.error is not None:
                    log.error("master stopped: %s", master.error)
                    return 2
                if master.stopped:
                    if shutdown.requested.is_set():
                        break  # SIGTERM landed between the wait and here: its helper stopped the master
                    log.error("master lost its lock; exiting so it can be restarted as a standby")
                    return EXIT_LOST
                if master.done.is_set():
                    done_at = done_at or time.monotonic()
                    if not st.range(keys.trainers) or time.monotonic() - done_at > values["linger"]:
                        trained = f"{config.windows} windows" if isinstance(source, StreamingSource) else f"{config.passes} passes"
                        log.info("job %r is done after %s", config.name, trained)
                        break
            if hooks is not None:
                hooks.close()  # the last window's export is whole before the master says it is done
            master.stop()
            return 0
    finally:
        store.close()


def make_room(store: CoordinationStore, config: JobConfig, index: int, stop: threading.Event) -> bool:
    """Before a pserver with fixed ``index`` claims it: if the job has fewer pservers
    (a StatefulSet scaled up before ``pdps scale``), ask for a resize to ``index + 1``,
    behind any resize in progress; if the newest resize removed this index, wait until
    one wants it again (:func:`pdps.core.headcount.pserver_entry`). False if ``stop``
    was set meanwhile.

    It does not wait for its own resize to finish: that resize waits for this pserver
    to claim its index.
    """
    from pdps.core.headcount import Entry, pserver_entry
    from pdps.runtime.resizing import REREAD, read_desired, read_map, read_resize, request_resize

    keys = Keys(config.name)
    said: Entry | None = None
    while not stop.is_set():
        latest, _ = read_resize(store, keys)
        desired = read_desired(store, keys, config.trainers).pservers
        entry = pserver_entry(index, desired, read_map(store, keys).num_pservers, latest)
        if entry is Entry.CLAIM:
            return True
        if entry is Entry.ASK:
            try:
                request_resize(store, keys, pservers=index + 1, by=f"pserver pod {index}")
                return True
            except ResizeInProgress as exc:
                if said is not Entry.ASK:
                    log.info("pserver index %d is beyond the job's %d pservers; asking for %d once this resize is done: %s", index, desired, index + 1, exc)
        elif said is not Entry.WAIT:
            log.warning(
                "pserver index %d was removed from job %r by resize %s; waiting until a resize wants it again "
                "(pdps scale --pservers %d), or until this pod is deleted (scale the StatefulSet down)",
                index, keys.job, latest.id if latest else "?", index + 1,
            )  # fmt: skip
        said = entry
        stop.wait(REREAD)
    return False


def run_pserver(values: Mapping[str, Any]) -> int:
    """Serve a slice of the parameters until SIGTERM. Exit code."""
    from pdps.adapters.prometheus_metrics import pserver_reading
    from pdps.registry import open_checkpoint_files, open_compute
    from pdps.roles.pserver import Pserver

    # its id is the index it claims; until then, the one it asks for
    metrics = role_metrics(values, "pserver", "unclaimed" if values.get("index") is None else str(values["index"]))
    store, config, st = _join(values, metrics)
    try:
        shutdown = Shutdown(values["grace"])
        if values.get("index") is not None and not make_room(st, config, values["index"], shutdown.requested):
            return 0
        ps = Pserver(
            st,
            metrics.transport(open_role_transport(values)),
            open_compute("torch"),
            config,
            address=serve_address(values),
            index=values.get("index"),
            claim_wait=3 * config.lease_ttl,  # a restarted pserver's old claim outlives it by a TTL at most
            checkpoints=open_checkpoint_files(config.checkpoint_url),
        )
        metrics.watch(pserver_reading(ps))
        with serving_metrics(values, metrics), _trimming(lambda: ps.row_bytes + ps.sent_bytes + ps.received_bytes, values["trim_every"]):
            ps.start()
            metrics.id = str(ps.index)
            print(json.dumps({"pserver": ps.index, "address": ps.address}), flush=True)
            while not shutdown.requested.wait(0.2):
                if ps.lease_lost:
                    log.error("pserver %s lost its lease; exiting so it can be restarted", ps.index)
                    ps.stop()
                    return EXIT_LOST
                if ps.departed.is_set():
                    print(json.dumps({"pserver": ps.index, "left": True}), flush=True)  # for pdps launch
                    break  # a resize let it go: its slots are elsewhere
            ps.stop()
            log.info("pserver %s stopped", ps.index)
            return 0
    finally:
        store.close()


@contextlib.contextmanager
def _trimming(moved: Callable[[], int], every: float) -> Iterator[None]:
    """A pserver process gives the memory its row traffic (``moved``, bytes) freed back
    to the system while it serves, looking every ``every`` seconds (0: never;
    :mod:`pdps.shell.allocator`)."""
    from pdps.shell.allocator import Trimmer

    if every <= 0:
        yield
        return
    running = Trimmer(moved, every=every, name="pdps-ps-trim").start()
    try:
        yield
    finally:
        running.stop()


def default_trainer_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


def run_trainer(values: Mapping[str, Any]) -> int:
    """Run the training function until the job is done (or SIGTERM). Exit code.

    The last line of stdout is a JSON object: the trainer's id, its counters, and
    what the function returned (when it is JSON-safe). A job that is done already is
    not trained: 0 at once, the function never called.
    """
    from pdps.adapters.prometheus_metrics import trainer_reading
    from pdps.registry import open_compute, open_data_source
    from pdps.roles.trainer import TrainerContext
    from pdps.roles.trainer.discovery import job_done

    if not values.get("target"):
        raise ConfigError("pdps trainer needs a training function: TARGET (module:function or file.py:function)")
    fn, _module = load_target(values["target"])
    trainer_id = values.get("trainer_id") or default_trainer_id()
    metrics = role_metrics(values, "trainer", trainer_id)
    store, config, st = _join(values, metrics)
    try:
        if job_done(st, Keys(config.name)):  # its pservers are gone: attach would wait for them in vain
            log.info("job %r is done: trainer %s has nothing to train", config.name, trainer_id)
            print(json.dumps({"trainer": trainer_id, "steps": 0, "tasks_done": 0, "stopped": False, "left": False, "result": None}), flush=True)
            return 0
        ctx = TrainerContext(
            st,
            metrics.transport(open_role_transport(values)),
            open_compute("torch"),
            open_data_source(config.dataset),
            config,
            trainer_id=trainer_id,
        )
        metrics.watch(trainer_reading(ctx))
        shutdown = Shutdown(values["grace"], on_request=ctx.request_stop)
        with serving_metrics(values, metrics):
            ctx.register()
            try:
                result = fn(ctx)
            except PdpsError:
                raise
            except Exception as exc:
                log.exception("trainer %s: the training function %s raised", ctx.trainer_id, values["target"])
                log.error("trainer %s: %s", ctx.trainer_id, function_error(values["target"], fn, exc))  # the last line, which pdps launch quotes
                return 1
            finally:
                ctx.leave()
        line = {"trainer": ctx.trainer_id, "steps": ctx.steps, "tasks_done": ctx.tasks_done, "stopped": shutdown.requested.is_set(), "left": ctx.left_by_resize}
        try:
            line["result"] = json.loads(json.dumps(result))
        except (TypeError, ValueError):
            line["result"] = repr(result)
        print(json.dumps(line), flush=True)
        return 0
    finally:
        store.close()
