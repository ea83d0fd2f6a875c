"""docs/online.md's examples run as written: each Python block on its own, in order,
with ``PDPS_REDIS`` naming the session's throwaway redis-server and ``PDPS_MODELS`` an
export folder, as the page tells a reader to set them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from pdps import exports

pytestmark = pytest.mark.integration

PAGE = Path(__file__).resolve().parents[2] / "docs" / "online.md"


def sections() -> list[tuple[str, str]]:
    """(heading, code) of every Python block, under the nearest heading above it."""
    out, heading = [], ""
    for part in re.split(r"(^#+ [^\n]*$|```python\n.*?```)", PAGE.read_text(), flags=re.S | re.M):
        if part.startswith("#"):
            heading = part.lstrip("# ").strip()
        elif part.startswith("```python"):
            out.append((heading, part[len("```python\n") : -3]))
    return out


def test_the_page_has_the_examples_it_promises():
    headings = [h for h, _ in sections()]
    assert headings == [
        "In one process: `memory-stream://`",
        "On Redis: `redis-stream://`",
        "Producing records: `pdps.streams.append`",
        "A growing Parquet directory: `?follow=1`",
        "Before the job: `before_job`",
        "Model exports",
        "Loading with the reference safetensors loader",
        "Speculative execution",
    ]


@pytest.mark.parametrize(("heading", "code"), sections(), ids=[h for h, _ in sections()])
def test_each_example_runs(heading, code, redis_server, tmp_path, monkeypatch):
    monkeypatch.setenv("PDPS_REDIS", redis_server.url)
    models = tmp_path.as_uri()
    exports.publish(models, {"weight": torch.ones(2, 3)})
    monkeypatch.setenv("PDPS_MODELS", models)
    exec(compile(code, f"docs/online.md ({heading})", "exec"), {"__name__": "online_docs"})  # noqa: S102 - each example asserts its outcome


def test_no_link_points_to_the_merged_sources_page():
    docs = PAGE.parent
    assert not (docs / "online-sources.md").exists()
    for page in [*docs.glob("*.md"), docs.parent / "README.md"]:
        assert "online-sources.md" not in page.read_text(), page
