"""Shared fixtures: one throwaway etcd and one Redis per test session, started on demand.

Tests that need a fresh server of their own (outages, benchmarks with other flags)
start one from :mod:`tests.servers` directly.
"""

from __future__ import annotations

import pytest

from tests.servers import EtcdServer, RedisServer


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
