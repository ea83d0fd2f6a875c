"""FsspecStorage on ``s3://`` against moto's S3 server: the Storage contract, then what
only an object store can get wrong (multipart uploads that must stay invisible until
complete, endpoint and credentials from the standard AWS variables).

The checkpoint files' tests (tests/unit/test_checkpoint_files.py) run here too, on a
bucket, through the same ``storage`` fixture.
"""

from __future__ import annotations

import pytest

from pdps.adapters.fsspec_storage import STREAM_ABOVE, FsspecStorage
from pdps.core.errors import StorageError
from pdps.registry import open_storage
from tests.unit import test_checkpoint_files
from tests.unit.contract_storage import MIB, ProducerFailed
from tests.unit.test_storage import _FsspecContract

pytestmark = pytest.mark.integration


class TestS3Storage(_FsspecContract):
    @pytest.fixture
    def storage(self, s3_storage):
        return s3_storage

    def test_a_failed_multipart_upload_is_aborted(self, storage):
        # 3 parts of 5 MiB reached the server before the producer failed: S3 must not
        # publish them, and no multipart upload may be left behind (it costs money).
        def chunks():
            for i in range(16):
                yield bytes([i]) * MIB
            raise ProducerFailed("stop")

        with pytest.raises(ProducerFailed):
            storage.put_chunks("ckpt/part", chunks())
        assert not storage.exists("ckpt/part")
        bucket = storage.url.removeprefix("s3://").split("/", 1)[0]
        uploads = storage.fs.call_s3("list_multipart_uploads", Bucket=bucket)
        assert uploads.get("Uploads", []) == []

    def test_big_objects_stream_small_ones_go_in_one_put(self, storage, monkeypatch):
        calls = []
        real_pipe, real_open = storage.fs.pipe_file, storage.fs.open
        monkeypatch.setattr(storage.fs, "pipe_file", lambda *a, **k: calls.append("pipe") or real_pipe(*a, **k))
        monkeypatch.setattr(storage.fs, "open", lambda *a, **k: calls.append("open") or real_open(*a, **k))
        storage.put_chunks("small", [b"x" * (STREAM_ABOVE // 2)] * 2)
        storage.put_chunks("big", [b"y" * (STREAM_ABOVE // 2)] * 3)
        assert calls == ["pipe", "open"]
        assert storage.size("small") == STREAM_ABOVE
        assert storage.size("big") == 3 * (STREAM_ABOVE // 2)

    def test_size_and_exists_see_what_another_writer_did(self, storage, moto_server):
        storage.put("p", b"1" * 10)
        assert storage.list() == ["p"]  # fills s3fs's listing cache
        other = FsspecStorage(storage.url, skip_instance_cache=True)
        other.put("p", b"2" * 20)
        assert storage.size("p") == 20
        buf = bytearray(20)
        storage.read_into("p", buf)
        assert buf == b"2" * 20
        assert storage.list() == ["p"]
        other.delete("p")
        assert not storage.exists("p")


def test_the_endpoint_and_credentials_come_from_the_aws_variables(s3_env):
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # an instance made before the variables were set
    bucket = s3_env.create_bucket()
    storage = open_storage(f"s3://{bucket}/ckpt")
    storage.put("x", b"via AWS_ENDPOINT_URL")
    assert storage.get("x") == b"via AWS_ENDPOINT_URL"


def test_explicit_options_reach_the_server_without_variables(moto_server, monkeypatch):
    for name in moto_server.environ():
        monkeypatch.delenv(name, raising=False)
    bucket = moto_server.create_bucket()
    storage = FsspecStorage(f"s3://{bucket}/p", **moto_server.storage_options())
    storage.put_chunks("a", [b"1", b"2"])
    assert storage.get("a") == b"12"


def test_a_missing_bucket_is_a_storage_error_naming_it(s3_env):
    storage = FsspecStorage("s3://pdps-no-such-bucket/p")
    with pytest.raises(StorageError, match="pdps-no-such-bucket"):
        storage.put("a", b"1")
    with pytest.raises(StorageError, match="pdps-no-such-bucket"):
        storage.size("a")


class TestCheckpointFilesOnS3(test_checkpoint_files.CheckpointFilesTests):
    @pytest.fixture
    def storage(self, s3_storage):
        return s3_storage


def test_a_job_checkpoints_to_s3_and_rolls_back_from_it(s3_env, tmp_path):
    """A whole sync job writing its checkpoints to a bucket: they commit, verify, and a
    rollback loads them (the path a restarted pserver takes)."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from torch import nn

    import pdps
    from pdps.adapters import safetensors_files as files
    from pdps.adapters.memory_store import MemoryStore
    from pdps.adapters.parquet import write_parquet_shards
    from pdps.core.job import Keys
    from pdps.runtime import recovery

    rng = np.random.default_rng(2)
    x = rng.normal(size=(320, 4)).astype(np.float32)
    write_parquet_shards({"x": x, "y": (x[:, 0] > 0).astype(np.int64)}, f"{tmp_path.as_uri()}/d", shards=2, row_group_size=40)

    def train(ctx: pdps.TrainerContext) -> None:
        model = ctx.attach(nn.Sequential(nn.Linear(4, 2)))
        for batch in ctx.batches():
            ctx.step(F.cross_entropy(model(batch["x"]), batch["y"]))

    url = f"s3://{s3_env.create_bucket()}/ckpt"
    store = MemoryStore()
    result = pdps.simulate(
        train, dataset=f"{tmp_path.as_uri()}/d", store=store, trainers=2, pservers=2, batch_size=16,
        checkpoint_url=url, checkpoint_every=3, min_block=1, num_slots=8,
    )  # fmt: skip
    keys = Keys(result.config.name)
    storage = open_storage(url)
    history = recovery.committed_ids(store, keys)
    # a checkpoint due while the last one is still being written is skipped: at least one
    assert history and set(history) <= set(files.list_ids(storage))
    assert all(files.verify(storage, files.read_manifest(storage, c)) == [] for c in history)
    epoch = recovery.rollback(store, files.SafetensorsFiles(storage), keys, "test")
    assert epoch.checkpoint == history[0]
    part = files.read_part(storage, files.read_manifest(storage, epoch.checkpoint).parts["ps-0"])
    values = [t for name, t in part.items() if name.endswith("/values")]  # keyed by block
    assert int(part["pdps.version"]) > 0 and values and all(torch.isfinite(v).all() for v in values)
