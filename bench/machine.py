"""What machine a benchmark ran on: shared by the programs in bench/ for their reports."""

from __future__ import annotations

import contextlib
import os
import platform
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
