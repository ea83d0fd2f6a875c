"""What a job looks like from the coordination store alone (``pdps status``).

Reads only: no master needs to be running. Counts come from the per-task records
the master persists, read the way a restoring master reads them (a record from an
older pass, or no record, is todo), so the figures are what a master restarted now
would serve.
"""

from __future__ import annotations

from typing import Any

from pdps.core.errors import CorruptRecord, NoSuchJob
from pdps.core.job import JobConfig, Keys, decode_as, decode_json
from pdps.ports.coordination import CoordinationStore
from pdps.roles.master import decode_record


def job_status(store: CoordinationStore, job: str) -> dict[str, Any]:
    """The job's status as one JSON-safe object (the ``pdps status --json`` contract):
    ``job``, ``state``, ``pass``, ``passes``, ``tasks``, ``todo``, ``pending``, ``done``,
    ``failed``, ``quarantined``, ``quarantine`` (key and error of each), ``corrupt``
    (undecodable records not yet quarantined), ``master``, ``trainers``, ``pservers``,
    ``pservers_desired`` and ``checkpoint`` (object or null).
    """
    keys = Keys(job)
    config_kv = store.get(keys.config)
    if config_kv is None:
        raise NoSuchJob(f"job {job!r} does not exist in {store.url} (no {keys.config})")
    config = JobConfig.decode(config_kv.value, keys.config)

    pass_kv = store.get(keys.pass_no)
    pass_no = decode_as(pass_kv.value, keys.pass_no, int) if pass_kv is not None else 0
    state_kv = store.get(keys.state)
    state = decode_as(state_kv.value, keys.state, lambda d: str(d["state"])) if state_kv else "starting"
    queue_kv = store.get(keys.queue)
    total = decode_as(queue_kv.value, keys.queue, lambda d: int(d["tasks"])) if queue_kv else None

    counts = {"pending": 0, "done": 0, "failed": 0}
    corrupt: list[str] = []
    ids = None if total is None else range(total)
    for kv in store.range(keys.tasks):
        try:
            rec = decode_record(kv, keys, pass_no, ids)
        except CorruptRecord:
            corrupt.append(kv.key)
            continue
        if rec.pass_no == pass_no and rec.state.value in counts:
            counts[rec.state.value] += 1
    quarantine = []
    for kv in store.range(keys.quarantine):
        try:
            note = decode_json(kv.value, kv.key)
            quarantine.append({"key": note.get("key", kv.key), "error": note.get("error", "")})
        except CorruptRecord as exc:
            quarantine.append({"key": kv.key, "error": str(exc)})
    busy = sum(counts.values())
    todo = None if total is None else max(0, total - busy)

    pservers = []
    for kv in store.range(keys.pservers):
        try:
            addr = decode_json(kv.value, kv.key).get("addr")
        except (CorruptRecord, AttributeError):
            addr = None
        pservers.append({"index": int(kv.key.rsplit("/", 1)[1]), "address": addr})
    pservers.sort(key=lambda p: p["index"])
    desired_kv = store.get(keys.ps_desired)
    master_kv = store.get(keys.master_addr)
    checkpoint_kv = store.get(keys.checkpoint)
    return {
        "job": job,
        "state": state,
        "pass": pass_no,
        "passes": config.passes,
        "tasks": total,
        "todo": todo,
        "pending": counts["pending"],
        "done": counts["done"],
        "failed": counts["failed"],
        "quarantined": len(quarantine),
        "quarantine": quarantine,
        "corrupt": corrupt,
        "master": master_kv.value.decode(errors="replace") if master_kv else None,
        "trainers": sorted(keys.trainer_id(kv.key) for kv in store.range(keys.trainers)),
        "pservers": pservers,
        "pservers_desired": int(desired_kv.value) if desired_kv else None,
        "checkpoint": decode_json(checkpoint_kv.value, keys.checkpoint) if checkpoint_kv else None,
    }


def format_status(status: dict[str, Any], url: str) -> str:
    """The human-readable form ``pdps status`` prints."""
    s = status
    tasks = "?" if s["tasks"] is None else s["tasks"]
    todo = "?" if s["todo"] is None else s["todo"]
    lines = [
        f"job {s['job']} on {url}: {s['state']}, pass {s['pass'] + 1} of {s['passes']}",
        f"  tasks       {tasks}: todo {todo}, pending {s['pending']}, done {s['done']}, failed {s['failed']}, quarantined {s['quarantined']}",
        f"  master      {s['master'] or 'none'}",
        f"  trainers    {len(s['trainers'])}" + (f": {', '.join(s['trainers'])}" if s["trainers"] else ""),
        f"  pservers    {len(s['pservers'])} of {s['pservers_desired'] if s['pservers_desired'] is not None else '?'}"
        + "".join(f"\n                {p['index']} at {p['address']}" for p in s["pservers"]),
        f"  checkpoint  {s['checkpoint'] if s['checkpoint'] is not None else 'none'}",
    ]
    for q in s["quarantine"]:
        lines.append(f"  quarantined {q['key']}: {q['error']}")
    for key in s["corrupt"]:
        lines.append(f"  corrupt     {key} (a master will quarantine it when it restores)")
    return "\n".join(lines)
