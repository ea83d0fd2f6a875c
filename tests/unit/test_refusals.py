"""RefusalLog: the first refusals of each interval in full, the rest in one summary line."""

from __future__ import annotations

import logging
import time

from pdps.adapters.refusals import RefusalLog

LOGGER = "tests.refusals"


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def wait_for(predicate, within: float = 10.0) -> bool:
    until = time.monotonic() + within
    while not predicate() and time.monotonic() < until:
        time.sleep(0.02)
    return predicate()


def test_the_first_few_are_told_the_rest_summed_up_when_the_interval_ends(caplog):
    refusals = RefusalLog(logging.getLogger(LOGGER), "grpc://here:1", first=3, interval=0.5)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        for i in range(20):
            refusals.refused("rejected a call", f"ipv4:10.0.0.{i % 5}:{4000 + i}", f"wrong token {i}")
        assert warnings(caplog) == [f"rejected a call from ipv4:10.0.0.{i}:{4000 + i} at grpc://here:1: wrong token {i}" for i in range(3)]
        assert wait_for(lambda: len(warnings(caplog)) == 4)  # the summary, with no further refusal to trigger it
        summary = warnings(caplog)[3]
        assert summary.startswith("17 more refusals at grpc://here:1 in the last 0.5 s, from 10.0.0.3, 10.0.0.4, 10.0.0.0 and 2 other hosts")
        assert "(the last: rejected a call: wrong token 19)" in summary
        debug = [r for r in caplog.records if r.levelno == logging.DEBUG]
        assert len(debug) == 17  # the counted ones are not lost to whoever debugs
        refusals.refused("refused a bulk connection", "127.0.0.1:5000", "no token")  # a new interval: told again
        assert warnings(caplog)[4] == "refused a bulk connection from 127.0.0.1:5000 at grpc://here:1: no token"
        time.sleep(0.6)
        assert len(warnings(caplog)) == 5  # nothing counted, nothing to sum up


def test_flush_sums_up_at_once_and_only_once(caplog):
    refusals = RefusalLog(logging.getLogger(LOGGER), "grpc://here:1", first=1, interval=60.0)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(4):
            refusals.refused("rejected a call", "ipv6:[::1]:7", "malformed frame")
        refusals.flush()
        refusals.flush()
    assert len(warnings(caplog)) == 2
    assert warnings(caplog)[1].startswith("3 more refusals at grpc://here:1 in the last 60 s, from ::1 (the last: rejected a call: malformed frame)")
