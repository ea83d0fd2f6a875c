"""Shard replicas: a pserver's death with replicas = 2 against the rollback of replicas = 1,
and what the second copy costs in training throughput.

A benchmark, not a test: it prints figures and ratios against baselines measured in the
same run and asserts nothing about speed (it exits 1 only when a kill was not recovered
from, or a sync configuration did not run).

What runs
---------
* **Kill -> training resumed** (every role its own process, always): a throwaway etcd on
  127.0.0.1 (``tests/servers.py``) and, for replicas = 1 and then 2, the job of
  ``bench/recovery.py`` (:func:`bench.recovery.recoveries`): ``python -m pdps launch``
  of the digits example, 2 trainers, 2 pservers, sync, over gRPC, ``--restart
  on-failure`` (the launcher restarts a dead role at its index, as an operator or a
  StatefulSet does), checkpoints every ``--checkpoint-every`` rounds, the same
  ``--lease-ttl`` (default 2 s) both times. Pserver 1 is SIGKILLed ``--repeats`` times.
  With replicas = 1 each kill waits for a checkpoint of the current epoch followed by
  training, and the job rolls back to it (a new epoch); training has resumed when a
  round of the new epoch closes. With replicas = 2 each kill waits for the same, and
  until every slot has its two copies again (the previous kill's re-replication done);
  a backup takes over
  with no rollback, and training has resumed when the round after the one under way at
  the kill closes (every trainer pulled the round under way from the new primaries and
  pushed the next). Seconds after the SIGKILL, by polling etcd every 20 ms.
* **Throughput** of the 10M-parameter MLP of ``bench/end_to_end.py`` (784-2048-2048-
  2048-10, batch 64, SGD; its training function ``bench/e2e_train.py``, its
  configurations' settings), 2 trainers and 2 pservers, with replicas = 1 and 2, sync
  and async. ``--processes`` (the default of the full run): ``pdps launch`` over gRPC on
  the run's etcd (:class:`bench.end_to_end.Launch`), every role a process;
  ``--in-process`` (the default of ``--quick``): ``pdps.simulate`` on ``memory://``
  over inproc (:func:`bench.end_to_end.run_inproc`). samples/s over the timed window
  (after ``--warmup`` steps per trainer). A configuration the pservers refuse (a
  ConfigError at their start) is reported as not run, with the reason; its ratio too.

Ratios (the targets of ``pdps bench --suite replicas``)
-------------------------------------------------------
* ``resumed_beyond_ttl``: replicas = 2's kill -> resumed (median of the kills) minus the
  lease TTL (as etcd grants it: whole seconds), the time failover adds to noticing the
  death;
* ``resumed_r1_vs_r2``: replicas = 1's kill -> resumed over replicas = 2's (medians);
* ``sync_r2_vs_r1``, ``async_r2_vs_r1``: samples/s with replicas = 2 over replicas = 1.

Run
---
    .venv/bin/python bench/replicas.py                  # ~2-3 min on 2 cores
    .venv/bin/python bench/replicas.py --quick          # 1 kill each, throughput in-process, fewer steps
    .venv/bin/python bench/replicas.py --repeats 5 --lease-ttl 3 --modes sync

``--json``: the table and progress on stderr, one JSON object on stdout's last line.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # for bench.* and tests.servers (throwaway etcd)

import pdps  # noqa: E402
from bench import e2e_train  # noqa: E402
from bench.end_to_end import BATCH, ROWS_PER_TASK, Launch, RunFailed, run_inproc, write_dataset  # noqa: E402
from bench.machine import finish  # noqa: E402
from bench.recovery import TARGET as KILLED_JOB  # noqa: E402
from bench.recovery import recoveries, say  # noqa: E402

FULL = {"repeats": 5, "checkpoint_every": 20, "samples": 6400, "roles": "processes"}
QUICK = {"repeats": 1, "checkpoint_every": 10, "samples": 640, "roles": "in-process"}
TRAINERS, PSERVERS = 2, 2
REPLICAS = (1, 2)
WARMUP = 4  # steps per trainer not timed
MIN_BLOCK = 1 << 18  # bench/end_to_end.py's default
JOB_TIMEOUT_S = 300.0  # one throughput configuration


def failover(store_url: str, lease_ttl: float, repeats: int, checkpoint_every: int) -> list[dict[str, Any]]:
    """The kill -> resumed runs of replicas 1 and 2 on one etcd."""
    runs = []
    for replicas in REPLICAS:
        say(f"kill -> resumed, replicas = {replicas}: {repeats} kill(s) of pserver 1, lease TTL {lease_ttl:g} s")
        got = recoveries(store_url, lease_ttl, repeats, checkpoint_every, replicas=replicas, job=f"bench-replicas-r{replicas}")
        if got["error"]:
            tail = "\n".join(f"    {line}" for line in got["log_tail"])
            raise RuntimeError(f"replicas = {replicas}: {got['error']}; the launcher's last lines:\n{tail}")
        kills = [r["seconds"]["resumed"] for r in got["results"]]
        # a rollback trains again every round since its checkpoint; a failover none
        retrained = [r["last_round_before_kill"] - r["checkpoint_round"] if r["rolled_back"] else 0 for r in got["results"]]
        runs.append({
            "replicas": replicas, "resumed_s": statistics.median(kills), "kills_s": kills, "rounds_retrained": retrained,
            "rollbacks": sum(r["rolled_back"] for r in got["results"]), "medians_s": got["medians"], "results": got["results"],
        })  # fmt: skip
        say(f"  replicas = {replicas}: resumed {', '.join(f'{k:.2f}' for k in kills)} s after the kills; rollbacks {runs[-1]['rollbacks']}")
    return runs


def throughput(mode: str, replicas: int, *, roles: str, settings: argparse.Namespace, data: Path, out: Path, store_url: str) -> dict[str, Any]:
    """One configuration's row: its figures, or ``not_run`` and why."""
    row: dict[str, Any] = {"mode": mode, "replicas": replicas, "trainers": TRAINERS, "pservers": PSERVERS}
    out.mkdir()
    try:
        if roles == "in-process":
            got = run_inproc(settings, data, out, mode, TRAINERS, PSERVERS, replicas)
        else:
            launch = Launch(settings, store_url, data, out, mode, TRAINERS, PSERVERS, replicas)
            try:
                launch.go()
                launch.wait_window()
                got = launch.finish()  # a launcher that failed: RunFailed, with the roles' last lines
            finally:
                launch.stop()
    except (RunFailed, pdps.PdpsError) as exc:
        row["not_run"] = " ".join(f"{type(exc).__name__}: {exc}".split())  # one line: it ends up in a table cell
        say(f"  {mode}, replicas = {replicas}: NOT RUN: {row['not_run']}")
        return row
    row.update(got)
    row["steps_per_s"] = got["trainer_steps"] / got["seconds"]
    say(f"  {mode}, replicas = {replicas}: {row['samples_per_s']:.0f} samples/s over {row['seconds']:.1f} s")
    return row


def ratio(rows: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    """samples/s of replicas = 2 over replicas = 1 in ``mode``, or ``not_run`` naming the row that did not run."""
    got = {r["replicas"]: r for r in rows if r["mode"] == mode}
    missing = [got[k] for k in REPLICAS if "not_run" in got[k]]
    if missing:
        return {"value": None, "mode": mode, "not_run": f"{mode}, replicas = {missing[0]['replicas']}: {missing[0]['not_run']}"}
    r1, r2 = got[1]["samples_per_s"], got[2]["samples_per_s"]
    return {"value": r2 / r1, "mode": mode, "r1_samples_per_s": r1, "r2_samples_per_s": r2}


def run(*, lease_ttl: float, repeats: int, checkpoint_every: int, samples: int, modes: list[str], roles: str, tmp: Path) -> dict[str, Any]:
    from tests.servers import EtcdServer

    folder = Path(tempfile.mkdtemp(prefix="pdps-replicas-", dir=tmp))
    try:
        with EtcdServer() as etcd:
            runs = failover(etcd.url, lease_ttl, repeats, checkpoint_every)
            data = folder / "data"
            write_dataset(data, TRAINERS * samples, ROWS_PER_TASK, 0)
            settings = argparse.Namespace(min_block=MIN_BLOCK, overlap="auto", job_timeout=JOB_TIMEOUT_S, warmup=WARMUP, threads=None, seed=0)
            say(f"throughput, {roles}: {TRAINERS} trainers x {PSERVERS} pservers, {samples} samples per trainer, {', '.join(modes)}")
            rows = [
                throughput(mode, replicas, roles=roles, settings=settings, data=data, out=folder / f"{mode}-r{replicas}", store_url=etcd.url)
                for mode in modes
                for replicas in REPLICAS
            ]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    ttl = float(-(-lease_ttl // 1))  # etcd grants whole seconds
    r1, r2 = (next(r for r in runs if r["replicas"] == k) for k in REPLICAS)
    ratios = {
        "resumed_beyond_ttl": {"value": r2["resumed_s"] - ttl, "resumed_s": r2["resumed_s"], "lease_ttl_s": ttl},
        "resumed_r1_vs_r2": {"value": r1["resumed_s"] / r2["resumed_s"], "r1_s": r1["resumed_s"], "r2_s": r2["resumed_s"]},
        **{f"{mode}_r2_vs_r1": ratio(rows, mode) for mode in modes},
    }
    return {"failover": {"lease_ttl_s": lease_ttl, "lease_ttl_etcd_s": ttl, "runs": runs}, "throughput": rows, "ratios": ratios}


def print_table(report: dict[str, Any]) -> None:
    c = report["config"]
    say("")
    say(f"kill -> training resumed: {KILLED_JOB}, {TRAINERS} trainers, {PSERVERS} pservers, sync, gRPC + etcd, every role a process; "
        f"lease TTL {c['lease_ttl']:g} s; pserver 1 SIGKILLed {c['repeats']} time(s) per replicas")  # fmt: skip
    say(f"{'replicas':>8} {'resumed s (median)':>18} {'each kill s':>24} {'claim gone s':>12} {'failed over s':>13} {'rollbacks':>9} {'rounds retrained':>16}")
    for r in report["failover"]["runs"]:
        m = r["medians_s"]
        say(f"{r['replicas']:>8} {r['resumed_s']:>18.3f} {', '.join(f'{k:.2f}' for k in r['kills_s']):>24} {m.get('claim_gone', float('nan')):>12.3f} "
            f"{m.get('failed_over', float('nan')):>13.3f} {r['rollbacks']:>9} {', '.join(map(str, r['rounds_retrained'])):>16}")  # fmt: skip
    say("(seconds after the SIGKILL, medians of the kills; replicas = 1: resumed when a round of the rolled-back epoch closed; replicas = 2: "
        "when the round after the one under way at the kill closed; rounds retrained: from the checkpoint to the kill, per kill)")  # fmt: skip
    say("")
    say(f"throughput: MLP {'-'.join(map(str, e2e_train.SIZES))}, batch {BATCH}, SGD, {TRAINERS} trainers x {PSERVERS} pservers, {c['roles']}")
    say(f"{'mode':<5} {'replicas':>8} {'samples/s':>10} {'steps/s':>8} {'seconds':>8}")
    for r in report["throughput"]:
        if "not_run" in r:
            say(f"{r['mode']:<5} {r['replicas']:>8}  NOT RUN: {r['not_run']}")
        else:
            say(f"{r['mode']:<5} {r['replicas']:>8} {r['samples_per_s']:>10.0f} {r['steps_per_s']:>8.2f} {r['seconds']:>8.2f}")
    say("")
    for name, r in report["ratios"].items():
        say(f"{name}: " + (f"NOT RUN ({r['not_run']})" if r.get("not_run") else f"{r['value']:.3f}" + (" s" if name == "resumed_beyond_ttl" else "x")))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--lease-ttl", type=float, default=2.0, help="the lease TTL of every job, seconds (default 2; etcd grants whole seconds)")
    p.add_argument("--repeats", type=int, help=f"kills of pserver 1 per replicas (default {FULL['repeats']}, --quick {QUICK['repeats']})")
    p.add_argument("--checkpoint-every", type=int, help=f"sync rounds between checkpoints (default {FULL['checkpoint_every']})")
    p.add_argument("--samples", type=int, help=f"samples per trainer of a throughput configuration (default {FULL['samples']}, --quick {QUICK['samples']})")
    p.add_argument("--modes", nargs="+", choices=("sync", "async"), default=["sync", "async"], help="the throughput rows' modes (default both)")
    roles = p.add_mutually_exclusive_group()
    roles.add_argument("--processes", dest="roles", action="store_const", const="processes", help="throughput: every role a process, pdps launch over gRPC (default, but for --quick)")
    roles.add_argument("--in-process", dest="roles", action="store_const", const="in-process", help="throughput: pdps.simulate over inproc (default of --quick)")
    p.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()), help="where the throughput dataset goes")
    p.add_argument("--quick", action="store_true", help=f"{QUICK['repeats']} kill per replicas, {QUICK['samples']} samples per trainer, {QUICK['roles']}")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout's last line")
    args = p.parse_args(argv)
    preset = QUICK if args.quick else FULL
    repeats, every = args.repeats or preset["repeats"], args.checkpoint_every or preset["checkpoint_every"]
    samples, roles_way = args.samples or preset["samples"], args.roles or preset["roles"]
    if args.lease_ttl <= 0 or repeats < 1 or every < 1 or samples < (WARMUP + 1) * BATCH:
        p.error(f"--lease-ttl, --repeats and --checkpoint-every must be positive, --samples at least {(WARMUP + 1) * BATCH}")
    modes = list(dict.fromkeys(args.modes))
    began = time.monotonic()
    try:
        report = run(lease_ttl=args.lease_ttl, repeats=repeats, checkpoint_every=every, samples=samples, modes=modes, roles=roles_way, tmp=args.tmp)
    except (RuntimeError, TimeoutError, pdps.PdpsError) as exc:
        say(f"bench/replicas.py: {exc}")
        return 1
    report = finish("bench/replicas.py", argv, began,
                    {"lease_ttl": args.lease_ttl, "repeats": repeats, "checkpoint_every": every, "killed_job": KILLED_JOB, "roles": roles_way,
                     "model": "-".join(map(str, e2e_train.SIZES)), "samples_per_trainer": samples, "warmup_steps": WARMUP, "modes": modes,
                     "trainers": TRAINERS, "pservers": PSERVERS, "replicas": list(REPLICAS)},
                    report, packages=("torch", "grpcio"), table=print_table, as_json=args.json)  # fmt: skip
    return 1 if any("not_run" in r for r in report["throughput"] if r["mode"] == "sync") else 0


if __name__ == "__main__":
    raise SystemExit(main())
