"""The ports: what the roles need from the outside world, as ``typing.Protocol``s."""

from pdps.ports.compute import Compute, ModelReplica, ParameterShard
from pdps.ports.coordination import (
    Compare,
    CoordinationStore,
    Delete,
    EventType,
    Fence,
    KeyValue,
    Op,
    Put,
    TxnResult,
    Watch,
    WatchEvent,
)
from pdps.ports.data import DataSource
from pdps.ports.storage import Storage
from pdps.ports.transport import Channel, Endpoint, Handler, Message, Transport

__all__ = [
    "Channel", "Compare", "Compute", "CoordinationStore", "DataSource", "Delete", "Endpoint",
    "EventType", "Fence", "Handler", "KeyValue", "Message", "ModelReplica", "Op",
    "ParameterShard", "Put", "Storage", "Transport", "TxnResult", "Watch", "WatchEvent",
]
