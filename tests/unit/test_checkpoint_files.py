"""Checkpoint parts and manifests (pdps.adapters.safetensors_files) over file:// and memory://.

:class:`CheckpointFilesTests` holds every test; a subclass supplies the ``storage``
fixture. tests/integration/test_storage_s3.py runs the same class on an S3 bucket.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
import zlib

import attrs
import fsspec
import pytest
import safetensors.torch
import torch

from pdps.adapters import safetensors_files as ckpt
from pdps.adapters.fsspec_storage import TEMP_PREFIX, FsspecStorage
from pdps.core.checkpoints import Manifest, PartInfo
from pdps.core.errors import ConfigError, CorruptCheckpoint, StorageError
from pdps.runtime.recovery import new_checkpoint_id

DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
]  # fmt: skip
SHAPES = [(), (0,), (3, 0), (1,), (7,), (2, 3, 5)]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Any bit pattern (NaN payloads, -0.0, subnormals), so a lossy round trip shows."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, t in want.items():
        assert got[key].dtype == t.dtype, key
        assert tuple(got[key].shape) == tuple(t.shape), key
        assert bits(got[key]) == bits(t), key


def a_state() -> dict[str, torch.Tensor]:
    """A pserver shard's state as TorchShard.state_dict() gives it, plus the version."""
    return {
        "values": random_tensor(torch.float32, (1000,), 1),
        "state.exp_avg": random_tensor(torch.float32, (1000,), 2),
        "state.exp_avg_sq": random_tensor(torch.float32, (1000,), 3),
        "scalar.step": torch.tensor(17.0),
        "pdps.version": torch.tensor(42, dtype=torch.int64),
        "mask": random_tensor(torch.bool, (13,), 4),
    }


def a_table_part() -> dict[str, torch.Tensor]:
    """A pserver's part with rows (design/sparse-embeddings.md §5): a dense block, the
    version, and per slot of table ``emb`` its ids, values, state and counts; slot 5
    holds no row."""
    part = {
        "w@0:4/values": random_tensor(torch.float32, (40,), 1),
        "w@0:4/state.sum": random_tensor(torch.float32, (40,), 2),
        "pdps.version": torch.tensor(42, dtype=torch.int64),
        "emb/scalar.step": torch.tensor(7.0, dtype=torch.float64),
    }
    for slot, n in [(0, 9), (3, 14), (5, 0), (11, 6), (12, 21)]:
        part[f"emb#{slot}/ids"] = torch.arange(n, dtype=torch.int64) * 256 + slot
        part[f"emb#{slot}/values"] = random_tensor(torch.float32, (n, 4), 100 + slot)
        part[f"emb#{slot}/state.sum"] = random_tensor(torch.float32, (n, 4), 200 + slot)
        part[f"emb#{slot}/count"] = random_tensor(torch.int32, (n,), 300 + slot)
        part[f"emb#{slot}/last_age"] = random_tensor(torch.int64, (n,), 400 + slot)
    return part


def slots(*numbers: int):
    prefixes = tuple(f"emb#{s}/" for s in numbers)
    return lambda key: key.startswith(prefixes) or key == "pdps.version"


#: predicates on a_table_part's entries, by name
WANTED = {
    "slot-3": slots(3),
    "slots-0-12": slots(0, 12),
    "slots-5-11-12": slots(5, 11, 12),
    "empty-slot": lambda key: key.startswith("emb#5/"),
    "dense": lambda key: key.startswith("w@"),
    "nothing": lambda key: False,
    "everything": lambda key: True,
}


def header_entries(data: bytes) -> tuple[list, int]:
    return ckpt._parse_header(memoryview(data), len(data), "a part", "p")


def entry_spans(data: bytes) -> tuple[dict[str, tuple[int, int]], int]:
    """Each entry's bytes [start, end) in the file, and where the data starts."""
    entries, start = header_entries(data)
    return {key: (start + a, start + b) for key, _, _, a, b in entries}, start


class _RecordingReads:
    """A storage that notes the (offset, bytes) of every read, through readers too."""

    def __init__(self, inner, reads):
        self._inner, self._reads = inner, reads
        self.url = inner.url

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def read_into(self, path, buffer, offset=0):
        self._reads.append((offset, memoryview(buffer).nbytes))
        return self._inner.read_into(path, buffer, offset)

    @__import__("contextlib").contextmanager
    def open_reader(self, path):
        with self._inner.open_reader(path) as reader:
            yield _RecordingReader(reader, self._reads)


class _RecordingReader:
    def __init__(self, inner, reads):
        self._inner, self._reads = inner, reads
        self.size, self.parallel = inner.size, inner.parallel

    def read_into(self, buffer, offset=0):
        self._reads.append((offset, memoryview(buffer).nbytes))
        return self._inner.read_into(buffer, offset)


def piece_crcs(data: bytes, piece: int) -> list[int]:
    return [zlib.crc32(data[i : i + piece]) for i in range(0, len(data), piece)]


def rewrite(storage, info: PartInfo, data: bytes) -> PartInfo:
    """Put ``data`` at the part's path; return the PartInfo that *matches* it, so that
    only the structural checks (not size or checksum) can catch what is wrong."""
    storage.put(info.path, data)
    return PartInfo(info.name, info.path, len(data), f"crc32:{zlib.crc32(data):08x}")


def safetensors_file(header: dict, data: bytes, pad: bool = True) -> bytes:
    head = json.dumps(header).encode()
    if pad:
        head += b" " * (-len(head) % 8)
    return len(head).to_bytes(8, "little") + head + data


class CheckpointFilesTests:
    @pytest.fixture
    def storage(self):
        raise NotImplementedError("a subclass provides a `storage` fixture")

    @pytest.fixture
    def cid(self) -> str:
        return new_checkpoint_id(2, 1200)

    def write(self, storage, cid, tensors, name="ps-0"):
        return ckpt.write_part(storage, f"{cid}/{name}.safetensors", tensors, name=name)

    # --- round trips --------------------------------------------------------------------

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    def test_every_dtype_and_shape_round_trips_bit_exact(self, storage, cid, dtype):
        tensors = {f"t{i}": random_tensor(dtype, shape, i) for i, shape in enumerate(SHAPES)}
        info = self.write(storage, cid, tensors)
        assert_same(ckpt.read_part(storage, info), tensors)

    def test_all_dtypes_in_one_part(self, storage, cid):
        # Mixed element sizes: every tensor must still start aligned to be a view.
        tensors = {f"{dtype}-{shape}": random_tensor(dtype, shape, i) for i, (dtype, shape) in enumerate(
            (d, s) for d in reversed(DTYPES) for s in [(), (3,), (0,)])}  # fmt: skip
        info = self.write(storage, cid, tensors)
        got = ckpt.read_part(storage, info)
        assert_same(got, tensors)
        base = got["torch.float64-(3,)"].untyped_storage().data_ptr()
        for key, t in got.items():
            if t.numel():
                # views of one buffer, no copies
                assert t.untyped_storage().data_ptr() == base, key

    def test_part_info_describes_the_object(self, storage, cid):
        info = self.write(storage, cid, a_state())
        assert info.name == "ps-0"
        assert info.path == f"{cid}/ps-0.safetensors"
        assert info.bytes == storage.size(info.path)
        assert info.checksum == f"crc32:{zlib.crc32(storage.get(info.path)):08x}"
        assert ckpt.write_part(storage, f"{cid}/ps-3.safetensors", {}).name == "ps-3"

    def test_safetensors_reads_our_file(self, storage, cid):
        state = a_state()
        info = self.write(storage, cid, state)
        assert_same(safetensors.torch.load(storage.get(info.path)), state)

    def test_we_read_what_safetensors_writes(self, storage, cid):
        state = a_state()
        data = safetensors.torch.save(state, metadata={"by": "safetensors"})
        info = rewrite(storage, PartInfo("x", f"{cid}/x.safetensors", 0, "crc32:00000000"), data)
        assert_same(ckpt.read_part(storage, info), state)

    def test_an_unaligned_layout_is_read_by_copying(self, storage, cid):
        # Another writer may put a 3-byte tensor before a float32 one.
        small, floats = torch.tensor([1, 2, 3], dtype=torch.uint8), torch.tensor([1.5, -2.25], dtype=torch.float32)
        header = {"a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
                  "b": {"dtype": "F32", "shape": [2], "data_offsets": [3, 11]}}  # fmt: skip
        data = safetensors_file(header, bits(small) + bits(floats))
        info = rewrite(storage, PartInfo("x", f"{cid}/x.safetensors", 0, "crc32:00000000"), data)
        assert_same(ckpt.read_part(storage, info), {"a": small, "b": floats})

    def test_tensors_that_cannot_be_written_from_where_they_are(self, storage, cid):
        base = random_tensor(torch.float32, (6, 8), 5)
        tensors = {
            "strided": base[:, ::3],
            "transposed": base.t(),
            "grad": torch.ones(4, requires_grad=True) * 2,
            "expanded": torch.tensor([1, 2], dtype=torch.int16).expand(3, 2),
        }
        info = self.write(storage, cid, tensors)
        assert_same(ckpt.read_part(storage, info), {k: v.detach() for k, v in tensors.items()})

    def test_big_parts_in_pieces_hashed_in_a_thread_or_not(self, storage, cid, monkeypatch):
        monkeypatch.setattr(ckpt, "PIECE", 4096)
        monkeypatch.setattr(ckpt, "READ_PIECE", 4096)  # 10 pieces, hashed in turn
        tensors = {"values": random_tensor(torch.float32, (10_000,), 6), "small": torch.arange(3)}
        monkeypatch.setattr(ckpt, "_hash_in_thread", lambda nbytes: True)
        threaded = self.write(storage, cid, tensors, "threaded")
        monkeypatch.setattr(ckpt, "_hash_in_thread", lambda nbytes: False)
        inline = self.write(storage, cid, tensors, "inline")
        assert threaded.checksum == inline.checksum
        for in_thread in (True, False):
            monkeypatch.setattr(ckpt, "_hash_in_thread", lambda nbytes: in_thread)
            for info in (threaded, inline):
                assert_same(ckpt.read_part(storage, info), tensors)
                manifest = Manifest(cid, "j", 1, 2, 0.0, {info.name: info})
                assert ckpt.verify(storage, manifest) == []

    def test_a_part_records_a_crc32_per_piece_and_a_flipped_byte_names_its_piece(self, storage, cid, monkeypatch):
        monkeypatch.setattr(ckpt, "READ_PIECE", 4096)
        info = self.write(storage, cid, {"values": random_tensor(torch.float32, (10_000,), 7)})
        data = storage.get(info.path)
        assert info.piece_bytes == 4096 and list(info.pieces) == [f"{c:08x}" for c in piece_crcs(data, 4096)]
        bad = bytearray(data)
        bad[5 * 4096 + 3] ^= 0x01
        storage.put(info.path, bytes(bad))
        self.assert_corrupt(storage, cid, info, "checksum", "bytes 20480..24576 (piece 5)")

    @pytest.mark.parametrize("in_thread", [True, False])
    def test_a_part_recorded_without_pieces_is_read_by_its_whole_crc32(self, storage, cid, monkeypatch, in_thread):
        # as an older pdps recorded it: one crc32 of the whole part, read in order
        monkeypatch.setattr(ckpt, "READ_PIECE", 4096)
        monkeypatch.setattr(ckpt, "PIECE", 8192)
        monkeypatch.setattr(ckpt, "_hash_in_thread", lambda nbytes: in_thread)
        tensors = {"values": random_tensor(torch.float32, (10_000,), 8)}
        info = attrs.evolve(self.write(storage, cid, tensors), pieces=None, piece_bytes=0)
        assert "pieces" not in info.to_json()
        assert_same(ckpt.read_part(storage, info), tensors)
        assert ckpt.verify(storage, Manifest(cid, "j", 1, 2, 0.0, {info.name: info})) == []
        data = bytearray(storage.get(info.path))
        data[-5] ^= 0x01
        storage.put(info.path, bytes(data))
        self.assert_corrupt(storage, cid, info, "checksum", info.checksum)

    # --- reading the wanted entries only --------------------------------------------------

    @pytest.mark.parametrize("piece", [64, 200, None], ids=["piece-64", "piece-200", "one-piece"])
    @pytest.mark.parametrize("wanted", list(WANTED), ids=list(WANTED))
    def test_the_wanted_entries_equal_a_full_reads(self, storage, cid, monkeypatch, piece, wanted):
        if piece is not None:
            monkeypatch.setattr(ckpt, "READ_PIECE", piece)  # the pieces recorded at write
        info = self.write(storage, cid, a_table_part())
        full = ckpt.read_part(storage, info)
        want = {k: t for k, t in full.items() if WANTED[wanted](k)}
        got = ckpt.read_part(storage, info, wanted=WANTED[wanted])
        assert_same(got, want)
        assert list(got) == [k for k in full if k in want]  # in the file's order
        assert_same(ckpt.SafetensorsFiles(storage).read_part(info, wanted=WANTED[wanted]), want)
        if piece is not None and 0 < len(want) < len(full):  # no whole part in memory: one buffer of the wanted bytes
            buffers = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in got.values() if t.numel()}
            wanted_bytes = sum(t.numel() * t.element_size() for t in want.values())
            assert len(buffers) <= 1 and sum(buffers.values()) < wanted_bytes + 8 * len(want)

    def test_a_corrupt_piece_outside_the_wanted_ranges_is_ignored_and_inside_refused(self, storage, cid, monkeypatch):
        monkeypatch.setattr(ckpt, "READ_PIECE", 64)
        info = self.write(storage, cid, a_table_part())
        good = storage.get(info.path)
        slot3 = WANTED["slot-3"]
        want = {k: t for k, t in ckpt.read_part(storage, info).items() if slot3(k)}
        spans, head = entry_spans(good)
        touched = {p for k, (a, b) in spans.items() if slot3(k) and b > a for p in range(a // 64, (b - 1) // 64 + 1)}
        touched |= set(range(-(-head // 64)))  # the header's pieces are read first
        outside = next(p for p in range(len(info.pieces)) if p not in touched and p - 1 not in touched and p + 1 not in touched)
        a, b = spans["emb#3/values"]
        in_wanted = lambda q: any(x <= q < y for k, (x, y) in spans.items() if slot3(k))  # noqa: E731
        shared = next(q for q in range(head, len(good)) if q // 64 in touched and not in_wanted(q))  # a touched piece's other bytes
        for pos, refused in [(outside * 64 + 5, None), (a + 3, "emb#3/values"), (b - 1, "emb#3/values"), (shared, "shared"), (head - 2, "header")]:
            bad = bytearray(good)
            bad[pos] ^= 0x04
            storage.put(info.path, bytes(bad))
            if refused is None:
                assert_same(ckpt.read_part(storage, info, wanted=slot3), want)
                with pytest.raises(CorruptCheckpoint):  # a whole read, and verify, see it
                    ckpt.read_part(storage, info)
                continue
            with pytest.raises(CorruptCheckpoint, match=rf"fails its checksum: .* \(piece {pos // 64}\)") as raised:
                ckpt.read_part(storage, info, wanted=slot3)
            assert info.path in str(raised.value) and raised.value.path == info.path, refused
        storage.put(info.path, good)
        assert_same(ckpt.read_part(storage, info, wanted=slot3), want)

    def test_adjacent_wanted_entries_are_read_in_one_range_each_piece_once(self, storage, cid, monkeypatch):
        monkeypatch.setattr(ckpt, "READ_PIECE", 64)
        info = self.write(storage, cid, a_table_part())
        spans, head = entry_spans(storage.get(info.path))
        # 8-byte entries come first, by name: emb#0/ids, emb#0/last_age, emb#11/ids side by side
        a0, b0 = spans["emb#0/ids"]
        assert spans["emb#0/last_age"][0] == b0 and spans["emb#11/ids"][0] == spans["emb#0/last_age"][1]
        near = {"emb#0/ids", "emb#0/last_age", "emb#11/ids"}
        end = spans["emb#11/ids"][1]
        reads: list[tuple[int, int]] = []
        got = ckpt.read_part(_RecordingReads(storage, reads), info, wanted=near.__contains__)
        assert sorted(got) == sorted(near)
        header_pieces = -(-head // 64)
        assert reads[0] == (0, 64) and sum(n for _, n in reads[:header_pieces]) == header_pieces * 64
        rest = reads[header_pieces:]
        first, last = max(a0 // 64, header_pieces), (end - 1) // 64
        assert rest == [(p * 64, 64) for p in range(first, last + 1)]  # one range: each piece it touches once, in order
        entries, data_start = header_entries(storage.get(info.path))
        ranges = ckpt._wanted_ranges([e for e in entries if e[0] in near], data_start)
        assert [(r.start, r.end) for r in ranges] == [(a0, end)]
        apart = {"emb#0/ids", "emb#3/ids"}
        ranges = ckpt._wanted_ranges([e for e in entries if e[0] in apart], data_start)
        assert [(r.start, r.end) for r in ranges] == [spans["emb#0/ids"], spans["emb#3/ids"]] and all(r.at % 8 == r.start % 8 for r in ranges)

    @pytest.mark.parametrize("wanted", ["slots-0-12", "everything"])
    def test_wanted_entries_read_with_a_hashing_thread(self, storage, cid, monkeypatch, wanted):
        monkeypatch.setattr(ckpt, "READ_PIECE", 64)
        info = self.write(storage, cid, a_table_part())
        want = {k: t for k, t in ckpt.read_part(storage, info).items() if WANTED[wanted](k)}
        monkeypatch.setattr(ckpt, "_hash_in_thread", lambda nbytes: True)  # runs of whole pieces: hashed beside the reads
        assert_same(ckpt.read_part(storage, info, wanted=WANTED[wanted]), want)
        data = bytearray(storage.get(info.path))
        a, b = entry_spans(bytes(data))[0]["emb#12/values"]
        data[(a + b) // 2] ^= 0x01  # in a piece the entry fills
        storage.put(info.path, bytes(data))
        with pytest.raises(CorruptCheckpoint, match=rf"\(piece {(a + b) // 2 // 64}\)"):
            ckpt.read_part(storage, info, wanted=WANTED[wanted])

    def test_a_part_without_pieces_is_read_whole_for_its_wanted_entries(self, storage, cid, monkeypatch):
        monkeypatch.setattr(ckpt, "READ_PIECE", 64)
        info = attrs.evolve(self.write(storage, cid, a_table_part()), pieces=None, piece_bytes=0)
        slot3 = WANTED["slot-3"]
        want = {k: t for k, t in ckpt.read_part(storage, info).items() if slot3(k)}
        got = ckpt.read_part(storage, info, wanted=slot3)
        assert_same(got, want)
        full = storage.size(info.path)
        assert all(t.untyped_storage().nbytes() < full for t in got.values())  # copies: the whole part's buffer goes
        data = bytearray(storage.get(info.path))
        data[-3] ^= 0x01  # outside slot 3's entries, but only the whole crc32 is recorded
        storage.put(info.path, bytes(data))
        with pytest.raises(CorruptCheckpoint, match="fails its checksum"):
            ckpt.read_part(storage, info, wanted=slot3)

    def test_wanted_entries_of_another_writers_unaligned_layout(self, storage, cid):
        small, floats, more = torch.tensor([1, 2, 3], dtype=torch.uint8), torch.tensor([1.5, -2.25], dtype=torch.float32), torch.arange(40, dtype=torch.int64)
        header = {"a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
                  "b": {"dtype": "F32", "shape": [2], "data_offsets": [3, 11]},
                  "c": {"dtype": "I64", "shape": [40], "data_offsets": [11, 331]}}  # fmt: skip
        data = safetensors_file(header, bits(small) + bits(floats) + bits(more))
        storage.put(f"{cid}/x.safetensors", data)
        info = PartInfo("x", f"{cid}/x.safetensors", len(data), f"crc32:{zlib.crc32(data):08x}",
                        pieces=tuple(f"{c:08x}" for c in piece_crcs(data, 32)), piece_bytes=32)  # fmt: skip
        assert_same(ckpt.read_part(storage, info, wanted=lambda k: k != "a"), {"b": floats, "c": more})
        assert_same(ckpt.read_part(storage, info, wanted=lambda k: k == "c"), {"c": more})

    def test_unsupported_tensors_are_refused_before_writing(self, storage, cid):
        for bad in [
            {"c": torch.zeros(2, dtype=torch.complex64)},
            {"s": torch.zeros(2, 2).to_sparse()},
            {"n": [1.0, 2.0]},
            {"": torch.zeros(1)},
            {"__metadata__": torch.zeros(1)},
            {3: torch.zeros(1)},
        ]:
            with pytest.raises(ConfigError):
                self.write(storage, cid, bad)
        assert storage.list() == []

    # --- corruption ---------------------------------------------------------------------

    def assert_corrupt(self, storage, cid, info, *words):
        read = ckpt.read_json_part if info.path.endswith(".json") else ckpt.read_part
        with pytest.raises(CorruptCheckpoint) as raised:
            read(storage, info)
        message = str(raised.value)
        assert info.path in message and raised.value.path == info.path
        for word in words:
            assert word in message
        manifest = Manifest(cid, "j", 1, 2, 0.0, {info.name: info})
        problems = ckpt.verify(storage, manifest)
        assert len(problems) == 1 and info.path in problems[0]
        for word in words:
            assert word in problems[0]
        return message

    def test_one_flipped_byte_anywhere_is_caught(self, storage, cid):
        info = self.write(storage, cid, a_state())
        good = storage.get(info.path)
        n = len(good)
        for pos in sorted({0, 3, 7, 8, 9, n // 4, n // 2, n - 9, n - 2, n - 1}):
            bad = bytearray(good)
            bad[pos] ^= 0x10
            storage.put(info.path, bytes(bad))
            self.assert_corrupt(storage, cid, info, "checksum")
        storage.put(info.path, good)
        assert ckpt.read_part(storage, info)

    @pytest.mark.parametrize("keep", [0, 1, 8, 100, -1])
    def test_a_truncated_part_is_caught(self, storage, cid, keep):
        info = self.write(storage, cid, a_state())
        data = storage.get(info.path)
        storage.put(info.path, data[:keep] if keep >= 0 else data[:-1])
        self.assert_corrupt(storage, cid, info, "bytes")

    def test_an_extra_trailing_byte_is_caught(self, storage, cid):
        info = self.write(storage, cid, a_state())
        storage.put(info.path, storage.get(info.path) + b"\0")
        self.assert_corrupt(storage, cid, info, f"holds {info.bytes + 1} bytes")

    def test_a_missing_part_is_caught(self, storage, cid):
        info = self.write(storage, cid, a_state())
        storage.delete(info.path)
        self.assert_corrupt(storage, cid, info, "missing")

    def test_a_wrong_checksum_in_the_record_is_caught(self, storage, cid):
        info = self.write(storage, cid, a_state())
        self.assert_corrupt(storage, cid, PartInfo(info.name, info.path, info.bytes, "crc32:00000000"), "checksum")

    F32x2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}

    @pytest.mark.parametrize(
        ("data", "what"),
        [
            (b"", "too short"),
            (b"\x01\x00\x00", "too short"),
            ((1000).to_bytes(8, "little") + b"{}", "runs past the end"),
            ((4).to_bytes(8, "little") + b"{{{{", "not JSON"),
            ((4).to_bytes(8, "little") + b"\xff\xfe{}", "not JSON"),
            (safetensors_file([1, 2], b""), "not a JSON object"),
            (safetensors_file({"a": {"dtype": "F8", "shape": [1], "data_offsets": [0, 1]}}, b"\0"), "dtype 'F8'"),
            (safetensors_file({"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8), "dtype"),
            (safetensors_file({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8), "shape"),
            (safetensors_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0]}}, b"\0" * 8), "data_offsets"),
            (safetensors_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}}, b"\0" * 8), "outside"),
            (safetensors_file({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8), "spans 8 bytes"),
            (safetensors_file({"a": F32x2, "b": F32x2}, b"\0" * 8), "overlap"),
            (safetensors_file({"a": {**F32x2, "data_offsets": [8, 16]}}, b"\0" * 16), "gap"),
            (safetensors_file({"a": F32x2}, b"\0" * 12), "trailing"),
            (safetensors_file({"a": "F32"}, b""), "not an object"),
            (safetensors_file({"__metadata__": {"k": 1}}, b""), "__metadata__"),
            (b"\x18\0\0\0\0\0\0\0" + b'{"a":{},"a":{}}         ', "twice"),
        ],
    )
    def test_a_bad_header_is_caught_even_with_a_matching_checksum(self, storage, cid, data, what):
        info = rewrite(storage, PartInfo("ps-0", f"{cid}/ps-0.safetensors", 0, "crc32:00000000"), data)
        self.assert_corrupt(storage, cid, info, what)

    def test_a_header_longer_than_a_piece_is_checked_too(self, storage, cid, monkeypatch):
        monkeypatch.setattr(ckpt, "PIECE", 64)
        tensors = {f"name-{i}": torch.tensor([i], dtype=torch.int32) for i in range(20)}
        info = self.write(storage, cid, tensors)
        assert ckpt.verify(storage, Manifest(cid, "j", 1, 2, 0.0, {info.name: info})) == []
        data = bytearray(storage.get(info.path))
        data[data.index(b'"I32"') + 2] = ord("X")  # "IX2": a dtype no reader knows
        info = rewrite(storage, info, bytes(data))
        self.assert_corrupt(storage, cid, info, "dtype 'IX2'")

    # --- JSON parts ---------------------------------------------------------------------

    def test_json_part_round_trip(self, storage, cid):
        snapshot = {"todo": [{"id": 1, "attempt": 0}], "done": list(range(5)), "pass": 3, "name": "é"}
        info = ckpt.write_json_part(storage, f"{cid}/master.json", snapshot)
        assert info.name == "master"
        assert ckpt.read_json_part(storage, info) == snapshot
        assert json.loads(storage.get(info.path)) == snapshot

    @pytest.mark.parametrize("bad", [{"x": float("nan")}, {"x": object()}, {"x": b"bytes"}])
    def test_json_part_refuses_what_json_cannot_hold(self, storage, cid, bad):
        with pytest.raises(ConfigError, match="master.json"):
            ckpt.write_json_part(storage, f"{cid}/master.json", bad)
        assert storage.list() == []

    def test_corrupt_json_parts_are_caught(self, storage, cid):
        info = ckpt.write_json_part(storage, f"{cid}/master.json", {"todo": [1, 2, 3]})
        data = storage.get(info.path)
        storage.put(info.path, data.replace(b"2", b"7"))
        self.assert_corrupt(storage, cid, info, "checksum")
        self.assert_corrupt(storage, cid, rewrite(storage, info, b'{"todo": [1,'), "not JSON")
        storage.delete(info.path)
        self.assert_corrupt(storage, cid, info, "missing")

    # --- manifests ----------------------------------------------------------------------

    def manifest(self, storage, cid) -> Manifest:
        parts = {"ps-0": self.write(storage, cid, a_state())}
        parts["master"] = ckpt.write_json_part(storage, f"{cid}/master.json", {"pass": 1})
        return Manifest(id=cid, job="digits", round=1200, epoch=2, created=1.7e9, parts=parts, extra={"pservers": 1})

    def test_manifest_round_trip(self, storage, cid):
        manifest = self.manifest(storage, cid)
        assert Manifest.from_json(json.loads(json.dumps(manifest.to_json()))) == manifest
        ckpt.write_manifest(storage, manifest)
        assert manifest.path == f"{cid}/manifest.json"
        assert ckpt.read_manifest(storage, cid) == manifest
        assert ckpt.verify(storage, manifest) == []

    def test_verify_reports_every_bad_part(self, storage, cid):
        manifest = self.manifest(storage, cid)
        storage.delete(manifest.parts["master"].path)
        storage.put(manifest.parts["ps-0"].path, b"garbage")
        problems = ckpt.verify(storage, manifest)
        assert len(problems) == 2
        assert "master.json" in problems[0] + problems[1] and "ps-0.safetensors" in problems[0] + problems[1]

    def test_verify_checks_other_parts_by_size_and_checksum_only(self, storage, cid):
        good = rewrite(storage, PartInfo("raw", f"{cid}/raw.bin", 0, "crc32:00000000"), b"not safetensors")
        manifest = Manifest(cid, "j", 1, 2, 0.0, {"raw": good})
        assert ckpt.verify(storage, manifest) == []
        storage.put(good.path, b"not safetensorz")
        assert "checksum" in ckpt.verify(storage, manifest)[0]

    def test_a_manifest_with_a_bad_field_names_its_object(self, storage, cid):
        d = self.manifest(storage, cid).to_json()
        storage.put(f"{cid}/manifest.json", json.dumps({**d, "round": -3}).encode())
        with pytest.raises(CorruptCheckpoint, match=f"{cid}/manifest.json.*'round'") as raised:
            ckpt.read_manifest(storage, cid)
        assert storage.url.rstrip("/") in str(raised.value) and raised.value.path == f"{cid}/manifest.json"

    def test_a_missing_manifest_is_corrupt(self, storage, cid):
        self.manifest(storage, cid)  # the parts, but no manifest: a checkpoint never finished
        with pytest.raises(CorruptCheckpoint, match=f"{cid}/manifest.json.*no manifest"):
            ckpt.read_manifest(storage, cid)

    @pytest.mark.parametrize("data", [b"\xff", b"{", b"[]", b'{"format": "other"}', b"null"])
    def test_an_undecodable_manifest_is_corrupt(self, storage, cid, data):
        storage.put(f"{cid}/manifest.json", data)
        with pytest.raises(CorruptCheckpoint):
            ckpt.read_manifest(storage, cid)

    def test_a_manifest_of_another_checkpoint_is_corrupt(self, storage, cid):
        manifest = self.manifest(storage, cid)
        other = new_checkpoint_id(2, 1300)
        storage.put(f"{other}/manifest.json", json.dumps(manifest.to_json()).encode())
        with pytest.raises(CorruptCheckpoint, match=f"manifest of {cid}, not of {other}"):
            ckpt.read_manifest(storage, other)

    def test_read_manifest_refuses_what_is_no_checkpoint_id(self, storage):
        for bad in ["", "../x", "a/b", "ckpt-1-2-3", 7]:
            with pytest.raises(CorruptCheckpoint, match="not a checkpoint id"):
                ckpt.read_manifest(storage, bad)

    # --- list and delete ----------------------------------------------------------------

    def test_list_ids_and_delete(self, storage):
        ids = [new_checkpoint_id(e, r) for e, r in [(10_000, 1), (0, 5), (1, 0), (0, 40)]]
        for cid in ids:
            self.manifest(storage, cid)
        storage.put("data/shard-0.npy", b"not a checkpoint")
        storage.put("ckpt-notes.txt", b"nor is this")
        storage.put("ckpt-0001-0000000000/x", b"nor this")
        assert ckpt.list_ids(storage) == [ids[1], ids[3], ids[2], ids[0]]  # (epoch, round) order
        assert ckpt.delete(storage, ids[1]) == 2
        assert ckpt.list_ids(storage) == [ids[3], ids[2], ids[0]]
        assert ckpt.delete(storage, ids[1]) == 0
        assert storage.exists("data/shard-0.npy") and storage.exists("ckpt-notes.txt")

    def test_delete_removes_the_manifest_first(self, storage, cid):
        ckpt.write_manifest(storage, self.manifest(storage, cid))
        order = []
        recording = _RecordingDeletes(storage, order)
        assert ckpt.delete(recording, cid) == 3
        assert order[0] == f"{cid}/manifest.json"
        assert storage.list() == []

    def test_delete_refuses_what_is_no_checkpoint_id(self, storage):
        storage.put("data/x", b"1")
        for bad in ["data", "", "../", "ckpt-0001-0000000000-abcd/x"]:
            with pytest.raises(StorageError, match="not a checkpoint id"):
                ckpt.delete(storage, bad)
        assert storage.list() == ["data/x"]


class _RecordingDeletes:
    """A storage that notes the order of deletes and passes everything on."""

    def __init__(self, inner, order):
        self._inner, self._order = inner, order
        self.url = inner.url

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def delete(self, path):
        self._order.append(path)
        self._inner.delete(path)


class TestOnFile(CheckpointFilesTests):
    @pytest.fixture
    def storage(self, tmp_path):
        return FsspecStorage(f"file://{tmp_path}/ckpts")

    def test_dead_writers_leftovers_go_and_so_does_a_deleted_checkpoints_folder(self, storage, tmp_path):
        root, now = tmp_path / "ckpts", time.time()
        kept, gone, live = new_checkpoint_id(0, 10), new_checkpoint_id(0, 5), new_checkpoint_id(0, 15)
        self.write(storage, kept, a_state())
        self.write(storage, gone, a_state())
        (root / live).mkdir()

        def leftover(folder: str, name: str, age: float) -> str:
            path = root / folder / f"{TEMP_PREFIX}{uuid.uuid4().hex}-{name}"
            path.write_bytes(b"half of it")
            os.utime(path, (now - age, now - age))
            return str(path.relative_to(root))

        (root / "data").mkdir()
        dead = {leftover(kept, "manifest.json", 600), leftover(gone, "ps-1.safetensors", 600)}
        writing = leftover(live, "ps-0.safetensors", 1)
        stranger = leftover("data", "shard-0", 600)  # not in a checkpoint's folder: not ours
        assert ckpt.list_ids(storage) == [gone, kept, live]  # a folder holding only a leftover counts
        assert {p.path for p in ckpt.leftovers(storage)} == dead | {writing}
        assert {p.path for p in ckpt.delete_leftovers(storage, older_than=60)} == dead
        assert ckpt.delete(storage, gone) == 1
        on_disk = {str(p.relative_to(root)) for p in root.rglob("*")}
        assert on_disk == {kept, f"{kept}/ps-0.safetensors", live, writing, "data", stranger}

    def test_safetensors_load_file_reads_our_file(self, storage, cid, tmp_path):
        state = a_state()
        info = self.write(storage, cid, state)
        assert_same(safetensors.torch.load_file(tmp_path / "ckpts" / info.path), state)


class TestOnMemory(CheckpointFilesTests):
    @pytest.fixture
    def storage(self):
        name = f"pdps-ckpt-{uuid.uuid4().hex}"
        yield FsspecStorage(f"memory://{name}")
        fs = fsspec.filesystem("memory")
        if fs.exists(f"/{name}"):
            fs.rm(f"/{name}", recursive=True)


def test_write_manifest_refuses_extra_that_is_not_json(tmp_path):
    storage = FsspecStorage(f"file://{tmp_path}")
    manifest = Manifest("ckpt-0001-0000000002-abcd", "j", 2, 1, 0.0, {}, extra={"x": object()})
    with pytest.raises(ConfigError, match="extra"):
        ckpt.write_manifest(storage, manifest)
    assert storage.list() == []


def test_the_crc32_is_zlibs_whichever_implementation_computes_it():
    data = random_tensor(torch.uint8, (100_000,), 8).numpy().tobytes()
    assert ckpt._crc32(data) == zlib.crc32(data)
    assert ckpt._crc32(memoryview(data)[7:], 12345) == zlib.crc32(data[7:], 12345)


def test_only_big_parts_get_a_thread_whichever_crc32(monkeypatch):
    for crc32 in (zlib.crc32, lambda data, value=0: zlib.crc32(data, value)):  # zlib's, "a fast one"
        monkeypatch.setattr(ckpt, "_crc32", crc32)
        assert ckpt._hash_in_thread(ckpt.HASH_IN_THREAD_ABOVE + 1)
        assert not ckpt._hash_in_thread(ckpt.HASH_IN_THREAD_ABOVE)


@pytest.mark.parametrize("piece", [1, 7, 64, 4096])
@pytest.mark.parametrize("size", [0, 1, 63, 64, 65, 10_000])
def test_the_crc32s_of_each_piece_and_of_the_whole_whatever_the_chunks(piece, size, monkeypatch):
    monkeypatch.setattr(ckpt, "READ_PIECE", 50)  # slices of at most 50 bytes, across pieces and chunks
    data = random_tensor(torch.uint8, (size,), size + piece).numpy().tobytes()
    for threaded in (True, False):
        hasher = ckpt._Hasher(threaded, whole=True, piece=piece)
        try:
            for start in range(0, size, 37):  # chunks that start anywhere in a piece
                hasher.update(memoryview(data)[start : start + 37])
            hasher.result()
        finally:
            hasher.close()
        assert hasher.whole == zlib.crc32(data)
        assert hasher.pieces == piece_crcs(data, piece)


def test_pieces_the_helper_cannot_take_are_hashed_by_the_reader(monkeypatch):
    # A helper that never gets to run: the reader hashes all but the pieces it handed over.
    monkeypatch.setattr(ckpt, "READ_PIECE", 100)
    data = random_tensor(torch.uint8, (10_000,), 4).numpy().tobytes()
    gate = __import__("threading").Event()
    real = ckpt._crc32

    def slow_crc32(chunk, value=0):
        if __import__("threading").current_thread().name == "pdps-crc32":
            gate.wait(10)
        return real(chunk, value)

    def read_into(view, offset):
        view[:] = data[offset : offset + view.nbytes]
        if offset == len(data) - 100:
            gate.set()

    monkeypatch.setattr(ckpt, "_crc32", slow_crc32)
    assert ckpt._read_pieces_hashed(read_into, memoryview(bytearray(len(data))), 2) == piece_crcs(data, 100)


@pytest.mark.parametrize("in_cache", [True, False], ids=["side-by-side", "one-reader"])
def test_both_ways_of_reading_with_a_helper_hash_every_byte(in_cache, monkeypatch):
    monkeypatch.setattr(ckpt, "READ_PIECE", 1000)
    data = random_tensor(torch.uint8, (10_500,), 10).numpy().tobytes()

    def read_into(view, offset):
        view[:] = data[offset : offset + view.nbytes]

    def cached(view, offset):
        read_into(view, offset)
        return in_cache

    out = bytearray(len(data))
    assert ckpt._read_pieces_hashed(read_into, memoryview(out), 2, cached) == piece_crcs(data, 1000)
    assert bytes(out) == data


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_parallel_piece_reads_hash_every_byte_in_order(threads, monkeypatch):
    monkeypatch.setattr(ckpt, "READ_PIECE", 1000)
    data = random_tensor(torch.uint8, (10_500,), 9).numpy().tobytes()
    seen = []

    def read_into(view, offset):
        seen.append((offset, view.nbytes))
        view[:] = data[offset : offset + view.nbytes]

    out = bytearray(len(data))
    assert ckpt._read_pieces_hashed(read_into, memoryview(out), threads) == piece_crcs(data, 1000)
    assert bytes(out) == data
    assert seen == [(i, min(1000, len(data) - i)) for i in range(0, len(data), 1000)]  # in order: one reader


def test_a_failing_piece_read_stops_every_thread_and_is_raised(monkeypatch):
    monkeypatch.setattr(ckpt, "READ_PIECE", 10)
    calls = []

    def read_into(view, offset):
        calls.append(offset)
        if offset == 30:
            raise StorageError("gone")

    with pytest.raises(StorageError, match="gone"):
        ckpt._read_pieces_hashed(read_into, memoryview(bytearray(10_000)), 2)
    assert calls == [0, 10, 20, 30]  # stopped, not read to the end


def test_a_failing_crc32_in_the_helper_thread_is_raised(monkeypatch):
    monkeypatch.setattr(ckpt, "READ_PIECE", 10)

    def crc32(data, value=0):
        raise MemoryError("no")

    monkeypatch.setattr(ckpt, "_crc32", crc32)
    with pytest.raises(MemoryError, match="no"):
        ckpt._read_pieces_hashed(lambda view, offset: None, memoryview(bytearray(100)), 2)


def test_a_part_truncated_between_size_and_read_is_a_storage_error(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt, "READ_PIECE", 4096)
    storage = FsspecStorage(f"file://{tmp_path}")
    cid = new_checkpoint_id(0, 1)
    info = ckpt.write_part(storage, f"{cid}/ps-0.safetensors", {"v": random_tensor(torch.float32, (10_000,), 3)})
    real_open_reader = FsspecStorage.open_reader

    def open_reader(self, path):  # the file shrinks after its size was checked
        with open(tmp_path / path, "r+b") as f:
            f.truncate(info.bytes - 100)
        return real_open_reader(self, path)

    monkeypatch.setattr(FsspecStorage, "open_reader", open_reader)
    with pytest.raises(StorageError, match="holds"):
        ckpt.read_part(storage, info)


def test_parts_checksummed_by_one_crc32_read_with_the_other(tmp_path, monkeypatch):
    # A checkpoint written where ISA-L is installed restores where it is not, and back.
    storage = FsspecStorage(f"file://{tmp_path}")
    cid = new_checkpoint_id(0, 1)
    state = a_state()
    first = ckpt.write_part(storage, f"{cid}/ps-0.safetensors", state)
    monkeypatch.setattr(ckpt, "_crc32", zlib.crc32)
    second = ckpt.write_part(storage, f"{cid}/ps-1.safetensors", state)
    assert first.checksum == second.checksum
    assert_same(ckpt.read_part(storage, first), state)
    monkeypatch.undo()
    assert_same(ckpt.read_part(storage, second), state)


@pytest.mark.gpu
def test_cuda_tensors_are_written_from_a_cpu_copy(tmp_path):
    storage = FsspecStorage(f"file://{tmp_path}")
    cid = new_checkpoint_id(0, 1)
    cpu = random_tensor(torch.float32, (1000,), 9)
    info = ckpt.write_part(storage, f"{cid}/ps-0.safetensors", {"values": cpu.cuda(), "half": cpu.half().cuda()})
    assert_same(ckpt.read_part(storage, info), {"values": cpu, "half": cpu.half()})


def test_a_role_of_a_job_that_keeps_checkpoints_is_refused_without_its_checkpoint_files(tmp_path):
    from pdps.adapters.inproc import InprocTransport
    from pdps.adapters.memory_store import MemoryStore
    from pdps.core.job import JobConfig
    from pdps.roles.pserver import Pserver
    from pdps.runtime.recovery import files_for

    config = JobConfig(name="j", dataset="memory://d", checkpoint_url=f"file://{tmp_path}", checkpoint_every=1)
    with pytest.raises(ConfigError, match="open_checkpoint_files"):
        Pserver(MemoryStore(), InprocTransport(), None, config)  # type: ignore[arg-type]
    files = ckpt.SafetensorsFiles(FsspecStorage(f"file://{tmp_path}"))
    assert files_for(config, files) is files and files.url == f"file://{tmp_path}"
    assert files_for(JobConfig(name="j", dataset="memory://d"), None) is None
