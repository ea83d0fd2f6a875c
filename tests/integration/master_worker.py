"""A master in its own OS process, with trainers in the same process, for restart tests.

    python -m tests.integration.master_worker STORE_URL JOB DATASET_URL [--dump FILE]
        [--trainers N] [--task-seconds S] [--lease-ttl S]

It waits for the job's lock (standby), restores the queue, writes what it restored
to ``--dump`` as JSON (pass and records), and then its trainers lease tasks and
report them finished after ``--task-seconds`` each until the job is done. The
trainers speak the master's protocol directly: the test is about the master.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

from pdps.adapters.inproc import InprocTransport
from pdps.adapters.parquet import ParquetSource
from pdps.core.job import JobConfig, Keys
from pdps.ports.transport import Message
from pdps.runtime.lease import LeaseKeeper
from pdps.roles.master import Master
from pdps.registry import connect_store
from pdps.runtime.resilient import ResilientStore


def config_for(job: str, dataset: str, lease_ttl: float) -> JobConfig:
    return JobConfig(name=job, dataset=dataset, lease_ttl=lease_ttl, task_timeout=60.0, passes=1, failure_max=3)


def run_trainer(store, transport, master: Master, trainer_id: str, task_seconds: float) -> None:
    keys = Keys(master.config.name)
    keeper = LeaseKeeper(store, master.config.lease_ttl, name=trainer_id)
    store.put(keys.trainer(trainer_id), b"{}", lease=keeper.lease)
    channel = transport.connect(master.address)
    while True:
        reply = channel.call("get_task", Message({"trainer": trainer_id}))
        if reply.meta.get("done"):
            return
        if "wait" in reply.meta:
            time.sleep(0.02)
            continue
        time.sleep(task_seconds)
        channel.call("finish_task", Message({"trainer": trainer_id, "task": reply.meta["task"]["id"], "attempt": reply.meta["attempt"]}))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("job")
    ap.add_argument("dataset")
    ap.add_argument("--dump")
    ap.add_argument("--trainers", type=int, default=2)
    ap.add_argument("--task-seconds", type=float, default=0.05)
    ap.add_argument("--lease-ttl", type=float, default=2.0)
    args = ap.parse_args()

    config = config_for(args.job, args.dataset, args.lease_ttl)
    store = ResilientStore(connect_store(args.store), deadline=config.store_outage_deadline)
    transport = InprocTransport()
    master = Master(store, transport, ParquetSource(args.dataset), config)
    master.start(standby=True)
    if args.dump:
        dump = {"pass": master.counts().pass_no, "records": None if master.restored is None else [r.to_json() for r in master.restored]}
        with open(args.dump, "w") as f:
            json.dump(dump, f)
    print("LEADING", flush=True)
    threads = [
        threading.Thread(target=run_trainer, args=(store, transport, master, f"t{i}-pid{os.getpid()}", args.task_seconds), daemon=True)
        for i in range(args.trainers)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("DONE" if master.done.is_set() else "NOT DONE", flush=True)
    master.stop()
    return 0 if master.done.is_set() else 1


if __name__ == "__main__":
    sys.exit(main())
