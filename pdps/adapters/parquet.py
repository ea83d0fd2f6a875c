"""The DataSource port over Parquet: one task per row group, via pyarrow over fsspec.

What this module owns: turning a Parquet file or a directory of ``*.parquet`` shards
into :class:`TaskSpec`s from the file footers alone (the master never reads a data
page), checking there that every column is something a trainer can use, and reading
one row group back on a trainer as numpy columns, a batch at a time. Also :func:`write_parquet_shards`,
which writes numpy columns in the layout this source reads, for demos and tests.

:class:`ParquetFollowSource` (a URL with ``?follow=1``) follows a directory that keeps
growing: a streaming source whose cuts are the row groups of new files, taken in name
order once each file is complete (see its docstring). :func:`open_parquet_source`
picks one of the two by URL.

pyarrow is the ``parquet`` extra; importing this module without it raises
:class:`MissingExtraError`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from urllib.parse import parse_qs

import attrs
import fsspec
import numpy as np

from pdps.adapters.fsspec_storage import filesystem_for
from pdps.core.errors import ConfigError, DatasetError, MissingExtraError
from pdps.core.tasks import TaskSpec
from pdps.ports.data import Arrivals, Columns, Cut

try:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
except ImportError as exc:
    raise MissingExtraError(f"Parquet datasets need pyarrow ({exc}): pip install 'pdps[parquet]'") from exc

log = logging.getLogger(__name__)


@attrs.define(init=False, eq=False)
class ParquetSource:
    """A Parquet file, or a directory whose ``*.parquet`` files are the shards, in name order.

    ``url`` is any fsspec URL or a plain local path; ``storage_options`` go to the
    fsspec filesystem. Files whose name starts with ``_`` or ``.`` are ignored, as
    Spark and pyarrow do (``_SUCCESS``, ``.part-0.parquet.crc``, unfinished writes).
    """

    url: str
    fs: fsspec.AbstractFileSystem = attrs.field(repr=False)
    _path: str = attrs.field(repr=False)
    _storage_options: dict = attrs.field(repr=False)

    def __init__(self, url: str, **storage_options: object) -> None:
        fs, path = filesystem_for(url, **storage_options)
        self.__attrs_init__(url=url, fs=fs, path=path, storage_options=storage_options)

    def tasks(self) -> list[TaskSpec]:
        """One task per non-empty row group, ids ``0..n-1`` in file-name then row-group order.

        Reads only footers. Raises :class:`DatasetError` for a missing path, a directory
        without Parquet files, a file that is not Parquet, files whose schemas differ, a
        column that is not numeric (or a list of numbers), or a dataset with no rows.
        """
        tasks: list[TaskSpec] = []
        first: tuple[str, list[tuple[str, str]]] | None = None
        for path in self._files():
            location = self.fs.unstrip_protocol(path)
            try:
                with self.fs.open(path, "rb") as f:
                    pf = pq.ParquetFile(f)  # parses the footer, reads no data page
                    meta, schema = pf.metadata, pf.schema_arrow
            except (pa.ArrowInvalid, OSError) as exc:
                raise DatasetError(
                    f"{location} is not a Parquet file or cannot be read ({exc}); "
                    "remove it from the dataset or fix the URL"
                ) from exc
            columns = [(field.name, _column_kind(field, location)) for field in schema]
            if first is None:
                first = (location, columns)
            elif columns != first[1]:
                raise DatasetError(
                    f"{location} has columns {columns}, but {first[0]} has {first[1]}; "
                    "every file of a dataset needs the same columns"
                )
            for group in range(meta.num_row_groups):
                rows = meta.row_group(group).num_rows
                if rows:  # an empty row group would be a task that trains on nothing
                    tasks.append(TaskSpec(id=len(tasks), location=location, part=group, records=rows))
        if not tasks:
            raise DatasetError(f"dataset {self.url} has no rows")
        return tasks

    def read(self, task: TaskSpec, *, start: int = 0, batch_size: int) -> Iterator[Columns]:
        """Rows ``[start, task.records)`` of the task's row group in batches of ``batch_size``
        rows: numbers 1-D, lists of numbers 2-D (rows x width, one width per task).

        pyarrow decodes ``batch_size`` rows at a time; the rows before ``start`` are
        decoded and dropped a batch at a time (Parquet pages cannot be skipped by row).
        """
        fs, path = filesystem_for(task.location, **self._storage_options)
        where = f"{task.location} row group {task.part}"
        widths: dict[str, int] = {}
        try:
            with fs.open(path, "rb") as f:
                pf = pq.ParquetFile(f)
                groups = pf.metadata.num_row_groups
                if not 0 <= task.part < groups:
                    raise DatasetError(
                        f"{where} does not exist (the file has {groups}); "
                        "the dataset changed after its tasks were made: restart the job"
                    )
                rows = pf.metadata.row_group(task.part).num_rows
                if rows != task.records:
                    raise DatasetError(
                        f"{where} has {rows} rows, its task says {task.records}; "
                        "the dataset changed after its tasks were made: restart the job"
                    )
                pieces = pf.iter_batches(row_groups=[task.part], batch_size=batch_size)
                for table in _rebatched(pieces, skip=start, size=batch_size):
                    yield {name: _to_numpy(table.column(name), name, where, widths) for name in table.column_names}
        except (pa.ArrowInvalid, OSError) as exc:
            raise DatasetError(f"cannot read {where}: {exc}") from exc

    def _files(self) -> list[str]:
        try:
            if not self.fs.exists(self._path):
                raise DatasetError(f"no dataset at {self.url}: the path does not exist")
            if not self.fs.isdir(self._path):
                return [self._path]  # named explicitly: taken whatever its suffix
            entries = self.fs.ls(self._path, detail=True)
        except OSError as exc:
            raise DatasetError(f"cannot list dataset {self.url}: {exc}") from exc
        files = sorted(
            e["name"]
            for e in entries
            if e["type"] == "file"
            and e["name"].endswith(".parquet")
            and not e["name"].rpartition("/")[2].startswith(("_", "."))
        )
        if not files:
            raise DatasetError(f"dataset directory {self.url} has no *.parquet files")
        return files


def _split_cursor(cursor: str) -> tuple[str, int | None]:
    """A follow cursor as (file name, last row group taken, None when the file was taken whole)."""
    name, sep, group = cursor.rpartition("#")
    if sep and name.endswith(".parquet") and group.isascii() and group.isdigit():
        return name, int(group)
    return cursor, None


def open_parquet_source(url: str, **storage_options: object) -> ParquetSource | ParquetFollowSource:
    """The data source of a Parquet URL: :class:`ParquetFollowSource` when its query
    has ``follow=``, else :class:`ParquetSource` (the URL as given)."""
    base, sep, query = url.partition("?")
    if sep and "follow" in parse_qs(query, keep_blank_values=True):
        return ParquetFollowSource(url, **storage_options)
    return ParquetSource(url, **storage_options)


#: Files after the cursor a poll looks at (signatures, footers): bounds its work and
#: the map of candidates; a backlog beyond them is reported as unknown.
CANDIDATES = 1000
_LATE_NAMES = 20  # late files named in ``late_names`` (all are counted)


@attrs.define(eq=False)
class _Candidate:
    signature: tuple  # size and mtime (ETag on S3) at the poll that saw it first
    since: float  # when that poll ran
    groups: tuple[int, ...] | None = None  # rows per row group, once the footer parsed


@attrs.define(init=False, eq=False)
class ParquetFollowSource:
    """A directory of Parquet files that keeps growing, as a streaming source.

    URL: any fsspec URL of a directory with ``?follow=1`` and optionally
    ``poll_seconds=S`` (default 1.0). Files are the ``*.parquet`` files under it, at
    any depth, whose path has no part starting with ``_`` or ``.``, ordered by their
    path below the directory (``dt=2024-05-01/hour=07/part-0.parquet`` layouts sort
    in time order).

    * The cursor is the last file taken (``""`` before the first), or
      ``NAME#G`` when a poll stopped at ``max_tasks`` after row group ``G`` of it.
    * ``poll`` takes the files after the cursor in name order up to the first one not
      complete (head of line: ``stalled`` names it). Each non-empty row group of a
      file taken is one cut (``task_records`` does not split row groups, ``flush`` does
      not matter). A file is complete when its footer parses and its size and mtime
      (ETag on S3) have not changed since a poll at least ``poll_seconds`` earlier:
      files are never read half-written, whether they were written in place or under
      a ``_``/``.`` name and renamed.
    * A file that appears with a name at or before the cursor is never trained: it is
      counted in ``late_files`` (and the last few named in ``late_names``) and logged
      as an error once. Producers must land files in name order. This source notices
      late files among those listed after its first poll.
    * ``backlog`` is the rows of the complete files (and row groups) after the cursor
      not cut yet; files still being written are not counted; None when more than
      :data:`CANDIDATES` files wait.
    * ``read`` is :class:`ParquetSource`'s: a file rewritten after it was cut (another
      row count) or removed fails its task with DatasetError.
    """

    url: str
    poll_seconds: float
    late_files: int
    late_names: list[str]
    fs: fsspec.AbstractFileSystem = attrs.field(repr=False)
    _root: str = attrs.field(repr=False)
    _batch: ParquetSource = attrs.field(repr=False)
    _clock: Callable[[], float] = attrs.field(repr=False)
    _candidates: dict[str, _Candidate] = attrs.field(repr=False)
    _seen: set[str] | None = attrs.field(repr=False)  # names listed by the previous poll
    _columns: tuple[str, list] | None = attrs.field(repr=False)  # the first file's, to compare

    def __init__(self, url: str, *, clock: Callable[[], float] = time.monotonic, **storage_options: object) -> None:
        base, _, query = url.partition("?")
        opts = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
        unknown = set(opts) - {"follow", "poll_seconds"}
        if unknown:
            raise ConfigError(f"unknown option(s) {sorted(unknown)} in {url!r}; known: ['follow', 'poll_seconds']")
        if opts.get("follow") not in ("1", "true"):
            raise ConfigError(f"follow={opts.get('follow')!r} in {url!r}: write follow=1 to follow a growing directory, or leave it out")
        try:
            poll_seconds = float(opts.get("poll_seconds", "1.0"))
        except ValueError:
            poll_seconds = -1.0
        if not poll_seconds >= 0:
            raise ConfigError(f"poll_seconds in {url!r} must be a number of seconds >= 0, got {opts['poll_seconds']!r}")
        batch = ParquetSource(base, **storage_options)
        self.__attrs_init__(
            url=url, poll_seconds=poll_seconds, late_files=0, late_names=[], fs=batch.fs, root=batch._path.rstrip("/"),
            batch=batch, clock=clock, candidates={}, seen=None, columns=None,
        )  # fmt: skip

    def start_cursor(self) -> str:
        return ""

    def tasks(self) -> list[TaskSpec]:
        """Refused: a followed directory has no fixed list of tasks; the master cuts them with :meth:`poll`."""
        raise DatasetError(
            f"{self.url} is a stream (follow=1): it has no fixed list of tasks; run the job in stream mode, "
            "or drop follow=1 to train on the files there now"
        )

    def read(self, task: TaskSpec, *, start: int = 0, batch_size: int) -> Iterator[Columns]:
        return self._batch.read(task, start=start, batch_size=batch_size)

    def poll(self, cursor: str, *, task_records: int, max_tasks: int, flush: bool) -> Arrivals:
        if task_records < 1 or max_tasks < 1:
            raise ConfigError(f"poll needs task_records >= 1 and max_tasks >= 1, got {task_records} and {max_tasks}")
        name, after_group = _split_cursor(cursor)
        now = self._clock()
        listing = self._listing()
        self._note_late(listing, name)
        walk = ([name] if after_group is not None else []) + sorted(rel for rel in listing if rel > name)
        cuts: list[Cut] = []
        new_cursor, stalled, backlog = cursor, None, 0
        for rel in walk[:CANDIDATES]:
            if after_group is not None and rel == name:  # the file the cursor stopped in: complete when cut
                groups = self._groups(rel, listing.get(rel))
                if groups is None:
                    new_cursor = rel  # it is gone: nothing more to cut from it
                    continue
                first = after_group + 1
            else:
                groups, why = self._complete(rel, listing[rel], now)
                if groups is None:
                    stalled = stalled or why  # head of line: later files wait for it
                    continue
                first = 0
            todo = [g for g in range(first, len(groups)) if groups[g]]  # an empty row group trains nothing
            room = 0 if stalled is not None else max_tasks - len(cuts)
            if room <= 0:
                backlog += sum(groups[g] for g in todo)
                continue
            take, rest = todo[:room], todo[room:]
            location = self.fs.unstrip_protocol(f"{self._root}/{rel}")
            cuts += [Cut(location=location, part=g, records=groups[g]) for g in take]
            backlog += sum(groups[g] for g in rest)
            new_cursor = f"{rel}#{take[-1]}" if rest else rel
        # Files at or before the cursor polled are done; the ones after it are kept even
        # if cut now: nothing is persisted yet, the same cursor may be polled again.
        self._candidates = {rel: c for rel, c in self._candidates.items() if rel in listing and rel > name}
        unknown = len(walk) > CANDIDATES
        return Arrivals(cuts=tuple(cuts), cursor=new_cursor, backlog=None if unknown else backlog, stalled=stalled)

    def _listing(self) -> dict[str, dict]:
        """Relative name -> fsspec info of the files that belong to the dataset."""
        try:
            self.fs.invalidate_cache(self._root)  # s3fs keeps listings: a poll must see new files
            found = self.fs.find(self._root, detail=True)
        except OSError as exc:
            raise DatasetError(f"cannot list {self.url}: {exc}") from exc
        out = {}
        for path, info in found.items():
            rel = path[len(self._root) :].lstrip("/")
            if info.get("type") == "file" and rel.endswith(".parquet") and not any(p.startswith(("_", ".")) for p in rel.split("/")):
                out[rel] = info
        return out

    def _note_late(self, listing: dict[str, dict], name: str) -> None:
        if self._seen is not None:
            for rel in sorted(listing):
                if rel <= name and rel not in self._seen:
                    self.late_files += 1
                    self.late_names = [*self.late_names, rel][-_LATE_NAMES:]
                    log.error(
                        "%s appeared in %s at or before the files already taken (up to %s): it will not be trained; "
                        "land files in name order", rel, self.url, name,
                    )  # fmt: skip
        self._seen = set(listing)

    def _complete(self, rel: str, info: dict, now: float) -> tuple[tuple[int, ...] | None, str | None]:
        """The file's rows per row group if it is complete, else None and why not."""
        signature = (info.get("size"), info.get("ETag"), info.get("mtime"), str(info.get("LastModified")))
        c = self._candidates.get(rel)
        if c is None or c.signature != signature:
            self._candidates[rel] = _Candidate(signature, now)
            return None, f"{rel} is new or still changing: waiting until it stays unchanged for {self.poll_seconds}s"
        if now - c.since < self.poll_seconds:
            return None, f"{rel} has not stayed unchanged for {self.poll_seconds}s yet"
        if c.groups is None:
            try:
                c.groups = self._groups(rel, info, check=True)
            except DatasetError as exc:
                return None, str(exc)
        return c.groups, None

    def _groups(self, rel: str, info: dict | None, *, check: bool = False) -> tuple[int, ...] | None:
        """Rows per row group from the footer (None for a file that is gone); with
        ``check``, DatasetError for a file without a footer or with unusable columns."""
        if info is None:
            return None
        location = self.fs.unstrip_protocol(f"{self._root}/{rel}")
        try:
            with self.fs.open(f"{self._root}/{rel}", "rb") as f:
                pf = pq.ParquetFile(f)
                meta, schema = pf.metadata, pf.schema_arrow
        except (pa.ArrowInvalid, OSError) as exc:
            raise DatasetError(f"{rel} has no readable Parquet footer yet (still being written, or truncated): {exc}") from exc
        if check:
            columns = [(field.name, _column_kind(field, location)) for field in schema]
            if self._columns is None:
                self._columns = (rel, columns)
            elif columns != self._columns[1]:
                raise DatasetError(f"{rel} has columns {columns}, but {self._columns[0]} has {self._columns[1]}; every file needs the same columns")
        return tuple(meta.row_group(g).num_rows for g in range(meta.num_row_groups))


def write_parquet_shards(
    columns: Mapping[str, np.ndarray],
    url: str,
    *,
    shards: int,
    row_group_size: int,
    overwrite: bool = False,
    **storage_options: object,
) -> list[str]:
    """Write numpy columns as ``part-00000.parquet``, ... under ``url``; return the files' URLs.

    Rows are split into ``shards`` contiguous, near-equal files, each cut into row
    groups of ``row_group_size`` rows. 1-D columns stay scalar; 2-D ones become
    ``fixed_size_list`` columns of their dtype. Existing ``*.parquet`` files under
    ``url`` would become part of the dataset, so they are refused unless ``overwrite``,
    which deletes them first.
    """
    if not columns:
        raise ConfigError("write_parquet_shards needs at least one column")
    lengths = {name: len(arr) for name, arr in columns.items()}
    if len(set(lengths.values())) != 1:
        raise ConfigError(f"columns have different lengths {lengths}; every column needs one value per row")
    rows = next(iter(lengths.values()))
    if not 1 <= shards <= rows:
        raise ConfigError(f"shards={shards} must be between 1 and the number of rows ({rows})")
    if row_group_size < 1:
        raise ConfigError(f"row_group_size={row_group_size} must be at least 1")
    arrays = {name: _to_arrow(np.asarray(arr), name) for name, arr in columns.items()}

    fs, root = filesystem_for(url, **storage_options)
    root = root.rstrip("/")
    existing = sorted(fs.glob(f"{root}/*.parquet"))
    if existing and not overwrite:
        raise DatasetError(
            f"{url} already holds {len(existing)} Parquet file(s), e.g. {fs.unstrip_protocol(existing[0])}; "
            "write elsewhere or pass overwrite=True"
        )
    for path in existing:
        fs.rm_file(path)
    fs.makedirs(root, exist_ok=True)
    table = pa.table(arrays)
    out = []
    bounds = np.linspace(0, rows, shards + 1).astype(int)
    for shard, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        path = f"{root}/part-{shard:05d}.parquet"
        with fs.open(path, "wb") as f:
            pq.write_table(table.slice(lo, hi - lo), f, row_group_size=row_group_size)
        out.append(fs.unstrip_protocol(path))
    return out


def _column_kind(field: pa.Field, location: str) -> str:
    """``"int64"``, ``"list<float>[3]"``, ... ; DatasetError for what numpy training cannot use."""
    t = field.type
    if _is_number(t):
        return str(t)
    if pa.types.is_fixed_size_list(t) and _is_number(t.value_type):
        return f"list<{t.value_type}>[{t.list_size}]"
    if (pa.types.is_list(t) or pa.types.is_large_list(t)) and _is_number(t.value_type):
        return f"list<{t.value_type}>"
    raise DatasetError(
        f"column {field.name!r} of {location} has type {t}; pdps reads numbers and lists of numbers "
        "only: drop or encode that column when writing the dataset"
    )


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _rebatched(pieces: Iterable[pa.RecordBatch], *, skip: int, size: int) -> Iterator[pa.Table]:
    """The rows after the first ``skip`` as tables of ``size`` rows, the last one fewer,
    whatever sizes pyarrow's batches come in; holds less than two of them at a time."""
    held: list[pa.RecordBatch] = []
    count = 0
    for piece in pieces:
        if skip >= piece.num_rows:
            skip -= piece.num_rows
            continue
        piece, skip = piece.slice(skip), 0
        held.append(piece)
        count += piece.num_rows
        while count >= size:
            table = pa.Table.from_batches(held)
            yield table.slice(0, size)
            rest = table.slice(size)
            held, count = rest.to_batches(), rest.num_rows
    if count:
        yield pa.Table.from_batches(held)


def _to_numpy(column: pa.ChunkedArray, name: str, where: str, widths: dict[str, int]) -> np.ndarray:
    """One column of a batch as numpy; ``widths`` holds each list column's width in the
    task's batches so far, which every later batch must match."""
    arr = column.combine_chunks()
    if arr.null_count:
        raise DatasetError(f"column {name!r} of {where} has {arr.null_count} missing values; fill them when writing")
    n = len(arr)
    if _is_number(arr.type):
        # writable: trainers normalise in place and torch.from_numpy warns on read-only arrays
        return arr.to_numpy(zero_copy_only=False, writable=True)
    if pa.types.is_fixed_size_list(arr.type):
        width = arr.type.list_size
    else:
        lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False)
        width = widths.setdefault(name, int(lengths[0]) if n else 0)
        if n and (lengths != width).any():
            low, high = min(int(lengths.min()), width), max(int(lengths.max()), width)
            raise DatasetError(
                f"column {name!r} of {where} has lists of lengths {low}..{high}; "
                "a list column must have one length per row group to become a 2-D array"
            )
    values = arr.flatten()  # honours the array's offset, unlike .values
    if values.null_count:
        raise DatasetError(f"column {name!r} of {where} has {values.null_count} missing list items; fill them when writing")
    return values.to_numpy(zero_copy_only=False, writable=True).reshape(n, width)


def _to_arrow(arr: np.ndarray, name: str) -> pa.Array:
    if not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_) or np.iscomplexobj(arr):
        raise ConfigError(f"column {name!r} has dtype {arr.dtype}; write_parquet_shards takes numbers only")
    if arr.ndim == 1:
        return pa.array(arr)
    if arr.ndim == 2:
        flat = pa.array(np.ascontiguousarray(arr).reshape(-1))
        return pa.FixedSizeListArray.from_arrays(flat, arr.shape[1])
    raise ConfigError(f"column {name!r} has shape {arr.shape}; write_parquet_shards takes 1-D or 2-D arrays")
