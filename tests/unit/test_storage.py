"""FsspecStorage on file:// and memory:// against the Storage contract, plus what is local-only."""

from __future__ import annotations

import errno
import importlib
import os
import subprocess
import sys
import textwrap
import uuid

import fsspec
import pytest

from pdps.adapters.fsspec_storage import TEMP_PREFIX, FsspecStorage
from pdps.core.errors import ConfigError, MissingExtraError, StorageError
from pdps.ports.storage import CachedReads, OpensReaders, Reader
from tests.unit.contract_storage import ProducerFailed, StorageContract


class _HalfWrittenFile:
    """Wraps a file being written: the first write sends half its bytes, then the disk is full."""

    def __init__(self, f):
        self._f = f

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self._f.close()  # what is written so far stays written, as after a real failure
        return False

    def write(self, data):
        self._f.write(data[: len(data) // 2])
        self._f.flush()
        raise OSError(errno.ENOSPC, "No space left on device (simulated)")

    def __getattr__(self, name):
        return getattr(self._f, name)

    @property
    def closed(self):
        return self._f.closed

    @closed.setter
    def closed(self, value):
        self._f.closed = value


class _FsspecContract(StorageContract):
    def break_next_put(self, storage, monkeypatch):
        fs = storage.fs
        real_open = fs.open

        def open_half_writing(path, mode="rb", **kwargs):
            f = real_open(path, mode, **kwargs)
            return _HalfWrittenFile(f) if "w" in mode or "a" in mode else f

        def failing_pipe(*args, **kwargs):
            # a single upload that fails is never visible: nothing reaches the store
            raise OSError(errno.ECONNRESET, "connection reset during upload (simulated)")

        monkeypatch.setattr(fs, "open", open_half_writing)
        monkeypatch.setattr(fs, "pipe_file", failing_pipe)
        monkeypatch.setattr(fs, "pipe", failing_pipe)

    def test_failed_put_says_why(self, storage, monkeypatch):
        self.break_next_put(storage, monkeypatch)
        with pytest.raises(StorageError) as info:
            storage.put("x", b"12345678")
        assert isinstance(info.value.__cause__, OSError)
        assert storage.url in str(info.value)

    def test_write_that_cannot_start_reports_its_own_cause(self, storage, monkeypatch):
        def refuse(*args, **kwargs):
            raise PermissionError(errno.EACCES, "Permission denied (simulated)")

        for name in ["open", "pipe_file", "pipe"]:
            monkeypatch.setattr(storage.fs, name, refuse)
        with pytest.raises(StorageError, match="could not write") as info:
            storage.put("x", b"1")
        assert isinstance(info.value.__cause__, PermissionError)

    def test_failed_delete_is_a_storage_error(self, storage, monkeypatch):
        storage.put("x", b"1")

        def refuse(*args, **kwargs):
            raise PermissionError(errno.EACCES, "Permission denied (simulated)")

        monkeypatch.setattr(storage.fs, "rm_file", refuse)
        with pytest.raises(StorageError, match="could not delete .*x"):
            storage.delete("x")

    def test_a_second_instance_sees_the_same_objects(self, storage):
        storage.put("a/b", b"shared")
        again = FsspecStorage(storage.url)
        assert again.get("a/b") == b"shared"
        assert again.list() == ["a/b"]

    @pytest.mark.parametrize("path", [TEMP_PREFIX + "x", "a/" + TEMP_PREFIX + "x"])
    def test_temporary_names_are_reserved(self, storage, path):
        with pytest.raises(StorageError, match="reserved"):
            storage.put(path, b"x")


class _FsspecReaderContract(_FsspecContract):
    # open_reader: beyond the port, one object opened for many reads at offsets.
    def test_open_reader_reads_pieces_at_offsets(self, storage):
        data = bytes(range(256)) * 40
        storage.put("dir/blob", data)
        with storage.open_reader("dir/blob") as reader:
            assert reader.size == len(data)
            buf = bytearray(len(data))
            for start in range(0, len(data), 1000):
                piece = memoryview(buf)[start : start + 1000]
                assert reader.read_into(piece, start) == piece.nbytes
            assert bytes(buf) == data
            with pytest.raises(StorageError, match="holds 10240 bytes"):
                reader.read_into(bytearray(10), len(data) - 5)
            with pytest.raises(StorageError, match="writable"):
                reader.read_into(b"0123", 0)

    def test_open_reader_is_a_declared_capability(self, storage):
        storage.put("blob", b"x" * 10)
        assert isinstance(storage, OpensReaders)
        with storage.open_reader("blob") as reader:
            assert isinstance(reader, Reader)
            # only a local file's reader can ask the page cache (RWF_NOWAIT)
            assert isinstance(reader, CachedReads) == storage.url.startswith("file://")

    def test_open_reader_of_a_missing_object_names_it(self, storage):
        with pytest.raises(StorageError, match="nothing-here"):
            with storage.open_reader("nothing-here") as reader:
                reader.read_into(bytearray(1), 0)


class TestFileStorage(_FsspecReaderContract):
    @pytest.fixture
    def storage(self, tmp_path):
        return FsspecStorage(f"file://{tmp_path}/root")

    def test_read_cached_reads_what_the_page_cache_holds(self, storage):
        data = os.urandom(1 << 16)
        storage.put("blob", data)
        buf = bytearray(1000)
        with storage.open_reader("blob") as reader:
            if reader.read_cached(buf, 5):  # just written: in the page cache (if the kernel can say)
                assert bytes(buf) == data[5:1005]
            assert not reader.read_cached(bytearray(10), len(data) - 5)  # past the end: never

    def test_open_reader_of_a_local_file_reads_from_threads_at_once(self, storage):
        from concurrent.futures import ThreadPoolExecutor

        data = os.urandom(1 << 20)
        storage.put("blob", data)
        buf = bytearray(len(data))
        with storage.open_reader("blob") as reader:
            assert reader.parallel
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda s: reader.read_into(memoryview(buf)[s : s + 4096], s), range(0, len(data), 4096)))
        assert bytes(buf) == data

    def test_plain_path_and_file_url_name_the_same_root(self, tmp_path):
        FsspecStorage(str(tmp_path)).put("k", b"v")
        assert FsspecStorage(f"file://{tmp_path}").get("k") == b"v"

    def test_put_creates_parent_folders(self, storage, tmp_path):
        storage.put("x/y/z.bin", b"deep")
        assert (tmp_path / "root" / "x" / "y" / "z.bin").read_bytes() == b"deep"

    def test_put_over_a_folder_fails_instead_of_writing_into_it(self, storage, tmp_path):
        storage.put("d/inner", b"1")
        with pytest.raises(StorageError):
            storage.put("d", b"2")
        assert storage.list() == ["d/inner"]

    def test_put_under_an_object_raises_storage_error(self, storage):
        storage.put("a", b"file")
        with pytest.raises(StorageError) as info:
            storage.put("a/b", b"x")
        assert "a/b" in str(info.value)
        assert isinstance(info.value.__cause__, OSError)

    def test_failed_put_removes_its_temporary_file(self, storage, monkeypatch, tmp_path):
        storage.put("a", b"old")
        self.break_next_put(storage, monkeypatch)
        with pytest.raises(StorageError):
            storage.put("a", b"new new new")
        assert sorted(os.listdir(tmp_path / "root")) == ["a"]

    def test_failing_chunks_remove_the_temporary_file(self, storage, tmp_path):
        storage.put("a", b"old")

        def chunks():
            yield b"x" * 2**20
            raise ProducerFailed("stop")

        with pytest.raises(ProducerFailed):
            storage.put_chunks("a", chunks())
        assert sorted(os.listdir(tmp_path / "root")) == ["a"]

    def test_crash_mid_write_keeps_old_content_and_lists_the_leftover_apart(self, storage, tmp_path):
        storage.put("ckpt/part-0", b"old" * 1000)
        # A killed process runs no cleanup, so the crash happens in a child that dies
        # with os._exit after half the new bytes reached the disk.
        child = textwrap.dedent(
            """
            import os, sys
            from pdps.adapters.fsspec_storage import FsspecStorage

            storage = FsspecStorage(sys.argv[1])
            real_open = storage.fs.open

            class Dying:
                def __init__(self, f):
                    self.f = f
                def __enter__(self):
                    return self
                def __exit__(self, *exc_info):
                    return False
                def write(self, data):
                    self.f.write(data[: len(data) // 2])
                    self.f.flush()
                    os._exit(17)

            def open_then_die(path, mode="rb", **kwargs):
                f = real_open(path, mode, **kwargs)
                return Dying(f) if "w" in mode else f

            storage.fs.open = open_then_die
            storage.put("ckpt/part-0", b"new" * 1000)
            """
        )
        done = subprocess.run([sys.executable, "-c", child, storage.url], capture_output=True, timeout=60)
        assert done.returncode == 17, done.stderr.decode()
        leftovers = [n for n in os.listdir(tmp_path / "root" / "ckpt") if n != "part-0"]
        assert len(leftovers) == 1 and leftovers[0].startswith(TEMP_PREFIX)  # the crash left a half file
        assert storage.get("ckpt/part-0") == b"old" * 1000
        assert storage.list() == ["ckpt/part-0"]
        assert storage.list("ckpt/") == ["ckpt/part-0"]
        half = tmp_path / "root" / "ckpt" / leftovers[0]
        [left] = storage.leftovers()
        assert (left.path, left.bytes, left.modified) == (f"ckpt/{leftovers[0]}", 1500, half.stat().st_mtime)
        assert storage.leftovers("ckpt/") == [left] and storage.leftovers("other/") == []
        storage.put("ckpt/part-0", b"next")  # and writing goes on
        assert storage.get("ckpt/part-0") == b"next"
        storage.delete_leftover(left.path)
        storage.delete_leftover(left.path)  # gone already: a no-op
        assert os.listdir(tmp_path / "root" / "ckpt") == ["part-0"] and storage.leftovers() == []

    def test_delete_folder_removes_an_empty_directory_and_keeps_one_holding_a_leftover(self, storage, tmp_path):
        storage.put("a/x", b"1")
        storage.put("b/x", b"2")
        storage.delete("a/x")
        storage.delete("b/x")
        (tmp_path / "root" / "b" / f"{TEMP_PREFIX}0-x").write_bytes(b"a live writer's")
        storage.delete_folder("a")
        storage.delete_folder("b")
        assert os.listdir(tmp_path / "root") == ["b"]


class TestMemoryStorage(_FsspecReaderContract):
    @pytest.fixture
    def storage(self):
        name = f"pdps-test-{uuid.uuid4().hex}"
        yield FsspecStorage(f"memory://{name}")
        fs = fsspec.filesystem("memory")
        if fs.exists(f"/{name}"):
            fs.rm(f"/{name}", recursive=True)

    def test_roots_do_not_see_each_other(self, storage):
        other = FsspecStorage(f"memory://{storage.url.removeprefix('memory://')}-sibling")
        try:
            other.put("x", b"1")
            storage.put("y", b"2")
            assert storage.list() == ["y"]
            assert other.list() == ["x"]
        finally:
            other.delete("x")


def test_unknown_scheme_is_a_config_error():
    with pytest.raises(ConfigError, match="nosuchscheme"):
        FsspecStorage("nosuchscheme://bucket/x")


def test_missing_s3fs_names_the_extra(monkeypatch):
    # Whether or not s3fs is installed here, make fsspec fail to import it.
    registry = importlib.import_module("fsspec.registry")  # `fsspec.registry` is a read-only view
    monkeypatch.setitem(registry.known_implementations, "s3", {"class": "pdps_no_such_module.S3FileSystem"})
    monkeypatch.delitem(registry._registry, "s3", raising=False)
    with pytest.raises(MissingExtraError, match=r"pip install 'pdps\[s3\]'"):
        FsspecStorage("s3://bucket/prefix")


def test_filesystems_without_atomic_writes_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="atomic"):
        FsspecStorage(f"blockcache::file://{tmp_path}")
