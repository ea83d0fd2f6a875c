"""What a job looks like from the coordination store alone (``pdps status``).

Reads only: no master needs to be running. Counts come from the per-task records
the master persists, read the way a restoring master reads them (a record from an
older pass, or no record, is todo), so the figures are what a master restarted now
would serve.

``pdps status --pass N`` reads the audit of one pass instead (:func:`pass_audit`):
every attempt at every task, its trainer and outcome, and how many of the dataset's
records were trained, and how many more than once; ``pdps status --window N`` the
same for one window of a streaming job (:func:`window_audit`).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import attrs

from pdps.core.audit import Attempt, Outcome, QueueHeader, decode_attempts, record_counts
from pdps.core.elastic import ResizeState, minimum_bytes
from pdps.core.errors import CorruptRecord, NoSuchJob, NoSuchPass
from pdps.core.headcount import parse_count
from pdps.core.job import JobConfig, Keys, decode_as, decode_json
from pdps.core.tables import TableSpec
from pdps.core.slots import Layout, ParamSpec, SlotMap
from pdps.core.tasks import TaskSpec
from pdps.core.windows import Window
from pdps.ports.coordination import CoordinationStore
from pdps.roles.master import decode_record
from pdps.runtime.resizing import read_resize, resizes_got


def job_config(store: CoordinationStore, job: str) -> JobConfig:
    """The stored configuration of ``job``; :class:`NoSuchJob` when the store has none."""
    keys = Keys(job)
    config_kv = store.get(keys.config)
    if config_kv is None:
        raise NoSuchJob(f"job {job!r} does not exist in {store.url} (no {keys.config})")
    return JobConfig.decode(config_kv.value, keys.config)


def job_state(store: CoordinationStore, keys: Keys) -> str:
    """``running`` or ``done`` as the job's state record says, ``starting`` before it has one."""
    state_kv = store.get(keys.state)
    return decode_as(state_kv.value, keys.state, lambda d: str(d["state"])) if state_kv else "starting"


def job_status(store: CoordinationStore, job: str, *, now: float | None = None) -> dict[str, Any]:
    """The job's status as one JSON-safe object (the ``pdps status --json`` contract):
    ``job``, ``state``, ``pass``, ``passes``, ``tasks``, ``todo``, ``pending``, ``done``,
    ``failed``, ``quarantined``, ``quarantine`` (key and error of each), ``corrupt``
    (undecodable records not yet quarantined), ``master``, ``trainers``, ``pservers``,
    ``pservers_desired``, ``checkpoint`` (the pointer to the latest committed checkpoint:
    ``id``, ``epoch``, ``round``, ``url``, ``created``, ``history`` of ids newest first;
    or null), ``epoch`` (the record of the last rollback: ``epoch``, ``checkpoint``,
    ``round``, ``reason``, ``time``; null if the job never rolled back) and ``waits``
    (one per role waiting longer than a few seconds: ``who``, ``what``, ``for``,
    ``since``, and ``seconds`` it has waited as of ``now``, default the clock's time)
    and ``layout`` (how the model is spread, once a trainer has published it, else
    null: ``blocks``, ``pservers``, ``pservers_holding`` the ones holding part of the
    model, ``idle`` the indices of the others, ``warning``, why some are idle, or
    null, and ``per_pserver``: ``index``, ``slots``, ``blocks`` and ``bytes`` of values
    of each pserver of the live map). For resizing: ``slot_map`` (the live map:
    ``version``, ``pservers``, ``slots``, ``base``; null before the job has one),
    ``trainers_desired`` (the configured count until a resize names one) and
    ``resize`` (the newest resize, see :func:`resize_status`; null if none).
    """
    keys = Keys(job)
    config = job_config(store, job)
    slots_kv = store.get(keys.slotmap)
    slot_map = None if slots_kv is None else decode_as(slots_kv.value, keys.slotmap, SlotMap.from_json)
    layout = model_layout(store, keys, config, slot_map)

    for tries in range(READ_TRIES, 0, -1):
        pass_no, total, stream, counts, corrupt = task_counts(store, keys)
        # a master moving on meanwhile (the next pass, new tasks of a stream) wrote records
        # that look impossible next to the pass and task count read before them: read again
        if tries == 1 or (not corrupt and pass_number(store, keys) == pass_no):
            break
        time.sleep(RETRY_PAUSE)
    state = job_state(store, keys)
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
    master_kv = store.get(keys.master_addr)
    checkpoint_kv = store.get(keys.checkpoint)
    epoch_kv = store.get(keys.epoch)
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
        "pservers_desired": desired_count(store, keys.ps_desired, None),
        "trainers_desired": desired_count(store, keys.trainers_desired, config.trainers),
        "checkpoint": decode_json(checkpoint_kv.value, keys.checkpoint) if checkpoint_kv else None,
        "epoch": decode_json(epoch_kv.value, keys.epoch) if epoch_kv else None,
        "waits": waits(store, keys, time.time() if now is None else now),
        "slot_map": None if slot_map is None else {
            "version": slot_map.version, "pservers": slot_map.num_pservers, "slots": slot_map.num_slots, "base": slot_map.base,
            "replicas": slot_map.replicas, "under_replicated": len(slot_map.under_replicated()),
        },
        "layout": None if layout is None else layout_status(layout),
        "resize": resize_status(store, keys, layout),
        "stream": stream,
        "tables": table_status(store, keys, slot_map),
    }


#: How many times :func:`job_status` reads the pass and its task records while what it
#: reads changes under it (or a record looks corrupt), RETRY_PAUSE seconds apart; a
#: record still corrupt after the last is reported as such.
READ_TRIES = 3
RETRY_PAUSE = 0.1


def pass_number(store: CoordinationStore, keys: Keys) -> int:
    """The job's current pass as stored (0 before it has one)."""
    kv = store.get(keys.pass_no)
    return decode_as(kv.value, keys.pass_no, int) if kv is not None else 0


def task_counts(store: CoordinationStore, keys: Keys) -> tuple[int, int | None, dict[str, Any] | None, dict[str, int], list[str]]:
    """The pass, its number of tasks (None: unknown), the stream (None: not streaming),
    the ``pending``/``done``/``failed`` counts of the pass's task records, and the keys
    of those that cannot be decoded or are impossible in that pass."""
    pass_no = pass_number(store, keys)
    queue_kv = store.get(keys.queue)
    total = decode_as(queue_kv.value, keys.queue, QueueHeader.from_json).tasks if queue_kv else None
    stream = stream_status(store, keys)
    if stream is not None:
        total = stream["tasks"]  # the tasks cut so far
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
    return pass_no, total, stream, counts, corrupt


#: the counters of a table's rows that ``pdps status`` sums over the pservers
TABLE_COUNTERS = ("rows", "bytes", "created", "admitted", "pending", "pending_dropped", "evicted_ttl", "evicted_lfu", "refused")


def table_status(store: CoordinationStore, keys: Keys, slot_map: SlotMap | None) -> list[dict[str, Any]] | None:
    """The model's sparse tables (None: it has none): per table its spec's ``name, dim,
    dtype, rows_bound`` (None: unbounded), the :data:`TABLE_COUNTERS` summed over the
    pservers of the slot map, and ``per_pserver`` (index -> counters, with ``at``: when
    that pserver recorded them)."""
    kv = store.get(keys.model_tables)
    if kv is None:
        return None
    specs = decode_as(kv.value, kv.key, lambda ds: [TableSpec.from_json(d) for d in ds])
    recorded: dict[int, dict[str, Any]] = {}
    for rec in store.range(keys.table_stats_prefix):
        try:
            index = int(rec.key.rsplit("/", 1)[1])
            recorded[index] = decode_json(rec.value, rec.key)
        except (CorruptRecord, ValueError):
            continue
    live = None if slot_map is None else range(slot_map.num_pservers)
    out = []
    for spec in specs:
        per = {
            i: {**{k: int(r.get("tables", {}).get(spec.name, {}).get(k, 0)) for k in TABLE_COUNTERS}, "at": r.get("at")}
            for i, r in sorted(recorded.items())
            if live is None or i in live
        }
        out.append({
            "name": spec.name, "dim": spec.dim, "dtype": spec.dtype, "rows_bound": spec.num_rows,
            **{k: sum(p[k] for p in per.values()) for k in TABLE_COUNTERS},
            "per_pserver": {str(i): p for i, p in per.items()},
        })
    return out


def desired_count(store: CoordinationStore, key: str, unset: int | None) -> int | None:
    """A desired count as stored; ``unset`` when there is none, null when it cannot be read."""
    kv = store.get(key)
    if kv is None:
        return unset
    try:
        return parse_count(kv.value, key)
    except CorruptRecord:
        return None


def model_layout(store: CoordinationStore, keys: Keys, config: JobConfig, slot_map: SlotMap | None) -> Layout | None:
    """How the published model is spread over ``slot_map``, computed as every role
    computes it (from ``model``, the map and ``min_block``); None before a trainer
    has published the model."""
    model_kv = store.get(keys.model)
    if model_kv is None or slot_map is None:
        return None
    specs = decode_as(model_kv.value, keys.model, lambda ds: [ParamSpec.from_json(d) for d in ds])
    return Layout.build(specs, slot_map, config.min_block)


def layout_status(layout: Layout) -> dict[str, Any]:
    """``layout`` of :func:`job_status`: the spread, and each pserver's share of the live map."""
    idle = layout.idle_pservers
    pservers = layout.slot_map.num_pservers
    slot_bytes = layout.slot_bytes()
    per_pserver = [{"index": p, "slots": 0, "blocks": 0, "bytes": 0, "backups": 0, "backup_bytes": 0} for p in range(pservers)]
    for slot, owner in enumerate(layout.slot_map.owners):
        per_pserver[owner]["slots"] += 1
        per_pserver[owner]["bytes"] += slot_bytes[slot]
        for backup in layout.slot_map.backups[slot]:
            per_pserver[backup]["backups"] += 1
            per_pserver[backup]["backup_bytes"] += slot_bytes[slot]
    for i in range(len(layout.blocks)):
        per_pserver[layout.pserver_of(i)]["blocks"] += 1
    return {
        "blocks": len(layout.blocks),
        "pservers": pservers,
        "pservers_holding": pservers - len(idle),
        "idle": list(idle),
        "warning": layout.spread_warning(),
        "per_pserver": per_pserver,
    }


def resize_status(store: CoordinationStore, keys: Keys, layout: Layout | None) -> dict[str, Any] | None:
    """The newest resize and how far it is: ``id``, ``state``, ``pservers``, ``trainers``
    (null: unchanged), ``by``, ``requested``; once planned ``from_version``,
    ``to_version``, ``slots_moving``, ``bytes_moving`` (the values of the moving slots;
    null before a trainer has published the model), ``receivers`` (the pservers that
    receive slots), ``received`` (those that hold them) and ``progress``
    (``"k of n receivers"``), all null before the plan. An undecodable record is
    ``{"error": ...}``: status still shows the rest of the job."""
    try:
        resize, _ = read_resize(store, keys)
    except CorruptRecord as exc:
        return {"error": str(exc)}
    if resize is None:
        return None
    out: dict[str, Any] = {
        "id": resize.id, "state": resize.state.value, "pservers": resize.pservers, "trainers": resize.trainers,
        "by": resize.by, "requested": resize.requested,
        "from_version": None, "to_version": None, "slots_moving": None, "bytes_moving": None,
        "receivers": None, "received": None, "progress": None,
    }  # fmt: skip
    if resize.from_map is None or resize.to_map is None:
        return out
    receivers = resize.receivers()
    # the master drops resize_got/<version>/ as it marks the resize done, when all had reported
    got = receivers if resize.state is ResizeState.DONE else resizes_got(store, keys, resize.to_map.version)
    received = sorted(set(got) & set(receivers))
    moving = None
    if layout is not None:  # a block never changes slot (SlotMap.base), so the live layout's blocks are from_map's too
        moving = minimum_bytes(attrs.evolve(layout, slot_map=resize.from_map), resize.to_map)
    out.update(
        from_version=resize.from_map.version, to_version=resize.to_map.version, slots_moving=len(resize.moves()),
        bytes_moving=moving, receivers=receivers, received=received, progress=f"{len(received)} of {len(receivers)} receivers",
    )
    return out


def waits(store: CoordinationStore, keys: Keys, now: float) -> list[dict[str, Any]]:
    """The ``waits/<who>`` records (trainer.discovery.Waits writes them), oldest wait first, each
    with the ``seconds`` it has lasted at ``now``. A record that cannot be decoded is
    listed with its ``who`` and an ``error`` instead: it expires with its writer's lease."""
    out = []
    for kv in store.range(keys.waits):
        who = kv.key[len(keys.waits) :]
        try:
            rec = decode_json(kv.value, kv.key)
            since = float(rec["since"])
            out.append(
                {
                    "who": str(rec.get("who", who)),
                    "what": str(rec.get("what", "")),
                    "for": [str(w) for w in rec.get("for", [])],
                    "since": since,
                    "seconds": max(0.0, now - since),
                }
            )
        except (CorruptRecord, KeyError, TypeError, ValueError, AttributeError) as exc:
            out.append({"who": who, "what": None, "for": [], "since": None, "seconds": None, "error": str(exc)})
    out.sort(key=lambda w: (w["since"] is None, w["since"] or 0.0, w["who"]))
    return out


def format_status(status: dict[str, Any], url: str) -> str:
    """The human-readable form ``pdps status`` prints."""
    s = status
    tasks = "?" if s["tasks"] is None else s["tasks"]
    todo = "?" if s["todo"] is None else s["todo"]
    lines = [
        f"job {s['job']} on {url}: {s['state']}, pass {s['pass'] + 1} of {s['passes']}",
        f"  tasks       {tasks}: todo {todo}, pending {s['pending']}, done {s['done']}, failed {s['failed']}, quarantined {s['quarantined']}",
        f"  master      {s['master'] or 'none'}",
        f"  trainers    {len(s['trainers'])}" + (f": {', '.join(s['trainers'])}" if s["trainers"] else "") + _wanted(s),
        f"  pservers    {len(s['pservers'])} of {s['pservers_desired'] if s['pservers_desired'] is not None else '?'}"
        + "".join(f"\n                {line}" for line in pserver_lines(s)),
        f"  slot map    {slot_map_text(s.get('slot_map'))}",
        f"  checkpoint  {_pointer_text(s['checkpoint'])}",
        f"  epoch       {epoch_text(s.get('epoch'))}",
        f"  layout      {layout_text(s.get('layout'))}",
    ]
    if s.get("stream"):
        lines[0] = f"job {s['job']} on {url}: {s['state']}, streaming"
        lines.insert(2, f"  stream      {stream_text(s['stream'])}")
    for t in s.get("tables") or ():
        lines.append(f"  table       {table_text(t)}")
    if s.get("resize"):
        lines.append(f"  resize      {resize_text(s['resize'], s['slot_map']['version'] if s.get('slot_map') else None)}")
    if s.get("layout") and s["layout"]["warning"]:
        lines.append(f"  WARNING: {s['layout']['warning']}")
    for q in s["quarantine"]:
        lines.append(f"  quarantined {q['key']}: {q['error']}")
    for key in s["corrupt"]:
        lines.append(f"  corrupt     {key} (a master will quarantine it when it restores)")
    if s.get("waits"):
        lines.append("  waiting:")
        lines += [f"    {wait_text(w)}" for w in s["waits"]]
    return "\n".join(lines)


def table_text(t: dict[str, Any]) -> str:
    """``emb.weight (dim 16 float32): 1,234 rows (80.0 KiB) on 2 pservers; created 1,300, admitted 0, pending 0, evicted 66 (ttl 66, lfu 0), refused 0``."""
    return (
        f"{t['name']} (dim {t['dim']} {t['dtype']}): {t['rows']:,} rows ({size_text(t['bytes'])}) on {len(t['per_pserver'])} pservers; "
        f"created {t['created']:,}, admitted {t['admitted']:,}, pending {t['pending']:,}, "
        f"evicted {t['evicted_ttl'] + t['evicted_lfu']:,} (ttl {t['evicted_ttl']:,}, lfu {t['evicted_lfu']:,}), refused {t['refused']:,}"
    )


def stream_text(st: dict[str, Any]) -> str:
    """``windows: 3 closed, 4 opened; 900 records in 18 tasks; lag: 120 records untasked, 2 tasks (96 records) untrained``."""
    untasked = "?" if st["records_untasked"] is None else st["records_untasked"]
    text = (
        f"windows: {st['windows_closed']} closed, {st['windows']} opened; {st['records']} records in {st['tasks']} tasks; "
        f"lag: {untasked} records untasked, {st['tasks_untrained'] or 0} tasks ({st['records_untrained'] or 0} records) untrained"
    )
    if st.get("ended"):
        text += "; last window sealed"
    if st.get("backpressure"):
        text += "; BACKPRESSURE (stream_max_tasks unfinished tasks)"
    if st.get("stalled"):
        text += f"; stalled: {st['stalled']}"
    if st.get("evaluation"):
        e = st["evaluation"]
        text += f"; evaluation after window {e['window']}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in e["metrics"].items())
    return text


def _wanted(s: dict[str, Any]) -> str:
    want = s.get("trainers_desired")
    return "" if want is None or want == len(s["trainers"]) or s["state"] == "done" else f" ({want} wanted)"


def pserver_lines(s: dict[str, Any]) -> list[str]:
    """One line per pserver, live or in the live map: ``0 at grpc://...: 86 slots,
    1.5 MiB of values``; ``2 not running: ...`` for one the map names but nobody holds."""
    addresses = {p["index"]: p["address"] for p in s["pservers"]}
    shares = {p["index"]: p for p in (s.get("layout") or {}).get("per_pserver", [])}
    mapped = range(s["slot_map"]["pservers"]) if s.get("slot_map") else range(0)
    lines = []
    for i in sorted(set(addresses) | set(mapped)):
        line = f"{i} at {addresses[i]}" if i in addresses else f"{i} not running"
        if i in shares:
            line += f": {shares[i]['slots']} slots, {size_text(shares[i]['bytes'])} of values"
            if shares[i].get("backups"):
                line += f"; backs up {shares[i]['backups']} slots, {size_text(shares[i]['backup_bytes'])}"
        elif s.get("slot_map") and i not in mapped:
            line += ": no slots in the live map"
        lines.append(line)
    return lines


def slot_map_text(m: dict[str, Any] | None) -> str:
    """``version 2: 256 slots on 3 pservers (blocks placed for 2)``."""
    if m is None:
        return "none yet (the master writes it when the job starts)"
    base = "" if m["base"] is None or m["base"] == m["pservers"] else f" (blocks placed for {m['base']})"
    copies = ""
    if m.get("replicas", 1) > 1:
        short = f", {m['under_replicated']} of them with fewer" if m.get("under_replicated") else ""
        copies = f", {m['replicas']} copies of each{short}"
    return f"version {m['version']}: {m['slots']} slots on {m['pservers']} pservers{base}{copies}"


def resize_text(r: dict[str, Any], live_version: int | None) -> str:
    """``<id> to 2 pservers, 4 trainers: migrating, map 1 -> 2, 85 slots (1.2 MiB of
    values) moving, 1 of 2 receivers hold their slots (asked by pdps scale at 10:04:05)``;
    ``last: <id> ...: done`` once done. ``live_version``: the live map's, which a sync
    job switches to ``to_version`` only at the next round boundary."""
    if "error" in r:
        return f"unreadable: {r['error']}"
    trainers = "" if r["trainers"] is None else f", {r['trainers']} trainers"
    line = f"{'last: ' if r['state'] == 'done' else ''}{r['id']} to {r['pservers']} pservers{trainers}: {r['state']}"
    if r["state"] == "migrating" and r["to_version"] is not None:
        moving = "" if r["bytes_moving"] is None else f" ({size_text(r['bytes_moving'])} of values)"
        pending = " (not switched yet)" if live_version is not None and live_version < r["to_version"] else ""
        line += f", map {r['from_version']} -> {r['to_version']}{pending}, {r['slots_moving']} slots{moving} moving, {r['progress']} hold their slots"
    return line + f" (asked by {r['by'] or 'an operator'} at {clock(r['requested'])})"


def size_text(n: int) -> str:
    """``512 bytes``, ``1.5 KiB``, ``64.0 MiB``, ``1.0 GiB``."""
    if n < 1024:
        return f"{n} bytes"
    size, unit = n / 1024, "KiB"
    for bigger in ("MiB", "GiB"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    return f"{size:.1f} {unit}"


def clock(t: float | None) -> str:
    """A unix time as the local time of day (``10:04:05``), as the roles log it."""
    return "?" if t is None else time.strftime("%H:%M:%S", time.localtime(t))


def wait_text(w: dict[str, Any]) -> str:
    """``t1 has waited 12s (since 10:04:05) for t0 (the barrier of round 92)``: the
    words of the waiter's own log line."""
    if w.get("error"):
        return f"{w['who']}: undecodable wait record ({w['error']})"
    whom = ", ".join(w["for"]) or "nobody known"
    return f"{w['who']} has waited {w['seconds']:.0f}s (since {clock(w['since'])}) for {whom} ({w['what']})"


def layout_text(layout: dict[str, Any] | None) -> str:
    """``20 blocks on 3 of 3 pservers``, or that no trainer has published the model yet."""
    if layout is None:
        return "none yet (no trainer has attached a model)"
    n = layout["blocks"]
    return f"{n} block{'s' if n != 1 else ''} on {layout['pservers_holding']} of {layout['pservers']} pservers"


def _pointer_text(ptr: Any) -> str:
    if ptr is None:
        return "none"
    if not isinstance(ptr, dict) or "id" not in ptr:
        return str(ptr)
    text = str(ptr["id"])
    if "epoch" in ptr and "round" in ptr:
        text += f" (epoch {ptr['epoch']}, round {ptr['round']}"
        text += f", taken at {clock(ptr['created'])})" if isinstance(ptr.get("created"), (int, float)) else ")"
    if isinstance(ptr.get("history"), list):
        text += f", {len(ptr['history'])} kept"
    return text


def epoch_text(rec: Any) -> str:
    """The epoch record of the last rollback in words: ``1, from ckpt-... (round 8) at
    10:04:05: operator: pdps checkpoint restore``, or ``0 (never rolled back)``."""
    if rec is None:
        return "0 (never rolled back)"
    if not isinstance(rec, dict) or "epoch" not in rec:
        return str(rec)
    start = f"from {rec['checkpoint']} (round {rec.get('round', '?')})" if rec.get("checkpoint") else "from scratch"
    when = f" at {clock(rec['time'])}" if isinstance(rec.get("time"), (int, float)) else ""
    reason = f": {rec['reason']}" if rec.get("reason") else ""
    return f"{rec['epoch']}, {start}{when}{reason}"


def pass_audit(store: CoordinationStore, job: str, pass_no: int) -> dict[str, Any]:
    """The audit of pass ``pass_no`` as one JSON-safe object (the ``pdps status --pass N
    --json`` contract).

    ``job``, ``pass``, ``tasks``, ``records`` (the dataset's, or null for a job started
    before record counts were kept), ``entries`` (one per task, by id: ``task``,
    ``records``, ``attempts`` [{``attempt``, ``trainer``, ``outcome``, and ``offset``
    (its first record) / ``applied`` (the record it had trained up to when it ended) /
    ``late_finish`` when set}], ``outcome`` of the task in the pass: done, failed,
    pending or todo, ``trained``: its attempts that trained records, and
    ``record_counts``: how many times each of its records was trained, as runs
    ``[count, length]`` in record order), ``summary`` (``done``, ``failed``, ``pending``,
    ``todo``, ``records_trained``: records trained at least once,
    ``records_trained_more_than_once``,
    ``attempts_total``) and ``corrupt`` (audit keys of the pass that could not be
    decoded, or were quarantined: those tasks' attempts are incomplete).

    Raises :class:`NoSuchJob` for an unknown job and :class:`NoSuchPass` for a pass
    the job has not reached, or one that has no audit, and :class:`CorruptRecord` naming
    a chunk of the dataset's record counts (``queue/records/<k>``) that is missing or
    changed (the job's master rewrites it from the dataset).
    """
    keys = Keys(job)
    config = job_config(store, job)
    pass_kv = store.get(keys.pass_no)
    current = decode_as(pass_kv.value, keys.pass_no, int) if pass_kv is not None else None
    if store.get(keys.stream) is not None:
        raise NoSuchPass(f"job {job!r} reads a stream: it has windows, not passes (pdps status --window N)")
    if current is None:
        raise NoSuchPass(f"job {job!r} has not started its first pass (pass 0) yet")
    if not 0 <= pass_no <= current:
        raise NoSuchPass(f"job {job!r} has no pass {pass_no}: passes 0..{current} exist so far (of {config.passes})")
    queue_kv = store.get(keys.queue)
    header = decode_as(queue_kv.value, keys.queue, QueueHeader.from_json) if queue_kv else None
    total = None if header is None else header.tasks
    chunks = {kv.key: kv.value for kv in store.range(keys.queue_records)} if header and header.chunks else {}
    records = None if header is None else header.counts(chunks, keys)

    attempts: dict[int, tuple[Attempt, ...]] = {}
    corrupt: list[str] = []
    for kv in store.range(keys.audit_pass(pass_no)):
        try:
            attempts[keys.task_id(kv.key)] = decode_attempts(kv.value, kv.key)
        except (CorruptRecord, ValueError):
            corrupt.append(kv.key)
    for kv in store.range(keys.quarantined_audit(pass_no)):
        try:
            corrupt.append(str(decode_json(kv.value, kv.key).get("key", kv.key)))
        except (CorruptRecord, AttributeError):
            corrupt.append(kv.key)
    if pass_no < current and not attempts and not corrupt:
        raise NoSuchPass(f"job {job!r} has no audit of pass {pass_no}: a pdps that kept no audit ran it (passes 0..{current} exist)")

    if records is not None:
        ids = set(records)
    else:
        ids = set(range(total)) if total is not None else set()
    ids |= set(attempts)
    outcomes = _final_outcomes(store, keys, pass_no, current, ids)
    entries, summary = _audited(ids, attempts, records, outcomes, finished=pass_no < current)
    return {
        "job": job,
        "pass": pass_no,
        "tasks": len(entries),
        "records": sum(records.values()) if records is not None else None,
        "entries": entries,
        "summary": summary,
        "corrupt": corrupt,
    }


def _audited(
    ids: set[int], attempts: dict[int, tuple[Attempt, ...]], records: dict[int, int] | None, outcomes: dict[int, str], *, finished: bool
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The audit ``entries`` of tasks ``ids`` and their ``summary`` (see :func:`pass_audit`)."""
    entries = []
    for tid in sorted(ids):
        tried = attempts.get(tid, ())
        outcome = outcomes.get(tid) or _outcome_of(tried, finished=finished)
        n = None if records is None else records.get(tid)
        entries.append(
            {
                "task": tid,
                "records": n,
                "attempts": [a.to_json() for a in tried],
                "outcome": outcome,
                "trained": sum(a.trained for a in tried),
                "record_counts": None if n is None else record_counts(tried, n),
            }
        )
    summary: dict[str, Any] = {k: sum(e["outcome"] == k for e in entries) for k in ("done", "failed", "pending", "todo")}
    known = records is not None

    def records_counted(at_least: int) -> int | None:
        return sum(length for e in entries for count, length in e["record_counts"] or () if count >= at_least) if known else None

    once, more = records_counted(1), records_counted(2)
    summary["records_trained"] = once
    summary["records_trained_more_than_once"] = more
    summary["records_trained_exactly_once"] = None if once is None or more is None else once - more
    summary["attempts_total"] = sum(len(e["attempts"]) for e in entries)
    return entries, summary


def window_audit(store: CoordinationStore, job: str, window_no: int) -> dict[str, Any]:
    """The audit of window ``window_no`` of a streaming job as one JSON-safe object (the
    ``pdps status --window N --json`` contract): ``job``, ``window``, ``state`` (open,
    sealed or closed), ``first_task``/``last_task`` (its task ids), ``tasks``,
    ``records``, ``opened_at``/``sealed_at``/``closed_at`` (Unix seconds or null),
    ``entries`` and ``summary`` as :func:`pass_audit` gives them (the summary also has
    ``records_trained_exactly_once``), and ``corrupt``.

    Raises :class:`NoSuchJob` for an unknown job and :class:`NoSuchPass` for a window
    the job has not opened (or a job that is not streaming).
    """
    keys = Keys(job)
    config = job_config(store, job)
    kv = store.get(keys.window(window_no)) if window_no >= 0 else None
    if kv is None:
        opened = len(store.range(keys.windows))
        if store.get(keys.stream) is None:
            raise NoSuchPass(f"job {job!r} reads no stream ({config.dataset}): it has passes, not windows (pdps status --pass N)")
        raise NoSuchPass(f"job {job!r} has no window {window_no}: windows 0..{opened - 1} exist so far" if opened else f"job {job!r} has opened no window yet")
    window = decode_as(kv.value, kv.key, Window.from_json)
    attempts: dict[int, tuple[Attempt, ...]] = {}
    records: dict[int, int] = {}
    corrupt: list[str] = []
    outcomes: dict[int, str] = {}
    for tid in window.tasks:
        for key, into in ((keys.audit_entry(0, tid), "audit"), (keys.spec(tid), "spec"), (keys.task(tid), "task")):
            got = store.get(key)
            if got is None:
                continue
            try:
                if into == "audit":
                    attempts[tid] = decode_attempts(got.value, key)
                elif into == "spec":
                    records[tid] = decode_as(got.value, key, TaskSpec.from_json).records
                else:
                    rec = decode_record(got, keys, 0)
                    outcomes[tid] = rec.state.value
            except (CorruptRecord, ValueError):
                corrupt.append(key)
    entries, summary = _audited(set(window.tasks), attempts, records, outcomes, finished=window.state == "closed")
    return {
        "job": job,
        "window": window.no,
        "state": window.state,
        "first_task": window.first,
        "last_task": window.end - 1,
        "tasks": len(window.tasks),
        "records": window.records,
        "opened_at": window.opened_at,
        "sealed_at": window.sealed_at,
        "closed_at": window.closed_at,
        "entries": entries,
        "summary": summary,
        "corrupt": corrupt,
    }


def stream_status(store: CoordinationStore, keys: Keys) -> dict[str, Any] | None:
    """A streaming job's ``stream`` in ``pdps status --json`` (null for a job with passes):
    ``cursor``, ``tasks`` (cut so far), ``records`` (tasked so far), ``ended`` (the job's
    last window is sealed: no more tasks are cut), ``windows`` (opened so far),
    ``windows_closed``, ``records_untasked`` (arrived, not cut into tasks yet; null if
    the source cannot tell), ``tasks_untrained`` and ``records_untrained`` (tasked,
    not trained yet), ``backpressure`` (the master holds ``stream_max_tasks``
    unfinished tasks and cuts no more), ``stalled`` (why arrived data is not cut, or
    null), ``lag_at`` (when the master measured this, Unix seconds) and ``evaluation``
    (the newest evaluation: ``window``, ``metrics``, ``updates``, ``at``; or null).

    A job that is done has nothing tasked left to train, whatever the master measured
    last (it measures about once a second, and may stop between the last tasks' end
    and its next measure)."""
    kv = store.get(keys.stream)
    if kv is None:
        return None
    pos = decode_json(kv.value, kv.key)
    lag_kv = store.get(keys.stream_lag)
    lag = decode_json(lag_kv.value, lag_kv.key) if lag_kv else {}
    if job_state(store, keys) == "done":
        lag = dict(lag, tasks_untrained=0, records_untrained=0, backpressure=False)
    windows = store.range(keys.windows)
    closed = 0
    for w in windows:
        with contextlib.suppress(CorruptRecord):
            closed += decode_json(w.value, w.key).get("closed_at") is not None
    evals = store.range(keys.evals)
    return {
        "cursor": pos.get("cursor"),
        "tasks": pos.get("next_id"),
        "records": pos.get("records"),
        "ended": pos.get("ended"),
        "windows": len(windows),
        "windows_closed": closed,
        "records_untasked": lag.get("records_untasked"),
        "tasks_untrained": lag.get("tasks_untrained"),
        "records_untrained": lag.get("records_untrained"),
        "backpressure": lag.get("backpressure"),
        "stalled": lag.get("stalled"),
        "lag_at": lag.get("at"),
        "evaluation": decode_json(evals[-1].value, evals[-1].key) if evals else None,
    }


def format_window_audit(audit: dict[str, Any], url: str) -> str:
    """The human-readable form ``pdps status --window N`` prints."""
    text = format_pass_audit(dict(audit, **{"pass": audit["window"]}), url)
    head, _, rest = text.partition("\n")
    head = f"job {audit['job']} on {url}: audit of window {audit['window']} ({audit['state']}; tasks {audit['first_task']}..{audit['last_task']})"
    return head + "\n" + rest


def _final_outcomes(store: CoordinationStore, keys: Keys, pass_no: int, current: int, ids: set[int]) -> dict[int, str]:
    """How each task stands in ``pass_no``: from the task records for the current pass,
    from the pass summary for a finished one (what is missing is left out)."""
    if pass_no == current:
        out = {}
        for kv in store.range(keys.tasks):
            try:
                rec = decode_record(kv, keys, current)
            except CorruptRecord:
                continue  # pdps status lists it; the audit stands in for it
            out[rec.id] = rec.state.value if rec.pass_no == current else "todo"
        return out
    summary_kv = store.get(keys.pass_summary(pass_no))
    if summary_kv is None:
        return {}
    failed = set(decode_as(summary_kv.value, summary_kv.key, lambda d: [int(t) for t in d["failed"]]))
    return {tid: "failed" if tid in failed else "done" for tid in ids | failed}


def _outcome_of(attempts: tuple[Attempt, ...], *, finished: bool) -> str:
    """A task's outcome from its attempts alone (its record or pass summary is missing)."""
    if any(a.outcome is Outcome.DONE for a in attempts):
        return "done"
    if attempts and attempts[-1].outcome is Outcome.PENDING:
        return "pending"
    return "failed" if finished else "todo"


def format_pass_audit(audit: dict[str, Any], url: str) -> str:
    """The human-readable form ``pdps status --pass N`` prints."""
    a, s = audit, audit["summary"]
    rows = [("task", "records", "outcome", "attempts")]
    for e in a["entries"]:
        tries = " ".join(_attempt_text(t) for t in e["attempts"]) or "-"
        rows.append((str(e["task"]), "?" if e["records"] is None else str(e["records"]), e["outcome"], tries))
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"job {a['job']} on {url}: audit of pass {a['pass']}"]
    lines += [f"  {r[0]:>{w[0]}}  {r[1]:>{w[1]}}  {r[2]:<{w[2]}}  {r[3]}" for r in rows]
    if s["records_trained"] is None:
        trained = "record counts unknown"
    else:
        trained = f"{s['records_trained']} of {a['records']} records trained, {s['records_trained_more_than_once']} more than once"
    lines.append(
        f"  {a['tasks']} tasks: done {s['done']}, failed {s['failed']}, pending {s['pending']}, todo {s['todo']}; "
        f"{trained}; {s['attempts_total']} attempts"
    )
    for key in a["corrupt"]:
        lines.append(f"  corrupt  {key}: undecodable or quarantined, the attempts of its task are incomplete")
    return "\n".join(lines)


def _attempt_text(t: dict[str, Any]) -> str:
    """``1:trainer-a:timeout``, plus ``+late_finish``, ``@offset`` (where it began) and
    ``..applied`` (where it ended without finishing) when set."""
    text = f"{t['attempt']}:{t['trainer'] or '?'}:{t['outcome']}"
    if t.get("late_finish"):
        text += "+late_finish"
    if t.get("offset"):
        text += f"@{t['offset']}"
    if t.get("applied") is not None and t["outcome"] != "done":
        text += f"..{t['applied']}"
    return text
