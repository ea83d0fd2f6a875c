"""The trainer role: :class:`TrainerContext`, the object a training function receives
(``context``), and its parts: the pserver client (``pserver_client``), the overlap
engine (``overlap``), the sync round and the async cadence (``steps``), the master
client (``master_client``) and finding the other roles (``discovery``)."""

from pdps.roles.trainer.context import TIMINGS, Batch, Killed, TrainerContext
from pdps.roles.trainer.steps import StepRecord

__all__ = ["TIMINGS", "Batch", "Killed", "StepRecord", "TrainerContext"]
