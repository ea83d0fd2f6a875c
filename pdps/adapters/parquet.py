"""The DataSource port over Parquet: one task per row group, via pyarrow over fsspec.

What this module owns: turning a Parquet file or a directory of ``*.parquet`` shards
into :class:`TaskSpec`s from the file footers alone (the master never reads a data
page), checking there that every column is something a trainer can use, and reading
one row group back on a trainer as numpy columns, a batch at a time. Also :func:`write_parquet_shards`,
which writes numpy columns in the layout this source reads, for demos and tests.

pyarrow is the ``parquet`` extra; importing this module without it raises
:class:`MissingExtraError`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import attrs
import fsspec
import numpy as np

from pdps.adapters.fsspec_storage import filesystem_for
from pdps.core.errors import ConfigError, DatasetError, MissingExtraError
from pdps.core.tasks import TaskSpec
from pdps.ports.data import Columns

try:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
except ImportError as exc:
    raise MissingExtraError(f"Parquet datasets need pyarrow ({exc}): pip install 'pdps[parquet]'") from exc


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
