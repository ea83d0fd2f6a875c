"""pdps.adapters.bulk.Connection arms its socket's timeout only when it changes:
``settimeout`` is a system call, and a 4 MiB message arrives in a dozen or more reads
(re-arming each one cost a p2p round about 0.25 ms on the 2-vCPU machine)."""

from __future__ import annotations

import pytest

from pdps.adapters import bulk


class ChunkedSocket:
    """A socket whose reads return ``chunk`` bytes at a time; counts ``settimeout`` calls."""

    def __init__(self, data: bytes, chunk: int) -> None:
        self.data, self.chunk, self.at = data, chunk, 0
        self.timeout: float | None = None
        self.armed: list[float | None] = []

    def gettimeout(self) -> float | None:
        return self.timeout

    def settimeout(self, value: float | None) -> None:
        self.timeout = value
        self.armed.append(value)

    def recv_into(self, view: memoryview, n: int) -> int:
        k = min(n, self.chunk, len(self.data) - self.at)
        view[:k] = self.data[self.at : self.at + k]
        self.at += k
        return k


def test_a_read_of_many_chunks_under_one_stall_arms_the_socket_once():
    sock = ChunkedSocket(bytes(range(256)) * 64, chunk=1000)  # 17 reads
    conn = bulk.Connection(sock, "peer")  # type: ignore[arg-type]
    got = conn.read_bytes(len(sock.data), stall=30.0)
    assert bytes(got) == sock.data and sock.armed == [30.0]
    conn.read_bytes(0, stall=30.0)
    conn.read_into(memoryview(bytearray(0)), stall=None)  # nothing to read: nothing armed
    assert sock.armed == [30.0]


def test_a_deadline_is_armed_again_once_the_time_left_falls_below_the_armed_timeout(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(bulk.time, "monotonic", lambda: now[0])
    sock = ChunkedSocket(b"x" * 30, chunk=10)
    conn = bulk.Connection(sock, "peer")  # type: ignore[arg-type]
    conn._arm(deadline=110.0, stall=None)
    now[0] += bulk._REARM_SLACK / 2  # within the slack: the armed 10 s stands
    conn._arm(deadline=110.0, stall=None)
    assert sock.armed == [10.0]
    now[0] = 105.0  # 5 s left: armed again, never more than the slack past the deadline
    conn._arm(deadline=110.0, stall=30.0)
    assert sock.armed == [10.0, 5.0]
    conn._arm(deadline=None, stall=30.0)  # a longer stall after it: armed again
    assert sock.armed == [10.0, 5.0, 30.0]
    now[0] = 110.0
    with pytest.raises(TimeoutError):
        conn._arm(deadline=110.0, stall=30.0)


def test_the_armed_timeout_is_read_from_the_socket_so_an_outside_settimeout_is_seen():
    sock = ChunkedSocket(b"", chunk=1)
    conn = bulk.Connection(sock, "peer")  # type: ignore[arg-type]
    conn._arm(deadline=None, stall=30.0)
    sock.settimeout(5.0)  # as the listener's handshake does
    conn._arm(deadline=None, stall=30.0)
    assert sock.armed == [30.0, 5.0, 30.0]
