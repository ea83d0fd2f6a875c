"""docs/sparse.md's examples run as written: each Python block on its own, in order,
as a reader would paste it. The page's memory formula is also checked against what
the pserver's row store reports it holds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration

PAGE = Path(__file__).resolve().parents[2] / "docs" / "sparse.md"


def sections() -> list[tuple[str, str]]:
    """(heading, code) of every Python block, under the nearest heading above it."""
    out, heading = [], ""
    for part in re.split(r"(^#+ [^\n]*$|```python\n.*?```)", PAGE.read_text(), flags=re.S | re.M):
        if part.startswith("#"):
            heading = part.lstrip("# ").strip()
        elif part.startswith("```python"):
            out.append((heading, part[len("```python\n") : -3]))
    return out


def run(heading: str, code: str) -> dict:
    namespace: dict = {"__name__": "sparse_docs"}
    exec(compile(code, f"docs/sparse.md ({heading})", "exec"), namespace)  # noqa: S102 - each example asserts its outcome
    return namespace


def test_the_page_has_the_examples_it_promises():
    assert [h for h, _ in sections()] == [
        "Quick start",
        "What becomes a table",
        "Rows, slots and initial values",
        "The same start for single-process torch",
        "Row rules",
        "Admission and eviction",
        "Bad input",
        "Watching tables: `pdps status`",
        "Memory per row",
        "The CTR example",
    ]


@pytest.mark.parametrize(("heading", "code"), sections(), ids=[h for h, _ in sections()])
def test_each_example_runs(heading, code):
    run(heading, code)


@pytest.mark.parametrize(
    ("rule", "args", "state", "options", "bookkeeping"),
    [
        ("SGD", {}, (), {}, ()),
        ("Adagrad", {}, (8 * 4,), {}, ()),
        ("RowWiseAdagrad", {}, (4,), {}, ()),
        ("SparseAdam", {}, (8 * 4, 8 * 4), {}, ()),
        ("SparseAdam", {"row_steps": True}, (8 * 4, 8 * 4, 8), {}, ()),
        ("SGD", {}, (), {"capacity": 10**6}, (4, 8)),
        ("SGD", {}, (), {"ttl_seconds": 60.0}, (4, 8, 8)),
    ],
)
def test_the_memory_formula_is_what_a_row_store_holds(rule, args, state, options, bookkeeping):
    from pdps.adapters.torch_rows import TorchRows
    from pdps.core.tables import TableSpec

    formula = run("Memory per row", dict(sections())["Memory per row"])["table_bytes"]
    slots = 16
    store = TorchRows(TableSpec(name="emb.weight", dim=8, **options), rule, args, range(slots), slots)
    n = 70_000  # past the first doublings of the mappings
    store.apply(torch.arange(n), torch.zeros(n, 8))  # async: no staging buffer
    got = store.stats()
    assert got["rows"] == n
    assert got["bytes"] == formula(n, 8, state=state, bookkeeping=bookkeeping) + slots  # one byte per slot besides


def test_the_guides_link_the_page():
    docs = PAGE.parent
    for page in (docs.parent / "README.md", docs / "user-guide.md", docs / "architecture.md"):
        assert "sparse.md" in page.read_text(), page
    architecture = (docs / "architecture.md").read_text()
    assert "`model_tables`" in architecture and "`table_stats/<i>`" in architecture
