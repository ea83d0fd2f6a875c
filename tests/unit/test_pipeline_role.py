"""The trainer's pipeline role, its pure parts: the step header's checks, the settings a
pipeline job is refused for, and a receive that ends as soon as its peer left (a real
P2P in process, the rank claims faked)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from pdps.adapters.inproc import InprocTransport
from pdps.adapters.memory_store import MemoryStore
from pdps.core.errors import ConfigError, Timeout
from pdps.core.hybrid import RankClaim
from pdps.core.job import JobConfig, Keys
from pdps.roles.trainer.pipeline import END, STEP, Header, PipelineStage, WatchedLink
from pdps.runtime.p2p import P2P


def test_headers_round_trip_and_malformed_ones_are_refused_naming_the_sender():
    h = Header(STEP, 7, 3, 16, 4)
    assert Header.parse(h.values(), 0) == h
    assert Header.parse([END, 9, 0, 0, 0], 0).kind == END
    for bad in ([STEP, 1, 0, 0, 4], [STEP, 1, 0, 8, 0], [2, 1, 0, 8, 4], [STEP, -1, 0, 8, 4], [STEP, 1, 0, 8]):
        with pytest.raises(ConfigError, match=r"rank 4 sent a malformed pipeline header"):
            Header.parse(bad, 4)


def test_a_pipeline_job_is_refused_where_it_cannot_be_one():
    assert JobConfig(trainers=8, pipeline_stages=4).pipeline_stages == 4
    with pytest.raises(ConfigError, match=r"trainers \(6\) must be a multiple of pipeline_stages \(4\)"):
        JobConfig(trainers=6, pipeline_stages=4)
    with pytest.raises(ConfigError, match="pipeline_schedule must be one of 'gpipe', '1f1b'"):
        JobConfig(trainers=4, pipeline_stages=4, pipeline_schedule="zb")
    assert JobConfig(trainers=4, pipeline_stages=4, mode="async").mode == "async"
    with pytest.raises(ConfigError, match="push_every and pull_every must be 1, got 2 and 1"):
        JobConfig(trainers=4, pipeline_stages=4, mode="async", push_every=2)
    with pytest.raises(ConfigError, match="with replicas = 2"):
        JobConfig(trainers=4, pipeline_stages=4, pservers=2, replicas=2)
    with pytest.raises(ConfigError, match="pipeline_timeout must be a number of seconds > 0"):
        JobConfig(pipeline_timeout=0)


def test_a_receive_ends_as_soon_as_its_peer_left_and_names_it(monkeypatch):
    monkeypatch.setattr("pdps.roles.trainer.pipeline.WATCH_EVERY", 0.01)  # a look at the claims every 10 ms
    transport = InprocTransport()
    book: dict[int, str] = {}
    a = P2P(transport, 0, "inproc://", peers=book.__getitem__, timeout=30)
    b = P2P(transport, 1, "inproc://", peers=book.__getitem__, timeout=30)
    book.update({0: a.address, 1: b.address})
    claims = {0: RankClaim("t0", a.address), 1: RankClaim("t1", b.address)}
    link = WatchedLink(a, claims.get, {0: "t0", 1: "t1"}.__getitem__, lambda: 0)
    try:
        b.send(0, "x", [torch.ones(2)])
        assert torch.equal(link.recv(1, "x", timeout=5)[0], torch.ones(2))
        with pytest.raises(Timeout, match=r"rank 0 waited 0.05 s for 'y' from rank 1"):
            link.recv(1, "y", timeout=0.05)  # the peer is there: the deadline decides
        claims[1] = RankClaim("t1-r1", "inproc://elsewhere")  # another trainer took the rank
        began = time.monotonic()
        with pytest.raises(Timeout, match=r"waited for 'y' from rank 1 \(t1\), which left the pipeline \(its rank is held by t1-r1\)"):
            link.recv(1, "y", timeout=30)
        assert time.monotonic() - began < 1  # not the 30 s deadline
        del claims[1]
        with pytest.raises(Timeout, match=r"its rank is free"):
            link.recv(1, "y", timeout=30)
    finally:
        a.close()
        b.close()


def test_a_stage_waiting_for_its_next_header_says_stage_0_left_once_its_claim_is_gone(monkeypatch):
    """The claim goes between the link's last look and the header wait's own: the wait
    ends with the same words as a receive whose peer left (naming its trainer), not with
    a deadline of one look's length."""
    monkeypatch.setattr("pdps.roles.trainer.pipeline.WATCH_EVERY", 0.01)
    transport = InprocTransport()
    follower = P2P(transport, 1, "inproc://", peers={}.__getitem__, timeout=30)
    store = MemoryStore()
    stage = object.__new__(PipelineStage)  # only what the wait for a header reads
    stage._ctx = SimpleNamespace(_stop=threading.Event(), trainer_id="t1")
    stage._store, stage._keys, stage._first, stage._lead = store, Keys("job"), 0, "t0"
    stale = RankClaim("t0", "inproc://stage-0")  # what the link last saw; the store holds no claim any more
    stage._link = WatchedLink(follower, {0: stale}.get, {0: "t0"}.__getitem__, lambda: 1)
    try:
        with pytest.raises(Timeout, match=r"^rank 1 waited for 'h/3' from rank 0 \(t0\), which left the pipeline \(its rank is free\)$"):
            stage._wait_header(3)
    finally:
        follower.close()
        store.close()
