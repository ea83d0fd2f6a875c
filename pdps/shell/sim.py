"""``pdps.simulate``: a whole job — master, pservers, trainers — in one process.

The composition root for in-process jobs: it builds the roles from adapters
(``memory://`` store, ``inproc://`` transport and torch compute unless told
otherwise; over ``grpc://`` the master and pservers serve real gRPC on 127.0.0.1),
runs each trainer's training function on its own thread, follows the
job's desired counts (a resize that wants more trainers or pservers gets new threads
for them; those it removes end by themselves), and returns the final parameters
*pulled from the pservers* with the job's counters.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from pdps.core.errors import ConfigError, PdpsError, SlotMapChanged, Timeout
from pdps.core.headcount import Desired, leaves, to_start
from pdps.core.job import JobConfig, Keys, decode_as, decode_json, require_seconds, require_whole_number, shown
from pdps.core.lifecycle import HALTED
from pdps.core.tables import TableSpec
from pdps.core.slots import ParamSpec
from pdps.core.wire import PullRequest
from pdps.ports.compute import Compute
from pdps.ports.coordination import CoordinationStore
from pdps.ports.data import DataSource, StreamingSource
from pdps.ports.transport import Transport
from pdps.roles.master import Master
from pdps.roles.pserver import Pserver
from pdps.roles.trainer import Killed, StepRecord, TrainerContext
from pdps.roles.trainer.pserver_client import PserverGroup
from pdps.runtime.resizing import read_desired
from pdps.shell.faults import Faults, Injected, Injector
from pdps.shell.hooks import WindowHooks, run_before_job, user_function

log = logging.getLogger(__name__)

#: Seconds between progress reports.
PROGRESS_EVERY = 1.0
#: A replacement pserver waits this many lease TTLs for its predecessor's claim to run out.
CLAIM_WAIT_TTLS = 5

TrainFn = Callable[[TrainerContext], Any]
RoleAdapters = Callable[[str, CoordinationStore, Transport], tuple[CoordinationStore, Transport]]


@attrs.frozen
class SimulationResult:
    """How a simulated job ended."""

    params: dict[str, Any]  # name -> torch.Tensor pulled from the pservers; a sparse table's name -> pdps.nn.TableRows
    passes: int  # passes completed
    tasks_done: int  # task completions summed over passes
    tasks_failed: int  # tasks failed, summed over passes
    steps: int  # updates applied (sync: global steps; async: pushes applied), busiest pserver
    seconds: float  # wall time of training
    trainers: dict[str, Any]  # trainer id -> what its function returned (None if killed)
    killed: tuple[str, ...]
    config: JobConfig
    #: trainer id -> the steps of it that were applied, in order (``ctx.history``): which
    #: sync round each joined, which records of which task it trained, its sample weight
    history: dict[str, tuple[StepRecord, ...]] = attrs.field(factory=dict)
    #: pserver index -> the records it applied, as ``[task, attempt, start, end]`` rows
    applied: dict[int, list[list[int]]] = attrs.field(factory=dict)
    #: the faults ``faults=`` injected, in the order they struck
    faults: tuple[Injected, ...] = ()


def simulate(
    train: TrainFn,
    *,
    dataset: str | DataSource,
    kill: Mapping[int, int] | None = None,
    slow: Mapping[int, float] | None = None,
    store: str | CoordinationStore = "memory://",
    transport: str | Transport = "inproc://",
    compute: Compute | None = None,
    timeout: float = 600.0,
    progress: Callable[[dict[str, Any]], None] | None = None,
    faults: Faults | None = None,
    _role_adapters: RoleAdapters | None = None,
    **settings: Any,
) -> SimulationResult:
    """Run a whole job in this process and return its outcome.

    ``train`` is the training function every trainer runs (see :class:`TrainerContext`).
    ``settings`` are :class:`~pdps.core.job.JobConfig` fields (``trainers``,
    ``pservers``, ``mode``, ``optimizer``, ``optimizer_args``, ``batch_size``,
    ``passes``, ...). ``kill={i: k}`` crashes trainer ``i`` after ``k`` steps: it
    reports nothing, its lease runs out (``lease_ttl``), the master re-queues its
    tasks as failures and the remaining trainers finish the job. ``slow={i: f}`` makes
    trainer ``i`` a straggler: each of its steps takes ``f`` times as long (it sleeps
    the difference), for trying ``speculation``.
    ``faults`` (:class:`~pdps.shell.faults.Faults`) kills trainers, pservers and the
    master mid-pass at seeded moments; ``SimulationResult.faults`` says what struck when.
    ``progress`` is called about once a second with the current pass's queue counts
    and each trainer's ``ctx.metrics``, and once more when the trainers are done.
    Hooks (docs/online.md): ``before_job`` and ``evaluate`` may be given as functions
    here, or as ``"module:function"`` settings; ``export_url`` exports the model after
    windows of a streaming job, and the last export is whole before ``simulate`` returns.
    ``_role_adapters`` (private, for :func:`pdps.simulate_control_plane`) gives each role
    ``("master"``, ``"pserver"``, ``"trainer")`` the store and transport it is built on,
    from the job's shared ones: per-role counting wraps them.
    """
    from pdps.registry import connect_store, open_checkpoint_files, open_compute, open_data_source, open_transport
    from pdps.runtime.resilient import ResilientStore

    _check_arguments(train, dataset, kill, store, transport, compute, timeout, progress, faults)
    hook_fns = {name: settings.pop(name) for name in ("before_job", "evaluate") if callable(settings.get(name))}
    settings.setdefault("name", f"sim-{uuid.uuid4().hex[:8]}")
    settings.setdefault("lease_ttl", 2.0)
    config = JobConfig(dataset=dataset if isinstance(dataset, str) else dataset.url, **settings)
    kill = dict(kill or {})
    bad = [i for i in kill if not 0 <= i < config.trainers]
    if bad:
        raise ConfigError(f"kill names trainers {bad}, but the job has trainers 0..{config.trainers - 1}")
    faults = faults or Faults()
    plan = faults.plan(config)
    source = open_data_source(dataset) if isinstance(dataset, str) else dataset
    if "evaluate" in hook_fns and not isinstance(source, StreamingSource):
        raise ConfigError(f"evaluate runs after each window of a streaming job, but {config.dataset!r} is a finite dataset (trained in passes)")
    if isinstance(source, StreamingSource) and not config.windows:
        raise ConfigError(f"simulate runs a job to its end, and a job reading the stream {config.dataset!r} ends after `windows` windows: give windows=N")
    if compute is None:
        compute = open_compute("torch")
    compute.check_optimizer(config.optimizer, config.optimizer_args)  # refuse a bad rule before anything starts
    tr = open_transport(transport) if isinstance(transport, str) else transport
    # the master and each pserver serve there (over gRPC: each on a free port of 127.0.0.1)
    address = serve_address(transport, tr, roles=1 + config.pservers, what="simulate")
    st = connect_store(store) if isinstance(store, str) else store
    # a store opened from a URL is closed at the end (its connections, its threads), except a
    # named memory store, which others in this process may share
    own_store = isinstance(store, str) and not (store.startswith("memory://") and store.rstrip("/") != "memory:")

    if st.get(Keys(config.name).config) is not None:
        if own_store:
            st.close()
        raise ConfigError(f"job {config.name!r} already exists in {st.url}; simulate runs a new job: pick another name or store")
    st = ResilientStore(st, deadline=config.store_outage_deadline)  # roles ride out outages up to the deadline
    adapters = _role_adapters or (lambda role, store, transport: (store, transport))

    before = hook_fns.get("before_job") or (user_function(config.before_job, "before_job") if config.before_job else None)
    evaluate = hook_fns.get("evaluate") or (user_function(config.evaluate, "evaluate") if config.evaluate else None)
    hooks = WindowHooks(st, tr, config, evaluate) if config.export_url or evaluate else None

    def new_master(via: CoordinationStore) -> Master:
        return Master(
            *adapters("master", via, tr), source, config, address=address, checkpoints=open_checkpoint_files(config.checkpoint_url),
            on_window=hooks, before_job=None if before is None else lambda: run_before_job(via, config, before),
        )  # fmt: skip

    def new_pserver(index: int | None) -> Pserver:
        # a replacement at a killed one's index waits for the old claim to run out with its lease
        wait = 0.0 if index is None else CLAIM_WAIT_TTLS * config.lease_ttl
        return Pserver(
            *adapters("pserver", st, tr), compute, config, index=index, address=address, claim_wait=wait, checkpoints=open_checkpoint_files(config.checkpoint_url)
        )

    def new_trainer(trainer_id: str) -> TrainerContext:
        # trainer-0's model is the job's: the others attach after it, so a trainer with another
        # model is refused the same way in every run
        return TrainerContext(*adapters("trainer", st, tr), compute, source, config, trainer_id=trainer_id, publisher="trainer-0")

    contexts = [new_trainer(f"trainer-{i}") for i in range(config.trainers)]
    results: dict[str, Any] = {}
    errors: list[tuple[str, BaseException]] = []  # in the order they happened
    killed: list[str] = []
    roles = Injector(plan, faults.pass_no, st, contexts, new_master, new_pserver, config.pservers)
    follow = _Follower(st, config)
    try:
        roles.master.start()
        for ps in roles.pservers:
            ps.start()
        # Register every trainer before any trains, so the first sync round waits for all.
        for ctx in contexts:
            ctx.register()
        for i, steps in kill.items():
            contexts[i].kill_after(steps)
        for i, factor in (slow or {}).items():
            if not (isinstance(i, int) and 0 <= i < config.trainers):
                raise ConfigError(f"slow names trainer {i!r}, but the job has trainers 0..{config.trainers - 1}")
            contexts[i].slow_down(factor)
        if roles.pending:
            roles.time_the_looks()

        def run(ctx: TrainerContext) -> None:
            try:
                results[ctx.trainer_id] = train(ctx)
                ctx.leave()
            except Killed:
                killed.append(ctx.trainer_id)
                ctx.leave(crashed=True)
            except BaseException as exc:  # the job is lost: stop it now, not after every pass
                errors.append((ctx.trainer_id, exc))
                for other in contexts:
                    other.request_stop()
                ctx.leave()  # a sync round stops waiting for this trainer

        def report(c: Any) -> None:
            assert progress is not None
            metrics = {ctx.trainer_id: dict(ctx.metrics) for ctx in contexts}
            progress({"pass": c.pass_no, "todo": c.todo, "pending": c.pending, "done": c.done, "failed": c.failed, "metrics": metrics})

        start = time.monotonic()
        threads = [threading.Thread(target=run, args=(c,), name=c.trainer_id, daemon=True) for c in contexts]
        for t in threads:
            t.start()
        left: set[str] = set()  # trainers a resize removed, which returned by themselves
        deadline, next_progress = start + timeout, start + PROGRESS_EVERY
        while alive := [t for t in threads if t.is_alive()]:
            if time.monotonic() > deadline:
                raise Timeout(f"simulated job {config.name!r} did not finish in {timeout:.0f}s; queue: {roles.counts() or 'a standby master taking over'}")
            alive[0].join(timeout=roles.poll if roles.pending else PROGRESS_EVERY)
            for error in (roles.master.error, roles.error):
                if error is not None:
                    raise error
            desired = follow.desired()
            for t in threads:
                if not t.is_alive() and t.name not in left and t.name not in killed and leaves(desired.trainers, len(threads) - len(left)):
                    left.add(t.name)
            for name in () if roles.master.done.is_set() else to_start("trainer", desired.trainers, len(threads), len(left)):
                log.info("simulate starts %s: the job wants %d trainers", name, desired.trainers)
                ctx = new_trainer(name)
                contexts.append(ctx)
                ctx.register()
                threads.append(threading.Thread(target=run, args=(ctx,), name=name, daemon=True))
                threads[-1].start()
            halted = sum(ps.state in HALTED for ps in roles.pservers)
            for _ in () if roles.master.done.is_set() else to_start("pserver", desired.pservers, len(roles.pservers), halted):
                roles.add_pserver()
            now = time.monotonic()
            due = progress is not None and now >= next_progress
            if not (roles.pending or due) or (c := roles.counts()) is None:
                continue
            roles.strike(c, now - start)
            if due:
                next_progress = now + PROGRESS_EVERY
                report(c)
        seconds = time.monotonic() - start
        if progress is not None and (c := roles.counts()) is not None:
            report(c)  # the last word, however short the job
        if errors:
            # the first to fail is the cause; the others' errors, if any, may be its echo
            tid, exc = errors[0]
            note = f"raised in {tid} of simulated job {config.name!r}; simulate stopped the job"
            if hasattr(exc, "add_note"):  # Python 3.11+
                exc.add_note(note)
            else:
                log.error("%s: %r", note, exc)
            raise exc
        master, pservers = roles.master, roles.pservers
        if not master.done.is_set():
            raise PdpsError(f"all trainers returned but job {config.name!r} is not done: {roles.counts() or 'no master serves'}")
        if hooks is not None:
            hooks.close()  # the last window's export is whole before the job's outcome is told
        params = fetch_parameters(st, tr, config)
        done, failed = pass_totals(st, config)
        return SimulationResult(
            params=params,
            passes=master.passes_completed,
            tasks_done=done,
            tasks_failed=failed,
            steps=max(ps.steps for ps in pservers),
            seconds=seconds,
            trainers={ctx.trainer_id: results.get(ctx.trainer_id) for ctx in contexts},  # a killed one's: None
            killed=tuple(sorted(killed)),
            config=config,
            history={ctx.trainer_id: tuple(ctx.history) for ctx in contexts},
            applied={ps.index: ps.applied() for ps in pservers},
            faults=tuple(roles.struck),
        )
    finally:
        if hooks is not None:
            hooks.close()
        for ctx in contexts:
            if ctx.trainer_id not in killed:
                ctx.leave()
        follow.close()
        roles.stop(timeout=CLAIM_WAIT_TTLS * config.lease_ttl)
        if own_store:
            st.close()


class _Follower:
    """The job's desired counts for :func:`simulate`'s driver loop: read again only after
    a watch saw them change (a resize), so a job nobody resizes reads them once."""

    def __init__(self, store: CoordinationStore, config: JobConfig) -> None:
        self._store, self._config, self._keys = store, config, Keys(config.name)
        self._changed = threading.Event()
        self._changed.set()
        self._watches = [store.watch(key, lambda _event: self._changed.set()) for key in (self._keys.ps_desired, self._keys.trainers_desired)]
        self._desired = Desired(config.pservers, config.trainers)

    def desired(self) -> Desired:
        if self._changed.is_set():
            self._changed.clear()
            self._desired = read_desired(self._store, self._keys, self._config.trainers)
        return self._desired

    def close(self) -> None:
        for watch in self._watches:
            watch.cancel()


def _check_arguments(
    train: Any, dataset: Any, kill: Any, store: Any, transport: Any, compute: Any, timeout: Any, progress: Any, faults: Any
) -> None:
    """ConfigError, naming the argument and its value, for an argument of :func:`simulate`
    that cannot work (the settings are JobConfig's to check)."""
    kinds = [
        ("train", train, callable(train), "a callable (the training function)"),
        ("dataset", dataset, isinstance(dataset, (str, DataSource)), "a URL (str) or a DataSource"),
        ("store", store, isinstance(store, (str, CoordinationStore)), "a URL (str) or a CoordinationStore"),
        ("transport", transport, isinstance(transport, (str, Transport)), "a URL (str) or a Transport"),
        ("compute", compute, compute is None or isinstance(compute, Compute), "a Compute or None"),
        ("progress", progress, progress is None or callable(progress), "a callable or None"),
        ("kill", kill, kill is None or isinstance(kill, Mapping), "a dict of trainer index -> steps"),
        ("faults", faults, faults is None or isinstance(faults, Faults), "a pdps.Faults or None"),
    ]
    for name, value, ok, what in kinds:
        if not ok:
            raise ConfigError(f"{name} must be {what}, got {shown(value)}")
    for index, steps in (kill or {}).items():
        if isinstance(index, bool) or not isinstance(index, int):
            raise ConfigError(f"kill must be a dict of trainer index -> steps: trainer index {shown(index)} is not a whole number")
        require_whole_number(f"kill[{index}]", steps, 0)
    require_seconds("timeout", timeout)


def serve_address(transport: str | Transport, opened: Transport, *, roles: int, what: str) -> str:
    """Where ``roles`` roles of a job run in this process serve on ``opened``, the
    transport the ``transport`` argument names (a URL) or is (an adapter).

    ``inproc://`` in process. Over gRPC, 127.0.0.1, or the host the URL names
    (``grpc://`` or ``grpc``; ``grpc://HOST``), at port 0: each role binds a free port
    and publishes it in the store. A URL naming a port other than 0 is refused unless
    one role serves (two cannot bind one port). Another adapter serves at ``<its
    scheme>://``: an empty name, which the transport port says picks a free one."""
    import urllib.parse

    scheme = getattr(opened, "scheme", None)
    if not isinstance(scheme, str) or not scheme:
        raise ConfigError(f"{what}: transport {shown(transport)} has no scheme (the Transport port's `scheme`), so no address to serve at")
    if scheme != "grpc":
        return f"{scheme}://"
    rest = transport.split("://", 1)[1].strip("/") if isinstance(transport, str) and "://" in transport else ""
    try:
        parts = urllib.parse.urlsplit("//" + rest)
        host, port = parts.hostname or "127.0.0.1", parts.port or 0
    except ValueError as exc:
        raise ConfigError(f"{what}: transport {transport!r} is no grpc://HOST[:PORT] URL: {exc}") from exc
    if port and roles > 1:
        raise ConfigError(
            f"{what}: transport {transport!r} names port {port}, but {roles} roles serve in this process, each on a port of its own: "
            f"give grpc://{host} (each role binds a free port)"
        )
    return f"grpc://[{host}]:{port}" if ":" in host else f"grpc://{host}:{port}"


def fetch_parameters(store: CoordinationStore, transport: Transport, config: JobConfig) -> dict[str, Any]:
    """The model's current parameters, pulled from the pservers, as ``name -> tensor``;
    each sparse table (:mod:`pdps.nn`) as ``name -> pdps.nn.TableRows``, every row it has."""
    return fetch_model(store, transport, config)[0]


def fetch_model(store: CoordinationStore, transport: Transport, config: JobConfig) -> tuple[dict[str, Any], int]:
    """The model's current parameters and the updates applied by the busiest pserver.
    A resize or a failover that moves slots while they are read (a replenish still
    running when the job finishes, say) starts the read again on the new slot map."""
    for attempt in range(1, FETCH_ATTEMPTS + 1):
        try:
            return _fetch_model_once(store, transport, config)
        except SlotMapChanged as exc:
            if attempt == FETCH_ATTEMPTS:
                raise SlotMapChanged(
                    f"job {config.name!r}: the slot map changed under each of {FETCH_ATTEMPTS} reads of the model; the last: {exc}",
                    sent=exc.sent, current=exc.current,
                ) from exc
            log.info("the slot map changed while the model was read (%s); reading it again", exc)
    raise AssertionError("unreachable")


#: reads of the model :func:`fetch_model` starts over when a resize moves slots under it
FETCH_ATTEMPTS = 10


def _fetch_model_once(store: CoordinationStore, transport: Transport, config: JobConfig) -> tuple[dict[str, Any], int]:
    import torch

    keys = Keys(config.name)
    kv = store.get(keys.model)
    if kv is None:
        raise PdpsError(f"job {config.name!r} has no model: no trainer attached one")
    specs = decode_as(kv.value, kv.key, lambda ds: [ParamSpec.from_json(d) for d in ds])
    tables_kv = store.get(keys.model_tables)
    tables = [] if tables_kv is None else decode_as(tables_kv.value, tables_kv.key, lambda ds: [TableSpec.from_json(d) for d in ds])
    group = PserverGroup(store, transport, config, specs, tables=bool(tables))
    # Parameters share one dtype (the replica's flat buffer requires it), so the model is
    # one flat buffer here too and each block lands at its own offset in it.
    flat = torch.empty(sum(s.numel for s in specs), dtype=getattr(torch, specs[0].dtype))
    steps = 0
    try:
        for part in group.parts:
            reply = group.ask(part, PullRequest("fetch", version=group.layout.slot_map.version))
            steps = max(steps, reply.updates)
            for block, tensor in zip(part.blocks, reply.tensors):
                flat[block.offset : block.offset + block.numel].copy_(tensor.reshape(-1))
        rows = {spec.name: _fetch_rows(group, spec) for spec in tables}
    finally:
        group.close()
    params, offset = {}, 0
    for s in specs:
        params[s.name] = flat[offset : offset + s.numel].view(s.shape)
        offset += s.numel
    params.update(rows)
    return params, steps


#: rows per page of a table fetched after a job
FETCH_PAGE_ROWS = 65536


def _fetch_rows(group: PserverGroup, spec: TableSpec) -> Any:
    """Every row of ``spec``'s table, paged from the primary of each slot, as a
    :class:`pdps.nn.TableRows` (ids ascending)."""
    import torch

    from pdps.nn import TableRows

    slot_map = group.layout.slot_map
    ids, values = [], []
    for part in group.parts:
        for slot in (s for s, owner in enumerate(slot_map.owners) if owner == part.index):
            offset = 0
            while True:
                reply = group.ask(part, PullRequest("fetch", version=slot_map.version, dump=(spec.name, slot, offset, FETCH_PAGE_ROWS)))
                if reply.tensors:
                    ids.append(reply.ids)
                    values.append(reply.values)
                    offset += int(reply.ids.numel())
                if not reply.more:
                    break
    dtype = getattr(torch, spec.dtype)
    if not ids:
        return TableRows(spec, torch.empty(0, dtype=torch.int64), torch.empty((0, spec.dim), dtype=dtype))
    all_ids, all_values = torch.cat(ids), torch.cat(values)
    order = torch.argsort(all_ids)
    return TableRows(spec, all_ids[order], all_values[order])


def pass_totals(store: CoordinationStore, config: JobConfig) -> tuple[int, int]:
    """Task completions and failures summed over the job's finished passes."""
    done = failed = 0
    for kv in store.range(Keys(config.name).passes):
        summary = decode_json(kv.value, kv.key)
        done += int(summary["done"])
        failed += len(summary["failed"])
    return done, failed
