"""The pserver process's allocator trimmer (pdps.shell.allocator): when it trims, and
that glibc's malloc_trim gives freed heap memory back on these machines."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pdps.shell.allocator import Trimmer, glibc_malloc_trim


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


def test_trims_once_enough_bytes_moved_and_the_traffic_paused_or_at_the_busy_period() -> None:
    moved, calls, now = [100], [], [0.0]
    trimmer = Trimmer(lambda: moved[0], every=1.0, min_bytes=50, busy_every=10.0, trim=lambda: calls.append(1) or 1, clock=lambda: now[0])
    assert not trimmer.tick() and calls == []  # nothing moved since it was made
    moved[0] = 149
    assert not trimmer.tick()  # moving, and not enough
    assert not trimmer.tick()  # paused, but 49 bytes are not enough
    moved[0] = 150
    assert not trimmer.tick()  # enough, but still moving
    assert trimmer.tick() and len(calls) == 1 and trimmer.trims == 1  # paused: trimmed
    assert not trimmer.tick()  # counted from the last trim, not from the start
    for t in range(1, 10):  # traffic that never pauses: only at the busy period
        now[0], moved[0] = float(t), moved[0] + 100
        assert not trimmer.tick()
    now[0], moved[0] = 10.0, moved[0] + 100
    assert trimmer.tick() and len(calls) == 2
    now[0], moved[0] = 11.0, moved[0] + 100
    assert not trimmer.tick()


def test_a_trimmer_with_nothing_to_call_does_nothing() -> None:
    trimmer = Trimmer(lambda: 1 << 40, trim=None)
    trimmer._trim = None  # as where the C library is not glibc
    assert not trimmer.active and not trimmer.tick()
    trimmer.start().stop()  # logs once, starts no thread


def test_settings_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match="every > 0"):
        Trimmer(lambda: 0, every=0.0, trim=lambda: 0)
    with pytest.raises(ValueError, match="min_bytes >= 0"):
        Trimmer(lambda: 0, min_bytes=-1, trim=lambda: 0)


def test_glibc_malloc_trim_gives_freed_heap_blocks_back() -> None:
    # what a pserver's pushes do: once a 24 MB buffer was freed, glibc's mmap threshold
    # rises past it and the next 4 MB buffers come from the heap; freed below a live one,
    # they stay resident until malloc_trim
    trim = glibc_malloc_trim()
    assert trim is not None, "these machines run glibc"
    big = np.ones(24 << 20, dtype=np.uint8)
    del big
    blocks = [np.ones(4 << 20, dtype=np.uint8) for _ in range(12)]
    last = blocks.pop()
    del blocks
    before = rss()
    moved = [0]
    trimmer = Trimmer(lambda: moved[0], min_bytes=1, trim=trim)
    moved[0] = 44 << 20
    assert not trimmer.tick() and trimmer.tick()  # the second look finds the traffic paused
    assert before - rss() >= 32 << 20, f"malloc_trim gave back {(before - rss()) / 2**20:.1f} MiB of the 44 freed"
    del last


def test_a_pserver_process_trims_on_a_thread_of_its_own_unless_trim_every_is_0() -> None:
    import threading

    from pdps.shell.process import _trimming

    def trimmers() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name == "pdps-ps-trim"]

    with _trimming(lambda: 0, 0.0):
        assert trimmers() == []
    with _trimming(lambda: 0, 30.0):
        assert trimmers() == ["pdps-ps-trim"]
    assert trimmers() == []  # stopped with the pserver
