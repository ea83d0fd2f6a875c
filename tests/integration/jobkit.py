"""A live job assembled from its roles by hand, for tests that poke at one role."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs

import pdps
from pdps.adapters.fsspec_storage import TEMP_PREFIX
from pdps.adapters.inproc import InprocTransport
from pdps.adapters.memory_store import MemoryStore
from pdps.adapters.torch_compute import TorchCompute
from pdps.ports.transport import Transport
from pdps.registry import open_checkpoint_files
from pdps.roles.master import Master
from pdps.roles.pserver import Pserver


@attrs.define
class LiveJob:
    store: MemoryStore
    transport: Transport
    compute: TorchCompute
    config: pdps.JobConfig
    source: Any
    master: Master
    pservers: list[Pserver]
    trainers: list[pdps.TrainerContext] = attrs.field(factory=list)

    @property
    def ps(self) -> Pserver:
        return self.pservers[0]

    def trainer(self, trainer_id: str) -> pdps.TrainerContext:
        ctx = pdps.TrainerContext(self.store, self.transport, self.compute, self.source, self.config, trainer_id=trainer_id)
        self.trainers.append(ctx)
        return ctx

    def close(self) -> None:
        for ctx in self.trainers:
            ctx.leave()
        for ps in self.pservers:
            ps.stop()
        self.master.stop()
        self.store.close()


def start_job(source: Any, *, transport: Transport | None = None, address: str = "inproc://", **settings: Any) -> LiveJob:
    """A master and ``pservers`` pservers on a fresh memory store; SGD(lr=0.1) unless told.
    ``transport``: in-process unless told (then ``address`` says where the roles serve)."""
    settings.setdefault("name", "live")
    settings.setdefault("optimizer", "SGD")
    settings.setdefault("optimizer_args", {"lr": 0.1})
    store, compute = MemoryStore(), TorchCompute("cpu")
    transport = transport or InprocTransport()
    config = pdps.JobConfig(dataset=source.url, **settings)
    master = Master(store, transport, source, config, address=address, checkpoints=open_checkpoint_files(config.checkpoint_url))
    master.start()
    servers = [
        Pserver(store, transport, compute, config, address=address, checkpoints=open_checkpoint_files(config.checkpoint_url))
        for _ in range(config.pservers)
    ]
    for ps in servers:
        ps.start()
    return LiveJob(store, transport, compute, config, source, master, servers)


def leftovers_on_disk(root: Path) -> list[str]:
    """What a local checkpoint root holds that nothing will ever read, seen by walking
    the directory itself (not through the storage adapter): temporary files of writes
    that never finished, and empty folders (with a trailing ``/``). ``[]`` when clean."""
    out = []
    for folder, dirs, names in os.walk(root):
        rel = Path(folder).relative_to(root)
        if not dirs and not names and rel != Path("."):
            out.append(f"{rel}/")
        out += [str(rel / n) for n in names if n.startswith(TEMP_PREFIX)]
    return sorted(out)
