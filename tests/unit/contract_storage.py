"""The Storage port's contract, as tests every adapter's test class inherits.

A subclass supplies two things: a ``storage`` fixture (an empty storage, cleaned up
afterwards) and :meth:`StorageContract.break_next_put`, which makes the adapter's next
write fail part-way the way a full disk or a dropped connection would.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from pdps.core.errors import StorageError
from pdps.ports.storage import Storage

BAD_PATHS = ["", "/etc/passwd", "../x", "a/../../x", "a/..", "./a", "a//b", "a/", "a\\..\\b", "file:///etc/passwd"]
MIB = 2**20


class ProducerFailed(Exception):
    """Raised by a test's chunk iterator: it must come out of put_chunks unchanged."""


def failing_chunks(before: int, piece: int = 2 * MIB):
    """Yields ``before`` bytes (more than one S3 part when big enough), then raises."""
    sent = 0
    while sent < before:
        yield bytes([sent // piece % 251]) * piece
        sent += piece
    raise ProducerFailed("the tensor producer failed half-way")


class StorageContract:
    @pytest.fixture
    def storage(self) -> Storage:
        raise NotImplementedError("a StorageContract subclass must provide a `storage` fixture")

    def break_next_put(self, storage: Storage, monkeypatch: pytest.MonkeyPatch) -> None:
        """Make the next ``put`` fail after part of the bytes went out."""
        raise NotImplementedError("a StorageContract subclass must say how to break a put")

    def test_is_a_storage(self, storage):
        assert isinstance(storage, Storage)

    @pytest.mark.parametrize("size", [0, 1, 3 * 2**20])
    def test_put_then_get_returns_the_same_bytes(self, storage, size):
        data = random.Random(size).randbytes(size)
        storage.put("blob", data)
        assert storage.get("blob") == data

    def test_overwrite_replaces_the_whole_object(self, storage):
        storage.put("a", b"a long first version")
        storage.put("a", b"short")
        assert storage.get("a") == b"short"

    def test_get_missing_raises_naming_the_path(self, storage):
        storage.put("other", b"x")
        with pytest.raises(StorageError) as info:
            storage.get("ckpt/missing.bin")
        assert "ckpt/missing.bin" in str(info.value)
        assert storage.url.rstrip("/") in str(info.value)

    def test_exists_is_true_for_objects_only(self, storage):
        assert not storage.exists("d/x")
        storage.put("d/x", b"1")
        assert storage.exists("d/x")
        assert not storage.exists("d")  # a folder is not an object
        assert not storage.exists("d/y")
        assert not storage.exists("d/x/under-an-object")

    def test_list_is_sorted_and_recursive(self, storage):
        paths = ["b", "a/2", "a/1", "a/sub/x", "ab", "c.txt"]
        for p in paths:
            storage.put(p, p.encode())
        assert storage.list() == sorted(paths)

    def test_list_filters_by_prefix(self, storage):
        for p in ["a/1", "a/sub/x", "ab", "b"]:
            storage.put(p, b"")
        assert storage.list("a/") == ["a/1", "a/sub/x"]
        assert storage.list("a/s") == ["a/sub/x"]
        assert storage.list("a") == ["a/1", "a/sub/x", "ab"]
        assert storage.list("nothing/") == []
        assert storage.list("b/") == []  # b is an object, not a folder

    def test_list_of_empty_storage_is_empty(self, storage):
        assert storage.list() == []

    def test_delete_removes_only_that_object(self, storage):
        storage.put("a/1", b"1")
        storage.put("a/2", b"2")
        storage.delete("a/1")
        assert not storage.exists("a/1")
        assert storage.list() == ["a/2"]
        with pytest.raises(StorageError):
            storage.get("a/1")

    def test_delete_missing_is_a_noop(self, storage):
        storage.put("keep", b"k")
        storage.delete("never/written")
        storage.delete("keep")
        storage.delete("keep")
        assert storage.list() == []

    def test_delete_of_a_folder_removes_nothing(self, storage):
        storage.put("d/x", b"1")
        storage.delete("d")
        assert storage.list() == ["d/x"]

    def test_delete_folder_removes_only_an_empty_folder(self, storage):
        storage.put("d/x", b"1")
        storage.put("e/y", b"2")
        storage.delete_folder("d")  # holds an object: stays
        storage.delete_folder("e/y")  # an object, not a folder
        storage.delete_folder("never/made")
        assert storage.list() == ["d/x", "e/y"]
        storage.delete("d/x")
        storage.delete_folder("d")
        storage.put("d/x", b"3")  # the path can be written again
        assert storage.list() == ["d/x", "e/y"]

    def test_writes_that_finished_or_failed_leave_no_leftovers(self, storage, monkeypatch):
        storage.put("a/b", b"1")
        storage.put_chunks("c", [b"2", b"3"])
        self.break_next_put(storage, monkeypatch)
        with pytest.raises(StorageError):
            storage.put("a/d", b"4" * 100)
        assert storage.leftovers() == [] and storage.leftovers("a/") == []

    @pytest.mark.parametrize("path", BAD_PATHS)
    def test_paths_outside_the_root_are_rejected(self, storage, path):
        with pytest.raises(StorageError):
            storage.put(path, b"x")
        with pytest.raises(StorageError):
            storage.put_chunks(path, [b"x"])
        with pytest.raises(StorageError):
            storage.get(path)
        with pytest.raises(StorageError):
            storage.size(path)
        with pytest.raises(StorageError):
            storage.read_into(path, bytearray(1))
        with pytest.raises(StorageError):
            storage.exists(path)
        with pytest.raises(StorageError):
            storage.delete(path)
        with pytest.raises(StorageError):
            storage.delete_folder(path)
        assert storage.list() == []

    def test_delete_leftover_refuses_what_names_no_leftover_inside_the_root(self, storage):
        storage.put("blob", b"x")
        storage.put("a/blob", b"y")
        for path in [*BAD_PATHS, "blob", "a/blob", "../.pdps-tmp-x", "/.pdps-tmp-x", "a//.pdps-tmp-x", "a\\.pdps-tmp-x"]:
            with pytest.raises(StorageError):
                storage.delete_leftover(path)
        assert storage.list() == ["a/blob", "blob"]

    @pytest.mark.parametrize("prefix", ["/", "../", "a/../../", "/etc/"])
    def test_prefixes_outside_the_root_are_rejected(self, storage, prefix):
        with pytest.raises(StorageError):
            storage.list(prefix)
        with pytest.raises(StorageError):
            storage.leftovers(prefix)

    def test_failed_put_keeps_the_old_object(self, storage, monkeypatch):
        storage.put("ckpt/part-0", b"old" * 1000)
        self.break_next_put(storage, monkeypatch)
        with pytest.raises(StorageError) as info:
            storage.put("ckpt/part-0", b"new" * 1000)
        assert "ckpt/part-0" in str(info.value)
        monkeypatch.undo()
        assert storage.get("ckpt/part-0") == b"old" * 1000
        assert storage.list() == ["ckpt/part-0"]

    def test_failed_first_put_leaves_nothing_visible(self, storage, monkeypatch):
        self.break_next_put(storage, monkeypatch)
        with pytest.raises(StorageError):
            storage.put("new", b"data" * 1000)
        monkeypatch.undo()
        assert not storage.exists("new")
        assert storage.list() == []

    # --- put_chunks, size, read_into ----------------------------------------------------

    def test_put_chunks_writes_the_concatenation_of_any_buffers(self, storage):
        floats = np.arange(6, dtype=np.float32).reshape(2, 3)
        chunks = [b"ab", bytearray(b"cd"), memoryview(b"ef"), b"", floats, np.array(7, dtype=np.int64)]
        expected = b"abcdef" + floats.tobytes() + np.int64(7).tobytes()
        assert storage.put_chunks("c/blob", chunks) == len(expected)
        assert storage.get("c/blob") == expected
        assert storage.size("c/blob") == len(expected)

    def test_put_chunks_takes_a_generator_of_big_chunks(self, storage):
        # More than one S3 part (and more than one write on local files).
        pieces = [random.Random(i).randbytes(MIB) for i in range(13)]
        assert storage.put_chunks("big", (p for p in pieces)) == 13 * MIB
        assert storage.get("big") == b"".join(pieces)

    def test_put_chunks_of_nothing_writes_an_empty_object(self, storage):
        assert storage.put_chunks("empty", iter(())) == 0
        assert storage.exists("empty")
        assert storage.get("empty") == b""
        assert storage.size("empty") == 0

    @pytest.mark.parametrize("sent", [0, 1 * MIB, 12 * MIB])
    def test_failing_chunks_leave_the_old_object_and_raise_unchanged(self, storage, sent):
        storage.put("ckpt/part-0", b"old" * 1000)
        with pytest.raises(ProducerFailed, match="half-way"):
            storage.put_chunks("ckpt/part-0", failing_chunks(sent))
        with pytest.raises(ProducerFailed):
            storage.put_chunks("ckpt/part-1", failing_chunks(sent))
        assert storage.get("ckpt/part-0") == b"old" * 1000
        assert not storage.exists("ckpt/part-1")
        assert storage.list() == ["ckpt/part-0"]  # no temporary leftovers either

    @pytest.mark.parametrize("bad", [[b"ok", 17], [b"ok", "text"], [np.arange(8, dtype=np.int32)[::2]]])
    def test_put_chunks_refuses_what_is_not_a_contiguous_buffer(self, storage, bad):
        with pytest.raises(StorageError) as info:
            storage.put_chunks("c/x", bad)
        assert "c/x" in str(info.value)
        assert storage.list() == []

    def test_failed_put_chunks_keeps_the_old_object(self, storage, monkeypatch):
        storage.put("ckpt/part-0", b"old" * 1000)
        self.break_next_put(storage, monkeypatch)
        with pytest.raises(StorageError) as info:
            storage.put_chunks("ckpt/part-0", [b"new" * MIB] * 4)
        assert "ckpt/part-0" in str(info.value)
        monkeypatch.undo()
        assert storage.get("ckpt/part-0") == b"old" * 1000
        assert storage.list() == ["ckpt/part-0"]

    def test_size_of_missing_objects_and_folders_raises_naming_the_path(self, storage):
        storage.put("d/x", b"12345")
        assert storage.size("d/x") == 5
        for path in ["d/missing", "d"]:
            with pytest.raises(StorageError) as info:
                storage.size(path)
            assert path in str(info.value)

    @pytest.mark.parametrize("size", [0, 1, 3 * MIB + 5])
    def test_read_into_fills_the_callers_buffer(self, storage, size):
        data = random.Random(size).randbytes(size)
        storage.put("blob", data)
        buf = bytearray(storage.size("blob"))
        assert storage.read_into("blob", buf) == size
        assert buf == data

    def test_read_into_reads_pieces_at_offsets(self, storage):
        data = random.Random(1).randbytes(MIB + 3)
        storage.put("blob", data)
        out = np.zeros(len(data), dtype=np.uint8)
        view = memoryview(out)
        for start in range(0, len(data), 300_001):
            end = min(start + 300_001, len(data))
            assert storage.read_into("blob", view[start:end], offset=start) == end - start
        assert out.tobytes() == data

    def test_read_into_a_typed_buffer(self, storage):
        values = np.arange(12, dtype=np.float32).reshape(3, 4)
        storage.put("f32", values.tobytes())
        out = np.empty((3, 4), dtype=np.float32)
        assert storage.read_into("f32", out) == values.nbytes
        assert (out == values).all()

    @pytest.mark.parametrize(("length", "offset"), [(11, 0), (4, 7), (1, 10), (0, 11)])
    def test_read_into_past_the_end_raises_naming_the_path(self, storage, length, offset):
        storage.put("d/ten", b"0123456789")
        with pytest.raises(StorageError) as info:
            storage.read_into("d/ten", bytearray(length), offset)
        assert "d/ten" in str(info.value)
        assert "10 bytes" in str(info.value)

    def test_read_into_may_stop_before_the_end(self, storage):
        storage.put("ten", b"0123456789")
        buf = bytearray(3)
        assert storage.read_into("ten", buf, 6) == 3
        assert buf == b"678"
        assert storage.read_into("ten", bytearray(0), 10) == 0

    @pytest.mark.parametrize("length", [0, 4])
    def test_read_into_missing_raises_naming_the_path(self, storage, length):
        storage.put("other", b"x")
        with pytest.raises(StorageError) as info:
            storage.read_into("ckpt/missing.bin", bytearray(length))
        assert "ckpt/missing.bin" in str(info.value)
        assert storage.url.rstrip("/") in str(info.value)

    def test_read_into_needs_a_writable_buffer(self, storage):
        storage.put("x", b"abcd")
        for bad in [b"....", memoryview(b"....")]:
            with pytest.raises(StorageError, match="writable"):
                storage.read_into("x", bad)
        with pytest.raises(StorageError, match="offset"):
            storage.read_into("x", bytearray(1), -1)
