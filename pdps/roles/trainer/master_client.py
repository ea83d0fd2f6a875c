"""A trainer's calls to the master, following it across a failover."""

from __future__ import annotations

import logging
from typing import Any

from pdps.core.backoff import Backoff
from pdps.core.errors import FencingError, Timeout, TransportError, Unauthenticated
from pdps.core.job import Keys
from pdps.core.wire import GetTaskReply, GetTaskRequest, MasterRequest, ReportReply
from pdps.ports.coordination import CoordinationStore
from pdps.ports.transport import Channel, Transport
from pdps.roles import calls
from pdps.roles.trainer.discovery import DISCOVERY_TIMEOUT, job_done, wait_for_key
from pdps.runtime.retry import Retry

log = logging.getLogger(__name__)

#: Pauses between looking the master up again while it fails over.
LOOKUP_BACKOFF = Backoff(first=0.05, longest=1.0)


class MasterClient:
    """The master of a job as one trainer sees it: found through ``master/addr``, looked
    up again when it is gone or has stepped down."""

    def __init__(self, store: CoordinationStore, transport: Transport, keys: Keys, trainer_id: str) -> None:
        self._store, self._transport, self._keys, self._trainer_id = store, transport, keys, trainer_id
        self._master: Channel | None = None

    def _channel(self) -> Channel | None:
        """The master's channel; ``None`` once the job is done and its master has left."""
        if self._master is None:
            addr = wait_for_key(self._store, self._keys.master_addr, "the master", unless=lambda: job_done(self._store, self._keys))
            if addr is None:
                return None
            self._master = self._transport.connect(addr.decode())
        return self._master

    def call(self, request: MasterRequest) -> Any:
        """Call the master; if it is gone or has stepped down, find the current one.

        A standby takes over within about a lease TTL and publishes its address under
        ``master/addr``; until then this retries with backoff, for at most
        ``DISCOVERY_TIMEOUT`` seconds. A master that left because the job is done
        answers for itself through the store: there are no more tasks.
        """
        retrying = Retry(LOOKUP_BACKOFF, deadline=DISCOVERY_TIMEOUT)
        while True:
            channel = self._channel()
            if channel is None:
                return GetTaskReply(done=True) if isinstance(request, GetTaskRequest) else ReportReply(accepted=False, reason="the job is done")
            try:
                return calls.call(channel, request)
            except (TransportError, FencingError) as exc:
                if isinstance(exc, (Timeout, Unauthenticated)) or not retrying.note():  # a wrong token stays wrong
                    raise
                log.warning("trainer %s: master unavailable for %s (%s); looking it up again", self._trainer_id, request.METHOD, exc)
                channel.close()
                self._master = None
                retrying.pause()
