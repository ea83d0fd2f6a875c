"""The suites: which program of the checkout's ``bench/`` each one is, with which
arguments, and running one as a subprocess.

A suite's program is run with ``sys.executable`` from the checkout's root, its stderr
and its stdout table streamed through as they come (prefixed with the suite's name),
and its JSON taken from the last line of its stdout (or, for a program whose
``--json`` names a file, from that file).

The full arguments are chosen so that two runs of every suite fit in about 15-20
minutes on 2 cores: only the rows the targets need plus a few.
"""

from __future__ import annotations

import collections
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import attrs

from pdps.shell.benchmark.targets import SUITES, BenchError, SuiteOutputError

STDERR_TAIL_LINES = 40
SUITE_TIMEOUT_S = 1800.0  # one run of one suite


@attrs.frozen
class Suite:
    """One suite: ``bench/<program>`` run with ``full`` (or ``quick``) arguments.

    ``json_to_file``: the program takes ``--json PATH`` and writes its JSON there;
    otherwise ``--json`` is a flag and the JSON is the last line of its stdout.
    """

    name: str
    program: str
    about: str
    full: tuple[str, ...]
    quick: tuple[str, ...]
    json_to_file: bool = False

    def args(self, quick: bool) -> list[str]:
        return list(self.quick if quick else self.full)


SUITE_SPECS: dict[str, Suite] = {
    s.name: s
    for s in (
        Suite(
            "transport",
            "transport.py",
            "Push + pull of a parameter set held by 2 pservers (half each) from one trainer, over the gRPC transport "
            "(2 server processes) and inproc, against raw loopback TCP (one server process) and "
            "torch.distributed.rpc (TensorPipe, 2 processes). GB/s = (bytes pushed + pulled) / round time, median of "
            "the timed rounds; the rounds of the in-process routes are interleaved.",
            ("--transports", "grpc", "tcp", "torch-rpc", "inproc", "--mib", "64", "--blocks", "1", "4", "--repeats", "7", "--warmup", "2"),
            ("--transports", "grpc", "tcp", "torch-rpc", "inproc", "--mib", "8", "--blocks", "1", "--repeats", "3", "--warmup", "1"),
        ),
        Suite(
            "master",
            "master_transitions.py",
            "A real master over a queue of N tasks on each coordination store (throwaway etcd and Redis servers, "
            "data on /dev/shm; memory://), driven by client threads (one trainer each; `clients` in the configuration) "
            "looping get_task / finish_task; against the "
            "original design's persistence, one key holding gzip(JSON of every task record) rewritten per transition.",
            ("--backends", "etcd", "redis", "memory", "--tasks", "100000", "--seconds", "5", "--baseline-transitions", "100"),
            ("--backends", "etcd", "redis", "memory", "--tasks", "2000", "--seconds", "1", "--baseline-transitions", "20"),
            json_to_file=True,
        ),
        Suite(
            "checkpoint",
            "checkpoint.py",
            "A pserver's Adam shard state written with write_part (safetensors, crc32, temporary file, fsync, rename) "
            "and read back with read_part (warm: in the page cache; cold: dropped with posix_fadvise first), against "
            "raw sequential write + fsync and raw sequential read of the same bytes, under /tmp.",
            ("--mib", "1024", "--repeats", "3"),
            ("--mib", "64", "--repeats", "2"),
        ),
        Suite(
            "end-to-end",
            "end_to_end.py",
            "Training throughput of pdps jobs (trainers x pservers, sync and async, over inproc and gRPC) against a "
            "single-process torch loop of the same model, batch and optimizer measured in the same run, with a "
            "per-step breakdown of where a step's time goes.",
            ("--trainers", "1", "2", "3"),
            ("--quick",),
        ),
        Suite(
            "scale",
            "scale.py",
            "The control plane's costs as the job grows: real sync jobs (pdps.simulate: the library's master, pservers and "
            "trainers on memory:// with a 0.5 ms round trip per get and commit, inproc, torch on a model of scalars) at 10 "
            "and 100 trainers x 4 and 16 pservers, counted "
            "per sync step (store operations, bytes, compare-and-set conflicts, messages); and a real master over 10k, 100k and "
            "1M tasks, counted per task (store operations and bytes, memory by tracemalloc). Ratios between sizes: a "
            "linear cost per step grows as the trainers, a per-task cost stays flat; the cost model is in [scale.md](scale.md).",
            (),
            ("--quick",),
        ),
        Suite(
            "elastic",
            "elastic.py",
            "Resizing a running sync job 2 -> 3 -> 4 -> 2 pservers (64 MiB and 1 GiB of float32 parameters, SGD, 1 trainer, "
            "every role its own process (etcd, python -m pdps ROLE as pdps launch starts them) over gRPC on 127.0.0.1; "
            "--quick: 8 MiB, the roles in one process): per resize, its wall time (request to done), the "
            "longest trainer pause (the longest gap between a trainer's consecutive steps from the request to its first "
            "step after done, minus its usual step), and the bytes moved against the minimum of the two slot maps; "
            "against, in the same run, stopping the job at a checkpoint, starting it with the new count and restoring "
            "(from the checkpoint's last step to the first step after the restore, process starts included).",
            (),
            ("--quick",),
        ),
        Suite(
            "replicas",
            "replicas.py",
            "Shard replicas, replicas = 2 against replicas = 1 in the same run. Kill -> training resumed: the digits "
            "example (2 trainers, 2 pservers, sync) started by `pdps launch --restart on-failure` over gRPC with a "
            "throwaway etcd on 127.0.0.1 (every role a process), lease TTL 2 s both times; pserver 1 SIGKILLed 5 times "
            "(1 with --quick), seconds from the kill to training resumed: replicas = 1 rolls back to its checkpoint "
            "(resumed: a round of the new epoch closed), replicas = 2 fails over to the backups (resumed: the round after "
            "the one under way at the kill closed), polled in etcd every 20 ms; and the rounds each kill made the job "
            "train again. Throughput: the 10M-parameter MLP of the end-to-end suite (batch 64, SGD), 2 trainers + 2 "
            "pservers, sync and async, samples/s over the timed window, every role a process over gRPC (--quick: "
            "in process over inproc, fewer steps). A configuration the pservers refuse is reported as not run, with "
            "the reason.",
            (),
            ("--quick",),
        ),
        Suite(
            "online",
            "online.py",
            "Online training, each figure against a baseline in the same run, every job pdps.simulate (in process, memory://, "
            "inproc), medians of 3 repeats (1 with --quick). Stream throughput: 200,000 records (20,000 with --quick) of a "
            "float32[64] vector and a label, in a Redis stream on a throwaway redis-server on 127.0.0.1 and in a Parquet file, "
            "trained by the same job (MLP 64-256-256-1, batch 256, 2 trainers, 1 pserver, async, tasks of 2,000 records); "
            "records/s = records / training time. Speculation: 8 tasks of 100 steps (20 with --quick) of 8 records, a step "
            "of 10 ms (a sleep), 3 trainers, 1 pserver, async, trainer 0 slowed 10x; the job time with speculation on "
            "against off, and the records the pass audit shows trained exactly once. Sync is not measured: every sync "
            "round waits for the straggler, so a backup cannot gain.",
            (),
            ("--quick",),
        ),
        Suite(
            "sparse",
            "sparse.py",
            "Sparse tables on the pservers (pdps.nn). Per step, a pull and a push (SGD) of 64k distinct rows x 64 float32 "
            "(8k with --quick) of a 10M-row table (1M), pre-filled by pushing every id once in a random order, through the "
            "real pserver path: a TrainerContext attaches the model and sends the trainer's requests to 2 pservers, in "
            "process over inproc against index_select + index_add_ on a local [rows, 64] tensor, and as 2 `pdps pserver` "
            "processes (throwaway etcd) over gRPC against the raw loopback TCP echo of the same bytes (ids and rows, half "
            "to each of 2 server processes); rows/s over the median step, the routes interleaved. Memory: each pserver "
            "process's RSS growth over the fill against the raw bytes of its rows and their optimizer state, SGD and "
            "Adagrad. Reported, no target: the CTR example (pdps.simulate, 2 trainers x 2 pservers, inproc) against "
            "single-process torch (EmbeddingBag sparse=True + Adagrad) on the same samples, samples/s.",
            (),
            ("--quick",),
        ),
        Suite(
            "pipeline",
            "pipeline.py",
            "Pipeline parallelism (issue 20), each figure against a reference in the same run. Bubble: 4 real StageRunners, "
            "one thread each, over inproc p2p, each stage's compute a sleep (forward 50 ms, backward 100 ms; 5 and 10 with "
            "--quick), 8 microbatches a step, GPipe and 1F1B, median of 5 steps each (2 with --quick) after one untimed; "
            "bubble = 1 - sum of the stages' busy time / (stages x step makespan), against theory (P-1)/(M+P-1); within 10% "
            "means |measured - theory| <= 0.1 x theory. Peak activations held per stage, the runner's own counter (GPipe: M; "
            "1F1B: min(M, P - stage)). p2p: an activation of 4 and 16 MiB (4 with --quick) sent over gRPC (its bulk channel) "
            "from this process to a second one and sent back, against the raw loopback TCP echo of the same bytes by a thread "
            "of that second process, rounds interleaved; GB/s = 2 x bytes / the median of 200 rounds (5 with --quick).",
            (),
            ("--quick",),
        ),
        Suite(
            "graph",
            "graph.py",
            "Update rules as graphs (docs/graph.md). A pserver shard of 10M float32 parameters in 10 blocks (1M with --quick), "
            "the real TorchShard stepped by apply with a fixed gradient per block: Adam (lr 1e-3) run from the graph rule "
            "pdps.graph_rule makes (GraphOptimizer) against eager torch.optim.Adam (torch's defaults) on tensors of the same "
            "blocks, and the named 'Adam' shard (no target); the routes' steps interleaved, 2 warm-up and 20 timed steps "
            "each (5 with --quick), medians; the graph-run parameters must equal eager torch's to 1e-5. Conversion: convert "
            "of a fresh Adam cold (the process's first trace) and cached, the cache's counts, and a pserver's check and "
            "runner build of the rule. One torch intra-op thread, as pdps launch gives a pserver.",
            (),
            ("--quick",),
        ),
    )
}
assert tuple(SUITE_SPECS) == SUITES


def bench_dir(package_file: str | None = None) -> Path:
    """The checkout's ``bench/``, next to the ``pdps`` package; a BenchError when it is not there."""
    if package_file is None:
        import pdps

        package_file = pdps.__file__
    path = Path(package_file).resolve().parents[1] / "bench"
    if not path.is_dir():
        raise BenchError(
            f"pdps bench runs the benchmark programs of a source checkout, and there is no bench/ directory at {path} "
            "(pdps is installed from a wheel?): run it from a clone of the repository, with pdps installed from it "
            "(pip install -e '.[dev]')"
        )
    return path


def command_of(suite: Suite, bench: Path, quick: bool, json_path: Path | None = None) -> list[str]:
    """The argv a suite runs with (``json_path``: where a ``json_to_file`` program writes)."""
    argv = [sys.executable, str(bench / suite.program), *suite.args(quick)]
    if suite.json_to_file:
        return [*argv, "--json", str(json_path) if json_path is not None else "PATH"]
    return [*argv, "--json"]


def display_command(argv: Sequence[str], root: Path) -> str:
    """The argv as a reader would type it from the checkout: ``python bench/x.py ...``."""
    shown = ["python" if a == sys.executable else os.path.relpath(a, root) if a.startswith(str(root) + os.sep) else a for a in argv]
    return shlex.join(shown)


def parse_json_line(text: str, where: str) -> dict[str, Any]:
    """The JSON object on the last non-empty line of ``text``; a SuiteOutputError saying what came instead."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise SuiteOutputError(f"{where} printed nothing on stdout: expected a JSON object on its last line")
    last = lines[-1].strip()
    try:
        value = json.loads(last)
    except json.JSONDecodeError as exc:
        raise SuiteOutputError(f"{where}: the last line of its stdout is not JSON ({exc}): {last[:200]!r}") from None
    if not isinstance(value, dict):
        raise SuiteOutputError(f"{where}: the last line of its stdout is JSON but not an object: {last[:200]!r}")
    return value


def _pump(stream: TextIO, echo: Callable[[str], None], keep: collections.deque, *, hide_json: bool) -> None:
    for line in stream:
        keep.append(line)
        if not (hide_json and line.lstrip().startswith("{")):
            echo(line.rstrip("\n"))


def run_suite(
    suite: Suite, bench: Path, *, quick: bool, label: str, echo: Callable[[str], None], timeout: float = SUITE_TIMEOUT_S
) -> dict[str, Any]:
    """Run one suite once. Returns ``{"ok", "seconds", "returncode", "report" | "error", "stderr_tail"}``.

    A program that exits non-zero, runs past ``timeout`` or prints no JSON object is a
    failed run (``ok`` False, ``error`` says why; the JSON of one that exited non-zero is
    kept as ``report`` when it printed one); it raises nothing.
    """
    root = bench.parent
    program = bench / suite.program
    if not program.is_file():
        return {"ok": False, "seconds": 0.0, "returncode": None, "error": f"{program} does not exist", "stderr_tail": ""}
    with tempfile.TemporaryDirectory(prefix="pdps-bench-") as tmp:
        json_path = Path(tmp) / f"{suite.name}.json"
        argv = command_of(suite, bench, quick, json_path)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, cwd=root, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out: collections.deque = collections.deque()
        err: collections.deque = collections.deque(maxlen=STDERR_TAIL_LINES)
        prefix = f"[{label}] "
        pumps = [
            threading.Thread(target=_pump, args=(proc.stdout, lambda s: echo(prefix + s), out), kwargs={"hide_json": True}, daemon=True),
            threading.Thread(target=_pump, args=(proc.stderr, lambda s: echo(prefix + s), err), kwargs={"hide_json": False}, daemon=True),
        ]
        for p in pumps:
            p.start()
        try:
            returncode = proc.wait(timeout)
            error = None if returncode == 0 else f"{suite.program} exited with status {returncode}"
        except subprocess.TimeoutExpired:
            proc.kill()
            returncode = proc.wait()
            error = f"{suite.program} ran past {timeout:g} s and was killed"
        for p in pumps:
            p.join(10)
        seconds = time.monotonic() - t0
        result: dict[str, Any] = {"ok": False, "seconds": seconds, "returncode": returncode, "stderr_tail": "".join(err)}
        if returncode is not None and returncode >= 0:  # a program that exits 1 may still report what it measured
            try:
                if suite.json_to_file and json_path.is_file():
                    result["report"] = _load_json_file(json_path, suite.program)
                else:
                    result["report"] = parse_json_line("".join(out), suite.program)
            except BenchError as exc:
                error = error or str(exc)
        if error is None:
            result["ok"] = True
        else:
            result["error"] = error
        return result


def _load_json_file(path: Path, where: str) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SuiteOutputError(f"{where}: its JSON file {path} cannot be read: {exc}") from None
    if not isinstance(value, dict):
        raise SuiteOutputError(f"{where}: its JSON file holds {type(value).__name__}, not an object")
    return value


def suite_config(suite: Suite, report: dict[str, Any]) -> dict[str, Any]:
    """The configuration a suite reports: its ``config`` block, else its top-level settings
    (numbers, strings, booleans and short lists; not figures, machine or timings)."""
    if isinstance(report.get("config"), dict):
        return dict(report["config"])
    skip = {"machine", "results", "ratios", "runs", "torch", "command", "total_s", "loadavg_start", "loadavg_end", "root", "bench"}
    out = {}
    for key, value in report.items():
        if key in skip:
            continue
        if isinstance(value, (str, int, float, bool)) or value is None:
            out[key] = value
        elif isinstance(value, list) and len(value) <= 16 and all(isinstance(v, (str, int, float, bool)) or v is None for v in value):
            out[key] = value
    return out
