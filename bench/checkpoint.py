"""Saving and restoring a pserver's checkpoint part, against raw file I/O of the same bytes.

A benchmark, not a test: it prints figures and ratios and asserts nothing about speed
(it exits 0 whatever the figures; a target it misses is printed as MISSED).

What runs
---------
A pserver shard state as ``TorchShard.state_dict()`` gives it for Adam, ``--mib`` MiB
in all (default 1024): ``values``, ``state.exp_avg`` and ``state.exp_avg_sq``, a third
each (float32), plus ``scalar.step`` and ``pdps.version`` (0-d). Everything is written
to and read from files under ``--root`` (default a fresh directory under /tmp, i.e. the
disk; ``--root /dev/shm`` measures RAM), through ``file://`` storage.

* ``raw write``: ``os.open``, ``os.write`` of the three tensors' memory, ``fsync``,
  ``close``: the same bytes, without header, checksum, temporary name or rename.
* ``write_part``: :func:`pdps.adapters.safetensors_files.write_part` (safetensors
  header, crc32s of every byte, of the whole part and of each 4 MiB piece,
  ``put_chunks`` to a temporary file, fsync, rename, fsync of the folder), with the
  crc32s in a helper thread and, in a second row, inline in the writing thread. The row of the library's own choice (a helper thread for parts over
  ``HASH_IN_THREAD_ABOVE``, whichever crc32) is marked ``*``; the ratios use it.
* ``raw read``: a new buffer allocated as ``read_part`` allocates its own (anonymous
  mmap with transparent huge pages), filled with ``readinto`` from an unbuffered file.
  An extra row reads into a buffer reused across rounds (no page faults at all): the
  floor, printed, not used by a target.
* ``read_part``: :func:`pdps.adapters.safetensors_files.read_part`: size check, one buffer, the
  file opened once and read in 4 MiB pieces (``READ_PIECE``), each hashed right after
  it is read, the checksum check, header checks, and tensors as views of the buffer.
  With a helper thread (two threads read and hash pieces, each piece checked against
  its own crc32 in the manifest) and, in a second row, inline (one thread).
* Reads run twice per round: **warm** (right after the write, the file is in the page
  cache) and **cold** (after ``posix_fadvise(POSIX_FADV_DONTNEED)`` on the file, which
  drops its clean pages from the cache without root; on tmpfs nothing is dropped).
  Both rows of a pair see the same cache state.
* ``crc32``: the checksum alone over the same bytes in memory, for reference.

The crc32 is ISA-L's when the ``isal`` package is installed (``pdps[isal]``, part of
the dev extra), else zlib's; ``--zlib`` forces zlib's, to see what a plain install gets.

What is timed
-------------
Wall time of each operation, the median of ``--repeats`` rounds after one untimed
warm-up round (the first touch of fresh memory in a VM is much slower than later
ones). In a round the operations run in an order rotated each round, so that noise
from other processes falls on all of them alike. GB/s = bytes / seconds, GB = 1e9
bytes. After the timed rounds, each restored part is compared with the source state.

Targets: raw write time / write_part time >= 0.8 (save) and raw read time / read_part
time >= 0.8 (restore), warm and cold each, on medians. The same ratios on each row's
fastest round are printed beside them.

Run
---
    .venv/bin/python bench/checkpoint.py                       # ~45 s on 2 cores
    .venv/bin/python bench/checkpoint.py --repeats 7           # steadier medians on a busy machine
    .venv/bin/python bench/checkpoint.py --mib 256
    .venv/bin/python bench/checkpoint.py --root /dev/shm --json
    .venv/bin/python bench/checkpoint.py --zlib                # without ISA-L

``run(size_bytes, root, repeats, zlib_crc) -> dict`` is importable; ``--json`` prints that dict as
one JSON object on the last stdout line, after the table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.machine import describe  # noqa: E402
from pdps.adapters import safetensors_files as ckpt  # noqa: E402
from pdps.adapters.fsspec_storage import FsspecStorage  # noqa: E402
from pdps.core.checkpoints import PartInfo, checkpoint_id  # noqa: E402

GB = 1e9
TARGET = 0.8


def shard_state(size_bytes: int) -> dict[str, torch.Tensor]:
    """Adam's shard state: values and two moments of equal size, a step and a version."""
    n = size_bytes // 12
    g = torch.Generator().manual_seed(0)
    values = torch.randn(n, generator=g)
    return {
        "values": values,
        "state.exp_avg": values * 0.1,
        "state.exp_avg_sq": values.square(),
        "scalar.step": torch.tensor(1234.0),
        "pdps.version": torch.tensor(1234, dtype=torch.int64),
    }


def tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def drop_from_page_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def raw_write(path: str, views: list[memoryview]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for v in views:
            done = 0
            while done < v.nbytes:
                done += os.write(fd, v[done:])
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(path: str, size: int, reuse: memoryview | None = None) -> Any:
    buf = ckpt._new_buffer(size) if reuse is None else None  # read_part's own allocation
    view = reuse if reuse is not None else memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        got = 0
        while got < size:
            k = f.readinto(view[got:])
            if not k:
                raise RuntimeError(f"{path} ended after {got} of {size} bytes")
            got += k
    return buf


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def filesystem_of(path: str) -> str:
    """'device (type)' of the mount holding ``path``, from /proc/mounts."""
    best, what = "", "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fstype = line.split()[:3]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, what = mnt, f"{dev} ({fstype}) mounted at {mnt}"
    return what


def transparent_huge_pages() -> str:
    with contextlib.suppress(OSError):
        return Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    return "unknown"


def run(size_bytes: int = 1 << 30, root: str | None = None, repeats: int = 3, zlib_crc: bool = False) -> dict[str, Any]:
    started = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="pdps-bench-ckpt-", dir=root or "/tmp")
    library_crc = ckpt._crc32
    if zlib_crc:
        ckpt._crc32 = zlib.crc32
    try:
        return _run(size_bytes, workdir, repeats, started)
    finally:
        ckpt._crc32 = library_crc
        shutil.rmtree(workdir, ignore_errors=True)


def _run(size_bytes: int, workdir: str, repeats: int, started: float) -> dict[str, Any]:
    loadavg_start = list(os.getloadavg())
    state = shard_state(size_bytes)
    views = [tensor_bytes(t) for t in state.values()]
    data_bytes = sum(v.nbytes for v in views)
    storage = FsspecStorage(f"file://{workdir}")
    raw_path = os.path.join(workdir, "raw.bin")
    cid = checkpoint_id(0, 1, 0)
    paths = {"thread": f"{cid}/ps-thread.safetensors", "inline": f"{cid}/ps-inline.safetensors"}
    infos: dict[str, PartInfo] = {}
    library_choice = ckpt._hash_in_thread
    default_mode = "thread" if library_choice(data_bytes) else "inline"
    reuse = memoryview(np.ones(data_bytes, dtype=np.uint8))  # touched: its pages exist

    def write_pdps(mode: str) -> None:
        ckpt._hash_in_thread = lambda nbytes: mode == "thread"
        try:
            infos[mode] = ckpt.write_part(storage, paths[mode], state)
        finally:
            ckpt._hash_in_thread = library_choice

    def read_pdps(mode: str) -> dict[str, torch.Tensor]:
        ckpt._hash_in_thread = lambda nbytes: mode == "thread"
        try:
            return ckpt.read_part(storage, infos[mode])
        finally:
            ckpt._hash_in_thread = library_choice

    def row_label(op: str, mode: str) -> str:
        return f"{op} (crc32 {'in a thread' if mode == 'thread' else 'inline'}){' *' if mode == default_mode else ''}"

    writes: dict[str, Callable[[], Any]] = {
        "raw write": lambda: raw_write(raw_path, views),
        row_label("write_part", "thread"): lambda: write_pdps("thread"),
        row_label("write_part", "inline"): lambda: write_pdps("inline"),
    }
    reads: dict[str, Callable[[], Any]] = {
        "raw read": lambda: raw_read(raw_path, data_bytes),
        row_label("read_part", "thread"): lambda: read_pdps("thread"),
        row_label("read_part", "inline"): lambda: read_pdps("inline"),
    }
    files = dict(zip(writes, [raw_path, f"{workdir}/{paths['thread']}", f"{workdir}/{paths['inline']}"]))
    read_files = dict(zip(reads, files.values()))
    times: dict[str, list[float]] = {}

    def record(label: str, seconds: float, timed_round: bool) -> None:
        if timed_round:
            times.setdefault(label, []).append(seconds)

    for r in range(repeats + 1):
        timed_round = r > 0  # round 0 warms up: first touches of fresh memory, imports
        order = list(range(3))
        order = order[r % 3 :] + order[: r % 3]
        for i in order:
            label = list(writes)[i]
            remove(files[label])  # every write creates its file, none truncates an old one
            seconds, _ = timed(writes[label])
            record(label, seconds, timed_round)
        for cache in ("warm", "cold"):
            for i in order:
                label = list(reads)[i]
                if cache == "cold":
                    drop_from_page_cache(read_files[label])
                seconds, out = timed(reads[label])
                record(f"{label}, {cache}", seconds, timed_round)
                del out
        seconds, _ = timed(lambda: raw_read(raw_path, data_bytes, reuse))
        record("raw read into a reused buffer, warm", seconds, timed_round)
        seconds, _ = timed(lambda: [ckpt._crc32(v) for v in views])
        record("crc32 of the bytes in memory", seconds, timed_round)

    # Every restored byte must be the saved one.
    for mode in ("thread", "inline"):
        back = read_pdps(mode)
        for key, t in state.items():
            if not torch.equal(back[key], t):
                raise RuntimeError(f"read_part ({mode}) returned a different {key!r}")

    part_bytes = infos["thread"].bytes
    rows = []
    for label, ts in times.items():
        nbytes = part_bytes if label.startswith(("write_part", "read_part")) else data_bytes
        med = statistics.median(ts)
        rows.append({"label": label, "seconds": med, "min_s": min(ts), "max_s": max(ts), "gbps": nbytes / med / GB, "bytes": nbytes})
    by = {r["label"]: r for r in rows}

    def ratio(name: str, base: str, mine: str) -> dict[str, Any]:
        value = by[base]["seconds"] / by[mine]["seconds"]
        best = by[base]["min_s"] / by[mine]["min_s"]
        return {"name": name, "value": value, "best": best, "target": TARGET, "met": value >= TARGET, "row": mine, "baseline": base}

    ratios = [
        ratio("save / raw write", "raw write", row_label("write_part", default_mode)),
        ratio("restore / raw read, warm", "raw read, warm", f"{row_label('read_part', default_mode)}, warm"),
        ratio("restore / raw read, cold", "raw read, cold", f"{row_label('read_part', default_mode)}, cold"),
    ]
    return {
        "machine": describe("fsspec", torch=torch.__version__, numpy=np.__version__),
        "root": workdir,
        "filesystem": filesystem_of(os.path.realpath(workdir)),
        "transparent_huge_pages": transparent_huge_pages(),
        "size_bytes": size_bytes,
        "data_bytes": data_bytes,
        "part_bytes": part_bytes,
        "repeats": repeats,
        "hash_in_thread": default_mode == "thread",
        "crc32": f"{ckpt._crc32.__module__}.crc32",
        "piece_bytes": ckpt.PIECE,
        "loadavg_start": loadavg_start,
        "loadavg_end": list(os.getloadavg()),
        "results": rows,
        "ratios": ratios,
        "total_s": time.perf_counter() - started,
    }


def print_report(report: dict[str, Any], command: str) -> None:
    m = report["machine"]
    print(f"command: {command}")
    print(f"machine: {m['cpu_count']} CPUs ({m['cpu_model']}), Python {m['python']}, torch {m['torch']}, numpy {m['numpy']}, fsspec {m['fsspec']}")
    print(f"files under {report['root']} on {report['filesystem']}; transparent huge pages: {report['transparent_huge_pages']}")
    print(f"crc32 by {report['crc32']}")
    ls, le = report["loadavg_start"], report["loadavg_end"]
    print(f"load average (1/5/15 min) at start {ls[0]:.2f} {ls[1]:.2f} {ls[2]:.2f}, at end {le[0]:.2f} {le[1]:.2f} {le[2]:.2f}")
    if ls[0] > m["cpu_count"] / 2:
        print("CAUTION: other processes were busy: the crc32 thread competes with them for the cores, figures are noisy")
    print(
        f"shard state of {report['data_bytes'] / 2**20:,.1f} MiB (values, exp_avg, exp_avg_sq float32 + 2 scalars); "
        f"part file {report['part_bytes']:,} bytes; median of {report['repeats']} rounds after 1 warm-up; GB = 1e9 bytes"
    )
    print("warm: the file was just written, its pages are in the page cache; cold: dropped with posix_fadvise(DONTNEED) first")
    if "tmpfs" in report["filesystem"]:
        print("CAUTION: tmpfs keeps files in RAM: 'cold' reads are warm")
    print()
    h = f"{'operation':<46} {'seconds':>8} {'min':>8} {'max':>8} {'GB/s':>7}"
    print(h)
    print("-" * len(h))
    for r in report["results"]:
        print(f"{r['label']:<46} {r['seconds']:>8.3f} {r['min_s']:>8.3f} {r['max_s']:>8.3f} {r['gbps']:>7.2f}")
    print()
    for x in report["ratios"]:
        print(
            f"{x['name']:<26} {x['value']:>6.3f}   target >= {x['target']:g}  {'MET' if x['met'] else 'MISSED':<7} "
            f"best rounds {x['best']:.3f}  ({x['row']} vs {x['baseline']})"
        )
    print("* the library's own choice (a helper thread for big parts, whichever crc32); the ratios use it")
    print("(ratio = baseline seconds / pdps seconds, medians: 1.0 means as fast as raw I/O of the same bytes;")
    print(" best rounds = the same with each row's fastest round, less sensitive to other processes' bursts)")
    print(f"\ntotal run time {report['total_s']:.1f} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=float, default=1024, help="shard state size in MiB (default 1024)")
    p.add_argument("--root", default=None, help="directory to write under (default: a temporary one under /tmp; /dev/shm is RAM)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds (default 3)")
    p.add_argument("--zlib", action="store_true", help="checksum with zlib.crc32 even when ISA-L (isal) is installed")
    p.add_argument("--json", action="store_true", help="also print the results as one JSON object on the last stdout line")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    command = " ".join(shlex.quote(a) for a in [sys.executable, *(sys.argv if argv is None else [sys.argv[0], *argv])])
    report = run(int(args.mib * 2**20), args.root, args.repeats, zlib_crc=args.zlib)
    report["command"] = command
    print_report(report, command)
    if args.json:
        print(json.dumps(report, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
