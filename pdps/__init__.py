"""pdps: parameter-server distributed training for torch.

The public surface:

* :func:`simulate` runs a whole job (master, pservers, trainers) in one process;
* :func:`simulate_control_plane` runs one pass of such a job at scale and reports what
  its control plane cost, per role;
* :class:`TrainerContext` is what a training function receives;
* :class:`JobConfig` holds a job's settings;
* ``open_store`` / ``open_transport`` / ``open_storage`` / ``open_data_source`` /
  ``open_compute`` pick adapters by URL;
* every error pdps raises on purpose derives from :class:`PdpsError`.

``import pdps`` loads only the core: the names that run a job (``simulate``,
``TrainerContext``, ...) import their modules on first use (PEP 562), so the command
line answers ``--help`` without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pdps.core.errors import (
    BadGraph,
    BadRequest,
    ConfigError,
    Contended,
    CorruptCheckpoint,
    CorruptExport,
    CorruptRecord,
    DatasetError,
    EpochChanged,
    ExportConflict,
    FencingError,
    GradientRejected,
    InvalidTransition,
    LeaseExpired,
    MetaError,
    MissingExtraError,
    NoSuchJob,
    NoSuchPass,
    NotInitialized,
    NotReady,
    PdpsError,
    ResizeInProgress,
    SlotMapChanged,
    StalePush,
    StorageError,
    StoreError,
    StoreUnavailable,
    Timeout,
    TransportError,
    Unauthenticated,
    UnknownSchemeError,
    UnknownTaskError,
)
from pdps.core.job import DEFAULT_JOB, JobConfig
from pdps.core.sgd import Mode
from pdps.registry import open_compute, open_data_source, open_storage, open_store, open_transport

if TYPE_CHECKING:
    from pdps.roles.trainer import Batch, Killed, StepRecord, TrainerContext
    from pdps.shell.control_plane import ControlPlaneReport, simulate_control_plane
    from pdps.adapters.torch_graph import graph_rule
    from pdps.shell.faults import Faults
    from pdps.shell.sim import SimulationResult, fetch_parameters, simulate
    from pdps.shell.session import Loss, Session

__version__ = "0.1.0"

# name -> the module that defines it, imported on first access
_LAZY = {
    "Batch": "pdps.roles.trainer",
    "Killed": "pdps.roles.trainer",
    "TrainerContext": "pdps.roles.trainer",
    "StepRecord": "pdps.roles.trainer",
    "Faults": "pdps.shell.faults",
    "SimulationResult": "pdps.shell.sim",
    "fetch_parameters": "pdps.shell.sim",
    "simulate": "pdps.shell.sim",
    "ControlPlaneReport": "pdps.shell.control_plane",
    "simulate_control_plane": "pdps.shell.control_plane",
    "scale": "pdps.shell.scale",
    "graph_rule": "pdps.adapters.torch_graph",
    "Session": "pdps.shell.session",
    "Loss": "pdps.shell.session",
}

__all__ = [
    "DEFAULT_JOB", "BadGraph", "BadRequest", "Batch", "ConfigError", "ControlPlaneReport", "Contended", "CorruptCheckpoint", "CorruptExport", "CorruptRecord", "DatasetError", "EpochChanged", "ExportConflict",
    "Faults", "FencingError", "GradientRejected", "InvalidTransition", "JobConfig", "Killed", "LeaseExpired", "Loss",
    "MetaError", "MissingExtraError", "Mode", "NoSuchJob", "NoSuchPass", "NotInitialized", "NotReady", "PdpsError",
    "ResizeInProgress", "Session", "SimulationResult", "SlotMapChanged", "StalePush", "StepRecord", "StorageError", "StoreError", "StoreUnavailable", "Timeout",
    "TrainerContext", "TransportError", "Unauthenticated", "UnknownSchemeError", "UnknownTaskError",
    "fetch_parameters", "graph_rule", "open_compute", "open_data_source", "open_storage", "open_store", "open_transport", "scale", "simulate",
    "simulate_control_plane",
]


#: submodules a user reaches as ``pdps.<name>`` after a plain ``import pdps`` (imported on
#: first use: they load torch or the stream adapters)
_SUBMODULES = frozenset({"nn", "streams", "exports"})


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"pdps.{name}")  # the import binds it in this module too
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pdps' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | _SUBMODULES)
