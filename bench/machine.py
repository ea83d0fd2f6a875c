"""What machine a benchmark ran on, and the report a program ends with: shared by the programs in bench/."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any


def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def describe(*packages: str, **extra: Any) -> dict[str, Any]:
    """CPU count and model, Python and platform, the named packages' versions, and ``extra``."""
    model = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    out: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    out.update(extra)
    out.update({name.replace("-", "_"): package_version(name) for name in packages})
    return out


def finish(
    script: str,
    argv: Sequence[str] | None,
    began: float,
    config: Mapping[str, Any],
    body: Mapping[str, Any],
    *,
    packages: Sequence[str],
    table: Callable[[dict[str, Any]], None],
    as_json: bool,
    loadavg_start: Sequence[float] | None = None,
) -> dict[str, Any]:
    """The report ``script`` (``bench/NAME.py``) ends ``main()`` with, printed and returned.

    Its keys, in this order: ``config``, those of ``body``, ``machine`` (``describe(*packages)``),
    ``loadavg_start`` and ``loadavg_end`` (now) when ``loadavg_start`` is given, ``command``
    (``python script`` and ``argv``, ``sys.argv[1:]`` when None) and ``total_s`` (since the
    ``time.monotonic()`` reading ``began``). ``table`` prints it for people; with ``as_json`` it is
    also printed as one JSON object on a line of its own, the last of stdout.
    """
    report: dict[str, Any] = {"config": dict(config), **body, "machine": describe(*packages)}
    if loadavg_start is not None:
        report["loadavg_start"] = list(loadavg_start)
        report["loadavg_end"] = list(os.getloadavg())
    report["command"] = shlex.join(["python", script, *(argv if argv is not None else sys.argv[1:])])
    report["total_s"] = time.monotonic() - began
    table(report)
    if as_json:
        print(json.dumps(report))
    return report
