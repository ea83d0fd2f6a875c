"""The ``pdps`` command line.

``pdps demo`` trains the digits MLP in one process through :func:`pdps.simulate`.
Progress goes to stderr; with ``--json`` the last line of stdout is one JSON object.

``pdps status STORE_URL`` shows a job as the coordination store holds it.

``pdps master``, ``pdps pserver`` and ``pdps trainer TARGET`` run one role as this
process; ``pdps launch TARGET`` runs a whole job on this machine. Their settings
come from a TOML file, ``PDPS_*`` variables and flags (:mod:`pdps.settings`).

Exit codes: 0 success, 1 the job does not exist (status) or the training function
raised (trainer), 2 any other pdps error, 3 a role lost its lease or lock (restart it).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from pdps.core.errors import ConfigError, NoSuchJob, PdpsError
from pdps.core.job import DEFAULT_JOB

from pdps.examples.digits import JOB_DEFAULTS as DEMO_DEFAULTS


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _version() -> str:
    from pdps import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
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
        help="train an MLP on scikit-learn's digits, in one process",
        description="Train a 64-128-10 MLP on scikit-learn's bundled digits (80/20 stratified split) "
        "with a master, M pservers and N trainers simulated in this process.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    demo.add_argument("--trainers", type=_positive_int, default=3, help="number of trainers (N)")
    demo.add_argument("--pservers", type=_positive_int, default=2, help="number of parameter servers (M)")
    demo.add_argument("--mode", choices=["sync", "async"], default="sync", help="sync-SGD (barrier) or async-SGD")
    demo.add_argument("--passes", type=_positive_int, default=DEMO_DEFAULTS["passes"], help="passes over the training data")
    demo.add_argument("--seed", type=int, default=0, help="seed of the train/held-out split")
    demo.add_argument("--batch-size", type=_positive_int, default=DEMO_DEFAULTS["batch_size"], help="mini-batch size per trainer")
    demo.add_argument("--optimizer", default=DEMO_DEFAULTS["optimizer"], help="torch.optim rule the pservers apply")
    demo.add_argument("--lr", type=float, default=DEMO_DEFAULTS["lr"], help="learning rate")
    demo.add_argument("--push-every", type=_positive_int, default=1, help="async: push every n mini-batches")
    demo.add_argument("--pull-every", type=_positive_int, default=1, help="async: pull every m mini-batches")
    demo.add_argument("--json", action="store_true", help="print the summary as one JSON object on the last line of stdout")
    demo.set_defaults(func=cmd_demo)

    status = sub.add_parser(
        "status",
        help="show a job's queues, pass, members and latest checkpoint",
        description="Read a job's state from its coordination store: queue counts, pass, live trainers "
        "and pservers, the latest checkpoint, and quarantined task records. No master needs to run.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    status.add_argument("store", metavar="STORE_URL", help="coordination store, e.g. etcd://127.0.0.1:2379 or redis://127.0.0.1:6379/0")
    status.add_argument("--job", default=DEFAULT_JOB, help="job name")
    status.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    status.add_argument("--connect-timeout", type=float, default=10.0, help="seconds to keep retrying an unreachable store")
    status.set_defaults(func=cmd_status)

    from pdps import settings

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
    for name, (short, long) in roles.items():
        p = sub.add_parser(name, help=short, description=long + " Settings: TOML file < PDPS_* environment < flags.")
        settings.add_flags(p, name, skip=("target",))
        if name in ("trainer", "launch"):
            p.add_argument("target", metavar="TARGET", nargs="?", default=argparse.SUPPRESS, help="module:function or path/to/file.py:function")
        p.set_defaults(func=globals()[f"cmd_{name}"], role=True)
    return parser


def _settings(args: argparse.Namespace, defaults: dict | None = None) -> dict:
    from pdps import settings

    given = {k: v for k, v in vars(args).items() if k in settings.BY_NAME or k == "config"}
    return settings.resolve(args.command, given, defaults=defaults)


def cmd_master(args: argparse.Namespace) -> int:
    from pdps.process import run_master

    return run_master(args.values)


def cmd_pserver(args: argparse.Namespace) -> int:
    from pdps.process import run_pserver

    return run_pserver(args.values)


def cmd_trainer(args: argparse.Namespace) -> int:
    from pdps.process import run_trainer

    return run_trainer(args.values)


def cmd_launch(args: argparse.Namespace) -> int:
    from pdps.launch import launch
    from pdps.process import load_target

    values = args.values
    if not values.get("target"):
        raise ConfigError("pdps launch needs a training function: TARGET (module:function or path/to/file.py:function)")
    _, module = load_target(values["target"])
    defaults = getattr(module, "JOB_DEFAULTS", None)
    if defaults:
        values = _settings(args, defaults=dict(defaults))  # the module's defaults, under file, env and flags
    return launch(values)


def cmd_status(args: argparse.Namespace) -> int:
    from pdps.roles.resilient import connect_store
    from pdps.status import format_status, job_status

    store = connect_store(args.store, timeout=args.connect_timeout)
    try:
        status = job_status(store, args.job)
    except NoSuchJob as exc:
        print(f"pdps: {exc}", file=sys.stderr)
        return 1
    finally:
        store.close()
    print(json.dumps(status) if args.json else format_status(status, args.store))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    import pdps
    from pdps.examples import digits
    from pdps.launch import describe, summary

    workdir = Path(tempfile.mkdtemp(prefix="pdps-demo-"))
    try:
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
            digits.train,
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
        acc = digits.accuracy(result.params, x_test, y_test)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    s = summary(
        {
            "mode": args.mode,
            "trainers": args.trainers,
            "pservers": args.pservers,
            "passes": result.passes,
            "tasks_done": result.tasks_done,
            "tasks_failed": result.tasks_failed,
            "steps": result.steps,
            "seconds": result.seconds,
        },
        {"accuracy": acc},
    )
    print(describe(s), file=sys.stderr)
    if args.json:
        print(json.dumps(s))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    try:
        if getattr(args, "role", False):
            from pdps.launch import die_with_launcher

            die_with_launcher()
            args.values = _settings(args)
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
