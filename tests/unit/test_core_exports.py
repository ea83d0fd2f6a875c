"""The pure rules of model exports (pdps.core.exports): layout, manifest, pointer, retention."""

from __future__ import annotations

import math

import pytest

from pdps.core import exports as core
from pdps.core.errors import ConfigError, CorruptExport


def test_folders_are_zero_padded_so_a_listing_sorts_them():
    assert core.folder(3) == "00000003"
    assert sorted(core.folder(n) for n in (10, 9, 100)) == ["00000009", "00000010", "00000100"]
    assert core.model_path(12) == "00000012/model.safetensors"
    assert core.manifest_path(12) == "00000012/manifest.json"
    assert core.claim_path(12, "ab") == "00000012/claim-ab"
    assert core.seq_of("00000012") == 12
    assert core.seq_of("123456789") == 123456789  # beyond the padding: still a number
    for name in ("LATEST", "12", "0000001x", "", "-0000001"):
        assert core.seq_of(name) is None, name


def test_the_next_seq_passes_every_folder_complete_or_not():
    paths = ["LATEST", "00000001/manifest.json", "00000001/model.safetensors", "00000004/claim-x", "other/00000009/x"]
    assert core.next_seq(paths) == 5
    assert core.next_seq([]) == 1
    assert core.next_seq(["LATEST", "readme"]) == 1


def test_only_folders_with_a_manifest_are_complete():
    paths = ["00000001/model.safetensors", "00000001/manifest.json", "00000002/model.safetensors", "00000003/claim-a", "00000003/manifest.json"]
    assert core.complete(paths) == [1, 3]


def test_a_writer_gives_up_a_seq_another_has_claimed():
    mine = core.claim_path(4, "aa")
    assert core.rivals([mine], 4, "aa") == []
    assert core.rivals([mine, core.claim_path(4, "bb")], 4, "aa") == [core.claim_path(4, "bb")]


@pytest.mark.parametrize("url", ["file:///srv/models", "s3://bucket/prefix", "memory://x", "S3://b"])
def test_storage_urls_are_taken(url):
    assert core.check_url(url) == url


@pytest.mark.parametrize("url", ["", "/srv/models", "models", "s3://", "://x", None, 3])
def test_a_url_without_a_scheme_and_a_root_is_refused(url):
    with pytest.raises(ConfigError, match="export URL"):
        core.check_url(url)


@pytest.mark.parametrize("keep", [0, -1, 1.5, True, "2"])
def test_keep_must_be_a_positive_int(keep):
    with pytest.raises(ConfigError, match="keep"):
        core.check_keep(keep)
    assert core.check_keep(None) is None and core.check_keep(2) == 2


@pytest.mark.parametrize("seq", [0, -1, 1.0, True, "3", None])
def test_a_seq_must_be_a_positive_int(seq):
    with pytest.raises(ConfigError, match="seq"):
        core.check_seq(seq)
    assert core.check_seq(3) == 3


def test_tensor_mappings_must_be_non_empty_and_named_by_strings():
    assert core.check_names({"w": 1, "b": 2}) == ["w", "b"]
    with pytest.raises(ConfigError, match="empty"):
        core.check_names({})
    with pytest.raises(ConfigError, match="mapping"):
        core.check_names([("w", 1)])
    with pytest.raises(ConfigError, match="names"):
        core.check_names({1: 2})


def test_meta_must_be_json_safe():
    assert core.check_meta(None) == {}
    assert core.check_meta({"window": 3, "tags": ("a", "b")}) == {"window": 3, "tags": ["a", "b"]}
    for bad in ({"loss": math.nan}, {"x": object()}, {"x": math.inf}, {1: "a"}, ["window", 3]):
        with pytest.raises(ConfigError, match="meta"):
            core.check_meta(bad)


def an_export(seq: int = 3) -> core.Export:
    specs = (core.TensorSpec("w", "F32", (2, 3)), core.TensorSpec("b", "BF16", ()))
    return core.Export(seq, f"file:///m/{core.model_path(seq)}", "2025-01-02T03:04:05+00:00", 40, "ab" * 32, specs, {"window": 7})


def test_a_manifest_reads_back_as_the_export_it_was_written_for():
    export = an_export()
    assert core.Export.decode(export.manifest(), 3, export.path, "where") == export


@pytest.mark.parametrize(
    "data",
    [b"", b"\xff", b"[]", b'{"format": 1, "seq": 4}', b'{"format": 2, "seq": 3}', b'{"format": 1, "seq": 3, "tensors": []}'],
)
def test_a_manifest_that_is_no_export_is_corrupt_and_named(data):
    with pytest.raises(CorruptExport, match="file:///m/00000003/manifest.json") as err:
        core.Export.decode(data, 3, "p", "file:///m/00000003/manifest.json")
    assert err.value.path == "file:///m/00000003/manifest.json"


def test_the_pointer_names_a_seq():
    assert core.pointed(core.pointer(12), "LATEST") == 12
    for bad in (b"", b"{}", b'{"seq": "1"}', b'{"seq": 0}', b'{"seq": true}'):
        with pytest.raises(CorruptExport, match="LATEST"):
            core.pointed(bad, "s3://b/LATEST")


def paths_of(done: list[int], unfinished: list[int]) -> list[str]:
    return [core.manifest_path(s) for s in done] + [core.claim_path(s, "t") for s in unfinished] + ["LATEST"]


def test_retention_keeps_the_newest_and_the_latest_and_drops_unfinished_folders():
    paths = paths_of([1, 2, 3, 5, 6], [4])
    assert core.to_delete(paths, keep=2, latest=6, current=6) == [1, 2, 3, 4]
    assert core.to_delete(paths, keep=1, latest=2, current=6) == [1, 3, 4, 5]  # LATEST's export stays
    assert core.to_delete(paths, keep=10, latest=6, current=6) == [4]


def test_retention_leaves_folders_above_the_current_export():
    # A folder numbered past this writer's is another writer's work in progress.
    assert core.to_delete(paths_of([1, 2], [3]), keep=1, latest=2, current=2) == [1]


def test_mismatches_name_each_difference():
    want = [core.TensorSpec("w", "F32", (2, 3)), core.TensorSpec("b", "F32", (3,))]
    assert core.mismatches(want, list(reversed(want))) == []
    got = [core.TensorSpec("w", "F16", (2, 3)), core.TensorSpec("x", "F32", ())]
    assert core.mismatches(want, got) == [
        "'w' is F16 [2, 3], the manifest says F32 [2, 3]",
        "'b' is missing",
        "'x' is not in the manifest",
    ]
