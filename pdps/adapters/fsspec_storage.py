"""The Storage port over fsspec: ``file:///abs/path``, ``memory://name``, ``s3://bucket/prefix``.

What this module owns: turning a relative object path into a filesystem path under one
root (and refusing paths that would escape it), making ``put`` atomic on each kind of
filesystem, and translating fsspec/OS exceptions into :class:`StorageError`.

How ``put`` / ``put_chunks`` stay atomic:

* local files: the chunks are written, straight from the caller's buffers, to a
  temporary name in the target's directory, fsynced, and renamed over the target
  (``os.replace``), so a reader or a crash sees the old file or the new one. A crash
  can leave the temporary file behind; its name starts with ``.pdps-tmp-``, ``list``
  never returns it and ``leftovers`` does, with its mtime, which every write pushes
  forward.
* S3: an object smaller than :data:`STREAM_ABOVE` goes in one ``pipe_file`` (one PUT);
  a bigger one streams as a multipart upload opened with ``autocommit=False``, which
  S3 publishes only when it is completed, and which is aborted if anything fails.
* ``memory://`` and the other object stores (GCS, Azure): the chunks are joined and
  sent with one ``pipe_file``; the object only becomes visible when it is complete.
  (fsspec's memory files are visible, growing, from the moment they are opened.)

Reads: ``read_into`` fills the caller's buffer with ``readinto`` on local files (no
intermediate ``bytes``); object stores answer a ranged GET whose body is copied once
into the buffer. ``open_reader`` (beyond the port) opens an object once for many
reads at offsets: ``pread`` on one descriptor of a local file, from several threads
at once, so that a big part read in pieces keeps the kernel's read-ahead going.

Other filesystems (sftp, hdfs, ...) are refused: their writes are visible while in
progress and their rename semantics vary, so the port's contract would not hold.
"""

from __future__ import annotations

import errno
import os
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import attrs
import fsspec
from fsspec.implementations.local import LocalFileSystem

from pdps.core.errors import ConfigError, MissingExtraError, PdpsError, StorageError
from pdps.ports.storage import Leftover, Reader

#: Prefix of the temporary files ``put`` writes on local filesystems. Object paths may
#: not start a component with it, so ``list`` can drop leftovers of crashed writers.
TEMP_PREFIX = ".pdps-tmp-"

# Filesystems on which a single pipe_file() is atomic for readers: the object appears
# whole when the (possibly multipart) upload completes, never as a prefix.
_ATOMIC_PIPE_PROTOCOLS = frozenset({"memory", "s3", "s3a", "gs", "gcs", "abfs", "abfss", "az"})

# Filesystems whose files opened with autocommit=False upload in parts and publish
# the object only on commit() (discard() aborts): big objects stream without being
# joined in memory. Checked against moto's S3 server in tests/integration.
_STREAMING_PROTOCOLS = frozenset({"s3", "s3a"})

#: On S3, objects of at most this many bytes go in one PUT; bigger ones stream as a
#: multipart upload. 5 MiB is S3's smallest part size: below it, a multipart upload
#: would cost three requests for nothing.
STREAM_ABOVE = 5 * 2**20

# Which extra to install when fsspec cannot import the implementation of a scheme.
_EXTRAS = {"s3": "s3", "s3a": "s3"}


@attrs.define(init=False, eq=False)
class FsspecStorage:
    """Blobs under one fsspec root URL; paths are relative, ``/``-separated.

    ``storage_options`` go to the fsspec filesystem (``key=``, ``endpoint_url=``, ...).
    ``list(prefix)`` matches ``prefix`` as a string, like an S3 listing: ``"ckpt/"``
    lists one folder, ``"ckpt/step-"`` the objects whose path starts with it.
    """

    url: str
    fs: fsspec.AbstractFileSystem = attrs.field(repr=False)
    _root: str = attrs.field(repr=False)
    _local: bool = attrs.field(repr=False)
    _streaming: bool = attrs.field(repr=False)

    def __init__(self, url: str, **storage_options: object) -> None:
        fs, root = filesystem_for(url, **storage_options)
        protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
        local = isinstance(fs, LocalFileSystem)
        if not local and not protocols & _ATOMIC_PIPE_PROTOCOLS:
            raise ConfigError(
                f"storage URL {url!r}: pdps cannot make writes atomic on {sorted(protocols)} filesystems; "
                "use file://, memory://, s3://, gs:// or abfs://"
            )
        # "" is the filesystem root ("file:///", "memory://"); paths are joined as root + "/" + rel.
        streaming = bool(protocols & _STREAMING_PROTOCOLS)
        self.__attrs_init__(url=url, fs=fs, root=root.rstrip("/"), local=local, streaming=streaming)

    def put(self, path: str, data: bytes) -> None:
        self.put_chunks(path, (data,))

    def put_chunks(self, path: str, chunks: Iterable[object]) -> int:
        full = self._full(_check_path(path))
        source = _Chunks(chunks, self._url_of(path))
        with self._translate("write", path, source):
            if self._local:
                return self._put_local(full, source)
            if self._streaming:
                return self._put_streaming(full, source)
            data = b"".join(source)
            self.fs.pipe_file(full, data)
            return len(data)

    def get(self, path: str) -> bytes:
        full = self._full(_check_path(path))
        with self._translate("read", path):
            return self.fs.cat_file(full)

    def size(self, path: str) -> int:
        full = self._full(_check_path(path))
        with self._translate("read", path):
            return self._size(full, path)

    def read_into(self, path: str, buffer: object, offset: int = 0) -> int:
        full = self._full(_check_path(path))
        view = self._view_of(path, buffer, offset)
        with self._translate("read", path):
            if self._local:
                self._read_local(full, path, view, offset)
            else:
                self._read_remote(full, path, view, offset)
        return view.nbytes

    @contextmanager
    def open_reader(self, path: str) -> Iterator[Reader]:
        """The object at ``path`` opened once for many ``read_into(buffer, offset)`` calls.

        The port's optional :class:`~pdps.ports.storage.OpensReaders`: a checkpoint part is
        read in pieces, and on local files each :meth:`read_into` opens the file again,
        which restarts the kernel's read-ahead on a cold page cache. The reader of a local file
        holds one descriptor and reads with ``pread``, so it may be called from several
        threads at once (``reader.parallel``); an object store's reader makes one ranged
        GET per call, as :meth:`read_into` does. ``reader.size`` is the object's size when
        it was opened; the same errors as :meth:`read_into` are raised.
        """
        full = self._full(_check_path(path))
        if not self._local:
            yield _StoreReader(self, path)
            return
        with self._translate("read", path):
            fd = os.open(full, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            with self._translate("read", path):
                size = os.fstat(fd).st_size
            yield _LocalReader(self, path, fd, size)
        finally:
            os.close(fd)

    def _view_of(self, path: str, buffer: object, offset: object) -> memoryview:
        try:
            view = memoryview(buffer)  # type: ignore[arg-type]
        except TypeError:
            raise StorageError(f"read_into {self._url_of(path)}: {type(buffer).__name__} is not a buffer") from None
        if view.readonly or not view.c_contiguous:
            raise StorageError(f"read_into {self._url_of(path)} needs a writable, C-contiguous buffer")
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise StorageError(f"read_into {self._url_of(path)}: offset must be an int >= 0, got {offset!r}")
        return view

    def _size(self, full: str, rel: str) -> int:
        info = self._info(full)
        if info.get("type") != "file":
            raise FileNotFoundError(full)  # a folder is not an object
        return int(info["size"])

    def _info(self, full: str) -> dict:
        # refresh: s3fs would answer from the listing it cached at the last list(), blind
        # to objects other processes wrote, replaced or deleted since.
        return self.fs.info(full) if self._local else self.fs.info(full, refresh=True)

    def _read_local(self, full: str, rel: str, view: memoryview, offset: int) -> None:
        n = view.nbytes
        # Unbuffered: readinto goes straight from the page cache into the caller's memory.
        with open(full, "rb", buffering=0) as f:
            total = os.fstat(f.fileno()).st_size
            if total < offset + n:
                raise self._short(rel, total, offset, n)
            if offset:
                f.seek(offset)
            got = 0
            while got < n:
                k = f.readinto(view[got:])
                if not k:
                    raise StorageError(f"{self._url_of(rel)} ended at byte {offset + got} while being read; was it truncated?")
                got += k

    def _read_remote(self, full: str, rel: str, view: memoryview, offset: int) -> None:
        n = view.nbytes
        if n == 0:
            total = self._size(full, rel)  # still: the object must exist and reach offset
            if total < offset:
                raise self._short(rel, total, offset, n)
            return
        try:
            data = self.fs.cat_file(full, start=offset, end=offset + n)
        except FileNotFoundError:
            raise
        except Exception:
            # S3 refuses a range that starts past the end; say so rather than quote its XML.
            total = self._size(full, rel)
            if total < offset + n:
                raise self._short(rel, total, offset, n) from None
            raise
        if len(data) != n:
            raise self._short(rel, self._size(full, rel), offset, n)
        view[:] = data

    def _short(self, rel: str, total: int, offset: int, n: int) -> StorageError:
        return StorageError(
            f"{self._url_of(rel)} holds {total} bytes; reading {n} bytes at offset {offset} needs {offset + n}"
        )

    def exists(self, path: str) -> bool:
        full = self._full(_check_path(path))
        with self._translate("check", path):
            try:
                return self._info(full)["type"] == "file"
            except (FileNotFoundError, NotADirectoryError):  # "a/b" under an object "a": not there
                return False

    def list(self, prefix: str = "") -> list[str]:
        return sorted(rel for rel in self._find(prefix) if not _is_temporary(rel))

    def leftovers(self, prefix: str = "") -> list[Leftover]:
        if not self._local:  # only local writes go through a temporary name
            _check_prefix(prefix)
            return []
        found = self._find(prefix, detail=True)
        return [
            Leftover(rel, int(info["size"]), float(info["mtime"])) for rel, info in sorted(found.items()) if _is_temporary(rel)
        ]

    def _find(self, prefix: str, *, detail: bool = False) -> dict[str, dict]:
        """Every file whose relative path starts with ``prefix``, temporary ones included
        (with fsspec's info of each when ``detail``)."""
        _check_prefix(prefix)
        # Walk only the folder the prefix names; its last partial component is a filter.
        folder = prefix.rpartition("/")[0]
        start = self._full(folder) if folder else (self._root or "/")
        with self._translate("list", prefix):
            found = self.fs.find(start, withdirs=False, detail=detail)
        out = {}
        for p in found:
            rel = self._relative(p)
            if rel is not None and rel.startswith(prefix):
                out[rel] = found[p] if detail else {}
        return out

    def delete(self, path: str) -> None:
        self._delete_file(_check_path(path))

    def delete_leftover(self, path: str) -> None:
        self._delete_file(_check_leftover(path))

    def _delete_file(self, rel: str) -> None:
        with self._translate("delete", rel):
            try:
                self.fs.rm_file(self._full(rel))
            except (FileNotFoundError, IsADirectoryError):
                # The contract: deleting what is not there is a no-op, and a folder is
                # not an object (as on S3, where deleting a prefix's key removes nothing).
                pass

    def delete_folder(self, path: str) -> None:
        full = self._full(_check_path(path))
        if not self._local:  # object stores' folders are prefixes: gone with their last object
            return
        with self._translate("delete", path):
            try:
                os.rmdir(full)
            except (FileNotFoundError, NotADirectoryError):
                pass  # no such folder, or an object
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise

    def _put_local(self, full: str, chunks: Iterable[memoryview]) -> int:
        parent, _, name = full.rpartition("/")
        # Same directory as the target, so the rename never crosses a filesystem.
        # The name is kept for whoever finds a leftover, cut so the whole fits in 255 bytes.
        tmp = f"{parent}/{TEMP_PREFIX}{uuid.uuid4().hex}-{name[:200]}"
        self.fs.makedirs(parent, exist_ok=True)
        written = 0
        try:
            with self.fs.open(tmp, "wb") as f:
                # A buffered writer coalesces small chunks (a header) and writes big ones
                # straight from the caller's memory, without copying them.
                for chunk in chunks:
                    f.write(chunk)
                    written += chunk.nbytes
                f.flush()
                os.fsync(f.fileno())  # the bytes must be on disk before the name points at them
            # os.replace, not fs.mv: shutil.move would move the file *into* a directory
            # of the target's name, and falls back to a non-atomic copy across devices.
            os.replace(tmp, full)
        except BaseException:
            try:
                self.fs.rm_file(tmp)
            except OSError:
                pass  # already gone or never created; list() hides it either way
            raise
        _fsync_dir(parent)
        return written

    def _put_streaming(self, full: str, chunks: Iterable[memoryview]) -> int:
        it = iter(chunks)
        head: list[memoryview] = []
        size = 0
        for chunk in it:
            head.append(chunk)
            size += chunk.nbytes
            if size > STREAM_ABOVE:
                break
        else:  # small: one PUT
            self.fs.pipe_file(full, b"".join(head))
            return size
        f = self.fs.open(full, "wb", autocommit=False)
        try:
            for chunk in head:
                f.write(chunk)
            del head
            for chunk in it:
                f.write(chunk)
                size += chunk.nbytes
            f.close()  # uploads the last part; with autocommit=False nothing is published yet
            f.commit()  # completes the multipart upload: the object appears whole
        except BaseException:
            try:
                f.discard()  # aborts the multipart upload: its parts are never visible
            except Exception:  # noqa: BLE001 - the write's own error is the one to report
                pass
            finally:
                # Else the file's __del__ would close() it, which uploads what it holds.
                f.closed = True
            raise
        return size

    def _full(self, rel: str) -> str:
        return f"{self._root}/{rel}"

    def _relative(self, found: str) -> str | None:
        head = self._root + "/"
        return found[len(head):] if found.startswith(head) else None

    def _url_of(self, rel: str) -> str:
        sep = "" if self.url.endswith("/") or not rel else "/"
        return f"{self.url}{sep}{rel}"

    @contextmanager
    def _translate(self, action: str, rel: str, source: _Chunks | None = None) -> Iterator[None]:
        try:
            yield
        except PdpsError:
            raise
        except Exception as exc:  # fsspec backends raise OSError, botocore errors, ...
            if source is not None and exc is source.failure:
                raise  # the caller's chunks failed, not the storage: theirs to report
            if action == "read" and isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError)):
                raise StorageError(f"no object at {self._url_of(rel)}") from exc
            raise StorageError(
                f"could not {action} {self._url_of(rel)}: {type(exc).__name__}: {exc}"
            ) from exc


def filesystem_for(url: str, **storage_options: object) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem serving ``url`` and the path inside it, with pdps errors.

    Raises :class:`MissingExtraError` when the scheme's package is not installed and
    :class:`ConfigError` for a scheme fsspec does not know.
    """
    try:
        return fsspec.core.url_to_fs(url, **storage_options)
    except ImportError as exc:
        extra = _EXTRAS.get(url.split("://", 1)[0])
        hint = f"pip install 'pdps[{extra}]'" if extra else "install the fsspec implementation it names"
        raise MissingExtraError(f"URL {url!r} needs an optional package ({exc}): {hint}") from exc
    except ValueError as exc:  # fsspec's "Protocol not known: ..."
        raise ConfigError(f"URL {url!r} cannot be opened: {exc}") from exc


class _LocalReader:
    """One open local file: ``pread`` into the caller's buffer, from any thread."""

    parallel = True

    def __init__(self, storage: FsspecStorage, rel: str, fd: int, size: int) -> None:
        self._storage, self._rel, self._fd, self.size = storage, rel, fd, size

    def read_into(self, buffer: object, offset: int = 0) -> int:
        st, rel = self._storage, self._rel
        view = st._view_of(rel, buffer, offset)
        n = view.nbytes
        if self.size < offset + n:
            raise st._short(rel, self.size, offset, n)
        with st._translate("read", rel):
            got = 0
            while got < n:
                # preadv fills the caller's memory straight from the page cache, without
                # the GIL and without moving a shared file position.
                k = os.preadv(self._fd, [view[got:]], offset + got)
                if not k:
                    raise StorageError(f"{st._url_of(rel)} ended at byte {offset + got} while being read; was it truncated?")
                got += k
        return n


    def read_cached(self, buffer: object, offset: int = 0) -> bool:
        """Fill ``buffer`` from ``offset`` if the kernel can without waiting for the disk
        (the bytes are in the page cache): True when it did, False when it would have
        had to wait (``buffer`` then holds an unknown part; read it again)."""
        st, rel = self._storage, self._rel
        view = st._view_of(rel, buffer, offset)
        n = view.nbytes
        if self.size < offset + n or not hasattr(os, "RWF_NOWAIT"):
            return False
        got = 0
        try:
            while got < n:
                k = os.preadv(self._fd, [view[got:]], offset + got, os.RWF_NOWAIT)
                if k <= 0:
                    return False
                got += k
        except OSError:  # EAGAIN: not cached; EOPNOTSUPP: a filesystem without it
            return False
        return True


class _StoreReader:
    """An object store's object: each read is :meth:`FsspecStorage.read_into` (a ranged GET)."""

    parallel = False

    def __init__(self, storage: FsspecStorage, rel: str) -> None:
        self._storage, self._rel = storage, rel

    @property
    def size(self) -> int:  # type: ignore[override]
        return self._storage.size(self._rel)

    def read_into(self, buffer: object, offset: int = 0) -> int:
        return self._storage.read_into(self._rel, buffer, offset)


class _Chunks:
    """The caller's ``chunks`` as flat byte memoryviews of its memory (no copy).

    Remembers an exception raised by the caller's iterator (``failure``), so that
    ``put_chunks`` lets it through unchanged instead of calling it a storage failure.
    """

    def __init__(self, chunks: Iterable[object], where: str) -> None:
        self._chunks = chunks
        self._where = where
        self.failure: BaseException | None = None

    def __iter__(self) -> Iterator[memoryview]:
        it = iter(self._chunks)
        index = 0
        while True:
            try:
                chunk = next(it)
            except StopIteration:
                return
            except BaseException as exc:
                self.failure = exc
                raise
            try:
                view = memoryview(chunk)  # type: ignore[arg-type]
            except TypeError:
                raise StorageError(f"writing {self._where}: chunk {index} is a {type(chunk).__name__}, not a buffer") from None
            if not view.c_contiguous:
                raise StorageError(f"writing {self._where}: chunk {index} is not C-contiguous; copy it first")
            yield view.cast("B") if view.format != "B" or view.ndim != 1 else view
            index += 1


def _check_path(path: str) -> str:
    if not isinstance(path, str) or not path:
        raise StorageError(f"storage path must be a non-empty string, got {path!r}")
    for part in _parts(path, "storage path"):
        if not part:
            raise StorageError(f"storage path {path!r} has an empty component; use 'a/b', not 'a//b' or 'a/'")
    return path


def _check_leftover(path: str) -> str:
    if not isinstance(path, str):
        raise StorageError(f"storage path must be a string, got {path!r}")
    folder, slash, name = path.rpartition("/")
    if not name.startswith(TEMP_PREFIX) or "\\" in name:
        raise StorageError(f"storage path {path!r} names no leftover: their names start with {TEMP_PREFIX!r}")
    if slash:
        _check_path(folder)  # refuses '/x', '../x', 'a//x'
    return path


def _is_temporary(rel: str) -> bool:
    return any(part.startswith(TEMP_PREFIX) for part in rel.split("/"))


def _check_prefix(prefix: str) -> None:
    if not isinstance(prefix, str):
        raise StorageError(f"storage prefix must be a string, got {prefix!r}")
    if not prefix:
        return
    parts = _parts(prefix, "storage prefix")
    if any(not part for part in parts[:-1]):
        raise StorageError(f"storage prefix {prefix!r} has an empty component; use 'a/b/', not 'a//b/'")


def _parts(path: str, what: str) -> list[str]:
    # Paths are keys relative to the root; anything that could name a file outside it
    # (absolute paths, '..', Windows separators) is refused before any I/O.
    if path.startswith("/") or "\\" in path or "://" in path:
        raise StorageError(f"{what} {path!r} must be relative and '/'-separated, inside the storage root")
    parts = path.split("/")
    for part in parts:
        if part in (".", ".."):
            raise StorageError(f"{what} {path!r} may not contain '.' or '..' components")
        if part.startswith(TEMP_PREFIX):
            raise StorageError(f"{what} {path!r}: names starting with {TEMP_PREFIX!r} are reserved for temporary files")
    return parts


def _fsync_dir(directory: str) -> None:
    # Makes the rename itself durable. Only POSIX can open a directory for fsync.
    if not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
