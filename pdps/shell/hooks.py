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
import threading
import time
from collections.abc import Callable
from typing import Any

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
    closed window (it returns at once); :meth:`close` waits for the work under way."""

    def __init__(self, store: CoordinationStore, transport: Transport, config: JobConfig, evaluate: Evaluate | None = None) -> None:
        self._store, self._transport, self._config = store, transport, config
        self._keys = Keys(config.name)
        self._evaluate = evaluate
        self._wanted: Window | None = None
        self._cv = threading.Condition()
        self._closed = False
        self.exports = 0  # exports written (for tests and logs)
        self._thread = threading.Thread(target=self._run, name="pdps-window-hooks", daemon=True)
        self._thread.start()

    @classmethod
    def wanted(cls, config: JobConfig) -> bool:
        return bool(config.export_url or config.evaluate)

    def __call__(self, window: Window) -> None:
        with self._cv:
            if self._wanted is not None:
                log.warning("post-window work for window %d skipped: window %d closed before it started", self._wanted.no, window.no)
            self._wanted = window
            self._cv.notify_all()

    def close(self, timeout: float = 60.0) -> None:
        """Finish the work asked for so far, then stop."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._wanted is None and not self._closed:
                    self._cv.wait()
                window, self._wanted = self._wanted, None
                if window is None:
                    return
            try:
                self.run(window)
            except Exception:  # post-window work never stops the job: it is logged, the next window tries again
                log.exception("post-window work for window %d failed", window.no)

    def run(self, window: Window) -> None:
        """Export and evaluate the model as it is after ``window`` closed."""
        from pdps.shell.sim import fetch_model

        cfg = self._config
        export = bool(cfg.export_url) and (window.no + 1) % cfg.export_every == 0
        if not (export or self._evaluate):
            return
        params, updates = fetch_model(self._store, self._transport, cfg)
        if export:
            from pdps import exports

            meta = {"job": cfg.name, "window": window.no, "tasks": [window.first, window.end - 1], "records": window.records, "updates": updates}
            done = exports.publish(cfg.export_url, params, meta=meta, keep=cfg.export_keep or None)
            self.exports += 1
            log.info("window %d exported as %s (%d updates)", window.no, done.path, updates)
        if self._evaluate is not None:
            metrics = self._evaluate(params)
            if isinstance(metrics, (int, float)) and not isinstance(metrics, bool):
                metrics = {"metric": float(metrics)}
            if not isinstance(metrics, dict):
                raise ConfigError(f"the evaluate function returned {type(metrics).__name__}; return a number or a dict of numbers")
            record = {"window": window.no, "metrics": metrics, "updates": updates, "at": time.time()}
            self._store.put(self._keys.evaluation(window.no), json.dumps(record).encode())
            log.info("window %d evaluated: %s", window.no, metrics)
