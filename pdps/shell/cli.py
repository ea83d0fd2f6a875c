"""The ``pdps`` command line.

``pdps demo`` trains the digits MLP in one process through :func:`pdps.simulate`.
Progress goes to stderr; with ``--json`` the last line of stdout is one JSON object.

``pdps status STORE_URL`` shows a job as the coordination store holds it; with
``--pass N``, the audit of pass N (every attempt at every task and its outcome);
``--window N``, the same for window N of a streaming job.

``pdps checkpoint list|inspect|restore`` lists a job's checkpoints, verifies one
part by part, or rolls the running job back to one (:mod:`pdps.shell.checkpoint_cli`).

``pdps bench`` runs the benchmark programs of the source checkout's ``bench/``, checks
the performance targets and regenerates ``docs/performance.md`` (:mod:`pdps.shell.benchmark`).

``pdps master``, ``pdps pserver`` and ``pdps trainer TARGET`` run one role as this
process; ``pdps launch TARGET`` runs a whole job on this machine. Their settings
come from a TOML file, ``PDPS_*`` variables and flags (:mod:`pdps.shell.settings`).

Exit codes: 0 success, 1 the job (or, with ``--pass``, that pass) does not exist
(status, checkpoint), the checkpoint does not exist, fails verification (checkpoint
inspect) or may not be restored (checkpoint restore), or the training function raised
(trainer), 2 any other pdps error, 3 a role lost its lease or lock (restart it).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from pdps.core.errors import ConfigError, CorruptCheckpoint, NoSuchJob, PdpsError, StorageError
from pdps.core.job import DEFAULT_JOB

from pdps.examples.ctr import JOB_DEFAULTS as CTR_DEFAULTS
from pdps.examples.digits import JOB_DEFAULTS as DEMO_DEFAULTS


def _whole_number(minimum: int, what: str, hint: str = ""):
    """An argparse type: an int of at least ``minimum``, with messages naming ``what``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}{hint}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{what} must be at least {minimum}{hint}, got {value}")
        return value

    return parse


_positive_int = _whole_number(1, "a whole number")
# pdps scale's counts: any whole number here; pdps.scale refuses one out of bounds (exit 1, naming the bound)
_count = _whole_number(-sys.maxsize, "a whole number")
def _seconds(text: str) -> float:
    """An argparse type: seconds, 0 or more (``--connect-timeout -1`` is refused, not read as "give up at once")."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"seconds must be 0 or more, got {text}")
    return value


_pass_number = _whole_number(0, "a pass number", " (0 is the first pass)")
_window_number = _whole_number(0, "a window number", " (0 is the first window)")


def _version() -> str:
    from pdps import __version__

    return __version__


def build_parser(argv: Sequence[str] = (), env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The parser of ``argv`` in ``env`` (os.environ by default), which decide whether the
    role commands require ``--store`` and TARGET on the command line."""
    parser = argparse.ArgumentParser(prog="pdps", description="Parameter-server distributed training for torch.")
    parser.add_argument("--version", action="version", version=f"pdps {_version()}")
    parser.add_argument(
        "--log-level",
        default=argparse.SUPPRESS,
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level for pdps's own messages (default: WARNING; INFO for roles and launch)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo",
        help="train an example model in one process (digits MLP, or a CTR model with a sparse table)",
        description="Train an example with a master, M pservers and N trainers simulated in this process: "
        "'digits' (default), a 64-128-10 MLP on scikit-learn's bundled digits (80/20 stratified split), "
        "reporting held-out accuracy; 'ctr', a click model whose embedding table lives on the pservers "
        "(pdps.examples.ctr: 20,000 synthetic Zipf-distributed clicks), reporting held-out AUC. "
        "Training settings default to the example's own.",
        formatter_class=_ExampleDefaults,
    )
    demo.add_argument("--example", choices=["digits", "ctr"], default="digits", help="which example to train")
    demo.add_argument("--trainers", type=_positive_int, default=3, help="number of trainers (N)")
    demo.add_argument("--pservers", type=_positive_int, default=2, help="number of parameter servers (M)")
    demo.add_argument("--mode", choices=["sync", "async"], default="sync", help="sync-SGD (barrier) or async-SGD")
    demo.add_argument("--passes", type=_positive_int, default=None, help=f"passes over the training data (default: {DEMO_DEFAULTS['passes']} for digits, {CTR_DEFAULTS['passes']} for ctr)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the train/held-out split")
    demo.add_argument("--batch-size", type=_positive_int, default=None, help=f"mini-batch size per trainer (default: {DEMO_DEFAULTS['batch_size']} for digits, {CTR_DEFAULTS['batch_size']} for ctr)")
    demo.add_argument("--optimizer", default=None, help=f"torch.optim rule the pservers apply (default: {DEMO_DEFAULTS['optimizer']} for digits, {CTR_DEFAULTS['optimizer']} for ctr)")
    demo.add_argument("--lr", type=float, default=None, help=f"learning rate (default: {DEMO_DEFAULTS['lr']} for digits, {CTR_DEFAULTS['lr']} for ctr)")
    demo.add_argument("--push-every", type=_positive_int, default=1, help="async: push every n mini-batches")
    demo.add_argument("--pull-every", type=_positive_int, default=1, help="async: pull every m mini-batches")
    demo.add_argument("--json", action="store_true", help="print the summary as one JSON object on the last line of stdout")
    demo.set_defaults(func=cmd_demo)

    status = sub.add_parser(
        "status",
        help="show a job's queues, pass, members and latest checkpoint",
        description="Read a job's state from its coordination store: queue counts, pass, live trainers "
        "and pservers, the latest checkpoint, and quarantined task records; with --pass N, the audit of "
        "that pass instead. No master needs to run.",
    )
    _add_store_arguments(status)
    status.add_argument(
        "--pass",
        dest="pass_no",
        metavar="N",
        type=_pass_number,
        default=None,
        help="show the audit of pass N (0 is the first): every attempt at every task, its trainer and outcome, "
        "and how many records were trained",
    )
    status.add_argument(
        "--window",
        dest="window_no",
        metavar="N",
        type=_window_number,
        default=None,
        help="a streaming job: show the audit of window N (0 is the first): every attempt at every task of "
        "the window, and how many of its records were trained exactly once",
    )
    status.set_defaults(func=cmd_status, parser=status)

    scale = sub.add_parser(
        "scale",
        help="resize a running job: more or fewer pservers and trainers",
        description="Ask a running job for other pserver and/or trainer counts. The desired counts go into the "
        "store with a resize record; the job's master moves the slots live (docs/elasticity.md). One resize at a "
        "time: while one is in progress this is refused, naming it, unless --wait. A job that is done is not resized (exit 1).",
    )
    _add_store_arguments(scale)
    scale.add_argument("--pservers", type=_count, default=None, metavar="M", help="pservers the job should run")
    scale.add_argument("--trainers", type=_count, default=None, metavar="N", help="trainers the job should run")
    scale.add_argument("--wait", action="store_true", help="queue behind a resize in progress, and wait until this one is done")
    scale.add_argument("--timeout", type=_seconds, default=None, metavar="SECONDS", help="with --wait: give up after this long")
    scale.set_defaults(func=cmd_scale, parser=scale)

    checkpoint = sub.add_parser(
        "checkpoint",
        help="list a job's checkpoints, verify one, or roll the job back to one",
        description="A job's coordinated checkpoints: which exist (the coordination store) and whether their "
        "files are sound (the checkpoint storage, at the job's checkpoint_url unless --storage names it). "
        "Exit status: 0; 1 when the job or checkpoint does not exist, inspect finds a problem, or restore refuses; "
        "2 for any other error (a store or storage that cannot be reached).",
    )
    actions = checkpoint.add_subparsers(dest="action", required=True, metavar="{list,inspect,restore}")
    about = {
        "list": ("every checkpoint of the job, newest first", "List every checkpoint of the job, newest first: those "
                 "the store knows (latest, committed, or writing: announced and not committed) and folders only the "
                 "storage holds (orphan), under the job's current epoch."),
        "inspect": ("a checkpoint's manifest, each part verified", "Show checkpoint ID (default: the latest committed): "
                    "its epoch, round and parts, each part read back in full and checked against its size and crc32 "
                    "checksum. Exits 1 when any part (or the manifest) is unusable, like fsck."),
        "restore": ("roll the running job back to a checkpoint", "Roll the running job back to checkpoint ID (default: "
                    "the newest committed checkpoint whose every part verifies) by starting a new epoch in the store. "
                    "Every role follows the new epoch by itself: pservers reload their parts of the checkpoint, the "
                    "master reloads its queue from it, and trainers drop the step in flight and re-fetch the "
                    "parameters. Updates made since the checkpoint are lost. Refused (exit 1, nothing changed) for a job "
                    "that is done, a checkpoint that is not committed (unless --force) and one that fails verification."),
    }
    for action, (short, long) in about.items():
        p = actions.add_parser(action, help=short, description=long)
        _add_store_arguments(p)
        if action != "list":
            which = "the latest committed" if action == "inspect" else "the newest committed one that verifies"
            p.add_argument("ckpt_id", metavar="ID", nargs="?", help=f"checkpoint id, ckpt-<epoch>-<round>-<hex> (default: {which})")
        p.add_argument("--storage", metavar="URL", help="checkpoint storage to read (default: the job's checkpoint_url), "
                       "e.g. when this machine reaches the bucket by another URL")
        if action == "restore":
            p.add_argument("--force", action="store_true", help="restore a checkpoint that is not committed (an orphan, "
                           "or one whose commit never landed) if its files verify")
        p.set_defaults(func=cmd_checkpoint, parser=p)

    _add_bench_parser(sub)

    from pdps.shell import settings

    roles = {
        "master": ("serve a job's task queue (creates the job if the store has none)", "Serve the job's task queue: "
                   "take the master lock (or stand by until it is free), restore the queue from the store, and exit when "
                   "the last pass is done."),
        "pserver": ("hold a slice of the parameters and apply the optimizer", "Claim a pserver index, serve init/push/pull "
                    "for the blocks of its slots, until SIGTERM."),
        "trainer": ("run a training function against a job", "Run TARGET (module:function or path/to/file.py:function) "
                    "with a TrainerContext until the job is done or SIGTERM."),
        "launch": ("run a whole job on this machine, one process per role", "Create the job, start a master, M pservers and "
                   "N trainers running TARGET as processes, restart roles that die, and report how the job ended."),
    }
    required = _required_on_command_line(argv, os.environ if env is None else env)
    for name, (short, long) in roles.items():
        p = sub.add_parser(name, help=short, description=long + " Settings: TOML file < PDPS_* environment < flags.")
        settings.add_flags(p, name, skip=("target",), required=required)
        if name in ("trainer", "launch"):
            optional = {} if "target" in required else {"nargs": "?", "default": argparse.SUPPRESS}
            p.add_argument("target", metavar="TARGET", help="module:function or path/to/file.py:function", **optional)
        p.set_defaults(func=globals()[f"cmd_{name}"], role=True)
    return parser


def _required_on_command_line(argv: Sequence[str], env: Mapping[str, str]) -> set[str]:
    """The role settings argparse must find on the command line: ``store`` and ``target``,
    unless a ``PDPS_*`` variable or a settings file may give them (``settings.resolve``
    then checks that one did)."""
    from pdps.shell import settings

    # --config as argparse reads it: --config FILE, --config=FILE, or --conf..., the prefixes no other flag shares
    flags = {a.split("=", 1)[0] for a in argv}
    if settings.ENV_PREFIX + "CONFIG" in env or any(f.startswith("--conf") and "--config".startswith(f) for f in flags):
        return set()
    return {name for name in ("store", "target") if settings.BY_NAME[name].env not in env}


def _add_bench_parser(sub: argparse._SubParsersAction) -> None:
    from pdps.shell.benchmark.targets import SUITES

    bench = sub.add_parser(
        "bench",
        help="run the benchmarks of the checkout's bench/, check the targets, regenerate docs/performance.md",
        description="Run the benchmark suites (programs in the source checkout's bench/), each --runs times in a row, "
        "judge the performance targets, write every figure as JSON and regenerate docs/performance.md with its plots. "
        "The suites run replace theirs in the earlier results, which keep the others (--fresh: only this run's). "
        "Exit status, judging only the suites run now: 0 when they ran (with --check: and every target of theirs is met), "
        "1 when one failed to run or, with --check, one of their targets is missed, 2 for any other error (no bench/ directory).",
    )
    bench.add_argument("--suite", dest="suites", action="append", choices=SUITES, metavar="NAME",
                       help=f"a suite to run, may be given several times ({', '.join(SUITES)}; default: all, in this order)")
    bench.add_argument("--check", action="store_true", help="exit 1 when a target of the suites run is missed (one line per such target either way)")
    bench.add_argument("--runs", type=_positive_int, default=2, help="consecutive runs of each suite (default: %(default)s; "
                       "stability needs 2)")
    bench.add_argument("--quick", action="store_true", help="small configurations, for development: figures not comparable "
                       "with the targets")
    bench.add_argument("--out", type=Path, metavar="DIR", default=None,
                       help="where to write results.json (default: docs/performance/ in the checkout, beside the plots; with --no-docs bench-results/)")
    bench.add_argument("--no-docs", dest="docs", action="store_false",
                       help="do not regenerate docs/performance.md and docs/performance/*.png")
    bench.add_argument("--fresh", action="store_true",
                       help="do not keep the suites of the earlier results; write only this run's (default: the suites "
                       "run now replace theirs in the earlier results.json, the others are kept)")
    bench.add_argument("--timeout", type=float, default=1800.0, metavar="SECONDS",
                       help="stop a suite's run after this long and count it failed (default: %(default)s)")
    bench.set_defaults(func=cmd_bench)


def _add_store_arguments(p: argparse.ArgumentParser) -> None:
    """How the commands that read a job (status, checkpoint) are told where it is."""
    p.add_argument(
        "store", metavar="STORE_URL", nargs="?", help="coordination store, e.g. etcd://127.0.0.1:2379 or redis://127.0.0.1:6379/0"
    )
    p.add_argument("--store", dest="store_flag", metavar="URL", help="the same, as the role commands take it")
    p.add_argument("--job", default=DEFAULT_JOB, help="job name (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument(
        "--connect-timeout", type=_seconds, default=10.0, help="seconds to keep retrying an unreachable store (default: %(default)s)"
    )


def _store_url(args: argparse.Namespace) -> str:
    """The store named by STORE_URL or --store (a parser error when none, or two differ)."""
    if args.store and args.store_flag and args.store != args.store_flag:
        args.parser.error(f"two stores given: STORE_URL {args.store!r} and --store {args.store_flag!r}")
    url = args.store or args.store_flag
    if not url:
        args.parser.error("a coordination store is required: STORE_URL or --store URL")
    return url


def _settings(args: argparse.Namespace, defaults: dict | None = None) -> dict:
    from pdps.shell import settings

    given = {k: v for k, v in vars(args).items() if k in settings.BY_NAME or k == "config"}
    return settings.resolve(args.command, given, defaults=defaults)


def cmd_master(args: argparse.Namespace) -> int:
    from pdps.shell.process import run_master

    return run_master(args.values)


def cmd_pserver(args: argparse.Namespace) -> int:
    from pdps.shell.process import run_pserver

    return run_pserver(args.values)


def cmd_trainer(args: argparse.Namespace) -> int:
    from pdps.shell.process import run_trainer

    return run_trainer(args.values)


def cmd_launch(args: argparse.Namespace) -> int:
    from pdps.shell.launch import launch
    from pdps.shell.process import load_target

    values = args.values
    if not values.get("target"):
        raise ConfigError("pdps launch needs a training function: TARGET (module:function or path/to/file.py:function)")
    _, module = load_target(values["target"])
    defaults = getattr(module, "JOB_DEFAULTS", None)
    if defaults:
        values = _settings(args, defaults=dict(defaults))  # the module's defaults, under file, env and flags
    return launch(values)


def cmd_status(args: argparse.Namespace) -> int:
    url = _store_url(args)  # before the imports below, which load torch
    from pdps.registry import connect_store
    from pdps.shell.status import format_pass_audit, format_status, format_window_audit, job_status, pass_audit, window_audit

    if args.pass_no is not None and args.window_no is not None:
        args.parser.error("give --pass N or --window N, not both")
    store = connect_store(url, timeout=args.connect_timeout)
    try:
        if args.window_no is not None:
            status = window_audit(store, args.job, args.window_no)
        elif args.pass_no is None:
            status = job_status(store, args.job)
        else:
            status = pass_audit(store, args.job, args.pass_no)
    except NoSuchJob as exc:  # NoSuchPass too
        print(f"pdps: {exc}", file=sys.stderr)
        return 1
    finally:
        store.close()
    if args.json:
        print(json.dumps(status))
    else:
        if args.window_no is not None:
            print(format_window_audit(status, url))
        else:
            print(format_status(status, url) if args.pass_no is None else format_pass_audit(status, url))
    return 0


def cmd_scale(args: argparse.Namespace) -> int:
    url = _store_url(args)
    from pdps.core.errors import ConfigError, Timeout
    from pdps.shell.scale import scale

    if args.pservers is None and args.trainers is None:
        args.parser.error("name --pservers, --trainers, or both")

    def show(record: dict) -> None:
        if not args.json:
            print(f"resize {record['id']}: {record['state']}", file=sys.stderr, flush=True)

    try:
        record = scale(url, job=args.job, pservers=args.pservers, trainers=args.trainers, wait=args.wait, timeout=args.timeout, progress=show)
    except (NoSuchJob, ConfigError, Timeout) as exc:  # ResizeInProgress is a ConfigError
        print(f"pdps: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(record))
    else:
        print(f"resize {record['id']} of job {args.job!r} to {record['pservers']} pservers"
              + (f", {record['trainers']} trainers" if record.get("trainers") is not None else "") + f": {record['state']}")
    return 0


def cmd_checkpoint(args: argparse.Namespace) -> int:
    if args.action != "list" and args.store and "://" not in args.store:
        # one positional that is no URL is the ID: `inspect ID --store URL`
        if args.ckpt_id is not None:
            args.parser.error(f"STORE_URL {args.store!r} is not a URL (etcd://host:port, redis://host:port/db)")
        args.store, args.ckpt_id = None, args.store
    url = _store_url(args)  # before the imports below, which load torch
    from pdps.shell import checkpoint_cli as ckpt
    from pdps.registry import connect_store
    from pdps.shell.status import job_config

    store = connect_store(url, timeout=args.connect_timeout)
    storage = None
    try:
        config = job_config(store, args.job)
        storage = ckpt.open_job_storage(config, args.storage)
        if args.action == "list":
            result = ckpt.list_checkpoints(store, storage, args.job)
            text = ckpt.format_list(result, url)
        elif args.action == "inspect":
            result = ckpt.inspect_checkpoint(store, storage, args.job, args.ckpt_id)
            text = ckpt.format_inspection(result, url)
        else:
            result = ckpt.restore(store, storage, args.job, args.ckpt_id, force=args.force)
            text = ckpt.format_restore(result, url)
    except (NoSuchJob, ckpt.RestoreRefused) as exc:  # NoSuchCheckpoint too
        print(f"pdps: {exc}", file=sys.stderr)
        return 1
    except StorageError as exc:
        if isinstance(exc, CorruptCheckpoint) or storage is None:
            raise
        hint = "" if args.storage else " (if this machine reaches it by another URL, give --storage URL)"
        raise StorageError(f"cannot read checkpoint storage {storage.url}{hint}: {exc}") from exc
    finally:
        store.close()
    print(json.dumps(result) if args.json else text)
    return 1 if args.action == "inspect" and not result["sound"] else 0


def cmd_bench(args: argparse.Namespace) -> int:
    from pdps.shell.benchmark.runner import run_bench
    from pdps.shell.benchmark.targets import SUITES

    return run_bench(
        suites=args.suites or SUITES,
        runs=args.runs,
        quick=args.quick,
        check=args.check,
        out_dir=args.out.resolve() if args.out else None,
        docs=args.docs,
        argv=args.argv,
        timeout=args.timeout,
        fresh=args.fresh,
    )


class _ExampleDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except where the example chooses them (None: the help says)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def cmd_demo(args: argparse.Namespace) -> int:
    import pdps
    from pdps.examples import ctr, digits
    from pdps.shell.launch import describe, summary

    example = ctr if args.example == "ctr" else digits
    defaults = example.JOB_DEFAULTS
    for name in ("passes", "batch_size", "optimizer", "lr"):
        if getattr(args, name) is None:
            setattr(args, name, defaults[name])
    workdir = Path(tempfile.mkdtemp(prefix="pdps-demo-"))
    try:
        if example is ctr:
            dataset, held = ctr.prepare(workdir.as_uri(), seed=args.seed)
        else:
            dataset, x_test, y_test = digits.prepare(workdir.as_uri(), seed=args.seed)
        total_tasks = len(pdps.open_data_source(dataset).tasks())
        last_line = [""]

        def progress(p: dict) -> None:
            losses = [m["loss"] for m in p["metrics"].values() if m.get("loss") == m.get("loss") and "loss" in m]
            loss = f"{sum(losses) / len(losses):.4f}" if losses else "-"
            line = f"pass {p['pass'] + 1}/{args.passes}  tasks {p['done'] + p['failed']}/{total_tasks}  loss {loss}"
            if line != last_line[0]:
                print(line, file=sys.stderr, flush=True)
                last_line[0] = line

        result = pdps.simulate(
            example.train,
            dataset=dataset,
            trainers=args.trainers,
            pservers=args.pservers,
            mode=args.mode,
            passes=args.passes,
            batch_size=args.batch_size,
            optimizer=args.optimizer,
            optimizer_args={"lr": args.lr},
            push_every=args.push_every,
            pull_every=args.pull_every,
            progress=progress,
        )
        if example is ctr:
            metrics = {"auc": ctr.evaluate(result.params, held)["auc"]}
        else:
            metrics = {"accuracy": digits.accuracy(result.params, x_test, y_test)}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    s = summary(
        {
            "example": args.example,
            "mode": args.mode,
            "trainers": args.trainers,
            "pservers": args.pservers,
            "passes": result.passes,
            "tasks_done": result.tasks_done,
            "tasks_failed": result.tasks_failed,
            "steps": result.steps,
            "seconds": result.seconds,
        },
        metrics,
    )
    print(describe(s), file=sys.stderr)
    if args.json:
        print(json.dumps(s))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    args.argv = argv  # as typed, for reports (pdps bench)
    fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    try:
        if getattr(args, "role", False):
            from pdps.shell.launch import die_with_launcher

            die_with_launcher()
            args.values = _settings(args)
            if args.command != "launch":
                from pdps.shell.process import check_shared

                check_shared(args.command, args.values)
            logging.basicConfig(level=args.values["log_level"], format=fmt, stream=sys.stderr)
        else:
            logging.basicConfig(level=getattr(args, "log_level", "WARNING"), format=fmt, stream=sys.stderr)
        return int(args.func(args))
    except PdpsError as exc:
        print(f"pdps: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
