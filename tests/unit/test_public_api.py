"""The names ``pdps`` exports: every documented error importable, ``import pdps`` light."""

from __future__ import annotations

import builtins
import re
import subprocess
import sys
from pathlib import Path

import pdps
from pdps.core import errors

USER_GUIDE = Path(__file__).resolve().parents[2] / "docs" / "user-guide.md"


def documented_errors() -> set[str]:
    """Every backticked capitalized name (``PdpsError``, ``Timeout``) in the user guide's
    Errors section, but Python's own (``ValueError``: what a pdps error also is)."""
    text = USER_GUIDE.read_text()
    section = re.search(r"^## Errors\n(.*?)(?=^## )", text, re.S | re.M)
    assert section, "docs/user-guide.md has no '## Errors' section"
    return set(re.findall(r"`(?:pdps\.)?([A-Z][A-Za-z0-9]*)`", section.group(1))) - set(dir(builtins))


def exported_errors() -> set[str]:
    return {name for name in pdps.__all__ if isinstance(getattr(pdps, name), type) and issubclass(getattr(pdps, name), Exception)}


def test_every_documented_error_is_exported_and_every_exported_error_is_documented():
    documented = documented_errors()
    assert {"PdpsError", "StoreUnavailable", "CorruptRecord", "NoSuchJob", "NoSuchPass"} <= documented
    assert documented - set(pdps.__all__) == set(), "documented but not in pdps.__all__"
    assert exported_errors() - documented == set(), "exported but not in the user guide's Errors section"
    for name in documented:
        assert issubclass(getattr(pdps, name), pdps.PdpsError), name
        namespace: dict = {}
        exec(f"from pdps import {name}", namespace)  # noqa: S102 - the import a user writes
        assert namespace[name] is getattr(pdps, name)


def test_every_error_class_of_the_hierarchy_is_exported():
    hierarchy = {name for name, value in vars(errors).items() if isinstance(value, type) and issubclass(value, pdps.PdpsError)}
    assert hierarchy - set(pdps.__all__) == set()


def test_all_and_dir_list_the_same_names_and_each_resolves():
    assert len(pdps.__all__) == len(set(pdps.__all__))
    assert set(pdps.__all__) <= set(dir(pdps))
    for name in pdps.__all__:
        assert getattr(pdps, name) is not None, name


def test_an_unknown_name_is_an_attribute_error():
    try:
        pdps.simulte  # noqa: B018
    except AttributeError as exc:
        assert "simulte" in str(exc)
    else:
        raise AssertionError("pdps.simulte resolved")


def in_a_fresh_process(*lines: str) -> None:
    """Run ``import sys; import pdps`` then ``lines`` in a new interpreter; they must pass."""
    code = "\n".join(["import sys", "import pdps", *lines, "print('ok')"])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_import_pdps_does_not_import_torch_until_a_name_needs_it():
    in_a_fresh_process(
        "from pdps import ConfigError, JobConfig, NoSuchJob, open_store",
        "assert 'torch' not in sys.modules, 'import pdps imported torch'",
        "from pdps import simulate, TrainerContext",
        "assert pdps.Killed is not None",
    )


def test_the_public_submodules_are_reached_after_a_plain_import_pdps():
    """docs/online.md and docs/sparse.md write ``pdps.streams.append``, ``pdps.nn.HashEmbedding``,
    ``pdps.exports``: after ``import pdps`` alone, as a fresh process has it."""
    in_a_fresh_process(
        "assert 'pdps.streams' not in sys.modules and 'pdps.nn' not in sys.modules",
        "assert {'nn', 'streams', 'exports'} <= set(dir(pdps))",
        "assert callable(pdps.streams.append) and pdps.nn.HashEmbedding and pdps.exports.__name__ == 'pdps.exports'",
        "import pdps.nn",
        "assert pdps.nn is sys.modules['pdps.nn']",
    )
