"""A live job assembled from its roles by hand, for tests that poke at one role."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import torch

import pdps
from pdps.adapters.fsspec_storage import TEMP_PREFIX
from pdps.adapters.grpc_transport import GrpcTransport
from pdps.adapters.inproc import InprocTransport
from pdps.adapters.memory_store import MemoryStore
from pdps.adapters.torch_compute import TorchCompute
from pdps.core.job import Keys
from pdps.ports.transport import Channel, Message, Transport
from pdps.registry import open_checkpoint_files
from pdps.roles.master import Master, publish_job
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


class NoData:
    """A dataset with no tasks: for a trainer that only attaches its model."""

    url = "memory://none"

    def tasks(self) -> list[Any]:
        return []


@contextlib.contextmanager
def grpc_pserver(model: torch.nn.Module, *, token: str, **settings: Any) -> Iterator[tuple[Pserver, Channel, Any]]:
    """One real pserver over gRPC on 127.0.0.1 that wants ``token``, its job (async, one pserver,
    unless ``settings`` say otherwise) published on a fresh memory store with no master; a real
    trainer ``t0`` attaches ``model``, which sets the pserver's parameters. Yields (the pserver, a
    channel to it, t0's part of pserver 0); closes them all after."""
    settings.setdefault("mode", "async")
    settings.setdefault("pservers", 1)
    store = MemoryStore()
    config = pdps.JobConfig(**settings)
    publish_job(store, config)
    transport = GrpcTransport(token=token)
    ps = Pserver(store, transport, TorchCompute("cpu"), config, address="grpc://127.0.0.1:0")
    ps.start()
    ctx = pdps.TrainerContext(store, transport, TorchCompute("cpu"), NoData(), config, trainer_id="t0")
    ctx.attach(model)
    channel = transport.connect(json.loads(store.get(Keys(config.name).pserver(0)).value)["addr"])
    try:
        yield ps, channel, ctx._group.parts[0]
    finally:
        channel.close()
        ctx.leave()
        ps.stop()
        store.close()


def pull(channel: Channel) -> list[torch.Tensor]:
    """Copies of the parameters the pserver at ``channel`` serves ``t0``."""
    return [t.clone() for t in channel.call("pull", Message({"trainer": "t0"}), timeout=10).tensors]


def valid_push(channel: Channel, part: Any, dtype: torch.dtype = torch.float32) -> tuple[dict, list[torch.Tensor]]:
    """The meta and tensors of a push from ``t0`` that the pserver at ``channel`` takes: a gradient
    of 0.5 (``dtype``, the parameters') for every block of ``part``, against its current version."""
    version = int(channel.call("pull", Message({"trainer": "t0"}), timeout=10).meta["updates"])
    grads = [torch.full(b.shape, 0.5, dtype=dtype) for b in part.blocks]
    return {"trainer": "t0", "updates": version, "blocks": list(part.keys)}, grads


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
