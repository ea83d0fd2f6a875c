"""pdps: parameter-server distributed training for torch.

The public surface:

* :func:`simulate` runs a whole job (master, pservers, trainers) in one process;
* :class:`TrainerContext` is what a training function receives;
* :class:`JobConfig` holds a job's settings;
* ``open_store`` / ``open_transport`` / ``open_storage`` / ``open_data_source`` pick
  adapters by URL;
* every error pdps raises on purpose derives from :class:`PdpsError`.
"""

from pdps.core.errors import (
    ConfigError,
    CorruptCheckpoint,
    DatasetError,
    FencingError,
    GradientRejected,
    InvalidTransition,
    LeaseExpired,
    MissingExtraError,
    NotReady,
    PdpsError,
    StalePush,
    StorageError,
    StoreError,
    Timeout,
    TransportError,
    UnknownSchemeError,
    UnknownTaskError,
)
from pdps.core.job import DEFAULT_JOB, JobConfig
from pdps.core.sgd import Mode
from pdps.registry import open_data_source, open_storage, open_store, open_transport
from pdps.roles.trainer import Batch, Killed, StepRecord, TrainerContext
from pdps.sim import SimulationResult, fetch_parameters, simulate

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_JOB", "Batch", "ConfigError", "CorruptCheckpoint", "DatasetError", "FencingError", "GradientRejected",
    "InvalidTransition", "JobConfig", "Killed", "LeaseExpired", "MissingExtraError", "Mode",
    "NotReady", "PdpsError", "SimulationResult", "StalePush", "StepRecord", "StorageError", "StoreError",
    "Timeout", "TrainerContext", "TransportError", "UnknownSchemeError", "UnknownTaskError",
    "fetch_parameters", "open_data_source", "open_storage", "open_store", "open_transport", "simulate",
]
