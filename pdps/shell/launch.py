"""``pdps launch``: a whole job on one machine, each role its own process.

The launcher creates the job in the store (its configuration is what every role
reads), starts a master, the pservers and the trainers as ``python -m pdps ROLE``
processes, relays their logs to stderr prefixed with the role's name, shows
progress (a live table on a terminal, plain lines elsewhere: :mod:`pdps.shell.launch_view`),
gives each role its metrics port, restarts roles that die (``--restart on-failure``), follows
the job's desired counts while it runs (starts the pservers and trainers a resize adds;
those a resize removes leave by themselves, exit 0, and are not restarted), and when the
trainers are done pulls the final parameters, stops the remaining roles and
reports how the job ended. With ``--transport inproc`` the same job runs in this
one process (threads, as :func:`pdps.simulate`).

The target's module may define hooks the launcher uses:

* ``JOB_DEFAULTS``: job settings that replace the built-in defaults;
* ``dataset(root_url) -> url``: writes the training data under ``root_url`` when
  no ``dataset`` is configured;
* ``evaluate(params) -> dict``: held-out figures of the final parameters, merged
  into the summary (the digits example reports ``accuracy``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import IO, Any

import attrs

from pdps.core.errors import ConfigError, PdpsError
from pdps.core.headcount import Desired, free_indexes, leaves, to_start
from pdps.core.job import JobConfig, Keys
from pdps.roles.trainer.discovery import job_done
from pdps.runtime.resizing import read_desired
from pdps.shell.launch_view import LiveView, PlainView, RoleRow, Snapshot, open_view, rates

log = logging.getLogger(__name__)

#: Set in a role's environment by the launcher that owns it (see :func:`die_with_launcher`).
LAUNCHER_PID = "_PDPS_LAUNCHER_PID"

#: How often the launcher looks at its children and at the job.
POLL = 0.2
PROGRESS_EVERY = 1.0
#: How many of a role's last stderr lines its error quotes (a traceback's end).
LAST_LINES = 12


@attrs.define
class Role:
    """One role process the launcher owns."""

    name: str  # master, pserver-<n>, trainer-<n>: numbered in the order they were started
    kind: str  # master | pserver | trainer
    argv: list[str]
    index: int | None = None  # a pserver's fixed index
    proc: subprocess.Popen | None = None
    restarts: int = 0
    finished: bool = False  # exited 0 on its own (trainers: the job is done for them)
    left: bool = False  # exited 0 on its own before the job was done: a resize removed it
    said_left: bool = False  # it said so on stdout ({"left": true}) before exiting
    result: dict | None = None  # a trainer's last stdout line
    threads: list[threading.Thread] = attrs.field(factory=list)
    metrics_port: int | None = None  # what it is told to serve metrics on (None: none)
    metrics_url: str | None = None  # where it says it does
    last_lines: deque[str] = attrs.field(factory=lambda: deque(maxlen=LAST_LINES))  # of stderr, this run


def summary(result: Mapping[str, Any], evaluation: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The one-line JSON summary of ``pdps demo --json`` and ``pdps launch --json``; a
    streaming job's (``result`` has ``windows``) adds ``windows`` (closed) and ``records``
    (cut into tasks), its ``passes`` being 1."""
    out: dict[str, Any] = dict(evaluation or {})
    out.update(
        mode=result["mode"],
        trainers=result["trainers"],
        pservers=result["pservers"],
        passes=result["passes"],
        tasks_done=result["tasks_done"],
        tasks_failed=result["tasks_failed"],
        steps=result["steps"],
        seconds=round(result["seconds"], 3),
    )
    if "windows" in result:
        out.update(windows=result["windows"], records=result["records"])
    for metric in ("accuracy", "auc"):
        if metric in out:
            out[metric] = round(float(out[metric]), 6)
    return out


def describe(s: Mapping[str, Any]) -> str:
    acc = f"held-out accuracy {s['accuracy']:.4f} after " if "accuracy" in s else f"held-out AUC {s['auc']:.4f} after " if "auc" in s else "done after "
    trained = f"{s['windows']} windows ({s['records']} records)" if "windows" in s else f"{s['passes']} passes"
    return f"{acc}{trained}, {s['steps']} updates, {s['tasks_done']} tasks done, {s['tasks_failed']} failed, in {s['seconds']:.1f}s"


def prepare(values: dict[str, Any], module: ModuleType, workdir: Path) -> JobConfig:
    """Fill in the dataset from the module's hook if none is set; the job's config."""
    from pdps.shell.settings import job_config

    if not values.get("dataset"):
        hook = getattr(module, "dataset", None)
        if hook is None:
            raise ConfigError(f"no dataset: give --dataset URL, or define dataset(root_url) in {module.__name__}")
        values["dataset"] = str(hook(workdir.as_uri()))
    return job_config(values)


def check_inputs(values: Mapping[str, Any], config: JobConfig) -> None:
    """Refuse, before the job is created or any role started, what would otherwise fail
    only in the roles (each restarted until ``max_restarts`` is used up): a ``memory://``
    store that role processes cannot share, TLS files that cannot be read, a dataset the
    master cannot read, an optimizer the pservers do not know, a hook (``before_job``,
    ``evaluate``) that cannot be imported here, where the master will run."""
    from pdps.registry import open_compute, scheme_of
    from pdps.shell.hooks import user_function
    from pdps.shell.process import check_dataset, check_tls_files

    if values["transport"] != "inproc":
        if scheme_of(values["store"]) == "memory":
            raise ConfigError(
                f"store {values['store']} is in this process's memory, and pdps launch runs each role as a process of its "
                "own: give an etcd:// or redis:// store (or --transport inproc to run the whole job in this process)"
            )
        check_tls_files(values)
    check_dataset(config.dataset)
    open_compute("torch").check_optimizer(config.optimizer, config.optimizer_args)
    for hook in ("before_job", "evaluate"):
        if getattr(config, hook):
            user_function(getattr(config, hook), hook)


def open_job_store(values: Mapping[str, Any], keys: Keys) -> Any:
    """The job's store, connected, and checked to deliver watches (every role watches it;
    a Redis without expiry notifications is refused here, not in each role)."""
    from pdps.registry import connect_store

    store = connect_store(values["store"], timeout=values["connect_timeout"])
    try:
        store.watch(keys.root, lambda _event: None).cancel()
    except BaseException:
        store.close()
        raise
    return store


def die_with_launcher() -> None:
    """In a role the launcher started: get SIGTERM when the launcher dies, even by SIGKILL.

    Done by the child itself at startup (Linux ``PR_SET_PDEATHSIG``), not in a
    ``preexec_fn``: forking a process that runs gRPC's threads and then running Python
    before ``exec`` aborts the child.
    """
    parent = os.environ.get(LAUNCHER_PID)
    if not parent:
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: the launcher's own SIGTERM handler still stops its roles
    if os.getppid() != int(parent):
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher died before we asked


class Interrupted(PdpsError):
    """The launcher was asked to stop (SIGTERM); its roles are stopped on the way out."""


_stopped_by: list[str] = []  # the signal that asked the launcher to stop, once it came


def _on_sigterm(signum: int, _frame: object) -> None:
    # Raised wherever the main thread is; a handler there that catches PdpsError (a store
    # read retried, a progress line skipped) may swallow it, so the watch loop also checks
    # this record each turn (:func:`_check_stopped`).
    _stopped_by.append(signal.Signals(signum).name)
    _check_stopped()


def _check_stopped() -> None:
    if _stopped_by:
        raise Interrupted(f"launcher stopped by {_stopped_by[0]}")


def launch(values: dict[str, Any], *, out: IO[str] | None = None, err: IO[str] | None = None) -> int:
    """Run the job the settings describe; print the summary; the exit code. ``out`` and
    ``err``: where to print (default: ``sys.stdout`` and ``sys.stderr`` as they are at
    the call, so a caller that swaps them, as pytest's capture does, is followed)."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    from pdps.shell.process import load_target

    if threading.current_thread() is threading.main_thread():
        _stopped_by.clear()
        signal.signal(signal.SIGTERM, _on_sigterm)  # unwinds through the launcher's cleanup

    fn, module = load_target(values["target"])
    workdir = Path(tempfile.mkdtemp(prefix="pdps-launch-"))
    try:
        config = prepare(values, module, workdir)
        check_inputs(values, config)
        view = open_view(config, err)
        try:
            if values["transport"] == "inproc":
                result = _run_inproc(fn, values, config, view)
            else:
                result = Launcher(values, config, view).run()
        finally:
            view.close()
        evaluate = getattr(module, "evaluate", None)
        params = result.pop("params")
        evaluation = evaluate(params) if evaluate is not None else None
    except PdpsError as exc:
        if values.get("json"):
            print(json.dumps({"error": str(exc), "job": values["job"]}), file=out, flush=True)
        raise
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    s = summary(result, evaluation)
    restarts = f" ({result['restarts']} role restarts)" if result.get("restarts") else ""
    print(describe(s) + restarts, file=err, flush=True)
    if values.get("json"):
        print(json.dumps(s), file=out, flush=True)
    return 0


def _run_inproc(fn: Any, values: Mapping[str, Any], config: JobConfig, view: PlainView | LiveView) -> dict[str, Any]:
    """The job in this process (:func:`pdps.simulate`); it serves no metrics."""
    import pdps
    from pdps.shell.process import function_error

    keys = Keys(config.name)
    # opened here, not by simulate: a streaming job's windows are read from it as it runs and after
    store = open_job_store(values, keys)

    def show(p: Mapping[str, Any]) -> None:
        closed = stream_totals(store, keys).get("windows", 0)
        view.show(Snapshot(p["pass"], p["done"] + p["failed"], p["todo"] + p["pending"] + p["done"] + p["failed"], p.get("extra", ""), windows_closed=closed))

    fields = config.to_json()
    dataset = fields.pop("dataset")
    try:
        result = pdps.simulate(
            fn,
            dataset=dataset,
            store=store,
            transport="inproc",
            progress=show,
            timeout=values["timeout"],
            **fields,
        )
        streamed = stream_totals(store, keys)
    except PdpsError:
        raise
    except Exception as exc:
        # as with trainer processes: the traceback goes to the log, the job ends with an error naming it
        log.error("the training function %s raised", values["target"], exc_info=exc)
        raise PdpsError(function_error(values["target"], fn, exc)) from exc
    finally:
        if not values["store"].startswith("memory:"):  # a named memory store may be shared in this process; it holds no connection
            store.close()
    return {
        "params": result.params,
        "mode": config.mode.value,
        "trainers": config.trainers,
        "pservers": config.pservers,
        "passes": result.passes,
        "tasks_done": result.tasks_done,
        "tasks_failed": result.tasks_failed,
        "steps": result.steps,
        "seconds": result.seconds,
        **streamed,
    }


def stream_totals(store: Any, keys: Keys) -> dict[str, int]:
    """A streaming job's ``windows`` closed and ``records`` cut into tasks, for its
    summary; empty for a job with passes."""
    from pdps.shell.status import stream_status

    stream = stream_status(store, keys)
    return {} if stream is None else {"windows": stream["windows_closed"], "records": stream["records"]}


class Launcher:
    """Starts, watches and restarts the role processes of one job."""

    def __init__(self, values: Mapping[str, Any], config: JobConfig, view: PlainView | LiveView) -> None:
        from pdps.shell.settings import role_env

        self.values = values
        self.config = config
        self._view = view
        self._err_lock = threading.Lock()
        self._env = {k: v for k, v in os.environ.items() if not k.startswith("PDPS_")}
        self._env.update(role_env(values))
        self._env["PYTHONUNBUFFERED"] = "1"
        self._env[LAUNCHER_PID] = str(os.getpid())  # the roles stop if the launcher dies
        # Torch's intra-op threads spin while they wait: N+M processes each starting one
        # per core starve each other (measured: 2.4x slower on 2 cores). Share the cores
        # among the trainers, which compute forward and backward; a pserver's update is
        # one memory-bound pass and the master computes nothing: one thread each.
        self._threads: dict[str, str] = {}
        if "OMP_NUM_THREADS" not in self._env:
            cores = os.cpu_count() or 1
            self._threads = {"trainer": str(max(1, cores // config.trainers)), "pserver": "1", "master": "1"}
        self._roles: list[Role] = []
        self._keys = Keys(config.name)
        self.restarts = 0
        self._unfollowed = ""  # why the desired counts could not be read, last time

    # --- processes --------------------------------------------------------------------

    def _argv(self, kind: str, *extra: str) -> list[str]:
        return [sys.executable, "-m", "pdps", kind, *extra]

    def _role(self, kind: str, name: str, index: int | None = None) -> Role:
        """A pserver (with its fixed ``index``) or a trainer (its id is its name)."""
        if kind == "pserver":
            return Role(name, kind, self._argv("pserver", "--index", str(index)), index=index)
        return Role(name, kind, self._argv("trainer", "--trainer-id", name, self.values["target"]))

    def _start(self, role: Role) -> None:
        env = {**self._env, "PDPS_METRICS_PORT": "none" if role.metrics_port is None else str(role.metrics_port)}
        if role.kind in self._threads:
            env["OMP_NUM_THREADS"] = self._threads[role.kind]
        role.proc = subprocess.Popen(
            role.argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            start_new_session=True,  # a terminal's Ctrl-C reaches the launcher, which stops the roles in order
        )
        role.finished = False
        role.metrics_url = None
        role.last_lines.clear()
        role.threads = [
            threading.Thread(target=self._relay, args=(role, role.proc.stderr), daemon=True, name=f"relay-{role.name}"),
            threading.Thread(target=self._collect, args=(role, role.proc.stdout), daemon=True, name=f"collect-{role.name}"),
        ]
        for t in role.threads:
            t.start()
        log.info("started %s (pid %d)", role.name, role.proc.pid)

    def _relay(self, role: Role, stream: IO[str]) -> None:
        for line in stream:
            role.last_lines.append(line.rstrip("\n"))
            with self._err_lock:
                self._view.log(f"[{role.name}] {line.rstrip(chr(10))}")

    def _collect(self, role: Role, stream: IO[str]) -> None:
        for line in stream:
            line = line.strip()
            if line.startswith("{"):
                try:
                    said = json.loads(line)
                except ValueError:
                    continue
                if isinstance(said, dict) and "metrics" in said:
                    role.metrics_url = str(said["metrics"])
                    self._say(f"{role.name} serves metrics at {role.metrics_url}")
                else:
                    role.result = said
                    if isinstance(said, dict) and said.get("left") is True:
                        role.said_left = True  # a resize removed it: its exit 0 is no failure, however late it is seen

    def _say(self, text: str) -> None:
        with self._err_lock:
            self._view.log(f"[launch] {text}")

    def _stop_all(self, kinds: tuple[str, ...]) -> None:
        """SIGTERM the live roles of ``kinds``; SIGKILL what is left after the grace period."""
        live = [r for r in self._roles if r.kind in kinds and r.proc is not None and r.proc.poll() is None]
        for r in live:
            r.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        deadline = time.monotonic() + self.values["grace"] + 5
        for r in live:
            try:
                r.proc.wait(timeout=max(0.1, deadline - time.monotonic()))  # type: ignore[union-attr]
            except subprocess.TimeoutExpired:
                self._say(f"{r.name} ignored SIGTERM; killing it")
                r.proc.kill()  # type: ignore[union-attr]
                r.proc.wait()  # type: ignore[union-attr]
        for r in live:
            for t in r.threads:
                t.join(timeout=5)

    # --- the job ----------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        from pdps.roles.master import publish_job

        store = open_job_store(self.values, self._keys)
        try:
            if store.get(self._keys.config) is not None:
                raise ConfigError(f"job {self.config.name!r} already exists in {self.values['store']}; pick another --job")
            self._roles = self.plan()
            publish_job(store, self.config)
            start = time.monotonic()
            try:
                for role in self._roles:
                    self._start(role)
                self._watch(store, start)
                seconds = time.monotonic() - start
                return self._result(store, seconds)
            finally:
                self._stop_all(("trainer",))
                self._stop_all(("pserver", "master"))
        finally:
            store.close()

    def plan(self) -> list[Role]:
        """The roles to start, each with its metrics port: the master ``metrics_port``,
        pserver i +1+i, trainer i +1+pservers+i (0: each a free one; None: none)."""
        roles = [Role("master", "master", self._argv("master"))]
        roles += [self._role("pserver", f"pserver-{i}", i) for i in range(self.config.pservers)]
        roles += [self._role("trainer", f"trainer-{i}") for i in range(self.config.trainers)]
        base = self.values.get("metrics_port")
        if base is None:
            return roles
        if base + len(roles) - 1 > 65535:
            raise ConfigError(f"metrics_port {base} leaves no room for the job's {len(roles)} roles (up to port {base + len(roles) - 1}); pick at most {65536 - len(roles)}")
        for offset, role in enumerate(roles):
            role.metrics_port = base + offset if base else 0
        return roles

    def _snapshot(self, st: Mapping[str, Any], readings: dict[str, tuple[float, float]]) -> Snapshot:
        """The job's progress; on a live view also each role's state and each trainer's
        steps and samples/s, read from its metrics (``readings``: the last, kept across calls)."""
        done = st["done"] + st["failed"]
        closed = (st["stream"] or {}).get("windows_closed", 0)
        if not self._view.live:
            return Snapshot(st["pass"], done, st["tasks"], windows_closed=closed)
        now = time.monotonic()
        counts = {r.name: self._trainer_counts(r) for r in self._roles if r.kind == "trainer" and r.metrics_url}
        samples = {name: c["pdps_trainer_samples_total"] for name, c in counts.items() if c}
        per_second = rates(readings, now, samples)
        readings.update({name: (now, total) for name, total in samples.items()})
        rows = []
        for r in self._roles:
            c = counts.get(r.name)
            rows.append(RoleRow(r.name, self._state(r), r.restarts, None if not c else int(c["pdps_trainer_steps_total"]), per_second.get(r.name), r.metrics_url))
        total = sum(per_second.values()) if per_second else None
        return Snapshot(st["pass"], done, st["tasks"], roles=rows, samples_per_second=total, windows_closed=closed)

    @staticmethod
    def _trainer_counts(role: Role) -> dict[str, float] | None:
        import urllib.request

        from pdps.adapters.prometheus_metrics import scrape

        assert role.metrics_url is not None
        try:
            with urllib.request.urlopen(role.metrics_url, timeout=0.5) as reply:  # noqa: S310 - the role's own address
                return scrape(reply.read().decode(), ["pdps_trainer_samples_total", "pdps_trainer_steps_total"])
        except (OSError, ValueError):
            return None  # not up yet, or gone: its row shows no figures this time

    @staticmethod
    def _state(role: Role) -> str:
        if role.left:
            return "left (exited 0)"
        if role.finished:
            return "finished"
        code = None if role.proc is None else role.proc.poll()
        return "running" if code is None else f"exited {code}"

    def _watch(self, store: Any, start: float) -> None:
        readings: dict[str, tuple[float, float]] = {}
        last_progress = 0.0
        while True:
            _check_stopped()
            now = time.monotonic()
            if now - start > self.values["timeout"]:
                raise PdpsError(f"job {self.config.name!r} did not finish in {self.values['timeout']:.0f}s")
            desired = self._desired(store)
            for role in list(self._roles):
                code = role.proc.poll() if role.proc is not None else None
                if code is None or role.finished or role.left:
                    continue
                if code == 0:
                    if role.kind != "master":
                        for t in role.threads:
                            t.join(timeout=2.0)  # its last stdout line (said it left?) is read by then: the pipe closed with it
                    removed = role.kind != "master" and (
                        role.said_left or (desired is not None and leaves(desired.of(role.kind), self._taking_part(role.kind)))
                    )
                    if removed:
                        # a resize removed it: it handed its work on (not a failure, not the job's end)
                        role.left = True
                        self._say(f"{role.name} left the job (exited 0)")
                        continue
                    role.finished = True
                    if role.kind == "trainer":
                        log.info("%s finished", role.name)
                        continue
                    if role.kind == "master" and job_done(store, self._keys):
                        continue
                self._died(role, code)
            if desired is not None:
                self._follow(store, desired)
            trainers = [r for r in self._roles if r.kind == "trainer"]
            if all(r.finished or r.left for r in trainers):
                if job_done(store, self._keys):
                    self._show_progress(store, readings)  # the last line says where the job ended (window 2/2), however short it was
                    return
                raise PdpsError(f"every trainer of job {self.config.name!r} has exited, but the job is not done")
            if now - last_progress >= PROGRESS_EVERY:
                last_progress = now
                self._show_progress(store, readings)
            time.sleep(POLL)

    def _show_progress(self, store: Any, readings: dict[str, tuple[float, float]]) -> None:
        from pdps.shell.status import job_status

        try:
            self._view.show(self._snapshot(job_status(store, self.config.name), readings))
        except PdpsError as exc:
            log.debug("no progress this time: %s", exc)

    def _desired(self, store: Any) -> Desired | None:
        """The job's desired counts; None (warned once) while they cannot be read."""
        try:
            desired = read_desired(store, self._keys, self.config.trainers)
        except PdpsError as exc:  # a store outage, or a count someone wrote wrong: follow once it reads again
            if str(exc) != self._unfollowed:
                log.warning("cannot read the job's desired counts: %s", exc)
            self._unfollowed = str(exc)
            return None
        self._unfollowed = ""
        return desired

    def _taking_part(self, kind: str) -> int:
        return sum(1 for r in self._roles if r.kind == kind and not r.left)

    def _follow(self, store: Any, desired: Desired) -> None:
        """Start the pservers and trainers the job wants beyond those taking part
        (:func:`pdps.core.headcount.to_start`); none once the job is done. A new pserver
        takes the lowest index no pserver of this launcher holds; each new role gets the
        next metrics port after the roles before it."""
        for kind in ("pserver", "trainer"):
            want = desired.of(kind)
            mine = [r for r in self._roles if r.kind == kind]
            names = to_start(kind, want, len(mine), sum(r.left for r in mine))
            if not names or job_done(store, self._keys):
                continue
            indexes = free_indexes((r.index for r in mine if not r.left and r.index is not None), len(names)) if kind == "pserver" else [None] * len(names)
            for name, index in zip(names, indexes):
                role = self._role(kind, name, index)
                base = self.values.get("metrics_port")
                if base is not None:
                    role.metrics_port = base + len(self._roles) if base and base + len(self._roles) <= 65535 else 0
                self._roles.append(role)
                self._say(f"the job wants {want} {kind}s: starting {name}" + ("" if index is None else f" (index {index})"))
                self._start(role)

    def _died(self, role: Role, code: int) -> None:
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"
        cap = self.values["max_restarts"]
        if self.values["restart"] != "on-failure":
            raise PdpsError(f"{role.name} exited with {how}; not restarting it (--restart never){self._last_words(role)}")
        if role.restarts >= cap:
            # a deterministic bug fails every run: end the job rather than loop
            raise PdpsError(f"{role.name} exited with {how} after {role.restarts} restarts; giving up (max_restarts is {cap}){self._last_words(role)}")
        role.restarts += 1
        self.restarts += 1
        if role.kind == "trainer":
            # a new id: the dead trainer's lease may still be live until its TTL runs out
            base = role.name
            role.argv = self._argv("trainer", "--trainer-id", f"{base}-r{role.restarts}", self.values["target"])
        self._say(f"{role.name} exited with {how}; restarting it ({role.restarts}/{cap})")
        self._start(role)

    def _last_words(self, role: Role) -> str:
        """The end of a dead role's stderr (its traceback, when it raised), for its error."""
        for t in role.threads:
            t.join(timeout=5)  # the pipe may still hold what it wrote before it exited
        if not role.last_lines:
            return ""
        return "; its last lines:\n" + "\n".join(f"  {line}" for line in role.last_lines)

    def _result(self, store: Any, seconds: float) -> dict[str, Any]:
        from pdps.shell.process import open_role_transport
        from pdps.shell.sim import fetch_model, pass_totals

        transport = open_role_transport(self.values)
        params, steps = fetch_model(store, transport, self.config)
        done, failed = pass_totals(store, self.config)
        passes = len(store.range(self._keys.passes))
        return {
            "params": params,
            "mode": self.config.mode.value,
            "trainers": self.config.trainers,
            "pservers": self.config.pservers,
            "passes": passes,
            "tasks_done": done,
            "tasks_failed": failed,
            "steps": steps,
            "seconds": seconds,
            "restarts": self.restarts,
            **stream_totals(store, self._keys),
        }

