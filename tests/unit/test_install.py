"""The environment the README's commands build holds exactly the pinned CPU torch.

A re-resolve during ``pip install -e '.[dev]'`` was seen to swap torch 2.13.0+cpu for a
CUDA build and about 3 GB of ``nvidia-*`` wheels (issue: a clean install). GPU machines
run only ``-m gpu`` tests, so this holds wherever the unit suite runs.
"""

from __future__ import annotations

import importlib.metadata


def test_torch_is_the_pinned_cpu_build_and_no_nvidia_package_is_installed():
    assert importlib.metadata.version("torch") == "2.13.0+cpu"
    nvidia = sorted(d.metadata["Name"] for d in importlib.metadata.distributions() if d.metadata["Name"].lower().startswith("nvidia-"))
    assert nvidia == []
