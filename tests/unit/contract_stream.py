"""The StreamingSource contract, run on every streaming source pdps ships and on its fake.

A test class inherits :class:`StreamContract` (every streaming source) or
:class:`EntryStreamContract` (sources that cut runs of entries: ``redis-stream://``,
``memory-stream://``) and supplies a ``harness`` fixture: a :class:`Harness` around
a fresh, empty stream.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from pdps.core.errors import ConfigError, DatasetError
from pdps.core.tasks import TaskSpec
from pdps.ports.data import Arrivals, Columns, Cut, StreamingSource, read_whole
from tests.unit.test_data_source_contract import check_batches

POLLS = 50  # bound on the polls of one drain


def records(lo: int, n: int) -> Columns:
    """``n`` records numbered from ``lo``: ``y`` is the number, ``x`` derived from it."""
    y = np.arange(lo, lo + n, dtype=np.int64)
    return {"x": np.stack([y, -y, y * 0.5], axis=1).astype(np.float32), "y": y}


class Harness:
    """A stream under test. Subclasses write records the source's way and remove one."""

    source: StreamingSource
    splits = True  # cuts are runs of at most task_records records (not whole row groups)
    exact_backlog = True  # a poll's backlog is a number whenever it reached the end

    def append(self, columns: Columns) -> None:
        """Make ``columns`` arrive, after everything appended before."""
        raise NotImplementedError

    def poll(self, cursor: str, **kw) -> Arrivals:
        """What a poll of ``cursor`` gives once the records appended so far have settled."""
        return self.source.poll(cursor, **kw)

    def remove(self, cut: Cut) -> None:
        """Delete (some of) a cut's records, as trimming or a rewrite would."""
        raise NotImplementedError


class EntryHarness(Harness):
    """A stream of entries at ``url``, appended to by :func:`pdps.streams.append`."""

    url: str

    def open(self, url: str) -> StreamingSource:
        """Another source of the stream (another process would open its own)."""
        raise NotImplementedError

    def append(self, columns: Columns) -> None:
        from pdps import streams

        streams.append(self.url, columns)


def task_of(cut: Cut, id: int = 0) -> TaskSpec:
    return TaskSpec(id=id, location=cut.location, part=cut.part, records=cut.records)


def drain(h: Harness, cursor: str, *, task_records: int, max_tasks: int, flush: bool) -> Iterator[tuple[Arrivals, str]]:
    """Poll from ``cursor`` on, each time from the cursor returned, until a poll cuts
    nothing; yield each poll's arrivals with the cursor it was polled from."""
    for _ in range(POLLS):
        got = h.poll(cursor, task_records=task_records, max_tasks=max_tasks, flush=flush)
        if not got.cuts:
            return
        yield got, cursor
        cursor = got.cursor
    raise AssertionError(f"still cutting after {POLLS} polls")


def read_cuts(h: Harness, cuts) -> np.ndarray:
    ys = [read_whole(h.source, task_of(c, i))["y"] for i, c in enumerate(cuts)]
    return np.concatenate(ys) if ys else np.zeros(0, np.int64)


class StreamContract:
    @pytest.fixture
    def harness(self) -> Harness:
        raise NotImplementedError

    def test_is_a_streaming_source_without_a_task_list(self, harness):
        assert isinstance(harness.source, StreamingSource)
        with pytest.raises(DatasetError, match="stream"):
            harness.source.tasks()

    def test_nothing_after_the_start_cursor_yet(self, harness):
        start = harness.source.start_cursor()
        got = harness.poll(start, task_records=4, max_tasks=3, flush=True)
        assert got == Arrivals(cuts=(), cursor=start, backlog=0)

    def test_cuts_partition_the_records_in_order(self, harness):
        lo = 0
        for n in (7, 5, 11):
            harness.append(records(lo, n))
            lo += n
        cuts = []
        for got, _ in drain(harness, harness.source.start_cursor(), task_records=4, max_tasks=2, flush=True):
            assert 1 <= len(got.cuts) <= 2
            cuts += got.cuts
        assert all(c.records >= 1 for c in cuts)
        if harness.splits:
            assert all(c.records <= 4 for c in cuts)
        whole = [read_whole(harness.source, task_of(c)) for c in cuts]
        assert [len(w["y"]) for w in whole] == [c.records for c in cuts]
        np.testing.assert_array_equal(read_cuts(harness, cuts), np.arange(23))
        np.testing.assert_array_equal(np.concatenate([w["x"] for w in whole]), records(0, 23)["x"])

    def test_a_poll_from_the_returned_cursor_sees_only_later_records(self, harness):
        harness.append(records(0, 5))
        first = harness.poll(harness.source.start_cursor(), task_records=8, max_tasks=4, flush=True)
        np.testing.assert_array_equal(read_cuts(harness, first.cuts), np.arange(5))
        assert harness.poll(first.cursor, task_records=8, max_tasks=4, flush=True) == Arrivals((), first.cursor, 0)
        harness.append(records(5, 3))
        later = harness.poll(first.cursor, task_records=8, max_tasks=4, flush=True)
        np.testing.assert_array_equal(read_cuts(harness, later.cuts), np.arange(5, 8))
        assert later.cursor != first.cursor and later.backlog == 0

    @pytest.mark.parametrize(("start", "batch_size"), [(0, 1), (0, 3), (2, 4), (5, 2), (6, 6), (1, 10)])
    def test_a_cut_reads_in_batches_bounded_by_start_and_batch_size(self, harness, start, batch_size):
        harness.append(records(0, 6))
        (cut,) = harness.poll(harness.source.start_cursor(), task_records=6, max_tasks=1, flush=True).cuts
        assert cut.records == 6
        check_batches(harness.source, task_of(cut), start, batch_size)

    def test_backlog_counts_the_records_not_cut(self, harness):
        harness.append(records(0, 10))
        got = harness.poll(harness.source.start_cursor(), task_records=4, max_tasks=1, flush=False)
        (cut,) = got.cuts
        assert got.backlog == 10 - cut.records
        rest = harness.poll(got.cursor, task_records=4, max_tasks=10, flush=True)
        assert sum(c.records for c in rest.cuts) == 10 - cut.records and rest.backlog == 0

    def test_reading_a_cut_whose_records_were_removed_raises(self, harness):
        harness.append(records(0, 6))
        (cut,) = harness.poll(harness.source.start_cursor(), task_records=6, max_tasks=1, flush=True).cuts
        harness.remove(cut)
        with pytest.raises(DatasetError):
            next(iter(harness.source.read(task_of(cut, 3), batch_size=2)))


class EntryStreamContract(StreamContract):
    """Runs of entries: cut ``task_records`` at a time, appended by :func:`pdps.streams.append`."""

    def test_only_full_cuts_without_flush_and_the_tail_with_it(self, harness):
        harness.append(records(0, 10))
        start = harness.source.start_cursor()
        full = harness.poll(start, task_records=4, max_tasks=5, flush=False)
        assert [c.records for c in full.cuts] == [4, 4] and full.backlog == 2
        assert harness.poll(full.cursor, task_records=4, max_tasks=5, flush=False) == Arrivals((), full.cursor, 2)
        tail = harness.poll(full.cursor, task_records=4, max_tasks=5, flush=True)
        assert [c.records for c in tail.cuts] == [2] and tail.backlog == 0
        np.testing.assert_array_equal(read_cuts(harness, full.cuts + tail.cuts), np.arange(10))

    def test_max_tasks_bounds_a_poll_and_the_backlog_stays_exact(self, harness):
        harness.append(records(0, 20))
        got = harness.poll(harness.source.start_cursor(), task_records=3, max_tasks=2, flush=True)
        assert [c.records for c in got.cuts] == [3, 3] and got.backlog == 14
        again = harness.poll(got.cursor, task_records=3, max_tasks=2, flush=True)
        assert [c.records for c in again.cuts] == [3, 3] and again.backlog == 8

    def test_a_source_that_never_saw_the_cursor_learns_the_backlog_at_the_end(self, harness):
        harness.append(records(0, 12))
        mid = harness.poll(harness.source.start_cursor(), task_records=2, max_tasks=1, flush=False).cursor
        other = harness.open(harness.url)  # a new master, from a persisted cursor
        far = other.poll(mid, task_records=2, max_tasks=1, flush=False)
        assert far.backlog is None  # more than one poll's worth after a cursor it cannot place
        end = other.poll(far.cursor, task_records=2, max_tasks=10, flush=False)
        assert sum(c.records for c in end.cuts) == 8 and end.backlog == 0
        harness.append(records(12, 9))
        after = other.poll(end.cursor, task_records=2, max_tasks=1, flush=False)
        assert after.backlog == 7

    def test_append_returns_the_ids_in_order(self, harness):
        from pdps import streams

        ids = streams.append(harness.url, records(0, 3))
        assert len(ids) == 3 == len(set(ids))
        (cut,) = harness.poll(harness.source.start_cursor(), task_records=3, max_tasks=1, flush=False).cuts
        assert cut.location.endswith(f"#{ids[0]}..{ids[-1]}")

    def test_an_append_that_disagrees_with_the_schema_is_refused_before_writing(self, harness):
        from pdps import streams

        harness.append(records(0, 2))
        bad = [
            {"x": records(0, 1)["x"].astype(np.float64), "y": np.arange(1)},  # another dtype
            {"x": np.zeros((1, 4), np.float32), "y": np.arange(1)},  # another shape
            {"x": records(0, 1)["x"]},  # a column missing
            {"x": np.zeros((2, 3), np.float32), "y": np.arange(1)},  # lengths differ
        ]
        for columns in bad:
            with pytest.raises(ConfigError):
                streams.append(harness.url, columns)
        got = harness.poll(harness.source.start_cursor(), task_records=1, max_tasks=10, flush=True)
        assert len(got.cuts) == 2

    def test_the_url_schema_must_agree_with_the_stored_one(self, harness):
        harness.append(records(0, 2))
        (cut,) = harness.poll(harness.source.start_cursor(), task_records=2, max_tasks=1, flush=False).cuts
        same = harness.open(harness.url + "?schema=x:float32[3],y:int64")
        np.testing.assert_array_equal(read_whole(same, task_of(cut))["y"], [0, 1])
        other = harness.open(harness.url + "?schema=x:float32[4],y:int64")
        with pytest.raises(DatasetError, match=r"x:float32\[3\]"):
            read_whole(other, task_of(cut))

    def test_a_count_that_differs_from_the_cut_names_the_task(self, harness):
        harness.append(records(0, 6))
        (cut,) = harness.poll(harness.source.start_cursor(), task_records=6, max_tasks=1, flush=True).cuts
        harness.remove(cut)
        with pytest.raises(DatasetError, match="task 3 .* holds 5 entries, its task says 6"):
            next(iter(harness.source.read(task_of(cut, 3), batch_size=2)))

    def test_a_cut_of_another_stream_is_refused(self, harness):
        harness.append(records(0, 2))
        (cut,) = harness.poll(harness.source.start_cursor(), task_records=2, max_tasks=1, flush=False).cuts
        stranger = TaskSpec(id=9, location=cut.location.replace("#", "-other#"), part=0, records=2)
        with pytest.raises(DatasetError, match="task 9"):
            read_whole(harness.source, stranger)
