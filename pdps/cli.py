"""The ``pdps`` command line.

``pdps demo`` trains the digits MLP in one process through :func:`pdps.simulate`.
Progress goes to stderr; with ``--json`` the last line of stdout is one JSON object.

``pdps status STORE_URL`` shows a job as the coordination store holds it.

Exit codes: 0 success, 1 the job does not exist, 2 any other pdps error.
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

from pdps.core.errors import NoSuchJob, PdpsError
from pdps.core.job import DEFAULT_JOB

DEMO_DEFAULTS = {"passes": 30, "batch_size": 32, "optimizer": "Adam", "lr": 0.001}


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
        default="WARNING",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level for pdps's own messages (default: %(default)s)",
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
    return parser


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
    summary = {
        "accuracy": round(acc, 6),
        "mode": args.mode,
        "trainers": args.trainers,
        "pservers": args.pservers,
        "passes": result.passes,
        "tasks_done": result.tasks_done,
        "tasks_failed": result.tasks_failed,
        "steps": result.steps,
        "seconds": round(result.seconds, 3),
    }
    print(
        f"held-out accuracy {acc:.4f} after {result.passes} passes, {result.steps} updates, "
        f"{result.tasks_done} tasks done, {result.tasks_failed} failed, in {result.seconds:.1f}s",
        file=sys.stderr,
    )
    if args.json:
        print(json.dumps(summary))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return int(args.func(args))
    except PdpsError as exc:
        print(f"pdps: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
