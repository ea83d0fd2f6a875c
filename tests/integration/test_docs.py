"""The docs' runnable examples run, and say what the code does."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def test_user_guide_example_runs(capsys):
    blocks = python_blocks(DOCS / "user-guide.md")
    assert blocks, "the user guide has no runnable example"
    namespace: dict = {"__name__": "user_guide_example"}
    exec(compile("\n".join(blocks), "docs/user-guide.md", "exec"), namespace)  # the example asserts its own outcome
    assert "accuracy" in capsys.readouterr().out
    assert namespace["result"].tasks_failed == 0


def test_readme_example_runs(tmp_path, monkeypatch):
    blocks = python_blocks(DOCS.parent / "README.md")
    assert blocks, "the README has no runnable example"
    monkeypatch.chdir(tmp_path)  # it writes data/train where it runs
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    result = namespace["result"]
    assert result.tasks_failed == 0 and result.tasks_done >= 40  # 4 shards x 10 row groups, every pass
    assert sorted(result.params) == ["0.bias", "0.weight", "2.bias", "2.weight"]


def test_user_guide_lists_every_job_setting():
    import attrs

    from pdps.core.job import JobConfig

    text = (DOCS / "user-guide.md").read_text()
    missing = [f.name for f in attrs.fields(JobConfig) if f"`{f.name}`" not in text and f.name != "dataset"]
    assert not missing, f"settings not documented in docs/user-guide.md: {missing}"


def test_operations_guide_lists_every_role_setting():
    from pdps.shell.settings import SETTINGS

    text = (DOCS / "operations.md").read_text()
    missing = []
    for s in SETTINGS:
        names = [s.name, s.env] + ([s.flag] if s.name != "target" else [])  # TARGET is positional
        missing += [n for n in names if f"`{n}`" not in text]
    assert not missing, f"settings not documented in docs/operations.md: {missing}"


def test_graph_guide_example_runs():
    blocks = python_blocks(DOCS / "graph.md")
    assert blocks, "docs/graph.md has no runnable example"
    exec(compile("\n".join(blocks), "docs/graph.md", "exec"), {"__name__": "graph_example"})  # it asserts its own outcome
