"""Model exports (pdps.exports) on file:// and on s3:// (the session's moto server).

:class:`ExportTests` holds every test; each subclass supplies the export ``url``.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import threading
import time

import pytest
import safetensors.torch
import torch

from pdps import exports
from pdps.adapters.fsspec_storage import TEMP_PREFIX
from pdps.adapters.safetensors_files import SafetensorsFormat
from pdps.core import exports as rules
from pdps.core.errors import ConfigError, CorruptExport, ExportConflict, UnknownSchemeError
from pdps.registry import open_storage
from pdps.runtime import exports as runtime

pytestmark = pytest.mark.integration


def a_model(step: int = 0) -> dict[str, torch.Tensor]:
    """A state_dict whose every value says which ``step`` it is: bf16, a non-contiguous
    tensor, an int counter and an empty one, as real models have."""
    g = torch.Generator().manual_seed(step)
    return {
        "embed.weight": torch.randn(50, 8, generator=g),
        "proj.weight": torch.randn(8, 6, generator=g).t(),  # non-contiguous
        "proj.bias": torch.randn(6, generator=g).to(torch.bfloat16),
        "steps": torch.tensor([step], dtype=torch.int64),
        "empty": torch.zeros(0, 3),
    }


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name


class ExportTests:
    @pytest.fixture
    def url(self) -> str:
        raise NotImplementedError

    @pytest.fixture
    def storage(self, url):
        return open_storage(url)

    def test_an_export_loads_with_the_reference_loader_and_equals_the_tensors_given(self, url, storage):
        model = a_model(1)
        export = exports.publish(url, model, meta={"window": 4, "round": 120})
        assert export.seq == 1 and export.path == f"{url}/00000001/model.safetensors"
        data = storage.get("00000001/model.safetensors")
        assert_same(safetensors.torch.load(data), model)
        assert_same(exports.load(url), model)

    def test_the_manifest_names_the_tensors_the_file_and_the_meta(self, url, storage):
        model = a_model(2)
        export = exports.publish(url, model, meta={"window": 4, "version": "v1"})
        manifest = json.loads(storage.get("00000001/manifest.json"))
        data = storage.get("00000001/model.safetensors")
        assert manifest["seq"] == 1 and manifest["file"] == "model.safetensors"
        assert manifest["bytes"] == len(data) == export.bytes
        assert manifest["sha256"] == hashlib.sha256(data).hexdigest() == export.sha256
        assert manifest["meta"] == {"window": 4, "version": "v1"}
        assert [t["name"] for t in manifest["tensors"]] == list(model)
        assert {t["name"]: (t["dtype"], tuple(t["shape"])) for t in manifest["tensors"]} == {
            "embed.weight": ("F32", (50, 8)),
            "proj.weight": ("F32", (6, 8)),
            "proj.bias": ("BF16", (6,)),
            "steps": ("I64", (1,)),
            "empty": ("F32", (0, 3)),
        }
        created = datetime.datetime.fromisoformat(manifest["created"])
        assert created.utcoffset() == datetime.timedelta(0)
        assert abs((datetime.datetime.now(datetime.timezone.utc) - created).total_seconds()) < 600
        assert exports.latest(url) == export

    def test_each_publish_takes_the_next_number_and_moves_latest(self, url, storage):
        assert exports.latest(url) is None and exports.list_exports(url) == []
        published = [exports.publish(url, a_model(i), meta={"i": i}) for i in range(3)]
        assert [e.seq for e in published] == [1, 2, 3]
        assert json.loads(storage.get("LATEST")) == {"seq": 3}
        assert exports.list_exports(url) == published
        assert exports.latest(url) == published[-1]
        assert_same(exports.load(url), a_model(2))
        assert_same(exports.load(url, 1), a_model(0))
        assert sorted({p.split("/")[0] for p in storage.list()}) == ["00000001", "00000002", "00000003", "LATEST"]

    def test_keep_deletes_all_but_the_newest(self, url, storage):
        for i in range(5):
            exports.publish(url, a_model(i), keep=2)
        assert [e.seq for e in exports.list_exports(url)] == [4, 5]
        assert {p.split("/")[0] for p in storage.list()} == {"00000004", "00000005", "LATEST"}
        assert_same(exports.load(url, 4), a_model(3))
        with pytest.raises(CorruptExport, match="no export 3"):
            exports.load(url, 3)

    @pytest.mark.parametrize(
        ("tensors", "meta", "keep", "match"),
        [
            ({}, None, None, "empty"),
            ({"w": [1.0, 2.0]}, None, None, "'w' is a list, not a dense tensor"),
            ({"w": torch.ones(2), "c": torch.ones(2, dtype=torch.complex64)}, None, None, "'c' is torch.complex64"),
            ({"w": torch.ones(2)}, {"loss": float("nan")}, None, "meta is not JSON-safe"),
            ({"w": torch.ones(2)}, {"when": datetime.date(2025, 1, 1)}, None, "meta is not JSON-safe"),
            ({"w": torch.ones(2)}, None, 0, "keep"),
            ([("w", torch.ones(2))], None, None, "mapping"),
        ],
    )
    def test_bad_input_is_refused_before_anything_is_written(self, url, storage, tensors, meta, keep, match):
        exports.publish(url, a_model(0))
        before = storage.list()
        with pytest.raises(ConfigError, match=match):
            exports.publish(url, tensors, meta=meta, keep=keep)
        assert storage.list() == before and storage.leftovers() == []

    @pytest.mark.parametrize("bad", ["", "relative/models", "/abs/models", "ftp://host/models", None])
    def test_a_bad_url_is_refused(self, bad):
        with pytest.raises(ConfigError) as err:
            exports.publish(bad, a_model(0))
        assert isinstance(err.value, UnknownSchemeError) or "export URL" in str(err.value)

    def test_a_bad_seq_is_refused(self, url):
        exports.publish(url, a_model(0))
        with pytest.raises(ConfigError, match="seq"):
            exports.load(url, "1")

    def test_nothing_published_is_a_typed_error_naming_latest(self, url):
        with pytest.raises(CorruptExport, match="nothing was published") as err:
            exports.load(url)
        assert err.value.path == f"{url}/LATEST"

    def test_a_model_file_that_does_not_match_its_manifest_is_refused(self, url, storage):
        exports.publish(url, a_model(0))
        path = "00000001/model.safetensors"
        good = storage.get(path)
        flipped = bytearray(good)
        flipped[-1] ^= 1
        storage.put(path, bytes(flipped))
        with pytest.raises(CorruptExport, match="fails its checksum") as err:
            exports.load(url)
        assert err.value.path == f"{url}/{path}"
        storage.put(path, good + b"x")
        with pytest.raises(CorruptExport, match="holds .* bytes, its manifest says"):
            exports.load(url)
        storage.delete(path)
        with pytest.raises(CorruptExport, match="is missing") as err:
            exports.load(url)
        assert err.value.path == f"{url}/{path}"

    def test_a_manifest_naming_other_tensors_is_refused(self, url, storage):
        exports.publish(url, a_model(0))
        manifest = json.loads(storage.get("00000001/manifest.json"))
        manifest["tensors"][0]["shape"] = [8, 50]
        storage.put("00000001/manifest.json", json.dumps(manifest).encode())
        with pytest.raises(CorruptExport, match=r"'embed.weight' is F32 \[50, 8\], the manifest says F32 \[8, 50\]"):
            exports.load(url)

    def test_a_killed_writers_folder_is_ignored_by_readers_and_cleaned_by_keep(self, url, storage):
        first = exports.publish(url, a_model(0))
        # Killed after the model, before the manifest: a claim and a whole model file.
        storage.put(rules.claim_path(2, "dead"), b"")
        storage.put(rules.model_path(2), storage.get(rules.model_path(1)))
        assert exports.latest(url) == first and exports.list_exports(url) == [first]
        assert_same(exports.load(url), a_model(0))
        third = exports.publish(url, a_model(3))
        assert third.seq == 3  # never written into the unfinished folder
        assert exports.list_exports(url) == [first, third]
        exports.publish(url, a_model(4), keep=5)
        assert {p.split("/")[0] for p in storage.list()} == {"00000001", "00000003", "00000004", "LATEST"}

    def test_a_writer_that_meets_another_claim_takes_the_next_number(self, url, storage):
        exports.publish(url, a_model(0))
        rival = RivalClaims(storage, times=1)
        export = runtime.publish(rival, SafetensorsFormat(), a_model(1))
        assert export.seq == 3
        assert storage.list("00000002/") == [rules.claim_path(2, "rival0")]  # the rival's folder, untouched
        assert_same(exports.load(url), a_model(1))

    def test_a_writer_that_always_meets_another_claim_gives_up_having_published_nothing(self, url, storage, monkeypatch):
        first = exports.publish(url, a_model(0))
        monkeypatch.setattr(runtime, "CLAIM_ATTEMPTS", 3)
        rival = RivalClaims(storage, times=10)
        with pytest.raises(ExportConflict, match="one writer at a time"):
            runtime.publish(rival, SafetensorsFormat(), a_model(1))
        assert exports.list_exports(url) == [first] and exports.latest(url) == first
        assert not any("model" in p or "manifest" in p for p in storage.list() if not p.startswith("00000001/"))

    def test_racing_writers_never_share_an_export(self, url):
        results: dict[int, list] = {0: [], 1: []}
        failures: list[BaseException] = []

        def write(who: int) -> None:
            try:
                for i in range(4):
                    results[who].append(exports.publish(url, a_model(10 * who + i), meta={"who": who, "i": i}))
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)

        threads = [threading.Thread(target=write, args=(w,)) for w in results]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert failures == []
        seqs = [e.seq for w in results for e in results[w]]
        assert len(set(seqs)) == 8
        for export in exports.list_exports(url):
            meta = export.meta
            assert_same(exports.load(url, export.seq), a_model(10 * meta["who"] + meta["i"]))

    @pytest.mark.parametrize("keep", [None, 1])
    def test_a_reader_of_latest_always_gets_a_whole_published_model(self, url, keep):
        models = {i: a_model(i) for i in range(6)}
        exports.publish(url, models[0], keep=keep)
        done = threading.Event()
        loads: list[int] = []
        failures: list[BaseException] = []

        def read() -> None:
            try:
                deadline = time.monotonic() + 60
                while not done.is_set() and len(loads) < 500 and time.monotonic() < deadline:
                    got = exports.load(url)
                    step = int(got["steps"][0])
                    assert_same(got, models[step])
                    loads.append(step)
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)

        reader = threading.Thread(target=read)
        reader.start()
        for i in range(1, 6):
            exports.publish(url, models[i], keep=keep)
        done.set()
        reader.join(timeout=120)
        assert failures == []
        assert loads and loads == sorted(loads)  # LATEST never went back
        assert_same(exports.load(url), models[5])


class RivalClaims:
    """A storage on which another writer claims the same number right after this one
    does, ``times`` times: what two writers racing look like, made certain."""

    def __init__(self, storage, times: int) -> None:
        self._storage, self._left, self._n = storage, times, 0
        self.url = storage.url

    def put(self, path: str, data: bytes) -> None:
        self._storage.put(path, data)
        if rules.CLAIM_PREFIX in path and self._left:
            self._left -= 1
            self._storage.put(f"{path.split('/')[0]}/{rules.CLAIM_PREFIX}rival{self._n}", b"")
            self._n += 1

    def __getattr__(self, name: str):
        return getattr(self._storage, name)


class TestLocalExports(ExportTests):
    @pytest.fixture
    def url(self, tmp_path) -> str:
        return f"file://{tmp_path}/exports"

    def test_the_model_file_loads_with_load_file(self, url, tmp_path):
        model = a_model(5)
        exports.publish(url, model)
        assert_same(safetensors.torch.load_file(tmp_path / "exports" / "00000001" / "model.safetensors"), model)

    def test_a_temporary_file_of_a_killed_writer_is_cleaned_by_keep(self, url, tmp_path):
        exports.publish(url, a_model(0))
        folder = tmp_path / "exports" / "00000002"
        folder.mkdir()
        (folder / f"{TEMP_PREFIX}1234-model.safetensors").write_bytes(b"half a model")
        assert [e.seq for e in exports.list_exports(url)] == [1]
        assert exports.publish(url, a_model(3), keep=1).seq == 3  # past the unfinished folder
        assert not folder.exists()
        assert [e.seq for e in exports.list_exports(url)] == [3]


class TestS3Exports(ExportTests):
    @pytest.fixture
    def url(self, s3_env) -> str:
        return f"s3://{s3_env.create_bucket()}/exports"

    def test_the_latest_model_loads_with_fsspec_and_the_reference_loader(self, url):
        # What docs/online.md tells a serving process without pdps to do.
        import fsspec

        model = a_model(7)
        exports.publish(url, a_model(6))
        exports.publish(url, model)
        with fsspec.open(f"{url}/LATEST") as f:
            seq = json.load(f)["seq"]
        with fsspec.open(f"{url}/{seq:08d}/model.safetensors") as f:
            assert_same(safetensors.torch.load(f.read()), model)
