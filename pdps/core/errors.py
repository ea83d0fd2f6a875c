"""The one error hierarchy of pdps.

Every layer raises these; adapters translate library exceptions into them with
``raise ... from exc`` so callers never catch ``grpc.RpcError`` or a redis error.
Each class carries a stable ``code`` so a transport can carry the error across
a process boundary and rebuild the same class on the other side.
"""

from __future__ import annotations


class PdpsError(Exception):
    """Base class of every error pdps raises on purpose."""

    code = "pdps"


class ConfigError(PdpsError, ValueError):
    """A job or role was configured with a value that cannot work."""

    code = "config"


class UnknownSchemeError(ConfigError):
    """A URL names a scheme no registered adapter serves."""

    code = "unknown_scheme"


class MissingExtraError(ConfigError, ImportError):
    """The adapter for a URL needs an optional dependency that is not installed."""

    code = "missing_extra"


class DatasetError(PdpsError):
    """A dataset is missing, unreadable or not in the expected format."""

    code = "dataset"


class InvalidTransition(PdpsError):
    """A state machine was fed an event its current state does not allow.

    Carries the subject (task id, ...), its state and the event.
    """

    code = "invalid_transition"

    def __init__(self, subject: object, state: object, event: object, detail: str = "") -> None:
        self.subject = subject
        self.state = state
        self.event = event
        msg = f"{subject!r} in state {state!s} cannot take event {event!s}"
        super().__init__(f"{msg}: {detail}" if detail else msg)


class UnknownTaskError(PdpsError, KeyError):
    """A report names a task id the queue never had."""

    code = "unknown_task"

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "unknown task"


class BadRequest(PdpsError, ValueError):
    """A request of the wire protocol (:mod:`pdps.core.wire`) lacks a field or holds a
    wrong one; it was refused before it changed anything. ``field`` names the field
    and ``trainer`` the caller, where known (both are in the message too)."""

    code = "bad_request"

    def __init__(self, message: str, *, field: str | None = None, trainer: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.trainer = trainer


class GradientRejected(BadRequest):
    """A pushed gradient (or initial value) failed validation; nothing was applied."""

    code = "gradient_rejected"


class MetaError(BadRequest):
    """A pipeline message's tensor meta (:mod:`pdps.core.tensormeta`) is malformed, names
    an id its receiver does not know, or does not match the bytes that came with it;
    nothing was delivered. The message names the position or the tensor."""

    code = "meta"


class BadGraph(BadRequest, ConfigError):
    """An update rule sent as a graph (:mod:`pdps.core.updategraph`) is malformed, uses an
    operator outside the element-wise allowlist, or is larger than the budget; it was
    refused before anything of it ran. A job config or a request holding one is refused
    the same way. ``node`` and ``operator`` name the offending node, where known."""

    code = "bad_graph"

    def __init__(self, message: str, *, field: str | None = None, trainer: str | None = None, node: str | None = None, operator: str | None = None) -> None:
        super().__init__(message, field=field, trainer=trainer)
        self.node = node
        self.operator = operator


class ResizeInProgress(ConfigError):
    """A resize was asked for while another one of the same job is in progress (one at
    a time): wait for it (``pdps scale --wait``), or ask again once ``pdps status``
    shows it done."""

    code = "resize_in_progress"


class SlotMapChanged(PdpsError):
    """A request was computed for another version of the slot map than the pserver
    serves (the job was resized): re-read the slot map, then compute and send again.
    ``sent`` and ``current`` are the two versions."""

    code = "slot_map_changed"

    def __init__(self, message: str, *, sent: int | None = None, current: int | None = None) -> None:
        super().__init__(message)
        self.sent = sent
        self.current = current


class StalePush(PdpsError):
    """A push was computed on parameters too old (or for a finished round): pull, then retry."""

    code = "stale_push"


class StoreError(PdpsError):
    """The coordination store failed or is unreachable."""

    code = "store"


class Contended(StoreError):
    """A read-modify-write lost the compare-and-set race to other writers more times in
    a row than its bound: something keeps rewriting the key."""

    code = "contended"


class StoreUnavailable(StoreError):
    """The store could not be reached (connection refused, timed out, server gone).

    Transient by nature: roles pause and retry these until their outage deadline.
    The outcome of a write that raised it is unknown (it may have been applied).
    """

    code = "store_unavailable"


class CorruptRecord(StoreError):
    """A value in the store cannot be decoded; ``key`` names it."""

    code = "corrupt_record"

    def __init__(self, message: str, key: str = "") -> None:
        super().__init__(message)
        self.key = key


class FencingError(StoreError):
    """A guarded write was refused because the writer no longer holds its lock."""

    code = "fencing"


class LeaseExpired(StoreError):
    """A lease is gone: its keys were deleted and it cannot be kept alive."""

    code = "lease_expired"


class NoSuchJob(PdpsError, LookupError):
    """The store holds no job by that name."""

    code = "no_such_job"


class NoSuchPass(NoSuchJob):
    """The job exists but has no audit of that pass (not run yet, or run before audits)."""

    code = "no_such_pass"


class StorageError(PdpsError):
    """Blob storage failed: missing object, unreachable bucket, ..."""

    code = "storage"


class CorruptCheckpoint(StorageError):
    """A checkpoint part or manifest is missing, truncated, or fails its checksum.

    Unlike a plain StorageError (the bucket is unreachable: retry), retrying does not
    help: fall back to an older checkpoint. ``path`` names the object.
    """

    code = "corrupt_checkpoint"

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.path = path


class CorruptExport(StorageError):
    """A model export is missing a piece, or its model file does not match its manifest
    (size, sha256, tensor names, dtypes or shapes). ``path`` names the object."""

    code = "corrupt_export"

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.path = path


class ExportConflict(StorageError):
    """Another writer kept taking the export number this one picked: an export URL
    takes one writer at a time. Nothing of this export was published."""

    code = "export_conflict"


class TransportError(PdpsError):
    """A call could not be delivered or answered (unknown address or method, deadline)."""

    code = "transport"


class Timeout(TransportError, TimeoutError):
    """A wait or a call ran past its deadline."""

    code = "timeout"


class Unauthenticated(TransportError):
    """The server refused this side's bearer token (or its lack of one): the two sides
    were given different ``--token`` / ``PDPS_TOKEN`` values. Permanent: a role that
    retries unreachable peers does not retry this one."""

    code = "unauthenticated"


class NotReady(PdpsError):
    """The callee is up but not ready for this request yet (e.g. parameters not initialized)."""

    code = "not_ready"


class EpochChanged(PdpsError):
    """The job rolled back to a checkpoint (a new *epoch*) since this request's step
    began: drop the step, re-fetch the parameters, take a new task."""

    code = "epoch_changed"


class NotInitialized(NotReady):
    """A pserver holds no parameter values (a fresh job, or a rollback with no
    checkpoint): a trainer must ``init`` it with its own."""

    code = "not_initialized"


def error_classes() -> dict[str, type[PdpsError]]:
    """Map each ``code`` to its class, for transports that rebuild remote errors."""
    out: dict[str, type[PdpsError]] = {}
    stack: list[type[PdpsError]] = [PdpsError]
    while stack:
        cls = stack.pop()
        out[cls.code] = cls
        stack.extend(cls.__subclasses__())
    return out
