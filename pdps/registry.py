"""Adapters chosen by URL: scheme -> lazy import path, per port.

Like fsspec's protocol registry: nothing is imported until a URL asks for it, and a
missing optional dependency names the extra to install. This module and the entry
points are the only places that import adapters.
"""

from __future__ import annotations

import importlib
from typing import Any

from pdps.core.errors import MissingExtraError, UnknownSchemeError

# port -> scheme -> (import path of a factory taking the URL, extra that provides it)
_REGISTRY: dict[str, dict[str, tuple[str, str | None]]] = {
    "store": {
        "memory": ("pdps.adapters.memory_store:open_memory_store", None),
        "etcd": ("pdps.adapters.etcd_store:open_etcd_store", "etcd"),
        "etcds": ("pdps.adapters.etcd_store:open_etcd_store", "etcd"),
        "redis": ("pdps.adapters.redis_store:open_redis_store", "redis"),
        "rediss": ("pdps.adapters.redis_store:open_redis_store", "redis"),
    },
    "transport": {
        "inproc": ("pdps.adapters.inproc:InprocTransport", None),
        "grpc": ("pdps.adapters.grpc_transport:GrpcTransport", "grpc"),
    },
    "storage": {
        "file": ("pdps.adapters.fsspec_storage:FsspecStorage", None),
        "memory": ("pdps.adapters.fsspec_storage:FsspecStorage", None),
        "s3": ("pdps.adapters.fsspec_storage:FsspecStorage", "s3"),
    },
    "compute": {
        "torch": ("pdps.adapters.torch_compute:TorchCompute", None),
    },
    "data": {
        "file": ("pdps.adapters.parquet:open_parquet_source", "parquet"),
        "memory": ("pdps.adapters.parquet:open_parquet_source", "parquet"),
        "s3": ("pdps.adapters.parquet:open_parquet_source", "parquet,s3"),  # pyarrow, and s3fs to reach the bucket
        "redis-stream": ("pdps.adapters.redis_stream:RedisStreamSource", "redis"),
        "memory-stream": ("pdps.adapters.memory_stream:MemoryStreamSource", None),
    },
}

_WHAT = {"store": "coordination store", "transport": "transport", "storage": "storage", "compute": "compute", "data": "data source"}


def register(port: str, scheme: str, target: str, extra: str | None = None) -> None:
    """Add or replace an adapter (``target`` is ``"module:attr"``)."""
    _REGISTRY.setdefault(port, {})[scheme] = (target, extra)


def scheme_of(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def known(port: str) -> list[str]:
    return sorted(_REGISTRY[port])


def _factory(port: str, url: str) -> Any:
    scheme = scheme_of(url)
    entry = _REGISTRY[port].get(scheme)
    if entry is None:
        options = ", ".join(
            f"{s}://" + (f" (pip install 'pdps[{e}]')" if e else " (built in)") for s, (_, e) in sorted(_REGISTRY[port].items())
        )
        raise UnknownSchemeError(f"unknown {_WHAT[port]} scheme {scheme!r} in {url!r}; known schemes: {options}")
    target, extra = entry
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except MissingExtraError:
        raise  # the adapter already named its extra
    except ImportError as exc:
        hint = f"pip install 'pdps[{extra}]'" if extra else "reinstall pdps"
        raise MissingExtraError(f"{scheme}:// {_WHAT[port]} needs a package that is not installed ({exc.name}): {hint}") from exc
    return getattr(module, attr)


def open_store(url: str) -> Any:
    """A :class:`~pdps.ports.coordination.CoordinationStore` for ``url``."""
    if "://" not in url:  # host:port, as etcdctl and redis-cli take it: not a file, as other ports read it
        raise UnknownSchemeError(f"coordination store {url!r} has no scheme: give a URL, e.g. etcd://{url} or redis://{url}")
    return _factory("store", url)(url)


def connect_store(url: str, *, timeout: float | None = None) -> Any:
    """Open the store at ``url`` and check that it answers, retrying for up to ``timeout``
    seconds (default :data:`pdps.runtime.resilient.CONNECT_TIMEOUT`).

    Raises :class:`~pdps.core.errors.StoreUnavailable` naming the URL when it never
    does; scheme and extra errors (an unknown scheme, a missing package) are raised at once.
    """
    from pdps.runtime.resilient import CONNECT_TIMEOUT, wait_until_answers

    return wait_until_answers(open_store(url), timeout=CONNECT_TIMEOUT if timeout is None else timeout)


def open_transport(url: str, **options: Any) -> Any:
    """The :class:`~pdps.ports.transport.Transport` for ``url``'s scheme (``grpc://`` or
    just ``grpc``). ``options`` go to the adapter (gRPC: ``token``, ``tls``, ...)."""
    if "://" not in url:
        url += "://"
    return _factory("transport", url)(**options)


def open_compute(url: str, **options: Any) -> Any:
    """The :class:`~pdps.ports.compute.Compute` for ``url``'s scheme (``torch://`` or
    just ``torch``). ``options`` go to the adapter (torch: ``device``, CUDA when there
    is one unless told)."""
    if "://" not in url:
        url += "://"
    return _factory("compute", url)(**options)


def open_storage(url: str, **options: Any) -> Any:
    return _factory("storage", url)(url, **options)


def open_checkpoint_files(url: str) -> Any:
    """The :class:`~pdps.ports.checkpoints.CheckpointFiles` of the checkpoints kept under
    the storage ``url`` (a job's ``checkpoint_url``): safetensors and JSON parts. None
    for ``""`` (a job that keeps no checkpoints)."""
    if not url:
        return None
    from pdps.adapters.safetensors_files import SafetensorsFiles

    return SafetensorsFiles(open_storage(url))


def open_data_source(url: str, **options: Any) -> Any:
    return _factory("data", url)(url, **options)
