"""Shared fixtures: one throwaway etcd, Redis and S3 server (moto) per test session, started on demand.

Tests that need a fresh server of their own (outages, benchmarks with other flags)
start one from :mod:`tests.servers` directly.
"""

from __future__ import annotations

import pytest

from tests.servers import EtcdServer, MotoServer, RedisServer


@pytest.fixture(scope="session")
def etcd_server():
    server = EtcdServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def moto_server():
    server = MotoServer().start()
    yield server
    server.stop()


@pytest.fixture
def s3_env(moto_server, monkeypatch):
    """The standard AWS variables pointing at the session's moto server, as an operator
    sets them for pdps roles (docs/operations.md): ``s3://`` URLs then need no options."""
    for name, value in moto_server.environ().items():
        monkeypatch.setenv(name, value)
    return moto_server


@pytest.fixture
def s3_storage(s3_env):
    """A storage at ``s3://<fresh bucket>/root`` on the session's moto server.

    Its uploads use 5 MiB parts (S3's smallest), so a write of a few MiB already
    exercises the multipart path that big checkpoint parts take.
    """
    from pdps.adapters.fsspec_storage import FsspecStorage

    bucket = s3_env.create_bucket()
    return FsspecStorage(f"s3://{bucket}/root", default_block_size=5 * 2**20)


@pytest.fixture
def etcd_store(etcd_server):
    """A store on the session's etcd with every test key (all start with "/") wiped."""
    from pdps.registry import open_store

    store = open_store(etcd_server.url)
    store.delete_prefix("/")
    yield store
    store.close()


@pytest.fixture
def redis_store(redis_server):
    """A store on the session's Redis, database flushed first."""
    import redis

    from pdps.registry import open_store

    redis.Redis(host="127.0.0.1", port=redis_server.port).flushdb()
    store = open_store(redis_server.url)
    yield store
    store.close()
