"""The Storage port's contract, as tests every adapter's test class inherits.

A subclass supplies two things: a ``storage`` fixture (an empty storage, cleaned up
afterwards) and :meth:`StorageContract.break_next_put`, which makes the adapter's next
write fail part-way the way a full disk or a dropped connection would.
"""

from __future__ import annotations

import random

import pytest

from pdps.core.errors import StorageError
from pdps.ports.storage import Storage

BAD_PATHS = ["", "/etc/passwd", "../x", "a/../../x", "a/..", "./a", "a//b", "a/", "a\\..\\b", "file:///etc/passwd"]


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

    @pytest.mark.parametrize("path", BAD_PATHS)
    def test_paths_outside_the_root_are_rejected(self, storage, path):
        with pytest.raises(StorageError):
            storage.put(path, b"x")
        with pytest.raises(StorageError):
            storage.get(path)
        with pytest.raises(StorageError):
            storage.exists(path)
        with pytest.raises(StorageError):
            storage.delete(path)
        assert storage.list() == []

    @pytest.mark.parametrize("prefix", ["/", "../", "a/../../", "/etc/"])
    def test_prefixes_outside_the_root_are_rejected(self, storage, prefix):
        with pytest.raises(StorageError):
            storage.list(prefix)

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
