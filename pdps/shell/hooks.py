"""A job's hooks: the user's function run once before the first task, and the work
after each window of a streaming job (an export of the model for serving, the user's
evaluation of it). They run where the master runs, on the master's side of the job.

Post-window work runs on its own thread, off the master's lock: a window closed while
the work of an earlier one still runs waits, and when several wait only the newest is
done (the model has moved on; an export of an older window would be older than the
parameters it holds). Each run pulls the parameters once, then exports and evaluates
that one copy, so the export and the metric describe the same model.
"""

from __future__ import annotations

import json
import logging
import numbers
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from pdps.core.errors import ConfigError
from pdps.core.job import JobConfig, Keys
from pdps.core.windows import Window
from pdps.ports.coordination import Compare, CoordinationStore, Put
from pdps.ports.transport import Transport

log = logging.getLogger(__name__)

Evaluate = Callable[[dict[str, Any]], Any]


def user_function(spec: str, what: str) -> Callable[..., Any]:
    """The function ``spec`` names (``module:function`` or ``path/to/file.py:function``)."""
    from pdps.shell.process import load_target

    return load_target(spec, what)[0]


def run_before_job(store: CoordinationStore, config: JobConfig, before: Callable[[], Any] | None) -> None:
    """Run the before-job function unless the job ran it already; record that it ran.

    Run by the master that leads before it serves the first task. A master that dies
    while it runs leaves no record, so the next one runs it again: write it to be
    repeatable (create a table if it is missing, not "create a table")."""
    if before is None:
        return
    keys = Keys(config.name)
    if store.get(keys.before_hook) is not None:
        return
    log.info("running the before-job function of job %r", config.name)
    started = time.time()
    before()
    record = {"at": time.time(), "seconds": round(time.time() - started, 3)}
    store.commit((Compare.absent(keys.before_hook),), (Put(keys.before_hook, json.dumps(record).encode()),))


class WindowHooks:
    """Post-window work: export every ``export_every`` windows to ``export_url`` and/or
    evaluate (``evaluate(params) -> metrics``) after each window; call it with each
    closed window (it returns at once); :meth:`close` waits for the work under way.
    With ``export_seconds`` it also exports every that many seconds, windows or not
    (counted from the last export of either kind)."""

    def __init__(self, store: CoordinationStore, transport: Transport, config: JobConfig, evaluate: Evaluate | None = None) -> None:
        self._store, self._transport, self._config = store, transport, config
        self._keys = Keys(config.name)
        self._evaluate = evaluate
        self._wanted: Window | None = None
        self._cv = threading.Condition()
        self._closed = False
        self._last: Window | None = None  # the newest window closed, for a timed export's meta
        self._exported_at = time.monotonic()
        self.exports = 0  # exports written (for tests and logs)
        self._thread = threading.Thread(target=self._run, name="pdps-window-hooks", daemon=True)
        self._thread.start()

    def __call__(self, window: Window) -> None:
        with self._cv:
            if self._wanted is not None:
                log.warning("post-window work for window %d skipped: window %d closed before it started", self._wanted.no, window.no)
            self._wanted = self._last = window
            self._cv.notify_all()

    def close(self, timeout: float = 60.0) -> None:
        """Finish the work asked for so far, then stop."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout)

    def _timed_due(self) -> float | None:
        """Seconds until the next timed export (None: none are made)."""
        every = self._config.export_seconds
        return None if not (every and self._config.export_url) else max(0.0, self._exported_at + every - time.monotonic())

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._wanted is None and not self._closed:
                    due = self._timed_due()
                    if due == 0.0:
                        break
                    self._cv.wait(due)
                window, self._wanted = self._wanted, None
                if window is None and self._closed:
                    return
            try:
                self.run(window)
            except Exception:  # post-window work never stops the job: it is logged, the next one tries again
                log.exception("post-window work for %s failed", "a timed export" if window is None else f"window {window.no}")
                self._exported_at = time.monotonic()  # a timed export that failed waits its period again

    def run(self, window: Window | None) -> None:
        """Export and evaluate the model as it is after ``window`` closed (None: a timed
        export, every ``export_seconds``)."""
        from pdps.shell.sim import fetch_model

        cfg = self._config
        by_window = window is not None and bool(cfg.export_every) and (window.no + 1) % cfg.export_every == 0
        export = bool(cfg.export_url) and (window is None or by_window)
        evaluate = self._evaluate if window is not None else None
        if not (export or evaluate):
            return
        if window is None and self._store.get(self._keys.model) is None:
            self._exported_at = time.monotonic()  # no trainer has attached the model yet: nothing to export
            return
        params, updates = fetch_model(self._store, self._transport, cfg)
        if export:
            from pdps import exports

            if window is not None:
                meta = {"job": cfg.name, "window": window.no, "tasks": [window.first, window.end - 1], "records": window.records, "updates": updates}
            else:  # timed: the newest window closed so far, if any
                meta = {"job": cfg.name, "window": None if self._last is None else self._last.no, "updates": updates, "timed": True}
            done = exports.publish(cfg.export_url, params, meta=meta, keep=cfg.export_keep or None)
            self.exports += 1
            self._exported_at = time.monotonic()
            log.info("%s exported as %s (%d updates)", "the model" if window is None else f"window {window.no}", done.path, updates)
        if evaluate is not None and window is not None:
            self._evaluate_window(evaluate, params, updates, window)

    def _evaluate_window(self, evaluate: Evaluate, params: dict[str, Any], updates: int, window: Window) -> None:
        """Record ``evaluate(params)`` at ``evals/<window>``."""
        metrics = evaluate(params)
        if isinstance(metrics, numbers.Real) and not isinstance(metrics, (bool, np.bool_)):  # numpy's scalars too
            metrics = {"metric": float(metrics)}
        if not isinstance(metrics, dict):
            raise ConfigError(f"the evaluate function returned {type(metrics).__name__}; return a number or a dict of numbers")
        record = {"window": window.no, "metrics": metrics, "updates": updates, "at": time.time()}
        try:  # strict JSON: `pdps status --json` prints the record as it is, for any JSON reader
            encoded = json.dumps(record, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"the evaluate function returned metrics that are not JSON values ({exc}): {metrics!r:.200}") from exc
        self._store.put(self._keys.evaluation(window.no), encoded.encode())
        log.info("window %d evaluated: %s", window.no, metrics)
