"""Prometheus metrics of one role: what it counts already, read when it is scraped.

A :class:`RoleMetrics` holds one role's own ``CollectorRegistry`` (never the global
one: ``pdps.simulate`` runs every role in one process) and labels each sample with
``job``, ``role`` and ``id``. It measures the two boundaries a role talks through by
wrapping them, so the roles call nothing to be measured:

* :meth:`RoleMetrics.transport` times every call, client side (a trainer's ``push``
  and ``pull``) and served side (a pserver's handlers), and adds up tensor bytes;
* :meth:`RoleMetrics.store` counts the store errors the role meets, retried or not.

:meth:`RoleMetrics.watch` reads the role's own counters (a trainer's steps, samples
and timings, a pserver's updates and checkpoint writes, the master's queue) at each
scrape. :func:`serve` exposes the registry over HTTP at ``/metrics``.
docs/operations.md ("Metrics") lists every metric.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily

from pdps.adapters.inproc import tensor_bytes
from pdps.core.errors import ConfigError, PdpsError, StoreError

log = logging.getLogger(__name__)

LABELS = ("job", "role", "id")
#: From a call within one machine (sub-millisecond) to a sync pull held at the barrier.
CALL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RoleMetrics:
    """One role's metrics. ``id`` may be set later (a pserver learns its index when it
    claims one); samples taken from then on carry it."""

    def __init__(self, job: str, role: str, id: str) -> None:
        self.job, self.role, self.id = job, role, id
        self.registry = CollectorRegistry()
        r = self.registry
        call = (*LABELS, "side", "method")
        self._seconds = Histogram("pdps_rpc_seconds", "Seconds per call, by side (client, server) and method", call, registry=r, buckets=CALL_BUCKETS)
        self._sent = Counter("pdps_rpc_sent_bytes", "Tensor bytes sent: by a client in requests, by a server in replies", call, registry=r)
        self._received = Counter("pdps_rpc_received_bytes", "Tensor bytes received: by a client in replies, by a server in requests", call, registry=r)
        self._call_errors = Counter("pdps_rpc_errors", "Calls that raised, by error class", (*call, "error"), registry=r)
        self._store_errors = Counter("pdps_store_errors", "Store calls that raised a StoreError (StoreUnavailable: the store was unreachable), retried ones included", (*LABELS, "error"), registry=r)

    def labels(self) -> tuple[str, str, str]:
        return self.job, self.role, self.id

    def transport(self, inner: Any) -> MeteredTransport:
        return MeteredTransport(inner, self)

    def store(self, inner: Any) -> CountedStore:
        return CountedStore(inner, self)

    def watch(self, read: Callable[[], Mapping[str, Any]]) -> None:
        """Read the role's counters at every scrape: ``read`` returns what
        :func:`trainer_reading`, :func:`pserver_reading` or :func:`master_reading` do."""
        self.registry.register(_Reading(self, read))

    def _call(self, side: str, method: str, seconds: float, sent: int, received: int, error: BaseException | None) -> None:
        labels = (*self.labels(), side, method)
        self._seconds.labels(*labels).observe(seconds)
        if sent:
            self._sent.labels(*labels).inc(sent)
        if received:
            self._received.labels(*labels).inc(received)
        if error is not None:
            self._call_errors.labels(*labels, type(error).__name__).inc()

    def _store_error(self, error: StoreError) -> None:
        self._store_errors.labels(*self.labels(), type(error).__name__).inc()


# --- the boundaries, measured ----------------------------------------------------------


class _Wrapper:
    """Stands in for ``inner``: every public attribute of it that the wrapper does not
    define is the wrapper's own too, ``wrap``-ped if it is callable. Copied into the
    instance, so a runtime-checkable Protocol's ``isinstance`` (which looks attributes up
    statically from Python 3.12) sees the inner's capabilities (``concurrent``, ``stats``)."""

    def __init__(self, inner: Any, metrics: RoleMetrics) -> None:
        self._inner = inner
        self._metrics = metrics
        for name in dir(inner):
            # a property may change (a store's ``closed``): __getattr__ reads it each time
            if not name.startswith("_") and not hasattr(type(self), name) and not isinstance(inspect.getattr_static(inner, name), property):
                value = getattr(inner, name)
                setattr(self, name, self._wrap(value) if callable(value) else value)

    def _wrap(self, method: Callable[..., Any]) -> Callable[..., Any]:
        return method

    def __getattr__(self, name: str) -> Any:  # what the inner gained after wrapping
        return getattr(self._inner, name)


class MeteredChannel(_Wrapper):
    """A channel whose calls are timed and weighed."""

    def call(self, method: str, request: Any, **options: Any) -> Any:
        began = time.perf_counter()
        reply = error = None
        try:
            reply = self._inner.call(method, request, **options)
            return reply
        except BaseException as exc:
            error = exc
            raise
        finally:
            received = 0 if reply is None else tensor_bytes(reply.tensors)
            self._metrics._call("client", method, time.perf_counter() - began, tensor_bytes(request.tensors), received, error)


class MeteredTransport(_Wrapper):
    """A transport whose channels and served handlers are measured (see the module)."""

    def serve(self, address: str, handlers: Mapping[str, Callable[[Any], Any]], **options: Any) -> Any:
        return self._inner.serve(address, {method: self._served(method, h) for method, h in handlers.items()}, **options)

    def connect(self, address: str, **options: Any) -> MeteredChannel:
        return MeteredChannel(self._inner.connect(address, **options), self._metrics)

    def _served(self, method: str, handler: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def measured(request: Any) -> Any:
            began = time.perf_counter()
            reply = error = None
            try:
                reply = handler(request)
                return reply
            except BaseException as exc:
                error = exc
                raise
            finally:
                sent = 0 if reply is None else tensor_bytes(getattr(reply, "tensors", ()))
                self._metrics._call("server", method, time.perf_counter() - began, sent, tensor_bytes(request.tensors), error)

        return measured


class CountedStore(_Wrapper):
    """A coordination store that counts the :class:`StoreError` its calls raise.

    Wrap the adapter's store beneath the retrying one, so an outage counts once per
    failed try: the rate says how hard the role is hitting a store that does not answer.
    """

    def _wrap(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs)
            except StoreError as exc:
                self._metrics._store_error(exc)
                raise

        return counted


# --- what the roles count, read at scrape time -----------------------------------------


def trainer_reading(ctx: Any) -> Callable[[], dict[str, Any]]:
    """The counters of a :class:`~pdps.roles.trainer.TrainerContext`."""

    def read() -> dict[str, Any]:
        return {
            "trainer_steps": ctx.steps,
            "trainer_samples": ctx.samples,
            "trainer_tasks_done": ctx.tasks_done,
            "trainer_pushes": ctx.pushes,
            "trainer_stale_pushes": ctx.stale_pushes,
            "trainer_rollbacks": ctx.rollbacks,
            "trainer_seconds": ctx.timings,
        }

    return read


def pserver_reading(ps: Any) -> Callable[[], dict[str, Any]]:
    """The counters of a :class:`~pdps.roles.pserver.Pserver`."""

    def read() -> dict[str, Any]:
        return {
            "pserver_updates": ps.steps,
            "pserver_round": ps.round_no,
            "pserver_epoch": ps.epoch,
            "pserver_rollbacks": ps.rollbacks,
            "checkpoint_write_seconds": (ps.checkpoint_parts, ps.checkpoint_seconds),
        }

    return read


def master_reading(master: Any) -> Callable[[], dict[str, Any]]:
    """The queue of a :class:`~pdps.roles.master.Master` (a standby has none)."""

    def read() -> dict[str, Any]:
        out: dict[str, Any] = {"master_leading": int(master.leading.is_set()), "master_passes_completed": master.passes_completed}
        if master.leading.is_set():
            c = master.counts()
            out["master_pass"] = c.pass_no
            out["master_tasks"] = {"todo": c.todo, "pending": c.pending, "done": c.done, "failed": c.failed}
        return out

    return read


#: name (less ``pdps_``) -> (kind, help, the label of a mapping's keys)
FAMILIES: dict[str, tuple[str, str, str | None]] = {
    "trainer_steps": ("counter", "Mini-batches this trainer stepped", None),
    "trainer_samples": ("counter", "Samples this trainer stepped (rate() is samples/s)", None),
    "trainer_tasks_done": ("counter", "Tasks this trainer finished", None),
    "trainer_pushes": ("counter", "Pushes of gradients to the pservers", None),
    "trainer_stale_pushes": ("counter", "Async pushes dropped as too stale", None),
    "trainer_rollbacks": ("counter", "Rollbacks of the job this trainer followed", None),
    "trainer_seconds": ("counter", "Seconds this trainer spent, by kind (barrier: sync rounds' commits and waits)", "kind"),
    "pserver_updates": ("counter", "Updates this pserver applied (sync: rounds; async: pushes); goes back with a rollback", None),
    "pserver_round": ("gauge", "The sync round this pserver has open", None),
    "pserver_epoch": ("gauge", "The job's epoch (rollbacks so far) this pserver serves", None),
    "pserver_rollbacks": ("counter", "Rollbacks this pserver went through", None),
    "checkpoint_write_seconds": ("summary", "Seconds writing this pserver's part of a checkpoint", None),
    "master_leading": ("gauge", "1 while this master holds the lock and serves, 0 on a standby", None),
    "master_pass": ("gauge", "The pass the master is serving (0 is the first)", None),
    "master_tasks": ("gauge", "Tasks of the current pass, by state", "state"),
    "master_passes_completed": ("counter", "Passes the job has completed", None),
}


@attrs.define(eq=False)  # the registry keys its collectors by identity
class _Reading:
    """A collector over one role's counters: each scrape reads them afresh."""

    _metrics: RoleMetrics
    _read: Callable[[], Mapping[str, Any]]

    def collect(self) -> Iterator[Metric]:
        names = list(LABELS)
        labels = list(self._metrics.labels())
        try:
            values = self._read()
        except PdpsError as exc:  # a role between states: this scrape shows the boundaries only
            log.debug("metrics: could not read %s %s: %s", self._metrics.role, self._metrics.id, exc)
            return
        for name, value in values.items():
            kind, doc, key = FAMILIES[name]
            full = f"pdps_{name}"
            if kind == "summary":
                count, total = value
                family: Metric = SummaryMetricFamily(full, doc, labels=names)
                family.add_metric(labels, count_value=count, sum_value=total)
            elif key is None:
                family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(full, doc, labels=names)
                family.add_metric(labels, float(value))
            else:
                family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(full, doc, labels=[*names, key])
                for k, v in value.items():
                    family.add_metric([*labels, k], float(v))
            yield family


# --- serving ------------------------------------------------------------------------


@attrs.define
class MetricsServer:
    """The HTTP server of one registry; ``url`` is where Prometheus scrapes it."""

    url: str
    _httpd: Any

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def serve(metrics: RoleMetrics, host: str, port: int) -> MetricsServer:
    """Serve ``metrics`` at ``http://host:port/metrics`` (port 0: a free one) on a thread."""
    try:
        httpd, _thread = start_http_server(port, addr=host, registry=metrics.registry)
    except OSError as exc:
        raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}; set metrics_port to a free port, or 0 for any") from exc
    shown = f"[{host}]" if ":" in host else host
    return MetricsServer(f"http://{shown}:{httpd.server_port}/metrics", httpd)


def scrape(text: str, names: Sequence[str]) -> dict[str, float]:
    """Sum each named sample over its label sets, from an exposition ``text``."""
    from prometheus_client.parser import text_string_to_metric_families

    out = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in out:
                out[sample.name] += sample.value
    return out
