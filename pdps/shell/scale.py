"""``pdps scale`` and :func:`pdps.scale`: ask a running job for other pserver and
trainer counts (:mod:`pdps.runtime.resizing`; the protocol: docs/elasticity.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pdps.core.elastic import Resize
from pdps.core.errors import ConfigError, NoSuchJob
from pdps.core.job import DEFAULT_JOB, Keys
from pdps.ports.coordination import CoordinationStore
from pdps.roles.trainer.discovery import job_done
from pdps.runtime.resizing import request_resize


def scale(
    store: str | CoordinationStore,
    *,
    job: str = DEFAULT_JOB,
    pservers: int | None = None,
    trainers: int | None = None,
    wait: bool = False,
    timeout: float | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Resize job ``job`` while it runs: the record of the resize asked for, as JSON.

    Refused with :class:`~pdps.core.errors.ResizeInProgress` while another resize is in
    progress, unless ``wait`` (then it queues behind it, and waits for its own to be
    done). :class:`~pdps.core.errors.ConfigError` for counts out of bounds, and for a
    job that is done.
    """
    from pdps.registry import connect_store

    own = isinstance(store, str)
    st = connect_store(store) if isinstance(store, str) else store
    try:
        keys = Keys(job)
        if st.get(keys.config) is None:
            raise NoSuchJob(f"no job {job!r} in this store (no {keys.config})")
        if job_done(st, keys):  # no master is left to carry a resize out: it would wait forever
            raise ConfigError(f"job {job!r} is done: there is nothing to resize (run a new job with the counts you want)")
        shown: Callable[[Resize], None] | None = None if progress is None else (lambda r: progress(r.to_json()))
        return request_resize(st, keys, pservers=pservers, trainers=trainers, wait=wait, timeout=timeout, by="pdps scale", progress=shown).to_json()
    finally:
        if own:
            st.close()
