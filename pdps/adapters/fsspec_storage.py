"""The Storage port over fsspec: ``file:///abs/path``, ``memory://name``, ``s3://bucket/prefix``.

What this module owns: turning a relative object path into a filesystem path under one
root (and refusing paths that would escape it), making ``put`` atomic on each kind of
filesystem, and translating fsspec/OS exceptions into :class:`StorageError`.

How ``put`` stays atomic:

* local files: the bytes go to a temporary name in the target's directory, are
  fsynced, and are renamed over the target (``os.replace``), so a reader or a crash
  sees the old file or the new one. A crash can leave the temporary file behind;
  its name starts with ``.pdps-tmp-`` and ``list`` never returns it.
* ``memory://`` and object stores (S3, GCS, Azure): one ``pipe_file`` call; the
  object only becomes visible when its upload completes.

Other filesystems (sftp, hdfs, ...) are refused: their writes are visible while in
progress and their rename semantics vary, so the port's contract would not hold.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import attrs
import fsspec
from fsspec.implementations.local import LocalFileSystem

from pdps.core.errors import ConfigError, MissingExtraError, PdpsError, StorageError

#: Prefix of the temporary files ``put`` writes on local filesystems. Object paths may
#: not start a component with it, so ``list`` can drop leftovers of crashed writers.
TEMP_PREFIX = ".pdps-tmp-"

# Filesystems on which a single pipe_file() is atomic for readers: the object appears
# whole when the (possibly multipart) upload completes, never as a prefix.
_ATOMIC_PIPE_PROTOCOLS = frozenset({"memory", "s3", "s3a", "gs", "gcs", "abfs", "abfss", "az"})

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
        self.__attrs_init__(url=url, fs=fs, root=root.rstrip("/"), local=local)

    def put(self, path: str, data: bytes) -> None:
        full = self._full(_check_path(path))
        with self._translate("write", path):
            if not self._local:
                self.fs.pipe_file(full, bytes(data))
                return
            self._put_local(full, data)

    def get(self, path: str) -> bytes:
        full = self._full(_check_path(path))
        with self._translate("read", path):
            return self.fs.cat_file(full)

    def exists(self, path: str) -> bool:
        full = self._full(_check_path(path))
        with self._translate("check", path):
            return self.fs.isfile(full)

    def list(self, prefix: str = "") -> list[str]:
        _check_prefix(prefix)
        # Walk only the folder the prefix names; its last partial component is a filter.
        folder = prefix.rpartition("/")[0]
        start = self._full(folder) if folder else (self._root or "/")
        with self._translate("list", prefix):
            found = self.fs.find(start, withdirs=False)
        out = []
        for p in found:
            rel = self._relative(p)
            if rel is None or not rel.startswith(prefix):
                continue
            if any(part.startswith(TEMP_PREFIX) for part in rel.split("/")):
                continue
            out.append(rel)
        return sorted(out)

    def delete(self, path: str) -> None:
        full = self._full(_check_path(path))
        with self._translate("delete", path):
            try:
                self.fs.rm_file(full)
            except (FileNotFoundError, IsADirectoryError):
                # The contract: deleting what is not there is a no-op, and a folder is
                # not an object (as on S3, where deleting a prefix's key removes nothing).
                pass

    def _put_local(self, full: str, data: bytes) -> None:
        parent, _, name = full.rpartition("/")
        # Same directory as the target, so the rename never crosses a filesystem.
        # The name is kept for whoever finds a leftover, cut so the whole fits in 255 bytes.
        tmp = f"{parent}/{TEMP_PREFIX}{uuid.uuid4().hex}-{name[:200]}"
        self.fs.makedirs(parent, exist_ok=True)
        try:
            with self.fs.open(tmp, "wb") as f:
                f.write(data)
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

    def _full(self, rel: str) -> str:
        return f"{self._root}/{rel}"

    def _relative(self, found: str) -> str | None:
        head = self._root + "/"
        return found[len(head):] if found.startswith(head) else None

    def _url_of(self, rel: str) -> str:
        sep = "" if self.url.endswith("/") or not rel else "/"
        return f"{self.url}{sep}{rel}"

    @contextmanager
    def _translate(self, action: str, rel: str) -> Iterator[None]:
        try:
            yield
        except PdpsError:
            raise
        except Exception as exc:  # fsspec backends raise OSError, botocore errors, ...
            if action == "read" and isinstance(exc, FileNotFoundError):
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


def _check_path(path: str) -> str:
    if not isinstance(path, str) or not path:
        raise StorageError(f"storage path must be a non-empty string, got {path!r}")
    for part in _parts(path, "storage path"):
        if not part:
            raise StorageError(f"storage path {path!r} has an empty component; use 'a/b', not 'a//b' or 'a/'")
    return path


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
